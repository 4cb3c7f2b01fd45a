"""Triton `block_scores`: PagedEviction's block scores in one pass over the keys and values.

Token score ``S = ||V|| / max(||K||, 1e-6)`` (L2 over D), averaged over the KV heads, then averaged over each full
block of ``block_size`` slots (`kernels.reference.block_scores_reference`). One program handles ``BLOCK_NB``
blocks of one batch row and loops over the heads, so K and V are read once and nothing per-token is written.
On CUDA the squared norms are summed over D in chunks of ``BLOCK_D``, so a ``[BLOCK_NB, BLOCK_S, BLOCK_D]`` tile
stays at ~2k elements (no register spills) whatever ``block_size x D`` is, up to ``block_size`` 2048.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from learnkv.kernels.nanmax import fmax


#: elements of one ``[BLOCK_NB, BLOCK_S, BLOCK_D]`` tile on CUDA, and the warps (8 per thread, per tensor: 125-154
#: registers on sm_90 for block sizes 1 to 256 at D 128; 4 warps spilled at block 64)
CUDA_TILE, CUDA_WARPS = 2048, 8


@triton.jit(do_not_specialize=("n_full",))  # the number of whole blocks: grows with the cache
def _block_scores_kernel(
    k_ptr, v_ptr, out_ptr,
    H, D, n_full, block_size,
    sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d,
    BLOCK_NB: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1) * BLOCK_NB + tl.arange(0, BLOCK_NB)
    j = tl.arange(0, BLOCK_S)
    slot = (blk[:, None] * block_size + j[None, :]).to(tl.int64)  # [NB, S]
    m2 = (blk[:, None] < n_full) & (j[None, :] < block_size)

    k_head = k_ptr + b * sk_b
    v_head = v_ptr + b * sv_b
    total = tl.zeros([BLOCK_NB, BLOCK_S], dtype=tl.float32)
    for _ in range(H):
        k_sq = tl.zeros([BLOCK_NB, BLOCK_S], dtype=tl.float32)
        v_sq = tl.zeros([BLOCK_NB, BLOCK_S], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            m3 = m2[:, :, None] & (d[None, None, :] < D)
            k = tl.load(k_head + slot[:, :, None] * sk_t + d[None, None, :] * sk_d, mask=m3, other=0.0)
            v = tl.load(v_head + slot[:, :, None] * sv_t + d[None, None, :] * sv_d, mask=m3, other=0.0)
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            k_sq += tl.sum(k * k, axis=2)
            v_sq += tl.sum(v * v, axis=2)
        k_head += sk_h
        v_head += sv_h
        total += tl.sqrt(v_sq) / fmax(tl.sqrt(k_sq), 1e-6)
    token = tl.where(m2, total / H, 0.0)
    tl.store(out_ptr + b * n_full + blk, tl.sum(token, axis=1) / block_size, mask=blk < n_full)


def block_scores(keys, values, block_size: int, *, block_nb=None):
    """Triton launcher of `kernels.reference.block_scores_reference`.

    Parameters
    ----------
    keys, values : Tensor
        ``[B, H, T, D]``, any float dtype and strides.
    block_size : int
        Slots per block.
    block_nb : int, optional
        Tuning (and tests): blocks per program, a power of two.

    Returns
    -------
    Tensor
        ``[B, T // block_size]`` fp32 mean block score (the trailing partial block is not scored).
    """
    if keys.shape != values.shape or keys.ndim != 4:
        raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} must both be [B, H, T, D]")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    B, H, T, D = keys.shape
    n_full = T // block_size
    out = torch.empty(B, n_full, dtype=torch.float32, device=keys.device)
    if out.numel() == 0:
        return out
    block_s = triton.next_power_of_2(block_size)
    if keys.is_cuda:  # [NB, S, BLOCK_D] tiles of ~2k elements: no spills
        block_d = min(triton.next_power_of_2(D), max(1, CUDA_TILE // block_s))
        default_nb = max(1, CUDA_TILE // (block_s * block_d))
        warps = CUDA_WARPS
    else:  # the interpreter: few, large programs, the whole of D at once
        block_d = triton.next_power_of_2(D)
        default_nb = min(triton.next_power_of_2(n_full), max(1, 8192 // block_s))
        warps = 1
    block_nb = block_nb or default_nb
    grid = (B, triton.cdiv(n_full, block_nb))
    _block_scores_kernel[grid](
        keys, values, out,
        H, D, n_full, block_size,
        *keys.stride(), *values.stride(),
        BLOCK_NB=block_nb, BLOCK_S=block_s, BLOCK_D=block_d, num_warps=warps,
    )  # fmt: skip
    return out
