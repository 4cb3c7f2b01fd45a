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


def step_attention(model, prompt: Tensor, continuation: Tensor) -> list[Tensor]:
    """Per layer ``[H, N - 1, P + N - 1]`` float16: the full-cache run's group-mean attention of each decode
    step's query (positions ``P .. P + N - 2``, the prompt ``[1, P]`` followed by the first ``N - 1`` tokens of the
    continuation ``[1, N]``) over every key position. One unpadded row: what the oracle looks ahead at and what the
    fidelity metrics' attention recall is measured against (`learnkv.eval.tasks.fidelity.FullRun`).

    Memory: layers x H x (N - 1) x (P + N - 1) halves (0.75 GB for SmolLM2-135M at P = 1,200, N = 1,536), the
    prompt's own query rows never held; fp16 since these are probabilities summed over a few steps."""
    seq = torch.cat([prompt, continuation[:, :-1].to(prompt.device)], dim=1)
    attention = full_attention(model, seq, torch.ones_like(seq), first_row=prompt.shape[1], dtype=torch.float16)
    return [a[0].cpu() for a in attention]


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
