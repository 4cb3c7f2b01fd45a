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


def test_the_decode_loop_looks_at_its_growth_every_few_steps(tiny, monkeypatch):
    from learnkv import decode
    from conftest import random_ids

    calls = []
    monkeypatch.setattr(decode, "HeapTrim", lambda: lambda: calls.append(1) or False)
    decode.generate(tiny, input_ids=random_ids(8), policy="h2o", budget=6, max_new_tokens=3 * decode.TRIM_EVERY)
    assert len(calls) == 3


def test_the_heap_is_trimmed_only_once_the_process_grew(monkeypatch):
    from learnkv import memory

    resident, trims = [100], []
    monkeypatch.setattr(memory, "resident_bytes", lambda: resident[0])
    monkeypatch.setattr(memory, "release_free_heap", lambda: trims.append(resident[0]) or True)
    trim = memory.HeapTrim(limit=50)
    for size, trimmed in [(100, False), (140, False), (150, False), (151, True), (160, False), (201, False),
                          (202, True)]:
        resident[0] = size
        assert trim() is trimmed, size
    assert trims == [151, 202]  # the second measured from the first hand-back (resident 151 after it)
    monkeypatch.setattr(memory, "resident_bytes", lambda: None)  # no /proc: every call hands back, as before
    assert memory.HeapTrim(limit=50)() and memory.HeapTrim(limit=50)()


def test_no_heap_trim_inside_paused_trims(monkeypatch):
    """`memory.paused_trims` (several decodes in one process): no `HeapTrim` hands pages back inside it, nested or
    not, and each trims as before once the block is left."""
    from learnkv import memory

    resident, trims = [100], []
    monkeypatch.setattr(memory, "resident_bytes", lambda: resident[0])
    monkeypatch.setattr(memory, "release_free_heap", lambda: trims.append(resident[0]) or True)
    trim = memory.HeapTrim(limit=10)
    trim()
    resident[0] = 500
    with memory.paused_trims():
        assert not trim()
        with memory.paused_trims():
            assert not trim() and not memory.HeapTrim(limit=0)()
        assert not trim()
    assert trims == [] and trim() and trims == [500]


# A steady decode's pattern: a compaction's, each layer's ~5 MB buffer replaced by a fresh one (allocated while the
# old one lives, then the old one freed), after a prefill. Prints the page faults per step (after 3 warm-up steps)
# when the heap is trimmed at every step, or by `HeapTrim` (it never grows).
STEADY = """
import resource, sys, torch
from learnkv.memory import HeapTrim, release_free_heap
trim = HeapTrim() if sys.argv[1] == "grown" else release_free_heap
big = torch.ones(30 * 2**18); del big  # a prefill's temporaries: glibc's mmap threshold rises to 30 MB
kept = [torch.ones(5 << 18) for _ in range(8)]
for step in range(13):
    if step == 3:
        start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for i in range(len(kept)):
        kept[i] = torch.ones(5 << 18)
    trim()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start) / 10)
"""


def test_a_steady_heap_is_not_handed_back_to_fault_in_again():
    if not release_free_heap():
        pytest.skip("not glibc")

    def faults(mode):
        out = subprocess.run([sys.executable, "-c", STEADY, mode], capture_output=True, text=True, check=True)
        return float(out.stdout)

    every, grown = faults("every"), faults("grown")
    assert every > 1000  # 8 buffers of 5 MB, ~1,280 pages each: most back from the system each step
    # 0 in most runs; 384 in some, glibc's own trim of the heap's top at a free, in some address layouts
    assert grown < every / 4


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


def test_frozen_objects_nest_and_leave_the_callers_freeze():
    """`memory.frozen_objects`: the objects alive at a block's start stay frozen until the last open block ends
    (a decode inside another's turns too); a freeze the caller made is left as it was."""
    import gc

    from learnkv import memory

    assert gc.get_freeze_count() == 0
    before = [{"a": 1}]  # a tracked object alive at the start
    with memory.frozen_objects():
        n = gc.get_freeze_count()
        assert n > 0
        inner = [{"b": 2}]
        with memory.frozen_objects():
            assert gc.get_freeze_count() > n  # the inner block froze the objects made since
        assert gc.get_freeze_count() > n  # the outer block still open: nothing thawed
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        n = gc.get_freeze_count()
        with memory.frozen_objects():
            pass
        assert gc.get_freeze_count() >= n > 0  # the caller's freeze stays
    finally:
        gc.unfreeze()
    del before, inner


def test_a_decode_freezes_the_objects_before_it(tiny):
    """`decode_steps` runs its steps inside `memory.frozen_objects`: no garbage collection walks the objects alive
    before the decode (the model's, ~380k in a real process) during it, and they are thawed after it."""
    import gc

    from conftest import random_ids
    from learnkv import generate

    counts = []
    generate(tiny, input_ids=random_ids(12, seed=1), policy="h2o", budget=8, max_new_tokens=5, stop_at_eos=False,
             on_step=lambda n: counts.append(gc.get_freeze_count()))
    assert len(counts) == 5 and min(counts) > 0 and gc.get_freeze_count() == 0
