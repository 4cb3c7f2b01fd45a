"""`learnkv.memory`: a fixed mmap threshold keeps a decode-like allocation pattern's memory at what is live."""

import subprocess
import sys

import pytest

from learnkv.memory import fix_mmap_threshold

# A decode's pattern: a large chunk freed first (a prefill's temporaries: glibc raises its threshold to it), then
# per step a temporary one token longer than the last, beside a piece that lives on (a snapshot). Prints the MB the
# process grew by; 200 steps keep 200 x 200 KB = 40 MB alive.
PATTERN = """
import os, sys, torch
from learnkv.memory import fix_mmap_threshold
if sys.argv[1] == "fixed":
    assert fix_mmap_threshold()
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
big = torch.ones(30 * 2**18); del big
kept, start = [], rss()
for i in range(200):
    temp = torch.ones(2**18 + 1024 * i)
    kept.append(torch.ones(50_000))
    del temp
print(rss() - start)
"""


def grown_mb(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", PATTERN, mode], capture_output=True, text=True, check=True)
    return float(out.stdout)


def test_a_fixed_threshold_keeps_memory_at_what_is_live():
    if not fix_mmap_threshold():
        pytest.skip("not glibc: its allocator does not raise an mmap threshold")
    default, fixed = grown_mb("default"), grown_mb("fixed")
    assert default > 150  # the holes of 200 freed ~1 MB temporaries stay resident
    assert fixed < 80  # the 40 MB kept, and little else
