"""What dropping a cached token costs the next-token distribution, to second order: the Fisher utility.

Issue 42 asks whether budget moved across layers and KV heads can beat an equal split. Ranking tokens by future
attention mass, or by that mass times the token's share of the head's output in the residual stream, cannot say:
both count one layer's direct effect only, and a unit of attention is not worth the same in every layer
(docs/allocation.md). This module measures the cost itself, on one scale for every layer and head: for each decode
step's query (position ``s``), each layer ``l``, KV head ``h`` and key ``i`` that the query sees, the increase of
``KL(p_s || p_s')`` when key ``i`` is dropped from that head at that step alone, to second order,

    u[l, h, s, i] = 1/2 * E_{y ~ p_s} [ (grad_a log p_s(y) . delta_a)^2 ]      (the Fisher quadratic form)

where ``a`` is the layer's attention output at position ``s`` (per query head, before the output projection), the
gradient runs through everything above it at that position (the output projection, the MLPs, the later layers'
queries and the final norm), and ``delta_a`` is the exact change of the attention output when key ``i`` leaves the
softmax, for each query head ``g`` of the group: ``p_g,i / (1 - p_g,i) * (a_g - v_i)`` (CAOTE's attention-output
error, https://arxiv.org/abs/2504.14051). The keys and values are detached in the backward pass, so a position's
gradient is its own prediction's only (what one eviction at one step changes there; what it changes at later steps
through the position's own cached keys and values in later layers is not counted). The expectation over ``y`` is
exact (every token of the vocabulary) or sampled (``samples`` draws per position, unbiased).

`learnkv.policies.oracle` (``utility="fisher"``) looks ahead at it as it looks ahead at future attention; this
module is called where the future is computed (`learnkv.decode`), not by the policy, which sees no model internals.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from learnkv.attention import unsupported_terms

NAME = "learnkv_fisher"


class _Record:
    """What the attention function keeps of each layer in one forward: its output (in the graph), the probabilities
    and the values (detached); and an optional key to drop (tests: the true cost of one drop)."""

    def __init__(self, drop: tuple[int, int, int, int] | None = None):
        self.outputs: dict[int, Tensor] = {}
        self.probs: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}
        self.drop = drop  # (layer, KV head, query position, key position): masked for that query and head only


_RECORD: list[_Record] = []  # the forward in progress (one at a time; set by `_recording`)


def fisher_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, scaling: float | None = None,
                     dropout: float = 0.0, **kwargs) -> tuple[Tensor, None]:
    """Causal attention by position index over one unpadded row, keeping what `step_fisher` needs; keys and values
    detached. Refuses what it does not implement (a sliding window, soft-capping, sink logits, any other term)."""
    extra = [k for k in ("sliding_window", "softcap", "s_aux") if kwargs.pop(k, None) is not None]
    if extra or (terms := unsupported_terms(kwargs)):
        raise ValueError(f"the Fisher utility's attention does not implement {', '.join(extra or terms)} "
                         f"({type(module).__name__}): refusing rather than measuring another attention")
    record = _RECORD[-1]
    B, Hq, S, D = query.shape
    H = key.shape[1]
    G = Hq // H
    key, value = key.detach(), value.detach()
    scores = torch.matmul(query.reshape(B, H, G * S, D), key.transpose(-1, -2)) * (scaling or D**-0.5)
    scores = scores.view(B, H, G, S, S)
    future = torch.ones(S, S, dtype=torch.bool, device=query.device).triu(1)
    scores = scores.masked_fill(future, float("-inf"))
    layer = module.layer_idx
    if record.drop is not None and record.drop[0] == layer:
        _, h, s, i = record.drop
        mask = torch.zeros_like(scores, dtype=torch.bool)
        mask[:, h, :, s, i] = True
        scores = scores.masked_fill(mask, float("-inf"))
    probs = scores.softmax(dim=-1)
    out = torch.matmul(probs, value[:, :, None])  # [B, H, G, S, Dv]
    record.outputs[layer], record.probs[layer], record.values[layer] = out, probs.detach(), value
    return out.reshape(B, Hq, S, -1).transpose(1, 2), None


@contextlib.contextmanager
def _recording(model, record: _Record):
    """The model on `fisher_attention` for the block (registered first), its own implementation back after."""
    from transformers import AttentionInterface  # transformers only once a model is loaded

    AttentionInterface.register(NAME, fisher_attention)
    previous = model.config._attn_implementation
    _RECORD.append(record)
    model.set_attn_implementation(NAME)
    try:
        yield record
    finally:
        _RECORD.pop()
        model.set_attn_implementation(previous)


def _sequence(model, prompt: Tensor, continuation: Tensor) -> Tensor:
    """``[1, P + N - 1]``: the prompt and every continuation token a decode step feeds, on the model's device."""
    return torch.cat([prompt, continuation[:, :-1]], dim=1).to(next(model.parameters()).device)


def _forward(model, seq: Tensor, record: _Record) -> Tensor:
    """``[S, V]`` fp32 log-probabilities of ``seq [1, S]``; where grad is enabled, the graph runs from each layer's
    attention output (the embeddings are a leaf that needs grad, the weights need none)."""
    with _recording(model, record):
        embeds = model.get_input_embeddings()(seq).detach().requires_grad_()
        logits = model(inputs_embeds=embeds, use_cache=False).logits[0]
        return logits.float().log_softmax(-1)


@torch.inference_mode(False)  # `generate` runs under inference mode, where no graph is recorded
@torch.enable_grad()  # the decode loop calls it under no_grad
def step_fisher(model, prompt: Tensor, continuation: Tensor, samples: int | None = 8, seed: int = 0) -> list[Tensor]:
    """Per layer ``[H, N - 1, P + N - 1]`` float32: the Fisher utility (module docstring) of every key for each
    decode step's query (positions ``P .. P + N - 2``), indexed by key position; laid out as
    `learnkv.capture.step_attention`'s attention, so the oracle reads either the same way. ``prompt [1, P]``,
    ``continuation [1, N]`` (one unpadded row). ``samples``: draws of ``y`` per position (seeded by ``seed``), or
    None for the exact expectation over the vocabulary (one backward pass per token: tests' tiny models)."""
    seq = _sequence(model, prompt, continuation)
    device, P, S = seq.device, prompt.shape[1], seq.shape[1]
    record = _Record()
    logp = _forward(model, seq, record)[P:]  # [N - 1, V]: the decode steps' next-token distributions
    layers = sorted(record.outputs)
    outputs = [record.outputs[layer] for layer in layers]
    p = logp.detach().exp()
    if samples is None:
        draws = [(torch.full((p.shape[0],), y, device=device), p[:, y]) for y in range(p.shape[1])]
    else:
        g = torch.Generator(device="cpu").manual_seed(seed)
        ys = torch.multinomial(p.cpu(), samples, replacement=True, generator=g).T.to(device)  # [samples, N - 1]
        draws = [(y, torch.full_like(p[:, 0], 1.0 / samples)) for y in ys]
    utility = [torch.zeros(o.shape[1], S - P, S, device=device) for o in outputs]  # [H, N - 1, S] per layer
    for k, (y, weight) in enumerate(draws):
        # the sum over positions is each position's own gradient: keys and values are detached, so a position's
        # attention output reaches no other position's prediction
        chosen = logp.gather(-1, y[:, None]).sum()
        grads = torch.autograd.grad(chosen, outputs, retain_graph=k < len(draws) - 1)
        for j, layer in enumerate(layers):
            z = _first_order(grads[j][0, :, :, P:], outputs[j][0, :, :, P:].detach(),
                             record.probs[layer][0, :, :, P:], record.values[layer][0])
            utility[j] += 0.5 * weight[None, :, None] * z * z
    return [u.cpu() for u in utility]


def _first_order(grad: Tensor, out: Tensor, probs: Tensor, values: Tensor) -> Tensor:
    """``[H, Q, S]``: ``grad . delta_a`` summed over the group's query heads, for dropping each key: ``grad``,
    ``out`` ``[H, G, Q, Dv]`` (the queries' gradient and attention output), ``probs [H, G, Q, S]``, ``values
    [H, S, Dv]``. ``delta_a = p_i / (1 - p_i) * (a - v_i)``; a key a query does not see (``p_i = 0``) costs 0."""
    weight = probs / (1.0 - probs).clamp(min=1e-6)
    ga = (grad * out).sum(-1)  # [H, G, Q]
    gv = torch.matmul(grad, values[:, None].transpose(-1, -2))  # [H, G, Q, S]
    return (weight * (ga[..., None] - gv)).sum(1)


def drop_cost(model, prompt: Tensor, continuation: Tensor, layer: int, head: int, step: int, key: int) -> float:
    """The true ``KL(p_s || p_s')`` of dropping key position ``key`` from ``layer``'s KV head ``head`` for decode
    step ``step``'s query alone (position ``P + step``), its other inputs unchanged: what `step_fisher` estimates to
    second order (tests)."""
    seq = _sequence(model, prompt, continuation)
    s = prompt.shape[1] + step
    with torch.no_grad():
        base = _forward(model, seq, _Record())[s]
        dropped = _forward(model, seq, _Record(drop=(layer, head, s, key)))[s]
    return float((base.exp() * (base - dropped)).sum())


__all__ = ["drop_cost", "fisher_attention", "step_fisher"]
