"""BudgetCache: a transformers `Cache` that holds at most `budget` tokens per layer and KV head.

It owns every eviction invariant, for every policy: the cache never holds more than the budget at the end of
a step, sinks and the recent window survive, kept tokens stay in their original order, and the policy's
per-token state stays aligned with the keys and values. Policies only score; selection and compaction are
done here, once, through `kernels.select_keep` and `kernels.gather_tokens`.

Order within a step (for every layer): append the step's keys/values -> attention over the whole cache,
statistics handed to the policy (`learnkv.attention`) -> policy state update -> evict if due. So a step's
attention always sees the full pre-eviction cache, as in LazyEviction, EasyKV and kvpress.

Each slot carries its token's original position ([B, H, T], -1 for left padding). The attention mask is
built from these positions, never from slot indices, so eviction and padding need no 2D mask.
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
    """One decoder layer's keys/values plus slot positions and policy state."""

    def __init__(self, layer_idx: int, owner: "BudgetCache"):
        super().__init__()
        self.layer_idx = layer_idx
        self.owner = owner
        self.positions: Tensor | None = None  # [B, H, T] int64, -1 = padding
        self.state: dict[str, Tensor] = {}
        self.n_new = 0

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        B, H, q, _ = key_states.shape
        new_pos = self.owner.step_positions
        if new_pos is None or new_pos.shape != (B, q):
            raise RuntimeError("BudgetCache.begin_step(positions) must be called before each forward pass")
        new_pos = new_pos.to(keys.device)[:, None, :].expand(B, H, q)
        self.positions = new_pos.clone() if self.positions is None else torch.cat([self.positions, new_pos], -1)
        for name, t in self.state.items():
            self.state[name] = torch.cat([t, t.new_zeros(*t.shape[:-1], q)], dim=-1)
        self.n_new = q
        self.owner._attended(self.layer_idx, keys.shape[-2])
        return keys, values

    def keep_slots(self, index: Tensor) -> None:
        """Compact keys, values, positions and state to the slots ``index [B, H, K]`` (ascending)."""
        self.keys = kernels.gather_tokens(self.keys, index, dim=-2)
        self.values = kernels.gather_tokens(self.values, index, dim=-2)
        self.positions = kernels.gather_tokens(self.positions, index, dim=-1)
        self.state = {n: kernels.gather_tokens(t, index, dim=-1) for n, t in self.state.items()}


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
    """

    def __init__(self, num_layers: int, policy: Policy, budget: int | None, last_step: int | None = None,
                 shared_block: int | None = None):
        if policy.evicts and budget is None:
            raise ValueError(f"policy {policy.name!r} needs a budget")
        super().__init__(layers=[BudgetLayer(i, self) for i in range(num_layers)])
        self.policy = policy
        self.budget = budget
        # layer-shared block mode: one decision for every layer and KV head, in whole blocks (as a paged engine)
        self.shared_block = shared_block
        self._shared_scores: dict[int, Tensor] = {}
        self.last_step = last_step  # index of the last forward pass, if known (lets lagged policies keep more)
        self.keep = None  # slots kept if the cache evicts in the current step
        self.step = -1
        self.step_positions: Tensor | None = None
        # accounting
        self._attended_slots = [0] * num_layers
        self.peak_slots = 0  # max over steps of the sum over layers of slots each layer attended to
        self.max_kept = 0  # max over steps and layers of slots held after the step
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
        kept = [layer.get_seq_length() for layer in self.layers]
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
        )
        t0 = time.perf_counter()
        policy.update(view)
        T = layer.keys.shape[-2]
        if policy.evicts and T > self.keep and self.step % policy.interval == 0:
            scores = policy.score(view)
            if self.shared_block is not None:
                self._shared_scores[layer_idx] = scores  # decided in end_step, once every layer has scored
            else:
                index = kernels.select_keep(
                    scores, layer.positions, self.keep, policy.n_sink, policy.n_recent, policy.block_size_at(self.step)
                )
                layer.keep_slots(index)
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
        index = shared_keep_slots(scores, positions, self.keep, policy.n_sink, policy.n_recent, self.shared_block)
        for layer in self.layers:
            layer.keep_slots(index.expand(-1, layer.positions.shape[1], -1))
        self.eviction_s += time.perf_counter() - t0

    # -- accounting -------------------------------------------------------------------------------------------

    def bytes_per_slot(self) -> int:
        """KV bytes of one slot in one layer, all KV heads and the whole batch (keys + values)."""
        layer = self.layers[0]
        B, H, _, D = layer.keys.shape
        return 2 * B * H * D * layer.keys.element_size()
