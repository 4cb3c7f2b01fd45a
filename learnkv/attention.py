"""The "learnkv" attention function (registered with transformers' `AttentionInterface`).

It computes ordinary scaled-dot-product attention over the (budgeted) cache, GQA-aware without expanding
keys and values, and hands the cache the attention statistics the policy asked for, reduced per KV head,
without `output_attentions` and without returning the per-head probability matrix:

- ``attn``       [B, H, W, T]  the step's last W query rows (W = policy.obs_window), group-reduced;
- ``attn_sum``   [B, H, T]     summed over all the step's query rows;
- ``attn_sq_sum``[B, H, T]     sum of squares (only for policies that need it).

The cache is anything with ``policy`` (the policy deciding in this step: its ``needs_attention``, ``group_reduce``,
``obs_window`` and ``needs_sq_sum`` say what to hand over), ``layer_positions``, ``step_positions`` and ``observe``
(`learnkv.cache.BudgetCache`, the serving simulator's request cache, test doubles), and optionally ``attended``
(told each layer's sliding window before its attention).

The mask comes from the cache's slot positions (key position <= query position, padding excluded), so
transformers builds no mask for this implementation; a decode step, whose one query comes after every cached
position, masks only the dead and padding slots (position -1), and over a layer whose every slot is live (the cache
says so on the host, `BudgetCache.every_slot_live`) needs no mask and builds none. Without a BudgetCache (the
`learnkv_cache` kwarg, or the one `active_cache` holds for the forward pass in progress) it falls back to plain
causal attention by index.

What the model's attention module hands over is honoured as transformers' own eager attention does, on the torch
path and in the fused kernel alike: ``sliding_window`` (a key is visible only within the query's newest ``window``
positions; the cache is told each layer's window, `BudgetCache.attended`, and drops what falls out of it),
``softcap`` (scores ``softcap * tanh(scores / softcap)``, Gemma 2) and ``s_aux`` (one sink logit per query head that
joins the softmax's normaliser and is then dropped, GPT-OSS). A cache that holds fewer KV heads than the keys have
(MLA: one latent per token, expanded per query head by the model) gets its statistics reduced over every query head
that shares a cached head. Any other term a model hands over that would change the attention (DeepSeek-V3.2's
sparse ``indices``, a T5-style ``position_bias``, ``is_causal=False``...) is refused in one line naming the module,
never ignored (`unsupported_terms`).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from torch import Tensor, nn

from learnkv import kernels
from learnkv.kernels.reference import REDUCE as FUSED_REDUCE  # the group reductions the fused decode kernel computes
from learnkv.features import group_mean_max

NAME = "learnkv"

#: keywords transformers hands attention functions that do not change the attention computed here (flash-attention
#: packing and bookkeeping flags); any other keyword with a value is refused (`unsupported_terms`)
NEUTRAL_TERMS = frozenset({"position_ids", "use_cache", "output_attentions", "output_router_logits", "cache_position",
                           "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"})

# the cache of the forward pass in progress, for attention modules whose decoder layer does not pass extra keyword
# arguments on (StableLM): `learnkv_cache` reaches them this way
_ACTIVE_CACHE: contextvars.ContextVar = contextvars.ContextVar("learnkv_cache", default=None)


@contextlib.contextmanager
def active_cache(cache):
    """Make ``cache`` the attention function's cache for the block, where no ``learnkv_cache`` kwarg reaches it."""
    token = _ACTIVE_CACHE.set(cache)
    try:
        yield
    finally:
        _ACTIVE_CACHE.reset(token)


def learnkv_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    learnkv_cache=None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: Tensor | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """query ``[B, Hq, q, D]``, key ``[B, H, T, D]``, value ``[B, H, T, Dv]`` -> output ``[B, q, Hq, Dv]``.

    ``sliding_window``, ``softcap`` and ``s_aux`` (sink logits ``[Hq]``) as the model's attention module passes
    them (see the module docstring); None where it has none."""
    if learnkv_cache is None:
        learnkv_cache = _ACTIVE_CACHE.get()
    if terms := unsupported_terms(kwargs):
        raise ValueError(f"{type(module).__name__} hands its attention {', '.join(terms)}, which learnkv's attention "
                         "does not implement: refusing rather than computing a different attention")
    B, Hq, q, D = query.shape
    H, T, Dv = key.shape[1], key.shape[2], value.shape[-1]
    G = Hq // H
    if scaling is None:
        scaling = D**-0.5
    if learnkv_cache is not None and hasattr(learnkv_cache, "attended"):
        learnkv_cache.attended(module.layer_idx, sliding_window)
    fused = (learnkv_cache is not None and q == 1 and _fused_decode_ok(learnkv_cache.policy)
             and Dv == D and learnkv_cache.layer_positions(module.layer_idx).shape[1] == H)  # fmt: skip
    if fused and kernels.use_triton(query, key):
        return _fused_decode(module, query, key, value, scaling, learnkv_cache, sliding_window, softcap, s_aux)
    # query heads j*G .. j*G+G-1 share KV head j (the order repeat_kv uses), so a reshape groups them. bmm on the
    # folded views is what matmul runs on these shapes, without its ~10 bookkeeping ops a call (batch 1 on a CPU)
    scores = torch.bmm(query.reshape(B * H, G * q, D), key.reshape(B * H, T, D).transpose(1, 2)) * scaling
    scores = scores.view(B, H, G, q, T)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap

    hidden = None  # the keys each query may not see, where some are hidden
    if learnkv_cache is not None:
        query_pos = learnkv_cache.step_positions.to(key.device)  # [B, q]
        key_pos = learnkv_cache.layer_positions(module.layer_idx)  # [B, Hc, T], Hc = H or 1 (one latent)
        if q == 1 and sliding_window is None and _queries_are_tokens(learnkv_cache):
            # a decode step's one query comes after every cached position: only dead and padding slots (position -1)
            # are hidden, 2 operators a layer instead of 5 (batch 1 on a CPU), none where every slot is live
            if not _every_slot_visible(learnkv_cache, module.layer_idx):
                hidden = (key_pos < 0)[:, :, None, None, :]
        else:
            key_pos = key_pos[:, :, None, None, :]
            allowed = (key_pos >= 0) & (key_pos <= query_pos[:, None, None, :, None])
            if sliding_window is not None:
                allowed = allowed & (key_pos > query_pos[:, None, None, :, None] - sliding_window)
            hidden = ~allowed
    else:
        allowed = torch.ones(q, T, dtype=torch.bool, device=key.device).tril(T - q)
        if attention_mask is not None:  # a user-supplied 4D additive mask [B, 1 or Hq, q, T] replaces causality
            m = attention_mask
            scores = scores + (m[:, :, None] if m.shape[1] == 1 else m.view(B, H, G, q, T))
            allowed = torch.ones_like(allowed)
        elif sliding_window is not None:  # query i (index T - q + i) sees keys j > T - q + i - window
            allowed = allowed & torch.ones_like(allowed).triu(T - q - sliding_window + 1)
        hidden = ~allowed
    if hidden is not None:
        scores = scores.masked_fill(hidden, torch.finfo(scores.dtype).min)
    if s_aux is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    else:  # the sink joins the normaliser and is dropped: the probabilities sum to less than 1
        sink = s_aux.to(scores.dtype).view(1, H, G, 1, 1).expand(B, H, G, q, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=torch.float32)[..., :T]
    out = torch.bmm(probs.to(query.dtype).view(B * H, G * q, T), value.reshape(B * H, T, Dv))
    out = out.view(B, Hq, q, Dv).transpose(1, 2).contiguous()

    if learnkv_cache is not None:
        _hand_statistics(learnkv_cache, module.layer_idx, probs, query_pos)
    return out, None


def _queries_are_tokens(cache) -> bool:
    """Whether the cache says every row's query of this step is a token (no padding row), asked on the host
    (`BudgetCache.every_query_a_token`): then a one-query step sees every live cached position (each is at most the
    query's), so its mask is the dead and padding slots alone, bit for bit the same scores as the causal mask."""
    every_query_a_token = getattr(cache, "every_query_a_token", None)
    return every_query_a_token is not None and every_query_a_token()


def _every_slot_visible(cache, layer_idx: int) -> bool:
    """Whether the cache says every slot of the layer holds a live token (no dead or padding slot), asked on the host
    (`BudgetCache.every_slot_live`): then a one-query step of tokens (`_queries_are_tokens`) hides nothing and its
    mask is skipped, bit for bit the same scores."""
    every_slot_live = getattr(cache, "every_slot_live", None)
    return every_slot_live is not None and every_slot_live(layer_idx)


def unsupported_terms(kwargs: dict) -> list[str]:
    """The keywords of an attention call that learnkv would otherwise ignore though they change the result."""
    return sorted(k for k, v in kwargs.items()
                  if v is not None and k not in NEUTRAL_TERMS and not (k == "is_causal" and v is True))


def _fused_decode_ok(policy) -> bool:
    """The fused kernel reduces over the group itself and returns the current query's row only."""
    return not (policy.evicts or policy.needs_attention) or policy.group_reduce in FUSED_REDUCE


def _fused_decode(module, query: Tensor, key: Tensor, value: Tensor, scaling: float, cache, window: int | None,
                  softcap: float | None, sinks: Tensor | None) -> tuple[Tensor, None]:
    """One decode step on CUDA through `kernels.decode_attention` (no [B, Hq, T] probability matrix in memory)."""
    policy = cache.policy
    key_pos = cache.layer_positions(module.layer_idx)
    query_pos = cache.step_positions[:, 0].to(key.device)
    # a policy that reads no attention gets the output alone (K and V read once, no probabilities written)
    reduce = None
    if policy.needs_attention:
        reduce = policy.group_reduce if policy.group_reduce in FUSED_REDUCE else "mean"
    out, attn = kernels.decode_attention(query, key, value, key_pos, query_pos, scaling, reduce, window=window,
                                         softcap=softcap, sinks=sinks)  # [B, 1, Hq, D], [B, H, T] or [B, H, 2, T]
    if policy.needs_attention:
        cache.observe(module.layer_idx, attn=attn.unsqueeze(-2), attn_sum=attn,
                      attn_sq_sum=attn * attn if policy.needs_sq_sum else None)
    else:
        cache.observe(module.layer_idx)
    return out, None


def _hand_statistics(cache, layer_idx: int, probs: Tensor, query_pos: Tensor) -> None:
    """Reduce ``probs [B, H, G, q, T]`` per KV head as the policy asked, and give them to the cache.

    ``group_reduce="none"`` hands the unreduced group axis (``attn [B, H, G, W, T]``, ``attn_sum [B, H, G, T]``),
    for observers that reduce several ways (the trace recorder runs every teacher on the same attention);
    ``"mean+max"`` both reductions on that axis (``[B, H, 2, W, T]``, `learnkv.features.group_mean_max`: the
    feature tracker's input).
    """
    policy = cache.policy
    if not policy.needs_attention:
        cache.observe(layer_idx)
        return
    B, H, G, q, T = probs.shape
    Hc = cache.layer_positions(layer_idx).shape[1]
    if Hc != H:  # fewer cached heads than key heads (MLA's one latent): reduce over every query head sharing one
        probs = probs.reshape(B, Hc, H // Hc * G, q, T)
    # padding query rows contribute nothing; a cache that knows every row's valid tokens (`BudgetCache.step_valid`,
    # on the host) spares the multiply when none is padding (a decode step: x * 1.0 is x, bit for bit)
    valid = getattr(cache, "step_valid", None)
    valid_rows = None if valid is not None and all(v == q for v in valid) else (query_pos >= 0).to(probs.dtype)
    # a sum over one query row is that row (probabilities are >= 0, so not even the sign of a zero changes)
    row_sum = (lambda r, dim: r.select(dim, 0)) if q == 1 else (lambda r, dim: r.sum(dim=dim))  # noqa: E731
    if policy.group_reduce in ("none", "mean+max"):
        r = probs if policy.group_reduce == "none" else group_mean_max(probs)
        r = r if valid_rows is None else r * valid_rows[:, None, None, :, None]  # [B, H, G or 2, q, T]
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


def install(model) -> str:
    """Switch ``model`` to the learnkv attention function (registered first); returns the implementation it had, for
    `installed` to put back. Raises ValueError, in one line, for a model whose attention cannot take it (no budget
    could be enforced)."""
    previous = model.config._attn_implementation
    if previous != NAME:
        register()
        try:
            model.set_attn_implementation(NAME)
        except (ValueError, NotImplementedError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"{type(model).__name__} cannot take learnkv's attention function, so no budget could be "
                             f"enforced: {first}") from None
    return previous


@contextlib.contextmanager
def installed(model):
    """`install` for the block, then the model's own attention implementation back."""
    previous = install(model)
    try:
        yield model
    finally:
        if previous not in (NAME, None):
            model.set_attn_implementation(previous)
