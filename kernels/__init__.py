"""Eviction kernels: Triton for CUDA tensors, plain-torch references everywhere else.

Keep this file cheap and free of side effects: `kernels` is also the name of a Hugging Face package that
transformers probes for at import time, so nothing heavy (torch, triton) is imported here at module level.
The public functions import their implementation on first call.
"""

__all__ = ["select_keep", "gather_tokens"]


def select_keep(scores, positions, keep, n_sink, n_recent, block_size=1):
    """Kept slot indices ``[B, H, K]`` (ascending) from scores ``[B, H, T]``; see `kernels.reference`."""
    from kernels.reference import select_keep_reference

    return select_keep_reference(scores, positions, keep, n_sink, n_recent, block_size)


def gather_tokens(x, index, dim):
    """Gather the slots ``index [B, H, K]`` of ``x`` along its token axis ``dim``; see `kernels.reference`."""
    from kernels.reference import gather_tokens_reference

    return gather_tokens_reference(x, index, dim)
