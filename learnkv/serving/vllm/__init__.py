"""The vLLM adapter (pinned to one vLLM minor, `compat.SUPPORTED_MINOR`). Importing this package imports no vLLM:
`plugin.register` is the ``vllm.general_plugins`` entry point; `connector`, `backend` and `manager` import vLLM and
are loaded by vLLM itself once the plugin is configured. `compat` and `paged` are pure and tested on CPU.
"""
