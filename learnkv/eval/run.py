"""Policies x budgets x tasks -> one record each: the task's metrics plus the cost of every run.

`build_spec` validates everything a user types (policies, budgets, tasks, scorer, limit) without loading a model,
so bad input fails in a second with one line. `evaluate` runs the grid prompt by prompt (the full-cache reference
of a prompt is computed once and shared by every policy and budget) and pools the per-prompt metrics.
`learnkv.eval.report` turns the records into results.json, a markdown table and plots.

A budget is a token count (``64``) or a fraction (``0.25``) of the full length of each prompt's run, prompt plus
``max_new_tokens``, resolved per prompt as `learnkv.generate` does. ``full`` ignores the budget, so it runs once
per prompt and its record is repeated at every budget.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from learnkv.decode import GenerationResult, parse_number, resolve_budget, resolve_policy
from learnkv.eval.tasks import TASKS, Sample, Task, make_task
from learnkv.eval.tasks.base import evicts
from learnkv.policies import POLICIES, make_policy

DEFAULT_POLICIES = ("full", "streaming", "h2o", "tova", "snapkv", "roco", "lazy", "paged")
DEFAULT_BUDGETS = (0.25, 0.5)
COST_METRICS = ("budget_tokens", "peak_kv_bytes", "full_kv_bytes", "kv_share", "kept_share", "tokens_per_s",
                "eviction_share")


@dataclass
class EvalSpec:
    """A validated evaluation grid.

    Attributes
    ----------
    policies : list of str
        Registered policy names, in report order; ``params`` the parameters each is built with.
    budgets : list of int or float
        Token counts or fractions of the full length.
    tasks : list of Task
    limit : int or None
        Prompts per task (None: each task's default).
    seed : int
        Data seed (which prompts) and torch seed.
    """

    policies: list[str]
    budgets: list[int | float]
    tasks: list[Task]
    params: dict[str, dict] = field(default_factory=dict)
    limit: int | None = None
    seed: int = 0


def split_list(text: str | Sequence, what: str) -> list:
    """``"a,b"`` -> ``["a", "b"]`` (duplicates dropped, order kept); a list passes through."""
    items = [s.strip() for s in text.split(",")] if isinstance(text, str) else list(text)
    if not items or any(isinstance(s, str) and not s for s in items):
        raise ValueError(f"--{what} takes a comma-separated list with no empty items, got {text!r}")
    return list(dict.fromkeys(items))


def parse_budget(value: str | int | float) -> int | float:
    """``"64"`` -> 64 tokens, ``"0.25"`` -> a fraction; raises ValueError out of range."""
    if isinstance(value, str):
        try:
            value = parse_number(value)
        except ValueError:
            raise ValueError(f"budget must be a token count or a fraction in (0, 1], got {value!r}") from None
    resolve_budget(value, 1)  # range checks: >= 1 token, or a fraction in (0, 1]
    return value


def build_spec(policies=DEFAULT_POLICIES, budgets=DEFAULT_BUDGETS, tasks=("fidelity",), scorer: str | None = None,
               limit: int | None = None, seed: int = 0, **task_options) -> EvalSpec:
    """Validate a grid (no model needed). ``task_options`` go to every task that has them (`make_task`)."""
    tasks = [make_task(name, **task_options) for name in split_list(tasks, "task")]
    budgets = [parse_budget(b) for b in split_list(budgets, "budget")]
    names = split_list(policies, "policy")
    if limit is not None and (int(limit) != limit or limit < 1):
        raise ValueError(f"--limit must be a number of prompts >= 1, got {limit}")
    params = {}
    for name in names:
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r}; known policies: {', '.join(POLICIES)}")
        params[name] = {}
        if name == "learned":
            if not scorer:
                raise ValueError(
                    "policy 'learned' needs a scorer artifact: --scorer PATH (train one with `python train.py`)")
            params[name]["scorer"] = str(scorer)
        if name == "random":
            params[name]["seed"] = seed
        for b in budgets:  # a token budget too small for the policy's windows fails now, not mid-run
            if isinstance(b, int):
                for task in tasks:
                    resolve_policy(name, b, task.granularity, task.block_size, **params[name])
    if scorer:  # checked even when unused: a typo should not pass silently
        make_policy("learned", scorer=str(scorer)).resolve_defaults(1)
    return EvalSpec(names, budgets, tasks, params, limit, seed)


class _Cost:
    """Pools the cost of one (policy, budget) over prompts: mean resolved budget, mean peak and full KV bytes
    (``kv_share`` is their ratio; the peak includes the uncompressed prefill, so a prompt longer than the budget
    sets it), ``kept_share`` the mean over prompts and steps of the slots held after a step over a full cache's,
    generated tokens per second of wall time (prefill included), and the eviction share of that time."""

    def __init__(self):
        self.budget, self.peak, self.full, self.kept = [], [], [], []
        self.tokens = self.seconds = self.evict_s = 0.0

    def add(self, r: GenerationResult) -> None:
        seconds = r.prefill_s + r.decode_s
        self.budget.append(r.budget)
        self.peak.append(r.peak_kv_bytes)
        self.full.append(r.full_kv_bytes)
        # slots held after each forward pass over what a full cache holds then (prompt + tokens fed so far)
        held = [sum(k) / len(k) / (r.prompt_tokens + s) for s, k in enumerate(r.kept_per_step)]
        self.kept.append(sum(held) / len(held))
        self.tokens += r.tokens.numel()
        self.seconds += seconds
        self.evict_s += r.eviction_share * seconds

    def metrics(self) -> dict:
        peak, full = _mean(self.peak), _mean(self.full)
        return {
            "budget_tokens": _mean(self.budget),
            "peak_kv_bytes": round(peak),
            "full_kv_bytes": round(full),
            "kv_share": peak / max(full, 1),
            "kept_share": _mean(self.kept),
            "tokens_per_s": self.tokens / max(self.seconds, 1e-9),
            "eviction_share": self.evict_s / max(self.seconds, 1e-9),
        }


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return float(sum(values) / len(values)) if values else None


def aggregate(rows: list[dict]) -> dict:
    """Per-prompt metric dicts -> the mean of each metric over the prompts that have it (None if none has)."""
    keys = list(dict.fromkeys(k for row in rows for k in row))
    return {k: _mean([row.get(k) for row in rows]) for k in keys}


def check_budgets(task: Task, prompts: Sequence[Sample], spec: EvalSpec) -> None:
    """Every (prompt, policy, budget) of the grid can run: a fraction resolves per prompt, and a policy whose
    windows do not fit the resolved budget (e.g. `paged`'s two protected blocks in 25% of a short run) must fail
    before the first decode, not after an hour of results. Raises ValueError naming the prompt."""
    checked = set()
    for sample in prompts:
        full_length = sample.input_ids.shape[1] + task.max_new_tokens
        for b in spec.budgets:
            for p in spec.policies:
                tokens = resolve_budget(b, full_length) if evicts(p) else None
                if (p, tokens) in checked:
                    continue
                try:
                    resolve_policy(p, tokens, task.granularity, task.block_size, **spec.params[p])
                except ValueError as e:
                    raise ValueError(f"{task.name} prompt {sample.id} ({sample.input_ids.shape[1]} + "
                                     f"{task.max_new_tokens} tokens), budget {b} = {tokens} tokens: {e}") from None
                checked.add((p, tokens))


def evaluate(model, tokenizer, spec: EvalSpec, samples: Sequence[Sample] | None = None, progress: bool | None = None,
             model_name: str | None = None) -> list[dict]:
    """Run every policy x budget x task of ``spec``.

    Parameters
    ----------
    model, tokenizer
        A loaded causal LM (`learnkv.load_model`); the tokenizer may be None when ``samples`` are token ids.
    samples : sequence of Sample, optional
        Prompts to use for every task instead of each task's own (tests feed token ids to the tiny model).
    progress : bool or None
        tqdm bar over prompts (None: only on a terminal).

    Returns
    -------
    list of dict
        One record per (policy, budget, task), task-major, then budget, then policy:
        ``{"policy", "budget", "task", "metrics": {...}, "config": {...}}``.
    """
    from tqdm.auto import tqdm

    torch.manual_seed(spec.seed)
    records = []
    for task in spec.tasks:
        limit = spec.limit if spec.limit is not None else task.default_limit
        prompts = list(samples)[:limit] if samples is not None else task.load(tokenizer, limit, spec.seed)
        if not prompts:
            raise ValueError(f"task {task.name!r} found no prompts")
        check_budgets(task, prompts, spec)
        rows = {(p, b): [] for b in spec.budgets for p in spec.policies}
        costs = {key: _Cost() for key in rows}
        first_params = {}
        for sample in tqdm(prompts, desc=task.name, unit="prompt", disable=None if progress is None else not progress):
            ref = task.reference(model, tokenizer, sample)
            done = {}  # (policy, budget tokens) -> (metrics, result): full runs once, equal budgets once
            for b in spec.budgets:
                for p in spec.policies:
                    tokens = resolve_budget(b, sample.input_ids.shape[1] + task.max_new_tokens) if evicts(p) else None
                    if (p, tokens) not in done:
                        done[p, tokens] = task.run(model, tokenizer, sample, ref, p, tokens, spec.params[p])
                    metrics, result = done[p, tokens]
                    rows[p, b].append(metrics)
                    costs[p, b].add(result)
                    first_params.setdefault((p, b), result.params)
        for (p, b), per_prompt in rows.items():
            pooled = aggregate(per_prompt)
            metrics = {k: pooled.get(k) for k in task.metric_names()}  # every named metric, None if none had it
            metrics.update(pooled)
            metrics.update(costs[p, b].metrics())
            config = {
                "model": model_name or getattr(model.config, "name_or_path", None) or type(model).__name__,
                "task_options": task.options(),
                "n_prompts": len(prompts),
                "prompt_ids": [s.id for s in prompts],
                "seed": spec.seed,
                "policy_params": first_params[p, b],
                "device": str(next(model.parameters()).device),
                "threads": torch.get_num_threads(),
                "date": time.strftime("%Y-%m-%d"),
            }
            records.append({"policy": p, "budget": b, "task": task.name, "metrics": metrics, "config": config})
    return records


__all__ = ["EvalSpec", "build_spec", "evaluate", "aggregate", "parse_budget", "TASKS", "DEFAULT_POLICIES",
           "DEFAULT_BUDGETS", "COST_METRICS"]
