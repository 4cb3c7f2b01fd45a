"""Policies x budgets x tasks -> one record each: the task's metrics with 95% intervals, plus the cost of every run.

`build_spec` validates everything a user types (policies with their parameters, budgets, tasks, scorer, limit,
prefill policy, batch size, comparison baseline) without loading a model, so bad input fails in a second with one
line. `evaluate` runs the grid batch by batch: the full-cache reference of a batch of prompts is computed once and
shared by every policy and budget, and every row of a batch decodes exactly as it would alone. Per-prompt metrics
are pooled into means with bootstrap intervals over prompts (`learnkv.eval.stats`); with a baseline, every other
policy's paired difference to it. `learnkv.eval.report` turns the records into results.json, a table and plots.

A policy item is ``NAME[:key=value]...`` (``lazy:window=16``): its label, the item as written, names its row. A
budget is a token count (``64``) or a fraction (``0.25``) of each prompt's final length: the prompt plus what the
full cache generated on it (LazyEviction's ratio of the final length), or plus ``max_new_tokens`` where a task has
no full-cache run. ``full`` ignores the budget, so it runs once per prompt and its record is repeated at every
budget.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from learnkv.decode import check_positions
from learnkv.eval import checkpoint
from learnkv.eval.checkpoint import scorer_identity
from learnkv.eval.stats import bootstrap_ci, paired_difference
from learnkv.eval.tasks import TASKS, Sample, Task, make_task
from learnkv.eval.tasks.base import RunConfig, cost_row, evicts
from learnkv.policies import POLICIES
from learnkv.policies.params import parse_policy, parse_policy_list
from learnkv.progress import redraw_seconds, token_counter
from learnkv.settings import Eviction, batch_groups, parse_number, resolve_budget, split_allocation

DEFAULT_POLICIES = ("full", "streaming", "h2o", "tova", "snapkv", "roco", "lazy", "paged")
DEFAULT_BUDGETS = (0.25, 0.5)
COST_METRICS = ("budget_tokens", "peak_kv_bytes", "live_kv_bytes", "full_kv_bytes", "kv_share", "kept_share",
                "tokens_per_s", "eviction_share")


@dataclass(frozen=True)
class PolicyRun:
    """One row of the grid: a registered policy with its parameters, named by its label."""

    label: str
    name: str
    params: dict = field(default_factory=dict, hash=False)


@dataclass
class EvalSpec:
    """A validated evaluation grid.

    Attributes
    ----------
    runs : list of PolicyRun
        The policy items, in report order.
    budgets : list of int or float
        Token counts or fractions of each prompt's final length.
    tasks : list of Task
    limit : int or None
        Prompts per task (None: each task's default).
    seed : int
        Data seed (which prompts) and torch seed.
    prefill : PolicyRun or None
        Compresses prompts over the budget at the prefill for every evicting policy (`learnkv.generate`).
    batch_size : int
        Prompts decoded together (speed only: each row decodes as alone).
    compare : str or None
        The label every other policy is compared with (paired differences).
    slack : int
        Dead slots a layer may hold before it compacts (speed and memory only: the same kept tokens, see
        `learnkv.generate`); 0 compacts whenever a slot is free in every row.
    batch_budgets : bool
        Decode a policy at every budget in one batch: ``batch_size`` prompts x the budgets as rows (speed only:
        each row decodes as alone). One decode step reads the model's weights once for all of them, which is
        most of a step's cost for a larger model on a CPU; the batch's memory grows with its rows.
    """

    runs: list[PolicyRun]
    budgets: list[int | float]
    tasks: list[Task]
    limit: int | None = None
    seed: int = 0
    prefill: PolicyRun | None = None
    batch_size: int = 1
    compare: str | None = None
    slack: int = 0
    batch_budgets: bool = False

    @property
    def policies(self) -> list[str]:
        return [r.label for r in self.runs]

    def config(self, run: PolicyRun, budgets: list[int | None]) -> RunConfig:
        """A grid row's decode configuration for prompts at these budgets (tokens, one per prompt)."""
        return run_config(run, budgets, self.prefill, self.slack)


def run_config(run: PolicyRun, budgets: list[int | None], prefill: PolicyRun | None = None, slack: int = 0) -> RunConfig:
    return RunConfig(run.name, run.params, budgets, (prefill.name, prefill.params) if prefill else None, slack)


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


def _policy_run(label: str, name: str, params: dict, scorer: str | None, seed: int) -> PolicyRun:
    """A checked grid row: a known policy, parameters of the right type and range, the scorer where needed."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r} in {label!r}; known policies: {', '.join(POLICIES)}")
    settings = Eviction(name, params, scorer=scorer)  # the allocation keys move to their own setting
    allocation = split_allocation(params)[1]  # kept as given: the row's parameters carry them
    params = settings.policy_params  # a learned policy takes --scorer
    if name == "random":
        params.setdefault("seed", seed)
    Eviction(name, params, allocation=settings.allocation).check()  # unknown keys and bad values fail here, naming
    # the valid keys; so does no scorer
    return PolicyRun(label, name, {**params, **allocation})  # the row's parameters carry them to `Task.eviction`


def prefill_run(item: str, where: str, scorer: str | None = None, seed: int = 0) -> PolicyRun:
    """The checked prefill policy of a ``NAME[:key=value]...`` item; ``where`` names the option in the error when
    the policy cannot decide at the prefill (`learnkv.cache.prefill_policy_error`)."""
    name, params = parse_policy(item)
    run = _policy_run(item, name, params, scorer, seed)
    Eviction(prefill=name, prefill_params=run.params).check(prefill_option=where)
    return run


def build_spec(policies=DEFAULT_POLICIES, budgets=DEFAULT_BUDGETS, tasks=("fidelity",), scorer: str | None = None,
               limit: int | None = None, seed: int = 0, prefill_policy: str | None = None, batch_size: int = 1,
               compare: str | None = None, slack: int = 0, batch_budgets: bool = False,
               **task_options) -> EvalSpec:
    """Validate a grid (no model needed). ``task_options`` go to every task that has them (`make_task`)."""
    tasks = [make_task(name, **task_options) for name in split_list(tasks, "task")]
    # compared as numbers, not as typed (0.5 and 0.50 are one budget; 64 tokens and the fraction 1.0 are not)
    budgets = list({(type(b), b): b for b in map(parse_budget, split_list(budgets, "budget"))}.values())
    runs = [_policy_run(label, name, params, scorer, seed) for label, name, params in parse_policy_list(policies)]
    for k, run in enumerate(runs):  # one policy under two labels would be two rows of the same decodes
        for other in runs[:k]:
            if _decoded_as(run) == _decoded_as(other):
                raise ValueError(f"--policy items {other.label!r} and {run.label!r} are the same policy with the same "
                                 "parameters: give it once")
    if limit is not None and (int(limit) != limit or limit < 1):
        raise ValueError(f"--limit must be a number of prompts >= 1, got {limit}")
    if isinstance(batch_size, bool) or int(batch_size) != batch_size or batch_size < 1:
        raise ValueError(f"--batch-size must be a number of prompts >= 1, got {batch_size}")
    if isinstance(slack, bool) or int(slack) != slack or slack < 0:
        raise ValueError(f"--slack must be a number of dead slots >= 0, got {slack}")
    if not isinstance(batch_budgets, bool):
        raise ValueError(f"--batch-budgets is true or false, got {batch_budgets!r}")
    prefill = prefill_run(prefill_policy, "--prefill-policy", scorer, seed) if prefill_policy else None
    if compare is not None and compare not in [r.label for r in runs]:
        raise ValueError(f"--compare {compare!r} is not one of the policies: {', '.join(r.label for r in runs)}")
    if compare is not None and len(runs) == 1:
        raise ValueError(f"--compare {compare!r} has no other policy to compare with: add one to --policy")
    for run in runs:
        for task in tasks:
            task.check_policy(run.name)
    for run in runs:  # a token budget too small for the policy's windows fails now, not mid-run
        for b in budgets:
            if isinstance(b, int):
                for task in tasks:
                    task.eviction(run_config(run, [b], prefill)).check(b)
    Eviction(scorer=scorer).check()  # a scorer is checked even when unused: a typo should not pass silently
    return EvalSpec(runs, budgets, tasks, limit, seed, prefill, int(batch_size), compare, int(slack), batch_budgets)


def _decoded_as(run: PolicyRun) -> tuple:
    """What a grid row decodes: its policy, built with its parameters, and its allocation."""
    settings = Eviction(run.name, run.params)
    return run.name, settings.make(), settings.resolved_allocation


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return float(sum(values) / len(values)) if values else None


def aggregate(rows: list[dict]) -> dict:
    """Per-prompt metric dicts -> the mean of each metric over the prompts that have it (None if none has)."""
    keys = list(dict.fromkeys(k for row in rows for k in row))
    return {k: _mean([row.get(k) for row in rows]) for k in keys}


def pool_cost(rows: list[dict]) -> dict:
    """Pools per-prompt costs: mean resolved budget, mean peak and full KV bytes (``kv_share`` is their ratio;
    the peak includes a prompt held before it is compressed; ``peak_kv_bytes`` is what learnkv's padded buffers
    hold, ``live_kv_bytes`` the live slots alone, what a paged per-head layout would hold: they differ under the
    ``head`` and ``global`` allocations), ``kept_share`` the mean over prompts of the tokens
    held after each step over a full cache's, generated tokens per second of wall time (prefill included), and the
    eviction share of that time."""
    peak, full = _mean([r["peak"] for r in rows]), _mean([r["full"] for r in rows])
    seconds = sum(r["seconds"] for r in rows)
    return {
        "budget_tokens": _mean([r["budget"] for r in rows]),
        "peak_kv_bytes": round(peak),
        "live_kv_bytes": round(_mean([r.get("live", r["peak"]) for r in rows])),  # resumed rows from before: peak
        "full_kv_bytes": round(full),
        "kv_share": peak / max(full, 1),
        "kept_share": _mean([r["kept"] for r in rows]),
        "tokens_per_s": sum(r["tokens"] for r in rows) / max(seconds, 1e-9),
        "eviction_share": sum(r["evict_s"] for r in rows) / max(seconds, 1e-9),
    }


def _budgets_for(run: PolicyRun, b, finals: list[int]) -> list[int | None]:
    return [resolve_budget(b, f) if evicts(run.name) else None for f in finals]


def _check(task: Task, spec: EvalSpec, run: PolicyRun, samples: list[Sample], budgets: list[int | None], b) -> None:
    """Raise ValueError, naming the prompt, if a run cannot decode a prompt at its budget."""
    for sample, tokens in zip(samples, budgets):
        where = f"{task.name} prompt {sample.id} ({sample.input_ids.shape[1]} prompt tokens), budget {b} = {tokens} tokens"
        try:
            task.eviction(spec.config(run, [tokens])).resolve([tokens], [sample.input_ids.shape[1]])
        except ValueError as e:
            raise ValueError(f"{where}, policy {run.label!r}: {e}") from None


def check_grid(task: Task, prompts: Sequence[Sample], spec: EvalSpec) -> None:
    """Before the first decode: every (prompt, policy, budget) that fails at every possible final length (a
    fraction resolved at the prompt + ``max_new_tokens`` is the largest budget it can get) fails now, naming the
    prompt, rather than after hours of results. What depends on the actual final length is checked batch by batch."""
    for run in spec.runs:
        for b in spec.budgets:
            finals = [s.input_ids.shape[1] + task.max_new_tokens for s in prompts]
            _check(task, spec, run, list(prompts), _budgets_for(run, b, finals), b)


def _decode(model, tokenizer, task: Task, spec: EvalSpec, run: PolicyRun, batch: list[Sample], refs: list,
            todo: list[tuple]) -> list[tuple[list, list, dict | None]]:
    """Decode ``batch`` under ``run`` at each ``(budget, tokens per prompt)`` of ``todo`` as rows of one batch
    (prompt i at budget k is row k * len(batch) + i; split by `batch_groups` where rows cannot share a policy), and give
    each budget its ``(metrics, costs, params)`` per prompt. ``params`` are the policy as resolved for the budget's
    first prompt (`learnkv.generate` reports its first row's)."""
    rows = [(k, i) for k in range(len(todo)) for i in range(len(batch))]
    budgets = [todo[k][1][i] for k, i in rows]
    for b, tokens in todo:
        _check(task, spec, run, batch, tokens, b)
    metrics = [[None] * len(batch) for _ in todo]
    row_costs = [[None] * len(batch) for _ in todo]
    reused = task.reference_run(batch, refs) if not evicts(run.name) and not run.params else None
    if reused is not None:  # the full row is the reference's own greedy decode: graded and costed as it ran
        for k in range(len(todo)):
            metrics[k], row_costs[k] = list(reused[0]), list(reused[1])
    groups = batch_groups(task.eviction(spec.config(run, budgets)), budgets) if reused is None else []
    for group in groups:
        cfg = spec.config(run, [budgets[j] for j in group])
        t0 = time.perf_counter()
        m, generated = task.run_batch(model, tokenizer, [batch[rows[j][1]] for j in group],
                                      [refs[rows[j][1]] for j in group], cfg)
        share = (time.perf_counter() - t0) / len(group)
        for n, j in enumerate(group):
            k, i = rows[j]
            metrics[k][i], row_costs[k][i] = m[n], cost_row(generated, n, share)
    params = [task.eviction(spec.config(run, tokens[:1])).resolve(tokens[:1])[0][0].params() for _, tokens in todo]
    return list(zip(metrics, row_costs, params))


def batches(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i : i + size]


def evaluate(model, tokenizer, spec: EvalSpec, samples: Sequence[Sample] | None = None, progress: bool | None = None,
             model_name: str | None = None, resume_dir: str | Path | None = None,
             finished_only: bool = False, shard: tuple[int, int] | None = None) -> list:
    """Run every policy x budget x task of ``spec``.

    Parameters
    ----------
    model, tokenizer
        A loaded causal LM (`learnkv.load_model`); the tokenizer may be None when ``samples`` are token ids.
    samples : sequence of Sample, optional
        Prompts to use for every task instead of each task's own (tests feed token ids to the tiny model).
    progress : bool or None
        A tqdm bar over prompts and runs (None: only on a terminal; True: also into a log, every 30 s).
    resume_dir : path, optional
        Keep every finished (policy, budget) of each batch of prompts in ``resume_dir/partial.jsonl`` and skip what
        an earlier, killed run of the same grid finished there (`learnkv.eval.checkpoint`).
    finished_only : bool
        Decode nothing: the records of the batches of prompts that a running or killed evaluation of this grid into
        ``resume_dir`` has finished so far (its partial file is only read), per budget: a budget's records count
        every batch finished at that budget, so one budget may have more prompts than another (each record says
        how many) and a budget no batch has finished has no records. Raises ValueError if none is finished.
    shard : (i, n), optional
        Decode only the batches of prompts whose index is i modulo n (0 <= i < n), into
        ``resume_dir/shard-i-of-n/``, reading what the main directory and the other shards finished as done; several
        processes, one per shard, decode one grid together, and a run without ``shard`` reads all of it back
        (`learnkv.eval.checkpoint`).

    Returns
    -------
    list of dict
        One record per (policy, budget, task), task-major, then budget, then policy: ``{"policy": label,
        "budget", "task", "metrics": {m, m_ci95, ..., cost}, "per_prompt": {m: [...]}, "config": {...}}``, with
        ``config["policy_params"]`` the resolved parameters (one prompt's), ``config["policy_given"]`` the
        parameters as given and ``config["n_prompts"]``. With ``shard``, instead:
        the 1-based indices of the batches left to other shards (none finished when this one ended).
    """
    torch.manual_seed(spec.seed)
    if shard is not None and (resume_dir is None or finished_only):
        raise ValueError("a shard decodes into its own directory of resume_dir, and decodes: give resume_dir, "
                         "without finished_only")
    resume = checkpoint.Resume(resume_dir if shard is None else checkpoint.shard_dir(resume_dir, shard),
                               checkpoint.grid_identity(spec, model_name), finished_only)
    left = []  # with a shard: the batches (1-based) left to the other shards
    if resume.note:
        print(f"note: {resume.note}", file=sys.stderr)
    records = []
    for task in spec.tasks:
        prompts = _prompts(model, tokenizer, task, spec, samples)
        grid = _TaskGrid(model, tokenizer, task, spec, resume, model_name, len(prompts), progress)
        try:
            for i, batch in enumerate(batches(prompts, spec.batch_size)):
                resume.refresh()  # a shard may have finished it meanwhile
                if grid.read_back(batch, finished_only):
                    continue
                if shard is not None and i % shard[1] != shard[0]:
                    left.append(i + 1)  # another shard's
                    continue
                grid.run_batch(batch)
        finally:
            task.on_step = None
            grid.bar.close()
        if shard is None:
            records += grid.records(resume_dir)
    return left if shard is not None else records


def _prompts(model, tokenizer, task: Task, spec: EvalSpec, samples: Sequence[Sample] | None) -> list[Sample]:
    """A task's prompts, checked against the grid and the model before the first decode."""
    limit = spec.limit if spec.limit is not None else task.default_limit
    prompts = list(samples)[:limit] if samples is not None else task.load(tokenizer, limit, spec.seed)
    if not prompts:
        raise ValueError(f"task {task.name!r} found no prompts")
    seen = Counter(s.id for s in prompts)
    if twice := [pid for pid, n in seen.items() if n > 1]:  # a record's prompts are distinct, or its interval lies
        raise ValueError(f"task {task.name!r}: prompt id {twice[0]!r} appears {seen[twice[0]]} times among its "
                         f"prompts ({len(twice)} ids repeat); give each prompt once")
    check_grid(task, prompts, spec)
    check_positions(model, [s.input_ids.shape[1] for s in prompts], task.max_new_tokens,
                    [f"{task.name} prompt {s.id}" for s in prompts])
    return prompts


class _TaskGrid:
    """One task's pass over its batches of prompts: each batch's (policy, budget) runs, read back from an earlier
    run (`learnkv.eval.checkpoint.Resume`) or decoded, filed per prompt until the task's records are made."""

    def __init__(self, model, tokenizer, task: Task, spec: EvalSpec, resume: checkpoint.Resume,
                 model_name: str | None, n_prompts: int, progress: bool | None):
        self.model, self.tokenizer, self.task, self.spec = model, tokenizer, task, spec
        self.resume, self.model_name = resume, model_name
        self.keys = [(r, b) for b in spec.budgets for r in spec.runs]
        self.per_prompt = {key: {} for key in self.keys}  # (run, budget) -> sample id -> metrics
        self.costs = {key: {} for key in self.keys}
        self.first_params = {}
        # per budget, the prompts of every batch evaluated (or read back) in full at that budget: all budgets of a
        # batch at once when decoding; --finished-only also reports a budget that a batch has finished before the next
        self.done_prompts = {b: {} for b in spec.budgets}  # id -> sample: each prompt once, however often it is filed
        # the reference and every distinct (policy, budget)
        self.runs_per_prompt = 1 + len({(r.label, b) if evicts(r.name) else r.label for r, b in self.keys})
        redraw_s = redraw_seconds()
        self.bar = tqdm(total=n_prompts * self.runs_per_prompt, desc=task.name, unit="run",
                        disable=not sys.stderr.isatty() if progress is None else not progress,
                        mininterval=redraw_s, file=sys.stderr)
        task.on_step = self.counter = token_counter(self.bar, every_s=redraw_s)  # live tokens, tok/s, what runs

    def keep(self, run_b: tuple, ids: list[str], metrics: list, row_costs: list, params: dict | None) -> None:
        """File one (policy, budget)'s per-prompt metrics and costs for a batch of prompts under their ids."""
        self.per_prompt[run_b].update(zip(ids, metrics))
        self.costs[run_b].update(zip(ids, row_costs))
        if params is not None:
            self.first_params.setdefault(run_b, params)

    def done_at(self, b, batch: list[Sample]) -> None:
        self.done_prompts[b].update((s.id, s) for s in batch)

    def read_back(self, batch: list[Sample], finished_only: bool) -> bool:
        """File what an earlier run finished of ``batch``: True if that is all there is to do for it (every budget
        finished, or ``finished_only``), False if it is to be decoded."""
        ids, spec = [s.id for s in batch], self.spec
        stored = self.resume.stored(self.task.name, ids)
        whole = [b for b in spec.budgets if all((run.label, b) in stored for run in spec.runs)]
        if not finished_only and len(whole) < len(spec.budgets):
            return False
        for b in whole:
            for run in spec.runs:
                self.keep((run, b), ids, *_stored(stored[run.label, b]))
            self.done_at(b, batch)
        if len(whole) == len(spec.budgets):
            self.bar.update(self.runs_per_prompt * len(batch))
        return True

    def run_batch(self, batch: list[Sample]) -> None:
        """Every (policy, budget) of ``batch`` that an earlier run did not finish, decoded against the batch's
        full-cache references (read back, or decoded once), stored as each finishes."""
        task, spec, ids = self.task, self.spec, [s.id for s in batch]
        ref_identity = checkpoint.reference_identity(self.model_name, task, ids)
        refs = self.resume.references(ref_identity, lambda: self._doing(
            f"full-cache reference of {len(batch)} prompts", task.reference_batch, self.model, self.tokenizer, batch))
        self.bar.update(len(batch))
        finals = [task.final_length(s, r) for s, r in zip(batch, refs)]
        done = {}  # (label, budget tokens per row) -> (metrics, costs, params): full once, equal budgets once
        # what decodes together: each (policy, budget) alone, or every budget of a policy (--batch-budgets)
        units = ([[(run, b) for b in spec.budgets] for run in spec.runs] if spec.batch_budgets
                 else [[run_b] for run_b in self.keys])
        for unit in units:
            self.run_unit(unit[0][0], [b for _, b in unit], batch, refs, finals, done)
        self.resume.batch_finished(ref_identity)
        for b in spec.budgets:
            self.done_at(b, batch)

    def run_unit(self, run: PolicyRun, budgets: list, batch: list[Sample], refs: list, finals: list[int],
                 done: dict) -> None:
        """One policy at ``budgets``, decoded together: what neither an earlier run nor this one (``done``) has."""
        ids = [s.id for s in batch]
        stored = self.resume.stored(self.task.name, ids)
        plan = []  # (budget, its tokens per row, the decode's key, what a killed run stored)
        for b in budgets:
            tokens = _budgets_for(run, b, finals)
            plan.append((b, tokens, (run.label, tuple(tokens)), stored.get((run.label, b))))
        have = {key: _stored(entry) for _, _, key, entry in plan if entry is not None}
        todo = {}  # key -> (budget, tokens per row): what neither a killed run nor this one decoded
        for b, tokens, key, entry in plan:
            if entry is None and key not in done and key not in have:
                todo.setdefault(key, (b, tokens))
        if todo:
            doing = f"{run.label} at {', '.join(str(b) for b, _ in todo.values())}"
            decoded = dict(zip(todo, self._doing(doing, _decode, self.model, self.tokenizer, self.task, self.spec,
                                                 run, batch, refs, list(todo.values()))))
        else:
            decoded = {}
        for b, _, key, entry in plan:
            result = _stored(entry) if entry is not None else done.get(key) or have.get(key) or decoded[key]
            if key not in done:
                done[key] = result
                self.bar.update(len(batch))
            if entry is None:
                self.resume.store(self.task.name, ids, run.label, b, result)
            self.keep((run, b), ids, *result)

    def _doing(self, what: str, work, *args):
        """``work(*args)``, its name on the bar's postfix meanwhile (a prefill of many long prompts runs for minutes
        before the first decode step moves the token count)."""
        self.counter(0, doing=what)
        return work(*args)

    def records(self, resume_dir) -> list[dict]:
        """One record per (policy, budget) with prompts finished at that budget."""
        task, spec = self.task, self.spec
        if not any(self.done_prompts.values()):
            raise ValueError(f"{task.name}: no batch of {spec.batch_size} prompts is finished yet in {resume_dir} "
                             f"at any budget (finished runs: {self.resume.n_finished()})")
        for b in spec.budgets:
            if not self.done_prompts[b]:
                print(f"note: {task.name}: no batch of prompts is finished at budget {b} yet: no records for it",
                      file=sys.stderr)
        return [_record(task, run, b, list(self.done_prompts[b].values()), self.per_prompt[run, b],
                        self.costs[run, b], self.first_params.get((run, b)), spec, self.model, self.model_name)
                for run, b in self.keys if self.done_prompts[b]]


def _stored(entry: dict) -> tuple[list, list, dict | None]:
    """A run read back from partial.jsonl: its per-prompt metrics and costs and its resolved parameters."""
    return entry["metrics"], entry["costs"], entry["params"]


def _record(task, run, b, prompts, per_prompt, costs, params, spec, model, model_name) -> dict:
    rows = [per_prompt[s.id] for s in prompts]
    names = list(task.metric_names()) + [k for k in dict.fromkeys(k for r in rows for k in r)
                                          if k not in task.metric_names()]
    metrics, series = {}, {}
    for name in names:
        values = [r.get(name) for r in rows]
        series[name] = values
        metrics[name] = _mean(values)
        metrics[f"{name}_ci95"] = bootstrap_ci(values, seed=spec.seed)
    if "generated_tokens" in series:
        gen = sorted(v for v in series["generated_tokens"] if v is not None)
        metrics["generated_tokens_median"] = float(gen[len(gen) // 2] if len(gen) % 2 else
                                                   (gen[len(gen) // 2 - 1] + gen[len(gen) // 2]) / 2) if gen else None
    metrics["n_prompts"] = len(prompts)
    metrics.update(pool_cost([costs[s.id] for s in prompts]))
    config = {
        "model": model_name or getattr(model.config, "name_or_path", None) or type(model).__name__,
        "policy_name": run.name,
        "policy_params": params,
        # as given, before a budget resolves them: two batches of one run at a fractional budget resolve different
        # windows, yet are one policy (`learnkv compare` pools them by these)
        "policy_given": run.params,
        # the path names a folder that retraining overwrites; the digest names the weights this row decoded with
        "scorer": scorer_identity(params["scorer"]) if isinstance(params.get("scorer"), str) else None,
        "prefill_policy": spec.prefill.label if spec.prefill and evicts(run.name) else None,
        "task_options": task.options(),
        "n_prompts": len(prompts),
        "prompt_ids": [s.id for s in prompts],
        "seed": spec.seed,
        "batch_size": spec.batch_size,
        "slack": spec.slack if evicts(run.name) else None,
        "batch_budgets": spec.batch_budgets,
        "device": str(next(model.parameters()).device),
        "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d"),
    }
    return {"policy": run.label, "budget": b, "task": task.name, "metrics": metrics, "per_prompt": series,
            "config": config}


def paired(records: list[dict], baseline: str, seed: int = 0) -> list[dict]:
    """For every record of another policy, its paired difference to ``baseline`` (same task and budget) in every
    per-prompt metric: ``{"task", "budget", "policy", "baseline", "metric", "mean_diff", "ci95", "n",
    "excludes_zero"}`` (difference = policy - baseline, over the prompts both have)."""
    base = {(r["task"], r["budget"]): r for r in records if r["policy"] == baseline}
    out = []
    for r in records:
        ref = base.get((r["task"], r["budget"]))
        if ref is None or r["policy"] == baseline:
            continue
        for metric, values in r["per_prompt"].items():
            if metric not in ref["per_prompt"] or metric == "generated_tokens":
                continue
            d = paired_difference(values, ref["per_prompt"][metric], seed=seed)
            if d is not None:
                out.append({"task": r["task"], "budget": r["budget"], "policy": r["policy"], "baseline": baseline,
                            "metric": metric, **d})
    return out


__all__ = ["EvalSpec", "PolicyRun", "build_spec", "evaluate", "paired", "aggregate", "parse_budget", "TASKS",
           "DEFAULT_POLICIES", "DEFAULT_BUDGETS", "COST_METRICS"]
