"""Fidelity: how closely a budgeted decode tracks the full-cache decode, on held-out prompts (model-agnostic).

Per prompt, the full cache first decodes greedily; its continuation is the reference. Each budgeted run is then
teacher-forced along that continuation, so every step compares the two caches on the same tokens:

* ``kl``: mean KL(full ‖ budgeted) of the next-token distributions over the generated steps (nats);
* ``top1_agreement``: share of those steps whose most likely token is the same;
* ``ppl_ratio``: perplexity of the continuation under the budgeted run over that under the full cache;
* ``attention_recall``: share of each decode step's full-cache attention mass (group mean per KV head) that
  falls on the tokens the budgeted cache held for that step, averaged over layers, heads and decode steps;
* ``agreement_length``: tokens a free-running greedy budgeted decode produces before it first differs from the
  full-cache output. Read off the forced run: greedy decoding is deterministic, so a free run feeds exactly
  the forced tokens until its own choice first differs, which is the first step whose argmax differs from the
  reference token (tested against a separate free run). None for ``oracle``, which replays the full output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from learnkv.decode import GenerationResult
from learnkv.eval import metrics as M
from learnkv.eval.tasks.base import Sample, Task, capture_logits, replays
from learnkv.policies.oracle import full_attention
from learnkv.prompts import load_prompts


@dataclass
class FullRun:
    """The full-cache reference on one prompt.

    Attributes
    ----------
    tokens : Tensor
        ``[1, N]`` the greedy continuation.
    logits : Tensor
        ``[N, V]`` float32, the logits each continuation token was chosen from.
    attention : list of Tensor
        Per layer ``[H, L, L]`` group-mean attention of prompt + continuation (all but the last token, L = P + N - 1),
        indexed by (query position, key position).
    """

    tokens: Tensor
    logits: Tensor
    attention: list[Tensor]


def recall_of_run(attention: list[Tensor], kept: list, prompt_len: int) -> float:
    """Attention recall of a run: decode step s (query at position P + s - 1) saw what pass s - 1 kept, plus
    itself. ``attention`` per layer ``[H, L, L]``, ``kept`` as from `decode_traced`. 1.0 if nothing was decoded."""
    n_steps = len(kept) - 1
    if n_steps < 1:
        return 1.0
    queries = list(range(prompt_len, prompt_len + n_steps))
    per_layer = []
    for layer, attn in enumerate(attention):
        visible = M.visible_mask([kept[s][layer] for s in range(n_steps)], queries, attn.shape[-1])
        per_layer.append(M.attention_recall(attn[:, queries, :], visible).mean())
    return float(torch.stack(per_layer).mean())


@dataclass
class Fidelity(Task):
    """Fidelity to the full cache on held-out ``gsm_symbolic`` prompts (test split).

    Parameters
    ----------
    max_new_tokens : int
        Length of the full-cache continuation each budgeted run is forced along.
    source : str
        Prompt source (`learnkv.prompts.SOURCES`).
    """

    name = "fidelity"
    metrics = ("kl", "top1_agreement", "ppl_ratio", "attention_recall", "agreement_length")
    default_limit = 8

    max_new_tokens: int = 24
    source: str = "gsm_symbolic"

    def load(self, tokenizer, limit: int | None, seed: int) -> list[Sample]:
        if tokenizer is None:
            raise ValueError("the fidelity task needs a tokenizer to load prompts (or pass token-id samples)")
        prompts = load_prompts(self.source, n=limit, seed=seed, split="test", tokenizer=tokenizer)
        return [Sample.from_prompt(p, tokenizer) for p in prompts]

    def decode_traced(self, model, tokenizer, sample: Sample, policy: str, budget: int | None, params: dict,
                      forced: Tensor | None = None) -> tuple[Tensor, list, GenerationResult]:
        """A greedy (or teacher-forced) decode of one sample that records every forward pass.

        Returns
        -------
        logits : Tensor
            ``[N, V]`` float32, the logits of each forward pass (prefill first), i.e. of each generated token.
        kept : list
            Per forward pass, per layer, the ``[H, T]`` positions the cache held after that pass.
        result : GenerationResult
        """
        logits, kept = [], []
        latest, handle = capture_logits(model)

        def observe(cache):
            logits.append(latest.pop("logits"))
            kept.append([layer.positions[0].detach().cpu().clone() for layer in cache.layers])

        try:
            result = self.decode(model, tokenizer, sample, policy, budget, params, forced_tokens=forced,
                                 observer=observe)
        finally:
            handle.remove()
        return torch.stack(logits), kept, result

    def reference(self, model, tokenizer, sample: Sample) -> FullRun:
        logits, _, result = self.decode_traced(model, tokenizer, sample, "full", None, {})
        seq = torch.cat([sample.input_ids, result.tokens[:, :-1]], dim=1)
        device = next(model.parameters()).device
        attention = full_attention(model, seq.to(device), torch.ones_like(seq, device=device))
        return FullRun(result.tokens, logits, [a[0].float().cpu() for a in attention])

    def run(self, model, tokenizer, sample, ref: FullRun, policy, budget, params):
        logits, kept, result = self.decode_traced(model, tokenizer, sample, policy, budget, params, forced=ref.tokens)
        targets = ref.tokens[0]
        free = None if replays(policy) else M.agreement_length(targets.tolist(), logits.argmax(-1).tolist())
        return {
            "kl": float(M.kl_divergence(ref.logits, logits).mean()),
            "top1_agreement": M.top1_agreement(ref.logits, logits),
            "ppl_ratio": M.ppl_ratio(ref.logits, logits, targets),
            "attention_recall": recall_of_run(ref.attention, kept, sample.input_ids.shape[1]),
            "agreement_length": free,
        }, result
