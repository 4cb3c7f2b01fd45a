"""Layer-shared block decisions: how per-(layer, KV head) token scores become one score per token.

A paged serving engine (vLLM) frees whole blocks shared by every layer and KV head, so a policy that runs there
gets one decision per block. Scores of different layers and heads live on different scales (attention mass
differs by layer), so they are pooled as rank percentiles: each (layer, head) ranks its tokens, and a token's
shared score is its mean percentile. Torch only: the serving runtime uses this same function.
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
