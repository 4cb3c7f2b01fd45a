"""Triton `gather_tokens`: compact a cache tensor to the kept slots, bitwise equal to the reference.

Any ``[B, H, ..., T, ...]`` tensor is seen as ``[B*H, M, T, R]`` (M = the dims between H and the token axis,
R = the dims after it): keys/values ``[B, H, T, D]`` are ``M = 1, R = D``; positions ``[B, H, T]`` and policy
state ``[B, H, ..., T]`` are ``R = 1``. One program copies ``BLOCK_K`` kept rows of one ``(b, h, m)``. The copy
moves raw bits (the tensor is viewed as a same-width integer type), so every dtype, NaN payload and -0.0 survives.
With ``out``, the kept rows land in the first ``K`` slots of a preallocated buffer of ``T_out`` slots (the cache's
next buffer), so a compaction reads each kept slot once and writes it once.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _gather_kernel(x_ptr, idx_ptr, out_ptr, M, T, K, T_out, R, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # over B*H*M
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mk = offs_k < K
    tok = tl.load(idx_ptr + (row // M) * K + offs_k, mask=mk, other=0)
    src = x_ptr + row * T * R + tok[:, None] * R
    dst = out_ptr + row * T_out * R + offs_k[:, None].to(tl.int64) * R
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        m = mk[:, None] & (offs_r[None, :] < R)
        tl.store(dst + offs_r[None, :], tl.load(src + offs_r[None, :], mask=m), mask=m)


def gather_tokens(x, index, dim: int, out=None, *, block_k=None):
    """Triton launcher of `kernels.reference.gather_tokens_reference`.

    Parameters
    ----------
    x : Tensor
        ``[B, H, ...]`` with the token axis at ``dim`` (>= 2 after wrapping): -2 for keys/values ``[B, H, T, D]``,
        -1 for positions and policy state ``[B, H, ..., T]``.
    index : Tensor
        ``[B, H, K]`` integer slot indices in ``[0, T)``.
    out : Tensor, optional
        A contiguous tensor shaped like ``x`` but with ``T_out >= K`` slots on the token axis, not overlapping ``x``:
        the kept slots are written to its first ``K`` (the rest is left as is).
    block_k : int, optional
        Tuning (and tests): kept slots per program, a power of two.

    Returns
    -------
    Tensor
        ``x`` with its token axis replaced by the ``K`` gathered slots, same dtype: a new contiguous tensor, or the
        first ``K`` slots of ``out``.
    """
    dim = dim % x.ndim
    if dim < 2 or index.ndim != 3 or tuple(index.shape[:2]) != tuple(x.shape[:2]):
        raise ValueError(f"need x [B, H, ..., T, ...] with dim >= 2 and index [B, H, K]; got {tuple(x.shape)}, "
                         f"dim {dim}, index {tuple(index.shape)}")  # fmt: skip
    B, H, K = index.shape
    T = x.shape[dim]
    M = math.prod(x.shape[2:dim])
    R = math.prod(x.shape[dim + 1 :])
    shape = list(x.shape)
    shape[dim] = K
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    else:
        _check_out(out, x, dim, K)
    T_out = out.shape[dim]
    result = out.narrow(dim, 0, K)
    if result.numel() == 0:
        return result
    if x.element_size() not in _BITS or x.is_complex():
        raise TypeError(f"unsupported dtype {x.dtype}")
    bits = _BITS[x.element_size()]
    src = x.contiguous().view(bits)
    index = index.contiguous()
    block_r = min(triton.next_power_of_2(R), 128)
    if x.is_cuda:
        default_k = min(1024, max(1, 2048 // block_r))  # ~16 elements per thread keeps pointers in registers
        warps = 4
    else:  # the interpreter: few, large programs
        default_k = min(triton.next_power_of_2(K), max(1, 65536 // block_r))
        warps = 1
    block_k = block_k or default_k
    grid = (B * H * M, triton.cdiv(K, block_k))
    _gather_kernel[grid](src, index, out.view(bits), M, T, K, T_out, R, BLOCK_K=block_k, BLOCK_R=block_r,
                         num_warps=warps)  # fmt: skip
    return result


def _check_out(out, x, dim: int, K: int) -> None:
    other = lambda t: t.shape[:dim] + t.shape[dim + 1 :]  # noqa: E731
    if out.dtype != x.dtype or out.device != x.device or other(out) != other(x) or out.shape[dim] < K:
        raise ValueError(f"out must be {x.dtype} on {x.device}, shaped like x {tuple(x.shape)} with >= {K} slots on "
                         f"axis {dim}; got {out.dtype} {tuple(out.shape)} on {out.device}")  # fmt: skip
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    if out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        raise ValueError("out must not share memory with x (programs would overwrite slots others still read)")
