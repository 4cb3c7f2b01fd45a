"""Random eviction: the floor every policy must beat."""

from dataclasses import dataclass

import torch
from torch import Tensor

from learnkv.policies.base import LayerView, Policy
from learnkv.fields import setting


@dataclass
class RandomEviction(Policy):
    """Evicts uniformly random tokens (EasyKV's ``random``), seeded so runs repeat.

    Parameters
    ----------
    seed : int
        Seed of the policy's own generator.
    """

    name = "random"
    needs_attention = False
    seed: int = setting(0, ge=0)

    def score(self, view: LayerView) -> Tensor:
        gen = self.__dict__.get("_generator")
        if gen is None:  # created on first use so that copies made by `resolve` start from the seed
            gen = self.__dict__["_generator"] = torch.Generator().manual_seed(self.seed)
        return torch.rand(view.positions.shape, generator=gen).to(view.keys.device)
