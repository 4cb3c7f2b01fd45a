"""Where eviction spends its time at 1-2k cached tokens: cProfile of one batched decode per policy (issue 43, item 2).

    python bench/profile_eviction.py                         # learned, snapkv, rkv; batch 4 of held-out chain prompts
    python bench/profile_eviction.py --policies snapkv --batch 8 --new-tokens 256 --top 25
    python bench/profile_eviction.py --policies paged --batch 16 --new-tokens 200 --fraction 0.9 --timers

Each policy decodes the same left-padded batch of held-out chain prompts (~1k tokens) for ``--new-tokens`` steps at
``--fraction`` of each row's final length (SnapKV compresses the prompts at the prefill), under cProfile. Printed
per policy: the decode's wall time and eviction share (`GenerationResult.eviction_share`), then the functions with
the most cumulative time inside the cache's eviction path (`BudgetCache` update/score/select/compact and below),
as a share of the decode's profiled time. The learned policy runs a random-init scorer bound to the model: the
same shapes, hence the same cost, as a trained one (the features and MLP do not depend on the weights' values).

``--timers``: no profiler; the wall time of a fixed set of the eviction path's functions (`TIMED`), per eviction
(a call of `BudgetCache._evict`). cProfile's cost per call inflates a path of many small ops (about twice, for the
moved rows' keys and values of a block eviction at batch 16), so the split it gives is the one to read, not its ms.
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


#: what ``--timers`` times: (owner, attribute name), outermost first
TIMED = [(BudgetCache, "_step"), (BudgetCache, "_evict"), (BudgetCache, "_score"), (BudgetCache, "_select_due_rows"),
         (kernels, "select_keep"), (BudgetCache, "_keep_slots"), (cache_module, "keep_moved_rows_of_layers"),
         (BudgetLayer, "keep_slots"), (BudgetLayer, "_move_keys_values"),
         # the learned policy's update and refresh, and the parts of them that cost the most (printed where called)
         (Learned, "update"), (FeatureTracker, "_update_decode"), (Learned, "score_layers"),
         (FeatureTracker, "features"), (features_module, "window_std"), (Scorer, "forward")]


@contextlib.contextmanager
def timers(targets=TIMED):
    """Within the block, each of ``targets`` is wrapped to record its wall time per call: yields ``{name: [s]}``."""
    spent: dict[str, list[float]] = {}
    saved = []
    for owner, name in targets:
        real = vars(owner)[name]  # a staticmethod stays one
        fn = real.__func__ if isinstance(real, staticmethod) else real

        def timed(*args, _fn=fn, _name=name, **kwargs):
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                spent.setdefault(_name, []).append(time.perf_counter() - t0)

        setattr(owner, name, staticmethod(timed) if isinstance(real, staticmethod) else timed)
        saved.append((owner, name, real))
    try:
        yield spent
    finally:
        for owner, name, real in saved:
            setattr(owner, name, real)


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
    p.add_argument("--slack", type=int, default=16)
    p.add_argument("--threads", type=thread_count, default=1)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--timers", action="store_true", help="wall time of the eviction path's functions, no profiler")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    ids, mask = encode_prompts(tok, [x.text for x in load_prompts("chain", n=args.batch, split="test")])
    lengths = mask.sum(-1).tolist()
    print(f"model {args.model}, batch {args.batch}, prompts {min(lengths)}-{max(lengths)} tokens + {args.new_tokens} "
          f"new, budget {args.fraction:.0%} of the final length, slack {args.slack}, threads {args.threads}")
    for item in args.policies.split(","):
        name, params = parse_policy(item)  # NAME[:key=value]...
        params.update({"scorer": random_scorer(model, args.model)} if name == "learned" else {})
        run = dict(input_ids=ids, attention_mask=mask, policy=name, budget=args.fraction, policy_params=params,
                   max_new_tokens=args.new_tokens, stop_at_eos=False, slack=args.slack, prefill_policy="snapkv")
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
