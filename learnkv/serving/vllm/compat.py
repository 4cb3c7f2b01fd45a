"""Which vLLM the adapter was written against, and what it refuses. Pure: takes versions and config objects.

The adapter subclasses vLLM internals (`FullAttentionManager`, `TritonAttentionBackend` / `TritonAttentionImpl`,
`KVConnectorBase_V1`) whose signatures change between minors, so it runs on exactly one minor and refuses any
other with a message naming both.
"""

from __future__ import annotations

SUPPORTED_MINOR = (0, 33)
PIN = "vllm>=0.33,<0.34"


def check_version(version: str) -> None:
    """Raise RuntimeError unless ``version`` is in the supported minor."""
    try:
        minor = tuple(int(x) for x in version.split("+")[0].split(".")[:2])
    except ValueError:
        minor = None
    if minor != SUPPORTED_MINOR:
        raise RuntimeError(
            f"learnkv's vLLM plugin supports vLLM {SUPPORTED_MINOR[0]}.{SUPPORTED_MINOR[1]}.x only, found {version}; "
            f"install the pinned engine with `pip install 'learnkv[serving]'` ({PIN}) or unset LEARNKV_SCORER"
        )


def refusals(vllm_config, mode: str) -> list[str]:
    """What the configured engine uses that the adapter cannot handle (empty = fine).

    Reads only plain attributes, so tests pass a `types.SimpleNamespace` shaped like a ``VllmConfig``.
    """
    out = []
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
        out.append("CUDA graphs: the backend runs per-request Python around the kernels; pass --enforce-eager")
    if mode == "evict" and getattr(sched, "async_scheduling", False):
        out.append("async scheduling (a batch in flight may still read a freed block); pass --no-async-scheduling")
    return out


def refuse(vllm_config, mode: str) -> None:
    """Raise RuntimeError listing every unsupported feature at once."""
    problems = refusals(vllm_config, mode)
    if problems:
        raise RuntimeError("learnkv vLLM plugin (mode=%s) cannot run with:\n  - %s" % (mode, "\n  - ".join(problems)))
