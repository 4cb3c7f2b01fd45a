"""The bytes and FLOPs a piece of torch code moves, op by op: what bounds a memory-bound step (issue 43).

    with OpTraffic() as traffic:
        with traffic.bucket("eviction"):
            ...
    total(traffic.by_op["eviction"].values())  # Traffic(ops, read, written, flops)

Every aten op that runs in the block, its composite ops decomposed (so the kernels a CPU or a GPU launches), is
counted in the current bucket, by op: one op, the bytes its tensor arguments span (read) and those its results span
(written), and its FLOPs where torch's flop counter knows the op (matmuls, attention). The byte counts are the
tensors' extents, not a cache simulation: an expanded argument counts its distinct elements once, a gather reads its
result's elements and its index (not its whole source), a scatter into a tensor in place writes what it scatters
(not the whole tensor), a copy or a fill into a tensor does not read it, and an op that only makes a view or an
uninitialised tensor is no op. A tensor read by two ops counts twice, as a step that is bound by memory reads it
twice once it is larger than the caches.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten
#: read where they gather: their result's elements and their index, not their whole source
GATHERS = {aten.gather, aten.index_select, aten.index, aten.take, aten.embedding}
#: write into their first argument, in place, only what they scatter (as many elements as their largest other argument)
SCATTERS = {aten.scatter_, aten.scatter_add_, aten.scatter_reduce_, aten.index_put_, aten.index_copy_,
            aten.index_fill_, aten.index_add_, aten.put_}  # fmt: skip
#: write their first argument without reading it
WRITE_ONLY = {aten.copy_, aten.fill_, aten.zero_, aten.uniform_, aten.normal_, aten.random_, aten.bernoulli_,
              aten.exponential_}  # fmt: skip
#: make a tensor without writing its elements, or a view that its schema does not call one
NO_TRAFFIC = {aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided, aten.resize_,
              aten.set_, aten._unsafe_view}  # fmt: skip


@dataclass
class Traffic:
    """What some ops moved: how many, their bytes read and written, their FLOPs."""

    ops: int = 0
    read: int = 0  # bytes
    written: int = 0  # bytes
    flops: int = 0

    def add(self, other: Traffic) -> None:
        self.ops += other.ops
        self.read += other.read
        self.written += other.written
        self.flops += other.flops


def total(counts) -> Traffic:
    """The sum of some `Traffic` counts."""
    out = Traffic()
    for t in counts:
        out.add(t)
    return out


def spanned_bytes(t: torch.Tensor) -> int:
    """The bytes of ``t``'s distinct elements: a dimension of stride 0 (an expanded one) counts once."""
    return math.prod(n for n, s in zip(t.shape, t.stride()) if s != 0) * t.element_size()


def op_traffic(func, args, kwargs, out) -> Traffic:
    """What one aten op moved (see the module's docstring)."""
    packet = func.overloadpacket
    if func.is_view or packet in NO_TRAFFIC:
        return Traffic()  # no kernel runs
    out_arg = kwargs.get("out")
    inputs = [t for t in pytree.tree_leaves((args, {k: v for k, v in kwargs.items() if k != "out"}))
              if isinstance(t, torch.Tensor)]  # fmt: skip
    results = [t for t in pytree.tree_leaves(out if out_arg is None else out_arg) if isinstance(t, torch.Tensor)]
    if packet in GATHERS:
        read = sum(spanned_bytes(t) for t in inputs[1:]) + sum(spanned_bytes(t) for t in results)
        written = sum(spanned_bytes(t) for t in results)
    elif packet in SCATTERS:
        read = sum(spanned_bytes(t) for t in inputs[1:])
        written = max((t.numel() for t in inputs[1:]), default=0) * inputs[0].element_size()
    else:
        read = sum(spanned_bytes(t) for t in (inputs[1:] if packet in WRITE_ONLY else inputs))
        written = sum(spanned_bytes(t) for t in results)
    flops = flop_registry[packet](*args, **kwargs, out_val=out) if packet in flop_registry else 0
    return Traffic(1, read, written, int(flops))


class OpTraffic(TorchDispatchMode):
    """Counts every aten op run under it into ``by_op[bucket][op name]`` (`Traffic`); `bucket` names the current
    bucket."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: dict[str, dict[str, Traffic]] = defaultdict(lambda: defaultdict(Traffic))
        self.current = "other"

    @contextlib.contextmanager
    def bucket(self, name: str):
        outer, self.current = self.current, name
        try:
            yield
        finally:
            self.current = outer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket not in flop_registry:  # a composite op (inference mode leaves them whole): its parts
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        moved = op_traffic(func, args, kwargs, out)
        self.by_op[self.current][str(func.overloadpacket).removeprefix("aten.")].add(moved)
        return out


def stream_rate(n_bytes: int = 1 << 27, repeats: int = 5) -> float:
    """This machine's rate for a streaming op (bytes/s): ``torch.add(a, b, out=c)`` over three float32 tensors of
    ``n_bytes`` each (larger than the caches), the best of ``repeats``."""
    a, b, c = (torch.ones(n_bytes // 4) for _ in range(3))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.add(a, b, out=c)
        best = min(best, time.perf_counter() - t0)
    return 3 * n_bytes / best
