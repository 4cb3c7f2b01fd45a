"""Keep a long CPU decode's memory at what is live under glibc's malloc.

A decode allocates, every step, tensors one token longer than the step before (attention rows, scores over the
cache) between allocations that live on (a recorded decision's snapshot, a reference's stored attention). glibc
serves such requests from its heap once its mmap threshold has risen past them (it rises to any mmapped chunk
freed, up to 32 MiB: a prefill's temporaries are such chunks), and each freed step-sized hole, too small for the
next step's request, stays resident. Trace collection of 8 chain rows at length grew by ~31-34 MB a step (15 GB by
step 565 of 1,536, 2026-11-26). `generate` hands the free pages back every `TRIM_EVERY` steps (`malloc_trim`).

Measured on that workload (SmolLM2, 8 rows of 1,000 tokens, the trace recorder with 9 teachers, steps 10-69, two
threads, one run each, 2026-11-26; resident memory at step 69): default 2.30 s a step, 3.5 GB; trimmed every step
2.02 s, 2.0 GB; every 16 steps 2.15 s, 2.0 GB (the step times are within one run's noise of each other). A fixed
128 KiB mmap threshold (``MALLOC_MMAP_THRESHOLD_``) also held 2.0 GB but costs a page fault per fresh page: 2.73 s.
"""

from __future__ import annotations

import ctypes
import ctypes.util

#: decode steps between two hand-backs: a trim costs far less than a step, and 16 steps grow the heap by ~0.5 GB
TRIM_EVERY = 16


def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to hand back this way
        return None


_TRIM = _malloc_trim()


def release_free_heap() -> bool:
    """Hand the heap's free pages back to the system (glibc's ``malloc_trim(0)``); False where there is no glibc."""
    return _TRIM is not None and (_TRIM(0) or True)


__all__ = ["release_free_heap", "TRIM_EVERY"]
