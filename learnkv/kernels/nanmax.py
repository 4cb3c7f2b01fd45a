"""NaN-propagating maxima for the Triton kernels.

`tl.maximum` and `tl.max` compile to PTX ``max.f32``, which returns the other operand when one is NaN, while torch's
``maximum``, ``amax`` and ``clamp`` (and the interpreter, which runs numpy's ``maximum``) propagate NaN. The kernels
use these two instead wherever a float maximum must agree with the reference (``max.NaN.f32`` on the GPU).
"""

import triton
import triton.language as tl


@triton.jit
def fmax(a, b):
    """Elementwise maximum; NaN if either operand is NaN (torch.maximum)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def rmax(x, axis: tl.constexpr):
    """Maximum over ``axis``; NaN if any element is NaN (torch.amax)."""
    return tl.reduce(x, axis, fmax)
