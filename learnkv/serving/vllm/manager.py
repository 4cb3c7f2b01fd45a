"""Tier B's block manager: `FullAttentionManager` plus "free these logical blocks of a running request".

Patched internal (subclassed, selected through ``KVCacheSpecRegistry.register_role_manager`` for the default
KV-cache group role, so vLLM itself is not modified), vLLM 0.32 and 0.33 (the same code in both):

- ``SingleTypeKVCacheManager.req_to_blocks[req_id][i]`` is overwritten with ``block_pool.null_block`` and the
  physical block goes back through ``block_pool.free_blocks``: the same move ``_remove_blocks_in_range`` makes for
  sliding windows, at arbitrary indices. The logical layout (block i <-> tokens [i*bs, (i+1)*bs)) and the list
  length stay, so ``get_num_blocks_to_allocate``, slot mapping and positions are untouched.
- ``cache_blocks`` is capped so no block written after the request's first eviction is published to the prefix
  cache (its KV was computed against a pruned context).
- ``pop_blocks_for_free`` drops null entries: stock code only trims a null *head*, and would otherwise hand the
  null block to ``free_blocks`` when the request ends.
"""

from __future__ import annotations

from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec


class EvictableFullAttentionManager(FullAttentionManager):
    """A full-attention manager whose requests can lose whole blocks mid-decode."""

    def __init__(self, kv_cache_spec, **kwargs):
        if type(kv_cache_spec) is not FullAttentionSpec:  # subclasses are sliding / chunked / sparse layouts
            raise RuntimeError(
                f"learnkv vLLM plugin: KV cache spec {type(kv_cache_spec).__name__} is not plain full attention "
                "(sliding-window, hybrid, MLA and quantised layouts are unsupported); unset LEARNKV_SCORER"
            )
        super().__init__(kv_cache_spec, **kwargs)
        self.publish_limit: dict[str, int] = {}  # request -> leading blocks that may still be published

    def evict_blocks(self, request_id: str, logical_blocks: list[int], cacheable_blocks: int) -> int:
        """Swap ``logical_blocks`` of ``request_id`` for the null block and free them; returns how many were freed."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:  # finished or preempted in the same step: nothing to free
            return 0
        self.publish_limit[request_id] = min(self.publish_limit.get(request_id, cacheable_blocks), cacheable_blocks)
        freed = []
        for i in sorted(logical_blocks):
            if i < len(blocks) and blocks[i] is not self._null_block:
                freed.append(blocks[i])
                blocks[i] = self._null_block
        if freed:
            self.block_pool.free_blocks(freed)
        return len(freed)

    def held_blocks(self, request_id: str) -> int:
        """Physical blocks ``request_id`` holds now (its null entries excluded)."""
        return sum(b is not self._null_block for b in self.req_to_blocks.get(request_id, ()))

    def cache_blocks(self, request, num_tokens, retention_interval=None, *, replay_boundaries):
        limit = self.publish_limit.get(request.request_id)
        if limit is not None:
            blocks = self.req_to_blocks[request.request_id]
            first_null = next((i for i, b in enumerate(blocks) if b is self._null_block), len(blocks))
            num_tokens = min(num_tokens, min(limit, first_null) * self.block_size)
        super().cache_blocks(request, num_tokens, retention_interval, replay_boundaries=replay_boundaries)

    def pop_blocks_for_free(self, request_id: str):
        self.publish_limit.pop(request_id, None)
        return [b for b in super().pop_blocks_for_free(request_id) if b is not self._null_block]
