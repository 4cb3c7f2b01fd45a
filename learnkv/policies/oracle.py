"""Oracle: evicts by true future utility, the upper bound every policy is measured against."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from learnkv.policies.base import LayerView, Policy
from learnkv.fields import setting


@dataclass
class _AttentionCapture(Policy):
    """Non-evicting observer that keeps each layer's prefill attention ``[B, H, N, N]`` (group mean), or only its
    query rows from ``first_row`` on, in ``dtype``, as each layer is computed."""

    name = "capture"
    evicts = False
    group_reduce = "mean"
    captured: dict = field(default_factory=dict, repr=False)
    first_row: int = 0
    dtype: torch.dtype | None = None

    @property
    def obs_window(self) -> int:
        return 1 << 30

    def update(self, view: LayerView) -> None:
        if view.step == 0:
            a = view.attn[:, :, self.first_row:, :] if self.first_row else view.attn
            self.captured[view.layer] = a.to(self.dtype) if self.dtype is not None else a


def full_attention(model, input_ids: Tensor, attention_mask: Tensor, first_row: int = 0,
                   dtype: torch.dtype | None = None) -> list[Tensor]:
    """Per layer, the group-mean attention ``[B, H, N, N]`` of one full-cache forward, indexed by position
    (query position, key position), so left padding is removed. Memory: layers x H x N^2 floats.

    ``first_row``: keep only the query rows from that position on (``[B, H, N - first_row, N]``), e.g. a
    continuation's rows after its prompt, and ``dtype`` to store them in; both applied layer by layer as the forward
    runs, so a long sequence never holds every layer's whole matrix (needs an unpadded batch)."""
    from learnkv.decode import generate

    if first_row and bool((attention_mask == 0).any()):
        raise ValueError("full_attention(first_row=...) needs an unpadded batch")
    capture = _AttentionCapture(first_row=first_row, dtype=dtype)
    generate(model, input_ids=input_ids, attention_mask=attention_mask, policy=capture, max_new_tokens=1)
    pads = (attention_mask == 0).sum(dim=-1)
    if not bool(pads.any()):
        return [capture.captured[layer] for layer in range(len(capture.captured))]
    out = []
    for layer in range(len(capture.captured)):
        a = capture.captured[layer]
        by_pos = torch.zeros_like(a)
        for b, off in enumerate(pads.tolist()):
            n = a.shape[-1] - off
            by_pos[b, :, :n, :n] = a[b, :, off:, off:]
        out.append(by_pos)
    return out


@dataclass
class Oracle(Policy):
    """Keeps the tokens that the full-cache run will attend to most over the next ``horizon`` steps.

    Score of a token at position p when the newest token is at position t: the attention it receives from the
    queries at positions t+1 .. t+horizon in a full-cache run of the same sequence (group mean, summed). This is
    the label the learned scorer is trained on, so the oracle is its ceiling. It needs the future: `generate`
    first decodes with the full cache, computes that run's attention, then replays the same tokens (teacher
    forcing) under the budget with this policy.

    Parameters
    ----------
    horizon : int
        H, steps of future that count.
    """

    name = "oracle"
    pooling = "mean_mass"  # future attention mass: comparable across layers and heads
    needs_attention = False
    needs_future = True
    horizon: int = setting(32, ge=1)
    future: list | None = field(default=None, repr=False, compare=False)

    def params(self) -> dict:
        return {"n_sink": self.n_sink, "n_recent": self.n_recent, "horizon": self.horizon}

    def with_future(self, model, input_ids: Tensor, attention_mask: Tensor, continuation: Tensor) -> "Oracle":
        """A copy holding the full-cache attention of prompt + continuation."""
        seq = torch.cat([input_ids, continuation.to(input_ids.device)], dim=1)
        mask = torch.cat([attention_mask, torch.ones_like(continuation).to(attention_mask)], dim=1)
        clone = Oracle(n_sink=self.n_sink, n_recent=self.n_recent, interval=self.interval, horizon=self.horizon)
        clone.future = full_attention(model, seq, mask)
        return clone

    def score(self, view: LayerView) -> Tensor:
        if self.future is None:
            raise ValueError("the oracle needs future attention: run it through learnkv.generate(policy='oracle', ...)")
        attn = self.future[view.layer]  # [B, H, N(query pos), N(key pos)]
        pos = view.positions.clamp(min=0)
        scores = torch.empty(view.positions.shape, dtype=torch.float32, device=pos.device)
        for b in range(pos.shape[0]):
            t = int(view.positions[b].max())
            future_mass = attn[b, :, t + 1 : t + 1 + self.horizon, :].sum(dim=1)  # [H, N]
            scores[b] = future_mass.gather(-1, pos[b])
        return scores
