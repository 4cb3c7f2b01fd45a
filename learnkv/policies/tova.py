"""TOVA: keep the tokens the current query attends to most."""

from dataclasses import dataclass

from torch import Tensor

from learnkv.policies.base import LayerView, Policy, reduce_heads


@dataclass
class TOVA(Policy):
    """Token Omission Via Attention (Oren et al., https://arxiv.org/abs/2401.06104; github.com/schwartz-lab-NLP/TOVA).

    A token's score is the attention of the latest query only, averaged over all heads of the layer, so every
    KV head of a layer keeps the same tokens (as in the paper and kvpress's TOVAPress). No recent window: the
    newest token competes like any other.
    Compared across heads and layers (``allocation=head|global``) its scores are ``mass``
    (`learnkv.allocation.normalisation_for`): each head's divided by its live total.
    """

    name = "tova"
    pooling = "mean_mass"  # the current query's attention: comparable across layers and heads
    rowwise = True  # each row from its own latest query

    def score(self, view: LayerView) -> Tensor:
        return reduce_heads(view.attn[:, :, -1, :])
