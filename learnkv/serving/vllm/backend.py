"""The ``CUSTOM`` attention backend: vLLM's Triton backend, plus what the runtime must see (both tiers) and the
evicted-block mask (tier B).

Patched internal (subclassed, registered with the official ``register_backend(AttentionBackendEnum.CUSTOM, ...)``),
vLLM 0.33: `TritonAttentionImpl.forward`. The stock kernel runs first for every row (it also covers prefill, which
never sees an evicted block: decisions start once the prompt is complete). Then, for each row of a tracked request,
`paged.masked_paged_attention` recomputes that row's attention over the request's resident blocks in torch: its
probabilities go to the runtime (the scorer's features need attention, which fused kernels never return), and in
evict mode its output replaces the stock output for requests that have evicted blocks (the stock kernel would
read the null block, or a block already reused by another request). Positions, slot mapping and ``seq_lens`` are
untouched. The torch path costs O(resident tokens) per row and layer; an in-house paged Triton kernel that skips
masked blocks is the planned replacement. Requires ``--enforce-eager`` (per-request Python between kernels).
"""

from __future__ import annotations

from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl

from learnkv.serving.vllm import hooks


class LearnKVAttentionImpl(TritonAttentionImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                              output_block_scale)
        worker = hooks.worker()
        if attn_metadata is not None and worker is not None:
            worker.attend(self, layer, query, key, value, kv_cache, attn_metadata, output)
        return out


class LearnKVAttentionBackend(TritonAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        return LearnKVAttentionImpl
