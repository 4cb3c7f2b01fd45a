"""The ``vllm.general_plugins`` entry point: ``learnkv = "learnkv.serving.vllm.plugin:register"``.

vLLM calls `register` in every process (API server, engine core, workers), possibly several times, before the
model loads. It does nothing unless ``LEARNKV_SCORER`` names an artifact, and never imports vLLM otherwise. When
enabled it checks the vLLM version (one minor, `compat.SUPPORTED_MINOR`), then registers, through vLLM's own
registries (no monkeypatching):

- the attention backend ``CUSTOM`` -> `learnkv.serving.vllm.backend.LearnKVAttentionBackend` (select it with
  ``--attention-backend CUSTOM``): it shows the runtime each tracked request's attention, and in evict mode masks
  evicted blocks;
- the block manager for the default KV-cache group role -> `learnkv.serving.vllm.manager.EvictableFullAttentionManager`
  (``KVCacheSpecRegistry.register_role_manager``): a `FullAttentionManager` that can also swap a request's block
  for the null block. Until the connector asks it to evict (evict mode only) it behaves exactly like the stock one.

The connector (`learnkv.serving.vllm.connector.LearnKVConnector`) is loaded by vLLM from ``--kv-transfer-config``.
"""

from __future__ import annotations

from learnkv.serving.config import merge_config

BACKEND = "learnkv.serving.vllm.backend.LearnKVAttentionBackend"


def import_vllm():
    """``vllm``, or an ImportError that says how to install the pinned engine."""
    from learnkv.serving.vllm.compat import PIN, check_version

    try:
        import vllm
    except ImportError:
        raise ImportError(
            f"learnkv's vLLM plugin is enabled (LEARNKV_SCORER is set) but vLLM is not installed; install the "
            f"supported engine with `pip install 'learnkv[serving]'` ({PIN})"
        ) from None
    check_version(vllm.__version__)
    return vllm


def register() -> bool:
    """Register the backend and block manager if an artifact is configured; returns whether it did (idempotent)."""
    config = merge_config(None)  # env only: vLLM passes plugins no arguments
    if config is None:
        return False
    import_vllm()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.kv_cache_interface import KVCacheGroupRole
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    from learnkv.serving.vllm.manager import EvictableFullAttentionManager

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND)  # overwrites the same entry: re-entrant
    # the registry accepts the same class again, so a second call is harmless
    KVCacheSpecRegistry.register_role_manager(KVCacheGroupRole.DEFAULT, EvictableFullAttentionManager)
    return True
