"""The kernel arguments that change from one decode step to the next, which Triton must not specialise on.

Triton compiles a kernel once per *specialisation* of its integer arguments: each is classed as 1, a multiple of
16, or neither (and a pointer as 16-byte aligned or not), and a new class means a new compile (~0.3-1 s on a GPU).
The cache length ``T`` changes every step (a cache grows, then holds its budget plus up to ``slack`` dead slots), and
so do the row strides of tensors allocated over it and the learned tracker's window rows. Specialised, a long
decode walks through the classes' combinations and compiles mid-decode: the 2026-11-28 H200 lease profiled 4
compiles in 32 steps of the learned policy after a warm-up (`bench/profile_step.py`). Each kernel lists those
arguments in ``do_not_specialize`` (the names below plus its own), so a decode compiles each kernel once per
constexpr variant; `tests/test_kernel_path.py` checks that no other integer argument changes class over a decode.
"""

import struct

#: arguments named alike in every kernel that has them: the cache length
STEP_VARYING = ("T",)


def fp32(x: float) -> float:
    """``x`` rounded to fp32 (what ``float(torch.tensor(x, dtype=torch.float32))`` gives, in ~0.6 µs of host time
    instead of ~14: launchers pass such scalars at every layer of every step). Finite ``x`` within fp32's range."""
    return struct.unpack("f", struct.pack("f", x))[0]
