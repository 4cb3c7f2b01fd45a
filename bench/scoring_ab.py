"""Before/after timing of the cheaper R-KV redundancy and SnapKV pooling (issue 43, item 2), alternating rounds.

    python bench/scoring_ab.py

"Before" is the replaced code, kept verbatim in tests/test_scoring_speed.py (which proves both give the same bits);
"after" is `learnkv.policies.rkv.redundancy` and `learnkv.policies.snapkv.avg_pool`. Shapes: R-KV's redundancy at
batch 4, 3 KV heads, 900 cached keys of 64 dims (bench/profile_eviction.py's R-KV at 1k tokens), no padding; SnapKV's
pooling of batch 1, 4 and 16 x 3 heads x 516 candidates, kernel 5 (its profile's budget ~580 less the 64-token
window). Seven
rounds, the side that goes first alternating; per round after / before, median [min, max]. One thread.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the repo root before bench/ (`import kernels`); tests: the references

from test_scoring_speed import avg_pool_before, redundancy_before  # noqa: E402

from learnkv.policies.rkv import redundancy  # noqa: E402
from learnkv.policies.snapkv import avg_pool  # noqa: E402


def clock(fn, n: int) -> float:
    """Mean milliseconds of ``n`` calls."""
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e3


def main() -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    keys, valid = torch.randn(4, 3, 900, 64, generator=g), torch.ones(4, 3, 900, dtype=torch.bool)
    cases = [("rkv redundancy [4, 3, 900, 64]", lambda: redundancy_before(keys, valid, 0.5),
              lambda: redundancy(keys, valid, 0.5), 2)]
    for B in (1, 4, 16):  # batch 1: fewer than 4 rows, `avg_pool` makes the pooling call itself
        x = torch.rand(B, 3, 516, generator=g)
        cases.append((f"snapkv pooling [{B}, 3, 516], kernel 5", lambda x=x: avg_pool_before(x, 5),
                      lambda x=x: avg_pool(x, 5), 200))
    for name, old, new, n in cases:
        old(), new()  # warm-up
        rounds = []
        for i in range(7):
            if i % 2 == 0:
                a = clock(old, n)
                b = clock(new, n)
            else:
                b = clock(new, n)
                a = clock(old, n)
            rounds.append((a, b))
        ratio = [b / a for a, b in rounds]
        print(f"{name}: before {statistics.median(a for a, _ in rounds):.2f} ms, after "
              f"{statistics.median(b for _, b in rounds):.2f} ms, after / before {statistics.median(ratio):.2f} "
              f"[{min(ratio):.2f}, {max(ratio):.2f}] over {len(rounds)} rounds")


if __name__ == "__main__":
    main()
