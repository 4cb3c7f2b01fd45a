"""Keep a long CPU decode's memory flat under glibc's malloc.

A decode allocates, every step, tensors one token longer than the step before (attention rows, scores over the
cache) between allocations that live on (a recorded decision's snapshot, a reference's stored attention). glibc
serves a request from its heap once its mmap threshold has risen past it, and it raises that threshold to any
mmapped chunk freed, up to 32 MiB (a prefill's temporaries are such chunks). From then on, each freed step-sized
hole is too small for the next step's request and stays resident: trace collection at 1,536 steps on 8 chain rows
grew by ~34 MB a step, to 15 GB at step 565 of 1,536 (2026-11-26), where the same run with a fixed threshold held
2.3 GB. A fixed threshold sends every large request to mmap and returns it at free: memory tracks what is live.
The cost, a page fault per fresh page, did not show in that run's tokens/s.
"""

from __future__ import annotations

import ctypes
import ctypes.util

#: requests at least this large are mmapped (glibc's own starting value; fixed, so it no longer rises)
MMAP_THRESHOLD = 128 * 1024
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters, from glibc's malloc.h


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold (and trim threshold) at ``nbytes`` for this process, as the environment variables
    ``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_`` would at start-up. Returns False where the C library is
    not glibc (nothing changed). The command-line entry points call it before they load a model."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): their allocators do not raise a threshold
        return False
    return mallopt(_M_MMAP_THRESHOLD, nbytes) == 1 and mallopt(_M_TRIM_THRESHOLD, nbytes) == 1


__all__ = ["fix_mmap_threshold", "MMAP_THRESHOLD"]
