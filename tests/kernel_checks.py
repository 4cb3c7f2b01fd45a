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
