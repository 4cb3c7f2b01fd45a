"""Random eviction: the floor every policy must beat."""

from dataclasses import dataclass

import torch
from torch import Tensor

from learnkv.policies.base import LayerView, Policy
from learnkv.fields import setting

_MASK32 = 0xFFFFFFFF


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds) on int64 tensors holding values below 2**32.

    The multipliers are below 2**31, so no product leaves int64's range and the result is the same on every device.
    """
    x = x & _MASK32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    return x ^ (x >> 16)


@dataclass
class RandomEviction(Policy):
    """Evicts uniformly random tokens (EasyKV's ``random``), seeded so runs repeat.

    A token's score is a hash of (seed, layer, decode step, KV head, token position): a fresh uniform draw for
    each token at each step, but a function of the token, not of its slot or row. So a row draws the same in a batch
    as alone, and the same whatever the slack leaves dead around it (a generator's stream would depend on both).
    Compared across heads and layers (``allocation=head|global``) its scores are ``rank``
    (`learnkv.allocation.normalisation_for`).

    Parameters
    ----------
    seed : int
        Seed of the draws.
    """

    name = "random"
    needs_attention = False
    seed: int = setting(0, ge=0)

    def score(self, view: LayerView) -> Tensor:
        key = _mix32(torch.tensor(self.seed, dtype=torch.int64))
        key = _mix32(key ^ view.layer)
        key = _mix32(key ^ view.step).to(view.positions.device)
        heads = torch.arange(view.positions.shape[1], device=view.positions.device)[None, :, None]
        bits = _mix32(_mix32(key ^ heads) ^ view.positions.clamp(min=0))
        return bits.to(torch.float64).div(2.0**32).to(torch.float32)
