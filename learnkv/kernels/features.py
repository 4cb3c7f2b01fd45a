"""Triton `decode_features`: one decode step of `learnkv.features.FeatureTracker` (``update`` then ``features``)
in one launch per layer (`kernels.reference.decode_features_reference`).

The torch tracker costs dozens of small launches per layer and step (running sums, a torch.cat window shift,
the recurrence counters, ~20 ops for the features). Here program ``(b * H + h, chunk)`` owns ``BLOCK_T`` slots of
one row: it scans the row's positions once for the visible-token count and the current position, updates every
``f.*`` state tensor of its slots in place (the window shifted row by row in ``f.win [B, H, WINDOW, T]``, or, kept
among spare rows as the learned policy's tracker keeps it, ``[B, H, WINDOW + spare, T]``, only the new row written
but when the window moves back to the top: either way the layout the torch tracker keeps, so it can take over
mid-run), and writes the slots' ``[F]`` features; with ``read_out=False`` (the learned policy's steps that score
nothing: 7 of 8 at its default refresh) it stops after the update.

The key and value norms: where the state holds them (`learnkv.features.NORMS`, a tracker with ``cache_norms``, as
the learned policy's), the kernel reads each slot's cached norm (4 bytes) instead of its key and value (``2 D``
elements: 512 bytes at D = 64 in fp32, ~5x the rest of what a slot costs the kernel: its ~25 state floats and its
two attention weights), and computes from the key and value only the new slot's (the last) and any still unknown (-1),
writing them into the state; the loads of the other slots' keys and values are masked off. Without them in the
state it computes every slot's norm, as before.

The kernel reads the step's attention reduced over each group (mean and max, as the attention hands it to a policy
with ``group_reduce="mean+max"``). The arithmetic follows the tracker op by op in fp32: divisions and square roots
are correctly rounded (``div_rn``, ``sqrt_rn``), the window std is Welford's (as torch's), so integer-valued state
(counts, steps, intervals) is exact and the rest agrees to a few ulps. ``log1p`` is libdevice's on GPU; the
interpreter has no libdevice, so there it is Goldberg's ``log(u) * x / (u - 1)``, ``u = 1 + x`` (accurate to a few
ulps for the non-negative arguments used here). Float maxima and clamps propagate NaN as the tracker's torch ops do
(`kernels.nanmax`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from learnkv.kernels.nanmax import fmax
from learnkv.kernels.specialize import STEP_VARYING, fp32
from learnkv.features import FEATURES, NORMS, SINKS, STATE, WINDOW
from learnkv.sliding_rows import first_row, in_rows

# the column order the kernel writes; checked against the feature list so a change there cannot go unnoticed
_ORDER = (
    "attn", "attn_gmax", "acc_sum", "acc_mean", "acc_std", "win_mean", "win_max", "win_std", "since_high",
    "n_returns", "mean_interval", "last_interval", "max_interval", "key_norm", "value_norm", "age", "rel_pos",
    "is_sink", "layer",
)  # fmt: skip

#: the launch on CUDA: 256 slots per program, one per thread of 8 warps, and 16-wide D chunks for the norms keep
#: the kernel at ~150 registers with no spills (512 slots and 32-wide chunks took 255 and spilled).
CUDA_BLOCK_T, CUDA_BLOCK_D, CUDA_WARPS = 256, 16, 8
#: no fused multiply-add: the tracker rounds ``acc_sq / cnt - mean * mean`` (and ``acc_sq + a * a``, Welford's
#: ``m2 += delta * (x - mu)``) op by op, and a fused one gives a slot seen once a spurious std of ~1e-4 instead of 0.
#: The interpreter never fuses; ``--fmad=false`` on the GPU makes the compiled kernel round as it does.
LAUNCH_OPTIONS = {"enable_fp_fusion": False}


@triton.jit
def _log1p(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.log1p(x)
    else:
        u = 1.0 + x
        return tl.where(u == 1.0, x, tl.log(u) * tl.math.div_rn(x, tl.where(u == 1.0, 1.0, u - 1.0)))


@triton.jit
def _sq_norm(base, slot, m, s_t, s_d, D, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    total = tl.zeros([BLOCK_T], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(base + slot[:, None] * s_t + d[None, :] * s_d, mask=m[:, None] & (d[None, :] < D), other=0.0)
        x = x.to(tl.float32)
        total += tl.sum(x * x, axis=1)
    return total


@triton.jit
def _cached_norm(norm_at, base, slot, m, T, s_t, s_d, D, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """The slots' cached norms (``norm_at``: their state), the new slot's (the last) and any unknown (-1) computed
    from the key or value at ``base`` and written back."""
    norm = tl.load(norm_at, mask=m, other=0.0)
    new = m & ((slot == T - 1) | (norm < 0.0))
    norm = tl.where(new, tl.sqrt_rn(_sq_norm(base, slot, new, s_t, s_d, D, BLOCK_T, BLOCK_D)), norm)
    tl.store(norm_at, norm, mask=new)
    return norm


# the window rows move with the step; the attention and output strides scale with T
@triton.jit(do_not_specialize=STEP_VARYING + ("w_first", "w_old", "w_new", "sa_b", "sa_h", "sa_g", "so_b", "so_h"))
def _decode_features_kernel(
    attn_ptr, key_ptr, val_ptr, pos_ptr,
    acc_ptr, sq_ptr, cnt_ptr, lh_ptr, nr_ptr, si_ptr, li_ptr, mi_ptr, win_ptr, kn_ptr, vn_ptr, out_ptr,
    H, T, DK, DV, w_first, w_old, w_new, n_win_f, step_f, layer_f,
    sa_b, sa_h, sa_g, sa_t, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d, sp_b, sp_h, sp_t,
    ss_b, ss_h, ss_t, sw_b, sw_h, sw_w, sw_t, so_b, so_h, so_t, so_f,
    WIN: tl.constexpr, N_SINK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, LIBDEVICE: tl.constexpr,
    CACHED_NORMS: tl.constexpr, REWRITE: tl.constexpr, READ_OUT: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    b = (row // H).to(tl.int64)
    h = (row % H).to(tl.int64)
    p_base = pos_ptr + b * sp_b + h * sp_h

    # the whole row's visible-token count and newest position (every chunk needs them)
    n_vis = tl.zeros([BLOCK_T], dtype=tl.int32)
    p_max = tl.full([BLOCK_T], -1, dtype=tl.int64)
    for t0 in range(0, T, BLOCK_T):
        s = t0 + tl.arange(0, BLOCK_T)
        p = tl.load(p_base + s * sp_t, mask=s < T, other=-1)
        n_vis += (p >= 0).to(tl.int32)
        p_max = tl.maximum(p_max, p)
    n_f = tl.maximum(tl.sum(n_vis, axis=0), 1).to(tl.float32)
    current = tl.maximum(tl.max(p_max, axis=0), 1).to(tl.float32)
    q = tl.load(p_base + (T - 1) * sp_t)  # the step's query is the newest slot

    slot = tl.program_id(1).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    m = slot < T
    pos = tl.load(p_base + slot * sp_t, mask=m, other=-1)

    # the group's mean and max, as the attention reduced them
    a_base = attn_ptr + b * sa_b + h * sa_h + slot * sa_t
    a_mean = tl.load(a_base, mask=m, other=0.0)
    a_max = tl.load(a_base + sa_g, mask=m, other=0.0)

    # -- update: running sums, observation count
    st = b * ss_b + h * ss_h + slot * ss_t
    acc = tl.load(acc_ptr + st, mask=m) + a_mean
    tl.store(acc_ptr + st, acc, mask=m)
    acc_sq = tl.load(sq_ptr + st, mask=m) + a_mean * a_mean
    tl.store(sq_ptr + st, acc_sq, mask=m)
    seen = (pos >= 0) & (q >= 0) & (pos <= q)
    count = tl.load(cnt_ptr + st, mask=m) + seen.to(tl.float32)
    tl.store(cnt_ptr + st, count, mask=m)

    # -- update: the window moves up one row, the step's mean enters last. Its rows start at row w_old (before the
    # step) and w_new (after): the same rows in order (no spare rows, both 0) or among spare rows
    # (`learnkv.sliding_rows`), where they are rewritten only when the window moves back to the top (REWRITE), else
    # only the new row is written. Each slot's column is read and written by the same lanes in row order, so an
    # in-place move reads every old row before it is overwritten. The statistics of its last n_win rows come along:
    # sequential sum, max, Welford's mean and M2.
    w_base = win_ptr + b * sw_b + h * sw_h + slot * sw_t
    w_sum = tl.zeros([BLOCK_T], dtype=tl.float32)
    w_max = tl.full([BLOCK_T], float("-inf"), dtype=tl.float32)
    w_mu = tl.zeros([BLOCK_T], dtype=tl.float32)
    w_m2 = tl.zeros([BLOCK_T], dtype=tl.float32)
    w_k = tl.zeros([BLOCK_T], dtype=tl.float32)  # rows seen so far
    for w in tl.static_range(WIN):
        if w == WIN - 1:
            x = a_mean
            tl.store(w_base + (w_new + w) * sw_w, x, mask=m)
        else:
            x = tl.load(w_base + (w_old + w + 1) * sw_w, mask=m, other=0.0)
            if REWRITE:
                tl.store(w_base + (w_new + w) * sw_w, x, mask=m)
        if w >= w_first:
            w_k += 1.0
            w_sum += x
            w_max = fmax(w_max, x)
            delta = x - w_mu
            w_mu += tl.math.div_rn(delta, w_k)
            w_m2 += delta * (x - w_mu)

    # -- update: recurrence ("high" = above-uniform attention from any head of the group)
    high = a_max * n_f >= 1.0
    last = tl.where(slot == T - 1, step_f - 1.0, tl.load(lh_ptr + st, mask=m))  # a new slot: seen the step before
    gap = step_f - last
    ret = high & (gap >= 2.0)
    n_ret = tl.load(nr_ptr + st, mask=m) + ret.to(tl.float32)
    tl.store(nr_ptr + st, n_ret, mask=m)
    s_int = tl.load(si_ptr + st, mask=m) + tl.where(ret, gap, 0.0)
    tl.store(si_ptr + st, s_int, mask=m)
    l_int = tl.where(ret, gap, tl.load(li_ptr + st, mask=m))
    tl.store(li_ptr + st, l_int, mask=m)
    m_int = fmax(tl.load(mi_ptr + st, mask=m), tl.where(high, gap, 0.0))
    tl.store(mi_ptr + st, m_int, mask=m)
    last = tl.where(high, step_f, last)
    tl.store(lh_ptr + st, last, mask=m)
    if READ_OUT:
        # -- features, in FEATURES order; padding slots get zeros
        cnt1 = fmax(count, 1.0)
        mean = tl.math.div_rn(acc, cnt1)
        std = tl.sqrt_rn(fmax(tl.math.div_rn(acc_sq, cnt1) - mean * mean, 0.0))
        pos_f = pos.to(tl.float32)
        if CACHED_NORMS:  # the cached norms; the new slot's (the last) and unknown ones (-1) from its key and value
            k_norm = _cached_norm(kn_ptr + st, key_ptr + b * sk_b + h * sk_h, slot, m, T, sk_t, sk_d, DK, BLOCK_T,
                                  BLOCK_D)  # fmt: skip
            v_norm = _cached_norm(vn_ptr + st, val_ptr + b * sv_b + h * sv_h, slot, m, T, sv_t, sv_d, DV, BLOCK_T,
                                  BLOCK_D)  # fmt: skip
        else:
            k_norm = tl.sqrt_rn(_sq_norm(key_ptr + b * sk_b + h * sk_h, slot, m, sk_t, sk_d, DK, BLOCK_T, BLOCK_D))
            v_norm = tl.sqrt_rn(_sq_norm(val_ptr + b * sv_b + h * sv_h, slot, m, sv_t, sv_d, DV, BLOCK_T, BLOCK_D))
        valid = pos >= 0
        o_base = out_ptr + b * so_b + h * so_h + slot * so_t
        for f in tl.static_range(19):
            if f == 0:
                v = _log1p(a_mean * n_f, LIBDEVICE)
            elif f == 1:
                v = _log1p(a_max * n_f, LIBDEVICE)
            elif f == 2:
                v = _log1p(acc, LIBDEVICE)
            elif f == 3:
                v = _log1p(mean * n_f, LIBDEVICE)
            elif f == 4:
                v = _log1p(std * n_f, LIBDEVICE)
            elif f == 5:
                v = _log1p(tl.math.div_rn(w_sum, n_win_f) * n_f, LIBDEVICE)
            elif f == 6:
                v = _log1p(w_max * n_f, LIBDEVICE)
            elif f == 7:
                v = _log1p(tl.sqrt_rn(tl.math.div_rn(w_m2, n_win_f)) * n_f, LIBDEVICE)
            elif f == 8:
                v = _log1p(fmax(step_f - last, 0.0), LIBDEVICE)
            elif f == 9:
                v = _log1p(n_ret, LIBDEVICE)
            elif f == 10:
                v = _log1p(tl.math.div_rn(s_int, fmax(n_ret, 1.0)), LIBDEVICE)
            elif f == 11:
                v = _log1p(l_int, LIBDEVICE)
            elif f == 12:
                v = _log1p(m_int, LIBDEVICE)
            elif f == 13:
                v = k_norm
            elif f == 14:
                v = v_norm
            elif f == 15:
                v = _log1p(fmax(current - pos_f, 0.0), LIBDEVICE)
            elif f == 16:
                v = tl.math.div_rn(pos_f, current)
            elif f == 17:
                v = (valid & (pos < N_SINK)).to(tl.float32)
            else:
                v = tl.zeros([BLOCK_T], dtype=tl.float32) + layer_f
            tl.store(o_base + f * so_f, tl.where(valid, v, 0.0), mask=m)
    elif CACHED_NORMS:  # the update only: the new slot's norms stay unknown (-1) until a read-out computes them
        new = m & (slot == T - 1)
        tl.store(kn_ptr + st, tl.full([BLOCK_T], -1.0, dtype=tl.float32), mask=new)
        tl.store(vn_ptr + st, tl.full([BLOCK_T], -1.0, dtype=tl.float32), mask=new)


def decode_features(attn, keys, values, positions, layer: int, n_layers: int, step: int, state, spare: int = 0, *,
                    read_out: bool = True, block_t=None):
    """Triton launcher of `kernels.reference.decode_features_reference` (same arguments, same effect).

    Parameters
    ----------
    attn : Tensor
        ``[B, H, 2, 1, T]`` fp32: the group mean and max of the step's one query row's attention
        (`learnkv.features.group_mean_max`; what the fused decode attention hands a ``"mean+max"`` policy).
    keys, values : Tensor
        ``[B, H, T, D]`` any float dtype, any strides (read for their norms, in fp32).
    positions : Tensor
        ``[B, H, T]`` int64 slot positions, -1 for padding; the step's query is the last slot.
    layer, n_layers : int
        This layer and the model's layer count (the ``layer`` feature).
    step : int
        The decode step, >= 1 (the prefill stays on the torch tracker).
    state : dict[str, Tensor]
        The tracker's ``f.*`` fp32 state, updated in place: ``[B, H, T]`` tensors sharing one layout, and
        ``f.win [B, H, WINDOW, T]`` or, among spare rows (`learnkv.sliding_rows`), ``[B, H, WINDOW + spare, T]``;
        with the cached norms (`learnkv.features.NORMS`, ``[B, H, T]`` in the same
        layout) if the tracker keeps them (they are then read, and the new and unknown slots' written).
    spare : int
        The tracker's `learnkv.features.FeatureTracker.spare_rows`; a window held in order is laid out once
        (`learnkv.sliding_rows.in_rows`), as the tracker does.
    read_out : bool
        Whether to write the features after the update (False: the state update only, the features' reads and
        writes skipped; the new slot's cached norms left unknown, -1, as the tracker's update leaves them).
    block_t : int, optional
        Tuning (and tests): slots per program, a power of two.

    Returns
    -------
    Tensor or None
        ``[B, H, T, F]`` fp32 features in `learnkv.features.FEATURES` order, zero on padding slots; None without
        ``read_out``.
    """
    if FEATURES != _ORDER:
        raise RuntimeError("learnkv.features.FEATURES changed: update the kernel's columns and _ORDER")
    if positions.ndim != 3:
        raise ValueError(f"positions must be [B, H, T], got {tuple(positions.shape)}")
    B, H, T = positions.shape
    if attn.ndim != 5 or attn.shape[:2] != (B, H) or attn.shape[2:] != (2, 1, T):
        raise ValueError(f"attn must be [B, H, 2, 1, T] with [B, H, T] = {(B, H, T)}, got {tuple(attn.shape)}")
    if attn.dtype != torch.float32:  # the attention hands fp32
        raise ValueError(f"attn must be fp32, got {attn.dtype}")
    for name, x in (("keys", keys), ("values", values)):
        if x.ndim != 4 or x.shape[:3] != (B, H, T):
            raise ValueError(f"{name} must be [B, H, T, D] with [B, H, T] = {(B, H, T)}, got {tuple(x.shape)}")
    if step < 1:
        raise ValueError(f"decode_features is for decode steps (step >= 1), got step {step}")
    missing = [n for n in STATE if n not in state]
    if missing:
        raise ValueError(f"state lacks {missing}: the prefill (the torch tracker) creates it")
    first = state["f.acc"]
    layout = [s for s, n in zip(first.stride(), first.shape) if n > 1]  # a size-1 dim's stride is never used
    cached = NORMS[0] in state
    names = STATE + NORMS if cached else STATE
    if state["f.win"].ndim == 4:  # else refused below
        state["f.win"] = in_rows(state["f.win"], WINDOW, spare, step - 1)
    for name in names:
        t = state[name]
        shape = (B, H, WINDOW + spare, T) if name == "f.win" else (B, H, T)
        same = name == "f.win" or [s for s, n in zip(t.stride(), t.shape) if n > 1] == layout
        if tuple(t.shape) != shape or t.dtype != torch.float32 or not same:
            raise ValueError(f"state {name!r} must be fp32 {shape} (the [B, H, T] ones with one layout), "
                             f"got {t.dtype} {tuple(t.shape)} strides {t.stride()}")  # fmt: skip
    out = torch.empty(B, H, T, len(FEATURES) if read_out else 0, dtype=torch.float32, device=positions.device)
    if B * H * T == 0:
        return out if read_out else None

    D = max(keys.shape[-1], values.shape[-1], 1)
    if positions.is_cuda:
        default_t, block_d, warps = CUDA_BLOCK_T, min(CUDA_BLOCK_D, triton.next_power_of_2(D)), CUDA_WARPS
    else:  # the interpreter: one program per row is fastest
        default_t, block_d, warps = triton.next_power_of_2(T), triton.next_power_of_2(D), 1
    block_t = block_t or default_t
    positions = positions.long()
    layer_f = fp32(layer / max(n_layers - 1, 1))  # torch.full's fp32 value
    s = {n: state[n] for n in names}
    n_win = min(WINDOW, step + 1)  # the window rows filled so far, as the tracker counts them
    w_old, w_new = first_row(step - 1, spare), first_row(step, spare)  # both 0 without spare rows
    grid = (B * H, triton.cdiv(T, block_t))
    _decode_features_kernel[grid](
        attn, keys, values, positions,
        s["f.acc"], s["f.acc_sq"], s["f.count"], s["f.last_high"], s["f.n_returns"], s["f.sum_interval"],
        s["f.last_interval"], s["f.max_interval"], s["f.win"], s.get(NORMS[0], first), s.get(NORMS[1], first), out,
        H, T, keys.shape[-1], values.shape[-1],
        WINDOW - n_win, w_old, w_new, float(n_win), float(step), layer_f,
        attn.stride(0), attn.stride(1), attn.stride(2), attn.stride(4), *keys.stride(), *values.stride(),
        *positions.stride(), *first.stride(), *s["f.win"].stride(), *out.stride(),
        WIN=WINDOW, N_SINK=SINKS, BLOCK_T=block_t, BLOCK_D=block_d, LIBDEVICE=positions.is_cuda, CACHED_NORMS=cached,
        REWRITE=w_new == 0, READ_OUT=read_out, num_warps=warps,
        **LAUNCH_OPTIONS,
    )  # fmt: skip
    return out if read_out else None
