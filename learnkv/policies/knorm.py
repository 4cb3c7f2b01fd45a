"""Key-norm: keep the tokens with the smallest key norm."""

from dataclasses import dataclass

import torch
from torch import Tensor

from learnkv.policies.base import LayerView, Policy


@dataclass
class KeyNorm(Policy):
    """Key L2 norm (Devoto et al., https://arxiv.org/abs/2406.11430; kvpress's KnormPress).

    A low key norm correlates with high attention, so score = -||k|| (keys as cached, after RoPE). Needs no
    attention at all.
    """

    name = "knorm"
    needs_attention = False
    # one selection for every layer of a decode step (`BudgetCache`'s stacked path), as H2O: at batch 1 a step's
    # per-layer small ops (selection, marking) were its overhead over kvpress (bench/RESULTS.md, kvpress parity)
    stacks_layers = True

    def score(self, view: LayerView) -> Tensor:
        if view.layers == 1:
            return -view.keys.float().norm(dim=-1)
        return torch.cat([-k.float().norm(dim=-1) for k, _ in view.layer_kv])  # layer-major, as the stacked rows
