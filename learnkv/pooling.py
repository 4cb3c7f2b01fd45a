"""Layer-shared block decisions: how per-(layer, KV head) token scores become one score per token.

A paged serving engine (vLLM) frees whole blocks shared by every layer and KV head, so a policy that runs there
gets one decision per block. Scores of different layers and heads live on different scales (attention mass
differs by layer), so they are pooled as rank percentiles: each (layer, head) ranks its tokens, and a token's
shared score is its mean percentile, and the blocks with the lowest mean shared score go (`shared_keep_slots`).
Torch only: the decode loop's block mode (`learnkv.cache`) and the serving runtime (`learnkv.serving.runtime`) both
call `shared_keep_slots`, so they keep the same blocks by construction.
"""

from __future__ import annotations

import torch
from torch import Tensor

POOLING = "mean_rank"


def rank_percentiles(scores: Tensor, valid: Tensor) -> Tensor:
    """``[..., T]`` -> percentile of each valid entry within its row, in [0, 1]; ties go to the later slot."""
    x = torch.nan_to_num(scores.float(), nan=float("-inf")).masked_fill(~valid, float("-inf"))
    ranks = torch.argsort(torch.argsort(x, dim=-1, stable=True), dim=-1, stable=True).float()
    n_invalid = (~valid).sum(-1, keepdim=True)
    return ((ranks - n_invalid) / (valid.sum(-1, keepdim=True) - 1).clamp(min=1)).clamp(min=0).masked_fill(~valid, 0.0)


def shared_token_scores(per_layer: list[Tensor], positions: Tensor) -> Tensor:
    """Pool ``per_layer`` scores (each ``[B, H, T]``, same slot layout) into one ``[B, T]`` score per token."""
    valid = positions >= 0
    return torch.stack([rank_percentiles(s, valid).mean(dim=1) for s in per_layer]).mean(dim=0)


def shared_keep_slots(per_layer: list[Tensor], positions: Tensor, keep: int, n_sink: int, n_recent: int,
                      block_size: int) -> Tensor:
    """Slots every layer and KV head keeps: whole blocks by pooled score, sinks and recent window protected.

    Parameters
    ----------
    per_layer : list of Tensor
        Each layer's scores ``[B, H, T]`` over the same slots, higher means keep.
    positions : Tensor
        ``[B, H, T]`` int64 original positions (-1 for padding), equal across heads.
    keep, n_sink, n_recent, block_size : int
        As in `kernels.select_keep` (at most ``keep`` slots survive, in whole blocks of ``block_size``).

    Returns
    -------
    Tensor
        ``[B, 1, K]`` int64 kept slot indices, ascending (expand over heads to apply).
    """
    import kernels  # the repository's kernel package; cheap to import, torch reference on CPU

    pooled = shared_token_scores(per_layer, positions)
    return kernels.select_keep(pooled[:, None], positions[:, :1], keep, n_sink, n_recent, block_size)
