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
  reference token (tested against a separate free run). None for ``oracle``, which replays the full output;
* ``generated_tokens``: the length of the full-cache continuation (the regime: how long the decode ran).

A budget fraction is a share of the final length of the full-cache run (prompt + its continuation), as
LazyEviction sets its budgets. Prompts are decoded in batches; every metric is accumulated per row, step by step
(no budgeted logits or kept sets are stored), so a batch gives each prompt exactly its metrics alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from learnkv.capture import step_attention
from learnkv.decode import generate
from learnkv.eval import metrics as M
from learnkv.eval.tasks.base import RunConfig, Sample, Task, capture_logits, left_pad, replays
from learnkv.fisher import step_fisher
from learnkv.prompts import SOURCES, load_prompts

HELD_OUT = ("test", "validation")  # splits a fidelity run may use: never the training prompts


@dataclass
class FullRun:
    """The full-cache reference on one prompt.

    Attributes
    ----------
    tokens : Tensor
        ``[1, N]`` the greedy continuation (up to and including EOS).
    logits : Tensor
        ``[N, V]`` float32, the logits each continuation token was chosen from.
    attention : list of Tensor
        Per layer ``[H, N - 1, L]`` float16: the group-mean attention of each decode step's query (positions
        ``P .. P + N - 2``) over the keys of prompt + continuation (``L = P + N - 1``), indexed by key position
        (`learnkv.capture.step_attention`): what attention recall is measured against and what the oracle
        looks ahead at.
    prompt_len : int
        P.
    fisher : list of Tensor or None
        Per layer ``[H, N - 1, L]`` bfloat16, laid out as ``attention``: what dropping each key costs each step's
        next-token distribution (`learnkv.fisher.step_fisher`), computed when a policy that reads it first asks
        (`future`), then kept for the batch's other runs (not stored with the reference).
    """

    tokens: Tensor
    logits: Tensor
    attention: list[Tensor]
    prompt_len: int
    fisher: list[Tensor] | None = None

    def future(self, kind: str, model, prompt: Tensor) -> list[Tensor]:
        """What a look-ahead policy of ``future_kind`` ``kind`` reads of this run (``prompt [1, P]``: its ids)."""
        if kind == "attention":
            return self.attention
        if self.fisher is None:
            # bf16 (fp32's range: costs span ~12 decades) halves what a batch of long references holds
            self.fisher = [u.bfloat16() for u in step_fisher(model, prompt, self.tokens)]
        return self.fisher

    @property
    def final_length(self) -> int:
        return self.prompt_len + self.tokens.shape[1]


def kept_positions(cache) -> Tensor:
    """Every layer's slot positions ``[L, B, H, T]`` (-1 pads a layer holding fewer slots than another)."""
    kept = [layer.positions for layer in cache.layers]
    T = max(k.shape[-1] for k in kept)
    return torch.stack([k if k.shape[-1] == T else torch.nn.functional.pad(k, (0, T - k.shape[-1]), value=-1)
                        for k in kept])


def _pad_tokens(refs: list[FullRun], pad_id: int) -> Tensor:
    n = max(r.tokens.shape[1] for r in refs)
    out = torch.full((len(refs), n), pad_id, dtype=torch.long)
    for i, r in enumerate(refs):
        out[i, : r.tokens.shape[1]] = r.tokens[0]
    return out


class _Tracker:
    """Accumulates each row's fidelity metrics during a teacher-forced budgeted run, one forward pass at a time."""

    def __init__(self, refs: list[FullRun], latest: dict):
        self.refs, self.latest = refs, latest
        B = len(refs)
        self.kl, self.top1, self.nll = ([[] for _ in range(B)] for _ in range(3))
        self.agree: list[int | None] = [None] * B  # first step whose argmax differs from the reference token
        self.recall = [[] for _ in range(B)]  # per decode step: mean over layers and heads
        self.step = 0

    def __call__(self, cache) -> None:
        i, logits = self.step, self.latest.pop("logits")  # [B, V] of forward pass i
        self.step += 1
        rows = [b for b, ref in enumerate(self.refs) if i < ref.tokens.shape[1]]
        if not rows:
            return
        # every row at once: each op reduces along the vocabulary only, so a row's values are its own (to the last
        # bits, which depend on how the threads split a reduction)
        q = logits[rows]
        p = torch.stack([self.refs[b].logits[i] for b in rows])
        targets = torch.stack([self.refs[b].tokens[0, i] for b in rows])
        kl = M.kl_divergence(p, q).tolist()
        choice = q.argmax(-1)
        top1 = (choice == p.argmax(-1)).tolist()
        nll = (-q.double().log_softmax(-1).gather(-1, targets[:, None])[:, 0]).tolist()
        differs = (choice != targets).tolist()
        kept = None  # every layer's kept positions [layers, B, H, T], stacked once for all rows of this step
        for j, b in enumerate(rows):
            self.kl[b].append(kl[j])
            self.top1[b].append(float(top1[j]))
            self.nll[b].append(nll[j])
            if self.agree[b] is None and differs[j]:
                self.agree[b] = i
            if i < self.refs[b].tokens.shape[1] - 1:  # what this pass kept, step i + 1 (position P + i) attends to
                kept = kept_positions(cache) if kept is None else kept
                self.recall[b].append(self._recall(kept[:, b], b, i))

    def _recall(self, kept: Tensor, b: int, i: int) -> float:
        """Row ``b``'s recall at step ``i``, averaged over layers, from every layer's kept positions ``[L, H, T]``."""
        ref = self.refs[b]
        per_layer = M.step_recalls(torch.stack([attn[:, i, :] for attn in ref.attention]), kept,
                                   ref.prompt_len + i).tolist()
        return sum(per_layer) / len(per_layer)

    def metrics(self, b: int, policy: str) -> dict:
        ref = self.refs[b]
        n = ref.tokens.shape[1]
        ref_nll = -ref.logits.double().log_softmax(-1).gather(-1, ref.tokens[0, :, None]).squeeze(-1)
        return {
            "kl": sum(self.kl[b]) / n,
            "top1_agreement": sum(self.top1[b]) / n,
            "ppl_ratio": float(torch.tensor(sum(self.nll[b]) / n - float(ref_nll.mean())).exp()),
            "attention_recall": sum(self.recall[b]) / len(self.recall[b]) if self.recall[b] else 1.0,
            "agreement_length": None if replays(policy) else (n if self.agree[b] is None else self.agree[b]),
            "generated_tokens": float(n),
        }


@dataclass
class Fidelity(Task):
    """Fidelity to the full cache on held-out prompts of a prompt source.

    Parameters
    ----------
    max_new_tokens : int
        The most tokens the full-cache continuation (that each budgeted run is forced along) may have.
    source : str
        Prompt source (`learnkv.prompts.SOURCES`).
    split : str
        ``"test"`` (the default: prompts nothing trains or validates on) or ``"validation"`` (the prompts `train.py`
        validates on: tune a policy's settings there, then report on test).
    """

    name = "fidelity"
    metrics = ("kl", "top1_agreement", "ppl_ratio", "attention_recall", "agreement_length", "generated_tokens")
    headline = ("kl", "top1_agreement", "attention_recall")
    default_limit = 8

    max_new_tokens: int = 24
    source: str = "gsm_symbolic"
    split: str = "test"

    def __post_init__(self):
        super().__post_init__()

        if self.source not in SOURCES:
            raise ValueError(f"unknown prompt source {self.source!r}; known: {', '.join(sorted(SOURCES))}")
        if self.split not in HELD_OUT:
            raise ValueError(f"fidelity split must be one of {', '.join(HELD_OUT)}, got {self.split!r}")

    def load(self, tokenizer, limit: int | None, seed: int) -> list[Sample]:
        if tokenizer is None:
            raise ValueError("the fidelity task needs a tokenizer to load prompts (or pass token-id samples)")
        prompts = load_prompts(self.source, n=limit, seed=seed, split=self.split, tokenizer=tokenizer)
        return [Sample.from_prompt(p, tokenizer) for p in prompts]

    def final_length(self, sample: Sample, ref: FullRun) -> int:
        return ref.final_length

    def reference_batch(self, model, tokenizer, samples: list[Sample]) -> list[FullRun]:
        latest, handle = capture_logits(model)
        steps = []
        try:
            result = self.decode_batch(model, tokenizer, samples, RunConfig("full", {}, [None] * len(samples)),
                                       observer=lambda cache: steps.append(latest.pop("logits")))
        finally:
            handle.remove()
        logits = torch.stack(steps, dim=1)  # [B, N, V]
        device = next(model.parameters()).device
        refs = []
        for b, sample in enumerate(samples):
            n = result.new_tokens[b]
            tokens = result.tokens[b : b + 1, :n]
            attention = step_attention(model, sample.input_ids.to(device), tokens, generate)
            refs.append(FullRun(tokens, logits[b, :n].clone(), attention, sample.input_ids.shape[1]))
        return refs

    def run_batch(self, model, tokenizer, samples: list[Sample], refs: list[FullRun], run: RunConfig):
        pad_id = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        latest, handle = capture_logits(model)
        tracker = _Tracker(refs, latest)
        try:
            # the oracle looks ahead at the reference's own attention (the same tensors, no second copy) or at the
            # Fisher utility of its run, computed once per prompt for every budget and allocation of the batch
            kind = self.eviction(run).make().future_kind if replays(run.policy) else None
            future = [r.future(kind, model, s.input_ids) for r, s in zip(refs, samples)] if kind else None
            result = self.decode_batch(model, tokenizer, samples, run, forced_tokens=_pad_tokens(refs, pad_id or 0),
                                       future=future, observer=tracker)
        finally:
            handle.remove()
        return [tracker.metrics(b, run.policy) for b in range(len(samples))], result


__all__ = ["Fidelity", "FullRun", "left_pad"]
