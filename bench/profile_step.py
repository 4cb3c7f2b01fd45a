"""Where a budgeted decode step spends its host time: cProfile of `bench/kernel_bench.py`'s decode steps, per policy.

    python bench/profile_step.py --policies learned,h2o --batch 8 --context 8192 --budget 0.25 --slack 64

On a GPU a decode step of a small model is host-bound (bench/RESULTS.md, "On an H100"): what costs is Python,
kernel launches and device-to-host syncs, not bytes. Printed per policy: ms per step, the device-to-host syncs
per step (CUDA only, counted with `torch.cuda.set_sync_debug_mode`, each with the line that made it), and the
functions with the most own time (cProfile ``tottime``) over the timed steps; then, over one more run of the same
steps, the launches per step: the torch operators (views excluded, counted with a `TorchDispatchMode`) and the
Triton launches, the most frequent named. On a GPU each is a launch and a few microseconds of host time, so their
count is the host cost a CPU can measure too (run it with ``LEARNKV_KERNELS=triton TRITON_INTERPRET=1`` for the
GPU's kernel path).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import importlib.util
import pstats
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# the repo root first (learnkv from this checkout); bench/kernel_bench.py is loaded under its own name
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
_spec = importlib.util.spec_from_file_location("bench_kernels", Path(__file__).with_name("kernel_bench.py"))
bench_kernels = importlib.util.module_from_spec(_spec)  # the step model and the decode step
_spec.loader.exec_module(bench_kernels)


class LaunchCount(TorchDispatchMode):
    """Counts the torch operators (views excluded: they launch nothing) and the Triton launches."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.inside = False  # in a Triton launch: the interpreter's own tensor copies are not the program's

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and not self.inside:
            self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        from triton.runtime.jit import KernelInterface

        self._getitem = KernelInterface.__getitem__
        ops = self.ops

        def counted(kernel, grid):
            launch = self._getitem(kernel, grid)

            def run(*a, **k):
                ops["triton:" + getattr(kernel, "__name__", type(kernel).__name__)] += 1
                self.inside = True
                try:
                    return launch(*a, **k)
                finally:
                    self.inside = False

            return run

        KernelInterface.__getitem__ = counted
        return super().__enter__()

    def __exit__(self, *exc):
        from triton.runtime.jit import KernelInterface

        KernelInterface.__getitem__ = self._getitem
        return super().__exit__(*exc)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", default="learned,h2o")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--budget", type=float, default=0.25)
    p.add_argument("--slack", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype, (Hq, H, D) = (torch.bfloat16, (32, 8, 128)) if cuda else (torch.float32, (8, 2, 64))
    model = bench_kernels.step_model(Hq, H, D, args.layers, dtype, device)
    budget = max(1, int(args.budget * args.context))
    with tempfile.TemporaryDirectory() as tmp:
        scorer = bench_kernels.untrained_scorer(model, Path(tmp) / "scorer")
        for policy in args.policies.split(","):
            # one warm-up call (compiles, first-use loads), then the profiled one, both through the benchmark's step
            prof = cProfile.Profile()
            syncs = collections.Counter()

            def timed(run):
                run()
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.set_sync_debug_mode("warn")
                t0 = time.perf_counter()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    prof.enable()
                    run()
                    prof.disable()
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.set_sync_debug_mode(0)
                for w in caught:
                    if "synchroniz" in str(w.message):
                        syncs[f"{Path(w.filename).name}:{w.lineno}"] += 1
                return (time.perf_counter() - t0) * 1e3

            ms, _ = bench_kernels.decode_step_ms(model, policy, args.batch, budget, budget, args.steps, timed,
                                                 args.slack, scorer)  # fmt: skip
            print(f"\n## {policy}: B {args.batch}, T {args.context}, budget {budget}, slack {args.slack}, "
                  f"{args.layers} layers: {ms:.2f} ms per step; device-to-host syncs per step: "
                  f"{sum(syncs.values()) / args.steps:.2f}")  # fmt: skip
            for where, n in syncs.most_common(10):
                print(f"   sync {n / args.steps:.2f}/step at {where}")
            pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)

            counter = LaunchCount()

            def counted(run):
                run()  # the warm-up, as `timed`'s: the first step loads the scorer and seeds the learned tracker
                with counter:
                    run()
                return 0.0

            bench_kernels.decode_step_ms(model, policy, args.batch, budget, budget, args.steps, counted, args.slack,
                                         scorer)  # fmt: skip
            torch_ops = sum(n for op, n in counter.ops.items() if not op.startswith("triton:"))
            triton_ops = sum(counter.ops.values()) - torch_ops
            frequent = ", ".join(f"{op} {n / args.steps:.1f}" for op, n in counter.ops.most_common(12))
            print(f"   launches per step: {torch_ops / args.steps:.1f} torch operators + {triton_ops / args.steps:.1f} "
                  f"Triton kernels; most frequent: {frequent}")


if __name__ == "__main__":
    main()
