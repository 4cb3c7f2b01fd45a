"""H2O: heavy hitters by accumulated attention, plus a recent window."""

from dataclasses import dataclass

import torch
from torch import Tensor

from learnkv import kernels
from learnkv.policies.base import LayerView, Policy
from learnkv.fields import setting


@dataclass
class H2O(Policy):
    """Heavy-Hitter Oracle (Zhang et al., https://arxiv.org/abs/2306.14048; github.com/FMInference/H2O).

    A token's score is the attention it has received, summed over every query that has seen it (the prompt's
    queries included), averaged over the query heads of its KV head. The budget is split between heavy hitters
    and a window of recent tokens; the paper's default is an even split.
    Compared across heads and layers (``allocation=head|global``) its scores are ``mass``
    (`learnkv.allocation.normalisation_for`): each head's divided by its live total.

    Parameters
    ----------
    n_recent : int or float
        Recent window, default half the budget.
    """

    name = "h2o"
    pooling = "mean_mass"  # accumulated attention: comparable across layers and heads
    rowwise = True  # each token's score is the attention it has received
    n_recent: int | float = setting(0.5, ge=0, fraction=True)

    def update(self, view: LayerView) -> None:
        acc = view.state.get("acc")
        if acc is not None and view.n_new == 1 and kernels.use_triton(acc, view.attn_sum):
            # a decode step on the kernel path: the fused in-place update (`kernels.update_token_state`)
            kernels.update_token_state(view.attn_sum, None, view.positions, view.step, 1, 0.0, acc=acc)
            return
        if acc is None:
            acc = torch.zeros(view.positions.shape, dtype=torch.float32, device=view.positions.device)
            view.state["acc"] = acc + view.attn_sum
        else:  # in place: the cache's buffer stays the state's (no copy at the next append)
            acc.add_(view.attn_sum)

    def score(self, view: LayerView) -> Tensor:
        return view.state["acc"].clone()  # the state is updated in place: the caller may keep the scores
