"""The ``CUSTOM`` attention backend for the CUDA build (vLLM 0.33): vLLM's Triton backend, plus what the runtime
must see (both modes) and, in evict mode, the output of rows with evicted blocks.

Patched internal (subclassed, registered with the official ``register_backend(AttentionBackendEnum.CUSTOM, ...)``,
selected with ``--attention-backend CUSTOM``), vLLM 0.33: `TritonAttentionImpl.forward`. The stock kernel runs first
for every row; then `learnkv.serving.vllm.worker.WorkerHalf.attend` reads the tracked requests' resident blocks
through `learnkv.serving.vllm.layouts.TritonLayout`. Written against the 0.33 wheel's source; not yet run on a GPU.
"""

from __future__ import annotations

from vllm.config import get_current_vllm_config_or_none
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl

from learnkv.serving.vllm import compat, hooks


class LearnKVAttentionImpl(TritonAttentionImpl):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        config = get_current_vllm_config_or_none()  # set while vLLM loads the model
        # the model's config (a window, softcap, MLA), then sinks, softcap, a window or ALiBi: refused at model load
        compat.refuse_impl(self, None if config is None else config.model_config)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                              output_block_scale)
        hooks.attend(self, layer, query, key, value, kv_cache, attn_metadata, output)
        return out


class LearnKVAttentionBackend(TritonAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        return LearnKVAttentionImpl
