"""Layer-shared block decisions: how per-(layer, KV head) token scores become one score per token.

A paged serving engine (vLLM) frees whole blocks shared by every layer and KV head, so a policy that runs there
gets one decision per block: a token's shared score pools its scores over every layer and head, and the blocks
with the lowest mean shared score go (`shared_keep_slots`). Each policy declares its rule (`Policy.pooling`):

- ``mean_mass``: the mean of the scores themselves, for scores that are attention mass (H2O, TOVA, SnapKV, the
  oracle). Every head's attention sums to one per query, so mass compares across layers and heads, and a token
  that a few heads need badly keeps its weight;
- ``mean_rank``: the mean rank percentile within each (layer, head), for scores on no shared scale (key norms,
  recurrence sigmoids, RoCo's protected infinities, the learned scorer's logits, which its listwise loss fixes
  only up to a constant per row).

Torch only: the decode loop's block mode (`learnkv.cache`) and the serving runtime (`learnkv.serving.runtime`) both
call `shared_keep_slots`, so they keep the same blocks by construction.
"""

from __future__ import annotations

import torch
from torch import Tensor

from learnkv import kernels

POOLING_RULES = ("mean_rank", "mean_mass")
POOLING = "mean_rank"  # the learned scorer's rule, which its exported artifact records


def rank_percentiles(scores: Tensor, valid: Tensor) -> Tensor:
    """``[..., T]`` -> percentile of each valid entry within its row, in [0, 1]; ties go to the later slot."""
    x = torch.nan_to_num(scores.float(), nan=float("-inf")).masked_fill(~valid, float("-inf"))
    ranks = torch.argsort(torch.argsort(x, dim=-1, stable=True), dim=-1, stable=True).float()
    n_invalid = (~valid).sum(-1, keepdim=True)
    return ((ranks - n_invalid) / (valid.sum(-1, keepdim=True) - 1).clamp(min=1)).clamp(min=0).masked_fill(~valid, 0.0)


def shared_token_scores(per_layer: list[Tensor], positions: Tensor, rule: str = POOLING) -> Tensor:
    """Pool ``per_layer`` scores (each ``[B, H, T]``, same slot layout) into one ``[B, T]`` score per token."""
    valid = positions >= 0
    if rule == "mean_rank":
        per_head = [rank_percentiles(s, valid) for s in per_layer]
    elif rule == "mean_mass":
        per_head = [s.float().masked_fill(~valid, 0.0) for s in per_layer]
    else:
        raise ValueError(f"unknown pooling rule {rule!r}; rules: {', '.join(POOLING_RULES)}")
    return torch.stack([s.mean(dim=1) for s in per_head]).mean(dim=0)


def shared_keep_slots(per_layer: list[Tensor], positions: Tensor, keep, n_sink, n_recent,
                      block_size: int, rule: str = POOLING) -> Tensor:
    """Slots every layer and KV head keeps: whole blocks by pooled score, sinks and recent window protected.

    Parameters
    ----------
    per_layer : list of Tensor
        Each layer's scores ``[B, H, T]`` over the same slots, higher means keep.
    positions : Tensor
        ``[B, H, T]`` int64 original positions (-1 for padding), equal across heads.
    keep, n_sink, n_recent : int or sequence of int
        As in `kernels.select_keep` (at most ``keep`` slots survive, in whole blocks of ``block_size``), for every
        row or one per row.
    block_size : int
        Slots per block.
    rule : str
        The pooling rule (`POOLING_RULES`), the policy's ``pooling``.

    Returns
    -------
    Tensor
        ``[B, 1, K]`` int64 kept slot indices, ascending, -1 entries first in a row that keeps fewer than the
        widest (expand over heads to apply).
    """
    pooled = shared_token_scores(per_layer, positions, rule)
    return kernels.select_keep(pooled[:, None], positions[:, :1], keep, n_sink, n_recent, block_size)
