"""Reasoning: GSM8K accuracy under a budget, and agreement with the full cache's final answer.

The model decodes its own chain of thought greedily; the answer is the number after the last ``####`` (else the
last number), as `learnkv.prompts.extract_answer` reads it. Metrics per prompt, averaged:

* ``accuracy``: the answer equals the gold answer (numerically);
* ``answer_agreement``: the answer equals the full-cache run's answer on the same prompt (both giving no
  number counts as agreeing). None for ``oracle``, which replays the full-cache output.

The bundled SmolLM2-135M scores about 0% on GSM8K and the opt-in Qwen2.5-Coder-0.5B about 25%, so on these
models the task mainly exercises the pipeline; a real reasoning model on a GPU is the real use.
"""

from __future__ import annotations

from dataclasses import dataclass

from learnkv.decode import GenerationResult
from learnkv.eval.tasks.base import Sample, Task, evicts, replays
from learnkv.prompts import extract_answer, is_correct, load_prompts

SPLITS = ("test", "all")


@dataclass
class Reasoning(Task):
    """GSM8K test problems with answer extraction.

    Parameters
    ----------
    max_new_tokens : int
        Room for the chain of thought.
    split : str
        ``"test"``: the held-out items of the 100 shipped GSM8K problems (12 under split seed 0); ``"all"``: all 100
        (the scorer never trains on ``gsm8k`` by default, only on ``gsm_symbolic``, which shares its templates).
    """

    name = "reasoning"
    metrics = ("accuracy", "answer_agreement")
    default_limit = None

    max_new_tokens: int = 256
    split: str = "test"

    def __post_init__(self):
        super().__post_init__()
        if self.split not in SPLITS:
            raise ValueError(f"reasoning split must be one of {', '.join(SPLITS)}, got {self.split!r}")

    def load(self, tokenizer, limit: int | None, seed: int) -> list[Sample]:
        if tokenizer is None:
            raise ValueError("the reasoning task needs a tokenizer")
        prompts = load_prompts("gsm8k", n=limit, seed=seed, split=None if self.split == "all" else self.split)
        return [Sample.from_prompt(p, tokenizer) for p in prompts]

    def reference(self, model, tokenizer, sample: Sample) -> GenerationResult:
        return self.decode(model, tokenizer, sample, "full", None, {})

    def run(self, model, tokenizer, sample, ref: GenerationResult, policy, budget, params):
        # a policy that never evicts decodes exactly as the reference did: reuse it
        result = ref if not evicts(policy) else self.decode(model, tokenizer, sample, policy, budget, params)
        text = result.texts[0]
        agree = extract_answer(text) == extract_answer(ref.texts[0])
        return {
            "accuracy": None if replays(policy) else float(is_correct(text, sample.answer)),
            "answer_agreement": None if replays(policy) else float(agree),
        }, result
