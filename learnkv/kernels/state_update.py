"""Triton `update_token_state`: one step's per-token policy statistics, fused, in place
(`kernels.reference.update_token_state_reference`).

One launch per layer covers the whole cache: program ``(b * H + h, chunk)`` reads a chunk of ``BLOCK_T`` slots of
the step's attention and positions once, and updates every state tensor it is given (H2O's ``acc``, RoCo's
``s1``/``s2``/``count``, LazyEviction's ``ts``/``mri``). Skipped states cost nothing: each is a constexpr flag.
The arithmetic is the reference's, one fp32 operation per statistic, so integer-valued state (``count``, ``ts``,
``mri``) is exact and the sums round alike: the launch turns off fused multiply-adds (`LAUNCH_OPTIONS`), so ``s2``
rounds ``a * a`` before adding it as torch does, and ``mri``'s maximum propagates NaN as torch's (`kernels.nanmax`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from learnkv.kernels.nanmax import fmax
from learnkv.kernels.specialize import STEP_VARYING, fp32

#: ``s2 += a * a`` rounded op by op, as the reference (the interpreter never fuses; ``--fmad=false`` on the GPU)
LAUNCH_OPTIONS = {"enable_fp_fusion": False}


# the row strides of tensors over the cache scale with T
@triton.jit(do_not_specialize=STEP_VARYING + ("sm_b", "sm_h", "sx_b", "sx_h", "sp_b", "sp_h", "ss_b", "ss_h"))
def _state_update_kernel(
    mean_ptr, max_ptr, pos_ptr, acc_ptr, s1_ptr, s2_ptr, count_ptr, ts_ptr, mri_ptr,
    H, T, n_new, step_f, alpha,
    sm_b, sm_h, sm_t, sx_b, sx_h, sx_t, sp_b, sp_h, sp_t, ss_b, ss_h, ss_t,
    HAS_ACC: tl.constexpr, HAS_S1: tl.constexpr, HAS_S2: tl.constexpr, HAS_COUNT: tl.constexpr,
    HAS_LAZY: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    b = (row // H).to(tl.int64)
    h = (row % H).to(tl.int64)
    slot = tl.program_id(1).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    m = slot < T
    st = b * ss_b + h * ss_h + slot * ss_t  # every state tensor has the same layout

    if HAS_ACC or HAS_S1 or HAS_S2:
        a = tl.load(mean_ptr + b * sm_b + h * sm_h + slot * sm_t, mask=m, other=0.0).to(tl.float32)
        if HAS_ACC:
            tl.store(acc_ptr + st, tl.load(acc_ptr + st, mask=m) + a, mask=m)
        if HAS_S1:
            tl.store(s1_ptr + st, tl.load(s1_ptr + st, mask=m) + a, mask=m)
        if HAS_S2:
            tl.store(s2_ptr + st, tl.load(s2_ptr + st, mask=m) + a * a, mask=m)

    if HAS_COUNT:
        p_base = pos_ptr + b * sp_b + h * sp_h
        pos = tl.load(p_base + slot * sp_t, mask=m, other=-1)
        seen = tl.zeros([BLOCK_T], dtype=tl.int32)
        for j in range(T - n_new, T):  # the step's queries are its new slots
            q = tl.load(p_base + j * sp_t)
            seen += ((pos >= 0) & (q >= 0) & (pos <= q)).to(tl.int32)
        tl.store(count_ptr + st, tl.load(count_ptr + st, mask=m) + seen.to(tl.float32), mask=m)

    if HAS_LAZY:
        ts = tl.load(ts_ptr + st, mask=m, other=0.0)
        prev = tl.where(slot >= T - n_new, step_f - 1.0, ts)  # a new slot starts as if seen one step ago
        hot = tl.load(max_ptr + b * sx_b + h * sx_h + slot * sx_t, mask=m, other=0.0).to(tl.float32) >= alpha
        new = tl.where(hot, step_f, prev)
        tl.store(ts_ptr + st, new, mask=m)
        tl.store(mri_ptr + st, fmax(tl.load(mri_ptr + st, mask=m), new - prev), mask=m)


def update_token_state(
    attn_mean, attn_max, positions, step: int, n_new: int, alpha: float,
    acc=None, s1=None, s2=None, count=None, ts=None, mri=None, *, block_t=None,
):  # fmt: skip
    """Triton launcher of `kernels.reference.update_token_state_reference` (same arguments, same effect).

    Parameters
    ----------
    attn_mean, attn_max : Tensor or None
        ``[B, H, T]`` the step's group-mean and group-max attention (any float dtype, any strides); each may be
        None when no state that needs it is given.
    positions : Tensor
        ``[B, H, T]`` int64 slot positions, -1 for padding.
    step, n_new : int
        The step t and the slots appended in it.
    alpha : float
        LazyEviction's activation threshold.
    acc, s1, s2, count, ts, mri : Tensor or None
        ``[B, H, T]`` fp32 state, updated in place; the given ones must share one layout (strides), as the
        cache's state buffers (one capacity) do. ts and mri come together.
    block_t : int, optional
        Tuning (and tests): slots per program, a power of two.
    """
    states = {"acc": acc, "s1": s1, "s2": s2, "count": count, "ts": ts, "mri": mri}
    given = {n: t for n, t in states.items() if t is not None}
    if (ts is None) != (mri is None):
        raise ValueError("ts and mri are updated together: give both or neither")
    if positions.ndim != 3:
        raise ValueError(f"positions must be [B, H, T], got {tuple(positions.shape)}")
    B, H, T = positions.shape
    if not 0 <= n_new <= T:
        raise ValueError(f"n_new must be in [0, T={T}], got {n_new}")
    lazy = ts is not None and step > 0
    sums = acc is not None or s1 is not None or s2 is not None
    for name, x, needed in (("attn_mean", attn_mean, sums), ("attn_max", attn_max, lazy)):
        if needed and (x is None or x.shape != positions.shape):
            got = None if x is None else tuple(x.shape)
            raise ValueError(f"{name} must be [B, H, T] = {tuple(positions.shape)}, got {got}")
    if not given or B * H * T == 0:
        return
    first = next(iter(given.values()))
    layout = [s for s, n in zip(first.stride(), first.shape) if n > 1]  # a size-1 dim's stride is never used
    for name, t in given.items():
        same = [s for s, n in zip(t.stride(), t.shape) if n > 1] == layout
        if t.shape != positions.shape or t.dtype != torch.float32 or not same:
            raise ValueError(
                f"state {name!r} must be fp32 {tuple(positions.shape)} with the others' strides {first.stride()}, "
                f"got {t.dtype} {tuple(t.shape)} strides {t.stride()}"
            )

    if first.is_cuda:
        default_t, warps = 1024, 4
    else:  # the interpreter: one program per row is fastest
        default_t, warps = triton.next_power_of_2(T), 1
    block_t = block_t or default_t
    positions = positions.long()
    alpha = fp32(alpha)  # compared in fp32, as torch compares fp32 with a float
    dummy = first  # stands in for the inputs and states not given (never read: their flags are off)
    mean_t = attn_mean if attn_mean is not None else dummy
    max_t = attn_max if attn_max is not None else dummy
    ptr = {n: (t if t is not None else dummy) for n, t in states.items()}
    grid = (B * H, triton.cdiv(T, block_t))
    _state_update_kernel[grid](
        mean_t, max_t, positions, ptr["acc"], ptr["s1"], ptr["s2"], ptr["count"], ptr["ts"], ptr["mri"],
        H, T, n_new, float(step), alpha,
        *mean_t.stride(), *max_t.stride(), *positions.stride(), *first.stride(),
        HAS_ACC=acc is not None, HAS_S1=s1 is not None, HAS_S2=s2 is not None, HAS_COUNT=count is not None,
        HAS_LAZY=lazy, BLOCK_T=block_t, num_warps=warps, **LAUNCH_OPTIONS,
    )  # fmt: skip
