"""The vLLM adapter, for two builds (`compat.SUPPORTED`: vLLM 0.32.x CPU, 0.33.x CUDA). Importing this package
imports no vLLM: `plugin.register` is the ``vllm.general_plugins`` entry point; `connector`, `cpu_backend`,
`cuda_backend` and `manager` import vLLM and are loaded by vLLM itself once the plugin is configured. `compat`,
`layouts`, `paged`, `worker` and `hooks` are torch-only and tested without vLLM (``tests/test_vllm_parts.py``).
"""
