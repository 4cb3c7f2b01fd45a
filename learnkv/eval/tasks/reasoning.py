"""Reasoning: GSM8K accuracy under a budget, and agreement with the full cache's final answer.

The model decodes its own chain of thought greedily; the answer is the number after the last ``####`` (else the
last number), as `learnkv.prompts.extract_answer` reads it. Metrics per prompt, averaged:

* ``accuracy``: the answer equals the gold answer (numerically);
* ``answer_agreement``: the answer equals the full-cache run's answer on the same prompt (both giving no
  number counts as agreeing). None for ``oracle``, which replays the full-cache output;
* ``generated_tokens``: the full cache's output length (the regime; the runner reports its mean and
  ``generated_tokens_median``).

The bundled SmolLM2-135M scores about 0% on GSM8K and the opt-in Qwen2.5-Coder-0.5B about 25%, so on these
models the task mainly exercises the pipeline; a real reasoning model on a GPU is the real use.
"""

from __future__ import annotations

from dataclasses import dataclass

from learnkv.eval.tasks.base import RunConfig, Sample, Task, replays
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
    metrics = ("accuracy", "answer_agreement", "generated_tokens")
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

    def reference_batch(self, model, tokenizer, samples: list[Sample]) -> list[dict]:
        result = self.decode_batch(model, tokenizer, samples, RunConfig("full", {}, [None] * len(samples)))
        return [{"text": t, "new_tokens": n} for t, n in zip(result.texts, result.new_tokens)]

    def final_length(self, sample: Sample, ref: dict) -> int:
        return sample.input_ids.shape[1] + ref["new_tokens"]

    def run_batch(self, model, tokenizer, samples, refs, run: RunConfig):
        result = self.decode_batch(model, tokenizer, samples, run)
        out = []
        for sample, ref, text in zip(samples, refs, result.texts):
            agree = extract_answer(text) == extract_answer(ref["text"])
            out.append({
                "accuracy": None if replays(run.policy) else float(is_correct(text, sample.answer)),
                "answer_agreement": None if replays(run.policy) else float(agree),
                "generated_tokens": float(ref["new_tokens"]),
            })
        return out, result
