"""The policy contract: what a policy sees (`LayerView`), what it declares, what it returns (scores).

A policy is pure tensor math over one layer of the cache. It never touches Hugging Face modules, never
selects or compacts (the cache does that, once, for every policy), and keeps its per-token state in
`view.state`, a dict of tensors whose *last* dimension is the token (slot) axis. The cache appends zeros
for new slots and gathers every state tensor with the kept indices, so state always stays aligned with
the keys and values.

Shapes use B (batch), H (KV heads), T (cached slots), D (head dim), W (observed query rows).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from learnkv.fields import check_fields, setting


@dataclass
class LayerView:
    """One layer of the cache as a policy sees it, right after the step's attention.

    Attributes
    ----------
    layer : int
        Decoder layer index.
    step : int
        0 for the prefill, then 1, 2, ... for each decode step. The cache calls a policy's ``update`` at every step
        (evicting or not), so state kept by step (SnapKV's window and the learned tracker's, `learnkv.sliding_rows`)
        may count on seeing each step once, in order.
    keys, values : Tensor
        ``[B, H, T, D]`` as cached (keys after RoPE).
    positions : Tensor
        ``[B, H, T]`` int64 original token positions; -1 marks a padding slot.
    n_new : int
        The last ``n_new`` slots were appended in this step.
    attn : Tensor or None
        ``[B, H, W, T]`` fp32 attention of the step's last ``W <= policy.obs_window`` query rows, reduced over
        the query heads of each KV head (``policy.group_reduce``). None if the policy does not need attention.
    attn_sum : Tensor or None
        ``[B, H, T]`` the same attention summed over all of the step's (non-padding) query rows.
    attn_sq_sum : Tensor or None
        ``[B, H, T]`` sum of squared attention over the step's query rows (only if ``policy.needs_sq_sum``).
    keep : int or list[int]
        How many slots each row keeps if it evicts now (one int for every row, or one per row). A row the cache
        does not evict in this step has its live token count here, so it keeps all of them.
    state : dict[str, Tensor]
        The policy's own per-token tensors, token axis last.
    live : list[int] or None
        Live tokens per row (not padding, not an evicted slot awaiting compaction: both have position -1), the
        same in every KV head of a row. None: count them from ``positions`` (`live_tokens`).
    scored : bool
        Whether the cache reads this view's scores after `Policy.update` (an eviction or a refresh in this step).
        Where False, ``update`` may skip what only ``score`` reads (the learned policy's feature read-out on the
        kernel path); ``score`` must still work if called (True unless the cache knows better).
    victims_only : bool
        Whether the cache reads nothing of this view's scores but each row and KV head's lowest score over its live
        unprotected slots (the first slot among ties), the one slot it drops: every row drops at most one, and the
        scores are neither kept nor compared across heads or layers. A policy may then return any scores with that
        same lowest slot, +inf elsewhere say (RoCo, which then skips the selection of its scope). False unless the
        cache knows (`BudgetCache`); a caller that reads the scores themselves leaves it so.

    layers : tuple[int, ...] or None
        The layers of a view that holds the rows of several (see below), in the order of their rows; None for one
        layer's view.

    The cache may hand a `Policy.rowwise` policy the rows of several layers in one view, layer-major along the batch
    axis (`BudgetCache`, "Batching"): ``layer`` is then the first, ``layers`` names them all, and keys and values are
    None; a policy that reads them or the layer (``reads_layer``) also gets one view per layer (`update_layers`,
    `score_layers`).
    """

    layer: int
    step: int
    keys: Tensor
    values: Tensor
    positions: Tensor
    n_new: int
    attn: Tensor | None = None
    attn_sum: Tensor | None = None
    attn_sq_sum: Tensor | None = None
    keep: int | list[int] = 0
    state: dict[str, Tensor] = field(default_factory=dict)
    live: list[int] | None = None
    scored: bool = True
    victims_only: bool = False
    layers: tuple[int, ...] | None = None

    @property
    def valid(self) -> Tensor:
        """``[B, H, T]`` bool, False on padding and dead slots."""
        return self.positions >= 0

    def keep_rows(self) -> list[int]:
        """``keep`` as one int per row."""
        B = self.positions.shape[0]
        return [self.keep] * B if isinstance(self.keep, int) else list(self.keep)

    def live_tokens(self) -> list[int]:
        """Live tokens per row (`live`, or counted from the positions: the most any KV head of the row holds)."""
        if self.live is not None:
            return list(self.live)
        return self.valid.sum(-1).amax(-1).tolist()

    def due_rows(self) -> list[int]:
        """The rows that evict in this step: they keep fewer than their live tokens (the cache hands a row that does
        not evict its live count as ``keep``)."""
        return [b for b, (k, n) in enumerate(zip(self.keep_rows(), self.live_tokens())) if k < n]

    def select_rows(self, rows: list[int]) -> LayerView:
        """The view of some rows of this one (of one layer), in the given order."""
        index = torch.tensor(rows, device=self.positions.device)

        def pick(x):
            return None if x is None else x.index_select(0, index)

        return self._rows(pick, lambda xs: [xs[r] for r in rows], layer=self.layer, keys=pick(self.keys),
                          values=pick(self.values))

    def of_layers(self, start: int, stop: int) -> LayerView:
        """The rows of the layers ``layers[start:stop]`` of a view of several layers (layer-major, the same number
        of rows each): views of this view's tensors, so what a policy writes into their state writes through."""
        B = self.positions.shape[0] // len(self.layers)
        rows = slice(start * B, stop * B)
        return self._rows(lambda x: x[rows], lambda xs: xs[rows], layer=self.layers[start], keys=None, values=None,
                          layers=self.layers[start:stop])

    def _rows(self, tensor_rows: Callable[[Tensor], Tensor], list_rows: Callable[[list], list], **fields) -> LayerView:
        """A view of some of this view's rows: ``tensor_rows`` / ``list_rows`` pick them from each batch-first tensor
        and per-row list; ``fields`` gives the rest (layer, keys, values)."""
        def pick(x):
            return None if x is None else tensor_rows(x)

        return LayerView(step=self.step, positions=pick(self.positions), n_new=self.n_new, attn=pick(self.attn),
                         attn_sum=pick(self.attn_sum), attn_sq_sum=pick(self.attn_sq_sum),
                         keep=self.keep if isinstance(self.keep, int) else list_rows(self.keep),
                         state={name: pick(t) for name, t in self.state.items()},
                         live=None if self.live is None else list_rows(self.live), scored=self.scored,
                         victims_only=self.victims_only, **fields)


def exact_map(fn: Callable[..., Tensor], *keys: Tensor) -> Tensor:
    """``fn(*keys)`` evaluated once per distinct tuple of key values and gathered back, so equal keys give
    bitwise-equal results at any slot index.

    Why: CPU elementwise kernels compute a tensor's vectorised body and its scalar tail with different code
    (SLEEF's ``exp`` against libm's), so the same transcendental function of the same value can differ in its last
    bit depending on where the value sits. A score that is a function of discrete per-token state (LazyEviction's
    steps since activation and recurrence interval) must tie exactly when the state ties, or the documented rule
    "ties go to the more recent token" silently fails at the keep boundary.

    Parameters
    ----------
    fn : callable
        Elementwise function of the keys' values (called on 1-D tensors of the distinct values).
    keys : Tensor
        Tensors of one shape; their elementwise tuples are the function's arguments.
    """
    shape = keys[0].shape
    # the distinct tuples in lexicographic order, as `torch.unique(stack(keys), dim=1)` orders them (so ``fn`` sees the
    # same tensor and gives the same bits), from 1-D uniques only: each key's rank among its distinct values, folded
    # into one code per tuple and re-ranked after each fold, so codes stay below N. On CPU, unique over a dimension
    # cost ~14 ms per call at 6k slots (B 16), more than a decode step's attention
    distinct, ranks = zip(*(torch.unique(k.reshape(-1), return_inverse=True) for k in keys))
    code, n = ranks[0], distinct[0].numel()
    for d, r in zip(distinct[1:], ranks[1:]):
        folded, code = torch.unique(code * d.numel() + r, return_inverse=True)
        n = folded.numel()
    one = torch.empty(n, dtype=torch.long, device=code.device)  # one slot holding each tuple (any: they are equal)
    one.scatter_(0, code, torch.arange(code.numel(), device=code.device))
    return fn(*(d[r[one]] for d, r in zip(distinct, ranks)))[code].view(shape)


def window_tokens(value: int | float, budget: int) -> int:
    """A window given as a token count (int) or as a fraction of the budget (float in (0, 1])."""
    if isinstance(value, float):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"a window given as a fraction of the budget must be in [0, 1], got {value}")
        return int(value * budget)
    if value < 0:
        raise ValueError(f"a window must be >= 0 tokens, got {value}")
    return int(value)


@dataclass
class Policy:
    """Base class of every eviction policy: the capabilities the cache reads, and the score contract.

    Parameters
    ----------
    n_sink : int or float
        Tokens at positions ``< n_sink`` are never evicted (attention sinks). A float is a fraction of the budget.
    n_recent : int or float
        The ``n_recent`` most recent tokens are never evicted. A float is a fraction of the budget.
    interval : int
        Lagged eviction: the cache evicts only at a step where it would otherwise end over the budget, and then
        down to ``budget - interval + 1`` slots (`keep_target`), so in steady state a lagged policy evicts every
        ``interval`` steps, observing that many steps between decisions, and never exceeds the budget. 1 (the
        default): evict down to the budget whenever it overflows, i.e. every step once full.
    block_size : int
        Evict whole blocks of this many consecutive slots (block score = mean of the token scores).

    Every field is a hyperparameter declared with its range (`learnkv.fields.setting`) and checked when the policy
    is built: a value of the wrong type, out of range or not finite is a ValueError naming it.
    """

    name: ClassVar[str] = ""
    #: whether the attention function must hand this policy attention statistics
    needs_attention: ClassVar[bool] = True
    #: how the attention of the query heads that share a KV head is reduced: "mean", "max", "none" (the view then
    #: keeps the group axis: attn [B, H, G, W, T], attn_sum [B, H, G, T], no attn_sq_sum) or "mean+max" (both on
    #: that axis, mean then max: attn [B, H, 2, W, T], attn_sum [B, H, 2, T]; the feature tracker's input)
    group_reduce: ClassVar[str] = "mean"
    #: whether the policy needs the sum of squared attention (RoCo's std)
    needs_sq_sum: ClassVar[bool] = False
    #: False only for the full cache and observers
    evicts: ClassVar[bool] = True
    #: how the layer-shared block mode pools this policy's scores over layers and heads (`learnkv.pooling`):
    #: "mean_mass" for scores that are attention mass, "mean_rank" for scores on no shared scale
    pooling: ClassVar[str] = "mean_rank"
    #: how `learnkv.allocation` compares its scores across heads and layers when the policy knows better than its
    #: pooling rule (the learned policy, from its artifact); None: the pooling rule's (`normalisation_for`)
    normalisation: ClassVar[str | None] = None
    #: whether scores depend on which slots are neighbours (SnapKV's average pool), so evicted slots must be compacted
    #: away at once instead of left dead in place (`BudgetCache.slack`)
    needs_dense_slots: ClassVar[bool] = False
    #: True for the oracle: `generate` first decodes with the full cache, then replays those tokens under the
    #: budget with ``policy.with_future(future)`` (that run's attention per row)
    needs_future: ClassVar[bool] = False
    #: what a look-ahead policy (``needs_future``) reads of that run, per row and layer ``[H, steps, keys]``:
    #: ``"attention"`` (`learnkv.capture.step_attention`, what the fidelity task's reference holds) or ``"fisher"``
    #: (`learnkv.fisher.step_fisher`: each key's second-order cost to each step's next-token distribution)
    future_kind: ClassVar[str] = "attention"
    #: whether the policy has anything to decide on at the prefill. False for LazyEviction, which observes nothing
    #: there (every prompt token scores the same): a prompt longer than the budget then needs a ``prefill_policy``
    #: to compress it (`learnkv.generate`), rather than a decision on all-tied scores
    scores_prefill: ClassVar[bool] = True
    #: the fields that may differ between the rows of one batch once resolved for each row's budget: the cache
    #: applies them per row (protected windows, the lagged headroom); every other field must be equal
    per_row_fields: ClassVar[tuple[str, ...]] = ("n_sink", "n_recent", "interval")
    #: whether `update` and `score` compute each row of a view from that row alone: a row's state and scores are the
    #: same whichever rows share its view (nothing is read by row index or from another row). The cache uses it to
    #: batch rows (`BudgetCache`, "Batching")
    rowwise: ClassVar[bool] = False
    #: whether `update` or `score` reads one layer's own keys, values or index (``view.keys``, ``view.values``,
    #: ``view.layer``): a view of several layers' rows then comes with one view per layer (`update_layers`,
    #: `score_layers`)
    reads_layer: ClassVar[bool] = False

    n_sink: int | float = setting(0, ge=0, fraction=True)
    n_recent: int | float = setting(0, ge=0, fraction=True)
    interval: int = setting(1, ge=1)
    block_size: int = setting(1, ge=1)

    def __post_init__(self):
        try:
            check_fields(self, declared_only=True)
        except ValueError as e:
            raise ValueError(f"policy {self.name or type(self).__name__!r}: parameter {e}") from None

    def check_model(self, model) -> None:
        """Refuse a model the policy is not for (a learned scorer trained for another); nothing by default."""

    # -- what the cache reads ------------------------------------------------------------------------------

    @property
    def obs_window(self) -> int:
        """How many of the step's last query rows the policy wants in ``view.attn``."""
        return 1

    @property
    def refresh(self) -> int:
        """How often the scores are computed: at every eviction (1), or every ``refresh`` steps, every row and layer
        alike, and evictions in between use the latest scores (a token cached since has none, and is kept). The
        cache runs the schedule (`BudgetCache`, "Refresh")."""
        return 1

    def block_size_at(self, step: int) -> int:
        """Eviction granularity at this step (PagedEviction drops single tokens at prefill, blocks after)."""
        return self.block_size

    def keep_target(self, budget: int, steps_left: int | None = None) -> int:
        """Slots kept after an eviction, so the cache holds at most ``budget`` at the end of every step.

        A lagged policy (interval > 1) appends ``interval - 1`` tokens before it evicts again, so it keeps that
        much headroom, or only as much as the decode has steps left (``steps_left``; None = unknown).
        """
        headroom = self.interval - 1 if steps_left is None else min(self.interval - 1, max(steps_left, 0))
        return budget - headroom

    # -- what a policy implements --------------------------------------------------------------------------

    def for_batch(self, rows: Sequence[Policy]) -> Policy:
        """The one policy that updates and scores a batch whose rows resolved to ``rows`` (this policy is
        ``rows[0]``; rows differ only in ``per_row_fields``). By default itself: the cache applies the per-row
        fields. A policy whose scores depend on a per-row field (SnapKV's window) returns a copy that knows them."""
        return self

    def update(self, view: LayerView) -> None:
        """Fold this step's attention into ``view.state`` (in place). Called every step, every layer."""

    def update_layers(self, view: LayerView, views: Sequence[LayerView]) -> None:
        """The update of a view of several layers (``view``, layer-major), with ``views``, one view per layer (for a
        policy that reads one layer's keys, values or index: ``reads_layer``), whose state entries are views of
        ``view``'s: by default `update` of ``view``'s rows at once, which reads no layer's own tensors. A policy
        whose update does (PagedEviction's ratios of the appended slots) reads them from ``views``."""
        self.update(view)

    def score(self, view: LayerView) -> Tensor:
        """``[B, H, T]`` importance, higher means keep. Called only when the cache evicts. The caller owns the
        result (trace recording keeps teacher scores for a while): never return a state tensor that `update`
        changes in place."""
        raise NotImplementedError

    def score_layers(self, view: LayerView, views: Sequence[LayerView]) -> Tensor:
        """The scores of a view of several layers (``view``, layer-major) from ``views``, one view per layer
        (the cache's, for a policy that reads one layer's keys, values or index: ``reads_layer``): each layer's
        `score`, concatenated layer-major. A policy may compute what reads no layer's own tensors over ``view``'s
        rows at once instead (the learned policy's feature read-out), with the same scores."""
        return torch.cat([self.score(v) for v in views])

    # -- configuration -------------------------------------------------------------------------------------

    def resolve_defaults(self, budget: int) -> dict:
        """Concrete values for fields left at None (paper defaults that depend on the budget). Override."""
        return {}

    def resolve(self, budget: int) -> Policy:
        """A copy with every window in tokens for this budget; raises ValueError if it cannot fit."""
        if not self.evicts:
            return self
        if budget < 1:
            raise ValueError(f"budget must be >= 1 token, got {budget}")
        p = dataclasses.replace(self, **self.resolve_defaults(budget))
        p.n_sink = window_tokens(p.n_sink, budget)
        p.n_recent = window_tokens(p.n_recent, budget)
        target = p.keep_target(budget)
        if p.block_size > 1:
            # when the cache overflows (target + 1 slots), one whole block must lie after the sink blocks and
            # before the recent window (which always includes the newest, possibly partial, block)
            bs = p.block_size
            needed = (-(-p.n_sink // bs) + 1) * bs + max(p.n_recent, 1) - 1
        else:
            needed = p.n_sink + p.n_recent
        if target < 1 or needed > target:
            raise ValueError(
                f"policy {p.name!r}: sink tokens ({p.n_sink}) + recent window ({p.n_recent})"
                + (f" + one evictable block of {p.block_size}" if p.block_size > 1 else "")
                + (f" with interval {p.interval}" if p.interval > 1 else "")
                + f" do not fit in a budget of {budget} tokens (at most {max(target, 0)} can be kept);"
                " lower the windows or raise the budget"
            )
        return p

    def params(self) -> dict:
        """The policy's hyperparameters, for logs and results (not its decode-time state: the fields it does not take
        as arguments)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if self.__dataclass_fields__[k].init}


def shared_fields(policy: Policy) -> tuple[tuple[str, Any], ...]:
    """The resolved fields every row of a batch must share (all but ``per_row_fields``): rows whose policies have
    equal shared fields can decode in one batch."""
    return tuple((f.name, getattr(policy, f.name)) for f in dataclasses.fields(policy)
                 if f.compare and f.name not in policy.per_row_fields)


def resolve_rows(policy: Policy, budgets: Sequence[int]) -> list[Policy]:
    """The policy resolved for each row's budget, checked to be one policy for the whole batch.

    Rows of a batch may have their own budgets; what the cache applies per row (the protected sinks and recent
    window, and the lagged schedule's headroom) and what `Policy.for_batch` takes per row (SnapKV's window) may
    then differ, but the scores must come from one policy. Any other parameter whose default depends on the budget
    can break that: the error says which, so the rows can be decoded in separate calls.
    """
    rows = [policy.resolve(b) for b in budgets]
    first = shared_fields(rows[0])
    for b, p in zip(budgets, rows):
        diff = {k: (v, w) for (k, v), (_, w) in zip(first, shared_fields(p)) if v != w}
        if diff:
            raise ValueError(
                f"policy {policy.name!r} resolves differently for budgets {budgets[0]} and {b} ({diff}): rows of one "
                "batch must share its parameters; give them explicitly or decode these rows in separate calls")
    return rows


def reduce_heads(x: Tensor) -> Tensor:
    """Mean over the KV-head axis of a ``[B, H, ...]`` tensor, broadcast back to H (layer-wide decisions)."""
    return x.mean(dim=1, keepdim=True).expand_as(x)
