"""The one process-wide pointer from the attention backend to the worker half of the connector (vLLM-free)."""

from __future__ import annotations

_WORKER = None


def set_worker(worker) -> None:
    global _WORKER
    _WORKER = worker


def worker():
    """The worker-side connector of this process, or None (plugin not configured in this process)."""
    return _WORKER
