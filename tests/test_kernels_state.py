"""The per-token state update and the scorer MLP kernels against their torch references, and the references
against the policies and the scorer they stand for.

As in `tests/test_kernels.py`: on CPU the launchers run under the Triton interpreter (`TRITON_INTERPRET=1`, set by
conftest); with a real GPU (``TRITON_INTERPRET=0``) the same tests run compiled on CUDA. Integer-valued state
(count, ts, mri) must match exactly, float state and scores within tight tolerances. The state update writes in
place, so its state tensors are views into NaN-filled buffers (a write outside them shows); the scorer's output is
allocated NaN-filled (an unwritten score fails).
"""

import os

import pytest
import torch

from learnkv.kernels import reference as ref
from kernel_checks import assert_close, assert_compiles_for_h100, assert_nan_parity, gen, poisoned

pytest.importorskip("triton")
from learnkv.kernels.scorer import scorer_mlp  # noqa: E402
from learnkv.kernels.state_update import update_token_state  # noqa: E402

CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
DEVICE = "cuda" if CUDA else "cpu"
#: (atol, rtol) for the fp32 state sums and, per feature dtype,
#: for the scorer (fp32 math on the same inputs either way; only the dot's summation order differs)
STATE_TOL = (1e-7, 1e-6)
SCORER_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-5, 1e-5)}
STATES = ("acc", "s1", "s2", "count", "ts", "mri")
EXACT = ("count", "ts", "mri")


def near_alpha(alpha: float) -> torch.Tensor:
    """fp32 alpha itself and its two fp32 neighbours: the activation test's edge."""
    a = torch.tensor(alpha, dtype=torch.float32)
    return torch.stack([a, torch.nextafter(a, torch.tensor(0.0)), torch.nextafter(a, torch.tensor(1.0))])


# -- update_token_state ---------------------------------------------------------------------------------------

ALPHA = 1e-4  # not an fp32 number: the threshold is compared in fp32, as torch does
STATE_CASES = [  # B, H, T, step, n_new, states, layout, slots per program
    pytest.param(1, 1, 1, 1, 1, STATES, "contiguous", None, id="B1-H1-T1-t1-all"),
    pytest.param(2, 3, 17, 1, 1, STATES, "contiguous", None, id="B2-H3-T17-t1-all"),
    pytest.param(2, 8, 63, 7, 1, STATES, "strided", 16, id="B2-H8-T63-t7-all-strided-chunk16"),
    pytest.param(3, 3, 100, 40, 1, STATES, "pad-query", 32, id="B3-H3-T100-t40-all-padquery-chunk32"),
    pytest.param(2, 1, 100, 99, 1, STATES, "shared-pos", None, id="B2-H1-T100-t99-all-sharedpos"),
    pytest.param(2, 3, 17, 0, 17, STATES, "contiguous", None, id="B2-H3-T17-t0-prefill"),
    pytest.param(1, 3, 17, 3, 2, STATES, "contiguous", 8, id="B1-H3-T17-t3-new2-chunk8"),
    pytest.param(2, 8, 63, 5, 1, ("acc",), "strided", None, id="B2-H8-T63-t5-h2o"),
    pytest.param(2, 3, 100, 9, 1, ("s1", "s2", "count"), "contiguous", 64, id="B2-H3-T100-t9-roco-chunk64"),
    pytest.param(2, 3, 63, 12, 1, ("ts", "mri"), "strided", None, id="B2-H3-T63-t12-lazy"),
    pytest.param(1, 8, 17, 2, 1, ("count",), "contiguous", None, id="B1-H8-T17-t2-count-only"),
]


def state_inputs(g, B, H, T, step, n_new, layout):
    """Attention (some group-max values at and next to alpha), gapped left-padded positions, and state as a
    decoding cache holds it (integer counts and steps, zero-filled new slots)."""
    pos = torch.randint(1, 3, (B, 1 if layout == "shared-pos" else H, T), generator=g).cumsum(-1) - 1
    pos[0, :, : min(3, T - 1 if step == 0 else T - n_new)] = -1  # left padding: among the new slots only at prefill
    if layout == "pad-query":
        pos[-1, :, -1] = -1  # a padding query row: it sees nothing
    pos = pos.expand(B, H, T) if layout == "shared-pos" else pos
    attn_mean = torch.rand(B, H, T, generator=g) / T
    attn_max = torch.rand(B, H, T, generator=g) * 2 * ALPHA
    edge = near_alpha(ALPHA)
    idx = torch.randint(0, T, (B, H, 6), generator=g)
    attn_max.scatter_(-1, idx, edge.repeat(2).expand(B, H, 6))
    if layout == "strided":  # the attention is a transposed view
        attn_mean = attn_mean.transpose(0, 1).contiguous().transpose(0, 1)
    old = T - n_new
    state = {
        "acc": torch.rand(B, H, T, generator=g) * step,
        "s1": torch.rand(B, H, T, generator=g) * step,
        "s2": torch.rand(B, H, T, generator=g) * step / T,
        "count": torch.randint(0, step + 1, (B, H, T), generator=g).float(),
        "ts": torch.randint(0, max(step, 1), (B, H, T), generator=g).float(),
        "mri": torch.randint(0, max(step, 1), (B, H, T), generator=g).float(),
    }
    for t in state.values():
        t[..., old:] = 0  # the cache appends zeros for the step's new slots
    return attn_mean, attn_max, pos, state


def in_nan_buffer(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A copy of ``t [B, H, T]`` as a view into a NaN-filled ``[B, H, T + 2]`` buffer, and the buffer."""
    buf = torch.full((*t.shape[:-1], t.shape[-1] + 2), float("nan"), device=DEVICE)
    view = buf[..., 1:-1]
    view.copy_(t)
    return view, buf


@pytest.mark.parametrize("B, H, T, step, n_new, names, layout, block_t", STATE_CASES)
def test_update_token_state(request, B, H, T, step, n_new, names, layout, block_t):
    g = gen(request.node.callspec.id)
    attn_mean, attn_max, pos, state = state_inputs(g, B, H, T, step, n_new, layout)
    expected = {n: state[n].clone() for n in names}
    ref.update_token_state_reference(attn_mean, attn_max, pos, step, n_new, ALPHA, **expected)

    actual, buffers = {}, {}
    for n in names:
        if layout == "strided":
            actual[n], buffers[n] = in_nan_buffer(state[n])
        else:
            actual[n] = state[n].to(DEVICE)
    update_token_state(attn_mean.to(DEVICE), attn_max.to(DEVICE), pos.to(DEVICE), step, n_new, ALPHA,
                       **actual, block_t=block_t)  # fmt: skip
    for n in names:
        if n in EXACT:
            assert torch.equal(actual[n].cpu(), expected[n]), f"{n} differs:\n{actual[n]}\n{expected[n]}"
        else:
            assert_close(n, expected[n], actual[n], *STATE_TOL)
        if n in buffers:
            edges = buffers[n][..., [0, -1]]
            assert edges.isnan().all(), f"{n}: a write outside the state tensor"
    if step == 0 and "ts" in names:  # the prefill observes nothing
        assert torch.equal(actual["ts"].cpu(), state["ts"]) and torch.equal(actual["mri"].cpu(), state["mri"])


def test_update_token_state_nan_parity():
    """NaN in the attention or the state stays NaN where torch keeps it: the sums, and LazyEviction's ``mri``
    through its maximum (a NaN ``ts`` or ``mri``), which the GPU's plain ``max.f32`` would drop."""
    g = gen("state-nan")
    attn_mean, attn_max, pos, state = state_inputs(g, 2, 3, 17, 5, 1, "contiguous")
    attn_mean[1, 2, 4] = float("nan")
    attn_max[0, 1, 9] = float("nan")
    state["ts"][0, 0, 6] = float("nan")
    state["mri"][1, 1, 8] = float("nan")
    expected = {n: t.clone() for n, t in state.items()}
    ref.update_token_state_reference(attn_mean, attn_max, pos, 5, 1, ALPHA, **expected)
    actual = {n: t.to(DEVICE) for n, t in state.items()}
    update_token_state(attn_mean.to(DEVICE), attn_max.to(DEVICE), pos.to(DEVICE), 5, 1, ALPHA, **actual)
    for n in ("acc", "s1", "s2", "ts", "mri"):
        assert_nan_parity(n, expected[n], actual[n], *((0, 0) if n in EXACT else STATE_TOL))
    assert torch.equal(actual["count"].cpu(), expected["count"])


@pytest.mark.parametrize("x", [0.0, 1e-4, 0.1, 1 / 3, 2 / 29, 0.999, 1.0, 3.4e38, -0.7])
def test_launchers_round_scalars_to_fp32_as_torch_does(x):
    """The launchers' fp32 rounding of a float scalar (``alpha``, the ``layer`` feature) without a torch tensor."""
    from learnkv.kernels.specialize import fp32

    assert fp32(x) == float(torch.tensor(x, dtype=torch.float32))


def test_update_token_state_rejects_bad_arguments():
    B, H, T = 2, 3, 5
    pos = torch.arange(T).expand(B, H, T).to(DEVICE)
    attn = torch.zeros(B, H, T, device=DEVICE)
    z = torch.zeros(B, H, T, device=DEVICE)
    with pytest.raises(ValueError, match="ts and mri"):
        update_token_state(attn, attn, pos, 1, 1, ALPHA, ts=z.clone())
    with pytest.raises(ValueError, match="ts and mri"):
        ref.update_token_state_reference(attn, attn, pos, 1, 1, ALPHA, mri=z.clone())
    with pytest.raises(ValueError, match="attn_mean"):
        update_token_state(None, attn, pos, 1, 1, ALPHA, acc=z.clone())
    with pytest.raises(ValueError, match="attn_max"):
        update_token_state(attn, None, pos, 1, 1, ALPHA, ts=z.clone(), mri=z.clone())
    with pytest.raises(ValueError, match="strides"):
        other_layout = z.transpose(0, 1).contiguous().transpose(0, 1)
        update_token_state(attn, attn, pos, 1, 1, ALPHA, acc=z.clone(), s1=other_layout)
    with pytest.raises(ValueError, match="fp32"):
        update_token_state(attn, attn, pos, 1, 1, ALPHA, count=z.long())
    update_token_state(None, None, pos, 1, 1, ALPHA)  # nothing to update: a no-op


def test_update_token_state_reference_matches_policies():
    """The reference is H2O's, RoCo's and LazyEviction's `update` over a few decode steps of a growing cache
    (one query per step, a left-padded row, attention exactly at alpha), state starting from the prefill's."""
    from learnkv.policies.base import LayerView
    from learnkv.policies.h2o import H2O
    from learnkv.policies.lazy import LazyEviction
    from learnkv.policies.roco import RoCo

    g = gen("policies")
    B, H, T0, alpha = 2, 3, 9, 5e-4
    h2o, roco, lazy = H2O(), RoCo(), LazyEviction(alpha=alpha)
    pos = torch.arange(T0).expand(B, H, T0).clone()
    pos[0, :, :4] = -1
    # the prefill (step 0): the policies create their state; the reference starts from the same
    attn = torch.rand(B, H, T0, generator=g)
    st = {name: {} for name in ("h2o", "roco", "lazy")}
    prefill = dict(layer=0, step=0, keys=torch.zeros(B, H, T0, 1), values=torch.zeros(B, H, T0, 1), positions=pos,
                   n_new=T0, attn=attn[:, :, None], attn_sum=attn, attn_sq_sum=attn * attn)  # fmt: skip
    for name, policy in (("h2o", h2o), ("roco", roco), ("lazy", lazy)):
        policy.update(LayerView(**prefill, state=st[name]))
    mine = {n: t.clone() for s in st.values() for n, t in s.items()}

    for step in range(1, 6):
        T = pos.shape[-1] + 1
        pos = torch.cat([pos, torch.full((B, H, 1), T0 + step - 1)], dim=-1)
        for s in (*st.values(), mine):  # the cache appends zeros for the new slot
            for n, t in s.items():
                s[n] = torch.cat([t, t.new_zeros(B, H, 1)], dim=-1)
        attn_mean = torch.rand(B, H, T, generator=g) / T
        attn_max = torch.rand(B, H, T, generator=g) * 2 * alpha
        attn_max[..., :3] = near_alpha(alpha)
        kv = torch.zeros(B, H, T, 1)
        h2o.update(LayerView(0, step, kv, kv, pos, 1, attn=attn_mean[:, :, None], attn_sum=attn_mean, state=st["h2o"]))
        roco.update(LayerView(0, step, kv, kv, pos, 1, attn=attn_mean[:, :, None], attn_sum=attn_mean,
                              attn_sq_sum=attn_mean * attn_mean, state=st["roco"]))  # fmt: skip
        lazy.update(LayerView(0, step, kv, kv, pos, 1, attn=attn_max[:, :, None], attn_sum=attn_max, state=st["lazy"]))
        ref.update_token_state_reference(attn_mean, attn_max, pos, step, 1, alpha, **mine)
        policy_state = {n: t for s in st.values() for n, t in s.items()}
        assert sorted(policy_state) == sorted(STATES)
        for n in STATES:
            assert torch.equal(mine[n], policy_state[n]), f"step {step}: {n} differs from the policy's"


# -- scorer_mlp -----------------------------------------------------------------------------------------------

SCORER_CASES = [  # N, F, hidden, feature dtype, layout, b2 as, tokens per program
    pytest.param(1, 19, 8, torch.float32, "contiguous", "0d", None, id="N1-F19-hd8"),
    pytest.param(37, 19, 32, torch.float32, "contiguous", "float", None, id="N37-F19-hd32-floatb2"),
    pytest.param(37, 19, 8, torch.bfloat16, "strided", "1elem", 16, id="N37-F19-hd8-bf16-strided-chunk16"),
    pytest.param(300, 19, 32, torch.float32, "strided", "0d", 64, id="N300-F19-hd32-strided-chunk64"),
    pytest.param(300, 19, 32, torch.bfloat16, "contiguous", "0d", None, id="N300-F19-hd32-bf16"),
    pytest.param(300, 19, 8, torch.float32, "transposed", "0d", 128, id="N300-F19-hd8-transposed-chunk128"),
]


def scorer_inputs(g, N, F, hidden, dtype, layout):
    """Features on several scales (as raw trace features are), and weights as a trained scorer might have."""
    scale = torch.logspace(-2, 3, F)
    x = torch.randn(N, F, generator=g) * scale + scale
    if layout == "strided":  # a column slice of a wider tensor
        x = torch.cat([x, torch.randn(N, 5, generator=g)], dim=-1)[:, :F]
    elif layout == "transposed":
        x = x.t().contiguous().t()
    mean = scale * (1 + 0.1 * torch.randn(F, generator=g))
    std = scale * (0.5 + torch.rand(F, generator=g))
    w1 = torch.randn(F, hidden, generator=g) * F**-0.5
    b1 = torch.randn(hidden, generator=g) * 0.1
    w2 = torch.randn(hidden, generator=g) * hidden**-0.5
    return x.to(dtype), mean, std, w1, b1, w2


@pytest.mark.parametrize("N, F, hidden, dtype, layout, b2_as, block_n", SCORER_CASES)
def test_scorer_mlp(request, N, F, hidden, dtype, layout, b2_as, block_n):
    g = gen(request.node.callspec.id)
    x, mean, std, w1, b1, w2 = scorer_inputs(g, N, F, hidden, dtype, layout)
    b2 = {"0d": torch.tensor(0.25), "1elem": torch.tensor([0.25]), "float": 0.25}[b2_as]
    expected = ref.scorer_mlp_reference(x, mean, std, w1, b1, w2, b2)
    dev = [t.to(DEVICE) for t in (x, mean, std, w1, b1, w2)]
    with poisoned():
        actual = scorer_mlp(*dev, b2.to(DEVICE) if isinstance(b2, torch.Tensor) else b2, block_n=block_n)
    assert actual.dtype == torch.float32 and actual.shape == (N,)
    assert_close("scores", expected, actual, *SCORER_TOL[dtype])


def test_scorer_mlp_reference_matches_scorer():
    """The reference is `Scorer.forward` with an int layer, exactly, and the kernel agrees with it."""
    from learnkv.scorer.model import Scorer

    torch.manual_seed(0)
    scorer = Scorer(n_layers=3, n_features=19, hidden=32)
    with torch.no_grad():
        scorer.b1.normal_(0, 0.1)
        scorer.b2.normal_(0, 0.1)
        scorer.set_normalization(torch.rand(19), torch.rand(19) + 0.1)
    feats = torch.randn(2, 3, 41, 19)  # [B, H, T, F], as the learned policy scores a layer
    with torch.no_grad():
        for layer in range(3):
            expected = scorer(feats, layer)
            args = (scorer.mean, scorer.std, scorer.w1[layer], scorer.b1[layer], scorer.w2[layer], scorer.b2[layer])
            mine = ref.scorer_mlp_reference(feats.reshape(-1, 19), *args).view(2, 3, 41)
            assert torch.equal(mine, expected), f"layer {layer}"
            actual = scorer_mlp(feats.reshape(-1, 19).to(DEVICE), *(t.to(DEVICE) for t in args)).view(2, 3, 41)
            assert_close(f"kernel, layer {layer}", expected, actual, *SCORER_TOL[torch.float32])


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (TRITON_INTERPRET=0)")
def test_scorer_forward_on_cuda_uses_the_kernel_and_agrees():
    """`Scorer.forward` with an int layer on CUDA (no grad) runs the kernel and matches its CPU path."""
    from learnkv.scorer.model import Scorer

    torch.manual_seed(1)
    scorer = Scorer(n_layers=2, n_features=19, hidden=32)
    feats = torch.randn(2, 3, 300, 19)
    with torch.no_grad():
        expected = scorer(feats, 1)
        actual = scorer.cuda()(feats.cuda(), 1)
    assert_close("scorer on cuda", expected, actual, *SCORER_TOL[torch.float32])


def test_scorer_mlp_rejects_bad_shapes():
    x, mean, std, w1, b1, w2 = scorer_inputs(gen("bad"), 4, 19, 8, torch.float32, "contiguous")
    with pytest.raises(ValueError, match="w1"):
        scorer_mlp(x, mean, std, w1[:-1], b1, w2, 0.0)
    with pytest.raises(ValueError, match="w2"):
        scorer_mlp(x, mean, std, w1, b1, w2[:-1], 0.0)
    with pytest.raises(ValueError, match="b2"):
        scorer_mlp(x, mean, std, w1, b1, w2, torch.zeros(2))
    assert scorer_mlp(x[:0], mean, std, w1, b1, w2, 0.0).shape == (0,)


def test_public_dispatch_on_cpu_is_the_reference():
    """`kernels.update_token_state` / `kernels.scorer_mlp` on CPU tensors run the references."""
    from learnkv import kernels

    g = gen("dispatch")
    attn_mean, attn_max, pos, state = state_inputs(g, 2, 3, 17, 4, 1, "contiguous")
    a = {n: t.clone() for n, t in state.items()}
    b = {n: t.clone() for n, t in state.items()}
    kernels.update_token_state(attn_mean, attn_max, pos, 4, 1, ALPHA, **a)
    ref.update_token_state_reference(attn_mean, attn_max, pos, 4, 1, ALPHA, **b)
    assert all(torch.equal(a[n], b[n]) for n in STATES)
    x, *params = scorer_inputs(g, 10, 19, 8, torch.float32, "contiguous")
    assert torch.equal(kernels.scorer_mlp(x, *params, 0.5), ref.scorer_mlp_reference(x, *params, 0.5))


COMPILE = """
from learnkv.kernels import scorer, state_update

ptrs = {n: "*fp32" for n in ("mean_ptr", "max_ptr", "acc_ptr", "s1_ptr", "s2_ptr", "count_ptr", "ts_ptr", "mri_ptr")}
opts = state_update.LAUNCH_OPTIONS
build(state_update._state_update_kernel, dict(HAS_ACC=True, HAS_S1=True, HAS_S2=True, HAS_COUNT=True, HAS_LAZY=True,
      BLOCK_T=1024), nan=True, options=opts, pos_ptr="*i64", step_f="fp32", alpha="fp32", **ptrs)
build(state_update._state_update_kernel, dict(HAS_ACC=True, HAS_S1=False, HAS_S2=False, HAS_COUNT=False,
      HAS_LAZY=False, BLOCK_T=1024), nan=True, options=opts, pos_ptr="*i64", step_f="fp32", alpha="fp32", **ptrs)
for x in ("*fp32", "*bf16"):
    build(scorer._scorer_mlp_kernel, dict(BLOCK_N=128, BLOCK_F=32, BLOCK_H=32), x_ptr=x,
          **{n: "*fp32" for n in ("mean_ptr", "std_ptr", "w1_ptr", "b1_ptr", "w2_ptr", "b2_ptr", "out_ptr")})
print("compiled")
"""


def test_state_and_scorer_kernels_compile_for_h100():
    """Both kernels, in the configurations the launchers pick on CUDA, compile to an sm_90 cubin (the
    interpreter checks none of what the GPU compiler does, e.g. tl.dot's minimum tile sizes)."""
    assert_compiles_for_h100(COMPILE)
