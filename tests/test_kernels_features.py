"""The fused decode-step feature kernel (`kernels.features.decode_features`) against its reference
(`FeatureTracker.update` then `.features`), and the two paths taking turns over a decode.

As in `tests/test_kernels_state.py`: on CPU the launcher runs under the Triton interpreter (`TRITON_INTERPRET=1`, set
by conftest); with a real GPU (``TRITON_INTERPRET=0``) the same tests run compiled on CUDA. Integer-valued state
(counts, steps, intervals) must match exactly, float state and features within tight tolerances. The state is
updated in place, so the state tensors are views into NaN-filled buffers (a write outside them shows), and the
features are allocated NaN-filled (an unwritten slot or column fails).
"""

import os

import pytest
import torch

from kernel_checks import assert_close, assert_compiles_for_h100, assert_nan_parity, gen, poisoned
from learnkv.kernels import reference as ref
from learnkv.features import FEATURES, NORMS, SPARE_ROWS, STATE, WINDOW, FeatureTracker, group_mean_max
from learnkv.sliding_rows import laid_out, window_view

pytest.importorskip("triton")
from learnkv.kernels.features import decode_features  # noqa: E402

CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
DEVICE = "cuda" if CUDA else "cpu"
EXACT = ("f.count", "f.last_high", "f.n_returns", "f.sum_interval", "f.last_interval", "f.max_interval")
#: fp32 sums; features: log1p and norms to a few ulps
STATE_TOL = (1e-7, 1e-6)
FEATURE_TOL = (1e-6, 4e-6)
N_LAYERS = 3

CASES = [  # B, H, G, T, D, step, keys/values dtype, layout, slots per program
    pytest.param(1, 1, 1, 1, 4, 1, torch.float32, "contiguous", None, id="B1-H1-G1-T1-t1"),
    pytest.param(2, 2, 4, 13, 8, 3, torch.float32, "contiguous", None, id="B2-H2-G4-T13-t3"),
    pytest.param(2, 2, 8, 13, 8, 15, torch.bfloat16, "strided", 8, id="B2-H2-G8-T13-t15-bf16-strided-chunk8"),
    pytest.param(1, 3, 4, 29, 16, 20, torch.float32, "strided", 8, id="B1-H3-G4-T29-t20-strided-chunk8"),
    pytest.param(2, 1, 1, 21, 6, 40, torch.bfloat16, "contiguous", None, id="B2-H1-G1-T21-D6-t40-bf16"),
    pytest.param(2, 2, 8, 17, 8, 7, torch.float32, "pad-query", 16, id="B2-H2-G8-T17-t7-padquery-chunk16"),
    pytest.param(1, 2, 4, 33, 8, 16, torch.bfloat16, "shared-pos", None, id="B1-H2-G4-T33-t16-bf16-sharedpos"),
]


def decode_inputs(g, B, H, G, T, D, step, dtype, layout, unreduced=False):
    """A decode step as the cache hands it: gapped left-padded positions with the step's token last, attention that
    sums to one over the visible slots (some of it exactly at and next to the uniform level, where "high" flips;
    G query heads per KV head, handed as their group mean and max unless ``unreduced``), and tracker state with
    integer counts and steps, zeros in the new slot and in window rows not filled yet."""
    pos = torch.randint(1, 3, (B, 1 if layout == "shared-pos" else H, T), generator=g).cumsum(-1) - 1
    pos[0, :, : min(3, T - 1)] = -1  # left padding, never the new slot
    if layout == "pad-query":
        pos[-1, :, -1] = -1  # a padding query row: it sees nothing
    pos = pos.expand(B, H, T) if layout == "shared-pos" else pos
    valid = pos >= 0
    attn = torch.rand(B, H, G, 1, T, generator=g) * valid[:, :, None, None]
    attn = attn / attn.sum(-1, keepdim=True).clamp(min=1e-9)
    n = valid.sum(-1).clamp(min=1)  # [B, H]
    uniform = (1.0 / n.float())[:, :, None, None, None]
    edge = torch.cat([uniform, torch.nextafter(uniform, torch.zeros(())), torch.nextafter(uniform, torch.ones(()))], -1)
    if T >= 4:
        attn[..., -4:-1] = edge.expand(B, H, G, 1, 3)
    keys = torch.randn(B, H, T, D, generator=g).to(dtype)
    values = torch.randn(B, H, T, D, generator=g).to(dtype)

    def ints(high):
        return torch.randint(0, max(high, 1), (B, H, T), generator=g).float()

    state = {
        "f.acc": torch.rand(B, H, T, generator=g) * step,
        "f.acc_sq": torch.rand(B, H, T, generator=g) * step / T,
        "f.count": ints(step + 1),
        "f.last_high": ints(step),
        "f.n_returns": ints(step // 2),
        "f.sum_interval": ints(step),
        "f.last_interval": ints(step),
        "f.max_interval": ints(step),
        "f.win": torch.rand(B, H, WINDOW, T, generator=g) / T,
    }
    state["f.win"][:, :, : max(WINDOW - step, 0)] = 0  # rows before the prefill's last query row
    for t in state.values():
        t[..., -1] = 0  # the cache appends zeros for the step's new slot
    return attn if unreduced else group_mean_max(attn), keys, values, pos, state


def nan_views(state):
    """Copies of the state as views into NaN-filled buffers: ``[B, H, T]`` inside ``[B, H, T + 2]``, and the window
    as the torch tracker leaves it after a step (the last WINDOW rows of ``[B, H, WINDOW + 1, T]``)."""
    views, buffers = {}, {}
    for name, t in state.items():
        if name == "f.win":
            buf = torch.full((t.shape[0], t.shape[1], t.shape[2] + 1, t.shape[3]), float("nan"), device=DEVICE)
            view = buf[:, :, 1:]
        else:
            buf = torch.full((*t.shape[:-1], t.shape[-1] + 2), float("nan"), device=DEVICE)
            view = buf[..., 1:-1]
        view.copy_(t)
        views[name], buffers[name] = view, buf
    return views, buffers


def window_rows(win, step):
    """The window's rows in order after ``step``, whether ``win`` keeps them so or among spare rows."""
    return window_view(win, WINDOW, win.shape[2] - WINDOW, step)


def check(expected_state, state, expected_feats, feats, where="", step=None):
    """The state and features against the reference's; with ``step``, the windows compared row by row in order
    (one of the two may keep its rows among spare rows)."""
    check_state(expected_state, state, where, step)
    assert feats.dtype == torch.float32 and feats.shape == expected_feats.shape
    for i, name in enumerate(FEATURES):
        assert_close(f"{where}feature {name}", expected_feats[..., i], feats[..., i], *FEATURE_TOL)


def check_state(expected_state, state, where="", step=None):
    """`check`'s state half."""
    for name in STATE:
        if name == "f.win" and step is not None:
            assert_close(f"{where}{name}", window_rows(expected_state[name], step), window_rows(state[name], step),
                         *STATE_TOL)
        elif name in EXACT:
            assert torch.equal(state[name].cpu(), expected_state[name]), f"{where}{name} differs"
        else:
            assert_close(f"{where}{name}", expected_state[name], state[name], *STATE_TOL)


@pytest.mark.parametrize("B, H, G, T, D, step, dtype, layout, block_t", CASES)
def test_decode_features(request, B, H, G, T, D, step, dtype, layout, block_t):
    g = gen(request.node.callspec.id)
    attn, keys, values, pos, state = decode_inputs(g, B, H, G, T, D, step, dtype, layout)
    expected, feats = run_case(attn, keys, values, pos, step, state, layout, block_t)
    assert (expected[~(pos >= 0)] == 0).all() and (feats[~(pos >= 0).to(DEVICE)] == 0).all()


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("step", [1, 9, 20])  # step 9: the window moves back to the top
def test_decode_features_window_among_spare_rows(request, step, layout):
    """The window kept among spare rows, as the learned policy's tracker keeps it (`learnkv.sliding_rows`): the
    kernel reads the rows where they are after the step before, writes the new one (and moves the window back to the
    top when due) as the reference does, and reads nothing outside the window (the spare rows hold 100, which would
    show in the window features)."""
    g = gen(request.node.callspec.id)
    attn, keys, values, pos, state = decode_inputs(g, 2, 2, 4, 13, 8, step, torch.float32, "contiguous")
    win = laid_out(state["f.win"], SPARE_ROWS, step - 1)
    outside = torch.ones(WINDOW + SPARE_ROWS, dtype=torch.bool)
    first = (step - 1) % (SPARE_ROWS + 1)
    outside[first : first + WINDOW] = False
    win[:, :, outside] = 100.0
    state["f.win"] = win
    expected, feats = run_case(attn, keys, values, pos, step, state, layout, None, spare=SPARE_ROWS)
    assert (feats[..., FEATURES.index("win_max")] < 3.0).all()  # log1p(100 n) > 7: no spare row was read


def run_case(attn, keys, values, pos, step, state, layout, block_t, spare=0):
    """The kernel and the reference on one decode step (the kernel's state strided inside NaN buffers for the
    "strided" layout, a NaN-poisoned output), checked against each other (`check`) and for writes outside the
    state; returns the reference's and the kernel's features."""
    expected_state = {n: t.clone() for n, t in state.items()}
    expected = ref.decode_features_reference(attn, keys, values, pos, 1, N_LAYERS, step, expected_state, spare)
    if layout == "strided":
        actual_state, buffers = nan_views(state)
    else:
        actual_state, buffers = {n: t.to(DEVICE) for n, t in state.items()}, {}
    tensors = [t.to(DEVICE) for t in (attn, keys, values, pos)]
    with poisoned():
        feats = decode_features(*tensors, 1, N_LAYERS, step, actual_state, spare, block_t=block_t)
    check(expected_state, actual_state, expected, feats)
    for name in NORMS if NORMS[0] in state else ():
        assert (expected_state[name] >= 0).all()
        assert_close(name, expected_state[name], actual_state[name], *FEATURE_TOL)
    for name, buf in buffers.items():
        edges = buf[:, :, 0] if name == "f.win" else buf[..., [0, -1]]
        assert edges.isnan().all(), f"{name}: a write outside the state tensor"
    return expected, feats


def with_norms(g, keys, values, state, unknown):
    """``state`` with the tracker's cached norms (`learnkv.features.NORMS`): known slots hold 1.5x their key's and
    value's norm (so a kernel that recomputes them instead of reading them fails), the new slot 0 (as the cache
    appends it), and with ``unknown`` a suffix of three slots and a few others -1 (not computed yet)."""
    state = dict(state)
    for name, x in zip(NORMS, (keys, values)):
        norm = x.float().norm(dim=-1) * 1.5
        if unknown:
            norm[..., -4:] = -1.0
            norm[torch.rand(norm.shape, generator=g) < 0.2] = -1.0
        norm[..., -1] = 0.0
        state[name] = norm
    return state


@pytest.mark.parametrize("unknown", [False, True], ids=["known", "unknown"])
@pytest.mark.parametrize("B, H, G, T, D, step, dtype, layout, block_t", CASES)
def test_decode_features_reads_the_cached_norms(request, B, H, G, T, D, step, dtype, layout, block_t, unknown):
    """With the norms in the state (the learned policy's tracker, ``cache_norms``) the kernel reads them, computes
    the new slot's and the unknown ones from the keys and values, and writes those into the state, as the reference
    does."""
    g = gen(request.node.callspec.id)
    attn, keys, values, pos, state = decode_inputs(g, B, H, G, T, D, step, dtype, layout)
    state = with_norms(g, keys, values, state, unknown)
    _, feats = run_case(attn, keys, values, pos, step, state, layout, block_t)
    read = (state[NORMS[0]] > 0) & (pos >= 0)  # known, not the new slot: the 1.5x values reach the features
    assert torch.equal(feats[..., FEATURES.index("key_norm")].cpu()[read], state[NORMS[0]][read])


@pytest.mark.parametrize("cached", [False, True], ids=["norms-computed", "norms-cached"])
@pytest.mark.parametrize("B, H, G, T, D, step, dtype, layout, block_t", CASES)
def test_decode_features_update_only(request, B, H, G, T, D, step, dtype, layout, block_t, cached):
    """``read_out=False`` (the learned policy's steps that score nothing): the state updated as the reference's
    update, no features, the new slot's cached norms left unknown (-1) as the tracker's update leaves them, the other
    norms untouched, nothing written outside the state."""
    g = gen(request.node.callspec.id)
    attn, keys, values, pos, state = decode_inputs(g, B, H, G, T, D, step, dtype, layout)
    if cached:
        state = with_norms(g, keys, values, state, unknown=True)
    expected_state = {n: t.clone() for n, t in state.items()}
    args = (1, N_LAYERS, step)
    assert ref.decode_features_reference(attn, keys, values, pos, *args, expected_state, read_out=False) is None
    if layout == "strided":
        actual_state, buffers = nan_views(state)
    else:
        actual_state, buffers = {n: t.to(DEVICE) for n, t in state.items()}, {}
    with poisoned():
        out = decode_features(*(t.to(DEVICE) for t in (attn, keys, values, pos)), *args, actual_state, block_t=block_t,
                              read_out=False)  # fmt: skip
    assert out is None
    check_state(expected_state, actual_state)
    for name in NORMS if cached else ():
        assert (expected_state[name][..., -1] == -1).all()
        assert torch.equal(actual_state[name].cpu(), expected_state[name]), name
    for name, buf in buffers.items():
        edges = buf[:, :, 0] if name == "f.win" else buf[..., [0, -1]]
        assert edges.isnan().all(), f"{name}: a write outside the state tensor"


def test_decode_features_nan_parity():
    """A NaN in one query head's attention, in a window row and in the interval state reaches the state and the
    features where it does in the tracker (group max, window max and std, the clamps): the GPU's plain ``max.f32``
    would drop it."""
    g = gen("features-nan")
    attn, keys, values, pos, state = decode_inputs(g, 2, 2, 4, 13, 8, 20, torch.float32, "contiguous", unreduced=True)
    attn[1, 0, 2, 0, 7] = float("nan")
    attn = group_mean_max(attn)
    state["f.win"][0, 1, 5, 9] = float("nan")
    state["f.max_interval"][0, 0, 10] = float("nan")
    state["f.count"][1, 1, 5] = float("nan")
    expected_state = {n: t.clone() for n, t in state.items()}
    expected = ref.decode_features_reference(attn, keys, values, pos, 1, N_LAYERS, 20, expected_state)
    actual_state = {n: t.to(DEVICE) for n, t in state.items()}
    feats = decode_features(*(t.to(DEVICE) for t in (attn, keys, values, pos)), 1, N_LAYERS, 20, actual_state)
    for name in ("f.acc", "f.acc_sq", "f.win", "f.max_interval"):
        assert_nan_parity(name, expected_state[name], actual_state[name], *STATE_TOL)
    for i, name in enumerate(FEATURES):
        if expected[..., i].isnan().any():
            assert_nan_parity(f"feature {name}", expected[..., i], feats[..., i], *FEATURE_TOL)
        else:
            assert_close(f"feature {name}", expected[..., i], feats[..., i], *FEATURE_TOL)
    nan_features = {FEATURES[i] for i in range(len(FEATURES)) if expected[..., i].isnan().any()}
    assert {"attn_gmax", "acc_std", "win_max", "win_std", "max_interval"} <= nan_features, nan_features


@pytest.mark.parametrize("prefill_spare, spare", [(0, 0), (SPARE_ROWS, SPARE_ROWS), (0, SPARE_ROWS)],
                         ids=["window", "spare-rows", "spare-rows-after-a-plain-prefill"])
@pytest.mark.parametrize("cached", [False, True], ids=["norms-computed", "norms-cached"])
def test_paths_take_turns_over_a_decode(cached, prefill_spare, spare):
    """Prefill with the tracker, then decode steps alternating kernel and reference on one growing state, against
    the tracker alone: either path can take over mid-run (same state layout), past the window filling up. With
    ``cached``, the tracker taking turns keeps the norms as state (the keys then persist from step to step, as a
    cache's do) and the features are those of the tracker that computes them. With ``spare``, it keeps its window
    among spare rows (the learned policy's layout), moving back to the top at steps 9 and 18; after a prefill that
    kept it in order, the first decode step lays it out (either path)."""
    g = gen("turns")
    B, H, G, T0, D = 2, 2, 4, 6, 4
    pos = torch.arange(T0).expand(B, H, T0).clone()
    pos[1, :, :2] = -1
    attn = group_mean_max(torch.rand(B, H, G, T0, T0, generator=g).softmax(-1))
    mine, theirs = {}, {}
    tracker = FeatureTracker(N_LAYERS)
    g_kv = gen("turns-prefill-kv")  # not from g: the attention drawn below stays the case it was
    keys, values = torch.randn(B, H, T0, D, generator=g_kv), torch.randn(B, H, T0, D, generator=g_kv)
    FeatureTracker(N_LAYERS, cache_norms=cached, spare_rows=prefill_spare).update(attn, pos, T0, 0, mine)
    assert mine["f.win"].shape[2] == WINDOW + prefill_spare
    tracker.update(attn, pos, T0, 0, theirs)
    for step in range(1, WINDOW + 3):
        pos = torch.cat([pos, torch.full((B, H, 1), T0 + step - 1)], dim=-1)
        T = pos.shape[-1]
        for st in (mine, theirs):
            for n, t in st.items():
                st[n] = torch.cat([t, t.new_zeros(*t.shape[:-1], 1)], dim=-1)
        attn = torch.rand(B, H, G, 1, T, generator=g) ** 4  # peaked: some tokens go high, come back
        attn = group_mean_max(attn / attn.sum(-1, keepdim=True))
        new_keys, new_values = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)
        if cached:  # the cached tokens' keys and values stay; the new one's is appended
            keys, values = torch.cat([keys, new_keys[..., -1:, :]], -2), torch.cat([values, new_values[..., -1:, :]], -2)
        else:
            keys, values = new_keys, new_values
        tracker.update(attn, pos, 1, step, theirs)
        expected = tracker.features(attn, keys, values, pos, 2, step, theirs)
        read_out = step % 3 != 1  # every third step the update only (the learned policy's steps between scores)
        if step % 2:
            on = {n: t.to(DEVICE) for n, t in mine.items()}
            feats = decode_features(*(t.to(DEVICE) for t in (attn, keys, values, pos)), 2, N_LAYERS, step, on, spare,
                                    read_out=read_out)  # fmt: skip
            mine = {n: t.cpu() for n, t in on.items()}
        else:
            feats = ref.decode_features_reference(attn, keys, values, pos, 2, N_LAYERS, step, mine, spare,
                                                  read_out=read_out)  # fmt: skip
        if read_out:
            check(theirs, mine, expected, feats, where=f"step {step}: ", step=step)
        else:
            assert feats is None
            check_state(theirs, mine, where=f"step {step}: ", step=step)
    assert theirs["f.n_returns"].sum() > 0, "no token ever came back: the recurrence went untested"
    assert (NORMS[0] in mine) == cached and mine["f.win"].shape[2] == WINDOW + spare


def test_decode_features_rejects_bad_arguments():
    g = gen("bad")
    attn, keys, values, pos, state = decode_inputs(g, 2, 2, 4, 9, 4, 3, torch.float32, "contiguous")
    with pytest.raises(ValueError, match="fp32"):
        decode_features(attn.bfloat16(), keys, values, pos, 0, N_LAYERS, 3, dict(state))
    with pytest.raises(ValueError, match="step >= 1"):
        decode_features(attn, keys, values, pos, 0, N_LAYERS, 0, dict(state))
    with pytest.raises(ValueError, match=r"\[B, H, 2, 1, T\]"):
        decode_features(attn.expand(-1, -1, -1, 2, -1), keys, values, pos, 0, N_LAYERS, 3, dict(state))
    unreduced = decode_inputs(g, 2, 2, 4, 9, 4, 3, torch.float32, "contiguous", unreduced=True)[0]
    for fn in (decode_features, ref.decode_features_reference):  # the group axis, not its mean and max
        with pytest.raises(ValueError, match=r"\[B, H, 2, 1, T\]"):
            fn(unreduced, keys, values, pos, 0, N_LAYERS, 3, dict(state))
    with pytest.raises(ValueError, match="lacks"):
        decode_features(attn, keys, values, pos, 0, N_LAYERS, 3, {n: t for n, t in state.items() if n != "f.win"})
    other = dict(state, **{"f.count": state["f.count"].transpose(0, 1).contiguous().transpose(0, 1)})
    with pytest.raises(ValueError, match="one layout"):
        decode_features(attn, keys, values, pos, 0, N_LAYERS, 3, other)
    spare_rows = dict(state, **{"f.win": laid_out(state["f.win"], SPARE_ROWS, 2)})
    with pytest.raises(ValueError, match="f.win"):  # a window among spare rows, passed as if it had none
        decode_features(attn, keys, values, pos, 0, N_LAYERS, 3, spare_rows)
    with pytest.raises(ValueError, match="step >= 1"):
        ref.decode_features_reference(attn, keys, values, pos, 0, N_LAYERS, 0, dict(state))


COMPILE = """
from learnkv.kernels import features

fn = features._decode_features_kernel
floats = ("n_win_f", "step_f", "layer_f")
for kv, cached, rewrite, read_out in (("*fp32", False, True, True), ("*bf16", False, True, True),
                                      ("*fp32", True, True, True), ("*bf16", True, True, True),
                                      ("*fp32", True, False, True), ("*bf16", True, False, True),
                                      ("*bf16", True, False, False), ("*bf16", False, True, False)):
    consts = dict(WIN=16, N_SINK=4, BLOCK_T=features.CUDA_BLOCK_T, BLOCK_D=features.CUDA_BLOCK_D, LIBDEVICE=True,
                  CACHED_NORMS=cached, REWRITE=rewrite, READ_OUT=read_out)
    types = {n: "fp32" if n in floats else "*fp32" for n in fn.arg_names if n in floats or n.endswith("_ptr")}
    types.update(key_ptr=kv, val_ptr=kv, pos_ptr="*i64")
    build(fn, consts, features.CUDA_WARPS, nan=True, options=features.LAUNCH_OPTIONS, **types)
print("compiled")
"""


def test_decode_features_kernel_compiles_for_h100():
    """The kernel in the configuration the launcher picks on CUDA (libdevice's log1p, a runtime branch per window
    row) compiles to an sm_90 cubin: the interpreter checks none of what the GPU compiler does."""
    assert_compiles_for_h100(COMPILE)
