"""Triton `scorer_mlp`: the exported scorer on every cached token of a layer in one launch
(`kernels.reference.scorer_mlp_reference`).

Each program scores ``BLOCK_N`` tokens: it standardises their features, multiplies by ``w1`` with one fp32
`tl.dot` (IEEE precision, not tf32), adds ``b1``, applies relu, and reduces against ``w2``. The hidden
activations never leave registers, so the kernel reads the features once and writes one fp32 score per token.
Features, hidden width and the token count need not be powers of two (they are padded with masked zeros).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# b2 is one float of a per-layer weight row: its address's alignment alternates with the layer (a compile each)
@triton.jit(do_not_specialize=("N",), do_not_specialize_on_alignment=("b2_ptr",))
def _scorer_mlp_kernel(
    x_ptr, mean_ptr, std_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, out_ptr,
    N, F, HD, sx_n, sx_f,
    BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    f = tl.arange(0, BLOCK_F)
    j = tl.arange(0, BLOCK_H)
    fm = f < F
    jm = j < HD
    xm = (rows[:, None] < N) & fm[None, :]
    x = tl.load(x_ptr + rows[:, None] * sx_n + f[None, :] * sx_f, mask=xm, other=0.0).to(tl.float32)
    mu = tl.load(mean_ptr + f, mask=fm, other=0.0)
    sd = tl.load(std_ptr + f, mask=fm, other=1.0)
    z = tl.where(xm, tl.math.div_rn(x - mu[None, :], sd[None, :]), 0.0)  # padded features contribute 0
    w1 = tl.load(w1_ptr + f[:, None] * HD + j[None, :], mask=fm[:, None] & jm[None, :], other=0.0)
    h = tl.dot(z, w1, input_precision="ieee") + tl.load(b1_ptr + j, mask=jm, other=0.0)[None, :]
    h = tl.maximum(h, 0.0)
    w2 = tl.load(w2_ptr + j, mask=jm, other=0.0)  # padded hidden units get weight 0
    out = tl.sum(h * w2[None, :], axis=1) + tl.load(b2_ptr)
    tl.store(out_ptr + rows, out, mask=rows < N)


def scorer_mlp(features, mean, std, w1, b1, w2, b2, *, block_n=None):
    """Triton launcher of `kernels.reference.scorer_mlp_reference` (same arguments, same result).

    Parameters
    ----------
    features : Tensor
        ``[N, F]`` any float dtype, any strides (read once, computed in fp32).
    mean, std : Tensor
        ``[F]``.
    w1, b1, w2 : Tensor
        ``[F, Hd]``, ``[Hd]``, ``[Hd]``.
    b2 : Tensor or float
        Output bias (a tensor stays on the device: no host sync).
    block_n : int, optional
        Tuning (and tests): tokens per program, a power of two >= 16.

    Returns
    -------
    Tensor
        ``[N]`` fp32 scores.
    """
    if features.ndim != 2:
        raise ValueError(f"features must be [N, F], got {tuple(features.shape)}")
    N, F = features.shape
    if w1.ndim != 2 or w1.shape[0] != F:
        raise ValueError(f"w1 must be [F={F}, Hd], got {tuple(w1.shape)}")
    HD = w1.shape[1]
    device = features.device
    shapes = {"mean": (mean, (F,)), "std": (std, (F,)), "b1": (b1, (HD,)), "w2": (w2, (HD,))}
    for name, (t, shape) in shapes.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must be {list(shape)}, got {list(t.shape)}")
    # the parameters are tiny: fp32 contiguous copies cost nothing (and none at all when already so)
    mean, std, w1, b1, w2 = (t.to(device=device, dtype=torch.float32).contiguous() for t in (mean, std, w1, b1, w2))
    if isinstance(b2, torch.Tensor):
        if b2.numel() != 1:
            raise ValueError(f"b2 must be a scalar, got shape {list(b2.shape)}")
        b2 = b2.to(device=device, dtype=torch.float32).reshape(1)
    else:
        b2 = torch.tensor([float(b2)], dtype=torch.float32, device=device)
    out = torch.empty(N, dtype=torch.float32, device=device)
    if N == 0:
        return out
    # tl.dot needs every dimension >= 16
    block_f = max(16, triton.next_power_of_2(F))
    block_h = max(16, triton.next_power_of_2(HD))
    if features.is_cuda:
        default_n, warps = 128, 4
    else:  # the interpreter: few, large programs
        default_n, warps = min(max(16, triton.next_power_of_2(N)), 1024), 1
    block_n = block_n or default_n
    _scorer_mlp_kernel[(triton.cdiv(N, block_n),)](
        features, mean, std, w1, b1, w2, b2, out,
        N, F, HD, *features.stride(),
        BLOCK_N=block_n, BLOCK_F=block_f, BLOCK_H=block_h, num_warps=warps,
    )  # fmt: skip
    return out
