"""Batch-1 parity with kvpress and transformers (issue 43, item 3): the two sides timed alternately in one run.

    bash bench/kvpress_venv.sh                                  # once: .venv-kvpress (kvpress 0.5.5, CPU torch)
    python bench/kvpress_parity.py --json runs/kvpress-parity.json
    python bench/kvpress_parity.py --rounds 1 --new-tokens 32   # a quick check that both sides run
    python bench/kvpress_parity.py --profile knorm --new-tokens 256 # cProfile of learnkv's side alone (no kvpress)
    python bench/kvpress_parity.py --ops full,knorm,h2o         # torch operators a decode step, learnkv's side

The setting (issue 43's held-out peer setting): the bundled SmolLM2-135M-Instruct in fp32, batch 1, the README
prompt (74 tokens with the chat template), ``--new-tokens`` (1,024) greedy tokens with no stop at EOS, budget
``--budget`` (256), ``--threads`` (1). Pairs, learnkv side against the peer side:

- ``knorm`` (``--slack``, 16) against kvpress ``DecodingPress(KnormPress)`` (``compression_interval`` 16,
  ``target_size`` the budget);
- ``h2o`` (``--slack``) against kvpress ``DecodingPress(ObservedAttentionPress)`` on eager attention, kvpress's only
  H2O-like scorer (under DecodingPress it scores by the current step's attention, not a running sum: the same
  family, not the same method);
- ``knorm-lagged`` and ``h2o-lagged``: the same peers, learnkv's policy on kvpress's schedule (``interval`` 16: it
  scores and evicts every 16 steps, down to ``budget - 15``, so it still never holds more than the budget);
- ``full`` against transformers' ``model.generate`` on the same weights with SDPA attention, in this venv (the
  transformers learnkv runs on) and in the kvpress venv (the transformers kvpress pins; a second reference).

The peer side runs in ``.venv-kvpress`` as one long-lived subprocess (bench/kvpress_worker.py), loaded once. Each of
``--rounds`` rounds times every pair, its two runs back to back, the side that goes first alternating from round to
round, so both sides see the same load. A run's tokens/s is its new tokens over its wall time (prefill included);
the ratio learnkv / peer is taken round by round and reported as the median [min, max] over rounds. Budget
semantics differ: learnkv holds at most ``budget`` tokens per layer (``budget + 1`` attended in a step) and compacts
every ``slack`` evictions; kvpress grows to ``target_size + compression_interval`` and compresses back every
``compression_interval`` steps, so it attends over up to 16 more tokens per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# the repo root first: learnkv from this checkout, installed or not
sys.path.insert(0, str(ROOT))

from decode import PROMPT  # noqa: E402  (bench/decode.py: the README prompt)

from learnkv import generate, load_model  # noqa: E402
from learnkv.cli import thread_count  # noqa: E402
from learnkv.decode import encode_prompts  # noqa: E402
from learnkv.eval.metrics import agreement_length  # noqa: E402
from learnkv.model import BUNDLED  # noqa: E402

# (label, learnkv policy or "hf-generate", peer run in the worker); a "-lagged" label runs the policy with interval
# = the compression interval (`--slack`): kvpress's schedule (score and evict every 16 steps), under learnkv's budget
PAIRS = [("knorm", "knorm", "knorm"), ("h2o", "h2o", "observed"), ("full", "full", "generate"),
         ("full-hf", "full", "hf-generate"), ("knorm-lagged", "knorm", "knorm"), ("h2o-lagged", "h2o", "observed")]
PEER_NAMES = {"knorm": "kvpress DecodingPress(KnormPress)", "observed": "kvpress DecodingPress(ObservedAttentionPress)",
              "generate": "transformers generate (kvpress venv)", "hf-generate": "transformers generate (this venv)"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="a bundled alias (both sides load its folder)")
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--slack", type=int, default=16, help="learnkv's slack; kvpress's compression_interval")
    p.add_argument("--new-tokens", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=thread_count, default=1)
    p.add_argument("--pairs", default="knorm,h2o,full,full-hf",
                   help="which pairs: knorm, h2o, full (vs generate in the kvpress venv), full-hf (vs this venv's), "
                        "knorm-lagged, h2o-lagged (interval = --slack: kvpress's schedule)")
    p.add_argument("--venv", default=str(ROOT / ".venv-kvpress"), help="kvpress's venv (bench/kvpress_venv.sh)")
    p.add_argument("--json", default=None, help="write the per-round records here")
    p.add_argument("--profile", default=None, metavar="POLICY",
                   help="instead: cProfile one learnkv decode of POLICY in this setting, print the top functions")
    p.add_argument("--top", type=int, default=30, help="--profile: functions printed")
    p.add_argument("--ops", default=None, metavar="POLICIES",
                   help="instead: the torch operators a decode step of each learnkv policy runs once it evicts (the "
                        "steps from --budget + 32 to + 64 new tokens; counts are exact under any load), the most "
                        "frequent named")
    return p.parse_args(argv)


class Peer:
    """The kvpress venv's worker, one JSON line per request and answer."""

    def __init__(self, venv: str, model_dir: str, threads: int):
        python = Path(venv) / "bin" / "python"
        if not python.exists():
            raise SystemExit(f"no kvpress venv at {venv}: run `bash bench/kvpress_venv.sh` first")
        self.proc = subprocess.Popen([str(python), str(ROOT / "bench" / "kvpress_worker.py"), "--model", model_dir,
                                      "--threads", str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env={"OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1",
                                                     "PATH": "/usr/bin:/bin"})  # fmt: skip

    def run(self, name: str, ids: list[int], new_tokens: int, budget: int, interval: int) -> tuple[float, list[int]]:
        req = {"run": name, "ids": ids, "new_tokens": new_tokens, "budget": budget, "interval": interval}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the kvpress worker died (exit {self.proc.wait()}); its stderr is above")
        ans = json.loads(line)
        return ans["seconds"], ans["tokens"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def budget_of(policy: str, args) -> dict:
    """`generate`'s budget and slack for a learnkv policy of this setting (none for the full cache)."""
    return {} if policy == "full" else {"budget": args.budget, "slack": args.slack}


def profile(model, ids, mask, args) -> None:
    """Where a batch-1 decode of ``args.profile`` spends its time: cProfile, by own time and by cumulative time."""
    import cProfile  # only this mode profiles
    import pstats

    run = dict(input_ids=ids, attention_mask=mask, policy=args.profile, max_new_tokens=args.new_tokens,
               stop_at_eos=False, **budget_of(args.profile, args))
    generate(model, **dict(run, max_new_tokens=4))
    prof = cProfile.Profile()
    prof.enable()
    r = generate(model, **run)
    prof.disable()
    print(f"{args.profile}: {r.tokens_per_s:.1f} tok/s under cProfile, decode {r.decode_s:.1f} s, eviction share "
          f"{r.eviction_share:.1%}")
    for key in ("tottime", "cumulative"):
        pstats.Stats(prof).sort_stats(key).print_stats(args.top)


def count_ops(model, ids, mask, args) -> None:
    """The torch operators per decode step of each policy in ``args.ops``, over the steps from ``budget + 32`` to
    ``budget + 64`` new tokens (every evicting policy evicts at each of them): the counts of two decodes, one 32 steps
    longer, subtracted (the prefill and the steps before cancel out)."""
    from profile_step import LaunchCount  # only this mode counts (bench/profile_step.py)

    def counted(policy: str, n: int):
        with LaunchCount() as c:
            generate(model, input_ids=ids, attention_mask=mask, policy=policy, max_new_tokens=n, stop_at_eos=False,
                     **budget_of(policy, args))
        return c.ops

    start = args.budget + 32 - ids.shape[1]
    for policy in args.ops.split(","):
        short, long = counted(policy, start), counted(policy, start + 32)
        per_step = {name: (long[name] - short[name]) / 32 for name in long if long[name] != short[name]}
        top = ", ".join(f"{name} {n:g}" for name, n in sorted(per_step.items(), key=lambda x: -x[1])[: args.top])
        print(f"{policy}: {sum(per_step.values()):.1f} operators a decode step; {top}")


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    model_dir = str(BUNDLED[args.model]())
    ids, mask = encode_prompts(tok, [PROMPT])
    if args.profile:
        return profile(model, ids, mask, args)
    if args.ops:
        return count_ops(model, ids, mask, args)
    plain = None  # transformers' own model (SDPA attention) for `generate` in this venv, loaded when asked for
    peer = Peer(args.venv, model_dir, args.threads)
    labels = args.pairs.split(",")
    pairs = [p for p in PAIRS if p[0] in labels]

    def ours(policy: str, n: int, lagged: bool = False) -> tuple[float, list[int]]:
        nonlocal plain
        if policy == "hf-generate":
            if plain is None:
                from transformers import AutoModelForCausalLM  # only this reference needs the plain model

                plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                             attn_implementation="sdpa").eval()
            with torch.inference_mode():
                start = time.perf_counter()
                out = plain.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                     pad_token_id=plain.config.eos_token_id)
                return time.perf_counter() - start, out[0, ids.shape[1]:].tolist()
        start = time.perf_counter()
        params = {"policy_params": {"interval": args.slack}} if lagged else {}
        r = generate(model, input_ids=ids, attention_mask=mask, policy=policy, max_new_tokens=n, stop_at_eos=False,
                     **budget_of(policy, args), **params)
        return time.perf_counter() - start, r.tokens[0].tolist()

    def learnkv_run(label, policy, n):
        return ours(policy, n, lagged=label.endswith("-lagged"))

    def peer_run(name, n):
        return ours(name, n) if name == "hf-generate" else peer.run(name, ids[0].tolist(), n, args.budget, args.slack)

    print(f"model {args.model}, batch 1, prompt {ids.shape[1]} tokens + {args.new_tokens} new, budget "
          f"{args.budget}, slack / compression interval {args.slack}, threads {args.threads}, {args.rounds} rounds")
    for label, ours_name, peer_name in pairs:  # warm-up: loads, first-call allocations
        learnkv_run(label, ours_name, 4)
        peer_run(peer_name, 4)
    records = {p[0]: {"pair": p[0], "learnkv": p[1] + (f" interval {args.slack}" if p[0].endswith("-lagged") else ""),
                      "peer": PEER_NAMES[p[2]], "learnkv_tokens_per_s": [],
                      "peer_tokens_per_s": [], "ratio": []} for p in pairs}
    for rnd in range(args.rounds):
        for label, ours_name, peer_name in pairs:
            runs = [("learnkv", lambda: learnkv_run(label, ours_name, args.new_tokens)),
                    ("peer", lambda: peer_run(peer_name, args.new_tokens))]
            out = dict((side, fn()) for side, fn in (runs if rnd % 2 == 0 else runs[::-1]))
            rec = records[label]
            a, b = args.new_tokens / out["learnkv"][0], args.new_tokens / out["peer"][0]
            rec["learnkv_tokens_per_s"].append(a)
            rec["peer_tokens_per_s"].append(b)
            rec["ratio"].append(a / b)
            rec["tokens_equal"] = agreement_length(out["learnkv"][1], out["peer"][1])
            print(f"round {rnd + 1}: {label}: learnkv {a:.1f} tok/s, {rec['peer']} {b:.1f} tok/s, ratio {a / b:.3f}",
                  flush=True)
    peer.close()
    print(f"\n| learnkv | peer | learnkv tok/s | peer tok/s | learnkv / peer, median [min, max] over {args.rounds} "
          "rounds | greedy tokens equal |")
    print("|---|---|---|---|---|---|")
    for rec in records.values():
        r = rec["ratio"]
        print(f"| {rec['learnkv']} | {rec['peer']} | {statistics.median(rec['learnkv_tokens_per_s']):.1f} | "
              f"{statistics.median(rec['peer_tokens_per_s']):.1f} | {statistics.median(r):.3f} [{min(r):.3f}, "
              f"{max(r):.3f}] | {rec['tokens_equal']}/{args.new_tokens} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "records": list(records.values())}, indent=1))


if __name__ == "__main__":
    main()
