"""The task contract: what an evaluation task loads, what it computes once per prompt, what it scores per run.

A task knows its prompts and its metrics; it knows nothing about the list of policies or budgets, results files
or plots (`learnkv.eval.run` owns those). The runner hands it batches of prompts: `reference_batch` once per batch
(the full-cache work every policy is compared with), then `run_batch` once per policy and budget, which returns
each prompt's metrics and the batch's `GenerationResult` (its per-row cost: KV bytes, kept share, time). Rows of
a batch decode exactly as each would alone (`learnkv.generate`), so the batch size changes speed, not metrics.
A task that only implements the per-prompt `reference` and `run` is run one prompt at a time. A task whose
reference is the full cache's own free run (`full_decode`) gives the ``full`` row from it (`reference_run`)
instead of decoding the same greedy run again.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import Tensor

import torch

from learnkv.decode import GenerationResult, encode_prompts, generate
from learnkv.policies import POLICIES
from learnkv.settings import Eviction, check_granularity


@dataclass
class Sample:
    """One evaluation prompt, already tokenized (batch of one, no padding).

    Attributes
    ----------
    id : str
        Stable prompt id (`learnkv.prompts.Prompt.id`).
    input_ids : Tensor
        ``[1, L]`` token ids (chat template applied for text prompts).
    answer : str or None
        Gold answer, for tasks that grade one.
    meta : dict
        Task details (e.g. the needle's context length and depth).
    """

    id: str
    input_ids: Tensor
    answer: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_prompt(cls, prompt, tokenizer) -> "Sample":
        """Tokenize a `learnkv.prompts.Prompt` with the model's chat template (and its reply prefix, if it has one:
        a chain prompt's reply starts with its first problems solved)."""
        ids, _ = encode_prompts(tokenizer, prompt.text, reply_prefixes=[prompt.meta.get("response_prefix")])
        return cls(prompt.id, ids, prompt.answer, dict(prompt.meta))

    @classmethod
    def from_ids(cls, ids: Tensor, id: str = "ids", answer: str | None = None) -> "Sample":
        """A token-id prompt ``[L]`` or ``[1, L]`` (what tests on the tiny random model use)."""
        ids = ids if ids.dim() == 2 else ids[None]
        if ids.shape[0] != 1 or ids.shape[1] == 0:
            raise ValueError(f"a sample is one non-empty row of token ids, got shape {tuple(ids.shape)}")
        return cls(id, ids.long(), answer)


@dataclass
class RunConfig:
    """One decode configuration of the grid, applied to a batch of prompts.

    Attributes
    ----------
    policy : str
        A registered policy name; ``params`` its parameters.
    budgets : list of int or None
        Per prompt of the batch: the budget in tokens (None for a policy that never evicts).
    prefill : tuple of (str, dict), optional
        The prefill policy and its parameters (`learnkv.generate`'s ``prefill_policy``).
    slack : int
        Dead slots a layer may hold before it compacts (`learnkv.generate`'s ``slack``; the same kept tokens; the
        cache ignores it where nothing is evicted or slots are grouped).
    """

    policy: str
    params: dict
    budgets: list[int | None]
    prefill: tuple[str, dict] | None = None
    slack: int = 0


def cost_row(result: GenerationResult, row: int, seconds: float) -> dict:
    """One prompt's cost from its row of a batched run (``seconds``: its share of the batch's wall time)."""
    live = result.live_kv_bytes_rows[row] if result.live_kv_bytes_rows else result.peak_kv_bytes_rows[row]
    return {"budget": result.budgets[row] if result.budgets else None, "peak": result.peak_kv_bytes_rows[row],
            "live": live, "full": result.full_kv_bytes_rows[row], "kept": result.kept_share(row),
            "tokens": result.new_tokens[row], "seconds": seconds, "evict_s": result.eviction_share * seconds}


@dataclass
class FreeRun:
    """The full cache's free-running greedy decode of one prompt, as the grid's ``full`` row would decode it.

    Attributes
    ----------
    text : str
        The continuation as `learnkv.generate` decoded it.
    cost : dict
        Its cost row (`cost_row`): KV bytes, kept share, tokens and its share of the batch's decode time.
    """

    text: str
    cost: dict


def left_pad(samples: list[Sample], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A left-padded batch ``(input_ids [B, L], attention_mask [B, L])`` of samples' token ids."""
    L = max(s.input_ids.shape[1] for s in samples)
    ids = torch.full((len(samples), L), pad_id, dtype=torch.long)
    mask = torch.zeros(len(samples), L, dtype=torch.long)
    for i, s in enumerate(samples):
        n = s.input_ids.shape[1]
        ids[i, L - n :], mask[i, L - n :] = s.input_ids[0], 1
    return ids, mask


@dataclass
class Task:
    """Base class of evaluation tasks: subclass, set ``name`` and ``metrics``, implement `load` and `run`.

    Parameters
    ----------
    max_new_tokens : int
        Tokens each run generates (at most).
    granularity : str
        ``"token"`` (each layer and KV head evicts for itself) or ``"block"`` (whole blocks of ``block_size``
        slots, one decision shared by every layer and KV head: what a paged serving engine can do).
    block_size : int
        Slots per block in ``"block"`` mode.
    """

    name: ClassVar[str] = ""
    #: the metrics this task reports, in table and plot order
    metrics: ClassVar[tuple[str, ...]] = ()
    #: the metrics of its headline table (`learnkv.eval.report.summary_table`); empty: all of them
    headline: ClassVar[tuple[str, ...]] = ()
    #: prompts when the caller gives no limit (None: the whole prompt set)
    default_limit: ClassVar[int | None] = 8

    max_new_tokens: int = 64
    granularity: str = "token"
    block_size: int = 16
    # not a field (not an option, not in `options`): `learnkv.eval.run.evaluate` sets it on the instance to count
    # decoded tokens for its progress bar; every decode of the task goes through `decode_batch`
    on_step = None

    def __post_init__(self):
        if int(self.max_new_tokens) != self.max_new_tokens or self.max_new_tokens < 1:
            raise ValueError(f"{self.name}: max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        check_granularity(self.granularity, self.block_size)

    def decode(self, model, tokenizer, sample: Sample, policy: str, budget: int | None, params: dict,
               **options) -> GenerationResult:
        """`learnkv.generate` on one sample with this task's length and granularity (``options`` go through)."""
        return self.decode_batch(model, tokenizer, [sample], RunConfig(policy, params, [budget]), **options)

    def decode_batch(self, model, tokenizer, samples: list[Sample], run: RunConfig, **options) -> GenerationResult:
        """`learnkv.generate` on a left-padded batch of samples with this task's length and granularity."""
        pad_id = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        ids, mask = left_pad(samples, pad_id or 0)
        return generate(model, tokenizer, None, self.eviction(run), input_ids=ids, attention_mask=mask,
                        max_new_tokens=self.max_new_tokens, on_step=self.on_step, **options)

    def eviction(self, run: RunConfig) -> Eviction:
        """A configuration's eviction settings on this task (its granularity and block size)."""
        prefill, prefill_params = run.prefill or (None, {})
        return Eviction(run.policy, run.params, run.budgets if POLICIES[run.policy].evicts else None,
                        self.granularity, self.block_size, run.slack, prefill, prefill_params)

    def full_decode(self, model, tokenizer, samples: list[Sample]) -> tuple[GenerationResult, list[FreeRun]]:
        """The full cache's free run of a batch, timed: the run and each prompt's `FreeRun`, which a reference that
        keeps it lets `reference_run` give as the ``full`` row."""
        t0 = time.perf_counter()
        result = self.decode_batch(model, tokenizer, samples, RunConfig("full", {}, [None] * len(samples)))
        share = (time.perf_counter() - t0) / len(samples)
        texts = result.texts or [""] * len(samples)
        return result, [FreeRun(text, cost_row(result, b, share)) for b, text in enumerate(texts)]

    def reference_run(self, samples: list[Sample], refs: list[Any]) -> tuple[list[dict], list[dict]] | None:
        """The ``full`` row of a batch from its references, where each holds the full cache's free run (`FreeRun`):
        the same greedy decode of the same batch that the row would repeat. ``(metrics, cost rows)`` per prompt,
        or None (the row is decoded: the task has no such reference, or a reference lacks it)."""
        return None

    def final_length(self, sample: Sample, ref: Any) -> int:
        """The full length a budget fraction is a share of: the prompt plus what the full cache generated on it,
        where the task has a full-cache run (override), else the prompt plus ``max_new_tokens``."""
        return sample.input_ids.shape[1] + self.max_new_tokens

    def load(self, tokenizer, limit: int | None, seed: int) -> list[Sample]:
        """The task's held-out prompts, deterministic for a seed."""
        raise NotImplementedError

    def reference_batch(self, model, tokenizer, samples: list[Sample]) -> list[Any]:
        """Full-cache work shared by every policy and budget on each sample (None where the task needs none)."""
        return [None] * len(samples)

    def reference(self, model, tokenizer, sample: Sample) -> Any:
        """`reference_batch` of one sample."""
        return self.reference_batch(model, tokenizer, [sample])[0]

    def run_batch(self, model, tokenizer, samples: list[Sample], refs: list[Any],
                  run: RunConfig) -> tuple[list[dict[str, float | None]], GenerationResult]:
        """Decode a batch of prompts under one configuration.

        Parameters
        ----------
        samples, refs
            The prompts and what `reference_batch` returned for them.
        run : RunConfig
            Policy, parameters, each prompt's budget (already resolved), prefill policy.

        Returns
        -------
        (list of dict, GenerationResult)
            Each prompt's metrics (None where a metric does not apply) and the batch's run, whose per-row cost is
            reported.
        """
        raise NotImplementedError

    def run(self, model, tokenizer, sample: Sample, ref: Any, policy: str, budget: int | None,
            params: dict) -> tuple[dict[str, float | None], GenerationResult]:
        """`run_batch` on one prompt: its metrics and its run."""
        metrics, result = self.run_batch(model, tokenizer, [sample], [ref], RunConfig(policy, params, [budget]))
        return metrics[0], result

    def metric_names(self) -> tuple[str, ...]:
        """The metrics this task reports, in table and plot order."""
        return self.metrics

    def check_policy(self, policy: str) -> None:
        """Raise ValueError, before any decode, if this task as configured cannot run registered ``policy``."""

    def options(self) -> dict:
        """The task's settings, for the results' config."""
        return dataclasses.asdict(self)


def evicts(policy: str) -> bool:
    """Whether a registered policy ever evicts (``full`` does not, at any budget)."""
    return POLICIES[policy].evicts


def replays(policy: str) -> bool:
    """Whether a policy replays the full-cache continuation (``oracle``): its free-running output is the full
    cache's by construction, so output agreement says nothing about it."""
    return POLICIES[policy].needs_future


def capture_logits(model):
    """A forward hook on ``model.lm_head`` that keeps the last position's logits of the latest forward pass.

    Returns ``(latest, handle)``: ``latest["logits"]`` is ``[B, V]`` float32 (CPU); remove the hook with
    ``handle.remove()``.
    """
    latest: dict[str, Tensor] = {}

    def hook(module, inputs, output):
        latest["logits"] = output[:, -1].detach().float().cpu()

    return latest, model.lm_head.register_forward_hook(hook)
