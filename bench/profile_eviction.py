"""Where eviction spends its time at 1-2k cached tokens: cProfile of one batched decode per policy (issue 43, item 2).

    python bench/profile_eviction.py                         # learned, snapkv, rkv; batch 4 of held-out chain prompts
    python bench/profile_eviction.py --policies snapkv --batch 8 --new-tokens 256 --top 25
    python bench/profile_eviction.py --policies paged --batch 16 --new-tokens 200 --fraction 0.9 --timers
    python bench/profile_eviction.py --policies full,h2o,snapkv --batch 16 --new-tokens 69 --budget 700 --bytes

Each policy decodes the same left-padded batch of held-out chain prompts (~1k tokens) for ``--new-tokens`` steps at
``--fraction`` of each row's final length (SnapKV compresses the prompts at the prefill), under cProfile. Printed
per policy: the decode's wall time and eviction share (`GenerationResult.eviction_share`), then the functions with
the most cumulative time inside the cache's eviction path (`BudgetCache` update/score/select/compact and below),
as a share of the decode's profiled time. The learned policy runs a random-init scorer bound to the model: the
same shapes, hence the same cost, as a trained one (the features and MLP do not depend on the weights' values).

``--timers``: no profiler; the wall time of a fixed set of the eviction path's functions (`TIMED`), per eviction
(a call of `BudgetCache._evict`). cProfile's cost per call inflates a path of many small ops (about twice, for the
moved rows' keys and values of a block eviction at batch 16), so the split it gives is the one to read, not its ms.

``--bytes``: no timing; every aten op of the decode steps counted (`op_traffic.OpTraffic`), the eviction path's
(`BudgetCache._step` and below) apart from the model's: ops, bytes read and written, and FLOPs a decode step, and
this machine's streaming rate, so that a step's bytes say how long it takes at least where it is bound by memory.
"""

from __future__ import annotations

import argparse
import cProfile
import contextlib
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

# the repo root first: learnkv from this checkout, installed or not
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.append(str(Path(__file__).resolve().parent))  # after the root: bench/op_traffic.py, when loaded by path too

from learnkv import cache as cache_module, generate, kernels, load_model  # noqa: E402
from learnkv.cache import BudgetCache  # noqa: E402
from learnkv.slots import BudgetLayer  # noqa: E402
from learnkv.cli import thread_count  # noqa: E402
from learnkv.decode import encode_prompts  # noqa: E402
from learnkv.policies.params import parse_policy  # noqa: E402
from learnkv.prompts import load_prompts  # noqa: E402
from learnkv import features as features_module  # noqa: E402
from learnkv.features import FeatureTracker  # noqa: E402
from learnkv.policies.learned import Learned  # noqa: E402
from learnkv.scorer.model import Scorer  # noqa: E402
from op_traffic import OpTraffic, Traffic, stream_rate, total  # noqa: E402 - bench/op_traffic.py


#: what ``--timers`` times: (owner, attribute name), outermost first
TIMED = [(BudgetCache, "_step"), (BudgetCache, "_evict"), (BudgetCache, "_score"), (BudgetCache, "_select_due_rows"),
         (kernels, "select_keep"), (BudgetCache, "_keep_slots"), (cache_module, "keep_moved_rows_of_layers"),
         (BudgetLayer, "keep_slots"), (BudgetLayer, "_move_keys_values"),
         # the learned policy's update and refresh, and the parts of them that cost the most (printed where called)
         (Learned, "update"), (FeatureTracker, "_update_decode"), (Learned, "score_layers"),
         (FeatureTracker, "features"), (features_module, "window_std"), (Scorer, "forward")]


@contextlib.contextmanager
def wrapped(targets, around):
    """Within the block, every call of each of ``targets`` ((owner, attribute name)) runs inside ``around(name)``, a
    context manager; the real functions are back afterwards."""
    saved = []
    for owner, name in targets:
        real = vars(owner)[name]  # a staticmethod stays one
        fn = real.__func__ if isinstance(real, staticmethod) else real

        def inside(*args, _fn=fn, _name=name, **kwargs):
            with around(_name):
                return _fn(*args, **kwargs)

        setattr(owner, name, staticmethod(inside) if isinstance(real, staticmethod) else inside)
        saved.append((owner, name, real))
    try:
        yield
    finally:
        for owner, name, real in saved:
            setattr(owner, name, real)


@contextlib.contextmanager
def timers(targets=TIMED):
    """Within the block, each of ``targets`` is wrapped to record its wall time per call: yields ``{name: [s]}``."""
    spent: dict[str, list[float]] = {}

    @contextlib.contextmanager
    def timing(name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            spent.setdefault(name, []).append(time.perf_counter() - t0)

    with wrapped(targets, timing):
        yield spent


def random_scorer(model, name: str) -> str:
    """A random-init scorer exported for ``model`` (bound to ``name``)."""
    from learnkv.scorer.artifact import export_scorer
    from learnkv.scorer.model import Scorer

    cfg = model.config
    torch.manual_seed(0)
    out = Path(tempfile.mkdtemp(prefix="learnkv-profile-")) / "scorer"
    return str(export_scorer(Scorer(cfg.num_hidden_layers), out, model=cfg.name_or_path or name,
                             n_kv_heads=cfg.num_key_value_heads))  # fmt: skip


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--policies", default="learned,snapkv,rkv", help="NAME[:key=value]... items, comma-separated")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--fraction", type=float, default=0.5)
    p.add_argument("--budget", type=int, default=None, help="the budget in tokens (instead of --fraction)")
    p.add_argument("--slack", type=int, default=16)
    p.add_argument("--threads", type=thread_count, default=1)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--timers", action="store_true", help="wall time of the eviction path's functions, no profiler")
    p.add_argument("--bytes", action="store_true", help="ops, bytes and FLOPs a decode step, no timing")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    ids, mask = encode_prompts(tok, [x.text for x in load_prompts("chain", n=args.batch, split="test")])
    lengths = mask.sum(-1).tolist()
    budget = args.fraction if args.budget is None else args.budget
    held = f"budget {args.fraction:.0%} of the final length" if args.budget is None else f"budget {args.budget}"
    print(f"model {args.model}, batch {args.batch}, prompts {min(lengths)}-{max(lengths)} tokens + {args.new_tokens} "
          f"new, {held}, slack {args.slack}, threads {args.threads}")
    if args.bytes:
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        token_kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * model.dtype.itemsize
        print(f"streaming rate (torch.add of 128 MB float32 tensors): {stream_rate() / 1e9:.1f} GB/s; a token's keys "
              f"and values over all layers: {token_kv:,} bytes\n")
        print("| policy | budgets | tokens held a row, mean | model: MB a step (read + written) | "
              "model: GFLOP a step | eviction: ops a step | eviction: MB a step (read + written) | "
              "eviction: MFLOP a step | eviction: bytes a held token | the full cache's bytes a step / these |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        full_bytes = None
    for item in args.policies.split(","):
        name, params = parse_policy(item)  # NAME[:key=value]...
        params.update({"scorer": random_scorer(model, args.model)} if name == "learned" else {})
        run = dict(input_ids=ids, attention_mask=mask, policy=name, budget=budget, policy_params=params,
                   max_new_tokens=args.new_tokens, stop_at_eos=False, slack=args.slack, prefill_policy="snapkv")
        if args.bytes:  # counts, not times: no warm-up
            full_bytes = print_traffic(item, *decode_traffic(model, run), top=args.top, full_bytes=full_bytes)
            continue
        generate(model, **dict(run, max_new_tokens=2))  # warm-up (loads the scorer)
        if args.timers:
            with timers() as spent:
                r = generate(model, **run)
            print_timers(item, r, spent)
            continue
        prof = cProfile.Profile()
        prof.enable()
        r = generate(model, **run)
        prof.disable()
        stats = pstats.Stats(prof)
        total = r.prefill_s + r.decode_s
        held = "the full cache" if r.budgets is None else f"budgets {min(r.budgets)}-{max(r.budgets)}"
        print(f"\n## {item}: {held}, decode {r.decode_s:.1f} s, prefill "
              f"{r.prefill_s:.1f} s, eviction share {r.eviction_share:.0%} (of prefill + decode)\n")
        print("| cumulative s | share of prefill + decode | calls | function |")
        print("|---|---|---|---|")
        rows = []
        for (file, line, fn), (_, calls, _, cum, _) in stats.stats.items():
            if "/learnkv/" in file or "/kernels/" in file:
                rows.append((cum, calls, f"{Path(file).parent.name}/{Path(file).name}:{line} {fn}"))
        for cum, calls, where in sorted(rows, reverse=True)[: args.top]:
            print(f"| {cum:.2f} | {cum / total:.0%} | {calls} | `{where}` |")


def decode_traffic(model, run: dict):
    """One decode of ``run`` (`generate`'s arguments) under `OpTraffic`: (its result, the number of decode steps,
    {"model": {op: Traffic}, "eviction": {op: Traffic}} summed over the decode steps, the prefill left out)."""
    traffic, forwards = OpTraffic(), []

    def from_the_first_decode_step(module, args):  # what was counted before it was the prefill's
        forwards.append(None)
        if len(forwards) == 2:
            traffic.by_op.clear()

    hook = model.register_forward_pre_hook(from_the_first_decode_step)
    try:
        with wrapped([(BudgetCache, "_step")], lambda _: traffic.bucket("eviction")), traffic.bucket("model"), traffic:
            r = generate(model, **run)
    finally:
        hook.remove()
    return r, len(forwards) - 1, {name: traffic.by_op[name] for name in ("model", "eviction")}


def print_traffic(item: str, r, steps: int, by_op: dict[str, dict[str, Traffic]], top: int,
                  full_bytes: float | None) -> float | None:
    """One row of ``--bytes``' table, per decode step: the tokens held, the model's and the eviction path's ops, MB
    and FLOPs, the eviction's bytes per token held (a row's, over all layers), and the full cache's bytes a step
    (``full_bytes``, once a "full" row has run) over this policy's; then the ``top`` ops of the eviction path by
    bytes. Returns the full cache's bytes a step (this row's if full)."""
    held = "full" if r.budgets is None else f"{min(r.budgets)}-{max(r.budgets)}"
    m, e = total(by_op["model"].values()), total(by_op["eviction"].values())
    per = max(steps, 1)
    # tokens held after each decode step, every row's (its layers' mean), on average over the steps
    decode_steps = r.kept_rows[1:]
    tokens = sum(sum(row) / len(row) for step in decode_steps for row in zip(*step)) / max(len(decode_steps), 1)
    step_bytes = (m.read + m.written + e.read + e.written) / per
    full_bytes = step_bytes if item == "full" else full_bytes
    vs_full = "-" if full_bytes is None else f"{full_bytes / step_bytes:.3f}"
    print(f"| {item} | {held} | {tokens / len(r.prompt_lengths):.0f} | {(m.read + m.written) / per / 1e6:.0f} "
          f"({m.read / per / 1e6:.0f} + {m.written / per / 1e6:.0f}) | {m.flops / per / 1e9:.2f} | {e.ops / per:.0f} | "
          f"{(e.read + e.written) / per / 1e6:.1f} ({e.read / per / 1e6:.1f} + {e.written / per / 1e6:.1f}) | "
          f"{e.flops / per / 1e6:.1f} | {(e.read + e.written) / per / max(tokens, 1):,.0f} | {vs_full} |")
    heaviest = sorted(by_op["eviction"].items(), key=lambda kv: -(kv[1].read + kv[1].written))[:top]
    print("|  | its heaviest ops: " + ", ".join(f"{op} {(t.read + t.written) / per / 1e6:.1f} MB ({t.ops / per:.0f})"
                                              for op, t in heaviest if t.ops) + " |||||||||")  # fmt: skip
    return full_bytes


def print_timers(item: str, r, spent: dict[str, list[float]]) -> None:
    """The table of ``--timers``: each timed function's calls, seconds and milliseconds per eviction."""
    held = "the full cache" if r.budgets is None else f"budgets {min(r.budgets)}-{max(r.budgets)}"
    evictions = len(spent.get("_evict", []))
    print(f"\n## {item}: {held}, decode {r.decode_s:.1f} s, prefill {r.prefill_s:.1f} s, {evictions} evictions\n")
    print("| function | calls | s | ms per eviction |")
    print("|---|---|---|---|")
    for _, name in TIMED:
        if name in spent:
            total = sum(spent[name])
            per = f"{1e3 * total / evictions:.2f}" if evictions else "-"
            print(f"| `{name}` | {len(spent[name])} | {total:.2f} | {per} |")


if __name__ == "__main__":
    main()
