"""The policy registry: one name per policy, used by the CLI, configs and result tables alike."""

from __future__ import annotations

import dataclasses

from learnkv.policies.base import LayerView, Policy
from learnkv.policies.full import FullCache
from learnkv.policies.h2o import H2O
from learnkv.policies.knorm import KeyNorm
from learnkv.policies.lazy import LazyEviction
from learnkv.policies.learned import Learned
from learnkv.policies.oracle import Oracle
from learnkv.policies.paged import PagedEviction
from learnkv.policies.random import RandomEviction
from learnkv.policies.rkv import RKV
from learnkv.policies.roco import RoCo
from learnkv.policies.snapkv import SnapKV
from learnkv.policies.streaming import StreamingLLM
from learnkv.policies.tova import TOVA

POLICIES: dict[str, type[Policy]] = {
    "full": FullCache,
    "streaming": StreamingLLM,
    "h2o": H2O,
    "tova": TOVA,
    "snapkv": SnapKV,
    "knorm": KeyNorm,
    "random": RandomEviction,
    "roco": RoCo,
    "lazy": LazyEviction,
    "paged": PagedEviction,
    "rkv": RKV,
    "oracle": Oracle,
    "learned": Learned,
}


def make_policy(name: str, **params) -> Policy:
    """Build a registered policy by name; unknown names and parameters raise a ValueError listing valid ones."""
    if isinstance(name, Policy):
        return dataclasses.replace(name, **params) if params else name
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r}; known policies: {', '.join(POLICIES)}")
    fields = {f.name for f in dataclasses.fields(cls) if f.init}  # not what it builds itself (`Learned.decoding`)
    unknown = sorted(set(params) - fields)
    if unknown:
        raise ValueError(f"policy {name!r} has no parameter {', '.join(unknown)}; its parameters: {', '.join(sorted(fields))}")
    if params and not cls.evicts:  # its windows and schedule exist (inherited) but never act: a row would mislead
        raise ValueError(f"policy {name!r} keeps every token, so a parameter has no effect on it: drop "
                         f"{', '.join(f'{k}={v}' for k, v in params.items())}")
    return cls(**params)


__all__ = ["POLICIES", "make_policy", "Policy", "LayerView"]
