"""`learnkv.memory`: handing the heap's free pages back keeps a decode-like allocation pattern at what is live."""

import subprocess
import sys

import pytest

from learnkv.memory import release_free_heap

# A decode's pattern: a large chunk freed first (a prefill's temporaries: glibc raises its mmap threshold to it),
# then per step a temporary one token longer than the last, beside a piece that lives on (a snapshot). Prints the
# MB the process grew by; 200 steps keep 200 x 200 KB = 40 MB alive.
PATTERN = """
import os, sys, torch
from learnkv.memory import release_free_heap
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
big = torch.ones(30 * 2**18); del big
kept, start = [], rss()
for i in range(200):
    temp = torch.ones(2**18 + 1024 * i)
    kept.append(torch.ones(50_000))
    del temp
    if sys.argv[1] == "trim" and i % 16 == 0:
        release_free_heap()
print(rss() - start)
"""


def grown_mb(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", PATTERN, mode], capture_output=True, text=True, check=True)
    return float(out.stdout)


def test_handing_back_free_pages_keeps_memory_at_what_is_live():
    if not release_free_heap():
        pytest.skip("not glibc")
    default, trimmed = grown_mb("none"), grown_mb("trim")
    assert default > 150  # the holes of 200 freed ~1 MB temporaries stay resident
    assert trimmed < 80  # the 40 MB kept, and little else


def test_the_decode_loop_hands_back_free_pages_every_few_steps(tiny, monkeypatch):
    from learnkv import decode
    from conftest import random_ids

    calls = []
    monkeypatch.setattr(decode, "release_free_heap", lambda: calls.append(1) or True)
    decode.generate(tiny, input_ids=random_ids(8), policy="h2o", budget=6, max_new_tokens=3 * decode.TRIM_EVERY)
    assert len(calls) == 3


@pytest.mark.parametrize("policy", ["full", "h2o", "snapkv", "learned"])
def test_a_decode_s_cache_is_freed_when_it_returns_not_at_a_garbage_collection(tiny, policy):
    """No reference cycle holds a cache: its KV (GBs on a GPU) goes when the decode returns, as a GPU benchmark's
    next row needs it to (the 2026-11-30 lease ran out of memory when each layer's strong link back to its cache
    kept every earlier row's cache alive until a collection)."""
    import gc

    from conftest import params_for, prefill_for, random_ids, scorer_for

    from learnkv import decode
    from learnkv.cache import BudgetCache

    params = params_for(policy, len(tiny.model.layers))
    if policy == "learned":
        params["scorer"] = scorer_for(len(tiny.model.layers))
    gc.collect()
    gc.disable()
    try:
        decode.generate(tiny, input_ids=random_ids(24, batch=2), policy=policy, budget=None if policy == "full" else 16,
                        max_new_tokens=6, slack=2, policy_params=params, **prefill_for(policy))  # fmt: skip
        alive = sum(isinstance(o, BudgetCache) for o in gc.get_objects())
    finally:
        gc.enable()
    assert alive == 0
