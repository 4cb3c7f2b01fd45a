"""Needle in a haystack: retrieval accuracy under a budget, over context lengths and depths.

A seeded 7-digit number is hidden at a given depth of a Paul Graham essay haystack cut to a token length
(`learnkv.prompts`, source ``needle``); the prompt ends with the question. A prompt counts as correct if the
needle's number appears in the output. Reports ``accuracy`` overall, ``accuracy@L`` per context length L and
``accuracy@dD`` per depth D (None where the held-out prompts have none of that length or depth).
"""

from __future__ import annotations

from dataclasses import dataclass

from learnkv.eval.tasks.base import RunConfig, Sample, Task, replays
from learnkv.prompts import load_prompts


@dataclass
class Needle(Task):
    """Needle retrieval on held-out (test split) prompts of the grid ``context_tokens x depths``.

    Parameters
    ----------
    max_new_tokens : int
        The answer is a number: a few tokens suffice.
    context_tokens : tuple of int
        Prompt lengths in the model's tokens (1k-4k for the bundled model; about 5 s a query at 1k on one CPU core).
    depths : tuple of float
        Where the needle goes, as a fraction of the haystack (0 = start).
    """

    name = "needle"
    default_limit = 9

    max_new_tokens: int = 16
    context_tokens: tuple[int, ...] = (1024, 2048, 4096)
    depths: tuple[float, ...] = (0.1, 0.5, 0.9)

    def __post_init__(self):
        super().__post_init__()
        self.context_tokens, self.depths = tuple(self.context_tokens), tuple(self.depths)
        if not self.context_tokens or any(int(L) != L or L < 64 for L in self.context_tokens):
            raise ValueError(f"needle context lengths must be token counts >= 64, got {self.context_tokens}")
        if not self.depths or any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise ValueError(f"needle depths must be fractions in [0, 1], got {self.depths}")

    def metric_names(self) -> tuple[str, ...]:
        return (("accuracy",) + tuple(f"accuracy@{L}" for L in self.context_tokens)
                + tuple(f"accuracy@d{d:g}" for d in self.depths))

    def load(self, tokenizer, limit: int | None, seed: int) -> list[Sample]:
        if tokenizer is None:
            raise ValueError("the needle task needs a tokenizer (the haystack is cut to a token length)")
        prompts = load_prompts("needle", n=limit, seed=seed, split="test", tokenizer=tokenizer,
                               context_tokens=self.context_tokens, depths=self.depths)
        return [Sample.from_prompt(p, tokenizer) for p in prompts]

    def run_batch(self, model, tokenizer, samples, refs, run: RunConfig):
        result = self.decode_batch(model, tokenizer, samples, run)
        out = []
        for sample, text in zip(samples, result.texts):
            correct = None if replays(run.policy) else float(sample.answer in text)
            length, depth = sample.meta.get("context_tokens"), sample.meta.get("depth")
            out.append({"accuracy": correct, f"accuracy@{length}": correct, f"accuracy@d{depth:g}": correct})
        return out, result
