"""Triton `select_keep`: which slots (or whole blocks) to keep, identical to `kernels.reference.select_keep_reference`.

Two kernels, one program per ``(b, h)`` row, each streaming over the row in chunks (no limit on T):

Blocks are counted from each row's first live slot (`kernels.reference.block_layout`, computed by the launcher), so
a row behind left padding is cut into the blocks it has alone.

1. `_priority_kernel` turns every unit (a slot, or a full block of ``block_size`` slots) into a unique int64 key
   ``(order-preserving bits of the fp32 priority) << IDX_BITS | unit index``. Priority is the reference's: the
   (block-mean) score, -inf for padding, +inf for protected units. Putting the index in the low bits is the
   reference's tie-break (ties prefer the more recent unit).
2. `_select_kernel` finds the ``n_keep``-th largest key by a radix select over the key's bits (RADIX_BITS per pass,
   each pass one sweep counting keys above 2**RADIX_BITS candidate thresholds), then writes the kept units' slots
   in ascending order with a cumsum compaction, followed by the trailing partial block. A row that keeps fewer
   slots than the widest row (rows may have their own ``keep``, ``n_sink`` and ``n_recent``) starts with -1 entries.

Every key is distinct, so exactly ``n_keep`` keys are >= the threshold and the result equals the reference's sort.
Block means divide with `div_rn` (IEEE) so that equal block sums give equal means; block sums are added in a
different order than torch's, so blocks whose means differ only by rounding may rank differently from the
reference. That never happens with ties (equal blocks) or with random scores in practice.

The launcher reads nothing back from the device in token mode when ``keep``, ``n_sink`` and ``n_recent`` are host
ints (one, or one per row, as the cache passes them): they go over in one non-blocking copy from pinned memory.
Block mode reads back once (the output's width depends on where each row's blocks start).
"""

from __future__ import annotations

import numbers

import torch
import triton
import triton.language as tl

from learnkv.kernels.reference import block_layout, per_row
from learnkv.kernels.specialize import STEP_VARYING

RADIX_BITS = 4
#: warps of the two kernels on CUDA (`_select_kernel` at 8 warps spills: ptxas caps it at 64 registers)
CUDA_WARPS_PRIORITY, CUDA_WARPS_SELECT = 8, 4


@triton.jit
def _row_start(scores_ptr, pos_ptr, sink_ptr, recent_ptr, H, T, ss_b, ss_h, sp_b, sp_h, sp_t,
               BLOCK_T: tl.constexpr):  # fmt: skip
    """This program's ``(b, h)`` row: its batch row ``b``, the bases of its scores and positions, its sink and recent
    window, and its newest position (one sweep: the recent window is counted back from it)."""
    row = tl.program_id(0)
    b = (row // H).to(tl.int64)
    h = (row % H).to(tl.int64)
    p_base = pos_ptr + b * sp_b + h * sp_h
    newest = tl.full([BLOCK_T], -1, tl.int64)
    for start in range(0, T, BLOCK_T):
        offs = start + tl.arange(0, BLOCK_T)
        newest = tl.maximum(newest, tl.load(p_base + offs * sp_t, mask=offs < T, other=-1))
    return (b, scores_ptr + b * ss_b + h * ss_h, p_base, tl.load(sink_ptr + b), tl.load(recent_ptr + b),
            tl.max(newest, axis=0))


@triton.jit
def _rank_key(p, unit, IDX_BITS: tl.constexpr):
    """One int64 key per unit in the reference's rank order (`rank_prefer_recent`): the order-preserving bits of
    the fp32 priority ``p`` above the unit's index, so that equal priorities rank the more recent unit higher."""
    p = tl.where(p == 0.0, 0.0, p)  # -0.0 and 0.0 tie in the reference's sort
    bits = p.to(tl.int32, bitcast=True)
    bits = tl.where(p != p, 0x7FC00000, bits)  # one NaN, above +inf as in torch's sort
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64) + 2147483648
    return (ordered << IDX_BITS) | unit.to(tl.int64)


# N (slots to order) and the row strides of tensors over the cache change with T
@triton.jit(do_not_specialize=STEP_VARYING + ("N", "ss_b", "ss_h", "sp_b", "sp_h"))
def _priority_kernel(
    scores_ptr, pos_ptr, key_ptr, sink_ptr, recent_ptr, first_ptr, nfull_ptr,
    H, T, N, block_size,
    ss_b, ss_h, ss_t, sp_b, sp_h, sp_t,
    IDX_BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    _, s_base, p_base, n_sink, n_recent, newest_pos = _row_start(scores_ptr, pos_ptr, sink_ptr, recent_ptr, H, T,
                                                                 ss_b, ss_h, sp_b, sp_h, sp_t, BLOCK_T)  # fmt: skip
    first = tl.load(first_ptr + row)  # block 0 starts at the row's first live slot (`block_layout`)
    n_full = tl.load(nfull_ptr + row)

    j = tl.arange(0, BLOCK_S)
    for start in range(0, N, BLOCK_N):
        unit = start + tl.arange(0, BLOCK_N)
        slot = first + unit[:, None] * block_size + j[None, :]
        m = (unit[:, None] < n_full) & (j[None, :] < block_size)
        s = tl.load(s_base + slot * ss_t, mask=m, other=0.0).to(tl.float32)
        pos = tl.load(p_base + slot * sp_t, mask=m, other=-1)
        valid = pos >= 0
        prot = valid & ((pos < n_sink) | (pos > newest_pos - n_recent))
        # the reference's block score; with block_size 1 it reduces exactly to the token priority
        n_valid = tl.sum(valid.to(tl.int32), axis=1)
        total = tl.sum(s * valid.to(tl.float32), axis=1)
        p = tl.math.div_rn(total, tl.maximum(n_valid, 1).to(tl.float32))
        p = tl.where(n_valid == 0, float("-inf"), p)
        p = tl.where(tl.max(prot.to(tl.int32), axis=1) > 0, float("inf"), p)
        key = _rank_key(p, unit, IDX_BITS)
        key = tl.where(unit < n_full, key, 0)  # a unit past the row's full blocks: below every real key (> 0)
        tl.store(key_ptr + row.to(tl.int64) * N + unit, key, mask=unit < N)


@triton.jit(do_not_specialize=STEP_VARYING + ("N",))
def _select_kernel(
    key_ptr, out_ptr, keep_ptr, first_ptr, nfull_ptr,
    T, N, out_len, block_size,
    N_PASSES: tl.constexpr, RADIX_BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    n_keep = tl.load(keep_ptr + row).to(tl.int32)  # units this row keeps
    first = tl.load(first_ptr + row)
    n_full = tl.load(nfull_ptr + row)
    k_base = key_ptr + row.to(tl.int64) * N
    j = tl.arange(0, BLOCK_S)
    n_tail = T - first - n_full * block_size
    # a row keeping fewer slots than the widest one starts with -1 (no slot), where left padding would be
    n_fill = out_len - n_keep * block_size - n_tail
    jn = tl.arange(0, BLOCK_N)
    for start in range(0, n_fill, BLOCK_N):
        tl.store(out_ptr + row.to(tl.int64) * out_len + start + jn, tl.full([BLOCK_N], -1, tl.int64),
                 mask=start + jn < n_fill)
    o_base = out_ptr + row.to(tl.int64) * out_len + n_fill
    digits = tl.arange(0, 1 << RADIX_BITS).to(tl.int64)

    # radix select: thr ends as the n_keep-th largest key (count(key >= thr) >= n_keep is kept invariant)
    thr = tl.zeros([1], dtype=tl.int64)
    for p in tl.static_range(N_PASSES):
        cand = thr + (digits << ((N_PASSES - 1 - p) * RADIX_BITS))
        count = tl.zeros([1 << RADIX_BITS], dtype=tl.int32)
        for start in range(0, N, BLOCK_N):
            unit = start + tl.arange(0, BLOCK_N)
            key = tl.load(k_base + unit, mask=unit < N, other=-1)
            count += tl.sum((key[:, None] >= cand[None, :]).to(tl.int32), axis=0)
        best = tl.max(tl.where(count >= n_keep, digits, 0), axis=0)
        thr = thr + (best << ((N_PASSES - 1 - p) * RADIX_BITS))
    thr = tl.where(n_keep > 0, thr, 1 << 62)  # above every key: keep no unit

    done = tl.zeros([1], dtype=tl.int32)
    for start in range(0, N, BLOCK_N):
        unit = start + tl.arange(0, BLOCK_N)
        key = tl.load(k_base + unit, mask=unit < N, other=-1)
        kept = (key >= thr).to(tl.int32)
        rank = done + tl.cumsum(kept, axis=0) - 1
        slot = first + unit[:, None].to(tl.int64) * block_size + j[None, :]
        m = (kept[:, None] > 0) & (j[None, :] < block_size)
        tl.store(o_base + rank[:, None] * block_size + j[None, :], slot, mask=m)
        done += tl.sum(kept, axis=0)
    # the trailing partial block is always kept, after the kept blocks (empty in token mode)
    tail = first + n_full * block_size
    tl.store(o_base + n_keep * block_size + j, (tail + j).to(tl.int64), mask=j < n_tail)


def _row_values(keep, n_sink, n_recent, B: int, device):
    """``keep``, ``n_sink`` and ``n_recent`` as int64 ``[B]`` tensors on ``device``, and keep's per-row values on
    the host (None if any of the three came as a tensor).

    Given as ints or sequences of ints, all three go over in one non-blocking copy from pinned memory: no
    device-to-host sync (a plain ``torch.as_tensor(..., device="cuda")`` of a host value waits for the stream)."""
    values = (keep, n_sink, n_recent)
    if any(isinstance(v, torch.Tensor) for v in values):
        return (*(per_row(v, B, device).view(B).contiguous() for v in values), None)
    rows = []
    for name, v in zip(("keep", "n_sink", "n_recent"), values):
        row = [int(v)] * B if isinstance(v, numbers.Integral) else [int(x) for x in v]
        if len(row) != B:
            raise ValueError(f"expected one value or one per row ({B} rows) for {name}, got {len(row)}")
        rows.append(row)
    if min(rows[0], default=0) < 0:
        raise ValueError(f"keep must be >= 0, got {keep}")
    host = torch.tensor(rows, dtype=torch.int64)
    if device.type == "cuda":
        host = host.pin_memory()
    dev = host.to(device, non_blocking=True)
    return dev[0], dev[1], dev[2], rows[0]


def select_keep(scores, positions, keep, n_sink, n_recent, block_size: int = 1, *, block_n=None):
    """Triton launcher of `kernels.reference.select_keep_reference` (same arguments, same result).

    Parameters
    ----------
    scores : Tensor
        ``[B, H, T]`` importance (any float dtype, any strides), higher means keep.
    positions : Tensor
        ``[B, H, T]`` int64 positions, -1 for padding.
    keep, n_sink, n_recent : int or sequence of int
        As in the reference: one for every row, or one per row.
    block_size : int
        As in the reference.
    block_n : int, optional
        Tuning (and tests): units (slots or blocks) per chunk, a power of two.

    Returns
    -------
    Tensor
        ``[B, H, K]`` int64 kept slot indices, ascending, after -1 entries in rows that keep fewer than the widest.
    """
    B, H, T = scores.shape
    device = scores.device
    if positions.shape != scores.shape:
        raise ValueError(f"positions {tuple(positions.shape)} must match scores {tuple(scores.shape)}")
    if isinstance(keep, int) and T <= keep:
        return torch.arange(T, device=device).expand(B, H, T).clone()
    bs = max(1, int(block_size))
    N = T // bs
    positions = positions.long()
    keep_b, sinks, recents, host_keep = _row_values(keep, n_sink, n_recent, B, device)
    first, n_full, n_kept = (t.reshape(B * H).contiguous() for t in block_layout(positions, keep_b, bs, check=False))
    if B * H == 0:
        out_len = 0
    elif host_keep is not None and bs == 1:  # token mode with keep known on the host: no device-to-host sync
        out_len = min(max(host_keep), T)
    else:  # one device-to-host sync for the output's width and both checks
        width = (n_kept * bs + T - first - n_full * bs).max()
        least_keep, least_kept, out_len = torch.stack([keep_b.min(), n_kept.min(), width]).tolist()
        if least_keep < 0:
            raise ValueError(f"keep must be >= 0, got {keep}")
        if least_kept < 0:
            block_layout(positions, keep_b, bs)  # raises the reference's "cannot drop" error
    out = torch.empty(B, H, out_len, dtype=torch.int64, device=device)
    if out_len == 0 or B * H == 0:
        return out

    block_s = triton.next_power_of_2(bs)
    if device.type == "cuda":
        default_n, warps, select_warps = max(1, 1024 // block_s), CUDA_WARPS_PRIORITY, CUDA_WARPS_SELECT
    else:  # the interpreter: one chunk per row is fastest
        default_n, warps, select_warps = triton.next_power_of_2(max(N, 1)), 1, 1
    block_n = block_n or default_n
    block_t = block_n * block_s  # slots per chunk of the newest-position sweep
    idx_bits = max(N - 1, 0).bit_length()
    keys = torch.empty(B * H, max(N, 1), dtype=torch.int64, device=device)
    _priority_kernel[(B * H,)](
        scores, positions, keys, sinks, recents, first, n_full,
        H, T, N, bs,
        *scores.stride(), *positions.stride(),
        IDX_BITS=idx_bits, BLOCK_N=block_n, BLOCK_S=block_s, BLOCK_T=block_t, num_warps=warps,
    )  # fmt: skip
    _select_kernel[(B * H,)](
        keys, out, n_kept, first, n_full,
        T, N, out_len, bs,
        N_PASSES=-(-(32 + idx_bits) // RADIX_BITS), RADIX_BITS=RADIX_BITS, BLOCK_N=block_n, BLOCK_S=block_s,
        num_warps=select_warps,
    )  # fmt: skip
    return out


#: the one-drop kernel's index bits: priorities' 32 order bits above 30 index bits fit an int64 below NO_KEY
ONE_DROP_IDX_BITS = 30
NO_KEY = 1 << 62
CUDA_WARPS_ONE_DROP = 4


@triton.jit
def _chunk_priority(s_base, p_base, start, T, ss_t, sp_t, n_sink, n_recent, newest_pos, BLOCK_T: tl.constexpr):
    """The slots ``start + [0, BLOCK_T)`` of a row: their offsets, which exist, which are live, and the reference's
    token priority (the fp32 score, -inf for a dead or padding slot, +inf for a protected one)."""
    offs = start + tl.arange(0, BLOCK_T)
    m = offs < T
    s = tl.load(s_base + offs * ss_t, mask=m, other=0.0).to(tl.float32)
    pos = tl.load(p_base + offs * sp_t, mask=m, other=-1)
    live = pos >= 0
    prot = live & ((pos < n_sink) | (pos > newest_pos - n_recent))
    return offs, m, live, tl.where(prot, float("inf"), tl.where(live, s, float("-inf")))


# the row strides of tensors over the cache change with T
@triton.jit(do_not_specialize=STEP_VARYING + ("ss_b", "ss_h", "sp_b", "sp_h"))
def _one_drop_kernel(
    scores_ptr, pos_ptr, keep_ptr, sink_ptr, recent_ptr,
    H, T,
    ss_b, ss_h, ss_t, sp_b, sp_h, sp_t,
    IDX_BITS: tl.constexpr, NO_KEY: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    b, s_base, p_base, n_sink, n_recent, newest_pos = _row_start(scores_ptr, pos_ptr, sink_ptr, recent_ptr, H, T,
                                                                 ss_b, ss_h, sp_b, sp_h, sp_t, BLOCK_T)  # fmt: skip
    n_drop = T - tl.load(keep_ptr + b)  # the reference drops the row's n_drop lowest-ranked slots

    # one sweep: the lowest-ranked live slot's key, and how many slots rank at -inf (dead ones and any live -inf)
    lowest = tl.full([BLOCK_T], NO_KEY, tl.int64)
    n_low = tl.zeros([BLOCK_T], dtype=tl.int32)
    n_dead = tl.zeros([BLOCK_T], dtype=tl.int32)
    for start in range(0, T, BLOCK_T):
        offs, m, live, p = _chunk_priority(s_base, p_base, start, T, ss_t, sp_t, n_sink, n_recent, newest_pos,
                                           BLOCK_T)  # fmt: skip
        lowest = tl.minimum(lowest, tl.where(live, _rank_key(p, offs, IDX_BITS), NO_KEY))
        n_low += (m & (p == float("-inf"))).to(tl.int32)
        n_dead += (m & ~live).to(tl.int32)
    lowest_key = tl.min(lowest, axis=0)
    n_low_row = tl.sum(n_low, axis=0)
    n_dead_row = tl.sum(n_dead, axis=0)

    if n_low_row < n_drop:
        # every -inf slot is dead and one more goes: the lowest-ranked live slot (none in a row with none live)
        if lowest_key < NO_KEY:
            tl.store(p_base + (lowest_key & ((1 << IDX_BITS) - 1)) * sp_t, -1)
    elif n_low_row > n_dead_row:
        # live slots scored -inf tie with the dead ones: the n_drop oldest slots of that tie go, as in the sort
        done = tl.zeros([1], dtype=tl.int32)
        for start in range(0, T, BLOCK_T):
            offs, m, live, p = _chunk_priority(s_base, p_base, start, T, ss_t, sp_t, n_sink, n_recent, newest_pos,
                                               BLOCK_T)  # fmt: skip
            low = (m & (p == float("-inf"))).to(tl.int32)
            rank = done + tl.cumsum(low, axis=0)
            tl.store(p_base + offs * sp_t, tl.full([BLOCK_T], -1, tl.int64), mask=(low > 0) & live & (rank <= n_drop))
            done += tl.sum(low, axis=0)


def mark_one_drop(scores, positions, keep, n_sink, n_recent, *, block_t=None) -> None:
    """Triton `kernels.reference.mark_one_drop_reference`: mark dead (position -1), in place, every slot the
    reference's selection drops, where no ``(b, h)`` row holds more than ``keep + 1`` live slots (the caller's
    precondition: it knows each row's live slots on the host). Reads nothing back from the device.

    One program per row, two sweeps (the newest position for the recent window; the lowest-ranked live slot's
    `_rank_key`, the reference's rank order, and the count of slots at -inf priority), one store: where a row must
    drop one slot more than its dead ones, the lowest-ranked live slot. No kept index is built (`select_keep`
    ranks every slot in radix passes, ~0.7 ms per layer at batch 32 and 32k slots on an H200) nor turned back
    into a mask. A live slot scored -inf ties with the dead slots, and the sort then drops the oldest of that
    tie: a third sweep marks them so, in the rare row that has one.

    ``block_t``: tuning (and tests), slots per chunk, a power of two.
    """
    B, H, T = scores.shape
    if positions.shape != scores.shape or positions.dtype != torch.int64:
        raise ValueError(f"positions {tuple(positions.shape)} {positions.dtype} must be int64 and match scores "
                         f"{tuple(scores.shape)}")  # fmt: skip
    if T >= 1 << ONE_DROP_IDX_BITS:
        raise ValueError(f"at most {(1 << ONE_DROP_IDX_BITS) - 1} slots per row, got {T}")
    if B * H == 0 or T == 0:
        return
    device = scores.device
    keep_b, sinks, recents, _ = _row_values(keep, n_sink, n_recent, B, device)
    cuda = device.type == "cuda"
    block_t = block_t or (1024 if cuda else triton.next_power_of_2(T))  # the interpreter: one chunk per row
    _one_drop_kernel[(B * H,)](
        scores, positions, keep_b, sinks, recents,
        H, T,
        *scores.stride(), *positions.stride(),
        IDX_BITS=ONE_DROP_IDX_BITS, NO_KEY=NO_KEY, BLOCK_T=block_t, num_warps=CUDA_WARPS_ONE_DROP if cuda else 1,
    )  # fmt: skip
