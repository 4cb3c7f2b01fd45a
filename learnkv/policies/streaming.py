"""StreamingLLM: attention sinks plus a sliding window of the most recent tokens."""

from dataclasses import dataclass

from torch import Tensor

from learnkv.policies.base import LayerView, Policy
from learnkv.fields import setting


@dataclass
class StreamingLLM(Policy):
    """StreamingLLM (Xiao et al., https://arxiv.org/abs/2309.17453; github.com/mit-han-lab/streaming-llm).

    Keeps the first ``n_sink`` tokens (attention sinks) and fills the rest of the budget with the most recent
    tokens. Positions are not re-rotated (as in kvpress's StreamingLLMPress).
    Compared across heads and layers (``allocation=head|global``) its scores are ``rank``
    (`learnkv.allocation.normalisation_for`): positions, as percentiles within the head.

    Parameters
    ----------
    n_sink : int
        Attention sinks, 4 as in the paper.
    """

    name = "streaming"
    needs_attention = False
    rowwise = True  # each token's score is its position
    n_sink: int | float = setting(4, ge=0, fraction=True)

    def score(self, view: LayerView) -> Tensor:
        return view.positions.float()  # newer is better; sinks are protected by the cache
