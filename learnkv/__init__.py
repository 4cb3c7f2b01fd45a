"""learnkv: learned KV-cache eviction for LLM decoding.

Data flows one way: model -> budgeted cache + policy -> traces -> scorer -> export.
"""

from learnkv.decode import GenerationResult, generate, resolve_budget
from learnkv.model import DEFAULT_MODEL, ModelLoadError, load_model, tiny_model
from learnkv.policies import POLICIES, make_policy

__all__ = [
    "DEFAULT_MODEL",
    "GenerationResult",
    "ModelLoadError",
    "POLICIES",
    "generate",
    "load_model",
    "make_policy",
    "resolve_budget",
    "tiny_model",
]
