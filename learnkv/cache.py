"""BudgetCache: a transformers `Cache` that holds at most `budget` tokens per layer and KV head.

It owns every eviction invariant, for every policy: the cache never holds more than the budget at the end of
a step, sinks and the recent window survive, kept tokens stay in their original order, and the policy's
per-token state stays aligned with the keys and values. Policies only score; the storage (slots, packed policy
state) is `learnkv.slots.BudgetLayer`'s; the decision is here, in one eviction step (`BudgetCache._evict`):
scores -> the slots each row keeps (`kernels.select_keep`, or one pooled decision for every layer in the
layer-shared block mode) -> compact (`kernels.gather_tokens`) or mark the rest dead. Per layer, stacked layers,
the layer-shared decision and a sliding window's drop by age all go through it: which layers decide together,
and whether they share one decision, is data.

Order within a step (for every layer): append the step's keys/values -> attention over the whole cache,
statistics handed to the policy (`learnkv.attention`) -> policy state update -> evict if the cache is over the
budget. So a step's attention always sees the full pre-eviction cache, as in LazyEviction, EasyKV and kvpress.

Batching: the cache alone decides how a policy's calls are batched, from what the policy is (`Policy.rowwise`: a
row's state and scores do not depend on which rows share its view; `Policy.reads_layer`). A layer's eviction at a
step is first read by that layer's attention at the next step, so the update and eviction of every layer may wait
for the end of the forward pass. For a rowwise policy, on the torch path, a decode step does exactly that ("stacked
layers"): `end_step` hands the policy one view of every layer's rows (the layers' positions and state are views of
one stacked buffer each; `LayerView.layers` names them), scores it in one call (one per layer where it reads a
layer's keys or scorer) and selects and marks dead slots once for the whole model. In a dense cache (block
eviction, R-KV) the rows that evict are scored and select once for every layer, and are moved in place, every
layer's positions and state at once (`learnkv.slots.keep_moved_rows_of_layers`). On a CPU at batch 1 a small
tensor op costs more in dispatch than in arithmetic: per layer, the learned policy's ~60 ops per step cost ~20% of
the decode; stacked, ~6% (bench/RESULTS.md, "Stacked layers"). A rowwise lagged policy (interval > 1) is scored on
the rows that evict only, of every layer at once: its rows come due at different steps, each on its own phase, so
most of a batch's scoring is saved (bench/RESULTS.md, "Lagged policies score only the rows that evict"). The
decisions are the same, bit for bit, either way.

Refresh: a policy whose scores are computed every ``refresh`` steps (`Policy.refresh`, the learned policy's) is
scored by the cache at those steps, every row; on a stacked step through `Policy.score_layers`, which the learned
policy uses to read out the features of a few layers' rows at once (each op then runs on both threads of a 2-core
CPU) before each layer's scorer. The scores are kept as per-token state, and every eviction in between uses the
latest (the tokens cached since have none, and are kept).

Victims alone: at a step of token eviction where no row drops more than one live slot, and the scores are neither
kept (a refresh), nor pooled into one decision (the layer-shared block mode), nor compared across heads (allocation
``head`` or ``global``), all the cache reads of the scores is each row's lowest slot. It says so
(`LayerView.victims_only`), and a policy whose full scores cost more than that victim may score the victim alone
(RoCo: the selection of its scope).

When it evicts: only at a step where a row would otherwise end over its budget, and then down to the policy's
keep target (`Policy.keep_target`: the budget, or ``budget - interval + 1`` for a lagged policy, which thus evicts
every ``interval`` steps once full and observes the steps in between). A prompt within the budget is never
compressed at the prefill. A prompt over it is compressed by the prefill policy if one is given (kvpress's
PrefillDecodingPress: the prefill policy decides at the prefill, then its state is dropped and the decode policy
starts its own at the first decode step), else by the decode policy, unless that policy has nothing to score at
the prefill (`Policy.scores_prefill`), which is an error rather than a blind decision.

Sliding-window layers (Mistral, Phi-3, Gemma 2/3, GPT-OSS): the attention function tells the cache each layer's
window at every forward pass (`attended`). The budget is one bound for every layer; a sliding layer is also bounded
by its window: it never holds more than ``window - 1`` tokens after a step (what the next query can still see; as
transformers' own sliding cache), the oldest dropped by age, at no cost to the model, after the policy has seen the
step's attention and before it decides. So at a budget of at least ``window - 1`` the policy decides only in the full-attention layers; at a smaller
budget it decides in the sliding layers too, as in any layer, and a token it keeps past the window is masked (never
attended) until the policy evicts it. Every layer's live tokens are counted alike (`kept_rows`).

Rows of a batch decode exactly as each would alone: each row has its own budget and live-token count, evicts when
it overflows and keeps its own target; a row that keeps fewer slots than the widest row of its layer holds dead
slots at the left, where left padding is. Each slot carries its token's original position ([B, H, T], -1 for
padding and dead slots); the attention mask is built from these positions, never from slot indices, so eviction
and padding need no 2D mask. That is also what lets an evicted slot stay in place, dead, until a later compaction
(``slack``): on a GPU, compacting the cache at every step would move more bytes than the step's attention reads.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers.cache_utils import Cache

from learnkv import kernels
from learnkv.kernels.cpu import one_drop_rows
from learnkv.kernels.reference import mark_dead, protected_slots
from learnkv.allocation import (Allocation, allocate, as_allocation, head_budgets, keep_slots, normalisation_for,
                                normalise_scores)
from learnkv.policies.base import LayerView, Policy
from learnkv.pooling import shared_keep_slots
from learnkv.slots import BudgetLayer, Link, Workspace, keep_moved_rows_of_layers, link_layers


def blind_prefill_error(policy: Policy, prompt_tokens: int, budget: int) -> str | None:
    """The error for a policy that would have to decide at the prefill on nothing (None if it need not)."""
    if not policy.evicts or policy.scores_prefill or prompt_tokens <= budget:
        return None
    return (f"policy {policy.name!r} observes nothing at the prefill, and a prompt of {prompt_tokens} tokens is over "
            f"the budget of {budget}: give a prefill policy to compress the prompt (prefill_policy='snapkv', CLI "
            "--prefill-policy snapkv) or a budget that holds the prompt")


def prefill_policy_error(policy: Policy) -> str | None:
    """Why a policy cannot compress a prompt at the prefill (None if it can): it must evict, decide on what it
    observes there, and need no future."""
    if policy.evicts and policy.scores_prefill and not policy.needs_future:
        return None
    return (f"policy {policy.name!r} cannot be a prefill policy: it must evict and decide on what it observes at the "
            "prefill (e.g. snapkv, h2o, tova, streaming; not full, lazy or oracle)")


def allocation_error(allocation: Allocation, policy: Policy, shared_blocks: bool) -> str | None:
    """Why a decode cannot share its budget under ``allocation`` (None if it can): every mode but ``uniform``
    decides per token, so not in the layer-shared block mode (``shared_blocks``) nor with a block policy."""
    if allocation.mode == "uniform" or not (shared_blocks or policy.block_size > 1):
        return None
    return (f"allocation {allocation.mode!r} needs token eviction: not granularity 'block' nor a block policy "
            f"({policy.name!r} with block_size {policy.block_size}); use allocation 'uniform'")


def kept_per_step(kept_rows: list[list[list[int]]]) -> list[list[int]]:
    """Per step and layer, the most live tokens any row held, from `BudgetCache.kept_rows` ``[step][layer][row]``
    (what `learnkv.decode.GenerationResult` keeps of a decode)."""
    return [[max(rows) for rows in step] for step in kept_rows]


def max_kept(kept_rows: list[list[list[int]]]) -> int:
    """The most live tokens any layer held for any row after any step, from `BudgetCache.kept_rows`."""
    return max((max(k) for k in kept_per_step(kept_rows)), default=0)


def _gather_slots(stat: Tensor, index: Tensor) -> Tensor:
    """A step statistic ``[B, H, ..., T]`` for the kept slots ``index [B, H, K]`` (-1: a filler slot, 0)."""
    B, H, K = index.shape
    idx = index.clamp(min=0).view(B, H, *([1] * (stat.dim() - 3)), K).expand(*stat.shape[:-1], K)
    filler = (index < 0).view(B, H, *([1] * (stat.dim() - 3)), K)
    return stat.gather(-1, idx).masked_fill(filler, 0)


#: the state entry a refreshing policy's latest scores are kept in (`Policy.refresh`)
_REFRESHED = "refresh.scores"


def _row_view(row: Tensor | None, rows: Tensor | None) -> bool:
    """Whether ``row`` is a view of the one query row of ``rows [..., 1, T]`` (the same memory, shape and strides)."""
    if row is None or rows is None or rows.shape[-2] != 1:
        return False
    view = rows.select(-2, 0)
    return row.data_ptr() == view.data_ptr() and row.shape == view.shape and row.stride() == view.stride()


def _scatter_rows(scores: Tensor, rows: list[int], shape: torch.Size) -> Tensor:
    """``scores`` of the rows ``rows`` of a view of ``shape``, as scores of every row: zeros in the others."""
    return scores.new_zeros(shape).index_copy_(0, torch.tensor(rows, device=scores.device), scores)


class _Selected(Sequence):
    """``views[i].select_rows(rows[i])``, each built when read: a policy that scores several layers' rows from
    their state alone (PagedEviction's ratios) copies no layer's keys and values."""

    def __init__(self, views: list[LayerView], rows: list[list[int]]):
        self._views, self._rows = views, rows

    def __len__(self) -> int:
        return len(self._views)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self._views[i].select_rows(self._rows[i])


def _held_where_they_lie(positions: Tensor, first: int = 0) -> Tensor:
    """The kept-slot index of rows that keep every live slot where it lies, for ``positions [., H, K]``, the slots
    from ``first``: each live slot's own number, -1 at a dead one."""
    held = torch.arange(first, first + positions.shape[-1], device=positions.device).expand_as(positions)
    return torch.where(positions >= 0, held, -1)


def _one_or_rows(values: list[int]) -> int | list[int]:
    """One int when every row has the same value (the kernels' fast path), else the per-row list."""
    return values[0] if len(set(values)) == 1 else values


class BudgetCache(Cache):
    """A cache whose every layer and KV head holds at most its row's ``budget`` tokens after each step.

    Parameters
    ----------
    num_layers : int
        Number of decoder layers.
    policy : Policy or sequence of Policy
        The decode policy, already resolved for the budget (`Policy.resolve`), or one resolved policy per row of
        the batch (`learnkv.policies.base.resolve_rows`: rows may differ only in ``per_row_fields``).
    budget : int, sequence of int, or None
        Token budget per layer and KV head, for every row or one per row; None only for policies that never
        evict (``full``).
    last_step : int, optional
        Index of the last forward pass (prefill = 0), if known.
    shared_block : int, optional
        Block size of the layer-shared block mode (one decision for every layer and KV head, whole blocks).
    slack : int
        Slots a layer may leave dead in every row before it compacts (see `BudgetLayer`). 0 compacts whenever a
        slot is free in every row. The kept tokens are the same for any slack; memory grows by ``slack`` slots per
        layer and the compaction runs once per ``slack + 1`` evicted tokens instead of at every eviction. Where
        neighbouring slots are grouped (block eviction: the block mode, PagedEviction; R-KV's max pool,
        ``needs_dense_slots``) no dead slot may lie between live ones: there every eviction compacts (``dense``)
        the rows that evict (`BudgetLayer.keep_slots`), and the slack counts the slots dead in every row that stay
        at the left, where padding is, before every row is compacted.
        (SnapKV's average pool reads live neighbours only, `policies.snapkv.live_order`, so slack applies to it.)
    capacity : int, optional
        Slots to preallocate per layer; by default what the budget needs (`slots_to_allocate`).
    prefill_policy : Policy or sequence of Policy, optional
        Decides at the prefill instead of ``policy`` (resolved like it), for rows whose prompt is over the budget.
        It compresses the prompt to the decode policy's keep target; its state is dropped after the prefill, and
        the decode policy starts its own at the first decode step (it does not observe the prefill).
    allocation : Allocation or str, optional
        How a row's budget is shared by layers and KV heads (`learnkv.allocation`): ``uniform`` (the default: every
        layer and KV head holds at most ``budget``), ``pyramid`` (per-layer budgets summing to ``L x budget``),
        ``head`` (a layer's ``H x budget`` slots shared by its KV heads, Ada-KV) or ``global`` (``L x H x budget``
        slots per row shared by every layer and KV head, decided once per step in `end_step`). Under ``head`` and
        ``global`` a layer's buffers are as wide as its widest head; the other heads' extra slots are dead
        (position -1), which attention ignores. Token granularity, full-attention layers only.
    """

    def __init__(self, num_layers: int, policy: Policy | Sequence[Policy], budget: int | Sequence[int] | None,
                 last_step: int | None = None, shared_block: int | None = None, slack: int = 0,
                 capacity: int | None = None, prefill_policy: Policy | Sequence[Policy] | None = None,
                 allocation: Allocation | str | None = None):
        rows = list(policy) if isinstance(policy, Sequence) else None
        # it scores every row (rows differ only in per-row fields, which the cache or `for_batch` applies)
        self.decode_policy = rows[0].for_batch(rows) if rows else policy
        if self.decode_policy.evicts and budget is None:
            raise ValueError(f"policy {self.decode_policy.name!r} needs a budget")
        if isinstance(slack, bool) or not isinstance(slack, int) or slack < 0:
            raise ValueError(f"slack must be an integer >= 0 (dead slots before a compaction), got {slack!r}")
        if capacity is not None and capacity < 1:
            raise ValueError(f"capacity must be >= 1 slot, got {capacity}")
        if prefill_policy is not None:
            first = prefill_policy[0] if isinstance(prefill_policy, Sequence) else prefill_policy
            if error := prefill_policy_error(first):
                raise ValueError(error)
        self.allocation = as_allocation(allocation)
        if error := allocation_error(self.allocation, self.decode_policy, shared_block is not None):
            raise ValueError(error)
        self._alloc_scores: dict[int, tuple] = {}  # global allocation: each layer's scores, decided in end_step
        self._row_totals: list[int] | None = None  # global: each row's live slots over layers and heads, last step
        self._layer_budgets: list[list[int]] | None = None  # pyramid: [layer][row] budgets (from the first step)
        self._pyramid_keep: tuple = (None, None)  # pyramid: the keep targets and their [layer][row] split
        self._due: list[bool] = []  # head, global: the rows that evict in the layer (head) or step (global)
        self.kept_slots: list[list[list[int]]] = []  # [step][layer][row] live slots summed over KV heads (not uniform)
        super().__init__(layers=[BudgetLayer(i, self) for i in range(num_layers)])
        self._row_args = (rows or policy, budget, prefill_policy)  # expanded to rows at the first step
        self.row_policies: list[Policy] = []
        self.prefill_rows: list[Policy] | None = None
        self.prefill_scorer: Policy | None = None  # the prefill rows' `for_batch`
        self.budgets: list[int] | None = None
        # layer-shared block mode: one decision for every layer and KV head, in whole blocks (as a paged engine)
        self.shared_block = shared_block
        self._shared_scores: dict[int, Tensor] = {}
        self._shared_keep: list[int] | None = None
        self.last_step = last_step  # index of the last forward pass, if known (lets lagged policies keep more)
        # where a block or a pool groups neighbouring slots they must stay dense: every eviction compacts the rows
        # that evict, and up to ``slack`` slots dead in every row stay at the left; elsewhere up to ``slack`` dead
        # slots are tolerated anywhere before a compaction
        self.dense = (shared_block is not None or self.decode_policy.block_size > 1
                      or self.decode_policy.needs_dense_slots)
        self.slack = slack
        self.capacity = capacity  # slots preallocated per layer (None: the steady-state need, see slots_to_allocate)
        self.max_slots: int | None = None  # the most slots the decode can ever fill (known once it starts)
        self.keep: list[int] | None = None  # per row: slots kept if the row evicts in the current step
        self.step = -1
        self.step_positions: Tensor | None = None
        self.step_valid: list[int] = []  # per row: valid (non-padding) tokens of the current step
        # accounting: live tokens each layer held for each row after each step (what the budget bounds)
        self.kept_rows: list[list[list[int]]] = []  # [step][layer][row]
        # stacked layers (`end_step`): whether this step stacks, the statistics each layer handed over, and
        # the stacked positions and state buffers every layer's are views of
        self._stack_step = False
        self._stash: dict[int, tuple[Tensor | None, Tensor | None, Tensor | None]] = {}
        self._stack: Link | None = None
        self._refreshed_at: dict[int, int] = {}  # per layer: the step of its latest refresh (`Policy.refresh`)
        self.eviction_s = 0.0
        # per layer: the sliding window its attention was called with (None: full attention), and the layers whose
        # attention ran learnkv's function with this cache at the prefill (`ungoverned_layers`)
        self.windows: dict[int, int | None] = {}
        self._attended_at_prefill: set[int] = set()
        self.workspace = Workspace()  # the layers' compactions gather through it (`BudgetLayer.keep_slots`)

    @property
    def budget(self) -> int | None:
        """The budget, when every row has the same one (else the largest)."""
        if self.budgets is None:
            arg = self._row_args[1]
            return max(arg) if isinstance(arg, Sequence) else arg
        return max(self.budgets)

    @property
    def policy(self) -> Policy:
        """The policy deciding in the current step (what the attention function hands statistics to): the prefill
        policy at the prefill, if there is one, else the decode policy."""
        return self.prefill_scorer if self.step == 0 and self.prefill_rows else self.decode_policy

    @property
    def kept_per_step(self) -> list[list[int]]:
        """Per step and layer, the most live tokens any row held."""
        return kept_per_step(self.kept_rows)

    @property
    def max_kept(self) -> int:
        """The most live tokens any layer held for any row after any step."""
        return max_kept(self.kept_rows)

    def _expand_rows(self, B: int) -> None:
        policy, budget, prefill = self._row_args
        as_rows = lambda x: list(x) if isinstance(x, Sequence) else [x] * B  # noqa: E731
        self.row_policies = as_rows(policy)
        self.budgets = as_rows(budget) if budget is not None else None
        self.prefill_rows = as_rows(prefill) if prefill is not None else None
        for what, rows in (("policies", self.row_policies), ("budgets", self.budgets), ("prefill policies",
                                                                                          self.prefill_rows)):
            if rows is not None and len(rows) != B:
                raise ValueError(f"BudgetCache: {len(rows)} {what} for a batch of {B} rows")
        self.prefill_scorer = self.prefill_rows[0].for_batch(self.prefill_rows) if self.prefill_rows else None
        if self.allocation.mode == "pyramid" and self.budgets is not None:
            self._layer_budgets = self._pyramid(self.budgets)

    # -- driven by the decode loop ---------------------------------------------------------------------------

    def begin_step(self, positions: Tensor, valid: Sequence[int] | None = None) -> None:
        """Announce the next forward pass: ``positions [B, q]`` of its tokens (-1 for padding). ``valid``: each
        row's non-padding tokens in it, if the caller knows them (else counted: a synchronisation)."""
        self.step += 1
        self.step_positions = positions.long()
        self.step_valid = list(valid) if valid is not None else (positions >= 0).sum(-1).tolist()
        if not self.row_policies:
            self._expand_rows(positions.shape[0])
        if self.step == 0 and self.last_step is not None:  # the prompt (padded) and one token per later pass
            self.max_slots = positions.shape[1] + self.last_step
        if self.decode_policy.evicts:
            steps_left = None if self.last_step is None else self.last_step - self.step
            self.keep = [p.keep_target(b, steps_left) for p, b in zip(self.row_policies, self.budgets)]
        policy = self.decode_policy
        self._stack_step = (self.step >= 1 and positions.shape[1] == 1 and policy.evicts and policy.rowwise
                            and self.shared_block is None
                            and not kernels.use_triton(self.step_positions)
                            and self.allocation.mode == "uniform")  # fmt: skip

    def end_step(self) -> None:
        """After the forward pass: the layer-shared eviction if one is due, then book-keeping."""
        if self._stash:  # a stacked step: every layer's update and eviction at once
            stash, self._stash = self._stash, {}
            order = sorted(stash)
            self._step(order, [stash[i] for i in order])
        if self._shared_scores:
            self._evict_shared()
        if self._alloc_scores:
            self._evict_global()
        if self.step == 0 and self.prefill_rows:
            for layer in self.layers:  # the decode policy starts its own state at the first decode step
                layer.drop_state()
        self.kept_rows.append([list(layer.live) for layer in self.layers])
        if self.allocation.mode != "uniform":
            self.kept_slots.append([layer.live_slots() for layer in self.layers])
            self._row_totals = [sum(rows) for rows in zip(*self.kept_slots[-1])]

    # -- driven by the attention function --------------------------------------------------------------------

    def layer_positions(self, layer_idx: int) -> Tensor:
        return self.layers[layer_idx].positions

    def every_query_a_token(self) -> bool:
        """Every row's step has all its tokens (none is padding), known on the host: a decode step's query then sees
        every live slot, so the attention masks the dead and padding slots alone (`learnkv.attention`)."""
        return all(valid == self.step_positions.shape[1] for valid in self.step_valid)

    def every_slot_live(self, layer_idx: int) -> bool:
        """Every slot of the layer, in every row and KV head, holds a live token, known on the host
        (`BudgetLayer.live`): a decode step of tokens (`every_query_a_token`) may skip a mask that would exclude
        nothing (`learnkv.attention`)."""
        layer = self.layers[layer_idx]
        n = layer.n_slots
        return layer.live_heads is None and layer.heads_alike and all(live == n for live in layer.live)

    def attended(self, layer_idx: int, window: int | None) -> None:
        """Called by the attention function before each layer's attention: the layer's sliding window (None: full
        attention), so the cache drops what falls out of it (`_drop_by_age`), and a record that the layer's
        attention runs through learnkv (`ungoverned_layers`)."""
        if window is not None and self.allocation.mode in ("head", "global"):
            raise ValueError(f"allocation {self.allocation.mode!r} is not supported with sliding-window layers "
                             f"(layer {layer_idx}: a window of {window} tokens): use 'uniform' or 'pyramid'")
        if window is not None and self.shared_block is not None:
            raise ValueError(f"granularity 'block' shares one decision across every layer, but layer {layer_idx} has a "
                             f"sliding window of {window} tokens: use granularity 'token' for this model")
        self.windows[layer_idx] = window
        if self.step == 0:
            self._attended_at_prefill.add(layer_idx)

    def ungoverned_layers(self) -> list[int]:
        """After the prefill: the layers that cached tokens but whose attention never ran learnkv's attention function
        with this cache (the model bypasses transformers' attention interface, or does not hand its attention the
        cache), so no eviction would reach them; every layer if none cached anything."""
        written = [i for i, layer in enumerate(self.layers) if layer.is_initialized]
        if not written:
            return list(range(len(self.layers)))
        return [i for i in written if i not in self._attended_at_prefill]

    def _drop_by_age(self, layer_idx: int, stats: tuple) -> tuple:
        """Drop a sliding layer's tokens the next query can no longer see (rows holding more than ``window - 1``
        keep their newest ``window - 1``) and return the step's statistics for the slots that remain."""
        window = self.windows.get(layer_idx)
        layer: BudgetLayer = self.layers[layer_idx]
        if window is None or max(layer.live) < window:
            return stats
        keep = [min(live, window - 1) for live in layer.live]
        positions, none = layer.positions, [0] * len(keep)
        # the newest by position: positions as scores, nothing protected (a sink past the window is never seen again)
        index, compacts = self._evict([layer], positions, positions.float(), keep, none, none, 1)
        layer.n_new = min(layer.n_new, layer.n_slots)
        if compacts:  # else marked dead in place: the statistics stay aligned with the slots
            stats = tuple(None if t is None else _gather_slots(t, index) for t in stats)
        return stats

    def _over_window(self, layer_idx: int) -> bool:
        """Whether a sliding layer holds more than its next query can see (`_drop_by_age` has work to do)."""
        window = self.windows.get(layer_idx)
        return window is not None and max(self.layers[layer_idx].live) >= window

    def _row_decision(self, layer: BudgetLayer) -> tuple[list[int], bool]:
        """Per row, what to keep now (its keep target if it is over its budget, else every live token), and
        whether any row is over (never for a policy that does not evict)."""
        if not self.policy.evicts:
            return layer.live, False
        if self.allocation.mode != "uniform":
            return self._allocation_decision(layer)
        over = [live > b for live, b in zip(layer.live, self.budgets)]
        return [k if o else live for k, o, live in zip(self.keep, over, layer.live)], any(over)

    def observe(
        self,
        layer_idx: int,
        attn: Tensor | None = None,
        attn_sum: Tensor | None = None,
        attn_sq_sum: Tensor | None = None,
    ) -> None:
        """Hand the step's attention statistics to the policy, then evict if a row is over its budget. Called once
        per layer per step. On a stacked step (see the class docstring) the statistics are kept, and `end_step`
        runs every layer's update and eviction at once."""
        stats = (attn, attn_sum, attn_sq_sum)
        policy = self.policy
        if not (policy.evicts or policy.needs_attention) or self._stack_step:
            if self._over_window(layer_idx):  # a decode step: the dropped token had no attention from its query
                t0 = time.perf_counter()
                stats = self._drop_by_age(layer_idx, stats)
                self.eviction_s += time.perf_counter() - t0
            if self._stack_step:
                self._stash[layer_idx] = stats
            return
        self._step([layer_idx], [stats])

    def _step(self, order: list[int], stats: list[tuple]) -> None:
        """The eviction step of the layers ``order``, one layer or (a stacked decode step, `end_step`) every layer as
        rows of one view: the policy's update, then, if a row is over its budget, its scores -> which slots to keep
        -> compact or mark dead (`_evict`); in the layer-shared block mode the scores wait for `end_step`'s one
        decision. Stacked layers that do not hold the same slots and state layout go one by one (`_link_layers`)."""
        layers = [self.layers[i] for i in order]
        linked = None
        if len(layers) > 1:
            linked = self._link_layers(layers) if len(layers) == len(self.layers) else None
            if linked is None:
                for i, s in zip(order, stats):
                    self._step([i], [s])
                return
        policy, first = self.policy, layers[0]
        keep, due = self._row_decision(first)
        view = self._view(order, stats, linked, keep)
        refreshing = policy.refresh > 1 and (_REFRESHED not in view.state or self.step % policy.refresh == 0)
        view.scored = refreshing if policy.refresh > 1 else due  # `score` follows the update (else a refresh's scores)
        view.victims_only = self._victims_only(first, keep)
        t0 = time.perf_counter()
        if linked is not None and policy.reads_layer:
            policy.update_layers(view, self._layer_views(order, stats, view, keep))
        else:
            policy.update(view)
        if linked is not None:
            self._store_state(layers, view.state, linked[1])
        if refreshing:
            views = self._layer_views(order, stats, view, keep)
            view.state[_REFRESHED] = policy.score(view) if len(views) == 1 else policy.score_layers(view, views)
            self._refreshed_at.update(dict.fromkeys(order, self.step))
            if linked is not None:
                self._store_state(layers, {_REFRESHED: view.state[_REFRESHED]}, linked[1])
        if linked is None and self._over_window(order[0]):
            # the policy saw the step's attention over every slot (at a prefill, early queries attend to tokens the
            # next query cannot see); then the window drops those, and the policy decides on what remains
            stats = [self._drop_by_age(order[0], stats[0])]
            keep, due = self._row_decision(first)
            view = self._view(order, stats, None, keep)
        if due and self.step == 0:
            for live, budget in zip(first.live, self.budgets):
                if error := blind_prefill_error(policy, live, budget):
                    raise ValueError(error)
        if due:
            scores, scored_rows = self._score(order, stats, view, keep)
            if self.shared_block is not None:
                self._shared_scores[order[0]] = scores  # decided in end_step, once every layer has scored
                self._shared_keep = keep
            else:
                rows = self.row_policies if policy is self.decode_policy else self.prefill_rows
                self._evict(layers, view.positions, scores, keep, [p.n_sink for p in rows],
                            [p.n_recent for p in rows], policy.block_size_at(self.step), rows=scored_rows)
        # host time; on CUDA this measures launch cost, not kernel time (the benchmark syncs for that)
        self.eviction_s += time.perf_counter() - t0

    def _victims_only(self, layer: BudgetLayer, keep: list[int]) -> bool:
        """Whether this step's scores of ``layer`` (or of the layers stacked with it) name each row's one victim and
        nothing else (`LayerView.victims_only`): no row drops more than one live slot of ``keep``, at token
        granularity (`kernels.cpu.one_drop_rows`, the case of the one-drop marking), and the scores are neither kept
        (a refresh), nor pooled into one shared decision, nor compared across heads and layers (allocation ``head``
        or ``global``)."""
        policy = self.policy
        return (policy.refresh == 1 and self.shared_block is None and self.allocation.mode not in ("head", "global")
                and policy.block_size_at(self.step) == 1
                and one_drop_rows(keep, layer.live, len(keep), 1, layer.n_slots) is not None)

    def _view(self, order: list[int], stats: list[tuple], linked: tuple | None, keep: list[int]) -> LayerView:
        """The policy's view of the layers ``order`` with the step's statistics ``stats`` (one tuple per layer); of
        stacked layers (``linked``, `_link_layers`), the layer-major rows of every layer."""
        first, L = self.layers[order[0]], len(order)
        positions, state = linked if linked is not None else (first.positions, first.state)

        def stat(k):
            return None if stats[0][k] is None else stats[0][k] if L == 1 else torch.cat([s[k] for s in stats])

        attn = stat(0)
        # a decode step's attention sum over its one query row is that row (`learnkv.attention`): of stacked layers,
        # a view of their stacked rows, not a second concatenation of the same values
        one_row = L > 1 and all(_row_view(s[1], s[0]) for s in stats)
        return LayerView(layer=order[0], step=self.step, keys=first.keys if L == 1 else None,
                         values=first.values if L == 1 else None, positions=positions, n_new=first.n_new,
                         attn=attn, attn_sum=attn.select(-2, 0) if one_row else stat(1), attn_sq_sum=stat(2),
                         keep=_one_or_rows(keep * L),
                         state=state if L == 1 else dict(state), live=first.live * L if L > 1 else first.live,
                         layers=tuple(order) if L > 1 else None)

    def _layer_views(self, order: list[int], stats: list[tuple], view: LayerView, keep: list[int]) -> list[LayerView]:
        """``view`` of the layers ``order`` as one view per layer (each layer's own positions, state, keys, values
        and statistics ``stats``, as a step layer by layer would build it); ``[view]`` for one layer."""
        if len(order) == 1:
            return [view]
        return [self._view([i], [s], None, keep) for i, s in zip(order, stats)]

    @staticmethod
    def _lagged(rows: Sequence[Policy]) -> bool:
        """Whether a row's policy is lagged (``interval > 1``): rows then come due at different steps."""
        return any(p.interval > 1 for p in rows)

    @staticmethod
    def _store_state(layers: list[BudgetLayer], state: dict[str, Tensor], stacked: dict[str, Tensor]) -> None:
        """What the policy rebound or added in a stacked view's ``state``, back into each layer's state. An entry
        rebound with another shape (SnapKV's window of attention rows, growing until it holds its window) goes to
        the layers as a new one would: each layer its own rows of it."""
        B = layers[0].positions.shape[0]
        for name, t in state.items():
            if name in stacked and t.shape == stacked[name].shape:
                if t is not stacked[name]:
                    stacked[name].copy_(t)
            else:
                for i, layer in enumerate(layers):
                    layer.state[name] = t[i * B : (i + 1) * B]

    def _score(self, order: list[int], stats: list[tuple], view: LayerView,
               keep: list[int]) -> tuple[Tensor, list[int] | None]:
        """The scores of the view of the layers ``order`` (see "Batching" and "Refresh" in the module docstring), and
        the rows of the view they are of (None: every row): the latest refresh's where the policy refreshes; of a
        view of several layers, in one call (`Policy.score_layers` where the policy reads a layer's keys or index);
        of a rowwise policy, lagged or in a dense cache (`_select_due_rows`), of the rows that evict now only
        (`LayerView.due_rows`; the others keep every live token whatever their scores: a lagged policy's rows come
        due at different steps, and rows reach their budgets at different steps) unless the decision is shared or
        every row is due; else of every row."""
        policy = self.policy
        if policy.refresh > 1:
            # the tokens appended since the last refresh, one per decode step, are the last slots (the cache appends
            # at the end and keeps the order when it compacts); they have no score yet, so they are kept
            unscored = self.step - self._refreshed_at[order[0]]
            scores = view.state[_REFRESHED].clone()
            if unscored:
                scores[..., -unscored:] = float("inf")
            return scores, None
        rows = self.row_policies if policy is self.decode_policy else self.prefill_rows
        by_rows = policy.rowwise and (self.dense or self._lagged(rows)) and self.shared_block is None
        due = view.due_rows() if by_rows else None
        per_layer = len(order) > 1 and policy.reads_layer  # the policy gets one view per layer too
        if due is None or len(due) == view.positions.shape[0]:
            views = self._layer_views(order, stats, view, keep) if per_layer else None
            return policy.score_layers(view, views) if per_layer else policy.score(view), None
        some = view.select_rows(due)
        if not per_layer:
            return policy.score(some), due
        # each layer's view of its due rows, selected (a copy of its keys and values) only if the policy reads it
        B, views = view.positions.shape[0] // len(order), self._layer_views(order, stats, view, keep)
        of_layer = [[d - i * B for d in due if i * B <= d < (i + 1) * B] for i in range(len(order))]
        return policy.score_layers(some, _Selected(views, of_layer)), due

    def _evict(self, layers: list[BudgetLayer], positions: Tensor, scores: Tensor | list[Tensor], keep: list[int],
               sinks: list[int], recents: list[int], block: int, pooling: str | None = None,
               rows: list[int] | None = None) -> tuple[Tensor | None, bool]:
        """The one eviction of the cache: ``scores`` -> the slots each row keeps -> compact or mark dead.

        ``layers`` decide as rows of one selection, layer-major (one layer, or a stacked step's every layer:
        ``positions`` and ``scores`` ``[L * B, H, T]``), or, with ``pooling``, share one decision whose scores are
        one tensor per layer pooled into one score per slot (`learnkv.pooling.shared_keep_slots`). ``keep``,
        ``sinks`` and ``recents`` are per row of one layer. Returns the kept slots (None where a one-drop step
        marked its victims without listing them, `_mark_one_drop`, or a stacked step of a dense cache listed only
        the rows that evict) and whether the layers were compacted (else the evicted slots were marked dead in
        place). ``rows``: the rows ``scores`` are of, if not every row (`_score`):
        a dense cache's due rows select alone (`_select_due_rows`); elsewhere the other rows get zeros, and keep
        every live slot as their ``keep`` asks."""
        dense_rows = self.dense and pooling is None and self.allocation.mode == "uniform"
        if rows is not None and not dense_rows:
            scores = _scatter_rows(scores, rows, positions.shape)
        if self.allocation.mode in ("head", "global") and pooling is None:
            return self._evict_per_head(layers[0], positions, scores, sinks, recents)
        if pooling is not None:
            index = shared_keep_slots(scores, positions, _one_or_rows(keep), _one_or_rows(sinks),
                                      _one_or_rows(recents), block, pooling)
            index = self._dense_width(layers[0], index)
            return index, self._keep_slots(layers, index, positions, None)
        L = len(layers)
        if block == 1 and self._mark_one_drop(layers, positions, scores, keep, sinks, recents):
            return None, False
        moving = None
        if dense_rows:
            # a stacked step's layers move only the rows that change (`_moved_rows_of_linked_layers`), so the
            # others need no index
            index, moving = self._select_due_rows(scores, rows, positions, keep * L, sinks * L, recents * L, block,
                                                  layers[0].live * L, self.slack if L > 1 else None)
        else:
            index = kernels.select_keep(scores, positions, _one_or_rows(keep * L), _one_or_rows(sinks * L),
                                        _one_or_rows(recents * L), block, live=layers[0].live * L)
        index = self._dense_width(layers[0], index)
        compacts = self._keep_slots(layers, index, positions, keep if block == 1 else None, moving)
        return (None if moving is not None else index), compacts

    def _dense_width(self, layer: BudgetLayer, index: Tensor) -> Tensor:
        """The kept slots ``index [., H, K]`` of a dense cache's ``layer`` at the layer's width, where a compaction to
        ``K`` would free at most ``slack`` slots in every row: -1 entries before each row's (dead slots at the left,
        where padding is), so that only the rows whose slots change move (`BudgetLayer.keep_slots`); else as
        given."""
        K, n = index.shape[-1], layer.n_slots
        if not self.dense or K >= n or n - K > self.slack:
            return index
        return F.pad(index, (n - K, 0), value=-1)

    @staticmethod
    def _select_due_rows(scores: Tensor, rows: list[int] | None, positions: Tensor, keep: list[int], sinks: list[int],
                         recents: list[int], block: int, live: list[int],
                         slack: int | None = None) -> tuple[Tensor, list[int] | None]:
        """`kernels.select_keep` of a dense cache (``dense``) where some rows evict: the rows that evict select (with
        their scores, the only ones computed: ``scores`` are of ``rows``, or of every row where ``rows`` is None),
        and each other row keeps its live slots where they lie. The same index as the selection of every row: a
        dense cache compacts at every eviction, so a row's dead slots (padding, the fillers of a compaction) precede
        its live ones. That is checked; a row that breaks it (a dead slot among live ones) has every row select.
        Returns the index and None, or with ``slack``, where the index would be padded to the width anyway
        (`_dense_width`: it frees at most ``slack`` slots in every row), the index of the rows that evict alone, at
        the width, and those rows: every other keeps each slot where it lies (for a caller that moves only the rows
        that change, `learnkv.slots.keep_moved_rows_of_layers`)."""
        def every_row() -> tuple[Tensor, None]:
            full = scores if rows is None else _scatter_rows(scores, rows, positions.shape)
            return kernels.select_keep(full, positions, _one_or_rows(keep), _one_or_rows(sinks),
                                       _one_or_rows(recents), block, live=live), None

        due = rows if rows is not None else [b for b, (k, n) in enumerate(zip(keep, live)) if k < n]
        if len(due) == len(keep):
            return every_row()
        at = torch.tensor(due, device=positions.device)
        chosen = kernels.select_keep(scores if rows is not None else scores.index_select(0, at),
                                     positions.index_select(0, at),
                                     *([v[b] for b in due] for v in (keep, sinks, recents)), block,
                                     live=[live[b] for b in due])
        T = positions.shape[-1]
        evicting = set(due)
        width = max([chosen.shape[-1]] + [n for b, n in enumerate(live) if b not in evicting])
        if slack is not None and T - width <= slack:
            # each other row keeps its slots where they lie if no live slot precedes a dead one (one
            # synchronisation, as the selection's own)
            alive = positions >= 0
            if bool((alive[..., :-1] > alive[..., 1:]).index_fill_(0, at, False).any()):
                return every_row()
            return F.pad(chosen, (T - chosen.shape[-1], 0), value=-1), due
        index = _held_where_they_lie(positions[..., T - width :], T - width)
        index.index_copy_(0, at, F.pad(chosen, (width - chosen.shape[-1], 0), value=-1))
        # ascending after the -1 entries, and no live slot of a row that does not evict left out (one
        # synchronisation, as the selection's own)
        left_out = (positions[..., : T - width] >= 0).index_fill_(0, at, False)
        if bool((index[..., 1:] < index[..., :-1]).any() | left_out.any()):
            return every_row()
        return index, None

    def _mark_one_drop(self, layers: list[BudgetLayer], positions: Tensor, scores: Tensor, keep: list[int],
                       sinks: list[int], recents: list[int]) -> bool:
        """A token eviction that drops at most one live slot per row and does not compact (`_compacts`): mark each
        dropping row's victim dead in place (`kernels.mark_one_drop`), without the kept index `kernels.select_keep`
        would build and `mark_dead` turn back into a mask; the same live slots, bit for bit. Returns whether it did
        (else the caller selects and keeps slots as usual)."""
        L, first = len(layers), layers[0]
        if max(keep) > first.n_slots or self._compacts(first, max(keep)):
            return False
        # a stacked view writes through to every layer's positions
        if not kernels.mark_one_drop(scores, positions, _one_or_rows(keep * L), _one_or_rows(sinks * L),
                                     _one_or_rows(recents * L), first.live * L):  # fmt: skip
            return False
        for layer in layers:
            layer.live = list(keep)
        return True

    def _compacts(self, layer: BudgetLayer, kept: int) -> bool:
        """Whether an eviction that keeps ``kept`` slots (the widest row's) compacts rather than marks the evicted
        slots dead: always where the slots must stay dense (a dead slot between a row's live ones would change
        what its policy sees, even when the widest row evicts nothing and no slot is free in every row), else once
        more than the cache's ``slack`` slots would be dead in every row."""
        return self.dense or layer.n_slots - kept > self.slack

    def _keep_slots(self, layers: list[BudgetLayer], index: Tensor, positions: Tensor, live: list[int] | None,
                    moving: list[int] | None = None) -> bool:
        """Keep the slots ``index`` (ascending, -1 = none, see `kernels.select_keep`; ``[L * B, H, K]`` layer-major
        for ``L`` layers, or ``[B, 1, K]`` for every layer and KV head alike) in ``layers``, whose positions are
        ``positions`` (one layer's, or their stacked view): compact, or mark the rest dead (`_compacts`).
        ``live``: each row's live tokens afterwards, if the caller knows them (token eviction: what it asked to
        keep); else counted. ``moving``: the only rows whose slots may change, if the caller knows
        (`_select_due_rows`), and ``index`` is of those alone. Returns whether the layers were compacted."""
        first = layers[0]
        B = first.positions.shape[0]
        compacts = self._compacts(first, index.shape[-1])
        if not compacts:
            mark_dead(positions, index)  # a stacked view writes through to every layer's positions
        elif not self._moved_rows_of_linked_layers(layers, index, moving):
            if moving is not None:  # every row's index: each other row's live slots where they lie
                at = torch.tensor(moving, device=index.device)
                index = _held_where_they_lie(positions).index_copy_(0, at, index)
            for i, layer in enumerate(layers):
                part = index[i * B : (i + 1) * B] if index.shape[0] > B else index
                heads = layer.positions.shape[1]
                layer.keep_slots(part if part.shape[1] == heads else part.expand(-1, heads, -1))
        live = list(live) if live is not None else first.count_live()
        for layer in layers:
            layer.live = list(live)
            layer.heads_alike = first.heads_alike
        return compacts

    def _moved_rows_of_linked_layers(self, layers: list[BudgetLayer], index: Tensor, moving: list[int] | None) -> bool:
        """Keep the slots ``index`` (at the layers' width) of a stacked step's layers by moving only the rows that
        change (of ``moving``, if not None), every layer's positions and state at once
        (`learnkv.slots.keep_moved_rows_of_layers`). Returns whether it did (else each layer keeps its slots
        itself)."""
        first = layers[0]
        rows = len(layers) * first.positions.shape[0] if moving is None else len(moving)
        if (len(layers) == 1 or len(layers) != len(self.layers) or index.shape[-1] != first.n_slots
                or index.shape[0] != rows):
            return False
        n = first.n_slots
        for layer in layers:  # entries the policy rebound this step, into their channels (as `keep_slots` does)
            if layer.state:
                layer._pack_state(n, n)
        return self._link_layers(layers) is not None and keep_moved_rows_of_layers(layers, index, self._stack, moving)

    def _link_layers(self, layers: list[BudgetLayer]) -> tuple[Tensor, dict[str, Tensor]] | None:
        """The stacked positions and state of ``layers`` (`learnkv.slots.link_layers`), or None."""
        linked = link_layers(layers, self._stack)
        if linked is None:
            return None
        self._stack, positions, state = linked
        return positions, state

    def _every_layer(self, stash: dict, what: str) -> list:
        """What every layer left in ``stash`` this step, in layer order, emptying it (each layer must have)."""
        if len(stash) != len(self.layers):
            raise RuntimeError(f"{what} needs every layer's scores in the same step")
        entries = [stash[i] for i in range(len(self.layers))]
        stash.clear()
        return entries

    def _evict_shared(self) -> None:
        """One block decision from every layer's scores, applied to every layer and KV head alike."""
        t0 = time.perf_counter()
        scores = self._every_layer(self._shared_scores, "layer-shared eviction")
        policy = self.policy
        rows = self.row_policies if policy is self.decode_policy else self.prefill_rows
        # every layer holds the same slots in this mode
        self._evict(list(self.layers), self.layers[0].positions, scores, self._shared_keep, [p.n_sink for p in rows],
                    [p.n_recent for p in rows], self.shared_block, policy.pooling)
        self.eviction_s += time.perf_counter() - t0

    # -- allocation across layers and KV heads (issue 42, `learnkv.allocation`) -------------------------------

    def _pyramid(self, values: list[int]) -> list[list[int]]:
        """``[layer][row]`` PyramidKV budgets of each row's ``values`` (budgets or keep targets), none below the
        row's protected tokens per head."""
        rows = [self.row_policies] + ([self.prefill_rows] if self.prefill_rows else [])
        protect = [max(p.n_sink + p.n_recent for p in ps) for ps in zip(*rows)]
        return head_budgets(self.allocation, values, len(self.layers), len(values), protect).tolist()

    def _allocation_decision(self, layer: BudgetLayer) -> tuple[list[int], bool]:
        """`_row_decision` under an allocation other than ``uniform``: ``pyramid`` as uniform with the layer's
        budget and keep target; ``head`` evicts a row when the layer's live slots over its KV heads exceed ``H x
        budget``, ``global`` when the row's over every layer will exceed ``L x H x budget`` once this step's tokens
        are in. A due row's keep is below its widest head (`LayerView.due_rows`), the others keep every live token."""
        i = layer.layer_idx
        if self.allocation.mode == "pyramid":
            budgets = self._layer_budgets[i]
            if self._pyramid_keep[0] != self.keep:  # once per step
                self._pyramid_keep = (list(self.keep), self._pyramid(self.keep))
            keep = [min(k, b) for k, b in zip(self._pyramid_keep[1][i], budgets)]
            over = [live > b for live, b in zip(layer.live, budgets)]
            return [k if o else live for k, o, live in zip(keep, over, layer.live)], any(over)
        H, L = layer.positions.shape[1], len(self.layers)
        if self.allocation.mode == "head":
            over = [n > H * b for n, b in zip(layer.live_slots(), self.budgets)]
        else:
            totals = self._row_totals or [0] * len(self.budgets)
            over = [n + L * H * new > L * H * b for n, new, b in zip(totals, self.step_valid, self.budgets)]
        self._due = over
        return [min(k, live - 1) if o else live for k, o, live in zip(self.keep, over, layer.live)], any(over)

    def _evict_per_head(self, layer: BudgetLayer, positions: Tensor, scores: Tensor, sinks: list[int],
                        recents: list[int]) -> tuple[Tensor | None, bool]:
        """``head``: the layer's slots each KV head keeps (`learnkv.allocation.allocate` on the policy's scores
        normalised per head, `normalisation_for`), then compact or mark dead. ``global``: the normalised scores
        wait for `end_step` (`_evict_global`)."""
        valid = positions >= 0
        protected = protected_slots(positions, sinks, recents)
        normed = normalise_scores(scores, valid, normalisation_for(self.policy))
        if self.allocation.mode == "global":
            self._alloc_scores[layer.layer_idx] = (normed, valid, protected)
            return None, False
        _, keep = allocate(normed[None], valid[None], protected[None], self.keep, self.allocation)
        return None, self._apply_keep(layer, keep[0], valid)

    def _apply_keep(self, layer: BudgetLayer, keep: Tensor, valid: Tensor) -> bool:
        """Keep the slots ``keep [B, H, T]`` of the due rows (the others keep every live slot) and count the live
        slots per row; returns whether the layer was compacted."""
        due = torch.tensor(self._due, device=keep.device)[:, None, None]
        keep = torch.where(due, keep, valid)
        compacts = self._keep_slots([layer], keep_slots(keep[None])[0], layer.positions, None)
        layer.live_heads = keep.sum((-2, -1)).tolist()
        return compacts

    def _evict_global(self) -> None:
        """``global``: one decision over every layer and KV head of each row, from the scores every layer left."""
        t0 = time.perf_counter()
        parts = self._every_layer(self._alloc_scores, "global allocation")
        T = max(p[0].shape[-1] for p in parts)

        def padded(k: int) -> Tensor:  # layers may hold different numbers of slots: pad with dead ones
            return torch.stack([torch.cat([p[k], p[k].new_zeros(*p[k].shape[:-1], T - p[k].shape[-1])], -1)
                                for p in parts])

        _, keep = allocate(padded(0), padded(1), padded(2), self.keep, self.allocation)
        for layer, (normed, valid, _) in zip(self.layers, parts):
            self._apply_keep(layer, keep[layer.layer_idx, ..., : normed.shape[-1]], valid)
        self.eviction_s += time.perf_counter() - t0

    def slots_to_allocate(self, need: int, current: int, window: int | None = None) -> int:
        """Slots a layer allocates when it needs ``need`` and holds ``current``.

        A budgeted cache needs at most ``budget + slack + 1`` slots after its prefill (the largest row budget, the
        dead slots, the step's new token), so that is allocated once and a compaction shrinks back to it after a
        longer prompt; never more than the decode can fill, though (the padded prompt and one token per later pass,
        `max_slots`), so a budget over the final length reserves what the full cache would, not the budget. The
        full cache allocates for the whole decode when ``last_step`` is known (like a static cache), and otherwise
        grows by half its size, so appends stay amortised O(1). A sliding layer (``window``) needs at most
        ``window + slack`` after a compaction (``window - 1`` kept, the step's token, the dead slots).
        """
        if self.capacity is not None:
            return max(need, self.capacity)
        if window is not None:
            held = min(window - 1, self.budget) if self.decode_policy.evicts else window - 1
            return max(need, held + 1 + self.slack)
        if self.decode_policy.evicts and self.allocation.mode in ("head", "global"):
            # a head may hold more than the budget: grow amortised, with room for the next step after a compaction
            grow = need + 1 + self.slack if current == 0 else max(need, current + current // 2)
            steady = max(grow, self.budget + self.slack + 1)
            return max(need, steady if self.max_slots is None else min(steady, self.max_slots))
        if self.decode_policy.evicts:
            widest = self.budget if self._layer_budgets is None else max(map(max, self._layer_budgets))
            steady = widest + self.slack + 1
            return max(need, steady if self.max_slots is None else min(steady, self.max_slots))
        if current == 0 and self.last_step is not None:
            return need + self.last_step
        return max(need, current + current // 2)

    # -- accounting -------------------------------------------------------------------------------------------

    def bytes_per_slot(self) -> int:
        """KV bytes of one slot in one layer, all KV heads and the whole batch (keys + values)."""
        return self.layers[0].keys.shape[0] * self.bytes_per_token()

    def bytes_per_token(self) -> int:
        """KV bytes of one token of one row in one layer, all KV heads (keys + values, which may differ in width)."""
        keys, values = self.layers[0].keys, self.layers[0].values
        return keys.shape[1] * (keys.shape[3] * keys.element_size() + values.shape[3] * values.element_size())

    def layer_windows(self) -> list[int | None]:
        """Per layer, the sliding window its attention ran with (None: full attention)."""
        return [self.windows.get(i) for i in range(len(self.layers))]
