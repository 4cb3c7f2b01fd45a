"""learnkv: learned KV-cache eviction for LLM decoding.

Data flows one way: model -> budgeted cache + policy -> traces -> scorer -> export, and imports point the same way
(the layers in README, "How it works"; checked by import-linter's contract in pyproject.toml and tests/test_imports.py).

The public names below are imported on first use, so `learnkv.scorer.artifact` (what serving loads) needs only
torch and safetensors, not transformers or Lightning.
"""

import importlib

_PUBLIC = {
    "generate": "learnkv.decode",
    "generate_steps": "learnkv.decode",
    "GenerationResult": "learnkv.decode",
    "resolve_budget": "learnkv.settings",
    "Eviction": "learnkv.settings",
    "load_model": "learnkv.model",
    "tiny_model": "learnkv.model",
    "DEFAULT_MODEL": "learnkv.model",
    "ModelLoadError": "learnkv.model",
    "POLICIES": "learnkv.policies",
    "make_policy": "learnkv.policies",
    "load_scorer": "learnkv.scorer.artifact",
    "export_scorer": "learnkv.scorer.artifact",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'learnkv' has no attribute {name!r}")
