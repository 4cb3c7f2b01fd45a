"""BudgetCache: a transformers `Cache` that holds at most `budget` tokens per layer and KV head.

It owns every eviction invariant, for every policy: the cache never holds more than the budget at the end of
a step, sinks and the recent window survive, kept tokens stay in their original order, and the policy's
per-token state stays aligned with the keys and values. Policies only score; selection and compaction are
done here, once, through `kernels.select_keep` and `kernels.gather_tokens`.

Order within a step (for every layer): append the step's keys/values -> attention over the whole cache,
statistics handed to the policy (`learnkv.attention`) -> policy state update -> evict if due. So a step's
attention always sees the full pre-eviction cache, as in LazyEviction, EasyKV and kvpress.

Each slot carries its token's original position ([B, H, T], -1 for left padding). The attention mask is
built from these positions, never from slot indices, so eviction and padding need no 2D mask. That is also
what lets an evicted slot stay in place, dead (position -1), until a later compaction (``slack``): on a GPU,
compacting the cache at every step would move more bytes than the step's attention reads.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor
from transformers.cache_utils import Cache, DynamicLayer

import kernels
from learnkv.policies.base import LayerView, Policy
from learnkv.pooling import shared_keep_slots


class BudgetLayer(DynamicLayer):
    """One decoder layer's keys/values plus slot positions and policy state.

    Keys, values, positions and policy state live in buffers preallocated along the slot axis, so a decode step
    writes its one new slot instead of concatenating the whole cache (`DynamicLayer` does that, copying every slot
    every step); ``keys``, ``values``, ``positions`` and each ``state`` entry are views of the first ``n_slots``.
    A policy that updates its state in place (the Triton path) keeps the views; one that rebinds an entry to a new
    tensor (the torch path) has it copied into a fresh buffer at the next append, which costs what a concatenation
    did.

    Evicted slots are compacted away at once, or, with the cache's ``slack``, marked dead (position -1, masked
    exactly like padding) and compacted only once more than ``slack`` have accumulated. Either way the live
    slots keep their original order; with slack, a policy that evicts one token per step moves the cache once
    every ``slack + 1`` steps instead of every step.
    """

    def __init__(self, layer_idx: int, owner: "BudgetCache"):
        super().__init__()
        self.layer_idx = layer_idx
        self.owner = owner
        self.positions: Tensor | None = None  # [B, H, T] int64, -1 = padding or a dead slot
        self.state: dict[str, Tensor] = {}
        self.n_new = 0
        self.n_dead = 0  # dead slots awaiting compaction, the same count in every (b, h) row
        self._buffers: tuple[Tensor, Tensor, Tensor] | None = None  # keys, values [B, H, C, D]; positions [B, H, C]
        self._state_buffers: dict[str, Tensor] = {}  # [B, H, ..., C] behind each state entry

    @property
    def n_slots(self) -> int:
        return 0 if self.positions is None else self.positions.shape[-1]

    @property
    def capacity(self) -> int:
        return 0 if self._buffers is None else self._buffers[2].shape[-1]

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        B, H, q, _ = key_states.shape
        new_pos = self.owner.step_positions
        if new_pos is None or new_pos.shape != (B, q):
            raise RuntimeError("BudgetCache.begin_step(positions) must be called before each forward pass")
        n = self.n_slots
        if n + q > self.capacity:
            self._allocate(self.owner.slots_to_allocate(n + q, self.capacity), key_states, n)
        kb, vb, pb = self._buffers
        kb[:, :, n : n + q] = key_states
        vb[:, :, n : n + q] = value_states
        pb[:, :, n : n + q] = new_pos.to(pb.device)[:, None, :]
        self._view(n + q)
        self._append_state(n, q)
        self.n_new = q
        self.owner._attended(self.layer_idx, n + q)
        return self.keys, self.values

    def _allocate(self, capacity: int, like: Tensor, n_copy: int) -> None:
        """New buffers of ``capacity`` slots holding the first ``n_copy`` current slots."""
        B, H, _, D = like.shape
        kb = like.new_empty(B, H, capacity, D)
        vb = like.new_empty(B, H, capacity, D)
        pb = torch.empty((B, H, capacity), dtype=torch.long, device=like.device)  # slots past n_slots are never read
        if n_copy:
            kb[:, :, :n_copy] = self.keys
            vb[:, :, :n_copy] = self.values
            pb[:, :, :n_copy] = self.positions
        self._buffers = (kb, vb, pb)

    def _append_state(self, n: int, q: int) -> None:
        """Grow every state entry by ``q`` zero slots, in place where the entry is still a view of its buffer."""
        buffers = {}
        for name, t in self.state.items():
            buf = self._state_buffer(name, t)
            if buf is None or buf.shape[-1] < n + q:
                buf = t.new_empty(*t.shape[:-1], self.capacity)
                buf[..., :n] = t
            buf[..., n : n + q] = 0
            buffers[name] = buf
            self.state[name] = buf[..., : n + q]
        self._state_buffers = buffers

    def _state_buffer(self, name: str, t: Tensor) -> Tensor | None:
        """The buffer behind state entry ``name`` if ``t`` is still its prefix view (the policy updated it in place),
        else None (the policy rebound the entry to a tensor of its own)."""
        buf = self._state_buffers.get(name)
        if buf is None or t.data_ptr() != buf.data_ptr():
            return None
        return buf if t.stride() == buf.stride() and t.shape[:-1] == buf.shape[:-1] else None

    def _view(self, n: int) -> None:
        kb, vb, pb = self._buffers
        self.keys, self.values, self.positions = kb[:, :, :n], vb[:, :, :n], pb[:, :, :n]

    def evict(self, index: Tensor, slack: int) -> None:
        """Keep the slots ``index [B, H, K]`` (ascending): mark the rest dead, or compact if over ``slack`` dead."""
        dead = self.n_slots - index.shape[-1]
        if dead > slack:
            self.keep_slots(index)
            return
        kept = torch.zeros(self.positions.shape, dtype=torch.bool, device=index.device).scatter_(-1, index, True)
        self.positions.masked_fill_(~kept, -1)  # writes through to the buffer
        self.n_dead = dead

    def keep_slots(self, index: Tensor) -> None:
        """Compact keys, values, positions and state to the slots ``index [B, H, K]`` (ascending)."""
        K = index.shape[-1]
        old = self._buffers
        # into fresh buffers (in place, one program's writes would overwrite slots another still reads); sized for
        # the steady state, so a long prompt compressed to the budget gives its memory back. Each kept slot is read
        # once and written once; the old buffers are freed (on CUDA, to the caching allocator's pool)
        self._allocate(self.owner.slots_to_allocate(K, 0), old[0], 0)
        for src, dst, dim in zip(old, self._buffers, (-2, -2, -1)):
            kernels.gather_tokens(src, index, dim, out=dst)  # from the whole buffers: index < n_slots <= capacity
        self._view(K)
        buffers = {}
        for name, t in self.state.items():
            src = self._state_buffer(name, t)
            src = t if src is None else src  # the whole buffer, which is contiguous
            buffers[name] = t.new_empty(*t.shape[:-1], self.capacity)
            self.state[name] = kernels.gather_tokens(src, index, -1, out=buffers[name])
        self._state_buffers = buffers
        self.n_dead = 0


class BudgetCache(Cache):
    """A cache whose every layer and KV head holds at most ``budget`` tokens after each step.

    Parameters
    ----------
    num_layers : int
        Number of decoder layers.
    policy : Policy
        A policy already resolved for this budget (`Policy.resolve`).
    budget : int or None
        Token budget per layer and KV head; None only for policies that never evict (``full``).
    last_step : int, optional
        Index of the last forward pass (prefill = 0), if known.
    shared_block : int, optional
        Block size of the layer-shared block mode (one decision for every layer and KV head, whole blocks).
    slack : int
        Dead slots a layer may hold before it compacts (see `BudgetLayer`). 0 compacts at every eviction. The
        kept tokens are the same for any slack; memory grows by ``slack`` slots per layer and the compaction
        runs once per ``slack + 1`` evicted tokens instead of at every eviction. Ignored (0) wherever neighbouring
        slots are grouped: block eviction (the block mode, PagedEviction) and SnapKV's average pool
        (``needs_dense_slots``).
    capacity : int, optional
        Slots to preallocate per layer; by default what the budget needs (`slots_to_allocate`).
    """

    def __init__(self, num_layers: int, policy: Policy, budget: int | None, last_step: int | None = None,
                 shared_block: int | None = None, slack: int = 0, capacity: int | None = None):
        if policy.evicts and budget is None:
            raise ValueError(f"policy {policy.name!r} needs a budget")
        if isinstance(slack, bool) or not isinstance(slack, int) or slack < 0:
            raise ValueError(f"slack must be an integer >= 0 (dead slots before a compaction), got {slack!r}")
        if capacity is not None and capacity < 1:
            raise ValueError(f"capacity must be >= 1 slot, got {capacity}")
        super().__init__(layers=[BudgetLayer(i, self) for i in range(num_layers)])
        self.policy = policy
        self.budget = budget
        # layer-shared block mode: one decision for every layer and KV head, in whole blocks (as a paged engine)
        self.shared_block = shared_block
        self._shared_scores: dict[int, Tensor] = {}
        self.last_step = last_step  # index of the last forward pass, if known (lets lagged policies keep more)
        # dead slots tolerated before a compaction; only where no block or pooling groups neighbouring slots
        dense = shared_block is not None or policy.block_size > 1 or policy.needs_dense_slots
        self.slack = 0 if dense else slack
        self.capacity = capacity  # slots preallocated per layer (None: the steady-state need, see slots_to_allocate)
        self.keep = None  # slots kept if the cache evicts in the current step
        self.step = -1
        self.step_positions: Tensor | None = None
        # accounting
        self._attended_slots = [0] * num_layers
        self.peak_slots = 0  # max over steps of the sum over layers of slots each layer attended to
        self.max_kept = 0  # max over steps and layers of tokens held after the step (live slots, padding included)
        self.kept_per_step: list[list[int]] = []
        self.eviction_s = 0.0

    # -- driven by the decode loop ---------------------------------------------------------------------------

    def begin_step(self, positions: Tensor) -> None:
        """Announce the next forward pass: ``positions [B, q]`` of its tokens (-1 for padding)."""
        self.step += 1
        self.step_positions = positions.long()
        if self.policy.evicts:
            steps_left = None if self.last_step is None else self.last_step - self.step
            self.keep = self.policy.keep_target(self.budget, steps_left)

    def end_step(self) -> None:
        """After the forward pass: the layer-shared eviction if one is due, then book-keeping."""
        if self._shared_scores:
            self._evict_shared()
        self.peak_slots = max(self.peak_slots, sum(self._attended_slots))
        kept = [layer.n_slots - layer.n_dead for layer in self.layers]  # what the budget bounds: dead slots are not
        self.kept_per_step.append(kept)
        self.max_kept = max(self.max_kept, max(kept))

    # -- driven by the attention function --------------------------------------------------------------------

    def _attended(self, layer_idx: int, n_slots: int) -> None:
        self._attended_slots[layer_idx] = n_slots

    def layer_positions(self, layer_idx: int) -> Tensor:
        return self.layers[layer_idx].positions

    def observe(
        self,
        layer_idx: int,
        attn: Tensor | None = None,
        attn_sum: Tensor | None = None,
        attn_sq_sum: Tensor | None = None,
    ) -> None:
        """Hand the step's attention statistics to the policy, then evict if due. Called once per layer per step."""
        policy = self.policy
        if not (policy.evicts or policy.needs_attention):
            return
        layer: BudgetLayer = self.layers[layer_idx]
        view = LayerView(
            layer=layer_idx,
            step=self.step,
            keys=layer.keys,
            values=layer.values,
            positions=layer.positions,
            n_new=layer.n_new,
            attn=attn,
            attn_sum=attn_sum,
            attn_sq_sum=attn_sq_sum,
            keep=self.keep,
            state=layer.state,
            n_dead=layer.n_dead,
        )
        t0 = time.perf_counter()
        policy.update(view)
        if policy.evicts and layer.n_slots - layer.n_dead > self.keep and self.step % policy.interval == 0:
            scores = policy.score(view)
            if self.shared_block is not None:
                self._shared_scores[layer_idx] = scores  # decided in end_step, once every layer has scored
            else:
                index = kernels.select_keep(
                    scores, layer.positions, self.keep, policy.n_sink, policy.n_recent, policy.block_size_at(self.step)
                )
                layer.evict(index, self.slack)
        # host time; on CUDA this measures launch cost, not kernel time (the benchmark syncs for that)
        self.eviction_s += time.perf_counter() - t0

    def _evict_shared(self) -> None:
        """One block decision from every layer's scores, applied to every layer and KV head alike."""
        t0 = time.perf_counter()
        if len(self._shared_scores) != len(self.layers):
            raise RuntimeError("layer-shared eviction needs every layer's scores in the same step")
        positions = self.layers[0].positions  # every layer holds the same slots in this mode
        scores = [self._shared_scores[i] for i in range(len(self.layers))]
        self._shared_scores = {}
        policy = self.policy
        index = shared_keep_slots(scores, positions, self.keep, policy.n_sink, policy.n_recent, self.shared_block,
                                  policy.pooling)
        for layer in self.layers:
            layer.keep_slots(index.expand(-1, layer.positions.shape[1], -1))
        self.eviction_s += time.perf_counter() - t0

    def slots_to_allocate(self, need: int, current: int) -> int:
        """Slots a layer allocates when it needs ``need`` and holds ``current``.

        A budgeted cache needs at most ``budget + slack + 1`` slots after its prefill (the budget, the dead slots,
        the step's new token), so that is allocated once and a compaction shrinks back to it after a longer
        prompt. The full cache allocates for the whole decode when ``last_step`` is known (like a static cache),
        and otherwise grows by half its size, so appends stay amortised O(1).
        """
        if self.capacity is not None:
            return max(need, self.capacity)
        if self.policy.evicts:
            return max(need, self.budget + self.slack + 1)
        if current == 0 and self.last_step is not None:
            return need + self.last_step
        return max(need, current + current // 2)

    # -- accounting -------------------------------------------------------------------------------------------

    def bytes_per_slot(self) -> int:
        """KV bytes of one slot in one layer, all KV heads and the whole batch (keys + values)."""
        layer = self.layers[0]
        B, H, _, D = layer.keys.shape
        return 2 * B * H * D * layer.keys.element_size()
