"""Key-norm: keep the tokens with the smallest key norm."""

from dataclasses import dataclass

import torch
from torch import Tensor

from learnkv import kernels
from learnkv.features import fill_unknown_norms, token_norms
from learnkv.policies.base import LayerView, Policy

#: each slot's key norm, per-token state: -1 until a score computes it (`fill_unknown_norms`); on the kernel path
#: computed by the update that appends the slot
KEY_NORM = "knorm.key_norm"
#: key elements of a layer's view from which a CPU score looks its norms up rather than computing them all: finding
#: the unknown ones costs ~9 small operators (~50 us), reading 128k fp32 keys (512 KB) about as long. On a GPU the
#: lookup would synchronise the host once per layer: there the update computes the new slots' norms instead
CACHE_FROM = 1 << 17


@dataclass
class KeyNorm(Policy):
    """Key L2 norm (Devoto et al., https://arxiv.org/abs/2406.11430; kvpress's KnormPress).

    A low key norm correlates with high attention, so score = -||k|| (keys as cached, after RoPE). Needs no
    attention at all. A key never changes in the cache, so its norm is computed once and kept as per-token state:
    on the torch path at the first score that sees it (``update`` marks the new slots unknown; it sees no keys when
    the cache hands it every layer's rows at once), where that pays (`CACHE_FROM`); on the kernel path by the update
    that appends it. An eviction reads the new keys only, not the whole cache (at batch 8 and 1.5k tokens, every key
    of every layer at every step was ~15% of the step's bytes).
    Compared across heads and layers (``allocation=head|global``) its scores are ``rank``
    (`learnkv.allocation.normalisation_for`): key norms share no scale across heads, so rank percentiles within the
    head.
    """

    name = "knorm"
    needs_attention = False
    rowwise = True  # each token's score from its own key
    reads_layer = True

    def update(self, view: LayerView) -> None:
        norms = view.state.get(KEY_NORM)
        if view.keys is not None and kernels.use_triton(view.keys):
            # the kernel path (a GPU's) never stacks layers (`BudgetCache`), so every update sees the keys it appends:
            # their norms now, and a score reads every slot's with no lookup (2026-11-30 H200: recomputing them all
            # cost key norm 0.33-0.72x of the full cache's step at batch 64-128, 32k tokens; bench/RESULTS.md)
            if norms is None:
                view.state[KEY_NORM] = token_norms(view.keys)
            elif view.n_new:
                norms[..., -view.n_new :] = token_norms(view.keys[..., -view.n_new :, :])
            return
        if norms is None:  # the state starts here: every slot is new
            view.state[KEY_NORM] = torch.full(view.positions.shape, -1.0, device=view.positions.device)
        elif view.n_new:
            norms[..., -view.n_new :] = -1.0

    def score(self, view: LayerView) -> Tensor:
        norms, keys = view.state.get(KEY_NORM), view.keys
        if norms is not None and kernels.use_triton(keys):  # every slot's norm computed at its update
            return -norms
        if norms is None or keys.device.type != "cpu" or keys.numel() < CACHE_FROM:  # (None: update never ran)
            return -token_norms(keys)
        return -fill_unknown_norms(norms, keys)
