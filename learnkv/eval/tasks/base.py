"""The task contract: what an evaluation task loads, what it computes once per prompt, what it scores per run.

A task knows its prompts and its metrics; it knows nothing about the list of policies or budgets, results files
or plots (`learnkv.eval.run` owns those). `run` is called once per prompt, policy and budget and returns the
prompt's metrics and the `GenerationResult` whose cost (KV bytes, tokens/s, eviction time) the runner pools.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import Tensor

from learnkv.decode import GRANULARITIES, GenerationResult, encode_prompts, generate
from learnkv.policies import POLICIES


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
        """Tokenize a `learnkv.prompts.Prompt` with the model's chat template."""
        ids, _ = encode_prompts(tokenizer, prompt.text)
        return cls(prompt.id, ids, prompt.answer, dict(prompt.meta))

    @classmethod
    def from_ids(cls, ids: Tensor, id: str = "ids", answer: str | None = None) -> "Sample":
        """A token-id prompt ``[L]`` or ``[1, L]`` (what tests on the tiny random model use)."""
        ids = ids if ids.dim() == 2 else ids[None]
        if ids.shape[0] != 1 or ids.shape[1] == 0:
            raise ValueError(f"a sample is one non-empty row of token ids, got shape {tuple(ids.shape)}")
        return cls(id, ids.long(), answer)


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
    #: prompts when the caller gives no limit (None: the whole prompt set)
    default_limit: ClassVar[int | None] = 8

    max_new_tokens: int = 64
    granularity: str = "token"
    block_size: int = 16

    def __post_init__(self):
        if int(self.max_new_tokens) != self.max_new_tokens or self.max_new_tokens < 1:
            raise ValueError(f"{self.name}: max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {self.granularity!r}")
        if int(self.block_size) != self.block_size or self.block_size < 1:
            raise ValueError(f"block size must be an integer >= 1, got {self.block_size!r}")

    def decode(self, model, tokenizer, sample: Sample, policy: str, budget: int | None, params: dict,
               **options) -> GenerationResult:
        """`learnkv.generate` on one sample with this task's length and granularity (``options`` go through)."""
        return generate(model, tokenizer, input_ids=sample.input_ids, policy=policy, budget=budget,
                        max_new_tokens=self.max_new_tokens, policy_params=params, granularity=self.granularity,
                        block_size=self.block_size, **options)

    def load(self, tokenizer, limit: int | None, seed: int) -> list[Sample]:
        """The task's held-out prompts, deterministic for a seed."""
        raise NotImplementedError

    def reference(self, model, tokenizer, sample: Sample) -> Any:
        """Full-cache work shared by every policy and budget on this prompt (None if the task needs none)."""
        return None

    def run(self, model, tokenizer, sample: Sample, ref: Any, policy: str, budget: int | None,
            params: dict) -> tuple[dict[str, float | None], GenerationResult]:
        """Decode one prompt under one policy and budget.

        Parameters
        ----------
        ref
            What `reference` returned for this sample.
        policy : str
            A registered policy name; ``params`` its parameters.
        budget : int or None
            Tokens per layer and KV head, already resolved for this prompt (None for a policy that never evicts).

        Returns
        -------
        (dict, GenerationResult)
            This prompt's metrics (None where a metric does not apply) and the run whose cost is reported.
        """
        raise NotImplementedError

    def pool(self, rows: list[dict]) -> dict[str, float | None]:
        """Per-prompt metric dicts -> this task's figures: by default each metric's mean over the prompts that
        have it (None if none has). A task that also reports another statistic (``chain``: the median generated
        length) overrides this."""
        keys = list(dict.fromkeys(k for row in rows for k in row))
        pooled = {}
        for k in keys:
            values = [row[k] for row in rows if row.get(k) is not None]
            pooled[k] = float(sum(values) / len(values)) if values else None
        return pooled

    def metric_names(self) -> tuple[str, ...]:
        """The metrics this task reports, in table and plot order."""
        return self.metrics

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

    Returns ``(latest, handle)``: ``latest["logits"]`` is ``[V]`` float32; remove the hook with ``handle.remove()``.
    """
    latest: dict[str, Tensor] = {}

    def hook(module, inputs, output):
        latest["logits"] = output[0, -1].detach().float().cpu()

    return latest, model.lm_head.register_forward_hook(hook)
