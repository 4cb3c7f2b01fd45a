"""Eviction kernels: Triton for CUDA tensors, plain-torch references everywhere else.

Keep this file cheap and free of side effects: the cache and every policy import it and triton is optional, so
nothing heavy (torch, triton) is imported here at module level; the public functions import their implementation
on first call. The package lives inside learnkv, not at the top level: a top-level ``kernels`` would shadow Hugging
Face's ``kernels``, which transformers 5.25 requires and imports.

Every public function has a reference with the same signature in `reference` (the spec and the CPU path;
`mark_one_drop` also takes the rows' live counts, which its reference needs not) and a Triton launcher in its own
module (`select`, `compact`, `decode_attn`, `block_score`, `state_update`, `scorer`, `features`); `cpu` holds
shortcuts of the references for common cases of the CPU decode loop, bit-equal to them. No module may be named
after a public function: importing ``kernels.<name>`` binds the attribute ``<name>`` of this package to the
module and would shadow the function.

The one switch is the environment variable ``LEARNKV_KERNELS``, read at every call (so tests can flip it):

- ``auto`` (default): Triton for CUDA tensors when triton imports, the references otherwise;
- ``torch``: the references everywhere, CUDA included (to compare both paths on a GPU);
- ``triton``: the Triton launchers for every tensor. On CPU tensors that needs ``TRITON_INTERPRET=1`` set before
  triton is imported: it exists so CI can run the whole Triton path of the decode loop in the interpreter.
"""

import functools
import os

# imports inside functions: an implementation is imported on its first call (this package stays cheap to import, and
# triton optional: see above)

__all__ = [
    "select_keep",
    "mark_one_drop",
    "gather_tokens",
    "decode_attention",
    "block_scores",
    "update_token_state",
    "scorer_mlp",
    "decode_features",
    "triton_available",
    "use_triton",
    "kernel_mode",
]

MODES = ("auto", "torch", "triton")
_TRITON = None


def triton_available() -> bool:
    """Whether triton imports (checked once)."""
    global _TRITON
    if _TRITON is None:
        try:
            import triton  # noqa: F401

            _TRITON = True
        except ImportError:
            _TRITON = False
    return _TRITON


def kernel_mode() -> str:
    """The switch's value: "auto", "torch" or "triton" (`LEARNKV_KERNELS`, default "auto")."""
    mode = os.environ.get("LEARNKV_KERNELS", "auto")
    if mode not in MODES:
        raise ValueError(f"LEARNKV_KERNELS must be one of {MODES}, got {mode!r}")
    return mode


def _use_triton(*tensors) -> bool:
    mode = kernel_mode()
    if mode == "torch":
        return False
    on_cuda = all(t.is_cuda for t in tensors)
    if mode == "auto":
        return on_cuda and triton_available()
    # checked here because triton's own error on a CPU pointer does not say what to do
    if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("LEARNKV_KERNELS=triton on CPU tensors needs TRITON_INTERPRET=1 set before importing triton")
    if not triton_available():
        raise RuntimeError("LEARNKV_KERNELS=triton but triton does not import")
    if not on_cuda:
        _check_interpreter()
    return True


def _version(text: str) -> tuple[int, int]:
    major, minor = (text.split(".") + ["0"])[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def _check_interpreter() -> None:
    """Refuse a Triton interpreter that cannot run with this numpy (`_interpreter_error`)."""
    error = _interpreter_error()
    if error is not None:
        raise RuntimeError(error)


@functools.cache
def _interpreter_error() -> str | None:
    """Why the Triton interpreter cannot run with this numpy, or None; decided once per process (the versions do not
    change; tests swap in a fresh cache). Before 3.7 the interpreter reads loop bounds and scalar arguments with
    ``int()`` of 1-element arrays, which numpy 2.4 turned from a warning into an error (seen with triton 3.6.0 and
    numpy 2.4.6: every kernel with a ``range`` over a runtime value fails inside the interpreter)."""
    import numpy
    import triton

    if _version(triton.__version__) < (3, 7) and _version(numpy.__version__) >= (2, 4):
        return (f"Triton {triton.__version__}'s interpreter does not run with numpy {numpy.__version__} "
                "(TRITON_INTERPRET=1 needs triton>=3.7 or numpy<2.4); compiled kernels on CUDA are unaffected")
    return None


def use_triton(*tensors) -> bool:
    """Whether the public functions run Triton for these tensors (see the switch in the module docstring)."""
    return _use_triton(*tensors)


def select_keep(scores, positions, keep, n_sink, n_recent, block_size=1, live=None):
    """Kept slot indices ``[B, H, K]`` (ascending) from scores ``[B, H, T]``; see `kernels.reference`.

    ``live``: each row's live slots (one int, or one per row), if the caller knows them; on the torch path it lets
    a step that drops at most one live slot per row take `kernels.cpu.select_keep_one_drop` (the same result).
    Elsewhere the torch path lists the kept slots by a cumulative sum (`kernels.cpu.select_keep_listed`)."""
    if _use_triton(scores, positions):
        from learnkv.kernels.select import select_keep as impl
    else:
        if live is not None and block_size == 1:
            from learnkv.kernels.cpu import select_keep_one_drop

            index = select_keep_one_drop(scores, positions, keep, n_sink, n_recent, live)
            if index is not None:
                return index
        from learnkv.kernels.cpu import select_keep_listed as impl
    return impl(scores, positions, keep, n_sink, n_recent, block_size)


def mark_one_drop(scores, positions, keep, n_sink, n_recent, live) -> bool:
    """Mark every slot `select_keep` (token granularity) would drop dead, in place, where no row drops more than
    one of its ``live`` slots (one int, or one per row: the caller's host-side counts); see
    `kernels.reference.mark_one_drop_reference`. Returns False, marking nothing, outside that case, or on the
    torch path where its argmin leaves the case to the reference (`kernels.cpu.mark_one_drop`)."""
    if _use_triton(scores, positions):
        from learnkv.kernels.cpu import one_drop_rows
        from learnkv.kernels.select import mark_one_drop as impl

        if one_drop_rows(keep, live, *scores.shape) is None:
            return False
        impl(scores, positions, keep, n_sink, n_recent)
        return True
    from learnkv.kernels.cpu import mark_one_drop as impl  # checks the case itself (`one_drop_victims`)

    return impl(scores, positions, keep, n_sink, n_recent, live)


def gather_tokens(x, index, dim, out=None):
    """Gather the slots ``index [B, H, K]`` of ``x`` along its token axis ``dim`` (into the first ``K`` slots of
    ``out`` if given); see `kernels.reference`."""
    if _use_triton(x, index):
        from learnkv.kernels.compact import gather_tokens as impl
    else:
        from learnkv.kernels.reference import gather_tokens_reference as impl
    return impl(x, index, dim, out)


def decode_attention(query, key, value, key_positions, query_positions, scaling=None, reduce="mean", *,
                     window=None, softcap=None, sinks=None):
    """One decode step: output ``[B, 1, Hq, D]`` and group-reduced attention ``[B, H, T]`` (None for ``reduce=None``;
    ``window``, ``softcap`` and ``sinks``: a sliding window, logit softcapping, per-head sink logits); see
    `kernels.reference`."""
    if _use_triton(query, key, value, key_positions, query_positions):
        from learnkv.kernels.decode_attn import decode_attention as impl
    else:
        from learnkv.kernels.reference import decode_attention_reference as impl
    return impl(query, key, value, key_positions, query_positions, scaling, reduce, window=window, softcap=softcap,
                sinks=sinks)


def block_scores(keys, values, block_size):
    """PagedEviction scores ``[B, T // block_size]`` from keys/values ``[B, H, T, D]``; see `kernels.reference`."""
    if _use_triton(keys, values):
        from learnkv.kernels.block_score import block_scores as impl
    else:
        from learnkv.kernels.reference import block_scores_reference as impl
    return impl(keys, values, block_size)


def update_token_state(attn_mean, attn_max, positions, step, n_new, alpha,
                       acc=None, s1=None, s2=None, count=None, ts=None, mri=None):  # fmt: skip
    """Update H2O/RoCo/LazyEviction per-token state ``[B, H, T]`` in place for one step; see `kernels.reference`."""
    tensors = [t for t in (attn_mean, attn_max, positions, acc, s1, s2, count, ts, mri) if t is not None]
    if _use_triton(*tensors):
        from learnkv.kernels.state_update import update_token_state as impl
    else:
        from learnkv.kernels.reference import update_token_state_reference as impl
    impl(attn_mean, attn_max, positions, step, n_new, alpha, acc, s1, s2, count, ts, mri)


def scorer_mlp(features, mean, std, w1, b1, w2, b2):
    """One layer's scorer MLP on token features ``[N, F]`` -> ``[N]`` fp32; see `kernels.reference`."""
    if _use_triton(features, mean, std, w1, b1, w2):
        from learnkv.kernels.scorer import scorer_mlp as impl
    else:
        from learnkv.kernels.reference import scorer_mlp_reference as impl
    return impl(features, mean, std, w1, b1, w2, b2)


def decode_features(attn, keys, values, positions, layer, n_layers, step, state, spare=0, read_out=True):
    """One decode step of the learned policy's feature tracker (state in place, ``[B, H, T, F]`` features out, or
    None without ``read_out``; its window among ``spare`` spare rows); see `kernels.reference`."""
    if _use_triton(attn, keys, values, positions, *state.values()):
        from learnkv.kernels.features import decode_features as impl
    else:
        from learnkv.kernels.reference import decode_features_reference as impl
    return impl(attn, keys, values, positions, layer, n_layers, step, state, spare, read_out=read_out)
