"""Eviction settings: what decides which tokens a decode keeps, as one object with one check.

A decode's eviction is set by a policy and its parameters, a budget, how decisions are shared (granularity, block
size), how often the cache compacts (slack), what compresses a prompt over the budget (the prefill policy) and the
learned policy's scorer artifact and the allocation (issue 42: how a row's budget is shared by layers and KV
heads, `learnkv.allocation`). `Eviction` holds them; `Eviction.check` is the one feasibility check every entry point
calls before any model loads (the command line, ``evaluate.py``'s grid, ``train.py``'s config, trace collection), and
`Eviction.resolve` the one place a policy is resolved for each row's budget, which `learnkv.generate` and the
evaluation runner call again with the prompts' lengths before they decode.

    Eviction("h2o", {"n_recent": 8}, budget=64).check()             # before a model loads
    Eviction("lazy", budget=16).resolve([16], prompt_lengths=[40])  # ValueError: 'lazy' observes nothing at the prefill
    generate(model, tokenizer, prompts, eviction)
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field

from learnkv.allocation import Allocation, as_allocation
from learnkv.cache import allocation_error, blind_prefill_error, prefill_policy_error
from learnkv.policies import Policy, make_policy
from learnkv.policies.base import resolve_rows, shared_fields

#: how eviction decisions are shared: per layer and KV head, or whole blocks shared by every layer and head
GRANULARITIES = ("token", "block")
#: keys of a policy's parameters (a grid item's ``h2o:allocation=head:allocation_floor=0.1``) that set the
#: allocation, not the policy, and the `Allocation` field each sets
ALLOCATION_KEYS = {"allocation": "mode", "allocation_floor": "floor", "allocation_beta": "beta"}


def split_allocation(params: dict) -> tuple[dict, dict]:
    """A grid item's parameters as (the policy's own, the `ALLOCATION_KEYS` among them), each in its given order."""
    return ({k: v for k, v in params.items() if k not in ALLOCATION_KEYS},
            {k: v for k, v in params.items() if k in ALLOCATION_KEYS})


def check_granularity(granularity: str, block_size: int) -> None:
    """The one check of how decisions are shared, which `Eviction` runs when it is made (and `learnkv.eval`'s tasks
    for their own fields): ValueError unless ``granularity`` is one of `GRANULARITIES` and ``block_size`` an
    integer >= 1."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be 'token' or 'block', got {granularity!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral) or block_size < 1:
        raise ValueError(f"block size must be an integer >= 1, got {block_size!r}")


def parse_number(text: str) -> int | float:
    """``"64"``, ``"-5"`` -> int (a token count, in range or not), ``"0.25"`` -> float; ValueError otherwise."""
    try:
        return int(text)
    except ValueError:
        return float(text)


def resolve_budget(budget: int | float | str | None, full_length: int) -> int | None:
    """A budget in tokens from a token count (int >= 1) or a fraction of the full length (float in (0, 1])."""
    if budget is None:
        return None
    if isinstance(budget, str):
        try:
            budget = parse_number(budget)
        except ValueError:
            raise ValueError(f"budget must be a token count or a fraction in (0, 1], got {budget!r}") from None
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise ValueError(f"budget must be a token count or a fraction in (0, 1], got {budget!r}")
    if isinstance(budget, float):
        if not 0.0 < budget <= 1.0 or math.isnan(budget):
            raise ValueError(
                f"budget fraction must be in (0, 1], got {budget} (give a token count as an integer, e.g. 64)"
            )
        return max(1, math.ceil(budget * full_length))
    if budget <= 0:
        raise ValueError(f"budget must be >= 1 token, got {budget}")
    return int(budget)


def resolve_policy(policy: str | Policy, budget_tokens: int | None, granularity: str = "token",
                   block_size: int = 16, params: dict | None = None) -> Policy:
    """The policy as `generate` runs it: built with ``params``, set to whole blocks of ``block_size`` in ``"block"``
    granularity, and resolved for a budget in tokens. Raises ValueError when its windows do not fit the budget, so
    callers that run many decodes (`learnkv.eval`) can check every combination before the first one."""
    return resolve_policy_rows(policy, [budget_tokens], granularity, block_size, params)[0]


def resolve_policy_rows(policy: str | Policy, budgets: Sequence[int | None], granularity: str = "token",
                        block_size: int = 16, params: dict | None = None) -> list[Policy]:
    """`resolve_policy` for each row's budget of a batch: one policy per row, which may differ only in what the
    cache applies per row (`learnkv.policies.base.resolve_rows`); raises ValueError otherwise."""
    policy_obj = make_policy(policy, **(params or {}))
    if not policy_obj.evicts:
        return [policy_obj] * len(budgets)
    if granularity == "block" and "block_size" in (params or {}):
        raise ValueError(f"policy {policy_obj.name!r}: block_size has no effect in block granularity, where the block "
                         "size is the granularity's own (--block-size): drop the parameter")
    if any(b is None for b in budgets):
        raise ValueError(f"policy {policy_obj.name!r} needs a budget (tokens, or a fraction of the full length)")
    if granularity == "block":
        policy_obj = dataclasses.replace(policy_obj, block_size=block_size)
    return resolve_rows(policy_obj, budgets)


def _name(policy: str | Policy | None) -> str | None:
    return policy if policy is None or isinstance(policy, str) else policy.name


@dataclass(frozen=True)
class Eviction:
    """The settings of one decode's eviction (the arguments of `learnkv.generate` that decide what is kept).

    Attributes
    ----------
    policy : str or Policy
        A registered policy name (`learnkv.policies.POLICIES`) or a policy object; ``params`` its parameters.
    budget : int, float, str, sequence of them, or None
        Tokens per layer and KV head, or a fraction of each row's full length; one, or one per row.
    granularity, block_size
        ``"token"`` (each layer and KV head decides for itself) or ``"block"``: whole blocks of ``block_size``
        slots, one decision shared by every layer and KV head.
    slack : int
        Dead slots a layer may hold before it compacts (the same kept tokens; `learnkv.cache.BudgetCache`).
    prefill, prefill_params
        The policy (and its parameters) that compresses a prompt over the budget at the prefill.
    scorer : str or None
        The learned policy's artifact, given to ``policy`` and ``prefill`` where they are ``learned`` without one
        (a ``--scorer`` beside a list of policies); a scorer given is checked even where no policy uses it.
    allocation : str or Allocation
        How a row's budget is shared by layers and KV heads: ``uniform`` (the default), ``head``, ``pyramid`` or
        ``global`` (`learnkv.allocation`), or an `Allocation` with its floor and beta. The `ALLOCATION_KEYS` in
        ``params`` (an evaluation item such as ``h2o:allocation=head:allocation_floor=0.1``) move here.
    """

    policy: str | Policy = "full"
    params: dict = field(default_factory=dict, hash=False)
    budget: int | float | str | Sequence | None = field(default=None, hash=False)
    granularity: str = "token"
    block_size: int = 16
    slack: int = 0
    prefill: str | Policy | None = None
    prefill_params: dict = field(default_factory=dict, hash=False)
    scorer: str | None = None
    allocation: str | Allocation = "uniform"

    def __post_init__(self):
        params, moved = split_allocation(self.params)
        if moved:  # a grid item's ``NAME:allocation=MODE``: settings of the eviction, not of the policy
            object.__setattr__(self, "params", params)
            moved = {ALLOCATION_KEYS[k]: v for k, v in moved.items()}
            mode = moved.pop("mode", self.allocation)
            allocation = dataclasses.replace(as_allocation(mode), **moved) if moved else mode
            object.__setattr__(self, "allocation", allocation)
        as_allocation(self.allocation)  # a bad mode fails here, in one line
        check_granularity(self.granularity, self.block_size)

    @property
    def resolved_allocation(self) -> Allocation:
        """The allocation as an `Allocation`."""
        return as_allocation(self.allocation)

    @property
    def policy_params(self) -> dict:
        """``params``, with the scorer where the policy is ``learned`` and names none."""
        return self._with_scorer(self.policy, self.params)

    @property
    def prefill_policy_params(self) -> dict:
        return self._with_scorer(self.prefill, self.prefill_params)

    def _with_scorer(self, policy, params: dict) -> dict:
        params = dict(params)
        if _name(policy) == "learned" and "scorer" not in params and self.scorer:
            params["scorer"] = str(self.scorer)
        return params

    def make(self) -> Policy:
        """The decode policy, built (not yet resolved for a budget); unknown names and parameters raise."""
        return make_policy(self.policy, **self.policy_params)

    def make_prefill(self) -> Policy | None:
        return None if self.prefill is None else make_policy(self.prefill, **self.prefill_policy_params)

    def check(self, budget_tokens: int | None = None, prompt_tokens: int | None = None,
              prefill_option: str | None = None) -> None:
        """Raise ValueError if these settings cannot decode: the policy and the prefill policy build, the prefill
        policy can decide at the prefill (its error starts with ``prefill_option``, the option that named it,
        where given), a learned policy's scorer (and any scorer given) is readable, and, at a budget in tokens
        (``budget_tokens``, else ``budget`` where it is a token count), what `resolve` checks. No model is needed."""
        if budget_tokens is None and isinstance(self.budget, int) and not isinstance(self.budget, bool):
            budget_tokens = self.budget
        policy = self.make()
        prefill = self.make_prefill()
        if policy.evicts and (error := allocation_error(self.resolved_allocation, policy, self.granularity == "block")):
            raise ValueError(error)
        if prefill is not None and (error := prefill_policy_error(prefill)):
            raise ValueError(f"{prefill_option}: {error}" if prefill_option else error)
        for p in (policy, prefill):
            if p is not None and p.name == "learned":
                p.resolve_defaults(1)  # the scorer artifact exists and is readable
        if self.scorer:  # checked even when unused: a typo should not pass silently
            make_policy("learned", scorer=str(self.scorer)).resolve_defaults(1)
        if budget_tokens is not None:
            self.resolve([budget_tokens], None if prompt_tokens is None else [prompt_tokens])

    def resolve(self, budgets: Sequence[int | None],
                prompt_lengths: Sequence[int] | None = None) -> tuple[list[Policy], list[Policy] | None]:
        """The decode policy and the prefill policy (None without one, or where nothing is evicted) resolved for
        each row's budget in tokens: what `learnkv.generate` decodes with. Raises ValueError where the windows do
        not fit a budget, and, given the rows' prompt lengths, where a policy that observes nothing at the prefill
        would have to compress a prompt without a prefill policy."""
        rows = resolve_policy_rows(self.policy, budgets, self.granularity, self.block_size, self.policy_params)
        prefill_rows = None
        if self.prefill is not None and rows[0].evicts:
            prefill_rows = resolve_policy_rows(self.prefill, budgets, self.granularity, self.block_size,
                                               self.prefill_policy_params)
        elif rows[0].evicts and prompt_lengths is not None:
            for n, b, row in zip(prompt_lengths, budgets, rows):
                if error := blind_prefill_error(row, n, b):
                    raise ValueError(error)
        return rows, prefill_rows


def batch_groups(settings: Eviction, budgets: Sequence[int | None]) -> list[list[int]]:
    """Rows (by index into ``budgets``, each row's budget in tokens) that can share one batched decode: rows whose
    decode policy, and prefill policy if any, resolve to the same fields but the per-row ones for their budgets
    (`learnkv.policies.base.shared_fields`). All of them where nothing is evicted, or unless a budget-dependent
    default that is not per row differs between rows (every registered policy's windows are per row, SnapKV's
    through `SnapKV.for_batch`, so in practice one group); groups in the order of their first row."""
    if not settings.make().evicts:
        return [list(range(len(budgets)))]
    policies = [(settings.policy, settings.policy_params)]
    if settings.prefill is not None:
        policies.append((settings.prefill, settings.prefill_policy_params))
    keys: dict = {}
    for i, b in enumerate(budgets):
        key = [shared_fields(resolve_policy(p, b, settings.granularity, settings.block_size, params))
               for p, params in policies]
        keys.setdefault(repr(key), []).append(i)
    return list(keys.values())


__all__ = ["ALLOCATION_KEYS", "Eviction", "GRANULARITIES", "batch_groups", "parse_number", "resolve_budget",
           "resolve_policy", "resolve_policy_rows", "split_allocation"]
