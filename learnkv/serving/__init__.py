"""Serving: run an exported scorer inside a paged serving engine.

- `learnkv.serving.runtime` — the engine-independent core (torch + safetensors): per-request block statistics and
  which whole blocks to free under a per-request budget.
- `learnkv.serving.batch` — the runtime's decoding requests as one batch (one feature update per engine step).
- `learnkv.serving.config` — the one config parser (plugin config or ``LEARNKV_*`` environment variables).
- `learnkv.serving.simulator` — a paged KV cache engine in miniature that drives the runtime on CPU (tests).
- `learnkv.serving.vllm` — the vLLM adapter, imported only when vLLM loads the plugin.

Nothing here is imported by ``import learnkv``.
"""
