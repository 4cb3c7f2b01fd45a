"""Page faults and step time of a batched decode on a CPU, with the heap handed back as today or at every look.

    python bench/page_faults.py                                  # h2o, learned; batch 8 of held-out chain prompts
    python bench/page_faults.py --policies learned --rounds 3 --threads 2

A fresh buffer of a layer's size (MBs at batch 8) is fresh pages from the system unless glibc's heap still holds
freed ones: each page faults on first write. Two things decide it in a decode: whether a compaction writes fresh
buffers (`BudgetLayer._state_in_place`: on a CPU the positions and state stay in theirs), and whether the decode loop
hands the free heap pages back at every look (`learnkv.memory.HeapTrim`: only once the process grew). Variants,
timed alternately in one process, the order reversed every round:

- ``today``: the code as it is;
- ``before``: fresh positions and state buffers at every compaction (and the stacked view of every layer's built
  anew), and the heap handed back at every look (every `TRIM_EVERY` steps), as before 2026-12-01.

Each decode: ``--batch`` held-out chain prompts (~1k tokens, compressed to the budget at the prefill by SnapKV), a
budget of ``--budget`` tokens per layer and KV head, ``--new-tokens`` steps with slack ``--slack``; printed per
decode, over its steps from ``--from-step`` to the last: minor page faults a step (exact under any load) and ms a
step (the machine must be otherwise idle for these to mean anything). The learned policy runs a random-init scorer
(the same cost as a trained one).
"""

from __future__ import annotations

import argparse
import resource
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
from learnkv.slots import BudgetLayer  # noqa: E402
from profile_eviction import random_scorer  # noqa: E402

TODAY = {"state_in_place": BudgetLayer._state_in_place, "trim": memory.HeapTrim}
BEFORE = {"state_in_place": lambda self, capacity: False, "trim": lambda: memory.release_free_heap}


def use(variant: dict) -> None:
    """Run the next decodes as ``variant`` (`TODAY` or `BEFORE`)."""
    BudgetLayer._state_in_place = variant["state_in_place"]
    decode_module.HeapTrim = variant["trim"]


def timed_decode(model, ids, mask, item: str, scorer: str, args) -> tuple[float, float]:
    """Minor page faults and ms a step over the decode's steps from ``--from-step`` to its last."""
    name, params = parse_policy(item)
    params.update({"scorer": scorer} if name == "learned" else {})
    marks = []

    def on_step(_):
        marks.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()))

    generate(model, input_ids=ids, attention_mask=mask, policy=name, budget=args.budget, policy_params=params,
             max_new_tokens=args.new_tokens, stop_at_eos=False, slack=args.slack, prefill_policy="snapkv",
             on_step=on_step)  # fmt: skip
    (f0, t0), (f1, t1) = marks[args.from_step], marks[-1]
    steps = len(marks) - 1 - args.from_step
    return (f1 - f0) / steps, (t1 - t0) / steps * 1e3


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--policies", default="h2o,learned", help="NAME[:key=value]... items, comma-separated")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--budget", type=int, default=780)
    p.add_argument("--new-tokens", type=int, default=112)
    p.add_argument("--from-step", type=int, default=16)
    p.add_argument("--slack", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=thread_count, default=2)
    args = p.parse_args(argv)
    if args.new_tokens <= args.from_step + 1:
        p.error(f"--new-tokens ({args.new_tokens}) must exceed --from-step + 1 ({args.from_step + 1})")
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    ids, mask = encode_prompts(tok, [x.text for x in load_prompts("chain", n=args.batch, split="test")])
    scorer = random_scorer(model, args.model)
    lengths = mask.sum(-1).tolist()
    print(f"model {args.model}, batch {args.batch}, prompts {min(lengths)}-{max(lengths)} tokens + {args.new_tokens} "
          f"new, budget {args.budget}, slack {args.slack}, threads {args.threads}, steps {args.from_step}-"
          f"{args.new_tokens - 1}\n")
    print("| round | policy | variant | minor page faults a step | ms a step |")
    print("|---|---|---|---|---|")
    variants = [("today", TODAY), ("before", BEFORE)]
    try:
        for r in range(args.rounds):
            for item in args.policies.split(","):
                for label, variant in variants if r % 2 == 0 else variants[::-1]:
                    use(variant)
                    faults, ms = timed_decode(model, ids, mask, item, scorer, args)
                    print(f"| {r + 1} | {item} | {label} | {faults:,.0f} | {ms:.1f} |", flush=True)
    finally:
        use(TODAY)


if __name__ == "__main__":
    main()
