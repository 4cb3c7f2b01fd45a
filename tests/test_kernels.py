"""Triton launchers against their torch references, over awkward shapes.

On CPU the launchers run under the Triton interpreter (`TRITON_INTERPRET=1`, set by conftest before any import);
with a real GPU (``TRITON_INTERPRET=0``) the same tests run compiled on CUDA, plus a few large shapes.
Indices and copies must match exactly; floats within per-dtype tolerances. Launcher outputs are allocated
NaN-filled (ints: most negative value), so a slot a kernel forgets to write fails.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import prefill_for
from learnkv.kernels import reference as ref
from kernel_checks import assert_close, assert_compiles_for_h100, assert_nan_parity, gen, one_drop_case, poisoned

pytest.importorskip("triton")
from learnkv.kernels.block_score import block_scores  # noqa: E402
from learnkv.kernels.compact import gather_tokens  # noqa: E402
from learnkv.kernels.decode_attn import decode_attention  # noqa: E402
from learnkv.kernels.select import mark_one_drop, select_keep  # noqa: E402

CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
DEVICE = "cuda" if CUDA else "cpu"
gpu_only = pytest.mark.skipif(not CUDA, reason="large shapes need a GPU (compiled Triton, not the interpreter)")
#: (atol, rtol) per input dtype for float outputs
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1e-2), torch.float16: (2e-3, 2e-3)}


def make_positions(B, H, T, g, pad=3):
    """``[B, H, T]`` increasing positions with gaps (as after evictions); batch row 0 left-padded with -1."""
    pos = torch.randint(1, 3, (B, H, T), generator=g).cumsum(-1) - 1
    if B > 0:
        pos[0, :, : min(pad, T)] = -1
    return pos


# -- select_keep ----------------------------------------------------------------------------------------------

SELECT_CASES = [  # B, H, T, keep, n_sink, n_recent, block_size, score kind, dtype, units per chunk
    pytest.param(1, 1, 1, 0, 0, 0, 1, "randn", torch.float32, None, id="T1-keep0"),
    pytest.param(1, 2, 1, 1, 1, 1, 1, "randn", torch.float32, None, id="T1-keep1"),
    pytest.param(2, 2, 17, 8, 2, 3, 1, "randn", torch.float32, None, id="B2-H2-T17-keep8"),
    pytest.param(2, 2, 63, 12, 4, 8, 1, "randn", torch.float32, None, id="B2-H2-T63-keep=sink+recent"),
    pytest.param(2, 4, 100, 50, 4, 8, 1, "ties", torch.float32, None, id="B2-H4-T100-keep50-ties"),
    pytest.param(2, 2, 100, 100, 4, 8, 1, "randn", torch.float32, None, id="B2-H2-T100-keep=T"),
    pytest.param(1, 4, 100, 37, 0, 0, 1, "shared", torch.bfloat16, None, id="B1-H4-T100-keep37-shared-bf16"),
    pytest.param(2, 2, 64, 15, 4, 8, 16, "randn", torch.float32, None, id="B2-H2-T64-keep15-bs16"),
    pytest.param(2, 2, 64, 16, 4, 8, 16, "randn", torch.float32, None, id="B2-H2-T64-keep16-bs16"),
    pytest.param(2, 2, 64, 17, 4, 8, 16, "ties", torch.float32, None, id="B2-H2-T64-keep17-bs16-ties"),
    pytest.param(2, 2, 100, 36, 16, 16, 16, "randn", torch.bfloat16, None, id="B2-H2-T100-keep36-bs16-bf16"),
    pytest.param(1, 2, 100, 63, 0, 0, 16, "ties", torch.float32, None, id="B1-H2-T100-keep63-bs16-ties"),
    pytest.param(2, 1, 63, 40, 2, 2, 5, "randn", torch.float32, None, id="B2-H1-T63-keep40-bs5"),
    pytest.param(2, 2, 100, 41, 4, 8, 1, "ties", torch.float32, 16, id="B2-H2-T100-keep41-ties-chunk16"),
    pytest.param(2, 2, 100, 30, 4, 8, 1, "shuffled", torch.float32, 16, id="B2-H2-T100-keep30-shuffled-chunk16"),
    pytest.param(1, 2, 100, 52, 2, 8, 16, "ties", torch.float32, 2, id="B1-H2-T100-keep52-bs16-ties-chunk2"),
]


@pytest.mark.parametrize("B, H, T, keep, n_sink, n_recent, block_size, kind, dtype, block_n", SELECT_CASES)
def test_select_keep(request, B, H, T, keep, n_sink, n_recent, block_size, kind, dtype, block_n):
    g = gen(request.node.callspec.id)
    if kind == "ties":  # many exactly equal scores (and block sums), as constant-score policies give
        scores = torch.randint(0, 3, (B, H, T), generator=g).to(dtype)
    elif kind == "shared":  # one score per slot broadcast over heads (stride 0), as `reduce_heads` gives
        scores = torch.randn(B, 1, T, generator=g).to(dtype).expand(B, H, T)
    else:
        scores = torch.randn(B, H, T, generator=g).to(dtype)
    positions = make_positions(B, H, T, g)
    if kind == "shuffled":  # slots need not be in position order: the newest may sit in any chunk
        positions = positions.gather(-1, torch.rand(B, H, T, generator=g).argsort(-1))
    expected = ref.select_keep_reference(scores, positions, keep, n_sink, n_recent, block_size)
    with poisoned():
        actual = select_keep(scores.to(DEVICE), positions.to(DEVICE), keep, n_sink, n_recent, block_size,
                             block_n=block_n)  # fmt: skip
    assert actual.dtype == torch.int64
    assert torch.equal(actual.cpu(), expected), f"kept slots differ:\n{actual}\n{expected}"


def test_select_keep_special_values():
    """Padding, protected slots, inf, -inf, NaN and -0.0 rank exactly as in the reference."""
    s = torch.tensor([[[0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1.0, -0.0, 0.0, 2.0, float("nan")]]])
    pos = torch.tensor([[[-1, -1, 0, 1, 2, 3, 4, 5, 6, 7]]])
    for keep in range(11):
        expected = ref.select_keep_reference(s, pos, keep, 1, 1)
        with poisoned():
            actual = select_keep(s.to(DEVICE), pos.to(DEVICE), keep, 1, 1)
        assert torch.equal(actual.cpu(), expected), f"keep {keep}: {actual.tolist()} != {expected.tolist()}"


@pytest.mark.parametrize("B, H, T", [(1, 1, 1), (1, 3, 17), (2, 2, 33), (4, 3, 129), (16, 3, 40)])
@pytest.mark.parametrize("kind", ["randn", "ties", "special", "bf16"])
@pytest.mark.parametrize("block_t", [None, 16])
def test_mark_one_drop(request, B, H, T, kind, block_t):
    """The one-drop kernel (the cache's eviction without compaction at a decode step) marks dead exactly the slots
    the reference's selection drops, in place, in rows that drop one live slot or none: one keep or one per row,
    per-row sinks and windows, ties, inf, -inf on live slots (tied with the dead ones, the oldest of the tie go),
    NaN, bf16 scores, positions a strided view of a larger buffer, rows in one chunk or several."""
    g = gen(request.node.callspec.id)
    for trial in range(6):
        scores, pos, keeps, lives = one_drop_case(B, H, T, g, "ties" if kind == "ties" else "special" if kind ==
                                                  "special" else "randn")  # fmt: skip
        scores = scores.to(torch.bfloat16) if kind == "bf16" else scores
        if trial % 2:  # one keep for every row
            keeps, lives = [keeps[0]] * B, [lives[0]] * B
            pos[:] = pos[:1]
        keep = keeps[0] if trial % 2 else keeps
        per_row = trial >= 4  # per-row sinks and windows
        n_sink, n_recent = ([b % 3 for b in range(B)], [b % 4 for b in range(B)]) if per_row else (trial % 3, trial % 5)
        expected = pos.clone()
        ref.mark_one_drop_reference(scores, expected, keep, n_sink, n_recent)
        buffer = torch.full((B, H, T + 5), -7, dtype=torch.int64)  # the cache's positions: a view of its buffer
        buffer[..., :T] = pos
        buffer = buffer.to(DEVICE)
        mark_one_drop(scores.to(DEVICE), buffer[..., :T], keep, n_sink, n_recent, block_t=block_t)
        assert torch.equal(buffer[..., :T].cpu(), expected), f"trial {trial}:\n{buffer[..., :T]}\n{expected}"
        assert (buffer[..., T:] == -7).all(), "wrote past the view"


def test_mark_one_drop_special_values():
    """Padding, protected slots, inf, -inf, NaN and -0.0 rank exactly as in the reference, every keep that drops
    one live slot or none; -inf on live slots in every place of the tie with the dead ones."""
    s = torch.tensor([[[0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1.0, -0.0, 0.0, 2.0, float("nan")]]])
    for dead in ([0, 1], [3], [0, 9], []):
        pos = torch.arange(10).view(1, 1, 10).clone()
        pos[..., dead] = -1
        live = 10 - len(dead)
        for keep in (live - 1, live, live + 1):
            for n_sink, n_recent in ((1, 1), (0, 0), (0, 3)):
                expected = pos.clone()
                ref.mark_one_drop_reference(s, expected, keep, n_sink, n_recent)
                actual = pos.clone().to(DEVICE)
                mark_one_drop(s.to(DEVICE), actual, keep, n_sink, n_recent)
                assert torch.equal(actual.cpu(), expected), f"dead {dead}, keep {keep}: {actual.tolist()}"


def test_mark_one_drop_launcher_syncs():
    """The launcher reads nothing back from the device (host keep, sinks and windows go over in one copy)."""
    s, pos = torch.randn(2, 2, 40).to(DEVICE), torch.arange(40).expand(2, 2, 40).clone().to(DEVICE)
    assert count_readbacks(lambda: mark_one_drop(s, pos, 39, 4, 8)) == []
    assert count_readbacks(lambda: mark_one_drop(s, pos, [38, 39], [4, 0], [8, 8])) == []


def count_readbacks(fn):
    """Run ``fn`` and return how many times it read a tensor's value back to the host (``.item()``, ``.tolist()``,
    ``bool``, ``int``...): each is a device-to-host sync on CUDA."""
    calls = []

    def counted(name, orig):
        return lambda self, *a, **k: (calls.append(name), orig(self, *a, **k))[1]

    with pytest.MonkeyPatch.context() as mp:
        for name in ("item", "tolist", "__bool__", "__int__", "__index__", "__float__"):
            mp.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
        fn()
    return calls


def test_select_keep_launcher_syncs(monkeypatch):
    """The launcher reads nothing back from the device in token mode when keep, n_sink and n_recent are host ints
    (one or one per row, as the cache passes them), and once in block mode (the output's width depends on the
    rows' first live slots); the kernels themselves are stubbed out here (the interpreter reads tensors back)."""
    import learnkv.kernels.select as sel

    class Stub:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    monkeypatch.setattr(sel, "_priority_kernel", Stub())
    monkeypatch.setattr(sel, "_select_kernel", Stub())
    s, pos = torch.randn(2, 3, 50), torch.arange(50).expand(2, 3, 50).clone()
    assert count_readbacks(lambda: sel.select_keep(s, pos, 20, 4, 8)) == []
    assert count_readbacks(lambda: sel.select_keep(s, pos, [20, 30], [4, 0], [8, 8])) == []
    assert len(count_readbacks(lambda: sel.select_keep(s, pos, 20, 4, 8, 16))) == 1
    assert len(count_readbacks(lambda: sel.select_keep(s, pos, torch.tensor([20, 30]), 4, 8))) == 1


@gpu_only
def test_select_keep_no_sync_gpu():
    """On CUDA, token mode with host ints runs without a device-to-host sync (torch's sync debug mode raises)."""
    g = gen("sync-gpu")
    scores, pos = torch.randn(4, 8, 3000, generator=g).to(DEVICE), make_positions(4, 8, 3000, g).to(DEVICE)
    expected = ref.select_keep_reference(scores, pos, 1500, 4, 64)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        kept = select_keep(scores, pos, 1500, 4, 64)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(kept, expected)


def test_select_keep_too_many_blocks():
    s, pos = torch.zeros(1, 1, 20), torch.arange(20).view(1, 1, 20)
    with pytest.raises(ValueError, match="cannot drop"):
        ref.select_keep_reference(s, pos, 2, 0, 0, 16)
    with pytest.raises(ValueError, match="cannot drop"):
        select_keep(s.to(DEVICE), pos.to(DEVICE), 2, 0, 0, 16)


# -- gather_tokens --------------------------------------------------------------------------------------------

GATHER_CASES = [  # shape of x, dim, K, dtype, kept slots per program
    pytest.param((2, 2, 17, 64), -2, 8, torch.float32, None, id="kv-B2-H2-T17-D64-K8-fp32"),
    pytest.param((1, 4, 100, 128), -2, 37, torch.bfloat16, None, id="kv-B1-H4-T100-D128-K37-bf16"),
    pytest.param((2, 2, 63, 128), -2, 63, torch.bfloat16, None, id="kv-B2-H2-T63-D128-K=T-bf16"),
    pytest.param((1, 2, 1, 64), -2, 1, torch.float32, None, id="kv-B1-H2-T1-D64-K1"),
    pytest.param((2, 2, 100, 60), -2, 50, torch.float16, None, id="kv-B2-H2-T100-D60-K50-fp16"),
    pytest.param((2, 4, 100), -1, 36, torch.int64, None, id="positions-B2-H4-T100-K36"),
    pytest.param((2, 2, 3, 63), -1, 17, torch.float32, None, id="state-B2-H2-W3-T63-K17"),
    pytest.param((1, 2, 2, 3, 17), -1, 8, torch.bool, None, id="state-B1-H2-2x3-T17-K8-bool"),
    pytest.param((1, 2, 17, 4), -2, 0, torch.float32, None, id="kv-K0"),
    pytest.param((1, 2, 17, 300), -2, 9, torch.float32, 4, id="rows-B1-H2-T17-R300-K9-chunk4"),
    pytest.param((2, 2, 3, 63), -1, 40, torch.int64, 16, id="state-B2-H2-W3-T63-K40-chunk16"),
]


@pytest.mark.parametrize("shape, dim, K, dtype, block_k", GATHER_CASES)
def test_gather_tokens(request, shape, dim, K, dtype, block_k):
    g = gen(request.node.callspec.id)
    B, H = shape[:2]
    T = shape[dim]
    if dtype == torch.bool:
        x = torch.rand(shape, generator=g) > 0.5
    elif dtype.is_floating_point:
        x = torch.randn(shape, generator=g).to(dtype)
        x.view(-1)[::7] = float("nan")  # NaN payloads and signed zeros must survive the copy bit for bit
        x.view(-1)[3::11] = -0.0
    else:
        x = torch.randint(-1, 1000, shape, generator=g, dtype=dtype)
    # kept slots: a random ascending subset per row, as select_keep gives
    index = torch.rand(B, H, T, generator=g).argsort(-1)[..., :K].sort(-1).values
    expected = ref.gather_tokens_reference(x, index, dim)
    with poisoned():
        actual = gather_tokens(x.to(DEVICE), index.to(DEVICE), dim, block_k=block_k)
    assert actual.dtype == x.dtype and actual.shape == expected.shape
    actual = actual.cpu()
    # torch's own CPU gather rewrites bf16 NaN payloads (0x7FC0 -> 0xFFFF), so a NaN need only stay a NaN
    nan = expected.isnan() if dtype.is_floating_point else torch.zeros_like(expected, dtype=torch.bool)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    assert torch.equal(actual.isnan() if dtype.is_floating_point else nan, nan), "NaNs moved"
    assert torch.equal(actual.view(bits)[~nan], expected.view(bits)[~nan]), "gathered values are not bitwise equal"


@pytest.mark.parametrize("shape, dim, K, T_out", [
    pytest.param((2, 2, 17, 64), -2, 8, 30, id="kv-B2-H2-T17-D64-K8-out30"),
    pytest.param((1, 4, 100, 128), -2, 37, 37, id="kv-B1-H4-T100-D128-K37-out37"),
    pytest.param((2, 4, 100), -1, 36, 61, id="positions-B2-H4-T100-K36-out61"),
])
@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_gather_tokens_into_a_buffer(request, shape, dim, K, T_out, impl):
    """``out=``: the kept slots go to the first K slots of a larger buffer (the cache's compaction); the rest of
    the buffer is left as it was."""
    g = gen(request.node.callspec.id)
    B, H = shape[:2]
    x = torch.randn(shape, generator=g) if len(shape) == 4 else torch.randint(0, 1000, shape, generator=g)
    index = torch.rand(B, H, shape[dim], generator=g).argsort(-1)[..., :K].sort(-1).values
    out_shape = list(shape)
    out_shape[dim] = T_out
    out = torch.full(out_shape, -7, dtype=x.dtype, device=DEVICE)
    fn = gather_tokens if impl == "triton" else ref.gather_tokens_reference
    result = fn(x.to(DEVICE), index.to(DEVICE), dim, out)
    assert result.data_ptr() == out.data_ptr()  # a view of out, written in place
    expected = ref.gather_tokens_reference(x, index, dim)
    out = out.cpu()
    assert torch.equal(out.narrow(dim, 0, K), expected)
    assert (out.narrow(dim, K, T_out - K) == -7).all(), "slots past K were written"


def test_gather_tokens_refuses_a_bad_out():
    x = torch.randn(1, 2, 9, 8)
    index = torch.tensor([[[0, 3, 5]] * 2])
    with pytest.raises(ValueError, match="shaped like x"):
        gather_tokens(x, index, -2, torch.empty(1, 2, 2, 8))
    with pytest.raises(ValueError, match="shaped like x"):
        gather_tokens(x, index, -2, torch.empty(1, 2, 9, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="must not share memory"):
        gather_tokens(x, index, -2, x)
    with pytest.raises(ValueError, match="contiguous"):
        gather_tokens(x, index, -2, torch.empty(1, 2, 8, 9).transpose(-1, -2))


# -- decode_attention -----------------------------------------------------------------------------------------

ATTENTION_CASES = [  # B, H, G, T, D, dtype, reduce, block_t, split_t, passes (None: the launcher's choice, 1 here)
    pytest.param(1, 1, 1, 1, 64, torch.float32, "mean", None, None, None, id="B1-H1-G1-T1-D64-fp32-mean"),
    pytest.param(2, 2, 1, 17, 64, torch.float32, "max", None, None, None, id="B2-H2-G1-T17-D64-fp32-max"),
    pytest.param(2, 1, 4, 63, 128, torch.float32, "mean", 16, 32, None, id="B2-H1-G4-T63-D128-fp32-mean-split32"),
    pytest.param(2, 1, 4, 63, 128, torch.float32, "mean", 16, 32, 2, id="B2-H1-G4-T63-D128-fp32-mean-split32-2pass"),
    pytest.param(1, 2, 4, 100, 64, torch.bfloat16, "max", 32, 64, 2, id="B1-H2-G4-T100-D64-bf16-max-split64-2pass"),
    pytest.param(2, 1, 8, 100, 128, torch.bfloat16, "mean", 64, 64, None, id="B2-H1-G8-T100-D128-bf16-mean-split64"),
    pytest.param(1, 1, 8, 17, 128, torch.float32, "max", 16, 16, None, id="B1-H1-G8-T17-D128-fp32-max-split16"),
    pytest.param(2, 2, 1, 63, 128, torch.bfloat16, "mean", None, None, None, id="B2-H2-G1-T63-D128-bf16-mean"),
    # fp16: the 16-bit dots (q @ K^T and P @ V as stored) also in the interpreter, which cannot multiply bf16
    pytest.param(2, 2, 4, 100, 128, torch.float16, "max", 32, 64, 2, id="B2-H2-G4-T100-D128-fp16-max-split64-2pass"),
    pytest.param(2, 2, 4, 100, 128, torch.float16, "max", 32, 32, None, id="B2-H2-G4-T100-D128-fp16-max-split32"),
    pytest.param(1, 1, 8, 33, 64, torch.float16, "mean", None, None, None, id="B1-H1-G8-T33-D64-fp16-mean"),
    # both reductions, [B, H, 2, T] (the learned policy's feature tracker reads the two)
    pytest.param(2, 2, 4, 63, 64, torch.float32, "mean+max", 16, 32, None, id="B2-H2-G4-T63-D64-fp32-meanmax-split32"),
    pytest.param(1, 2, 8, 100, 128, torch.float16, "mean+max", 32, 64, 2,
                 id="B1-H2-G8-T100-D128-fp16-meanmax-split64-2pass"),
    # no probabilities: the output alone (a policy that reads no attention, the full cache)
    pytest.param(2, 2, 4, 63, 64, torch.float32, None, 16, 32, None, id="B2-H2-G4-T63-D64-fp32-none-split32"),
    pytest.param(2, 1, 8, 100, 128, torch.float16, None, 32, 64, None, id="B2-H1-G8-T100-D128-fp16-none-split64"),
]


def attention_inputs(g, B, H, G, T, D, dtype):
    """HF-layout query (a transposed view), keys/values, gapped and left-padded key positions, and query
    positions: row 0 sees every key, row 1 (if any) only about half of its keys."""
    query = torch.randn(B, 1, G * H, D, generator=g).to(dtype).transpose(1, 2)  # [B, Hq, 1, D], not contiguous
    key = torch.randn(B, H, T, D, generator=g).to(dtype)
    value = torch.randn(B, H, T, D, generator=g).to(dtype)
    key_pos = make_positions(B, H, T, g)
    query_pos = key_pos.amax(dim=(1, 2)).clone()
    if B >= 2:
        query_pos[1] = key_pos[1, 0, T // 2]
    return query, key, value, key_pos, query_pos


@pytest.mark.parametrize("B, H, G, T, D, dtype, reduce, block_t, split_t, passes", ATTENTION_CASES)
def test_decode_attention(request, B, H, G, T, D, dtype, reduce, block_t, split_t, passes):
    g = gen(request.node.callspec.id)
    q, k, v, kp, qp = attention_inputs(g, B, H, G, T, D, dtype)
    out_ref, probs_ref = ref.decode_attention_reference(q.float(), k.float(), v.float(), kp, qp, None, reduce)
    with poisoned():
        out, probs = decode_attention(
            *(t.to(DEVICE) for t in (q, k, v, kp, qp)), None, reduce, block_t=block_t, split_t=split_t, passes=passes
        )
    assert out.dtype == dtype and out.shape == (B, 1, G * H, D)
    assert_close("output", out_ref, out, *TOL[dtype])
    if reduce is None:
        assert probs is None and probs_ref is None
        return
    assert probs.dtype == torch.float32 and probs.shape == (B, H, *((2,) if reduce == "mean+max" else ()), T)
    assert_close("probs", probs_ref, probs, 1e-5, 1e-4)


def test_decode_attention_schedule_by_bytes():
    """The launcher reads K once unless the one pass's scores (8 G bytes a slot) outweigh a second read of K."""
    from learnkv.kernels.decode_attn import one_pass

    assert one_pass(7, 128, 2, "mean") and one_pass(4, 64, 2, "mean+max")  # Qwen2.5-7B; SmolLM2 in bf16
    assert not one_pass(71, 64, 2, "mean") and one_pass(71, 64, 2, None)  # Falcon-7B's multi-query attention
    q, k, v, kp, qp = attention_inputs(gen("schedule"), 1, 1, 4, 20, 64, torch.float32)
    with pytest.raises(ValueError, match="passes must be 1 or 2"):
        decode_attention(q, k, v, kp, qp, None, None, passes=2)


@pytest.mark.parametrize("reduce", ["mean", "mean+max"])
def test_one_and_two_passes_hand_the_same_probabilities(reduce):
    """Both schedules normalise the same scores with the same statistics in the same order: the same probabilities
    bit for bit (with a window, softcapping, sinks, several splits and a padding query); the outputs differ only in
    rounding (the one pass rescales its partial sums)."""
    g = gen(f"passes-{reduce}")
    q, k, v, kp, qp = attention_inputs(g, 3, 2, 4, 70, 64, torch.float32)
    qp[2] = -1
    terms = dict(window=20, softcap=3.0, sinks=torch.randn(8, generator=g))
    runs = [decode_attention(*(t.to(DEVICE) for t in (q, k, v, kp, qp)), None, reduce, block_t=16, split_t=32,
                             passes=passes, **{n: t.to(DEVICE) if torch.is_tensor(t) else t for n, t in terms.items()})
            for passes in (1, 2)]  # fmt: skip
    assert torch.equal(runs[0][1], runs[1][1])
    assert_close("output", runs[1][0], runs[0][0], *TOL[torch.float32])


def test_decode_attention_padding_rows():
    """A query that sees no key attends uniformly (as learnkv attention does); a padding query hands zero probs."""
    g = gen("padding-rows")
    q, k, v, kp, _ = attention_inputs(g, 2, 1, 4, 20, 64, torch.float32)
    qp = torch.tensor([-5, -1])  # row 0 sees no key, row 1 is padding
    out_ref, probs_ref = ref.decode_attention_reference(q, k, v, kp, qp)
    out, probs = decode_attention(*(t.to(DEVICE) for t in (q, k, v, kp, qp)), block_t=16, split_t=16)
    assert_close("output", out_ref, out, *TOL[torch.float32])
    assert_close("probs", probs_ref, probs, 1e-6, 1e-5)
    assert torch.allclose(out_ref[0, 0], v[0].mean(dim=1).repeat_interleave(4, dim=0), atol=1e-5)


@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("where", ["query-head", "key"])
@pytest.mark.parametrize("reduce", ["mean", "max", "mean+max"])
def test_decode_attention_nan_parity(reduce, where, passes):
    """A NaN in one query head (the group's other heads and its 16-row padding stay finite) or in one visible key
    reaches the output and the reduced probabilities where it does in torch: ``reduce="max"`` must not drop it."""
    g = gen(f"nan-{reduce}-{where}")
    q, k, v, kp, qp = attention_inputs(g, 2, 2, 4, 40, 64, torch.float32)
    if where == "query-head":
        q[0, 5, 0, 3] = float("nan")  # KV head 1's second query head
    else:
        k[1, 0, 10, 7] = float("nan")  # a key row 1 sees (it sees about half of its keys)
    out_ref, probs_ref = ref.decode_attention_reference(q, k, v, kp, qp, None, reduce)
    with poisoned():
        out, probs = decode_attention(*(t.to(DEVICE) for t in (q, k, v, kp, qp)), None, reduce, block_t=16, split_t=32,
                                      passes=passes)  # fmt: skip
    assert_nan_parity("output", out_ref, out, *TOL[torch.float32])
    assert_nan_parity("probs", probs_ref, probs, 1e-5, 1e-4)


@pytest.mark.parametrize("reduce", ["mean", "max", "mean+max"])
def test_reference_matches_learnkv_attention(reduce):
    """The reference is `learnkv_attention` at q = 1: same output, same statistic handed to the cache."""
    from learnkv.attention import learnkv_attention

    g = gen(f"learnkv-{reduce}")
    q, k, v, kp, qp = attention_inputs(g, 3, 2, 4, 33, 64, torch.float32)
    seen = {}
    policy = SimpleNamespace(evicts=True, needs_attention=True, group_reduce=reduce, obs_window=1, needs_sq_sum=False)
    cache = SimpleNamespace(
        policy=policy,
        step_positions=qp[:, None],
        layer_positions=lambda layer: kp,
        observe=lambda layer, **stats: seen.update(stats),
    )
    out, _ = learnkv_attention(SimpleNamespace(layer_idx=0), q, k, v, None, 0.125, learnkv_cache=cache)
    out_ref, probs_ref = ref.decode_attention_reference(q, k, v, kp, qp, 0.125, reduce)
    assert_close("output", out, out_ref, 1e-5, 1e-5)
    assert_close("probs", seen["attn_sum"], probs_ref, 1e-6, 1e-5)


MODEL_TERMS = [  # window, softcap, sinks: what a model's attention module may hand over (Mistral, Gemma 2, GPT-OSS)
    pytest.param(8, None, False, id="window8"),
    pytest.param(None, 5.0, False, id="softcap5"),
    pytest.param(None, None, True, id="sinks"),
    pytest.param(5, 2.0, True, id="window5-softcap2-sinks"),
]


@pytest.mark.parametrize("dtype, passes", [pytest.param(torch.float32, 1, id="dtype0"),  # the ids seed the inputs
                                           pytest.param(torch.bfloat16, 2, id="dtype1")])  # fmt: skip
@pytest.mark.parametrize("window, softcap, sinks", MODEL_TERMS)
def test_decode_attention_model_terms(request, window, softcap, sinks, dtype, passes):
    """The launcher honours a sliding window, softcapping and sink logits as the reference does (two T splits, so
    the sinks join the normaliser combined over splits), in either schedule, and without probabilities (the output
    alone, what the full cache of such a model asks for)."""
    g = gen(request.node.callspec.id)
    q, k, v, kp, qp = attention_inputs(g, 2, 2, 4, 40, 64, dtype)
    k = k * 4  # peaked scores: softcapping changes them
    terms = dict(window=window, softcap=softcap, sinks=torch.randn(8, generator=g) * 3 if sinks else None)
    out_ref, probs_ref = ref.decode_attention_reference(q.float(), k.float(), v.float(), kp, qp, None, "mean", **terms)
    plain_ref, _ = ref.decode_attention_reference(q.float(), k.float(), v.float(), kp, qp)
    assert (out_ref - plain_ref).abs().max() > 1e-2  # the terms matter on these inputs
    inputs = [t.to(DEVICE) for t in (q, k, v, kp, qp)]
    terms = {n: t.to(DEVICE) if torch.is_tensor(t) else t for n, t in terms.items()}
    with poisoned():
        out, probs = decode_attention(*inputs, None, "mean", block_t=16, split_t=32, passes=passes, **terms)
        alone, none = decode_attention(*inputs, None, None, block_t=16, split_t=32, **terms)
    assert_close("output", out_ref, out, *TOL[dtype])
    assert_close("probs", probs_ref, probs, 1e-5, 1e-4)
    assert none is None
    assert_close("output alone", out_ref, alone, *TOL[dtype])


@pytest.mark.parametrize("window, softcap, sinks", MODEL_TERMS)
def test_reference_matches_learnkv_attention_with_model_terms(window, softcap, sinks):
    """The reference and `learnkv_attention` agree with a window, softcapping and sinks too."""
    from learnkv.attention import learnkv_attention

    g = gen(f"learnkv-terms-{window}-{softcap}-{sinks}")
    q, k, v, kp, qp = attention_inputs(g, 3, 2, 4, 33, 64, torch.float32)
    s_aux = torch.randn(8, generator=g) if sinks else None
    seen = {}
    policy = SimpleNamespace(evicts=True, needs_attention=True, group_reduce="mean", obs_window=1, needs_sq_sum=False)
    cache = SimpleNamespace(policy=policy, step_positions=qp[:, None], layer_positions=lambda layer: kp,
                            observe=lambda layer, **stats: seen.update(stats))
    out, _ = learnkv_attention(SimpleNamespace(layer_idx=0), q, k, v, None, 0.125, learnkv_cache=cache,
                               sliding_window=window, softcap=softcap, s_aux=s_aux)
    out_ref, probs_ref = ref.decode_attention_reference(q, k, v, kp, qp, 0.125, window=window, softcap=softcap,
                                                        sinks=s_aux)
    assert_close("output", out, out_ref, 1e-5, 1e-5)
    assert_close("probs", seen["attn_sum"], probs_ref, 1e-6, 1e-5)


# -- block_scores ---------------------------------------------------------------------------------------------

BLOCK_CASES = [  # B, H, T, D, block_size, dtype, blocks per program
    pytest.param(1, 1, 1, 64, 1, torch.float32, None, id="B1-H1-T1-D64-bs1"),
    pytest.param(2, 2, 17, 64, 16, torch.float32, None, id="B2-H2-T17-D64-bs16"),
    pytest.param(2, 4, 63, 128, 16, torch.bfloat16, None, id="B2-H4-T63-D128-bs16-bf16"),
    pytest.param(1, 8, 100, 128, 16, torch.float32, None, id="B1-H8-T100-D128-bs16"),
    pytest.param(2, 2, 100, 60, 5, torch.bfloat16, None, id="B2-H2-T100-D60-bs5-bf16"),
    pytest.param(1, 2, 15, 64, 16, torch.float32, None, id="B1-H2-T15-D64-bs16-noblock"),
    pytest.param(2, 2, 100, 64, 16, torch.float32, 2, id="B2-H2-T100-D64-bs16-chunk2"),
]


@pytest.mark.parametrize("B, H, T, D, block_size, dtype, block_nb", BLOCK_CASES)
def test_block_scores(request, B, H, T, D, block_size, dtype, block_nb):
    g = gen(request.node.callspec.id)
    k = torch.randn(B, H, T, D, generator=g).to(dtype)
    v = torch.randn(B, H, T, D, generator=g).to(dtype)
    k[..., 0, :] = 0  # a zero key: its norm is clamped at 1e-6
    expected = ref.block_scores_reference(k.float(), v.float(), block_size)
    with poisoned():
        actual = block_scores(k.to(DEVICE), v.to(DEVICE), block_size, block_nb=block_nb)
    assert_close("block scores", expected, actual, 1e-5, 1e-5)


def test_block_scores_nan_parity():
    """A NaN key element gives its token (and block) a NaN score, as the reference's clamp does."""
    g = gen("block-nan")
    k, v = torch.randn(2, 2, 40, 32, generator=g), torch.randn(2, 2, 40, 32, generator=g)
    k[1, 1, 21, 3] = float("nan")
    for bs in (1, 16):
        expected = ref.block_scores_reference(k, v, bs)
        assert_nan_parity(f"block {bs}", expected, block_scores(k.to(DEVICE), v.to(DEVICE), bs), 1e-5, 1e-5)


def test_block_scores_match_paged_policy():
    """The reference is PagedEviction's token score, block-averaged."""
    from learnkv.policies.base import LayerView
    from learnkv.policies.paged import PagedEviction

    g = gen("paged")
    k, v = torch.randn(2, 3, 40, 32, generator=g), torch.randn(2, 3, 40, 32, generator=g)
    view = LayerView(layer=0, step=1, keys=k, values=v, positions=torch.arange(40).expand(2, 3, 40), n_new=1)
    token = PagedEviction().score(view)[:, 0]  # [B, T], identical over heads
    expected = token[:, :32].reshape(2, 2, 16).mean(-1)
    assert_close("paged", expected, ref.block_scores_reference(k, v, 16), 1e-6, 1e-6)


# -- on a real GPU only: large shapes; and GPU compilation checked without one ------------------------------------


@gpu_only
@pytest.mark.parametrize("T", [4097, 16384])
def test_large_shapes_gpu(T):
    g = gen(f"gpu-{T}")
    B, H, G, D = 4, 8, 4, 128
    q, k, v, kp, qp = (t.to(DEVICE) for t in attention_inputs(g, B, H, G, T, D, torch.bfloat16))
    out_ref, probs_ref = ref.decode_attention_reference(q.float(), k.float(), v.float(), kp, qp)
    out, probs = decode_attention(q, k, v, kp, qp)
    assert_close("output", out_ref, out, *TOL[torch.bfloat16])
    assert_close("probs", probs_ref, probs, 1e-5, 1e-4)
    scores = torch.randn(B, H, T, device=DEVICE)
    for bs in (1, 16):
        kept = select_keep(scores, kp, T // 2, 4, 64, bs)
        assert torch.equal(kept, ref.select_keep_reference(scores, kp, T // 2, 4, 64, bs))
    # block mode lists -1 (no slot) first in a row that keeps fewer slots; the cache gathers slot 0 there and marks
    # it dead (learnkv/slots.py), so the gather kernels only ever see indices in [0, T)
    kept = kept.clamp(min=0)
    assert torch.equal(gather_tokens(k, kept, -2), ref.gather_tokens_reference(k, kept, -2))
    assert_close("blocks", ref.block_scores_reference(k.float(), v.float(), 16), block_scores(k, v, 16), 1e-4, 1e-4)


COMPILE = """
from learnkv.kernels import block_score, compact, decode_attn, select

for bs in (1, 16):
    build(select._priority_kernel, dict(IDX_BITS=15, BLOCK_N=1024 // bs, BLOCK_S=bs, BLOCK_T=1024),
          select.CUDA_WARPS_PRIORITY,
          scores_ptr="*bf16", pos_ptr="*i64", key_ptr="*i64", sink_ptr="*i64", recent_ptr="*i64",
          first_ptr="*i64", nfull_ptr="*i64")
    build(select._select_kernel, dict(N_PASSES=12, RADIX_BITS=4, BLOCK_N=1024 // bs, BLOCK_S=bs),
          select.CUDA_WARPS_SELECT,
          key_ptr="*i64", out_ptr="*i64", keep_ptr="*i64", first_ptr="*i64", nfull_ptr="*i64")
for dt in ("*bf16", "*fp32"):
    build(select._one_drop_kernel, dict(IDX_BITS=select.ONE_DROP_IDX_BITS, NO_KEY=select.NO_KEY, BLOCK_T=1024),
          select.CUDA_WARPS_ONE_DROP, scores_ptr=dt, pos_ptr="*i64", keep_ptr="*i64", sink_ptr="*i64",
          recent_ptr="*i64")
build(compact._gather_kernel, dict(BLOCK_K=16, BLOCK_R=128), x_ptr="*i16", idx_ptr="*i64", out_ptr="*i16")
build(compact._gather_kernel, dict(BLOCK_K=1024, BLOCK_R=1), x_ptr="*i64", idx_ptr="*i64", out_ptr="*i64")
for bs in (1, 16, 32, 64, 256):  # block 1: the paged policy's token scores; from 32 x D 128 on, chunked over D
    bd = min(128, max(1, block_score.CUDA_TILE // bs))
    build(block_score._block_scores_kernel, dict(BLOCK_NB=max(1, block_score.CUDA_TILE // (bs * bd)), BLOCK_S=bs,
          BLOCK_D=bd), block_score.CUDA_WARPS, nan=True, k_ptr="*bf16", v_ptr="*bf16", out_ptr="*fp32")
for dt, bt in (("*bf16", 64), ("*fp16", 64), ("*fp32", 32)):
    ptrs = dict(q_ptr=dt, k_ptr=dt, v_ptr=dt, kpos_ptr="*i64", qpos_ptr="*i64", m_ptr="*fp32", l_ptr="*fp32",
                probs_ptr="*fp32", acc_ptr="*fp32", sinks_ptr="*fp32", scaling="fp32", softcap="fp32")
    terms = dt == "*bf16"  # a sliding window, softcapping and sinks in one build, none in the others
    consts = dict(BLOCK_G=16, BLOCK_T=bt, BLOCK_D=128, PRECISION="ieee", F32=dt == "*fp32", WINDOWED=terms,
                  SOFTCAP=terms)
    warps = decode_attn.cuda_warps(128)
    for pv, logits in ((False, False), (True, True), (True, False)):  # the two passes' first; the one pass
        build(decode_attn._split_kernel, dict(consts, PV=pv, LOGITS=logits), warps, nan=True, logits_ptr="*fp32",
              **ptrs)
    for reduce_mean, reduce_max in ((True, False), (False, True), (True, True)):
        build(decode_attn._probs_pv_kernel, dict(consts, REDUCE_MEAN=reduce_mean, REDUCE_MAX=reduce_max, SINKS=terms),
              warps, nan=True, **ptrs)
        build(decode_attn._probs_kernel, dict(REDUCE_MEAN=reduce_mean, REDUCE_MAX=reduce_max, BLOCK_G=16,
              BLOCK_T=bt, SINKS=terms), warps, nan=True, logits_ptr="*fp32", **ptrs)
    for rescale in (True, False):
        build(decode_attn._combine_kernel, dict(BLOCK_G=16, BLOCK_D=128, RESCALE=rescale, SINKS=terms and rescale),
              warps, nan=True, **ptrs, out_ptr=dt)
print("compiled")
"""


def test_kernels_compile_for_h100():
    """Every kernel, in the configurations the launchers pick on CUDA, compiles to an sm_90 cubin with the
    ptxas bundled in the triton wheel, with no register spills, and the float maxima of block_score and
    decode_attn propagate NaN: no GPU needed, and the interpreter does not check this."""
    assert_compiles_for_h100(COMPILE)


# -- the package's place: inside learnkv, cheap to import ----------------------------------------------------------

PROBE = """
import json, sys
import learnkv.kernels as ours, torch
report = {"ours": ours.__file__, "triton_after_import": "triton" in sys.modules}
s = torch.randn(1, 2, 9)
p = torch.arange(9).expand(1, 2, 9)
i = ours.select_keep(s, p, 4, 1, 1)
ours.gather_tokens(torch.randn(1, 2, 9, 8), i, -2)
ours.block_scores(torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8), 4)
kv = torch.randn(1, 2, 9, 8)
ours.decode_attention(torch.randn(1, 4, 1, 8), kv, kv, p, torch.tensor([8]))
report["triton_after_cpu_calls"] = "triton" in sys.modules
import importlib.metadata
import transformers.integrations.hub_kernels  # imports Hugging Face's `kernels` where it is installed (model loading)
try:
    theirs = importlib.metadata.distribution("kernels").locate_file("kernels/__init__.py")
    report["hub_kernels_installed"] = str(theirs)
except importlib.metadata.PackageNotFoundError:
    report["hub_kernels_installed"] = None
hub = sys.modules.get("kernels")
report["hub_kernels_module"] = str(getattr(hub, "__file__", "")) if hub is not None else None
print(json.dumps(report))
"""


def test_our_kernels_neither_shadow_hugging_face_kernels_nor_import_triton_on_cpu():
    """Our kernels live at `learnkv.kernels`: Hugging Face's top-level ``kernels``, which transformers 5.25 requires
    and imports, stays theirs (a top-level package of ours by that name made every `import transformers` fail);
    importing ours and calling it on CPU tensors imports no triton."""
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", PROBE], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["ours"].startswith(str(root / "learnkv" / "kernels")), report
    assert not report["triton_after_import"], report
    assert not report["triton_after_cpu_calls"], report
    if report["hub_kernels_installed"]:  # transformers >= 5.25 requires it: the import above must have found theirs
        assert report["hub_kernels_module"] == report["hub_kernels_installed"], report  # their file, not ours
    for folder in (root, root / "bench"):  # each is first on sys.path for its scripts
        assert not (folder / "kernels").exists() and not (folder / "kernels.py").exists(), \
            f"{folder}/kernels would shadow Hugging Face's package of that name"


def test_import_is_cheap():
    """`import learnkv.kernels` alone imports neither torch nor triton."""
    code = "import sys, learnkv.kernels; print(sorted({'torch', 'triton'} & set(sys.modules)))"
    res = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert res.returncode == 0 and res.stdout.strip() == "[]", (res.stdout, res.stderr)


def test_public_functions_not_shadowed_by_modules():
    """Importing every launcher module leaves the public dispatchers in place (a module named like a public
    function would replace it as an attribute of the package)."""
    from learnkv import kernels

    for name in kernels.__all__:
        assert callable(getattr(kernels, name)), f"kernels.{name} is {getattr(kernels, name)!r}"


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (TRITON_INTERPRET=0)")
@pytest.mark.parametrize("policy", ["h2o", "tova", "lazy", "paged", "streaming"])
def test_decode_loop_same_kept_sets_with_and_without_kernels_gpu(policy, monkeypatch):
    """The decode loop on CUDA: Triton kernels and torch references keep the same tokens."""
    from learnkv import generate
    from learnkv.model import tiny_model

    model = tiny_model(seed=0).cuda()
    ids = torch.randint(0, 256, (2, 60), generator=torch.Generator().manual_seed(0)).cuda()
    runs = []
    for backend in ("auto", "torch"):
        monkeypatch.setenv("LEARNKV_KERNELS", backend)
        kept = []
        generate(model, input_ids=ids, policy=policy, budget=40, max_new_tokens=30, **prefill_for(policy),
                 observer=lambda c: kept.append([layer.positions.cpu().clone() for layer in c.layers]))
        runs.append(kept)
    for step_a, step_b in zip(*runs):
        for a, b in zip(step_a, step_b):
            assert torch.equal(a, b)
