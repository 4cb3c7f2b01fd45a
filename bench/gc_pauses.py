"""Python's garbage collections during a batched decode on a CPU, with the objects alive before it frozen or not.

    python bench/gc_pauses.py                          # full cache and R-KV, batch 8 of held-out chain prompts
    python bench/gc_pauses.py --policies full,h2o --new-tokens 528 --rounds 2

A collection of the oldest generation walks every object the collector tracks: with a model, its tokenizer and
transformers loaded, hundreds of thousands. CPython runs one only once the objects that survived younger collections
since the last make up a quarter of the old ones: in a process that has just loaded a model, one comes due early in
its first decode. `learnkv.decode.decode_steps` runs its steps inside `learnkv.memory.frozen_objects`, so the objects
alive before the decode are left out of the walk. Variants, each decode in a fresh process right after the model's
load, alternately, the order reversed every round:

- ``today``: the code as it is;
- ``before``: the decode's steps without `frozen_objects`, as before 2026-12-05.

Printed per decode: the collections during its steps by generation (count, ms in all) and its slowest step; then the
objects tracked before a decode, and the time of one ``gc.collect(2)`` after it without and with the objects frozen.
The machine must be otherwise idle for the times to mean anything.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

# the repo root first: learnkv from this checkout, installed or not
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import learnkv.decode as decode_module  # noqa: E402
from learnkv import generate, load_model, memory  # noqa: E402
from learnkv.cli import thread_count  # noqa: E402
from learnkv.decode import encode_prompts  # noqa: E402
from learnkv.policies.params import parse_policy  # noqa: E402
from learnkv.prompts import load_prompts  # noqa: E402

VARIANTS = {"today": memory.frozen_objects, "before": contextlib.nullcontext}


def collect_ms(frozen: bool) -> float:
    """The median ms of ``gc.collect(2)`` over 5 calls, inside `memory.frozen_objects` or not."""
    times = []
    for _ in range(5):
        with memory.frozen_objects() if frozen else contextlib.nullcontext():
            t0 = time.perf_counter()
            gc.collect(2)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def traced_decode(model, ids, mask, item: str, args) -> tuple[dict[int, tuple[int, float]], float]:
    """({generation: (collections, ms)} during the decode's steps, its slowest step in ms)."""
    name, params = parse_policy(item)
    budget = {} if name == "full" else {"policy": name, "budget": args.budget, "policy_params": params}
    seen, started, marks = {g: [0, 0.0] for g in range(3)}, [0.0], []

    def on_collection(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        elif marks:  # the decode's steps (its prefill ended at the first mark)
            seen[info["generation"]][0] += 1
            seen[info["generation"]][1] += (time.perf_counter() - started[0]) * 1e3

    gc.callbacks.append(on_collection)
    try:
        generate(model, input_ids=ids, attention_mask=mask, max_new_tokens=args.new_tokens, stop_at_eos=False,
                 slack=args.slack, on_step=lambda _: marks.append(time.perf_counter()), **budget)  # fmt: skip
    finally:
        gc.callbacks.remove(on_collection)
    slowest = max(b - a for a, b in zip(marks, marks[1:])) * 1e3
    return {g: (n, ms) for g, (n, ms) in seen.items()}, slowest


def one_decode(args) -> dict:
    """The decode of ``--one POLICY VARIANT`` in this fresh process, as after any model load; then the cost of one
    full collection here, without and with the objects frozen."""
    item, label = args.one
    decode_module.frozen_objects = VARIANTS[label]
    model, tok = load_model(args.model)
    ids, mask = encode_prompts(tok, [x.text for x in load_prompts("chain", n=args.batch, split="test")])
    tracked = len(gc.get_objects())
    seen, slowest = traced_decode(model, ids, mask, item, args)
    lengths = mask.sum(-1).tolist()
    return {"seen": seen, "slowest": slowest, "tracked": tracked, "prompts": [min(lengths), max(lengths)],
            "collect_ms": [collect_ms(False), collect_ms(True)]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--policies", default="full,rkv", help="NAME[:key=value]... items, comma-separated")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--budget", type=int, default=780)
    p.add_argument("--new-tokens", type=int, default=300)
    p.add_argument("--slack", type=int, default=16)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--threads", type=thread_count, default=2)
    p.add_argument("--one", nargs=2, metavar=("POLICY", "VARIANT"), help=argparse.SUPPRESS)  # a child's decode
    args = p.parse_args(argv)
    if args.new_tokens < 2:
        p.error(f"--new-tokens ({args.new_tokens}) must be at least 2 (a step after the first)")
    torch.set_num_threads(args.threads)
    if args.one:
        print(json.dumps(one_decode(args)))
        return
    child = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:])]
    print(f"model {args.model}, batch {args.batch}, {args.new_tokens} new tokens, budget {args.budget}, slack "
          f"{args.slack}, threads {args.threads}; each decode in a fresh process, right after the model's load\n")
    print("| round | policy | variant | generation 0 | generation 1 | generation 2 | slowest step ms |")
    print("|---|---|---|---|---|---|---|")
    variants, costs = list(VARIANTS), []
    for r in range(args.rounds):
        for item in args.policies.split(","):
            for label in variants if r % 2 == 0 else variants[::-1]:
                out = subprocess.run([*child, "--one", item, label], capture_output=True, text=True)
                if out.returncode:
                    sys.exit(f"the decode of {item} ({label}) failed:\n{out.stderr[-2000:]}")
                res = json.loads(out.stdout.splitlines()[-1])
                cells = " | ".join(f"{n} ({ms:.0f} ms)" for n, ms in res["seen"].values())
                print(f"| {r + 1} | {item} | {label} | {cells} | {res['slowest']:.0f} |", flush=True)
                costs.append(res)
    print(f"\nprompts {costs[0]['prompts'][0]}-{costs[0]['prompts'][1]} tokens; objects tracked before a decode: "
          f"{min(c['tracked'] for c in costs):,}-{max(c['tracked'] for c in costs):,}; one gc.collect(2) after it: "
          f"{statistics.median(c['collect_ms'][0] for c in costs):.1f} ms, "
          f"{statistics.median(c['collect_ms'][1] for c in costs):.1f} ms with them frozen (medians over the decodes)")


if __name__ == "__main__":
    main()
