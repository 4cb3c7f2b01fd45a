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

from dataclasses import dataclass, field

import torch
from torch import Tensor

from learnkv.decode import GenerationResult
from learnkv.eval import metrics as M
from learnkv.eval.tasks.base import Sample, Task, capture_logits, replays
from learnkv.policies.base import LayerView, Policy
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
        Per layer ``[H, R, L]`` group-mean attention of prompt + continuation (all but the last token,
        L = P + N - 1), rows from query position ``row_offset`` on (R = L - row_offset), indexed by key position.
    row_offset : int
        Query position of the first stored row: 0 stores every row; the prompt length P stores only the decode
        steps' rows, all that attention recall reads (what long runs use: ``[layers, H, L, L]`` fp32 is 600 MB at
        L = 1300 on SmolLM2).
    """

    tokens: Tensor
    logits: Tensor
    attention: list[Tensor]
    row_offset: int = 0


class RecallMeter:
    """Attention recall accumulated pass by pass, so a long run never stores what its cache kept.

    Decode step s (query at position P + s - 1) saw what pass s - 1 kept, plus itself; its recall is the share of
    its full-cache attention on those tokens, per layer and KV head. `value` is the mean over layers, heads and
    decode steps (1.0 if nothing was decoded).

    Parameters
    ----------
    attention : list of Tensor
        Per layer ``[H, R, L]`` full-cache attention rows from query position ``row_offset`` on (`FullRun`).
    prompt_len : int
        P.
    """

    def __init__(self, attention: list[Tensor], prompt_len: int, row_offset: int = 0):
        self.attention, self.prompt_len, self.row_offset = attention, prompt_len, row_offset
        self.passes, self.total, self.count = 0, 0.0, 0

    def add(self, kept: list[Tensor]) -> None:
        """The positions each layer's cache held after the next forward pass, per layer ``[H, T]``."""
        query = self.prompt_len + self.passes  # the query of the next decode step, which sees this pass's cache
        self.passes += 1
        row = query - self.row_offset
        for layer, attn in enumerate(self.attention):
            if row >= attn.shape[1]:
                return  # the last pass: no later query sees its cache
            visible = M.visible_mask([kept[layer]], [query], attn.shape[-1])
            self.total += float(M.attention_recall(attn[:, row: row + 1, :], visible).sum())
            self.count += visible.shape[0]

    @property
    def value(self) -> float:
        return self.total / self.count if self.count else 1.0


def recall_of_run(attention: list[Tensor], kept: list, prompt_len: int) -> float:
    """Attention recall of a run: decode step s (query at position P + s - 1) saw what pass s - 1 kept, plus
    itself. ``attention`` per layer ``[H, L, L]``, ``kept`` as from `decode_traced`. 1.0 if nothing was decoded."""
    meter = RecallMeter([a[:, : prompt_len + len(kept) - 2 + 1] for a in attention], prompt_len)
    for per_layer in kept:
        meter.add(per_layer)
    return meter.value


@dataclass
class _RowCapture(Policy):
    """Non-evicting observer that keeps rows ``first_row:`` of each layer's prefill attention, cast to ``dtype``."""

    name = "capture-rows"
    evicts = False
    group_reduce = "mean"
    first_row: int = 0
    dtype: torch.dtype = torch.float32
    rows: dict = field(default_factory=dict, repr=False)

    @property
    def obs_window(self) -> int:
        return 1 << 30

    def update(self, view: LayerView) -> None:
        if view.step == 0:
            self.rows[view.layer] = view.attn[0, :, self.first_row:, :].to(self.dtype).cpu()


def capture_attention(model, seq: Tensor, first_row: int = 0, dtype: torch.dtype = torch.float32) -> list[Tensor]:
    """Per layer ``[H, L - first_row, L]`` group-mean attention of one full-cache forward over ``seq`` ``[1, L]``:
    the rows of query positions ``first_row`` on, cast to ``dtype`` layer by layer (so the whole ``[layers, H, L,
    L]`` stack is never held)."""
    from learnkv.decode import generate

    capture = _RowCapture(first_row=first_row, dtype=dtype)
    generate(model, input_ids=seq.to(next(model.parameters()).device), policy=capture, max_new_tokens=1)
    return [capture.rows[layer] for layer in range(len(capture.rows))]


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
                      forced: Tensor | None = None, meter: RecallMeter | None = None
                      ) -> tuple[Tensor, list, GenerationResult]:
        """A greedy (or teacher-forced) decode of one sample that records every forward pass.

        Returns
        -------
        logits : Tensor
            ``[N, V]`` float32, the logits of each forward pass (prefill first), i.e. of each generated token.
        kept : list
            Per forward pass, per layer, the ``[H, T]`` positions the cache held after that pass; empty when a
            ``meter`` is given, which is fed them instead.
        result : GenerationResult
        """
        logits, kept = [], []
        latest, handle = capture_logits(model)

        def observe(cache):
            logits.append(latest.pop("logits"))
            held = [layer.positions[0].detach().cpu().clone() for layer in cache.layers]
            if meter is None:
                kept.append(held)
            else:
                meter.add(held)

        try:
            result = self.decode(model, tokenizer, sample, policy, budget, params, forced_tokens=forced,
                                 observer=observe)
        finally:
            handle.remove()
        return torch.stack(logits), kept, result

    def reference(self, model, tokenizer, sample: Sample) -> FullRun:
        return self.full_run(model, tokenizer, sample)[0]

    def full_run(self, model, tokenizer, sample: Sample, decode_rows_only: bool = False,
                 dtype: torch.dtype = torch.float32) -> tuple[FullRun, GenerationResult]:
        """The full cache's greedy run and its attention (`FullRun`); ``decode_rows_only`` keeps only the rows of
        the decode steps' queries, in ``dtype``."""
        logits, _, result = self.decode_traced(model, tokenizer, sample, "full", None, {})
        seq = torch.cat([sample.input_ids, result.tokens[:, :-1]], dim=1)
        first = sample.input_ids.shape[1] if decode_rows_only else 0
        return FullRun(result.tokens, logits, capture_attention(model, seq, first, dtype), first), result

    def run(self, model, tokenizer, sample, ref: FullRun, policy, budget, params):
        return self.fidelity(model, tokenizer, sample, ref, policy, budget, params)

    def fidelity(self, model, tokenizer, sample: Sample, ref: FullRun, policy: str, budget: int | None,
                 params: dict) -> tuple[dict[str, float | None], GenerationResult]:
        """The five fidelity metrics of one teacher-forced run along ``ref``, and that run."""
        meter = RecallMeter(ref.attention, sample.input_ids.shape[1], ref.row_offset)
        logits, _, result = self.decode_traced(model, tokenizer, sample, policy, budget, params, forced=ref.tokens,
                                               meter=meter)
        targets = ref.tokens[0]
        free = None if replays(policy) else M.agreement_length(targets.tolist(), logits.argmax(-1).tolist())
        return {
            "kl": float(M.kl_divergence(ref.logits, logits).mean()),
            "top1_agreement": M.top1_agreement(ref.logits, logits),
            "ppl_ratio": M.ppl_ratio(ref.logits, logits, targets),
            "attention_recall": meter.value,
            "agreement_length": free,
        }, result
