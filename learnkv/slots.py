"""Slot storage of the budgeted cache: one decoder layer's keys, values, slot positions and packed policy state.

A `BudgetLayer` stores; it does not decide. `learnkv.cache.BudgetCache` decides which slots each row keeps (scores ->
kept slots) and then has its layers compact to them (`BudgetLayer.keep_slots`) or marks the others dead in place
(`kernels.reference.mark_dead`). `link_layers` makes every layer's positions and state rows of one buffer each, so
that one op updates or marks the whole model (the cache's stacked decode steps).
"""

from __future__ import annotations

import math
import weakref
from typing import Protocol

import torch
from torch import Tensor
from transformers.cache_utils import DynamicLayer

from learnkv import kernels
from learnkv.kernels.cpu import move_slot_run, slot_runs

#: every layer's slot positions ``[L, B, H, C]`` and packed state ``{dtype: [L, B, H, S, C]}``, stacked
Link = tuple[Tensor, dict[torch.dtype, Tensor]]
#: the most runs of slots a moved row and KV head shifts in place (`kernels.cpu.slot_runs`); with more, its keys and
#: values are gathered: a block eviction makes one a head, R-KV's ~128 tokens evicted along a row one a token, and
#: each run is a call from Python (at batch 16 and ~1.3k slots, a row's gather cost what ~100 runs did)
RUNS_IN_PLACE = 8


class SlotOwner(Protocol):
    """What a layer reads from the cache that owns it (`learnkv.cache.BudgetCache`)."""

    step_positions: Tensor | None  # [B, q] positions of the forward pass's tokens (-1: padding)
    step_valid: list[int]  # per row: its non-padding tokens in the forward pass
    windows: dict[int, int | None]  # per layer: its sliding window (None: full attention)
    workspace: Workspace  # scratch memory of its layers' compactions

    def slots_to_allocate(self, need: int, current: int, window: int | None = None) -> int: ...


def _channel_view(packed: Tensor, first: int, extra: tuple[int, ...], axis: int) -> Tensor:
    """One state entry's view of a packed buffer whose channel axis is ``axis``: channel ``first``, or the
    ``prod(extra)`` channels from it, shaped ``extra``."""
    if not extra:
        return packed.select(axis, first)
    return packed.narrow(axis, first, math.prod(extra)).unflatten(axis, extra)


class BudgetLayer(DynamicLayer):
    """One decoder layer's keys/values plus slot positions and policy state.

    Keys, values, positions and policy state live in buffers preallocated along the slot axis, so a decode step
    writes its one new slot instead of concatenating the whole cache (`DynamicLayer` does that, copying every slot
    every step); ``keys``, ``values``, ``positions`` and each ``state`` entry are views of the first ``n_slots``.
    The state entries share one buffer per dtype, ``[B, H, S, C]`` (each entry a run of its ``S`` channels), so a
    compaction gathers every entry in one op, not one op each (the learned policy's tracker keeps ten entries). A
    policy that updates its state in place keeps the views; one that rebinds an entry to a new tensor has it copied
    back into its channels at the next append or compaction (one copy, what a concatenation cost).

    ``live`` counts each row's live tokens (position >= 0), on the host, so deciding whether a row is over its
    budget needs no device synchronisation. Evicted slots are compacted away at once, or, with the cache's
    ``slack``, marked dead (position -1, masked exactly like padding) and compacted only once more than ``slack``
    slots are dead in every row. Either way the live slots keep their original order.
    """

    def __init__(self, layer_idx: int, owner: SlotOwner):
        super().__init__()
        self.layer_idx = layer_idx
        # a weak reference: the cache holds its layers, so a strong one back would make a cycle that only the garbage
        # collector frees, and a decode's KV (GBs on a GPU) would outlive it until a collection
        self.owner = weakref.proxy(owner)
        self.positions: Tensor | None = None  # [B, H, T] int64, -1 = padding or a dead slot
        self.state: dict[str, Tensor] = {}
        self.n_new = 0
        self.live: list[int] = []  # per row: live tokens, the same in every KV head of the row (else the widest's)
        self.heads_alike = True  # whether every KV head of a row holds ``live`` tokens (False once a count found not)
        # per row: live slots summed over the KV heads, once the cache's allocation gave heads different counts
        # (``head``, ``global``); None while every head holds ``live`` (see `live_slots`)
        self.live_heads: list[int] | None = None
        self._buffers: tuple[Tensor, Tensor, Tensor] | None = None  # keys, values [B, H, C, D]; positions [B, H, C]
        self._packed: dict[torch.dtype, Tensor] = {}  # [B, H, S, C] per dtype: every state entry's channels
        self._layout: dict[str, tuple[torch.dtype, int, tuple[int, ...]]] = {}  # entry -> dtype, first channel, shape
        self._channels: dict[str, Tensor] = {}  # entry -> its [B, H, ..., C] view of the packed buffer

    @property
    def n_slots(self) -> int:
        return 0 if self.positions is None else self.positions.shape[-1]

    @property
    def n_dead(self) -> int:
        """Slots no row uses (dead in every row: what a compaction would free)."""
        return self.n_slots - max(self.live, default=0)

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
            self._allocate(self.owner.slots_to_allocate(n + q, self.capacity), key_states, value_states, n)
        kb, vb, pb = self._buffers
        kb[:, :, n : n + q] = key_states
        vb[:, :, n : n + q] = value_states
        pb[:, :, n : n + q] = new_pos.to(pb.device)[:, None, :]
        self._view(n + q)
        self._append_state(n, q)
        self.n_new = q
        self.live = [live + new for live, new in zip(self.live or [0] * B, self.owner.step_valid)]
        if self.live_heads is not None:
            self.live_heads = [live + H * new for live, new in zip(self.live_heads, self.owner.step_valid)]
        return self.keys, self.values

    def live_slots(self) -> list[int]:
        """Per row: live slots summed over the KV heads (what a paged per-head layout holds)."""
        if self.live_heads is not None:
            return list(self.live_heads)
        heads = 0 if self.positions is None else self.positions.shape[1]
        return [heads * live for live in self.live]

    def _allocate(self, capacity: int, keys: Tensor, values: Tensor, n_copy: int) -> None:
        """New buffers of ``capacity`` slots holding the first ``n_copy`` current slots (keys and values may differ in
        width: MLA caches a latent and its rotary part)."""
        B, H = keys.shape[:2]
        kb = keys.new_empty(B, H, capacity, keys.shape[-1])
        vb = values.new_empty(B, H, capacity, values.shape[-1])
        pb = torch.empty((B, H, capacity), dtype=torch.long, device=keys.device)  # slots past n_slots are never read
        if n_copy:
            kb[:, :, :n_copy] = self.keys
            vb[:, :, :n_copy] = self.values
            pb[:, :, :n_copy] = self.positions
        self._buffers = (kb, vb, pb)

    def _append_state(self, n: int, q: int) -> None:
        """Grow every state entry by ``q`` zero slots, in place where the entry is still a view of its channels.

        The packed buffers are zero past the slots in use (allocated so, and a view ``[..., :n]`` cannot write past
        them), so growing a view into its channels writes nothing: a decode step costs no op per state entry."""
        if not self.state:
            return
        self._pack_state(n, n + q)
        for name, full in self._channels.items():
            self.state[name] = full[..., : n + q]

    def _pack_state(self, n: int, need: int) -> None:
        """Make every state entry (``n`` slots) live in the packed buffers, with room for ``need`` slots: copy the
        entries the policy rebound into their channels, or lay the buffers out anew when the entries' names, shapes
        or dtypes changed or they are out of room."""
        state, channels = self.state, self._channels
        same = state.keys() == channels.keys() and all(
            t.dtype == channels[k].dtype and t.shape[:-1] == channels[k].shape[:-1] for k, t in state.items()
        )
        if same and next(iter(self._packed.values())).shape[-1] >= need:
            for name, t in state.items():
                full = channels[name]
                if t.data_ptr() != full.data_ptr() or t.stride() != full.stride():
                    full[..., :n] = t  # rebound by the policy; past n the channels are still zero
            return
        self._layout, widths = {}, {}
        for name, t in state.items():
            extra = tuple(t.shape[2:-1])
            self._layout[name] = (t.dtype, widths.get(t.dtype, 0), extra)
            widths[t.dtype] = widths.get(t.dtype, 0) + math.prod(extra)
        B, H = next(iter(state.values())).shape[:2]
        device = next(iter(state.values())).device
        self._packed = {dtype: torch.zeros((B, H, width, max(self.capacity, need)), dtype=dtype, device=device)
                        for dtype, width in widths.items()}  # fmt: skip
        self._view_channels()
        for name, t in state.items():
            self._channels[name][..., :n] = t

    def _view_channels(self) -> None:
        """Each entry's whole-capacity view of its channels in the packed buffers (per `_layout`)."""
        self._channels = {}
        for name, (dtype, first, extra) in self._layout.items():
            self._channels[name] = _channel_view(self._packed[dtype], first, extra, 2)

    def state_buffers(self) -> dict[str, Tensor]:
        """Each state entry's whole-capacity view of the packed buffers (tests check they are zero past the slots
        in use)."""
        return dict(self._channels)

    def _view(self, n: int) -> None:
        kb, vb, pb = self._buffers
        self.keys, self.values, self.positions = kb[:, :, :n], vb[:, :, :n], pb[:, :, :n]

    def drop_state(self) -> None:
        """Forget the policy state (the prefill policy's, once the decode policy takes over)."""
        self.state, self._packed, self._layout, self._channels = {}, {}, {}, {}

    def count_live(self) -> list[int]:
        """Live tokens per row, counted on the device (a synchronisation; block evictions only): the widest KV
        head's; ``heads_alike`` says whether every head holds as many."""
        counts = (self.positions >= 0).sum(-1)
        widest, narrowest = torch.stack([counts.amax(-1), counts.amin(-1)]).tolist()
        self.heads_alike = widest == narrowest
        return widest

    def keep_slots(self, index: Tensor) -> None:
        """Compact keys, values, positions and state to the slots ``index [B, H, K]`` (ascending; a -1 entry becomes a
        dead slot with zero state, like left padding). At the layer's width (``K`` = ``n_slots``) only the rows
        whose slots change move (`_keep_moved_rows`)."""
        K = index.shape[-1]
        if self.state:
            self._pack_state(self.n_slots, self.n_slots)  # entries the policy rebound this step, into their channels
        if K == self.n_slots and self._keep_moved_rows(index):
            return
        old = self._buffers
        filler = index < 0
        C = self.owner.slots_to_allocate(K, 0, self.owner.windows.get(self.layer_idx))
        # keys and values are gathered into fresh buffers (in place, one program's writes would overwrite slots
        # another still reads), sized for the steady state, so a long prompt compressed to the budget gives its
        # memory back. The index runs on past K with slot 0 to the C slots of a buffer, so the gather's output *is*
        # the new buffer: each kept slot is read once and written once (slots past K are never read as keys, values
        # or positions). The old buffers are freed (on CUDA, to the caching allocator's pool; on a CPU to the heap,
        # where the next compaction's buffers find them). Positions and state stay in their buffers where
        # `_state_in_place`
        index = index.clamp(min=0)
        padded = torch.cat([index, index.new_zeros(*index.shape[:2], C - K)], dim=-1) if C > K else index
        in_place = self._state_in_place(C)
        keys, values = (kernels.gather_tokens(src, padded, -2) for src in old[:2])  # from the whole buffers
        if in_place:
            _gather_in_place(old[2], index, -1, self.owner.workspace)
        self._buffers = (keys, values, old[2] if in_place else kernels.gather_tokens(old[2], padded, -1))
        self._view(K)
        # the filler entries lie in the first F slots (a synchronisation, only when compacting; -1 sorts first in an
        # ascending index): F is a few slots where a fill over all K would rewrite every channel of the state
        # (SnapKV's 80 window rows: ~6 MB a layer at batch 8 and ~800 slots)
        F = _filled_prefix(filler)
        filler = filler[..., :F]
        if F:
            self.positions[..., :F].masked_fill_(filler, -1)
        if not self.state:
            return
        for dtype, buf in self._packed.items():  # every entry of a dtype at once
            if in_place:
                _gather_in_place(buf, index, -1, self.owner.workspace)
            else:
                buf = self._packed[dtype] = kernels.gather_tokens(buf, padded, -1)
            buf[..., K:] = 0  # zero past the slots in use, as `_append_state` expects
            if F:  # zero, as the state of a padding slot that was never attended
                buf[..., :F].masked_fill_(filler[:, :, None, :], 0)
        if not in_place:
            self._view_channels()
        for name, full in self._channels.items():
            self.state[name] = full[..., :K]

    def _keep_moved_rows(self, index: Tensor) -> bool:
        """`keep_slots` at the layer's width (``index [B, H, n_slots]``): a cache whose slots stay dense compacts at
        every eviction, also where only some rows evict (rows reach their budgets at different steps). The other
        rows' index keeps each live slot where it is, so only the rows that move are gathered, in place; the same
        live slots, positions and state as a whole compaction, which would rewrite every row (~1 GB of K and V at
        batch 16 and ~1.3k slots over 30 layers, at each row's eviction). Returns False, having done nothing, where
        every row moves (then the whole compaction is no dearer)."""
        # the layer's own positions and state as a link of one layer
        link = (self._buffers[2][None], {dtype: buf[None] for dtype, buf in self._packed.items()})
        return keep_moved_rows_of_layers([self], index, link)

    def _move_keys_values(self, row: int, slots: Tensor, first: int) -> None:
        """Into the slots from ``first`` of row ``row``, its slots ``slots [H, W]`` (the Triton path's move, and the
        fallback where `kernels.cpu.slot_runs` finds none): gathered as whole slots (`kernels.gather_tokens`, one
        contiguous read a slot, where advanced indexing read one index an element at twice the time) into the
        owner's workspace, then copied back."""
        for buf in self._buffers[:2]:  # [B, H, C, D]
            one = buf.narrow(0, row, 1)
            shape = [1, *slots.shape, buf.shape[-1]]
            kept = kernels.gather_tokens(one, slots[None], -2, out=self.owner.workspace(shape, buf.dtype, buf.device))
            one.narrow(2, first, slots.shape[-1]).copy_(kept)

    def _state_in_place(self, capacity: int) -> bool:
        """Whether a compaction to ``capacity`` slots keeps the positions and state in their buffers (gathered
        through the owner's `Workspace`, then copied back): on a CPU, at the capacity they have. There the stacked
        decode step's view of every layer's positions and state (`link_layers`) stays valid, where fresh buffers
        would be stacked anew (the learned policy's state, ~36 fp32 channels a slot, is ~85 MB at batch 8 and 800
        slots over 30 layers: a copy, and fresh pages from the system, a page fault each, at every compaction). On
        CUDA the stack is one copy from the caching allocator's pool, cheaper than the copy back."""
        return capacity == self.capacity and self._buffers[2].device.type == "cpu"


class Workspace:
    """Scratch memory reused across calls: one flat buffer per dtype and device, grown when a call needs more. A
    cache's compactions gather into it (`BudgetLayer.keep_slots`); what it returns is valid until the next call."""

    def __init__(self):
        self._flat: dict[tuple[torch.dtype, torch.device], Tensor] = {}

    def __call__(self, shape: list[int], dtype: torch.dtype, device: torch.device) -> Tensor:
        n = math.prod(shape)
        flat = self._flat.get((dtype, device))
        if flat is None or flat.numel() < n:
            flat = self._flat[(dtype, device)] = torch.empty(n, dtype=dtype, device=device)
        return flat[:n].view(shape)


def _move_state(buf: Tensor, moved: Tensor, rows: Tensor, first: int) -> None:
    """Into the slots from ``first`` of the rows ``moved`` of a packed state buffer ``buf [B, H, S, C]``, every
    channel of their slots ``rows [len(moved), H, W]`` (a -1 entry: zero, as a padding slot's state)."""
    filler, rows = rows < 0, rows.clamp(min=0)
    kept = buf.index_select(0, moved).gather(-1, rows[:, :, None, :].expand(-1, -1, buf.shape[2], -1))
    buf.narrow(3, first, rows.shape[-1]).index_copy_(0, moved, kept.masked_fill_(filler[:, :, None, :], 0))


def keep_moved_rows_of_layers(layers: list[BudgetLayer], index: Tensor, link: Link,
                              rows: list[int] | None = None) -> bool:
    """`BudgetLayer._keep_moved_rows` of layers whose positions and state are linked (``link``, `link_layers`), for
    their kept slots ``index [L * B, H, n_slots]`` (layer-major): the positions and state of every layer's moved
    rows at once, then each layer's keys and values (on the CPU shifted in place, one memmove a run of slots,
    `kernels.cpu.move_slot_run`; else gathered, `BudgetLayer._move_keys_values`). The same slots and state as layer
    by layer, in a few ops where each layer's took ~20 (a row's block eviction in a 30-layer model); gathered where
    a row and head would take more than `RUNS_IN_PLACE` runs. With ``rows``
    (layer-major), ``index`` is of those rows alone and every other row keeps its slots where they lie: the others
    are neither listed nor compared (at batch 16 and ~1.3k slots over 30 layers, listing and comparing every row
    cost ~15 ms an eviction). Returns False, having done nothing, where every row of every layer moves."""
    B, n = layers[0].positions.shape[0], layers[0].n_slots
    positions = link[0][..., :n].flatten(0, 1)
    compared = None if rows is None else torch.tensor(rows, dtype=torch.long, device=positions.device)
    held = positions if compared is None else positions.index_select(0, compared)
    kept = held.gather(-1, index.clamp(min=0)).masked_fill_(index < 0, -1)
    # a row moves where a slot would hold another token or turn dead (live positions are unique within a row)
    changed = (kept != held).any(1)  # [rows, n]
    moved_of = changed.any(1).nonzero().flatten()  # of the rows compared
    moved = moved_of if compared is None else compared[moved_of]
    if len(moved) == positions.shape[0]:  # one synchronisation, as the whole compaction's own
        return False
    if len(moved) == 0:
        return True
    positions.index_copy_(0, moved, kept.index_select(0, moved_of))
    # the slots before the first that changes and from the one after the last hold what they held: a block
    # evicted halfway along a row (live slots at its right) moves the first half alone
    first, last = changed.any(0).nonzero()[[0, -1], 0].tolist()
    slots = index.index_select(0, moved_of)[..., first : last + 1]
    for buf in link[1].values():  # [L, B, H, S, C]
        _move_state(buf.flatten(0, 1), moved, slots, first)
    moved = moved.tolist()  # layer-major: row r is row r % B of layer r // B
    most = RUNS_IN_PLACE * slots.shape[0] * slots.shape[1]
    runs = slot_runs(slots, first, most) if _in_place(layers) else None
    if runs is not None:  # each run's keys and values shifted in place
        for j, head, dest, length, shift in runs:
            for buf in layers[moved[j] // B]._buffers[:2]:
                move_slot_run(buf, moved[j] % B, head, dest, length, shift)
        return True
    slots = slots.clamp(min=0)
    for j, row in enumerate(moved):
        layers[row // B]._move_keys_values(row % B, slots[j], first)
    return True


def _in_place(layers: list[BudgetLayer]) -> bool:
    """Whether the moved rows' keys and values of ``layers`` shift in place (`kernels.cpu.move_slot_run`: contiguous
    CPU buffers on the torch path), rather than through `BudgetLayer._move_keys_values`."""
    return all(not kernels.use_triton(buf) and buf.device.type == "cpu" and buf.is_contiguous()
               for layer in layers for buf in layer._buffers[:2])


def _filled_prefix(filler: Tensor) -> int:
    """How many leading slots of ``filler [B, H, K]`` hold every True: one past the last slot any row marks (0 if
    none). Where the index is ascending that is the most fillers a row has; computed from the columns, not assumed."""
    columns = filler.flatten(0, -2).any(0).nonzero()
    return int(columns[-1]) + 1 if len(columns) else 0


def _gather_in_place(buf: Tensor, index: Tensor, dim: int, workspace: Workspace) -> None:
    """``buf``'s slots ``index [B, H, K]`` along its token axis ``dim`` into its own first ``K`` slots, through
    ``workspace`` (a gather straight into ``buf`` could write a slot before another thread of it read that slot)."""
    shape = list(buf.shape)
    shape[dim] = index.shape[-1]
    kept = kernels.gather_tokens(buf, index, dim, out=workspace(shape, buf.dtype, buf.device))
    buf.narrow(dim, 0, index.shape[-1]).copy_(kept)


def link_layers(layers: list[BudgetLayer], link: Link | None) -> tuple[Link, Tensor, dict[str, Tensor]] | None:
    """The stacked positions ``[L * B, H, T]`` and state entries of ``layers``, views of one buffer each that
    every layer's own positions and state are views of too (so a policy's in-place updates and the marking of
    dead slots write through), with the stacked buffers (``link``: the last call's, reused while every layer
    still holds views of it). The buffers are stacked once, and again only after a compaction or reallocation
    gave a layer fresh ones. None when the layers do not hold the same slots, live tokens and state layout."""
    first = layers[0]
    n, pos_shape = first.n_slots, first._buffers[2].shape
    if any(layer.n_slots != n or layer.live != first.live or layer._buffers[2].shape != pos_shape
           or layer._layout != first._layout or layer.state.keys() != first._layout.keys() for layer in layers):
        return None
    linked = link is not None and link[0].shape[1:] == pos_shape and all(
        layer._buffers[2].data_ptr() == link[0][i].data_ptr()
        and layer._packed.keys() == link[1].keys()
        and all(t.data_ptr() == link[1][d][i].data_ptr() and t.shape == link[1][d].shape[1:]
                for d, t in layer._packed.items())
        for i, layer in enumerate(layers))  # fmt: skip
    if not linked:
        if any({d: t.shape for d, t in layer._packed.items()} != {d: t.shape for d, t in first._packed.items()}
               for layer in layers):
            return None
        link = (torch.stack([layer._buffers[2] for layer in layers]),
                              {d: torch.stack([layer._packed[d] for layer in layers]) for d in first._packed})
        for i, layer in enumerate(layers):
            keys, values, _ = layer._buffers
            layer._buffers = (keys, values, link[0][i])
            layer._view(n)
            layer._packed = {d: t[i] for d, t in link[1].items()}
            layer._view_channels()
            for name, full in layer._channels.items():
                layer.state[name] = full[..., :n]
    positions = link[0][..., :n].flatten(0, 1)
    state = {name: _channel_view(link[1][dtype], c0, extra, 3)[..., :n].flatten(0, 1)  # from [L, B, H, S, C]
             for name, (dtype, c0, extra) in first._layout.items()}
    return link, positions, state
