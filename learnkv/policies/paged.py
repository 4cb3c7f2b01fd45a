"""PagedEviction: block-wise eviction by ||V|| / ||K|| that fits a paged cache."""

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from learnkv import kernels
from learnkv.features import stacked, token_norms
from learnkv.policies.base import LayerView, Policy, reduce_heads
from learnkv.fields import setting

#: each slot's ||V|| / ||K|| per KV head, per-token state on the torch path: a token's keys and values never change in
#: the cache, so the update computes the ratio of the slots it appends and an eviction reads no key or value
RATIO = "paged.ratio"


@dataclass
class PagedEviction(Policy):
    """PagedEviction (Chitty-Venkata et al., https://arxiv.org/abs/2509.04377; github.com/krishnateja95/PagedEviction).

    Token score S = ||V|| / ||K|| (the paper's formula; its vLLM fork computes the swapped ratio), averaged
    over the KV heads of the layer so a whole block is freed for every head. At prefill the lowest-S tokens are
    dropped one by one; during decoding the cache is paged into blocks of ``block_size`` slots and, whenever
    the newest block starts past the budget, the full block with the lowest mean S is evicted. Block 0 (the
    first ``block_size`` tokens) is kept as a sink and the newest block (partly filled or just filled) is never
    evicted, as in the HF prototype, which always keeps the last page, so the
    cache holds between ``budget - block_size + 1`` and ``budget`` tokens once full.
    Its scores would be ``rank`` across heads and layers (`learnkv.allocation.normalisation_for`), but as a block policy
    it runs ``allocation=uniform`` only.

    Parameters
    ----------
    block_size : int
        Page size, 16 in the paper.
    n_sink : int or None
        Protected first tokens; None means one block.
    """

    name = "paged"
    needs_attention = False
    rowwise = True  # each row from its own keys and values
    reads_layer = True
    block_size: int = setting(16, ge=1)
    n_sink: int | float | None = setting(None, ge=0, fraction=True)
    # protects the newest token, hence its block even when that block is full
    n_recent: int | float = setting(1, ge=0, fraction=True)

    def resolve_defaults(self, budget: int) -> dict:
        return {"n_sink": self.block_size if self.n_sink is None else self.n_sink}

    def block_size_at(self, step: int) -> int:
        return 1 if step == 0 else self.block_size

    def update(self, view: LayerView) -> None:
        # not on the kernel path, where the eviction's one fused pass over K and V costs fewer launches than this
        # update at every step (a GPU's small-model step is host-bound, bench/RESULTS.md "On an H100")
        if view.keys is not None and not kernels.use_triton(view.keys, view.values):
            self.update_layers(view, [view])

    def update_layers(self, view: LayerView, views: Sequence[LayerView]) -> None:
        # a padding slot's ratio is zero, as the state of a dead slot (`BudgetLayer.keep_slots`): the same state
        # whether or not a compaction moved its row
        ratio = view.state.get(RATIO)
        if ratio is None:  # the state starts here: every slot is new
            ratio = stacked([token_ratio(v.keys, v.values) for v in views])
            view.state[RATIO] = ratio.masked_fill_(view.positions < 0, 0.0)
        elif view.n_new:
            new = slice(-view.n_new, None)
            ratio[..., new] = token_ratio(*(stacked([x[..., new, :] for x in xs]) for xs in (
                [v.keys for v in views], [v.values for v in views]))).masked_fill_(view.positions[..., new] < 0, 0.0)

    def score(self, view: LayerView) -> Tensor:
        if kernels.use_triton(view.keys, view.values):
            # one fused pass over K and V (`kernels.block_scores` with blocks of one slot = the head-averaged token
            # score); the cache's selection then averages whole blocks, over non-padding slots, as on the torch path
            B, H, T, _ = view.keys.shape
            return kernels.block_scores(view.keys, view.values, 1)[:, None].expand(B, H, T)
        ratio = view.state.get(RATIO)
        return reduce_heads(token_ratio(view.keys, view.values) if ratio is None else ratio)

    def score_layers(self, view: LayerView, views: Sequence[LayerView]) -> Tensor:
        # with the ratios as state (the torch path, where the cache stacks layers), every layer's rows at once
        ratio = view.state.get(RATIO)
        return super().score_layers(view, views) if ratio is None else reduce_heads(ratio)


def token_ratio(keys: Tensor, values: Tensor) -> Tensor:
    """``[..., T, D]`` keys and values -> ``[..., T]``: each token's fp32 ||V|| / ||K|| (PagedEviction's token score
    before the mean over KV heads)."""
    return token_norms(values) / token_norms(keys).clamp(min=1e-6)
