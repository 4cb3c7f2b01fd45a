"""Evaluation: policies x budgets x tasks, scored against the full cache, with the cost of every run.

* `learnkv.eval.metrics`: pure metric functions (KL, top-1 agreement, perplexity ratio, attention recall,
  agreement length).
* `learnkv.eval.tasks`: the task registry (`TASKS`: fidelity, reasoning, needle), one module per task.
* `learnkv.eval.run`: `build_spec` (validation, no model) and `evaluate` (the grid -> records).
* `learnkv.eval.report`: results.json, the markdown table, the plots.

`evaluate.py` at the repository root is the command line over these.
"""

from learnkv.eval.report import markdown_table, plot, write_results
from learnkv.eval.run import EvalSpec, build_spec, evaluate
from learnkv.eval.tasks import TASKS, Sample, Task, make_task

__all__ = ["TASKS", "EvalSpec", "Sample", "Task", "build_spec", "evaluate", "make_task", "markdown_table", "plot",
           "write_results"]
