"""LazyEviction: token-importance recurrence, observation window, lagged eviction."""

from dataclasses import dataclass

import torch
from torch import Tensor

from learnkv import kernels
from learnkv.policies.base import LayerView, Policy, exact_map
from learnkv.fields import setting

DEFAULT_WINDOW = 128  # `decoding_recent_size` argparse default of the official code
VARIANTS = ("official", "paper")
# W as a share of the budget when the budget is too small for 128: the official Qwen scripts run W = 175 of 1,492
# slots (MATH), about an eighth. A quarter evicted in bulk down to three quarters of the budget, so the cache ran far
# below its budget (docs/decoding.md, "What a budget means", measures both).
WINDOW_SHARE = 8


@dataclass
class LazyEviction(Policy):
    """LazyEviction (https://arxiv.org/abs/2506.15969; github.com/Halo-949/LazyEviction).

    Per KV head and token it tracks TS, the last decode step at which the token got attention >= ``alpha``
    (from any query head of the group: max reduction), and MRI, its maximum recurrence interval (the longest
    gap between two such activations). Every ``window`` steps it keeps the ``window`` newest tokens plus the
    best-scoring older ones, with Δ = t - TS, m = MRI:

    - official code (default): ``2σ(-(1 + Δ/(m+1e-5))) + [m > 0]·2σ(1 - m)``
    - paper (arXiv v3):        ``2σ(-Δ/m) + [m ≠ 0]·2σ(-1/(m - 1))``

    The window W is at once the eviction period and the protected recent span, as in the official code: the cache
    evicts only when it would otherwise exceed the budget, so a prompt within the budget is never compressed at the
    prefill and the first eviction comes after the decode has filled the budget, with those steps observed (the
    official code, too, never evicts at the prefill). LazyEviction observes nothing at the prefill
    (``scores_prefill = False``): a prompt longer than the budget needs a prefill policy (``prefill_policy``) to
    compress it, instead of a decision on all-tied scores.
    Deviations, for equal KV bytes across policies: decisions are per KV head on the native GQA cache (the
    official code expands K/V to every query head, 7x the bytes on Qwen-7B), state is fp32 (the official
    fp16 state rounds steps above 2048), ties prefer recent tokens (exactly: the score is evaluated once per
    distinct state, `exact_map`), and the cache keeps ``budget - W + 1`` tokens at each eviction so it never
    exceeds the budget between evictions (the official cache keeps B and grows to B + W).

    Compared across heads and layers (``allocation=head|global``) its scores are ``rank``
    (`learnkv.allocation.normalisation_for`).

    Parameters
    ----------
    window : int or None
        W. None: the code's default 128, capped at an eighth of the budget (the Qwen scripts' ratio) so small
        budgets work.
    alpha : float
        Activation threshold; 1e-4 (code default and Qwen scripts; Llama scripts use 5e-4).
    variant : str
        "official" or "paper" score formula.
    """

    name = "lazy"
    group_reduce = "max"
    scores_prefill = False
    rowwise = True  # its score is a function of each token's own state
    per_row_fields = ("n_sink", "n_recent", "interval", "window")  # the window only sets the schedule and protection
    window: int | None = setting(None, ge=1)
    alpha: float = setting(1e-4, ge=0.0, le=1.0)
    variant: str = setting("official", choices=VARIANTS)

    def resolve_defaults(self, budget: int) -> dict:
        window = self.window if self.window is not None else min(DEFAULT_WINDOW, max(1, budget // WINDOW_SHARE))
        return {"window": window, "interval": window, "n_recent": window}

    def update(self, view: LayerView) -> None:
        st, t = view.state, view.step
        if "ts" not in st:  # prompt tokens start at TS = 0, MRI = 0 (the code creates the state zero-filled)
            zeros = torch.zeros(view.positions.shape, dtype=torch.float32, device=view.positions.device)
            st["ts"], st["mri"] = zeros, zeros.clone()
        if t == 0:  # the prefill observes nothing
            return
        if view.n_new == 1 and kernels.use_triton(st["ts"], view.attn):
            # a decode step on the kernel path: TS and MRI in one fused in-place launch
            kernels.update_token_state(None, view.attn[:, :, -1, :], view.positions, t, 1, self.alpha,
                                       ts=st["ts"], mri=st["mri"])  # fmt: skip
            return
        # in place, so the cache's buffers stay the state's (no copy at the next append)
        ts = st["ts"]
        ts[..., -view.n_new :] = t - 1  # a new token starts as if last seen one step ago
        # TS <- t where the attention reaches alpha, and MRI <- max(MRI, TS's jump): the jump is t - TS there and
        # 0 elsewhere, a float 0/1 mask times t - TS. Not a bool mask and `masked_fill_`: on a CPU those cost ~3x
        # (bench/RESULTS.md, "LazyEviction's update without a bool mask"). Exact: TS holds whole numbers of steps
        # below 2**24, at most t, so t - TS is exact and >= 0, and the mask times it is it or +0.0.
        # (The comparison stays in the attention's dtype, as ``>=`` compares; the product is TS's float32.)
        jump = torch.rsub(ts, t).mul_(view.attn[:, :, -1, :].clone().ge_(self.alpha))
        ts.add_(jump)
        torch.maximum(st["mri"], jump, out=st["mri"])

    def score(self, view: LayerView) -> Tensor:
        # a function of integer state (steps since activation, recurrence interval): equal state, equal score
        return exact_map(self._priority, view.step - view.state["ts"], view.state["mri"])

    def _priority(self, delta: Tensor, m: Tensor) -> Tensor:
        """The score from Δ = t - TS and m = MRI (elementwise)."""
        if self.variant == "official":
            h1 = 2 * torch.sigmoid(-(1 + delta / (m + 1e-5)))
            h2 = torch.where(m > 0, 2 * torch.sigmoid(1 - m), torch.zeros_like(m))
        else:
            h1 = 2 * torch.sigmoid(-delta / (m + 1e-5))
            h2 = torch.where(m != 0, 2 * torch.sigmoid(-1 / (m - 1)), torch.zeros_like(m))
        return h1 + h2
