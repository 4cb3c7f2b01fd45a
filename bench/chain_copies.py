"""Does a policy's model copy each chain problem's statement, and how much of it did the prefill keep? (exploratory)

    python bench/chain_copies.py --model qwen2.5-coder-0.5b-instruct --policy learned \
        --scorer docs/results/train-qwen/round-1/scorer --prefill-policy learned --budget 601 --prompt chain/s0/94

Before it works a chain problem the model copies its ``Problem k: ...`` line from the prompt. For one held-out chain
prompt (test split, seed 0) this decodes the policy freely at a budget in tokens (with ``--prefill-policy``
compressing the prompt first, as `evaluate.py` does) and reports per graded problem: the share of its statement's
prompt tokens that the prefill kept (mean over layers and KV heads: the cache right after the prefill), whether the
model's own ``Problem k:`` line equals the prompt's (``copied``, ``miscopied``, or ``missing``: never written), and
whether its answer is right (graded as the chain task grades). A look at one decode, not a table.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from learnkv.eval import make_task  # noqa: E402
from learnkv.eval.diagnose import lines_of, token_pieces  # noqa: E402
from learnkv.eval.tasks.base import RunConfig  # noqa: E402
from learnkv.eval.tasks.chain import grade_chain  # noqa: E402
from learnkv.eval.tasks.fidelity import kept_positions  # noqa: E402

_HEADER = re.compile(r"^\W*Problem (\d+): (.*)$")
#: held-out prompts searched for ``--prompt`` (the tables use the first 32)
SEARCHED = 64


def statements(text: str) -> dict[int, str]:
    """Each ``Problem k:`` line's statement in ``text`` (the first one where a number repeats)."""
    out: dict[int, str] = {}
    for line in text.splitlines():
        if (m := _HEADER.match(line)) and int(m.group(1)) not in out:
            out[int(m.group(1))] = m.group(2).strip()
    return out


def kept_per_statement(held: torch.Tensor, pieces: list[str], prompt_len: int) -> dict[int, float]:
    """Per ``Problem k:`` line of the prompt's problem list, the share of its tokens in ``held`` (``[layers, H_kv,
    T]`` positions, -1 for an empty slot), averaged over layers and heads. The reply's solved problems repeat the
    headers; the first occurrence (the problem list) is the one counted."""
    kept = torch.zeros(*held.shape[:2], prompt_len + 1, dtype=torch.bool)
    kept.scatter_(2, torch.where((held >= 0) & (held < prompt_len), held, prompt_len), True)
    share = kept[..., :prompt_len].float().mean(dim=(0, 1))
    line = lines_of(pieces)
    by_line: dict[int, list[int]] = {}
    for p in range(prompt_len):
        by_line.setdefault(line[p], []).append(p)
    out: dict[int, float] = {}
    for positions in by_line.values():
        m = _HEADER.match("".join(pieces[p] for p in positions).strip())
        if m and int(m.group(1)) not in out:
            out[int(m.group(1))] = float(share[positions].mean())
    return out


def look(model, tokenizer, prompt_id: str, policy: str, params: dict, budget: int, prefill: str | None,
         slack: int = 64, max_new_tokens: int | None = None, block_size: int | None = None) -> dict:
    """The per-problem report of one prompt (the module docstring); ``block_size``: block granularity."""
    options = {} if max_new_tokens is None else {"max_new_tokens": max_new_tokens}
    if block_size:
        options.update(granularity="block", block_size=block_size)
    task = make_task("chain", accuracy_only=True, **options)
    sample = next((s for s in task.load(tokenizer, SEARCHED, 0) if s.id == prompt_id), None)
    if sample is None:
        raise ValueError(f"{prompt_id!r} is not among the first {SEARCHED} held-out chain prompts (ids look like "
                         "chain/s0/94)")
    P = sample.input_ids.shape[1]
    after_prefill: list[torch.Tensor] = []
    run = RunConfig(policy, params, [budget], (prefill, params if prefill == policy else {}) if prefill else None,
                    slack)
    result = task.decode_batch(model, tokenizer, [sample], run, observer=lambda cache: after_prefill.append(
        kept_positions(cache)[:, 0].cpu()) if not after_prefill else None)
    text = result.texts[0]
    prompt_text = tokenizer.decode(sample.input_ids[0].tolist(), skip_special_tokens=True)
    real = statements(prompt_text)  # the problem list's; the reply's solved problems repeat the first headers
    written = statements(prompt_text.splitlines()[-1] + text)  # the prompt ends with the first graded header
    gold, given, kinds = task.gold(sample), task.given(sample), task.kinds(sample)
    graded = grade_chain(text, gold, given=given, kinds=kinds)
    kept = kept_per_statement(after_prefill[0], token_pieces(tokenizer, sample.input_ids[0].tolist()), P)
    problems = []
    for k in range(given + 1, len(gold) + 1):
        copy = written.get(k)
        problems.append({"problem": k, "kind": kinds[k - 1], "kept": kept.get(k),
                         "copy": "missing" if copy is None else "copied" if copy == real.get(k) else "miscopied",
                         "right": bool(graded["right"][k - 1]), "written": copy})
    summary = {}
    for state in ("copied", "miscopied", "missing"):
        rows = [p for p in problems if p["copy"] == state]
        shares = [p["kept"] for p in rows if p["kept"] is not None]
        summary[state] = {"problems": len(rows), "right": sum(p["right"] for p in rows),
                          "mean_kept": sum(shares) / len(shares) if shares else None}
    return {"prompt": prompt_id, "prompt_tokens": P, "budget": budget, "policy": policy, "prefill_policy": prefill,
            "generated_tokens": int(result.new_tokens[0]), "problems": problems, "summary": summary, "text": text}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="bundled alias, local folder or hub id (default: SmolLM2-135M)")
    ap.add_argument("--policy", required=True)
    ap.add_argument("--scorer", default=None, help="exported scorer for --policy learned")
    ap.add_argument("--prefill-policy", default=None, help="compresses the prompt at the prefill (e.g. learned)")
    ap.add_argument("--budget", type=int, required=True, help="tokens per layer and KV head")
    ap.add_argument("--prompt", required=True, help="a held-out chain prompt's id, e.g. chain/s0/94")
    ap.add_argument("--slack", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=None, help="cap (default: the chain task's)")
    ap.add_argument("--block-size", type=int, default=None, help="evict blocks of this many tokens (granularity)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="write the report (with the decoded text) here")
    args = ap.parse_args(argv)
    from learnkv.model import DEFAULT_MODEL, load_model

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model or DEFAULT_MODEL)
    params = {"scorer": args.scorer} if args.scorer else {}
    report = look(model, tokenizer, args.prompt, args.policy, params, args.budget, args.prefill_policy, args.slack,
                  args.max_new_tokens, args.block_size)
    print(f"{report['prompt']}: {report['prompt_tokens']}-token prompt, budget {report['budget']}, "
          f"{report['policy']} (prefill {report['prefill_policy'] or 'none'}), {report['generated_tokens']} tokens")
    print("| problem | kind | statement kept at the prefill | copy | answer |\n|---|---|---|---|---|")
    for p in report["problems"]:
        kept = "—" if p["kept"] is None else f"{p['kept']:.2f}"
        print(f"| {p['problem']} | {p['kind']} | {kept} | {p['copy']} | {'right' if p['right'] else 'wrong'} |")
    for state, s in report["summary"].items():
        mean = "—" if s["mean_kept"] is None else f"{s['mean_kept']:.2f}"
        print(f"{state}: {s['problems']} problems, {s['right']} answered right, mean kept share {mean}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
