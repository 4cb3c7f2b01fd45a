"""Decode benchmark on CPU or GPU: every policy at one budget against the full cache, and batched throughput.

    python bench/decode.py                                   # bundled SmolLM2, budget 96, 128 new tokens, batch 1
    python bench/decode.py --batch-sizes 1,4,16 --json runs/bench-decode.json
    python bench/decode.py --policies full,h2o,learned --scorer runs/train/scorer --batch-sizes 1,16

Table 1 (batch 1, one prompt): per policy, peak KV bytes as a share of the full cache, decode tokens/s relative to
the full cache measured in the same run, the share of wall time spent in eviction (update + score + select +
compact), and how many greedy tokens match the full-cache output before the first difference.

Table 2 (``--batch-sizes``): per policy and batch size, aggregate generated tokens per second of wall time (prefill
included) over a batch of distinct held-out prompts (left-padded; every row decodes as it would alone) and the
ratio to batch 1 of the same policy, all measured in one run; then each policy's step time relative to the full
cache's at the same batch size, paired by round (``--repeats`` rounds time every policy in turn, so a policy and
the full cache are timed seconds apart under the same load; median and range over rounds). A prompt longer than the budget is compressed at the prefill by
``--prefill-policy`` (default snapkv), so every policy, LazyEviction included, runs on the same batch. ``--json PATH`` writes those records
(``{"policy", "batch_size", "tokens_per_s", ...}``).

Table 3 (``--long``, issue 43's benchmark): where the KV cache dominates. Per setting ``B:L`` of ``--long-settings``
(default batch 8 to ~1.5k cached tokens and batch 16 to ~2.5k), B held-out chain prompts (~1k tokens) decode
``L - median prompt`` new tokens, so each row ends near L cached tokens; every policy (the oracle excepted: it
replays a full-cache pass) at each fraction of ``--long-fractions`` of each row's final length, against the full
cache. ``--repeats`` rounds time every (setting, policy, fraction) in turn; per round a run's decode tokens/s (prefill
excluded) is divided by the full cache's of the same round and setting, reported as the median [min, max] over
rounds, with the share of the run's time spent in eviction (on CUDA the host's launch time only). ``--json`` writes
the records (``{"mode": "long", "policy", "fraction", "batch_size", "final_length", "speed_vs_full", ...}``). The
table runs for hours: each finished decode is kept in ``<json>.decodes.jsonl`` as it ends, and the same command
resumes after the last one; the file stays beside the records, so a rerun with more policies, settings or
``--repeats`` times only what is new (a kept decode keeps its time, ``timed_at_rounds`` in the records: a round
completed later pairs runs timed apart). Remove the file to time everything again:

    python bench/decode.py --long --threads 2 --slack 16 --repeats 2 --json runs/bench-decode-long.json

``--interleave``: a round's decodes of a setting take turns with a full-cache decode, one step each
(`bench/turns.py`), so each ratio pairs decodes that ran on the same machine state (this CPU's speed drifts 10-20%
over minutes); the records add each policy's pooled ratio (the rounds' summed step times) and its 95% interval over
16-step blocks. Such a round is kept when all its decodes end (the caches of a round live together).

``--pair BASE,OTHER`` (with ``--json``, after such a run): two policies of the same turns paired with each other,
step by step, from their kept decodes (``<json>.decodes.jsonl``): OTHER's speed over BASE's with its 95% interval over
16-step blocks, each one's against its turn-mate full cache, and mean milliseconds a step; ``--from-step N`` leaves
out the first N decode steps (e.g. a window still filling):

    python bench/decode.py --pair snapkv,snapkv:running_sum=true --json runs/bench-long-b8-snap-running.json

``--by-residue N`` (with ``--json``, after such a run): where each policy's extra time falls in a periodic schedule
(a compaction every ``slack + 1`` steps where every row evicts at every step, a refresh every ``refresh``): per
policy and round, the median over steps of its step time minus its turn-mate full cache's, in milliseconds, by the
decode step's index modulo N (from ``--from-step``):

    python bench/decode.py --by-residue 17 --from-step 64 --json runs/bench-long-turns.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

# the repo root first: learnkv from this checkout, installed or not
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.append(str(Path(__file__).resolve().parent))  # after the root: bench/turns.py, when loaded by path too

from learnkv import POLICIES, attention, generate, generate_steps, load_model  # noqa: E402
from learnkv.cli import Interruptible, OneLineParser, thread_count  # noqa: E402
from learnkv.eval.checkpoint import differing_keys, scorer_identity  # noqa: E402
from learnkv.eval.metrics import agreement_length  # noqa: E402
from learnkv.policies.params import parse_policy  # noqa: E402
from learnkv.progress import redraw_seconds  # noqa: E402
from turns import block_ratio_interval, take_turns  # noqa: E402 - bench/turns.py

PROMPT = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May? Think step by step."
)


def int_at_least(minimum: int):
    """An argparse type: an integer >= ``minimum``, else one line naming the bound (a negative ``--from-step`` would
    silently slice from the end of every decode)."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if n < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {n}")
        return n
    return parse


def parse_args(argv=None):
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--budget", default="96", help="tokens (holds the 74-token prompt: decode-time eviction)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--policies", default=None,
                        help="comma-separated (default: every policy; learned needs --scorer); with --long an item may "
                             "carry settings, NAME:key=value (e.g. snapkv:running_sum=true)")
    parser.add_argument("--scorer", default=None, help="exported scorer for the learned policy")
    parser.add_argument("--threads", type=thread_count, default=2)
    parser.add_argument("--batch-sizes", default=None, help="B[,B...]: the throughput table (e.g. 1,4,16)")
    parser.add_argument("--json", default=None,
                        help="write the throughput records here (--long: and keep each finished decode beside them, "
                             "in JSON.decodes.jsonl, so the same command resumes or adds to them)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds, each timing every policy in turn: best rate, cost ratio per round")
    parser.add_argument("--slack", type=int, default=0,
                        help="dead slots a layer may hold before it compacts (`generate(slack=...)`; same kept tokens)")
    parser.add_argument("--prefill-policy", default="snapkv",
                        help="compresses a prompt longer than the budget at the prefill (the batch's prompts are "
                             "80-174 tokens); 'none' to let each policy do it (LazyEviction then refuses)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="the model's dtype (bfloat16 on a GPU)")
    parser.add_argument("--long", action="store_true", help="only table 3: long caches, every policy against full")
    parser.add_argument("--long-settings", default="8:1536,16:2560",
                        help="B:L[,B:L...]: batch size and the cache length each row ends near (prompt + new tokens)")
    parser.add_argument("--long-fractions", default="0.25,0.5", help="budgets as fractions of each row's final length")
    parser.add_argument("--pair", default=None, metavar="BASE,OTHER",
                        help="instead: pair two policies' kept decodes of --json's turns step by step (see above)")
    parser.add_argument("--by-residue", type=int_at_least(1), default=None, metavar="N",
                        help="instead: each kept decode of --json's turns, its median extra ms a step over its "
                             "turn-mate full cache by step index modulo N (see above)")
    parser.add_argument("--from-step", type=int_at_least(0), default=0,
                        help="--pair, --by-residue: leave out the first N decode steps")
    parser.add_argument("--interleave", action="store_true",
                        help="--long: a round's decodes of a setting take turns, one step each, with a full-cache "
                             "decode (bench/turns.py): each ratio pairs decodes that ran on the same machine state")
    parser.add_argument("--random-weights", action="store_true",
                        help="--model is a folder with the model's config.json and tokenizer but no weights (a GPU "
                             "machine that cannot take the weights along): build it with seeded random weights. "
                             "Timing only: the greedy tokens, and so the agreement column, mean nothing")
    return parser.parse_args(argv)


def random_weight_model(folder: str, dtype: torch.dtype, device: str):
    """(model, tokenizer) of the shape that ``folder``'s config.json describes, with seeded random weights.

    A decode step costs the same whatever the weights hold (``stop_at_eos=False`` fixes every run's length), so
    speed ratios measured on it hold for the real model of that shape.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # only for --random-weights

    attention.register()
    config = AutoConfig.from_pretrained(folder)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention.NAME)
    return model.to(device).eval(), AutoTokenizer.from_pretrained(folder)


def batch_prompts(tokenizer, n: int) -> list[str]:
    """``n`` distinct held-out GSM8K-style prompts (the first is the README's)."""
    from learnkv.prompts import load_prompts

    return [PROMPT] + [p.text for p in load_prompts("gsm_symbolic", n=max(n - 1, 0), split="test")]


def prefill(name: str, args) -> dict:
    """`generate`'s slack and prefill policy for an evicting policy (the prefill policy acts only on rows whose
    prompt exceeds the budget)."""
    if not POLICIES[parse_policy(name)[0]].evicts:
        return {}
    return {"slack": args.slack, **({"prefill_policy": args.prefill_policy} if args.prefill_policy != "none" else {})}


def single_table(model, tok, names, args) -> None:
    run = dict(max_new_tokens=args.new_tokens, stop_at_eos=False)
    full = generate(model, tok, PROMPT, policy="full", **run)
    ref = full.tokens[0].tolist()
    print(f"prompt tokens: {full.prompt_tokens}, new tokens: {args.new_tokens}, budget: {args.budget}, batch 1\n")
    print("| policy | budget (tokens) | peak KV / full | tokens/s / full | eviction share of time | tokens equal to full |")
    print("|---|---|---|---|---|---|")
    for name in names:
        params = {"scorer": args.scorer} if name == "learned" else {}
        r = full if name == "full" else generate(model, tok, PROMPT, policy=name, budget=args.budget,
                                                 policy_params=params, **prefill(name, args), **run)
        # the oracle replays the full-cache tokens (teacher forcing), so its agreement is 100% by construction
        agree = "replayed" if POLICIES[name].needs_future else f"{agreement_length(r.tokens[0].tolist(), ref)}/{len(ref)}"
        print(f"| {name} | {r.budget or '-'} | {r.peak_kv_bytes / full.full_kv_bytes:.2f} | "
              f"{r.tokens_per_s / full.tokens_per_s:.2f} | {r.eviction_share:.1%} | {agree} |")


def throughput_table(model, tok, names, args) -> list[dict]:
    """Table 2. Each of ``--repeats`` rounds times every policy once, in turn, at each batch size: a policy's rate
    is its best round, and its step time relative to the full cache is taken round by round (the two ran seconds
    apart, under the same load) and reported as the median with the range over rounds."""
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    prompts = batch_prompts(tok, max(sizes))
    rounds: dict[tuple[str, int], list[float]] = {(n, b): [] for n in names for b in sizes}
    prompt_tokens = {}
    for _ in range(args.repeats):
        for b in sizes:
            for name in names:
                params = {"scorer": args.scorer} if name == "learned" else {}
                t0 = time.perf_counter()
                r = generate(model, tok, prompts[:b], policy=name, policy_params=params,
                             budget=args.budget if POLICIES[name].evicts else None, max_new_tokens=args.new_tokens,
                             stop_at_eos=False, **prefill(name, args))
                rounds[name, b].append(sum(r.new_tokens) / (time.perf_counter() - t0))
                prompt_tokens[b] = r.prompt_lengths
    records = []
    for name in names:
        for b in sizes:
            rates = rounds[name, b]
            rec = {"policy": name, "batch_size": b, "tokens_per_s": max(rates), "tokens_per_s_rounds": rates,
                   "new_tokens": args.new_tokens, "budget": args.budget, "prompt_tokens": prompt_tokens[b],
                   "threads": args.threads, "slack": args.slack}
            base = rounds.get((name, 1))
            rec["ratio_to_batch_1"] = rec["tokens_per_s"] / max(base) if base else None
            full = rounds.get(("full", b))
            # a decode step's time relative to the full cache's at the same batch size, paired by round
            per_round = [f / p for f, p in zip(full, rates)] if full else []
            rec["time_vs_full_rounds"] = per_round
            rec["time_vs_full"] = statistics.median(per_round) if per_round else None
            records.append(rec)
    rec_of = {(r["policy"], r["batch_size"]): r for r in records}
    print(f"\nthroughput: {args.new_tokens} new tokens per row, budget {args.budget}, best of {args.repeats} "
          "interleaved rounds\n")
    print("| policy | " + " | ".join(f"batch {b} tok/s" for b in sizes) + " | " +
          " | ".join(f"batch {b} / batch 1" for b in sizes if b != 1) + " |")
    print("|---|" + "---|" * (2 * len(sizes) - (1 in sizes)))
    for name in names:
        ratios = [f"{rec_of[name, b]['ratio_to_batch_1']:.2f}x" if 1 in sizes else "—" for b in sizes if b != 1]
        print(f"| {name} | " + " | ".join(f"{rec_of[name, b]['tokens_per_s']:.1f}" for b in sizes) + " | " +
              " | ".join(ratios) + " |")
    if "full" in names:
        print(f"\nstep time relative to the full cache at the same batch size (full tok/s / policy tok/s, per round: "
              f"median{' [min, max] over ' + str(args.repeats) + ' rounds' if args.repeats > 1 else ''})\n")
        print("| policy | " + " | ".join(f"batch {b}" for b in sizes) + " |")
        print("|---|" + "---|" * len(sizes))
        for name in names:
            cells = []
            for b in sizes:
                r = rec_of[name, b]["time_vs_full_rounds"]
                spread = f" [{min(r):.2f}, {max(r):.2f}]" if len(r) > 1 else ""
                cells.append(f"{statistics.median(r):.2f}x{spread}")
            print(f"| {name} | " + " | ".join(cells) + " |")
    return records


def long_prompts(n: int) -> list[str]:
    """``n`` held-out chain prompts (~1k tokens with SmolLM2's or Qwen's chat template)."""
    from learnkv.prompts import load_prompts

    return [p.text for p in load_prompts("chain", n=n, split="test")]


def long_identity(model, args) -> dict:
    """What a kept decode of the long table was timed under: a decode kept under anything else is not read back.
    (The scorer is the learned policy's alone: it is in that policy's keys, `long_key`.)"""
    return {"model": args.model, "dtype": args.dtype, "random_weights": args.random_weights, "threads": args.threads,
            "slack": args.slack, "prefill_policy": args.prefill_policy, "device": str(next(model.parameters()).device),
            **({"interleave": True} if args.interleave else {})}  # files timed one decode after another read back


def long_key(i: int, batch: int, length: int, name: str, fraction: float | None, scorer: str | None) -> tuple:
    """A decode's key: (round, batch, length, policy, fraction), and for the learned policy its scorer's weights
    digest, so a run may add ``learned`` to decodes timed without a scorer, and another scorer is another decode."""
    return (i, batch, length, name, fraction) + ((scorer,) if parse_policy(name)[0] == "learned" else ())


def read_long_state(path: Path, identity: dict) -> dict[tuple, dict]:
    """The finished decodes kept in ``path`` (one JSON line each after an identity line), keyed by `long_key`. A
    line without its newline was being written when the run was killed: it is cut off here, so the next decode
    appends after the last finished one. A file whose identity line names a scorer (the first format) keeps its
    learned decodes under that scorer's digest."""
    if not path.exists():
        return {}
    text = path.read_text()
    finished = text[:text.rindex("\n") + 1] if "\n" in text else ""
    if finished != text:
        path.write_text(finished)
    lines = finished.split("\n")[:-1]
    if not lines:
        return {}
    head = json.loads(lines[0])["identity"]
    first_format = head.pop("scorer", None)
    if head != identity:
        raise SystemExit(f"error: {path} keeps decodes timed under another setting "
                         f"({', '.join(differing_keys(head, identity))} differ); give another --json, or remove it "
                         "to start over")
    entries = (json.loads(line) for line in lines[1:])
    old = (first_format or {}).get("weights_sha256")
    return {tuple(e["key"]) + ((old,) if e["key"][3] == "learned" and len(e["key"]) == 5 else ()): e["result"]
            for e in entries}


def append_long_state(path: Path, identity: dict, key: tuple, result: dict) -> None:
    """Keep one finished decode: one line appended in one write (the identity line first in a new file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    head = "" if path.exists() and path.stat().st_size else json.dumps({"identity": identity}) + "\n"
    with path.open("a") as f:
        f.write(head + json.dumps({"key": list(key), "result": result}) + "\n")


def _whole_blocks(steps: list[float], block: int = 16) -> list[float]:
    """``steps`` cut to whole blocks, so pooled rounds do not put two rounds' steps in one block."""
    return steps[: len(steps) - len(steps) % block]


def long_params(item: str, args) -> dict:
    """The settings of a ``--policies`` item (``NAME[:key=value]...``), and the learned policy's scorer."""
    name, params = parse_policy(item)
    return {**params, **({"scorer": args.scorer} if name == "learned" else {})}


def long_turns(model, keys: list[tuple], plan: tuple, args) -> dict[tuple, dict]:
    """The decodes ``keys`` (one round and setting) and a full-cache decode, taking turns step by step
    (`bench/turns.py`); each result holds its step times and its turn-mate full cache's (``paired_full_*``), which
    its speed is divided by. The full decode is kept as the round's if ``keys`` holds it."""
    ids, mask, _, new = plan
    names = [("full", None)] + [(k[3], k[4]) for k in keys if k[3] != "full"]

    def job(name, frac):
        return lambda: generate_steps(model, input_ids=ids, attention_mask=mask, policy=parse_policy(name)[0],
                                      budget=frac, policy_params=long_params(name, args), max_new_tokens=new,
                                      stop_at_eos=False, **prefill(name, args))

    attention.install(model)  # once for all: each `generate` then leaves the model's attention as it found it
    bar = tqdm(total=len(names) * new, desc=f"turns of {len(names)}", unit="step", leave=False,
               mininterval=redraw_seconds())
    turned = take_turns([job(n, f) for n, f in names], after_step=lambda _: bar.update())
    bar.close()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    results = {}
    for (name, frac), t in zip(names, turned):
        r = t.result
        results[name, frac] = {
            "decode_tokens_per_s": sum(r.new_tokens) / t.decode_s,
            "tokens_per_s": sum(r.new_tokens) / (t.prefill_s + t.decode_s),
            "eviction_share": r.eviction_s / (t.prefill_s + t.decode_s), "budgets": r.budgets, "timed_at": stamp,
            "step_s": [round(x, 6) for x in t.step_s], "prefill_s": round(t.prefill_s, 6)}
    full = results["full", None]
    for res in results.values():
        res["paired_full_decode_tokens_per_s"] = full["decode_tokens_per_s"]
        res["paired_full_step_s"] = full["step_s"]
    return {k: results[k[3], k[4]] for k in keys}


def long_table(model, tok, names, args) -> list[dict]:
    """Table 3 (see the module docstring): decode speed relative to the full cache at long caches, paired by round."""
    from learnkv.decode import encode_prompts

    settings = [tuple(int(x) for x in s.split(":")) for s in args.long_settings.split(",")]
    fractions = [float(f) for f in args.long_fractions.split(",")]
    runs = [("full", None)] + [(n, f) for n in names if n != "full" for f in fractions]
    prompts = long_prompts(max(b for b, _ in settings))
    plan = {}
    for b, length in settings:
        ids, mask = encode_prompts(tok, prompts[:b])
        lengths = mask.sum(-1).tolist()
        new = length - int(statistics.median(lengths))
        if new < 1:
            median = statistics.median(lengths)
            raise SystemExit(f"error: cache length {length} is not above the prompts' median {median}")
        plan[b, length] = (ids, mask, lengths, new)
    rounds: dict[tuple, list[dict]] = {(b, length, n, f): [] for b, length in settings for n, f in runs}
    state = Path(args.json + ".decodes.jsonl") if args.json else None
    identity = long_identity(model, args)
    kept = read_long_state(state, identity) if state else {}
    scorer = scorer_identity(args.scorer)["weights_sha256"] if args.scorer else None
    todo = [long_key(i, b, length, name, frac, scorer)
            for i in range(args.repeats) for b, length in settings for name, frac in runs]
    if kept:
        print(f"resuming: {sum(k in kept for k in todo)} of {len(todo)} decodes read back from {state}")
    # one tick per decode (minutes each), nothing per step: the bar must not touch what it times
    bar = tqdm(total=len(todo), desc="long", unit="decode", mininterval=redraw_seconds())
    try:
        with Interruptible() as interrupt:  # SIGTERM (a scheduler's, `timeout`'s) as Ctrl-C: say what was kept
            for key in todo:
                i, b, length, name, frac = key[:5]
                if key not in kept and args.interleave:  # this round's missing decodes of the setting, in turns
                    group = [k for k in todo if k[:3] == key[:3] and k not in kept]
                    kept.update(long_turns(model, group, plan[b, length], args))
                    if state:
                        for k in group:
                            append_long_state(state, identity, k, kept[k])
                elif key not in kept:
                    ids, mask, _, new = plan[b, length]
                    r = generate(model, input_ids=ids, attention_mask=mask, policy=parse_policy(name)[0], budget=frac,
                                 policy_params=long_params(name, args), max_new_tokens=new, stop_at_eos=False,
                                 **prefill(name, args))
                    kept[key] = {"decode_tokens_per_s": sum(r.new_tokens) / max(r.decode_s, 1e-9),
                                 "tokens_per_s": r.tokens_per_s, "eviction_share": r.eviction_share,
                                 "budgets": r.budgets, "timed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
                    if state:
                        append_long_state(state, identity, key, kept[key])
                rounds[b, length, name, frac].append(kept[key])
                bar.update()
                rate = kept[key]["decode_tokens_per_s"]
                bar.set_postfix_str(f"round {i + 1}, batch {b}, {name} {frac or ''}: {rate:.1f} decode tok/s")
    except KeyboardInterrupt:
        bar.close()
        if state:
            raise SystemExit(f"{interrupt.how}: {len(kept)} finished decodes kept in {state}; the same command "
                             "resumes") from None
        raise
    bar.close()
    records = []
    for b, length in settings:
        _, _, lengths, new = plan[b, length]
        full = [x["decode_tokens_per_s"] for x in rounds[b, length, "full", None]]
        for name, frac in runs:
            got = rounds[b, length, name, frac]
            rates = [x["decode_tokens_per_s"] for x in got]
            # a decode timed in turns is divided by its turn-mate full cache's speed
            speed = [p / x.get("paired_full_decode_tokens_per_s", f) for p, f, x in zip(rates, full, got)]
            pooled = extra_ms = None
            if all("step_s" in x for x in got):  # the rounds' steps pooled, 16-step blocks resampled
                base_s = [s for x in got for s in _whole_blocks(x["paired_full_step_s"])]
                own_s = [s for x in got for s in _whole_blocks(x["step_s"])]
                pooled = block_ratio_interval(base_s, own_s)
                extra_ms = 1000 * (sum(own_s) - sum(base_s)) / len(own_s)  # what a step costs beyond the full cache's
            records.append({
                "mode": "long", "policy": name, "fraction": frac, "batch_size": b, "final_length": length,
                "prompt_tokens": lengths, "new_tokens": new, "budgets": got[0]["budgets"], "threads": args.threads,
                "slack": args.slack, "device": str(next(model.parameters()).device),
                "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                "random_weights": args.random_weights,
                "decode_tokens_per_s": max(rates), "decode_tokens_per_s_rounds": rates,
                "tokens_per_s_rounds": [x["tokens_per_s"] for x in got],
                "speed_vs_full_rounds": speed, "speed_vs_full": statistics.median(speed),
                "eviction_share_rounds": [x["eviction_share"] for x in got],
                "eviction_share": statistics.median(x["eviction_share"] for x in got),
                # a resumed benchmark pairs runs timed in different sessions: when each was timed says so
                "timed_at_rounds": [x.get("timed_at") for x in got],
                **({"speed_vs_full_pooled": pooled[0], "speed_vs_full_pooled_ci95": list(pooled[1:]),
                    "step_ms_over_full": extra_ms} if pooled else {})})
    spread = f" [min, max] over {args.repeats} rounds" if args.repeats > 1 else ""
    print(f"\nlong caches: decode tokens/s (prefill excluded) relative to the full cache, paired by round "
          f"(median{spread}); eviction share of each run's time; slack {args.slack}\n")
    turns = all("speed_vs_full_pooled" in r for r in records)
    if turns:
        print("each round's decodes of a setting took turns with a full-cache decode, one step each; pooled: the "
              "rounds' summed step times, 95% interval over 16-step blocks (bench/turns.py)\n")
    print("| batch | cache (prompt + new) | policy | budget | decode tok/s | vs full | eviction share |"
          + (" pooled [95%] | ms/step over full |" if turns else ""))
    print("|---|---|---|---|---|---|---|" + ("---|---|" if turns else ""))
    for r in records:
        s = r["speed_vs_full_rounds"]
        rng = f" [{min(s):.2f}, {max(s):.2f}]" if len(s) > 1 else ""
        budget = "-" if r["fraction"] is None else f"{r['fraction']:.0%} ({min(r['budgets'])}-{max(r['budgets'])})"
        lo, hi = r.get("speed_vs_full_pooled_ci95", (0, 0))
        print(f"| {r['batch_size']} | {min(r['prompt_tokens'])}-{max(r['prompt_tokens'])} + {r['new_tokens']} | "
              f"{r['policy']} | {budget} | {r['decode_tokens_per_s']:.1f} | {r['speed_vs_full']:.2f}x{rng} | "
              f"{r['eviction_share']:.0%} |"
              + (f" {r['speed_vs_full_pooled']:.3f}x [{lo:.3f}, {hi:.3f}] | {r['step_ms_over_full']:+.1f} |"
                 if turns else ""))
    return records


def pair_table(args) -> None:
    """``--pair BASE,OTHER``: every round and setting where both ran in turns, OTHER against BASE step by step."""
    base, other = args.pair.split(",")
    runs = kept_turns(args.json)
    found = False
    for (i, b, length, name, frac), r in runs.items():
        mates = [(f, m) for (j, c, n, o, f), m in runs.items()
                 if (j, c, n, o) == (i, b, length, other) and (None in (f, frac) or f == frac)]
        if name != base or not mates or "paired_full_step_s" not in r:
            continue
        found = True
        for f, mate in mates:
            pair_line(args, i, b, length, (base, frac), (other, f), r, mate)
    if not found:
        raise SystemExit(f"error: no round of {args.json}.decodes.jsonl has {base} and {other} in turns")


def pair_line(args, i: int, b: int, length: int, base: tuple, other: tuple, r: dict, mate: dict) -> None:
    """`pair_table`'s lines for one pair of kept decodes: OTHER against BASE, and each against the full cache."""
    base, other = decode_label(*base), decode_label(*other)
    n = args.from_step
    a, o, full = r["step_s"][n:], mate["step_s"][n:], r["paired_full_step_s"][n:]
    ratio, lo, hi = block_ratio_interval(a, o)
    ms = " / ".join(f"{1e3 * sum(x) / len(x):.1f}" for x in (full, a, o))
    print(f"round {i + 1}, batch {b} to {length}, decode steps {n}-{n + len(a) - 1}: {other} / {base} speed "
          f"{ratio:.3f}x [{lo:.3f}, {hi:.3f}]; ms a step full / {base} / {other}: {ms}")
    for label, x in ((base, a), (other, o)):
        ratio, lo, hi = block_ratio_interval(full, x)
        print(f"  {label} / full {ratio:.3f}x [{lo:.3f}, {hi:.3f}]")


def kept_turns(path: str) -> dict[tuple, dict]:
    """The decodes kept beside ``path``'s records, by (round, batch, length, policy, fraction): a run of several
    fractions holds each policy once per fraction (the full cache's is None)."""
    kept = [json.loads(line) for line in Path(path + ".decodes.jsonl").read_text().splitlines()]
    return {tuple(e["key"][:5]): e["result"] for e in kept if "key" in e}


def decode_label(name: str, fraction: float | None) -> str:
    """A kept decode's policy, with its budget's fraction where it has one (``h2o 50%``)."""
    return name if fraction is None else f"{name} {fraction:.0%}"


def residue_table(args) -> None:
    """``--by-residue N``: per kept decode in turns (the full cache's own left out), the median of its step time
    minus its turn-mate full cache's, in ms, over the steps of each residue modulo N."""
    n, first = args.by_residue, args.from_step
    rows = [(key, r) for key, r in kept_turns(args.json).items() if key[3] != "full" and "paired_full_step_s" in r]
    if not rows:
        raise SystemExit(f"error: {args.json}.decodes.jsonl holds no decode in turns with a full cache")
    print(f"median ms a step over the turn-mate full cache, by decode step modulo {n} (steps {first}-):")
    print("| round | policy | " + " | ".join(str(k) for k in range(n)) + " |")
    print("|---|---|" + "---|" * n)
    for (i, _, _, name, frac), r in rows:
        extra = [a - f for a, f in zip(r["step_s"], r["paired_full_step_s"])]
        by_k = [[extra[s] for s in range(first, len(extra)) if s % n == k] for k in range(n)]
        cells = (f"{1e3 * statistics.median(x):+.0f}" if x else "-" for x in by_k)  # "-": no step of that residue
        print(f"| {i + 1} | {decode_label(name, frac)} | " + " | ".join(cells) + " |")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.by_residue is not None:
        if not args.json:
            raise SystemExit("error: --by-residue takes the --json of a run in turns (--interleave)")
        return residue_table(args)
    if args.pair:
        if not args.json or args.pair.count(",") != 1:
            raise SystemExit("error: --pair takes BASE,OTHER and the --json of a run in turns (--interleave)")
        return pair_table(args)
    names = args.policies.split(",") if args.policies else [n for n in POLICIES if n != "learned" or args.scorer]
    unknown = [n for n in names if parse_policy(n)[0] not in POLICIES]
    if unknown:
        raise SystemExit(f"error: unknown policies {unknown}; known: {', '.join(POLICIES)}")
    if not args.long and any(":" in n for n in names):
        raise SystemExit("error: policy settings (NAME:key=value) are taken by --long only")
    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    load = random_weight_model if args.random_weights else load_model
    model, tok = load(args.model, dtype=getattr(torch, args.dtype), device=device)
    generate(model, tok, PROMPT, policy="full", max_new_tokens=4)  # warm-up
    print(f"device: {device}, threads: {args.threads}, model: {args.model} ({args.dtype}"
          f"{', random weights: timing only' if args.random_weights else ''}), "
          f"{time.strftime('%Y-%m-%d')}\n")
    records = None
    if args.long:
        records = long_table(model, tok, [n for n in names if not POLICIES[parse_policy(n)[0]].needs_future], args)
    else:
        if args.batch_sizes is None or "1" in args.batch_sizes.split(","):
            single_table(model, tok, names, args)
        if args.batch_sizes:
            records = throughput_table(model, tok, names, args)
    if records is not None and args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(records, indent=1))
        print(f"\nrecords: {args.json}")


if __name__ == "__main__":
    main()
