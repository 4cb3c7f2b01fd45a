"""Full-cache attention capture: what a full-cache run attends to, per layer, recorded by a non-evicting observer.

The oracle looks ahead at it (`learnkv.policies.oracle`) and the fidelity task measures attention recall against it
(`learnkv.eval.tasks.fidelity`). It needs one prefill of the decode loop, which callers hand in (`generate`, or
`learnkv.decode.observe`, the prefill alone, which the decode loop hands in when it calls `step_attention` for the
oracle's rows).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from learnkv.policies.base import LayerView, Policy


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


def full_attention(model, input_ids: Tensor, attention_mask: Tensor, generate, first_row: int = 0,
                   dtype: torch.dtype | None = None) -> list[Tensor]:
    """Per layer, the group-mean attention ``[B, H, N, N]`` of one full-cache forward, indexed by position
    (query position, key position), so left padding is removed. Memory: layers x H x N^2 floats.

    ``first_row``: keep only the query rows from that position on (``[B, H, N - first_row, N]``), e.g. a
    continuation's rows after its prompt, and ``dtype`` to store them in; both applied layer by layer as the forward
    runs, so a long sequence never holds every layer's whole matrix (needs an unpadded batch). ``generate``:
    `learnkv.decode.generate` or `learnkv.decode.observe` (keywords ``input_ids``, ``attention_mask``, ``policy``,
    ``max_new_tokens``), handed in by its caller (the decode loop calls this for the oracle's rows, so this module
    sits below it)."""
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


def step_attention(model, prompt: Tensor, continuation: Tensor, generate) -> list[Tensor]:
    """Per layer ``[H, N - 1, P + N - 1]`` float16: the full-cache run's group-mean attention of each decode
    step's query (positions ``P .. P + N - 2``, the prompt ``[1, P]`` followed by the first ``N - 1`` tokens of the
    continuation ``[1, N]``) over every key position. One unpadded row: what the oracle looks ahead at and what the
    fidelity metrics' attention recall is measured against (`learnkv.eval.tasks.fidelity.FullRun`).

    Memory: layers x H x (N - 1) x (P + N - 1) halves (0.75 GB for SmolLM2-135M at P = 1,200, N = 1,536), the
    prompt's own query rows never held; fp16 since these are probabilities summed over a few steps. ``generate``:
    as for `full_attention`."""
    seq = torch.cat([prompt, continuation[:, :-1].to(prompt.device)], dim=1)
    attention = full_attention(model, seq, torch.ones_like(seq), generate, first_row=prompt.shape[1],
                               dtype=torch.float16)
    return [a[0].cpu() for a in attention]
