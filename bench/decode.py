"""Decode benchmark on CPU or GPU: every policy at one budget against the full cache, in one run.

    python bench/decode.py                       # bundled SmolLM2, budget 64, 128 new tokens
    python bench/decode.py --budget 0.25 --new-tokens 256 --threads 2

Reports, per policy: peak KV bytes as a share of the full cache, decode tokens/s relative to the full cache
measured in the same run, the share of wall time spent in eviction (update + score + select + compact), and
how many greedy tokens match the full-cache output before the first difference.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

# the repo root must come before this script's folder, or `import kernels` would find bench/kernels.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from learnkv import POLICIES, generate, load_model  # noqa: E402
from learnkv.eval.metrics import agreement_length  # noqa: E402

PROMPT = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May? Think step by step."
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--budget", default="64")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--policies", default=None, help="comma-separated (default: every policy; learned needs --scorer)")
    parser.add_argument("--scorer", default=None, help="exported scorer for the learned policy")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tok = load_model(args.model, device=device)
    run = dict(max_new_tokens=args.new_tokens, stop_at_eos=False)
    generate(model, tok, PROMPT, policy="full", max_new_tokens=4)  # warm-up
    full = generate(model, tok, PROMPT, policy="full", **run)
    ref = full.tokens[0].tolist()
    print(f"device: {device}, threads: {args.threads}, model: {args.model}, prompt tokens: {full.prompt_tokens}, "
          f"new tokens: {args.new_tokens}, budget: {args.budget}, {time.strftime('%Y-%m-%d')}\n")
    print("| policy | budget (tokens) | peak KV / full | tokens/s / full | eviction share of time | tokens equal to full |")
    print("|---|---|---|---|---|---|")
    names = args.policies.split(",") if args.policies else [n for n in POLICIES if n != "learned" or args.scorer]
    for name in names:
        params = {"scorer": args.scorer} if name == "learned" else {}
        r = full if name == "full" else generate(model, tok, PROMPT, policy=name, budget=args.budget,
                                                 policy_params=params, **run)
        # the oracle replays the full-cache tokens (teacher forcing), so its agreement is 100% by construction
        agree = "replayed" if POLICIES[name].needs_future else f"{agreement_length(r.tokens[0].tolist(), ref)}/{len(ref)}"
        print(f"| {name} | {r.budget or '-'} | {r.peak_kv_bytes / full.full_kv_bytes:.2f} | "
              f"{r.tokens_per_s / full.tokens_per_s:.2f} | {r.eviction_share:.1%} | {agree} |")


if __name__ == "__main__":
    main()
