"""Serving configuration: which artifact, what budget, which blocks are protected, and which tier runs.

One strict parser for both sources: the vLLM adapter's plugin config (``kv_connector_extra_config``, a dict) and
environment variables (``LEARNKV_*``, read by the ``vllm.general_plugins`` entry point, which gets no arguments).
Unknown keys and out-of-range values raise `ValueError` naming the key and the allowed range. Torch-free.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields

MODES = ("shadow", "evict")
#: the budget allocations (`learnkv.allocation.ALLOCATIONS`) serving takes; docs/allocation.md, "Serving"
ALLOCATIONS = ("uniform", "pyramid")
#: the others, and why a paged engine cannot hold them
REFUSED_ALLOCATIONS = {
    "head": "a paged engine's blocks are shared by a layer's KV heads, so a per-head budget frees no block; it needs "
            "a per-head paged layout (Ada-KV's vLLM port replaces the block manager and kernels)",
    "global": "it ranks tokens of every layer and KV head together, per head within a layer (see 'head'); a "
              "layer-level variant (whole blocks ranked across layers, per-layer block tables resized every step) is "
              "not built (the scorer trained for 'global' ranks tokens, not whole blocks); serve 'pyramid' (fixed "
              "per-layer budgets)",
}

#: environment variable -> config key
ENV = {
    "LEARNKV_SCORER": "scorer",
    "LEARNKV_BUDGET": "budget",
    "LEARNKV_BLOCK_SIZE": "block_size",
    "LEARNKV_SINK_BLOCKS": "sink_blocks",
    "LEARNKV_RECENT_BLOCKS": "recent_blocks",
    "LEARNKV_MODE": "mode",
    "LEARNKV_EXPECT_MODEL": "expect_model",
    "LEARNKV_LOG": "log",
    "LEARNKV_ALLOCATION": "allocation",
}


@dataclass(frozen=True)
class ServingConfig:
    """What the serving runtime and the vLLM adapter need.

    Parameters
    ----------
    scorer : str
        Path of an exported scorer directory (`python train.py` prints it as ``artifact: PATH``).
    budget : int
        Default per-request budget in tokens (per layer and KV head, as in the decode loop); a request may ask for
        another one (``vllm_xargs={"learnkv_budget": N}``).
    block_size : int
        The engine's KV block size in tokens (vLLM's ``--block-size``); decisions are whole blocks.
    sink_blocks, recent_blocks : int
        Never evicted: the first ``sink_blocks`` blocks, and every block holding one of the newest
        ``recent_blocks * block_size`` tokens (so the block being written is always protected).
    mode : str
        "shadow" (tier A: score and log, free nothing) or "evict" (tier B: free blocks, mask them in attention).
    expect_model : str
        The model name the artifact must be bound to; empty = the served model's name or folder name.
    log : str
        JSONL file for the decisions (shadow mode logs every decision; evict mode too); empty = the vLLM logger.
    allocation : str
        How a request's budget is shared by layers (`ALLOCATIONS`): "uniform" (every layer holds the same blocks) or
        "pyramid" (per-layer budgets in whole blocks, `learnkv.serving.runtime.pyramid_block_budgets`; the runtime
        and the paged simulator only). The scorer's scores must compare as the allocation compares them
        (`learnkv.scorer.artifact.COMPARES_ACROSS`: a ``uniform`` scorer serves both).
    """

    scorer: str
    budget: int
    block_size: int = 16
    sink_blocks: int = 1
    recent_blocks: int = 1
    mode: str = "shadow"
    expect_model: str = ""
    log: str = ""
    allocation: str = "uniform"

    @property
    def n_sink(self) -> int:
        return self.sink_blocks * self.block_size

    @property
    def n_recent(self) -> int:
        return self.recent_blocks * self.block_size

    def to_dict(self) -> dict:
        return asdict(self)


def parse_config(raw: dict) -> ServingConfig:
    """A validated `ServingConfig` from a dict of strings or numbers (unknown keys are errors)."""
    known = {f.name: f for f in fields(ServingConfig)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ValueError(f"learnkv serving: unknown config key(s) {', '.join(unknown)}; known: {', '.join(known)}")
    for key in ("scorer", "budget"):
        if raw.get(key) in (None, ""):
            raise ValueError(f"learnkv serving: {key!r} is required (env {_env_name(key)})")
    values = {}
    for name, value in raw.items():
        if known[name].type == "int":
            try:
                values[name] = int(value)
            except (TypeError, ValueError):
                raise ValueError(f"learnkv serving: {name} must be an integer, got {value!r}") from None
        else:
            values[name] = str(value)
    cfg = ServingConfig(**values)
    if cfg.budget < 1:
        raise ValueError(f"learnkv serving: budget must be >= 1 token, got {cfg.budget}")
    if cfg.block_size < 1:
        raise ValueError(f"learnkv serving: block_size must be >= 1, got {cfg.block_size}")
    if cfg.sink_blocks < 0 or cfg.recent_blocks < 1:
        raise ValueError(
            f"learnkv serving: sink_blocks must be >= 0 and recent_blocks >= 1 (the block being written is never "
            f"evicted), got {cfg.sink_blocks} and {cfg.recent_blocks}"
        )
    if cfg.mode not in MODES:
        raise ValueError(f"learnkv serving: mode must be one of {', '.join(MODES)}, got {cfg.mode!r}")
    check_allocation(cfg.allocation)
    return cfg


def check_allocation(allocation: str) -> None:
    """Refuse, in one line, an allocation serving does not take (`ALLOCATIONS`), saying why."""
    if allocation in REFUSED_ALLOCATIONS:
        raise ValueError(f"learnkv serving: allocation {allocation!r} is not served: {REFUSED_ALLOCATIONS[allocation]}")
    if allocation not in ALLOCATIONS:
        raise ValueError(f"learnkv serving: allocation must be one of {', '.join(ALLOCATIONS)}, got {allocation!r}")


def merge_config(extra: dict | None, environ: dict | None = None) -> ServingConfig | None:
    """Plugin config (a KV connector's ``kv_connector_extra_config``) over environment variables; None if unset."""
    environ = os.environ if environ is None else environ
    raw = {key: environ[var] for var, key in ENV.items() if environ.get(var, "") != ""}
    raw.update({k: v for k, v in (extra or {}).items() if v is not None})
    if not raw.get("scorer"):
        return None
    return parse_config(raw)


def _env_name(key: str) -> str:
    return next(var for var, k in ENV.items() if k == key)
