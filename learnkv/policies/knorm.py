"""Key-norm: keep the tokens with the smallest key norm."""

from dataclasses import dataclass

from torch import Tensor

from learnkv.policies.base import LayerView, Policy


@dataclass
class KeyNorm(Policy):
    """Key L2 norm (Devoto et al., https://arxiv.org/abs/2406.11430; kvpress's KnormPress).

    A low key norm correlates with high attention, so score = -||k|| (keys as cached, after RoPE). Needs no
    attention at all.
    Compared across heads and layers (``allocation=head|global``) its scores are ``rank``
    (`learnkv.allocation.normalisation_for`): key norms share no scale across heads, so rank percentiles within the
    head.
    """

    name = "knorm"
    needs_attention = False
    rowwise = True  # each token's score from its own key
    reads_layer = True

    def score(self, view: LayerView) -> Tensor:
        return -view.keys.float().norm(dim=-1)
