"""The task registry: one small module per task. To add a task, subclass `Task` in a new module here and add it
to `TASKS`; `python evaluate.py --task NAME` then runs it against every policy and budget.

* ``fidelity`` (`fidelity.py`): KL, top-1 agreement, perplexity ratio, attention recall and free-running agreement
  length against the full cache, teacher-forced along its continuation (model-agnostic).
* ``reasoning`` (`reasoning.py`): GSM8K accuracy and agreement with the full cache's answer.
* ``needle`` (`needle.py`): needle-in-a-haystack retrieval over context lengths and depths.
* ``chain`` (`chain.py`): chains of word problems whose late answers need early tokens (long outputs):
  per-problem and final accuracy of a free run, agreement with the full cache, and the fidelity metrics of a
  teacher-forced run (`Chain` subclasses `Fidelity`).
* ``gsm8k``, ``math500``, ``aime24``, ``champ`` (`math.py`): the math benchmarks, loaded by hub id (or a local
  copy, ``--data-file``; ``champ`` from its PyPI package), answers in ``\\boxed{}`` graded by math-verify.
"""

from __future__ import annotations

import dataclasses

from learnkv.eval.tasks.base import Sample, Task
from learnkv.eval.tasks.chain import Chain
from learnkv.eval.tasks.fidelity import Fidelity
from learnkv.eval.tasks.math import AIME24, GSM8K, MATH500, Champ
from learnkv.eval.tasks.needle import Needle
from learnkv.eval.tasks.reasoning import Reasoning

TASKS: dict[str, type[Task]] = {
    "fidelity": Fidelity,
    "reasoning": Reasoning,
    "needle": Needle,
    "chain": Chain,
    "gsm8k": GSM8K,
    "math500": MATH500,
    "aime24": AIME24,
    "champ": Champ,
}


def make_task(name: str, **options) -> Task:
    """Build a registered task; options it does not have (and options given as None) are ignored, so one set of
    command-line flags serves every task."""
    cls = TASKS.get(name)
    if cls is None:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}")
    fields = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in options.items() if k in fields and v is not None})


__all__ = ["TASKS", "Task", "Sample", "make_task"]
