"""Random eviction: the floor every policy must beat."""

from dataclasses import dataclass

import torch
from torch import Tensor

from learnkv.policies.base import LayerView, Policy
from learnkv.fields import setting

_MASK32 = 0xFFFFFFFF


def _mix32(x):
    """A 32-bit integer hash (xorshift-multiply rounds) on Python ints or int64 tensors holding values below 2**32.

    The multipliers are below 2**31, so no product leaves int64's range and the result is the same on every device
    (and for a Python int, the same as for a tensor holding it).
    """
    x = x & _MASK32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    return x ^ (x >> 16)


def _mix32_(x: Tensor) -> Tensor:
    """`_mix32` of an int64 tensor the caller owns, in place, with one scratch tensor where `_mix32` makes a fresh
    one per operator (at batch 16, 30 layers and ~1.3k slots: ~9 against ~15 ms a decode step, 2 threads)."""
    x.bitwise_and_(_MASK32)
    shifted = torch.empty_like(x)
    for _ in range(2):
        x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=shifted)).mul_(0x45D9F3B).bitwise_and_(_MASK32)
    return x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=shifted))


@dataclass
class RandomEviction(Policy):
    """Evicts uniformly random tokens (EasyKV's ``random``), seeded so runs repeat.

    A token's score is a hash of (seed, layer, decode step, KV head, token position): a fresh uniform draw for
    each token at each step, but a function of the token, not of its slot or row. So a row draws the same in a batch
    as alone, and the same whatever the slack leaves dead around it (a generator's stream would depend on both).
    Compared across heads and layers (``allocation=head|global``) its scores are ``rank``
    (`learnkv.allocation.normalisation_for`).

    Rowwise: the cache may hand it every layer's rows in one view (``LayerView.layers``); the hash of (seed, layer,
    step, head) is computed on the host, one per layer and head, so the tensor work is one hash of the positions for
    every layer at once, not ~70 small operators per layer (12% of a batch-8 decode at 1.5k tokens, bench/RESULTS.md).

    Parameters
    ----------
    seed : int
        Seed of the draws.
    """

    name = "random"
    needs_attention = False
    rowwise = True  # each token's draw is a function of its own layer, head and position
    seed: int = setting(0, ge=0)

    def score(self, view: LayerView) -> Tensor:
        layers = view.layers or (view.layer,)
        rows, heads = view.positions.shape[:2]
        step_keys = [_mix32(_mix32(_mix32(self.seed) ^ layer) ^ view.step) for layer in layers]
        head_keys = torch.tensor([[_mix32(k ^ h) for h in range(heads)] for k in step_keys],
                                 dtype=torch.int64, device=view.positions.device)  # [layers, H]
        head_keys = head_keys.repeat_interleave(rows // len(layers), dim=0)[:, :, None]  # layer-major rows
        bits = _mix32_(head_keys ^ view.positions.clamp(min=0))
        # bits < 2**32 round to float32 as their float64 quotient by 2**32 would (a power of two: only the scale)
        return bits.to(torch.float32).mul_(2.0**-32)
