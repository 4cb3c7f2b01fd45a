"""What a second OpenMP team costs a CPU torch op: why `bench/turns.py` runs its decodes in one thread.

    python bench/omp_teams.py                  # [16, 3, 1290] log1p, 2 threads, 5 rounds
    python bench/omp_teams.py --shape 8,3,790 --threads 2 --rounds 3

torch's CPU ops run on OpenMP (GNU libgomp in the PyPI wheels), which gives each thread that calls a parallel op its
own team of workers. Timed here per op, alternately in one process: ``alone`` (only this thread's team), and
``beside an idle team`` (a second thread has run one op and waits, alive, as a decode waiting for its turn did when
`bench/turns.py` gave each decode a thread). Printed: the median microseconds per op of each and their ratio,
median [min, max] over rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from learnkv.cli import thread_count  # noqa: E402


def per_op_us(x: torch.Tensor, n: int) -> float:
    """Microseconds per ``log1p`` of ``x`` over ``n`` calls (one small op: a dispatch and a parallel region)."""
    t0 = time.perf_counter()
    for _ in range(n):
        torch.log1p(x)
    return (time.perf_counter() - t0) / n * 1e6


def idle_team(x: torch.Tensor, threads: int, release: threading.Event, ready: threading.Event) -> None:
    """A thread that makes its own OpenMP team (one op), then waits alive until ``release``."""
    torch.set_num_threads(threads)
    torch.log1p(x)
    ready.set()
    release.wait()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="16,3,1290", help="the op's tensor shape, comma-separated")
    p.add_argument("--threads", type=thread_count, default=2)
    p.add_argument("--ops", type=int, default=3000, help="ops timed per measurement")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    x = torch.rand(*[int(d) for d in args.shape.split(",")])
    per_op_us(x, 500)  # warm-up: this thread's team exists
    alone, beside = [], []
    for _ in range(args.rounds):
        alone.append(per_op_us(x, args.ops))
        release, ready = threading.Event(), threading.Event()
        other = threading.Thread(target=idle_team, args=(x, args.threads, release, ready))
        other.start()
        ready.wait()
        time.sleep(0.2)  # its workers asleep, as a decode's waiting for its turn
        beside.append(per_op_us(x, args.ops))
        release.set()
        other.join()
    ratios = sorted(b / a for a, b in zip(alone, beside))
    print(f"log1p of [{args.shape}], {args.threads} threads, {args.ops} ops x {args.rounds} rounds: alone "
          f"{statistics.median(alone):.1f} us an op, beside an idle team {statistics.median(beside):.1f} us; beside / "
          f"alone {statistics.median(ratios):.2f} [{ratios[0]:.2f}, {ratios[-1]:.2f}]")


if __name__ == "__main__":
    main()
