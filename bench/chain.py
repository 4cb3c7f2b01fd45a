"""How long and how right the full cache is on chain prompts: the measurement that sets the `chain` task's size.

    python bench/chain.py --model smollm2-135m-instruct --n 8 --batch 4
    python bench/chain.py --model qwen2.5-coder-0.5b-instruct --n 8 --batch 4

Greedy, full cache, ``stop_at_eos=True``, held-out (test split) prompts decoded in left-padded batches (each row
exactly as alone). Prints per prompt the generated tokens, whether it hit the cap, per-problem and final-answer
accuracy, then the median and mean generated tokens and the per-problem accuracy with a 95% Wilson interval (and a
bootstrap over prompts, since a prompt's problems are not independent). ``--out FILE`` writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from learnkv import generate, load_model  # noqa: E402
from learnkv.cli import thread_count  # noqa: E402
from learnkv.chains import problem_kind  # noqa: E402
from learnkv.decode import encode_prompts  # noqa: E402
from learnkv.eval.tasks.chain import count_by_kind, grade_chain  # noqa: E402
from learnkv.prompts import load_prompts  # noqa: E402


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion k / n."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def bootstrap(per_prompt: list[tuple[int, int]], reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of pooled accuracy, resampling prompts (correct, total)."""
    rng = random.Random(seed)
    stats = []
    for _ in range(reps):
        draw = [rng.choice(per_prompt) for _ in per_prompt]
        stats.append(sum(c for c, _ in draw) / max(1, sum(t for _, t in draw)))
    stats.sort()
    return stats[int(0.025 * reps)], stats[int(0.975 * reps) - 1]


def chain_tokens(tokenizer, text: str, n_problems: int) -> int | None:
    """Tokens of the completion up to the end of its ``Answer {n_problems}:`` line (None if it never gets there):
    how long the chain itself is, whatever the model writes after it."""
    at = text.find(f"Answer {n_problems}:")
    if at < 0:
        return None
    end = text.find("\n", at)
    return len(tokenizer(text[: len(text) if end < 0 else end], add_special_tokens=False)["input_ids"])


def kind_counts(meta: dict, parsed: list[str | None]) -> dict[str, list[int]]:
    """(correct, graded) per kind of problem: ``linked`` (uses an earlier answer, maybe a fact too), ``fact``
    (a fact only), ``alone`` (neither) (`learnkv.eval.tasks.chain.count_by_kind`)."""
    kinds = [problem_kind(d, f) for d, f in zip(meta["depends"], meta["facts"])]
    by_kind = count_by_kind(parsed, list(meta["answers"]), kinds, meta["given"])
    return {kind: list(by_kind[kind]) for kind in ("alone", "fact", "linked")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--n", type=int, default=8, help="held-out prompts")
    p.add_argument("--start", type=int, default=0,
                   help="skip this many held-out prompts (to split a run over processes)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=1536)
    p.add_argument("--n-problems", type=int, default=None)
    p.add_argument("--n-facts", type=int, default=None)
    p.add_argument("--linked-share", type=float, default=None,
                   help="share of linked problems (learnkv.chains.LINKED_SHARE by default)")
    p.add_argument("--fact-share", type=float, default=None,
                   help="share of fact-only problems (learnkv.chains.FACT_SHARE by default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--split", default="test")
    p.add_argument("--threads", type=thread_count, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    kw = {k: v for k, v in (("n_problems", args.n_problems), ("n_facts", args.n_facts),
                            ("linked_share", args.linked_share), ("fact_share", args.fact_share)) if v is not None}
    prompts = load_prompts("chain", args.start + args.n, seed=args.seed, split=args.split, **kw)[args.start:]
    rows, t0 = [], time.perf_counter()
    for i in range(0, len(prompts), args.batch):
        batch = prompts[i: i + args.batch]
        ids, mask = encode_prompts(tok, [q.text for q in batch], reply_prefixes=[q.meta["response_prefix"] for q in batch])
        r = generate(model, tok, input_ids=ids, attention_mask=mask, max_new_tokens=args.max_new_tokens,
                     stop_at_eos=True, progress=True)
        for q, n, text in zip(batch, r.new_tokens, r.texts):
            g = grade_chain(text, q.meta["answers"], given=q.meta["given"])
            row = {"id": q.id, "generated_tokens": n, "capped": n >= args.max_new_tokens,
                   "correct": g["correct"], "n_problems": g["graded"], "final": g["final_correct"],
                   "answered": g["answered"], "kinds": kind_counts(q.meta, g["parsed"]),
                   "chain_tokens": chain_tokens(tok, text, len(q.meta["answers"])),
                   "text": text}
            rows.append(row)
            print(f"{q.id}: {n} tokens{' (cap)' if row['capped'] else ''}, the last problem answered at "
                  f"{row['chain_tokens']}, {row['correct']}/{row['n_problems']} "
                  f"right, {row['answered']} answered, final {'right' if row['final'] else 'wrong'}", flush=True)
    elapsed = time.perf_counter() - t0
    lengths = [r["generated_tokens"] for r in rows]
    k, n = sum(r["correct"] for r in rows), sum(r["n_problems"] for r in rows)
    lo, hi = wilson(k, n)
    blo, bhi = bootstrap([(r["correct"], r["n_problems"]) for r in rows])
    finals = sum(r["final"] for r in rows)
    summary = {
        "model": args.model, "n_prompts": len(rows), "max_new_tokens": args.max_new_tokens,
        "median_generated_tokens": statistics.median(lengths), "mean_generated_tokens": statistics.mean(lengths),
        "min_generated_tokens": min(lengths), "capped": sum(r["capped"] for r in rows),
        "median_chain_tokens": statistics.median([r["chain_tokens"] or 0 for r in rows]),
        "reached_last_problem": sum(r["chain_tokens"] is not None for r in rows),
        "per_problem_accuracy": k / n, "wilson95": [lo, hi], "bootstrap95": [blo, bhi],
        "by_kind": {kind: [sum(r["kinds"][kind][i] for r in rows) for i in (0, 1)]
                    for kind in ("alone", "fact", "linked")},
        "final_accuracy": finals / len(rows), "final_wilson95": list(wilson(finals, len(rows))),
        "seconds": round(elapsed), "threads": args.threads, "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(summary))
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
