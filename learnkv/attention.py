"""The "learnkv" attention function (registered with transformers' `AttentionInterface`).

It computes ordinary scaled-dot-product attention over the (budgeted) cache, GQA-aware without expanding
keys and values, and hands the cache the attention statistics the policy asked for, reduced per KV head,
without `output_attentions` and without returning the per-head probability matrix:

- ``attn``       [B, H, W, T]  the step's last W query rows (W = policy.obs_window), group-reduced;
- ``attn_sum``   [B, H, T]     summed over all the step's query rows;
- ``attn_sq_sum``[B, H, T]     sum of squares (only for policies that need it).

The cache is anything with ``policy`` (the policy deciding in this step: its ``needs_attention``, ``group_reduce``,
``obs_window`` and ``needs_sq_sum`` say what to hand over), ``layer_positions``, ``step_positions`` and ``observe``
(`learnkv.cache.BudgetCache`, the serving simulator's request cache, test doubles).

The mask comes from the cache's slot positions (key position <= query position, padding excluded), so
transformers builds no mask for this implementation. Without a BudgetCache (`learnkv_cache` kwarg) it
falls back to plain causal attention by index.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

import kernels

NAME = "learnkv"


def learnkv_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    learnkv_cache=None,
    **kwargs,
) -> tuple[Tensor, None]:
    """query ``[B, Hq, q, D]``, key/value ``[B, H, T, D]`` -> output ``[B, q, Hq, D]``."""
    B, Hq, q, D = query.shape
    H, T = key.shape[1], key.shape[2]
    G = Hq // H
    if scaling is None:
        scaling = D**-0.5
    fused = learnkv_cache is not None and q == 1 and _fused_decode_ok(learnkv_cache.policy)
    if fused and kernels.use_triton(query, key):
        return _fused_decode(module, query, key, value, scaling, learnkv_cache)
    # query heads j*G .. j*G+G-1 share KV head j (the order repeat_kv uses), so a reshape groups them
    scores = torch.matmul(query.reshape(B, H, G * q, D), key.transpose(-1, -2)) * scaling
    scores = scores.view(B, H, G, q, T)

    if learnkv_cache is not None:
        key_pos = learnkv_cache.layer_positions(module.layer_idx)[:, :, None, None, :]  # [B, H, 1, 1, T]
        query_pos = learnkv_cache.step_positions.to(key.device)  # [B, q]
        allowed = (key_pos >= 0) & (key_pos <= query_pos[:, None, None, :, None])
    else:
        allowed = torch.ones(q, T, dtype=torch.bool, device=key.device).tril(T - q)
        if attention_mask is not None:  # a user-supplied 4D additive mask [B, 1 or Hq, q, T] replaces causality
            m = attention_mask
            scores = scores + (m[:, :, None] if m.shape[1] == 1 else m.view(B, H, G, q, T))
            allowed = torch.ones_like(allowed)
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    out = torch.matmul(probs.to(query.dtype).view(B, H, G * q, T), value)
    out = out.view(B, Hq, q, D).transpose(1, 2).contiguous()

    if learnkv_cache is not None:
        _hand_statistics(learnkv_cache, module.layer_idx, probs, query_pos)
    return out, None


def _fused_decode_ok(policy) -> bool:
    """The fused kernel reduces over the group itself (mean or max) and returns the current query's row only."""
    return not (policy.evicts or policy.needs_attention) or policy.group_reduce in ("mean", "max")


def _fused_decode(module, query: Tensor, key: Tensor, value: Tensor, scaling: float, cache) -> tuple[Tensor, None]:
    """One decode step on CUDA through `kernels.decode_attention` (no [B, Hq, T] probability matrix in memory)."""
    policy = cache.policy
    key_pos = cache.layer_positions(module.layer_idx)
    query_pos = cache.step_positions[:, 0].to(key.device)
    reduce = policy.group_reduce if policy.group_reduce in ("mean", "max") else "mean"
    out, attn = kernels.decode_attention(query, key, value, key_pos, query_pos, scaling, reduce)  # [B,1,Hq,D], [B,H,T]
    if policy.needs_attention:
        cache.observe(module.layer_idx, attn=attn[:, :, None, :], attn_sum=attn,
                      attn_sq_sum=attn * attn if policy.needs_sq_sum else None)
    else:
        cache.observe(module.layer_idx)
    return out, None


def _hand_statistics(cache, layer_idx: int, probs: Tensor, query_pos: Tensor) -> None:
    """Reduce ``probs [B, H, G, q, T]`` per KV head as the policy asked, and give them to the cache.

    ``group_reduce="none"`` hands the unreduced group axis (``attn [B, H, G, W, T]``, ``attn_sum [B, H, G, T]``),
    for observers that reduce several ways (the trace recorder runs every teacher on the same attention).
    """
    policy = cache.policy
    if not policy.needs_attention:
        cache.observe(layer_idx)
        return
    q = probs.shape[3]
    # padding query rows contribute nothing; a cache that knows every row's valid tokens (`BudgetCache.step_valid`,
    # on the host) spares the multiply when none is padding (a decode step: x * 1.0 is x, bit for bit)
    valid = getattr(cache, "step_valid", None)
    valid_rows = None if valid is not None and all(v == q for v in valid) else (query_pos >= 0).to(probs.dtype)
    # a sum over one query row is that row (probabilities are >= 0, so not even the sign of a zero changes)
    row_sum = (lambda r, dim: r.select(dim, 0)) if q == 1 else (lambda r, dim: r.sum(dim=dim))  # noqa: E731
    if policy.group_reduce == "none":
        r = probs if valid_rows is None else probs * valid_rows[:, None, None, :, None]  # [B, H, G, q, T]
        w = min(policy.obs_window, q)
        cache.observe(layer_idx, attn=r[..., -w:, :], attn_sum=row_sum(r, 3))
        return
    r = probs.amax(dim=2) if policy.group_reduce == "max" else probs.mean(dim=2)  # [B, H, q, T]
    r = r if valid_rows is None else r * valid_rows[:, None, :, None]
    w = min(policy.obs_window, q)
    cache.observe(
        layer_idx,
        attn=r[:, :, -w:, :],
        attn_sum=row_sum(r, 2),
        attn_sq_sum=row_sum(r * r, 2) if policy.needs_sq_sum else None,
    )


def register() -> str:
    """Register the attention function with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface  # transformers only once a model is loaded (learnkv.model)

    AttentionInterface.register(NAME, learnkv_attention)
    return NAME
