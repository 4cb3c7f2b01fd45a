"""What the kernel tests share: per-case seeded inputs, poisoned allocations, and a close-enough check that names
the failing output."""

import contextlib
import zlib

import pytest
import torch


def gen(case_id: str) -> torch.Generator:
    """A generator seeded by the case, so every case gets its own fresh inputs."""
    return torch.Generator().manual_seed(zlib.crc32(case_id.encode()))


@contextlib.contextmanager
def poisoned():
    """Make `torch.empty` / `torch.empty_like` return poisoned memory while a launcher runs (NaN for floats, the
    most negative value for ints, True for bools), so a slot a kernel forgets to write fails."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t):
        if t.is_floating_point():
            return t.fill_(float("nan"))
        return t.fill_(True) if t.dtype == torch.bool else t.fill_(torch.iinfo(t.dtype).min)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
        mp.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))
        yield


def assert_close(name, expected, actual, atol, rtol):
    expected, actual = expected.float().cpu(), actual.float().cpu()
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = (actual - expected).abs()
    ok = not actual.isnan().any() and torch.allclose(actual, expected, atol=atol, rtol=rtol)
    assert ok, f"{name}: max abs err {err.max():.3g}, mean {err.mean():.3g} (atol {atol}, rtol {rtol})"


def assert_compiles_for_h100(script: str) -> None:
    """Run ``script`` (which builds kernels with ``triton.compile`` for sm_90 and prints "compiled") outside the
    interpreter; skip if this triton wheel ships no ptxas. No GPU needed, and the interpreter checks none of what
    the GPU compiler does (e.g. tl.dot's minimum tile sizes)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton wheel ships no ptxas")
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert res.returncode == 0 and "compiled" in res.stdout, res.stderr[-3000:]
