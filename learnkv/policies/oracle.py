"""Oracle: evicts by true future utility, the upper bound every policy is measured against."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from learnkv.policies.base import LayerView, Policy
from learnkv.fields import setting


@dataclass
class Oracle(Policy):
    """Keeps the tokens that the full-cache run will attend to most over the next ``horizon`` steps.

    Score of a token at position p when the newest token is at position t: the attention it receives from the
    queries at positions t+1 .. t+horizon in a full-cache run of the same sequence (group mean, summed). This is
    the label the learned scorer is trained on, so the oracle is its ceiling on that objective; over a thousand
    decode steps tokens go quiet for longer than 32 steps and return, and there a longer horizon than the labels'
    keeps the better output (docs/long-chain.md, "The long table"). It needs the future: `generate`
    first decodes with the full cache (or is handed that run's attention, as the fidelity task's reference holds
    it), then replays the same tokens (teacher forcing) under the budget with this policy.
    Compared across heads and layers (``allocation=head|global``) its scores are ``mass``
    (`learnkv.allocation.normalisation_for`): each head's divided by its live total.

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
    #: per row of the batch, `step_attention` of its prompt and continuation (per layer ``[H, steps, keys]``; its
    #: first query row is at position keys - steps, the prompt length)
    future: list | None = field(default=None, repr=False, compare=False)

    def params(self) -> dict:
        return {"n_sink": self.n_sink, "n_recent": self.n_recent, "horizon": self.horizon}

    def with_future(self, future: list[list[Tensor]]) -> "Oracle":
        """A copy that looks ahead at ``future``: per row, `step_attention` of that row's unpadded prompt and the
        continuation it replays."""
        clone = Oracle(n_sink=self.n_sink, n_recent=self.n_recent, interval=self.interval, horizon=self.horizon)
        clone.future = list(future)
        return clone

    def score(self, view: LayerView) -> Tensor:
        if self.future is None:
            raise ValueError("the oracle needs future attention: run it through learnkv.generate(policy='oracle', ...)")
        if len(self.future) != view.positions.shape[0]:
            raise ValueError(f"future attention for {len(self.future)} rows, a batch of {view.positions.shape[0]}")
        pos = view.positions.clamp(min=0)
        scores = torch.empty(view.positions.shape, dtype=torch.float32, device=pos.device)
        for b in range(pos.shape[0]):
            attn = self.future[b][view.layer]  # [H, steps, keys]: query rows from the prompt's end on
            start = attn.shape[-1] - attn.shape[-2]  # the prompt length: keys = prompt + steps
            t = int(view.positions[b].max())
            first = t + 1 - start
            if first < 0:
                raise ValueError(f"the oracle holds no future before position {start} (row {b}), "
                                 f"asked at newest position {t}")
            future_mass = attn[:, first : first + self.horizon, :].float().sum(dim=1)  # [H, keys]
            # past the row's own continuation (a row of the batch that has finished) nothing is ahead: score 0
            short = int(pos[b].max()) + 1 - future_mass.shape[-1]
            if short > 0:
                future_mass = torch.nn.functional.pad(future_mass, (0, short))
            scores[b] = future_mass.to(pos.device).gather(-1, pos[b])
        return scores
