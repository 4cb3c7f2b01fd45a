"""Triton `decode_attention`: one decode step of learnkv attention plus the group-reduced attention probabilities.

Split-T design (FlashDecoding), so short batches still fill the GPU; ``[B, Hq, T]`` probabilities never reach memory.
Each program takes one KV head's G query heads (padded to 16 rows for `tl.dot`) over one T split and loads each K and
V block once for the whole group. Two schedules, the launcher picking the one that moves fewer bytes:

- **One pass** (`_split_kernel` with ``PV``, then `_combine_kernel` rescaling, then `_probs_kernel`): K and V are
  read once, with an online softmax (FlashAttention's running max and rescaled ``P @ V``); where probabilities are
  asked for, the split also writes its raw scores (``G`` fp32 rows per KV head, ``[B*H, G, T]``), which
  `_probs_kernel` normalises with the global statistics and reduces over the group. Its extra traffic is ``8 * G``
  bytes per slot (the scores written and read), none without probabilities (``reduce=None``: the full cache's
  FlashDecoding).
- **Two passes** (`_split_kernel` without ``PV``: the statistics alone; `_probs_pv_kernel`; `_combine_kernel`
  summing): the scores recomputed, normalised and reduced, and ``P @ V`` on normalised probabilities: K is read
  twice, which costs ``D * element size`` bytes per slot, less than the one pass's ``8 * G`` only for a large group
  (multi-query attention: Falcon's 71 query heads on one KV head).

Both compute the probabilities by the same formulas in the same order (the same scores, statistics and
normalisation: equal bit for bit in the interpreter); their outputs differ in rounding (the one pass rescales partial
sums). Splits combine in a fixed order
(deterministic). Softmax statistics, probabilities and the output accumulate in fp32. With bf16 (or fp16) q, K and
V the dots take them as stored: ``q @ K^T`` is exact products summed in fp32 (what the reference's fp32 upcast
computes, in another order), and ``P @ V`` rounds P to V's dtype (as FlashAttention does; the error stays below the
16-bit output's own rounding). Upcasting them for a TF32 dot held 218 registers per thread in the statistics kernel
on sm_90 (164 without). Otherwise (fp32, or mixed dtypes) both dots run in fp32 at IEEE precision. Maxima propagate
NaN as torch's (`kernels.nanmax`), so ``reduce="max"`` hands on a NaN probability instead of dropping it.
Masking follows `learnkv_attention`: a hidden key scores the fp32 minimum, not -inf, so a query that sees no key
attends uniformly. A sliding window hides keys at ``key_pos <= query_pos - window`` too; softcapping maps scores
through ``softcap * tanh(scores / softcap)`` (tanh as ``2 * sigmoid(2x) - 1``) before masking; sink logits (one per
query head) join the softmax normaliser with the splits' statistics and are dropped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from learnkv.kernels.nanmax import fmax, rmax
from learnkv.kernels.reference import REDUCE
from learnkv.kernels.specialize import STEP_VARYING


def cuda_warps(block_d: int) -> int:
    """Warps per program on CUDA: 8 from 128-wide head tiles, where triton 3.6 spills at 4 (`_probs_pv_kernel` in
    bf16 at BLOCK_T 64: 254 registers and 8-16 bytes of local memory; the statistics kernel in fp32: 3,040 bytes;
    with 8: 246 and 80 registers, no spill; triton 3.7 spills at neither)."""
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


@triton.jit
def _program(q_ptr, k_ptr, kpos_ptr, qpos_ptr, H, T, G, D, split_t, sq_b, sq_h, sq_d, sk_b, sk_h, sp_b, sp_h, sqp,
             BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, F32: tl.constexpr):
    """What a program of grid ``(B*H, n_splits)`` works on: its KV head ``bh`` (row ``b``, head ``h``) and split, the
    group's queries (`_load_group`), the row's query position, the head's K and position rows, and its key range."""
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
    return bh, split, b, h, q, offs_g, offs_d, mg, md, qpos, k_base, kpos_base, t_begin, t_end


@triton.jit
def _pv(p, v_base, offs_t, mt, offs_d, md, sv_t, sv_d, PRECISION: tl.constexpr, F32: tl.constexpr):
    """``p [BLOCK_G, BLOCK_T] @ V`` of the block's keys, fp32 (16-bit dots round p to V's dtype)."""
    v = tl.load(v_base + offs_t[:, None] * sv_t + offs_d[None, :] * sv_d, mask=mt[:, None] & md[None, :], other=0.0)
    if F32:
        pv = tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return pv


@triton.jit
def _global_stats(m_ptr, l_ptr, sinks_ptr, bh, h, G, n_splits, offs_g, mg, BLOCK_G: tl.constexpr,
                  SINKS: tl.constexpr):
    """The softmax's global max and normaliser ``[BLOCK_G]`` of KV head ``bh``'s query heads, from every split's
    running max and sum of exponentials (``[B*H, n_splits, BLOCK_G]``), in split order; a head's sink logit joins
    the normaliser (and the max, so exp never overflows)."""
    stats = bh.to(tl.int64) * n_splits * BLOCK_G + offs_g
    m_all = tl.full([BLOCK_G], float("-inf"), tl.float32)
    for i in range(0, n_splits):
        m_all = fmax(m_all, tl.load(m_ptr + stats + i * BLOCK_G))
    if SINKS:
        sink = tl.load(sinks_ptr + h * G + offs_g, mask=mg, other=float("-inf")).to(tl.float32)
        m_all = fmax(m_all, sink)
    l_all = tl.zeros([BLOCK_G], dtype=tl.float32)
    for i in range(0, n_splits):
        l_all += tl.load(l_ptr + stats + i * BLOCK_G) * tl.exp(tl.load(m_ptr + stats + i * BLOCK_G) - m_all)
    if SINKS:
        l_all += tl.exp(sink - m_all)
    return m_all, l_all


@triton.jit
def _store_reduced(p, mg, offs_t, mt, probs_ptr, bh, T, G, keep_row, REDUCE_MEAN: tl.constexpr,
                   REDUCE_MAX: tl.constexpr):
    """Reduce the probabilities ``p [BLOCK_G, BLOCK_T]`` over the group's G heads and store them in the head's row
    of ``[B, H, T]``, or its two rows of ``[B, H, 2, T]`` (mean, then max); a padding query (``keep_row`` 0) hands
    no attention to the cache."""
    mean_row = bh.to(tl.int64) * T
    max_row = mean_row
    if REDUCE_MEAN and REDUCE_MAX:
        mean_row = mean_row * 2
        max_row = mean_row + T
    p_group = tl.where(mg[:, None], p, 0.0)
    if REDUCE_MEAN:
        tl.store(probs_ptr + mean_row + offs_t, tl.sum(p_group, axis=0) / G * keep_row, mask=mt)
    if REDUCE_MAX:
        tl.store(probs_ptr + max_row + offs_t, rmax(p_group, 0) * keep_row, mask=mt)


@triton.jit(do_not_specialize=STEP_VARYING)
def _probs_pv_kernel(
    q_ptr, k_ptr, v_ptr, kpos_ptr, qpos_ptr, m_ptr, l_ptr, probs_ptr, acc_ptr, sinks_ptr,
    H, T, G, D, split_t, scaling, window, softcap,
    sq_b, sq_h, sq_d, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d, sp_b, sp_h, sp_t, sqp,
    REDUCE_MEAN: tl.constexpr, REDUCE_MAX: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, F32: tl.constexpr, WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
):  # fmt: skip
    bh, split, b, h, q, offs_g, offs_d, mg, md, qpos, k_base, kpos_base, t_begin, t_end = _program(
        q_ptr, k_ptr, kpos_ptr, qpos_ptr, H, T, G, D, split_t, sq_b, sq_h, sq_d, sk_b, sk_h, sp_b, sp_h, sqp,
        BLOCK_G, BLOCK_D, F32)  # fmt: skip
    n_splits = tl.num_programs(1)
    v_base = v_ptr + b * sv_b + h * sv_h

    m_all, l_all = _global_stats(m_ptr, l_ptr, sinks_ptr, bh, h, G, n_splits, offs_g, mg, BLOCK_G, SINKS)
    keep_row = (qpos >= 0).to(tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for start in range(t_begin, t_end, BLOCK_T):
        s, offs_t, mt = _scores(q, k_base, kpos_base, qpos, start, t_end, offs_d, md, sk_t, sk_d, sp_t, scaling,
                                window, softcap, BLOCK_T, PRECISION, F32, WINDOWED, SOFTCAP)  # fmt: skip
        p = tl.exp(s - m_all[:, None]) / l_all[:, None]
        _store_reduced(p, mg, offs_t, mt, probs_ptr, bh, T, G, keep_row, REDUCE_MEAN, REDUCE_MAX)
        acc += _pv(p, v_base, offs_t, mt, offs_d, md, sv_t, sv_d, PRECISION, F32)
    part = (bh * n_splits + split).to(tl.int64) * BLOCK_G * BLOCK_D
    tl.store(acc_ptr + part + offs_g[:, None] * BLOCK_D + offs_d[None, :], acc)


@triton.jit(do_not_specialize=STEP_VARYING)
def _split_kernel(
    q_ptr, k_ptr, v_ptr, kpos_ptr, qpos_ptr, m_ptr, l_ptr, logits_ptr, acc_ptr,
    H, T, G, D, split_t, scaling, window, softcap,
    sq_b, sq_h, sq_d, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d, sp_b, sp_h, sp_t, sqp,
    PV: tl.constexpr, LOGITS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, F32: tl.constexpr, WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """One split's running max and sum of exponentials per query head: the two passes' first pass, and with PV the
    one pass (``P @ V`` rescaled as the max moves, from one read of K and V); with LOGITS its raw scores too
    (``[B*H, G, T]``)."""
    bh, split, b, h, q, offs_g, offs_d, mg, md, qpos, k_base, kpos_base, t_begin, t_end = _program(
        q_ptr, k_ptr, kpos_ptr, qpos_ptr, H, T, G, D, split_t, sq_b, sq_h, sq_d, sk_b, sk_h, sp_b, sp_h, sqp,
        BLOCK_G, BLOCK_D, F32)  # fmt: skip
    v_base = v_ptr + b * sv_b + h * sv_h  # read only with PV
    logit_rows = (bh.to(tl.int64) * G + offs_g) * T

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for start in range(t_begin, t_end, BLOCK_T):
        s, offs_t, mt = _scores(q, k_base, kpos_base, qpos, start, t_end, offs_d, md, sk_t, sk_d, sp_t, scaling,
                                window, softcap, BLOCK_T, PRECISION, F32, WINDOWED, SOFTCAP)  # fmt: skip
        if LOGITS:
            tl.store(logits_ptr + logit_rows[:, None] + offs_t[None, :], s, mask=mg[:, None] & mt[None, :])
        m_new = fmax(m_i, rmax(s, 1))  # finite from the first block on: every block holds a key of the split
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if PV:
            acc = acc * alpha[:, None] + _pv(p, v_base, offs_t, mt, offs_d, md, sv_t, sv_d, PRECISION, F32)
        m_i = m_new
    part = (bh * tl.num_programs(1) + split).to(tl.int64) * BLOCK_G + offs_g
    tl.store(m_ptr + part, m_i)
    tl.store(l_ptr + part, l_i)
    if PV:
        tl.store(acc_ptr + part[:, None] * BLOCK_D + offs_d[None, :], acc)


@triton.jit(do_not_specialize=STEP_VARYING)
def _probs_kernel(
    logits_ptr, qpos_ptr, m_ptr, l_ptr, probs_ptr, sinks_ptr, H, T, G, split_t, sqp,
    REDUCE_MEAN: tl.constexpr, REDUCE_MAX: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr,
    SINKS: tl.constexpr,
):  # fmt: skip
    """The one pass's raw scores of one split normalised by the global statistics and reduced over the group, as
    `_probs_pv_kernel` computes them from recomputed scores."""
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_g = tl.arange(0, BLOCK_G)
    mg = offs_g < G
    m_all, l_all = _global_stats(m_ptr, l_ptr, sinks_ptr, bh, h, G, tl.num_programs(1), offs_g, mg, BLOCK_G, SINKS)
    keep_row = (tl.load(qpos_ptr + b * sqp) >= 0).to(tl.float32)
    logit_rows = (bh.to(tl.int64) * G + offs_g) * T
    t_begin = split * split_t
    t_end = tl.minimum(t_begin + split_t, T)
    for start in range(t_begin, t_end, BLOCK_T):
        offs_t = start + tl.arange(0, BLOCK_T)
        mt = offs_t < t_end
        s = tl.load(logits_ptr + logit_rows[:, None] + offs_t[None, :], mask=mg[:, None] & mt[None, :],
                    other=float("-inf"))
        p = tl.exp(s - m_all[:, None]) / l_all[:, None]
        _store_reduced(p, mg, offs_t, mt, probs_ptr, bh, T, G, keep_row, REDUCE_MEAN, REDUCE_MAX)


@triton.jit(do_not_specialize=("n_splits",))  # cdiv(T, split_t): 1 or more as the cache grows
def _combine_kernel(acc_ptr, out_ptr, m_ptr, l_ptr, sinks_ptr, H, G, D, n_splits, BLOCK_G: tl.constexpr,
                    BLOCK_D: tl.constexpr, RESCALE: tl.constexpr, SINKS: tl.constexpr):
    """Sum the splits' partial outputs; RESCALE (the one pass): each weighted by ``exp(m_split - m_all) /
    l_all``, since its ``P @ V`` used its own running max and no normaliser."""
    bh = tl.program_id(0).to(tl.int64)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mg = offs_g < G
    tile = offs_g[:, None] * BLOCK_D + offs_d[None, :]
    out = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    if RESCALE:
        m_all, l_all = _global_stats(m_ptr, l_ptr, sinks_ptr, bh, bh % H, G, n_splits, offs_g, mg, BLOCK_G, SINKS)
    for i in range(0, n_splits):
        part = tl.load(acc_ptr + (bh * n_splits + i) * BLOCK_G * BLOCK_D + tile)
        if RESCALE:
            w = tl.exp(tl.load(m_ptr + (bh * n_splits + i) * BLOCK_G + offs_g) - m_all) / l_all
            part = part * w[:, None]
        out += part
    # out is [B, 1, Hq, D] contiguous and query head h*G + g is row bh*G + g
    dst = out_ptr + (bh * G + offs_g[:, None]) * D + offs_d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=mg[:, None] & (offs_d[None, :] < D))


def one_pass(G: int, D: int, element_size: int, reduce: str | None) -> bool:
    """Whether the one-pass schedule moves fewer bytes: its scores, written and read (``8 * G`` bytes per slot, none
    without probabilities), against the two passes' second read of K (``D * element_size``)."""
    return reduce is None or 8 * G < D * element_size


def decode_attention(
    query, key, value, key_positions, query_positions, scaling=None, reduce: str | None = "mean",
    *, window: int | None = None, softcap: float | None = None, sinks=None, block_t: int | None = None,
    split_t: int | None = None, passes: int | None = None,
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
    reduce : str or None
        "mean", "max" or "mean+max" (both) over each KV head's G query heads; None: no probabilities (the output
        alone, in one pass over K and V: a policy that reads no attention).
    window, softcap, sinks : optional
        A sliding window (keys at ``key_pos <= query_pos - window`` hidden), logit softcapping, and ``[Hq]`` sink
        logits, as in the reference.
    block_t, split_t : int, optional
        Tuning: keys per inner block (power of two >= 16) and keys per split (rounded up to a multiple of
        ``block_t``). By default the splits give the GPU about four programs per SM.
    passes : int, optional
        1 or 2: the schedule (module docstring); by default the one that moves fewer bytes (`one_pass`).

    Returns
    -------
    tuple of Tensor
        Output ``[B, 1, Hq, D]`` in the query's dtype, and group-reduced probabilities ``[B, H, T]`` fp32
        (``[B, H, 2, T]``, mean then max, for "mean+max"; None for ``reduce=None``).
    """
    if reduce is not None and reduce not in REDUCE:
        raise ValueError(f"reduce must be one of {REDUCE} or None, got {reduce!r}")
    B, Hq, q, D = query.shape
    _, H, T, _ = key.shape
    if q != 1 or Hq % H or value.shape != key.shape or key_positions.shape != (B, H, T) or T == 0:
        raise ValueError(f"need query [B, G*H, 1, D], key/value [B, H, T>0, D], key_positions [B, H, T]; got "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(key_positions.shape)}")  # fmt: skip
    G = Hq // H
    if passes is None:
        passes = 1 if one_pass(G, D, key.element_size(), reduce) else 2
    if passes not in (1, 2) or (passes == 2 and reduce is None):
        raise ValueError(f"passes must be 1 or 2 (2 only with probabilities), got {passes}")
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
    probs = None
    if reduce is not None:
        probs = torch.empty(B, H, *((2,) if reduce == "mean+max" else ()), T, dtype=torch.float32, device=device)
    out = torch.empty(B, 1, Hq, D, dtype=query.dtype, device=device)
    sq = (query.stride(0), query.stride(1), query.stride(3))
    grid = (B * H, n_splits)
    windowed, capped = window is not None, softcap is not None
    window, softcap = (int(window) if windowed else 0), (float(softcap) if capped else 1.0)
    has_sinks = sinks is not None
    sinks = sinks.contiguous() if has_sinks else m_part  # an unused pointer when there are no sinks
    terms = dict(BLOCK_G=block_g, BLOCK_T=block_t, BLOCK_D=block_d, PRECISION=precision, F32=f32, WINDOWED=windowed,
                 SOFTCAP=capped, num_warps=warps)  # fmt: skip
    reductions = dict(REDUCE_MEAN=reduce != "max", REDUCE_MAX=reduce != "mean")
    if passes == 1:
        logits = torch.empty(B * H, G, T, dtype=torch.float32, device=device) if probs is not None else m_part
        _split_kernel[grid](
            query, key, value, key_positions, query_positions, m_part, l_part, logits, acc_part,
            H, T, G, D, split_t, scaling, window, softcap,
            *sq, *key.stride(), *value.stride(), *key_positions.stride(), query_positions.stride(0),
            PV=True, LOGITS=probs is not None, **terms,
        )  # fmt: skip
        if probs is not None:
            _probs_kernel[grid](logits, query_positions, m_part, l_part, probs, sinks, H, T, G, split_t,
                                query_positions.stride(0), **reductions, BLOCK_G=block_g, BLOCK_T=block_t,
                                SINKS=has_sinks, num_warps=warps)  # fmt: skip
    else:
        _split_kernel[grid](  # the statistics alone: V, the scores' buffer and the partial outputs are not touched
            query, key, value, key_positions, query_positions, m_part, l_part, m_part, acc_part,
            H, T, G, D, split_t, scaling, window, softcap,
            *sq, *key.stride(), *value.stride(), *key_positions.stride(), query_positions.stride(0),
            PV=False, LOGITS=False, **terms,
        )  # fmt: skip
        _probs_pv_kernel[grid](
            query, key, value, key_positions, query_positions, m_part, l_part, probs, acc_part, sinks,
            H, T, G, D, split_t, scaling, window, softcap,
            *sq, *key.stride(), *value.stride(), *key_positions.stride(), query_positions.stride(0),
            **reductions, SINKS=has_sinks, **terms,
        )  # fmt: skip
    _combine_kernel[(B * H,)](acc_part, out, m_part, l_part, sinks, H, G, D, n_splits, BLOCK_G=block_g,
                              BLOCK_D=block_d, RESCALE=passes == 1, SINKS=has_sinks, num_warps=warps)  # fmt: skip
    return out, probs
