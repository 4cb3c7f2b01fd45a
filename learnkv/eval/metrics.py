"""Fidelity metrics: how far a budgeted decode strays from the full-cache decode of the same tokens.

Pure tensor functions, no model: each compares a full-cache run with a budgeted run teacher-forced along the
same continuation (`learnkv.eval.tasks.fidelity` produces both). Shapes use N (generated steps), V (vocabulary),
H (KV heads), Q (query rows), K (key positions).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def _check_pair(p_logits: Tensor, q_logits: Tensor) -> None:
    if p_logits.dim() != 2 or p_logits.shape != q_logits.shape:
        raise ValueError(
            f"logits must both be [N, V] with the same shape, got {tuple(p_logits.shape)} and {tuple(q_logits.shape)}"
        )


def kl_divergence(p_logits: Tensor, q_logits: Tensor) -> Tensor:
    """KL(p ‖ q) of the next-token distributions at each step, from logits.

    Parameters
    ----------
    p_logits : Tensor
        ``[N, V]`` logits of the reference (full-cache) run.
    q_logits : Tensor
        ``[N, V]`` logits of the budgeted run at the same steps.

    Returns
    -------
    Tensor
        ``[N]`` float64, ``sum_v p_v (log p_v - log q_v)`` in nats; 0 where the logits are equal.
    """
    _check_pair(p_logits, q_logits)
    log_p = p_logits.double().log_softmax(-1)
    log_q = q_logits.double().log_softmax(-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).clamp(min=0.0)


def top1_agreement(p_logits: Tensor, q_logits: Tensor) -> float:
    """Share of steps where both runs put the most probability on the same token (``[N, V]`` each)."""
    _check_pair(p_logits, q_logits)
    return float((p_logits.argmax(-1) == q_logits.argmax(-1)).double().mean())


def perplexity(logits: Tensor, targets: Tensor) -> float:
    """``exp`` of the mean negative log-likelihood of ``targets [N]`` under ``logits [N, V]``."""
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"need logits [N, V] and targets [N], got {tuple(logits.shape)} and {tuple(targets.shape)}")
    nll = -logits.double().log_softmax(-1).gather(-1, targets.long()[:, None]).squeeze(-1)
    return float(nll.mean().exp())


def ppl_ratio(p_logits: Tensor, q_logits: Tensor, targets: Tensor) -> float:
    """Perplexity of ``targets [N]`` under the budgeted logits over that under the full-cache logits (1 = equal)."""
    _check_pair(p_logits, q_logits)
    return perplexity(q_logits, targets) / perplexity(p_logits, targets)


def agreement_length(reference: Sequence[int], other: Sequence[int]) -> int:
    """Number of leading tokens two sequences share: the index of their first difference (the shorter length
    if one is a prefix of the other)."""
    n = 0
    for a, b in zip(reference, other):
        if a != b:
            break
        n += 1
    return n


def attention_recall(attention: Tensor, visible: Tensor) -> Tensor:
    """Share of each query row's full-cache attention mass that falls on the keys a budgeted cache kept.

    Parameters
    ----------
    attention : Tensor
        ``[..., Q, K]`` non-negative attention weights of the full-cache run (e.g. ``[H, Q, K]``).
    visible : Tensor
        ``[..., Q, K]`` bool, True where the budgeted cache held that key when that query attended.

    Returns
    -------
    Tensor
        ``[..., Q]`` float64 in [0, 1]: ``sum(attention * visible) / sum(attention)`` per row (1 for an all-zero row).
    """
    if attention.shape != visible.shape:
        raise ValueError(f"attention and visible must have the same shape, got {tuple(attention.shape)} and "
                         f"{tuple(visible.shape)}")
    a = attention.double()
    total = a.sum(-1)
    kept = (a * visible.to(a.dtype)).sum(-1)
    return torch.where(total > 0, kept / total.clamp(min=1e-300), torch.ones_like(total))


def visible_mask(kept: Sequence[Tensor], queries: Sequence[int], n_keys: int) -> Tensor:
    """Which keys each query saw: the positions kept after the previous step, plus the query's own token.

    Parameters
    ----------
    kept : sequence of Tensor
        One ``[H, T]`` int64 tensor of kept positions per query (T may differ; -1 marks padding, ignored).
    queries : sequence of int
        The position of each query's token.
    n_keys : int
        K, the length of the key axis.

    Returns
    -------
    Tensor
        ``[H, Q, K]`` bool.
    """
    if len(kept) != len(queries):
        raise ValueError(f"one kept set per query: got {len(kept)} kept sets and {len(queries)} queries")
    if not kept:
        raise ValueError("visible_mask needs at least one query")
    H = kept[0].shape[0]
    out = torch.zeros(H, len(queries), n_keys, dtype=torch.bool)
    for i, (pos, q) in enumerate(zip(kept, queries)):
        pos = pos.cpu()
        row = torch.zeros(H, n_keys + 1, dtype=torch.bool)  # the extra last column swallows padding (-1)
        row.scatter_(1, torch.where(pos >= 0, pos, n_keys), True)
        out[:, i] = row[:, :n_keys]
        out[:, i, q] = True
    return out


def step_recall(attention: Tensor, kept: Tensor, query: int) -> float:
    """Attention recall of one decode step: the share of its query's full-cache attention that falls on what the
    budgeted cache held for it (the positions kept after the previous pass, plus the query's own token).

    Parameters
    ----------
    attention : Tensor
        ``[H, K]`` the full-cache attention of the step's query over key positions.
    kept : Tensor
        ``[H, T]`` int64 kept positions (-1 = padding or a dead slot, ignored).
    query : int
        The query's position.

    Returns
    -------
    float
        The recall, averaged over heads (`attention_recall`).
    """
    return float(step_recalls(attention[None], kept[None], query)[0])


def step_recalls(attention: Tensor, kept: Tensor, query: int) -> Tensor:
    """`step_recall` of N caches at once (e.g. every layer of a step): ``attention [N, H, K]``, ``kept [N, H, T]``
    -> ``[N]`` float64, each exactly what `step_recall` gives for its slice (one op for all layers instead of N:
    on a CPU the per-call dispatch was most of a long evaluation's metric time)."""
    N, H, K = attention.shape
    kept = kept.cpu()
    visible = torch.zeros(N, H, K + 1, dtype=torch.bool)  # the extra last column swallows -1 and out-of-range slots
    visible.scatter_(2, torch.where((kept >= 0) & (kept < K), kept, K), True)
    visible = visible[..., :K]
    visible[..., query] = True
    return attention_recall(attention, visible).mean(-1)
