"""What the kernel tests share: per-case seeded inputs (a one-drop decode step's among them), poisoned allocations,
and a close-enough check that names the failing output."""

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


def one_drop_case(B, H, T, g, kind):
    """Scores, positions, per-row keep and live counts of a decode step: rows left-padded or with dead slots, every
    (b, h) of a row with the same number of live slots, each row over its budget by one or not at all."""
    pos = torch.full((B, H, T), -1, dtype=torch.int64)
    lives = []
    for b in range(B):
        n_live = int(torch.randint(max(1, T // 2), T + 1, (1,), generator=g))  # a row near its budget
        lives.append(n_live)
        for h in range(H):  # a random ascending set of live slots per head (dead ones anywhere: slack, padding)
            slots = torch.randperm(T, generator=g)[:n_live].sort().values
            pos[b, h, slots] = torch.arange(n_live) * 2 + int(torch.randint(0, 3, (1,), generator=g))
    if kind == "ties":
        scores = torch.randint(0, 3, (B, H, T), generator=g).float()
    elif kind == "special":  # inf on live slots ties with the protected ones; -inf and NaN force the fallback
        scores = torch.randn(B, H, T, generator=g)
        pick = torch.rand(B, H, T, generator=g)
        scores[pick < 0.05] = float("inf")
        scores[(pick > 0.05) & (pick < 0.07)] = float("-inf")
        scores[(pick > 0.07) & (pick < 0.08)] = float("nan")
    else:
        scores = torch.randn(B, H, T, generator=g)
    keeps = [n - int(torch.rand(1, generator=g) < 0.7) for n in lives]
    if kind == "over":  # one row drops two: not this shortcut's case
        keeps[0] = lives[0] - 2
    return scores, pos, keeps, lives


def assert_close(name, expected, actual, atol, rtol):
    expected, actual = expected.float().cpu(), actual.float().cpu()
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = (actual - expected).abs()
    ok = not actual.isnan().any() and torch.allclose(actual, expected, atol=atol, rtol=rtol)
    assert ok, f"{name}: max abs err {err.max():.3g}, mean {err.mean():.3g} (atol {atol}, rtol {rtol})"



def assert_nan_parity(name, expected, actual, atol, rtol):
    """NaN exactly where the reference has NaN (torch propagates it through max, amax and clamp; the GPU's plain
    ``max.f32`` does not), and the rest close."""
    expected, actual = expected.float().cpu(), actual.float().cpu()
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    nan = expected.isnan()
    assert nan.any(), f"{name}: the reference has no NaN, so the case checks nothing"
    assert torch.equal(actual.isnan(), nan), f"{name}: NaN at {actual.isnan().sum()} entries, reference {nan.sum()}"
    assert_close(name, expected[~nan], actual[~nan], atol, rtol)


#: prepended to every compile script: ``build(fn, consts, warps, nan=..., **types)`` compiles ``fn`` for sm_90
#: (``options`` as the launcher passes them, e.g. ``enable_fp_fusion``) and prints one ``RES`` line with the
#: registers, the local-memory bytes per thread (spills: what the driver reports as ``n_spills * 4``) and, for a
#: kernel whose float maxima must propagate NaN (``nan=True``), the count of PTX ``max.f32`` that drop it.
COMPILE_PREAMBLE = """
import os, re, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")

def build(fn, consts, warps=4, nan=False, options=None, **types):
    sig = {n: types.get(n, "constexpr" if n in consts else "i32") for n in fn.arg_names}
    opts = dict(options or {}, num_warps=warps)
    k = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32), options=opts)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        res = subprocess.run([os.path.join(_BIN, "cuobjdump"), "-res-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    use = dict(re.findall(r"(REG|STACK|LOCAL):(\\d+)", res))
    drops = len(re.findall(r"\\bmax(?:\\.ftz)?\\.f32\\b", k.asm["ptx"])) if nan else 0
    label = fn.__name__ + str(sorted((n, v) for n, v in consts.items()))
    print(f"RES {label} regs={use['REG']} spill={int(use['STACK']) + int(use['LOCAL'])} nan_drops={drops}")
    return k
"""


def assert_compiles_for_h100(script: str) -> None:
    """Run ``script`` (which builds kernels with `COMPILE_PREAMBLE`'s ``build`` for sm_90 and prints "compiled")
    outside the interpreter; skip if this triton wheel ships no ptxas or cuobjdump. No GPU needed, and the
    interpreter checks none of what the GPU compiler does (e.g. tl.dot's minimum tile sizes). Every kernel built
    must use no local memory (no register spills) and, where it asked for NaN parity, no NaN-dropping ``max.f32``."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (bin_dir / "ptxas").exists() or not (bin_dir / "cuobjdump").exists():
        pytest.skip("this triton wheel ships no ptxas or cuobjdump")
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", COMPILE_PREAMBLE + script], cwd=root, env=env, capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert res.returncode == 0 and "compiled" in res.stdout, res.stderr[-3000:]
    rows = re.findall(r"^RES (.+) regs=(\d+) spill=(\d+) nan_drops=(\d+)$", res.stdout, re.M)
    assert rows, "the script built no kernel through build()"
    spills = [f"{name}: {regs} registers, {spill} bytes of local memory" for name, regs, spill, _ in rows
              if int(spill)]  # fmt: skip
    assert not spills, "register spills:\n" + "\n".join(spills)
    drops = [f"{name}: {n} max.f32" for name, _, _, n in rows if int(n)]
    assert not drops, "float maxima that drop NaN (use kernels.nanmax):\n" + "\n".join(drops)
