"""The one process-wide pointer from the attention backends to the worker half of the connector (vLLM-free)."""

from __future__ import annotations

import re

_WORKER = None
_LAYER = re.compile(r"layers\.(\d+)\.")


def set_worker(worker) -> None:
    global _WORKER
    _WORKER = worker


def worker():
    """The worker-side `learnkv.serving.vllm.worker.WorkerHalf` of this process, or None (plugin not configured)."""
    return _WORKER


def layer_index(layer_name: str) -> int:
    """Decoder layer of an attention layer's name (``model.layers.7.self_attn.attn`` -> 7)."""
    match = _LAYER.search(layer_name)
    if match is None:
        raise RuntimeError(f"learnkv: cannot tell the decoder layer of attention layer {layer_name!r}")
    return int(match.group(1))


def attend(impl, layer, query, key, value, kv_cache, attn_metadata, output) -> None:
    """Called by a learnkv backend after its stock kernel: hand the layer to the worker, if one is configured."""
    if attn_metadata is None or _WORKER is None:  # warm-up / profiling pass, or plugin not configured here
        return
    n = attn_metadata.num_actual_tokens
    _WORKER.attend(layer_index(layer.layer_name), query[:n], key[:n], value[:n], kv_cache, attn_metadata,
                   output[:n], impl.scale)
