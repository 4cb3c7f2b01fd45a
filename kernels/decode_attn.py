"""Triton `decode_attention`: one decode step of learnkv attention plus the group-reduced attention probabilities.

Split-T design (FlashDecoding), so short batches still fill the GPU; ``[B, Hq, T]`` probabilities never reach memory:

1. `_stats_kernel`, grid ``(B*H, n_splits)``: each program takes one KV head's G query heads (padded to 16 rows
   for `tl.dot`) over one T split, loads each K block once for the whole group, and writes the split's running
   max and sum of exponentials per query head.
2. `_probs_pv_kernel`, same grid: combines the splits' statistics into the softmax's global max and normaliser,
   recomputes the scores block by block, writes the probabilities reduced over the group (``[B, H, T]``, or the
   mean and the max both, ``[B, H, 2, T]``: the learned policy's feature tracker reads the two) and the split's
   partial ``P @ V``.
3. `_combine_kernel`, grid ``(B*H,)``: sums the partial outputs over the splits in a fixed order (deterministic).

K is read twice and V once. Softmax statistics, probabilities and the output accumulate in fp32. With bf16 (or
fp16) q, K and V the dots take them as stored: ``q @ K^T`` is exact products summed in fp32 (what the reference's
fp32 upcast computes, in another order), and ``P @ V`` rounds P to V's dtype (as FlashAttention does; the error
stays below the 16-bit output's own rounding). Upcasting them for a TF32 dot held 218 registers per thread in the
statistics kernel on sm_90 (164 without). Otherwise (fp32, or mixed dtypes) both dots run in fp32 at IEEE
precision. Maxima propagate NaN as torch's (`kernels.nanmax`), so ``reduce="max"`` hands on a NaN probability
instead of dropping it.
Masking follows `learnkv_attention`: a hidden key scores the fp32 minimum, not -inf, so a query that sees no key
attends uniformly. A sliding window hides keys at ``key_pos <= query_pos - window`` too; softcapping maps scores
through ``softcap * tanh(scores / softcap)`` (tanh as ``2 * sigmoid(2x) - 1``) before masking; sink logits (one per
query head) join the softmax normaliser in `_probs_pv_kernel` and are dropped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.nanmax import fmax, rmax
from kernels.reference import REDUCE
from kernels.specialize import STEP_VARYING


def cuda_warps(block_d: int) -> int:
    """Warps per program on CUDA: 8 from 128-wide head tiles, where triton 3.6 spills at 4 (`_probs_pv_kernel` in
    bf16 at BLOCK_T 64: 254 registers and 8-16 bytes of local memory; `_stats_kernel` in fp32: 3,040 bytes; with 8:
    246 and 80 registers, no spill; triton 3.7 spills at neither)."""
    return 8 if block_d >= 128 else 4


@triton.jit
def _scores(q, k_base, kpos_base, qpos, start, t_end, offs_d, md, sk_t, sk_d, sp_t, scaling, window, softcap,
            BLOCK_T: tl.constexpr, PRECISION: tl.constexpr, F32: tl.constexpr, WINDOWED: tl.constexpr,
            SOFTCAP: tl.constexpr):  # fmt: skip
    """Masked scores ``[BLOCK_G, BLOCK_T]`` of the group's queries against keys ``start .. start + BLOCK_T``."""
    offs_t = start + tl.arange(0, BLOCK_T)
    mt = offs_t < t_end
    k = tl.load(k_base + offs_t[:, None] * sk_t + offs_d[None, :] * sk_d, mask=mt[:, None] & md[None, :], other=0.0)
    if F32:
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scaling
    if SOFTCAP:
        s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)
    kpos = tl.load(kpos_base + offs_t * sp_t, mask=mt, other=-1)
    visible = (kpos >= 0) & (kpos <= qpos)
    if WINDOWED:
        visible = visible & (kpos > qpos - window)
    s = tl.where(visible[None, :], s, -3.4028234663852886e38)  # torch.finfo(torch.float32).min
    return tl.where(mt[None, :], s, float("-inf")), offs_t, mt


@triton.jit
def _load_group(q_ptr, b, h, G, D, sq_b, sq_h, sq_d, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                F32: tl.constexpr):
    """The G query heads of KV head h, ``[BLOCK_G, BLOCK_D]``, fp32 if F32 else as stored (padding rows and columns
    are 0)."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mg = offs_g < G
    md = offs_d < D
    q_off = b * sq_b + (h * G + offs_g)[:, None].to(tl.int64) * sq_h + offs_d[None, :] * sq_d
    q = tl.load(q_ptr + q_off, mask=mg[:, None] & md[None, :], other=0.0)
    if F32:
        q = q.to(tl.float32)
    return q, offs_g, offs_d, mg, md


@triton.jit(do_not_specialize=STEP_VARYING)
def _stats_kernel(
    q_ptr, k_ptr, kpos_ptr, qpos_ptr, m_ptr, l_ptr,
    H, T, G, D, split_t, scaling, window, softcap,
    sq_b, sq_h, sq_d, sk_b, sk_h, sk_t, sk_d, sp_b, sp_h, sp_t, sqp,
    BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
    F32: tl.constexpr, WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    q, offs_g, offs_d, mg, md = _load_group(q_ptr, b, h, G, D, sq_b, sq_h, sq_d, BLOCK_G, BLOCK_D, F32)
    qpos = tl.load(qpos_ptr + b * sqp)
    k_base = k_ptr + b * sk_b + h * sk_h
    kpos_base = kpos_ptr + b * sp_b + h * sp_h
    t_begin = split * split_t
    t_end = tl.minimum(t_begin + split_t, T)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    for start in range(t_begin, t_end, BLOCK_T):
        s, _, _ = _scores(q, k_base, kpos_base, qpos, start, t_end, offs_d, md, sk_t, sk_d, sp_t, scaling, window,
                          softcap, BLOCK_T, PRECISION, F32, WINDOWED, SOFTCAP)  # fmt: skip
        m_new = fmax(m_i, rmax(s, 1))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(s - m_new[:, None]), axis=1)
        m_i = m_new
    part = (bh * tl.num_programs(1) + split).to(tl.int64) * BLOCK_G + offs_g
    tl.store(m_ptr + part, m_i)
    tl.store(l_ptr + part, l_i)


@triton.jit(do_not_specialize=STEP_VARYING)
def _probs_pv_kernel(
    q_ptr, k_ptr, v_ptr, kpos_ptr, qpos_ptr, m_ptr, l_ptr, probs_ptr, acc_ptr, sinks_ptr,
    H, T, G, D, split_t, scaling, window, softcap,
    sq_b, sq_h, sq_d, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d, sp_b, sp_h, sp_t, sqp,
    REDUCE_MEAN: tl.constexpr, REDUCE_MAX: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, F32: tl.constexpr, WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    q, offs_g, offs_d, mg, md = _load_group(q_ptr, b, h, G, D, sq_b, sq_h, sq_d, BLOCK_G, BLOCK_D, F32)
    qpos = tl.load(qpos_ptr + b * sqp)
    k_base = k_ptr + b * sk_b + h * sk_h
    v_base = v_ptr + b * sv_b + h * sv_h
    kpos_base = kpos_ptr + b * sp_b + h * sp_h
    t_begin = split * split_t
    t_end = tl.minimum(t_begin + split_t, T)

    # the softmax's global max and normaliser, from every split's statistics
    stats = bh.to(tl.int64) * n_splits * BLOCK_G + offs_g
    m_all = tl.full([BLOCK_G], float("-inf"), tl.float32)
    for i in range(0, n_splits):
        m_all = fmax(m_all, tl.load(m_ptr + stats + i * BLOCK_G))
    if SINKS:  # the head's sink logit joins the normaliser (and the max, so exp never overflows)
        sink = tl.load(sinks_ptr + h * G + offs_g, mask=mg, other=float("-inf")).to(tl.float32)
        m_all = fmax(m_all, sink)
    l_all = tl.zeros([BLOCK_G], dtype=tl.float32)
    for i in range(0, n_splits):
        l_all += tl.load(l_ptr + stats + i * BLOCK_G) * tl.exp(tl.load(m_ptr + stats + i * BLOCK_G) - m_all)
    if SINKS:
        l_all += tl.exp(sink - m_all)

    keep_row = (qpos >= 0).to(tl.float32)  # a padding query hands no attention to the cache
    # where the head's reductions go: its row of [B, H, T], or its two rows of [B, H, 2, T] (mean, then max)
    mean_row = bh.to(tl.int64) * T
    max_row = mean_row
    if REDUCE_MEAN and REDUCE_MAX:
        mean_row = mean_row * 2
        max_row = mean_row + T
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for start in range(t_begin, t_end, BLOCK_T):
        s, offs_t, mt = _scores(q, k_base, kpos_base, qpos, start, t_end, offs_d, md, sk_t, sk_d, sp_t, scaling,
                                window, softcap, BLOCK_T, PRECISION, F32, WINDOWED, SOFTCAP)  # fmt: skip
        p = tl.exp(s - m_all[:, None]) / l_all[:, None]
        p_group = tl.where(mg[:, None], p, 0.0)
        if REDUCE_MEAN:
            tl.store(probs_ptr + mean_row + offs_t, tl.sum(p_group, axis=0) / G * keep_row, mask=mt)
        if REDUCE_MAX:
            tl.store(probs_ptr + max_row + offs_t, rmax(p_group, 0) * keep_row, mask=mt)
        v_off = offs_t[:, None] * sv_t + offs_d[None, :] * sv_d
        v = tl.load(v_base + v_off, mask=mt[:, None] & md[None, :], other=0.0)
        if F32:
            acc += tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
        else:
            acc += tl.dot(p.to(v.dtype), v)
    part = (bh * n_splits + split).to(tl.int64) * BLOCK_G * BLOCK_D
    tl.store(acc_ptr + part + offs_g[:, None] * BLOCK_D + offs_d[None, :], acc)


@triton.jit(do_not_specialize=("n_splits",))  # cdiv(T, split_t): 1 or more as the cache grows
def _combine_kernel(acc_ptr, out_ptr, G, D, n_splits, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    tile = offs_g[:, None] * BLOCK_D + offs_d[None, :]
    out = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for i in range(0, n_splits):
        out += tl.load(acc_ptr + (bh * n_splits + i) * BLOCK_G * BLOCK_D + tile)
    # out is [B, 1, Hq, D] contiguous and query head h*G + g is row bh*G + g
    dst = out_ptr + (bh * G + offs_g[:, None]) * D + offs_d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=(offs_g[:, None] < G) & (offs_d[None, :] < D))


def decode_attention(
    query, key, value, key_positions, query_positions, scaling=None, reduce: str = "mean",
    *, window: int | None = None, softcap: float | None = None, sinks=None, block_t: int | None = None,
    split_t: int | None = None,
):  # fmt: skip
    """Triton launcher of `kernels.reference.decode_attention_reference` (same arguments and results).

    Parameters
    ----------
    query : Tensor
        ``[B, Hq, 1, D]`` (any strides, e.g. HF's transposed projection output).
    key, value : Tensor
        ``[B, H, T, D]`` with ``Hq = G * H``; query head ``j * G + g`` uses KV head ``j``.
    key_positions : Tensor
        ``[B, H, T]`` int64 slot positions, -1 for padding.
    query_positions : Tensor
        ``[B]`` int64 position of the step's token, -1 for a padding row.
    scaling : float, optional
        Score scale, ``D ** -0.5`` by default.
    reduce : str
        "mean", "max" or "mean+max" (both) over each KV head's G query heads.
    window, softcap, sinks : optional
        A sliding window (keys at ``key_pos <= query_pos - window`` hidden), logit softcapping, and ``[Hq]`` sink
        logits, as in the reference.
    block_t, split_t : int, optional
        Tuning: keys per inner block (power of two >= 16) and keys per split (rounded up to a multiple of
        ``block_t``). By default the splits give the GPU about four programs per SM.

    Returns
    -------
    tuple of Tensor
        Output ``[B, 1, Hq, D]`` in the query's dtype, and group-reduced probabilities ``[B, H, T]`` fp32
        (``[B, H, 2, T]``, mean then max, for "mean+max").
    """
    if reduce not in REDUCE:
        raise ValueError(f"reduce must be one of {REDUCE}, got {reduce!r}")
    B, Hq, q, D = query.shape
    _, H, T, _ = key.shape
    if q != 1 or Hq % H or value.shape != key.shape or key_positions.shape != (B, H, T) or T == 0:
        raise ValueError(f"need query [B, G*H, 1, D], key/value [B, H, T>0, D], key_positions [B, H, T]; got "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(key_positions.shape)}")  # fmt: skip
    G = Hq // H
    if scaling is None:
        scaling = D**-0.5
    device = query.device
    block_g = max(16, triton.next_power_of_2(G))
    block_d = max(16, triton.next_power_of_2(D))
    if block_t is None:
        if query.is_cuda:  # fp32 K/V tiles at 64 keys would need ~145 KB of shared memory in the P @ V kernel
            block_t = 64 if query.element_size() <= 2 else 32
        else:
            block_t = min(max(16, triton.next_power_of_2(T)), 256)
    if split_t is None:
        programs = 4 * torch.cuda.get_device_properties(device).multi_processor_count if query.is_cuda else 1
        split_t = triton.cdiv(T, max(1, programs // (B * H)))
    split_t = triton.cdiv(split_t, block_t) * block_t
    n_splits = triton.cdiv(T, split_t)
    # 16-bit dots where the three share a 16-bit dtype; not bf16 in the interpreter, whose tl.dot multiplies bf16
    # bit patterns as integers (numpy has no bf16), so there bf16 runs the fp32 path and fp16 tests the 16-bit one
    native = (torch.float16,) if not query.is_cuda else (torch.bfloat16, torch.float16)
    f32 = not (query.dtype == key.dtype == value.dtype and query.dtype in native)
    precision = "ieee"  # the fp32 dots' (the 16-bit dots take no precision)
    warps = cuda_warps(block_d) if query.is_cuda else 1

    key_positions = key_positions.long()
    query_positions = query_positions.long()
    m_part = torch.empty(B * H, n_splits, block_g, dtype=torch.float32, device=device)
    l_part = torch.empty_like(m_part)
    acc_part = torch.empty(B * H, n_splits, block_g, block_d, dtype=torch.float32, device=device)
    probs = torch.empty(B, H, *((2,) if reduce == "mean+max" else ()), T, dtype=torch.float32, device=device)
    out = torch.empty(B, 1, Hq, D, dtype=query.dtype, device=device)
    sq = (query.stride(0), query.stride(1), query.stride(3))
    grid = (B * H, n_splits)
    windowed, capped = window is not None, softcap is not None
    window, softcap = (int(window) if windowed else 0), (float(softcap) if capped else 1.0)
    has_sinks = sinks is not None
    sinks = sinks.contiguous() if has_sinks else probs  # an unused pointer when there are no sinks
    _stats_kernel[grid](
        query, key, key_positions, query_positions, m_part, l_part,
        H, T, G, D, split_t, scaling, window, softcap,
        *sq, *key.stride(), *key_positions.stride(), query_positions.stride(0),
        BLOCK_G=block_g, BLOCK_T=block_t, BLOCK_D=block_d, PRECISION=precision, F32=f32, WINDOWED=windowed,
        SOFTCAP=capped,
        num_warps=warps,
    )  # fmt: skip
    _probs_pv_kernel[grid](
        query, key, value, key_positions, query_positions, m_part, l_part, probs, acc_part, sinks,
        H, T, G, D, split_t, scaling, window, softcap,
        *sq, *key.stride(), *value.stride(), *key_positions.stride(), query_positions.stride(0),
        REDUCE_MEAN=reduce != "max", REDUCE_MAX=reduce != "mean", BLOCK_G=block_g, BLOCK_T=block_t, BLOCK_D=block_d,
        PRECISION=precision, F32=f32, WINDOWED=windowed, SOFTCAP=capped, SINKS=has_sinks, num_warps=warps,
    )  # fmt: skip
    _combine_kernel[(B * H,)](acc_part, out, G, D, n_splits, BLOCK_G=block_g, BLOCK_D=block_d, num_warps=warps)
    return out, probs
