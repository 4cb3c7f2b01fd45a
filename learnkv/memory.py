"""Keep a long CPU decode's memory at what is live under glibc's malloc.

A decode allocates, every step, tensors one token longer than the step before (attention rows, scores over the
cache) between allocations that live on (a recorded decision's snapshot, a reference's stored attention). glibc
serves such requests from its heap once its mmap threshold has risen past them (it rises to any mmapped chunk
freed, up to 32 MiB: a prefill's temporaries are such chunks), and each freed step-sized hole, too small for the
next step's request, stays resident. Trace collection of 8 chain rows at length grew by ~31-34 MB a step (15 GB by
step 565 of 1,536, 2026-11-26). `generate` hands the free pages back (`malloc_trim`) when the process grew by more
than `GROWTH_LIMIT` since it last did, looked at every `TRIM_EVERY` steps (`HeapTrim`).

Measured on that workload (SmolLM2, 8 rows of 1,000 tokens, the trace recorder with 9 teachers, steps 10-69, two
threads, one run each, 2026-11-26; resident memory at step 69): default 2.30 s a step, 3.5 GB; trimmed every step
2.02 s, 2.0 GB; every 16 steps 2.15 s, 2.0 GB (the step times are within one run's noise of each other). A fixed
128 KiB mmap threshold (``MALLOC_MMAP_THRESHOLD_``) also held 2.0 GB but costs a page fault per fresh page: 2.73 s.

Not every `TRIM_EVERY` steps regardless: a decode whose heap is steady (the same buffers freed and taken again,
step after step) would then get every free page back from the system at its next use, a page fault each. A batch-8
decode at ~800 slots evicting every step took 2,300-2,500 (H2O) and 4,100-4,300 (learned) page faults a step that
way, 0-4 once the trim waited for growth and compactions kept the state in its buffers (2026-12-01,
`python bench/page_faults.py`, bench/RESULTS.md).

Several decodes in one process (`bench/turns.py`) share one heap and one resident size: each decode's look would
take the others' growth for its own, and its trim would hand back pages they are about to take again. They run
under `paused_trims`: a steady decode alone never trims (batch 8 at ~1k-1.5k tokens, full cache, H2O, SnapKV and
learned, 200 steps each, 2026-12-05), where in turns of six the first to look trimmed at every look (31-37 ms a
trim, then page faults in the others' next steps).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

#: decode steps between two looks at the process's growth: a look (and a trim) costs far less than a step
TRIM_EVERY = 16
#: resident bytes a decode may grow by before its free heap pages are handed back: above a steady decode's
#: churn, and ~8 steps of the trace collection's growth above
GROWTH_LIMIT = 256 << 20


def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to hand back this way
        return None


_TRIM = _malloc_trim()
_paused = 0  # how many `paused_trims` blocks are open
_frozen = 0  # how many `frozen_objects` blocks are open
_thaw = False  # whether the outermost block froze the objects (nobody had before it), so unfreezes them at its end


@contextmanager
def paused_trims() -> Iterator[None]:
    """No `HeapTrim` hands pages back inside this block (it may nest): for several decodes in one process."""
    global _paused
    _paused += 1
    try:
        yield
    finally:
        _paused -= 1


@contextmanager
def frozen_objects() -> Iterator[None]:
    """Python's garbage collector leaves out the objects alive at the start of this block (``gc.freeze``), until
    the last open block ends; it may nest, and it leaves a freeze it did not make (the caller's) as it was.

    A collection of the oldest generation walks every object the collector tracks: with a model, its tokenizer and
    transformers loaded, ~380k, ~170 ms, more than a step at batch 8 and ~1k tokens. CPython runs one once the
    objects that survived younger collections since the last are a quarter of the old ones, so in a process that
    has just loaded a model one comes due early in the first decode (at step 130 of an R-KV decode, 151 of a
    full-cache one: a pause in that decode's steps, and in a benchmark's first decode alone). Frozen, those objects
    are not walked; the decode's own still are. vLLM freezes its startup objects for the same reason.
    `python bench/gc_pauses.py` (bench/RESULTS.md)."""
    global _frozen, _thaw
    if _frozen == 0:
        _thaw = gc.get_freeze_count() == 0
    _frozen += 1
    gc.freeze()  # the objects of a decode started inside another one too (O(1): the generations' lists joined)
    try:
        yield
    finally:
        _frozen -= 1
        if _frozen == 0 and _thaw:
            gc.unfreeze()


def release_free_heap() -> bool:
    """Hand the heap's free pages back to the system (glibc's ``malloc_trim(0)``); False where there is no glibc."""
    return _TRIM is not None and (_TRIM(0) or True)


def resident_bytes() -> int | None:
    """The process's resident memory in bytes (Linux's ``/proc/self/statm``), None where there is none."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class HeapTrim:
    """Hands the heap's free pages back (`release_free_heap`) when the process's resident memory grew by more than
    ``limit`` bytes since the first call or the last hand-back; called every `TRIM_EVERY` decode steps. Where the
    resident size cannot be read, it hands them back at every call (as before it looked)."""

    limit: int = GROWTH_LIMIT
    since: int | None = None  # resident bytes after the last hand-back (or at the first call)

    def __call__(self) -> bool:
        """Whether it handed pages back (never inside `paused_trims`)."""
        if _paused:
            return False
        now = resident_bytes()
        if now is not None:
            if self.since is None:
                self.since = now
            if now - self.since <= self.limit:
                return False
        released = release_free_heap()
        self.since = resident_bytes()
        return released


__all__ = ["release_free_heap", "resident_bytes", "HeapTrim", "paused_trims", "frozen_objects", "TRIM_EVERY",
           "GROWTH_LIMIT"]
