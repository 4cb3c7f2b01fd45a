"""Before/after timing of the cheaper R-KV redundancy and SnapKV pooling (issue 43, item 2), alternating rounds.

    python bench/scoring_ab.py
    python bench/scoring_ab.py --step      # a decode step's marking, tracker window and SnapKV window instead

"Before" is the replaced code, kept verbatim in tests/test_scoring_speed.py (which proves both give the same bits);
"after" is `learnkv.policies.rkv.redundancy` and `learnkv.policies.snapkv.avg_pool`. Shapes: R-KV's redundancy at
batch 4, 3 KV heads, 900 cached keys of 64 dims (bench/profile_eviction.py's R-KV at 1k tokens), no padding; SnapKV's
pooling of batch 1, 4 and 16 x 3 heads x 516 candidates, kernel 5 (its profile's budget ~580 less the 64-token
window). Seven
rounds, the side that goes first alternating; per round after / before, median [min, max]. One thread.

``--step``: the per-step work of a long decode (batch 8, 3 KV heads, 790 slots; 30 layers stacked for the first two):
marking one dead slot per row (`kernels.cpu.select_keep_one_drop` + `learnkv.slots.mark_dead` before, the victims'
argmin and one scatter after), the learned tracker's window shift ([240, 3, 16, 790], a temporary copy before, row by
row after; tests/test_fast_paths.py keeps the replaced code) and SnapKV's 64-row window update for 30 layers
(concatenation, then the cache's copy back into its buffer before; an in-place shift after).
"""

from __future__ import annotations

import statistics
import sys
import time
from types import SimpleNamespace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the repo root before bench/ (`import kernels`); tests: the references

from test_fast_paths import update_decode_before  # noqa: E402
from test_scoring_speed import avg_pool_before, redundancy_before, snapkv_update_before  # noqa: E402

from kernels.cpu import one_drop_victims, select_keep_one_drop  # noqa: E402
from learnkv.cache import mark_victims  # noqa: E402
from learnkv.features import STATE, WINDOW, FeatureTracker  # noqa: E402
from learnkv.policies.snapkv import SnapKV  # noqa: E402
from learnkv.policies.rkv import redundancy  # noqa: E402
from learnkv.policies.snapkv import avg_pool  # noqa: E402
from learnkv.slots import mark_dead  # noqa: E402


def clock(fn, n: int) -> float:
    """Mean milliseconds of ``n`` calls."""
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e3


def step_cases(g) -> list:
    """The ``--step`` cases (see the module docstring): name, before, after, calls per round."""
    L, B, H, T = 30, 8, 3, 790
    pos = torch.arange(T).expand(L * B, H, T).contiguous()
    pos[:, :, 5:20] = -1  # dead slots (slack)
    scores, keep, live = torch.rand(L * B, H, T, generator=g), [T - 16] * (L * B), [T - 15] * (L * B)

    def mark_before():
        p = pos.clone()
        mark_dead(p, select_keep_one_drop(scores, p, keep, 4, 8, live))

    def mark_after():
        p = pos.clone()
        mark_victims(p, *one_drop_victims(scores, p, keep, 4, 8, live))

    state = {n: torch.zeros(L * B, H, *((WINDOW,) if n == "f.win" else ()), T + 17)[..., :T] for n in STATE}
    attn = torch.rand(L * B, H, 3, 1, T, generator=g) / T
    tracker = FeatureTracker(L)
    window = [torch.rand(B, H, 64, T + 17, generator=g)[..., :T] for _ in range(L)]  # the cache's buffer views
    rows = torch.rand(B, H, 1, T, generator=g)
    policy = SnapKV(window=64)

    def snapkv_before():
        for buf in window:
            view = SimpleNamespace(attn=rows, state={"window_attn": buf})
            snapkv_update_before(policy, view)
            buf.copy_(view.state["window_attn"])  # the cache's copy back into its buffer (`BudgetLayer._pack_state`)

    def snapkv_after():
        for buf in window:
            policy.update(SimpleNamespace(attn=rows, state={"window_attn": buf}))

    return [(f"mark one dead slot per row [{L * B}, {H}, {T}]", mark_before, mark_after, 3),
            (f"tracker window shift [{L * B}, {H}, {WINDOW}, {T}]", lambda: update_decode_before(attn, pos, 5, state),
             lambda: tracker._update_decode(attn, pos, 5, state), 3),
            (f"snapkv window update {L} x [{B}, {H}, 64, {T}]", snapkv_before, snapkv_after, 3)]


def main() -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    if "--step" in sys.argv[1:]:
        run(step_cases(g))
        return
    keys, valid = torch.randn(4, 3, 900, 64, generator=g), torch.ones(4, 3, 900, dtype=torch.bool)
    cases = [("rkv redundancy [4, 3, 900, 64]", lambda: redundancy_before(keys, valid, 0.5),
              lambda: redundancy(keys, valid, 0.5), 2)]
    for B in (1, 4, 16):  # batch 1: fewer than 4 rows, `avg_pool` makes the pooling call itself
        x = torch.rand(B, 3, 516, generator=g)
        cases.append((f"snapkv pooling [{B}, 3, 516], kernel 5", lambda x=x: avg_pool_before(x, 5),
                      lambda x=x: avg_pool(x, 5), 200))
    run(cases)


def run(cases: list) -> None:
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
