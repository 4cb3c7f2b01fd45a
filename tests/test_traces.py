"""Trace collection: schema round-trip, no look-ahead in features, labels, resumption, sharding, refusals."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from learnkv.features import FEATURES, N_FEATURES
from learnkv.policies.base import LayerView
from learnkv.prompts import Prompt
from learnkv.traces.collect import CollectConfig, collect, merge
from learnkv.traces.record import Recorder, resident
from learnkv.traces.store import TraceError, load_traces, read_manifest


def make_prompt(id, text, split):
    """A real `Prompt` record (a test double of it once drifted from the real type)."""
    return Prompt(id=id, source="test", text=text, answer="", split=split)


PROMPTS = [make_prompt(f"p{i}", t, split) for i, (t, split) in enumerate([
    ("Tom has 3 apples and buys 5 more. How many apples does he have?", "train"),
    ("A train travels 60 km per hour for 2 hours. How far does it go?", "validation"),
    ("What is 15 plus 27?", "test"),
    ("Sara reads 12 pages a day. How many pages in a week?", "train"),
])]
CFG = CollectConfig(prompts=4, max_new_tokens=24, decisions_per_prompt=2, horizon=6, prompts_per_shard=2, chat=False)


@pytest.fixture(scope="module")
def collected(small, tmp_path_factory):
    model, tok = small
    out = tmp_path_factory.mktemp("traces")
    manifest, stats = collect(out, CFG, model=model, tokenizer=tok, prompts=PROMPTS, progress=False)
    return out, manifest, stats


def test_shards_load_back_with_the_manifest_schema(collected):
    out, manifest, stats = collected
    assert manifest["complete"] and len(manifest["shards"]) == 2
    assert manifest["features"] == list(FEATURES) and manifest["horizon"] == CFG.horizon
    for entry in manifest["shards"]:
        assert set(entry) >= {"path", "rows", "sha256"}
    ds = load_traces(out)
    assert len(ds) == sum(s["rows"] for s in manifest["shards"]) == stats.rows
    assert len(ds) == 4 * 2 * 2 - 2 * stats.dropped_decisions  # prompts x decisions x layers
    row = ds[0]
    H, T = row["n_heads"], row["n_tokens"]
    assert len(row["features"]) == H * T * N_FEATURES
    for col in ["future_sum", "future_max", "future_out", "reenter", "positions"] + [f"teacher_{t}" for t in CFG.teachers]:
        assert len(row[col]) == H * T, col
    assert {r for r in ds["split"]} == {"train", "validation", "test"}
    assert len(load_traces(out, split="test")) == sum(1 for s in ds["split"] if s == "test")


def test_features_use_no_information_from_the_future(small):
    """Features at decision step t are identical when the run is truncated right after step t."""
    from learnkv.decode import generate

    model, _ = small
    ids = torch.randint(0, 1000, (1, 20), generator=torch.Generator().manual_seed(3))
    t = 7
    snaps = {}
    for new_tokens in (t + 1, 30):
        rec = Recorder(n_layers=2, teachers=("h2o", "lazy"), decision_steps=frozenset({t}), horizon=5)
        generate(model, input_ids=ids, policy=rec, max_new_tokens=new_tokens)
        snaps[new_tokens] = {(p.layer): p for p in rec.rows + rec._pending}
    for layer in (0, 1):
        short, long = snaps[t + 1][layer], snaps[30][layer]
        assert torch.equal(short.features, long.features)
        assert torch.equal(short.teachers["lazy"], long.teachers["lazy"])


def test_a_snapshot_holds_only_the_rows_that_decide_and_they_record_as_alone(small):
    """At length a whole batch per decision step does not fit in memory: each snapshot keeps its deciding rows only
    (values in float16, as the shard stores them), and what each row records equals its run alone."""
    from learnkv.decode import generate

    model, _ = small
    ids = torch.randint(0, 1000, (3, 12), generator=torch.Generator().manual_seed(5))
    steps = (frozenset({3, 9}), frozenset({3}), frozenset({6}))

    def recorder(decision_steps):
        return Recorder(n_layers=2, teachers=("h2o", "rkv"), decision_steps=decision_steps, horizon=4,
                        record_values=True)

    batched = recorder(steps)
    generate(model, input_ids=ids, policy=batched, max_new_tokens=16)
    held = {(p.step, p.layer): p for p in batched.rows}
    assert {k: p.rows for k, p in held.items()} == {(3, 0): [0, 1], (3, 1): [0, 1], (6, 0): [2], (6, 1): [2],
                                                     (9, 0): [0], (9, 1): [0]}
    for p in held.values():
        assert p.values.dtype == torch.float16
        tensors = [p.positions, p.features, p.values, *p.teachers.values(), *p.labels.values()]
        assert {t.shape[0] for t in tensors} == {len(p.rows)}
    for row in range(3):
        alone = recorder(steps[row])
        generate(model, input_ids=ids[row:row + 1], policy=alone, max_new_tokens=16)
        mine, theirs = batched.decisions(row, 16), alone.decisions(0, 16)
        assert [(d.step, d.layer) for d in mine] == [(d.step, d.layer) for d in theirs] and mine
        for a, b in zip(mine, theirs):
            assert torch.equal(a.positions, b.positions)
            torch.testing.assert_close(a.values.float(), b.values.float(), rtol=2e-3, atol=2e-3)  # fp16 of batched math
            torch.testing.assert_close(a.features, b.features, rtol=1e-4, atol=1e-5)
            for name in (*a.labels, *a.teachers):
                x, y = (a.labels | a.teachers)[name], (b.labels | b.teachers)[name]
                torch.testing.assert_close(x.float(), y.float(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("H, T, tail", [(1, 5, ()), (3, 7, ()), (2, 6, (4,)), (4, 9, (2, 3))])
@pytest.mark.parametrize("equal", [True, False])
def test_resident_keeps_each_heads_tokens_in_order_padded_at_the_front(H, T, tail, equal):
    """Against a loop: each head's resident slots in slot order, n = the fullest head's count, the others padded
    at the front with the fill (under the head and global allocations a cache's KV heads hold different counts)."""
    g = torch.Generator().manual_seed(H * 100 + T)
    x = torch.randn(H, T, *tail, generator=g)
    if equal:  # the same number per head (uniform): the reshape of before, bit for bit
        valid = torch.stack([torch.randperm(T, generator=g) < T // 2 + 1 for _ in range(H)])
    else:
        valid = torch.rand(H, T, generator=g) < 0.6
        valid[0] = True  # one head holds every slot, another (H > 1) only its first
        if H > 1:
            valid[1] = torch.arange(T) == 0
    n = int(valid.sum(-1).max())
    expected = torch.full((H, n, *tail), -7.0)
    for h in range(H):
        kept = x[h][valid[h]]
        expected[h, n - len(kept):] = kept
    assert torch.equal(resident(x, valid, fill=-7.0), expected)
    if equal:
        assert torch.equal(resident(x, valid), x[valid].reshape(H, n, *tail))


def test_labels_equal_a_direct_computation():
    """Hand-made attention: a decision at step 1 with horizon 3 sees the attention of steps 2, 3, 4."""
    g = torch.Generator().manual_seed(0)
    B, H, G, T0 = 1, 2, 2, 5
    rec = Recorder(n_layers=1, teachers=(), decision_steps=frozenset({1}), horizon=3, label_budget=0.25)
    state, history = {}, []
    keys = torch.randn(B, H, T0 + 5, 4, generator=g)
    for step in range(0, 6):
        T = T0 + step
        q = T0 if step == 0 else 1
        attn = torch.rand(B, H, G, q, T, generator=g)
        attn = attn / attn.sum(-1, keepdim=True)
        for name in list(state):
            state[name] = torch.cat([state[name], state[name].new_zeros(*state[name].shape[:-1], T - state[name].shape[-1])], -1)
        view = LayerView(layer=0, step=step, keys=keys[:, :, :T], values=keys[:, :, :T],
                         positions=torch.arange(T).expand(B, H, T), n_new=q, attn=attn, state=state)
        rec.update(view)
        history.append(attn[:, :, :, -1, :])
    (p,) = rec.rows
    T1 = T0 + 1
    for h in range(H):
        for tok in range(T1):
            rows = [history[s][0, h, :, tok] for s in (2, 3, 4)]
            assert math.isclose(p.labels["future_sum"][0, h, tok].item(), sum(float(r.mean()) for r in rows), rel_tol=1e-5)
            assert math.isclose(p.labels["future_max"][0, h, tok].item(), max(float(r.max()) for r in rows), rel_tol=1e-6)
            # dropping the token moves query head g's output o_g by a_g |v - o_g| / (1 - a_g)
            out = 0.0
            for s in (2, 3, 4):
                T_s = T0 + s
                a = history[s][0, h]  # [G, T_s]
                v = keys[0, h, :T_s]
                o = a @ v  # [G, D]
                out += float(sum(a[g, tok] * (v[tok] - o[g]).norm() / (1 - a[g, tok]) for g in range(G)) / G)
            assert math.isclose(p.labels["future_out"][0, h, tok].item(), out, rel_tol=1e-4)
            reenter = False
            for s in (2, 3, 4):
                means = history[s][0, h].mean(0)  # group mean over the step's tokens
                k = math.ceil(0.25 * means.shape[0])
                reenter |= tok in sorted(range(means.shape[0]), key=lambda i: -float(means[i]))[:k]
            assert bool(p.labels["reenter"][0, h, tok]) == reenter


def _rows(trace_dir):
    ds = load_traces(trace_dir)
    return sorted((r["prompt_id"], r["step"], r["layer"], np.asarray(r["features"]).tobytes()) for r in ds)


def test_killed_collector_resumes_without_duplicates_or_losses(small, collected, tmp_path):
    model, tok = small
    reference, _, _ = collected
    # first run "killed" after one shard; plus debris a kill could leave: a half-written temp file, and a shard
    # renamed into place whose sidecar was never written
    collect(tmp_path, CFG, model=model, tokenizer=tok, prompts=PROMPTS, progress=False, max_shards=1)
    (tmp_path / "shard-00001.arrow.tmp-4242").write_bytes(b"half a shard")
    (tmp_path / "shard-00001.arrow").write_bytes(b"renamed but no sidecar")
    manifest, stats = collect(tmp_path, CFG, model=model, tokenizer=tok, prompts=PROMPTS, progress=False)
    assert manifest["complete"] and stats.skipped_shards == 1 and stats.shards == 1
    assert _rows(tmp_path) == _rows(reference)


def test_a_resumed_collection_shows_the_finished_shards_and_the_tokens(small, tmp_path, capsys):
    """The bar starts at the prompts of shards an earlier run finished (2 of 4 here) and ends with the tokens
    this run decoded, counted step by step."""
    model, tok = small
    collect(tmp_path, CFG, model=model, tokenizer=tok, prompts=PROMPTS, progress=False, max_shards=1)
    capsys.readouterr()
    _, stats = collect(tmp_path, CFG, model=model, tokenizer=tok, prompts=PROMPTS, progress=True)
    err = capsys.readouterr().err
    assert "2/4" in err and "4/4" in err, err
    assert f"tokens={stats.decode_tokens}" in err, err


def test_sharded_collectors_and_merge(small, collected, tmp_path):
    model, tok = small
    reference, _, _ = collected
    m0, _ = collect(tmp_path, CFG, shard=(0, 2), model=model, tokenizer=tok, prompts=PROMPTS, progress=False)
    m1, _ = collect(tmp_path, CFG, shard=(1, 2), model=model, tokenizer=tok, prompts=PROMPTS, progress=False)
    assert merge(tmp_path)[0]["complete"]
    assert _rows(tmp_path) == _rows(reference)


def test_another_config_is_refused(small, collected):
    model, tok = small
    out, _, _ = collected
    other = CollectConfig(**{**CFG.__dict__, "horizon": 5})
    with pytest.raises(TraceError, match="another config"):
        collect(out, other, model=model, tokenizer=tok, prompts=PROMPTS, progress=False)


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_corrupt_or_truncated_shard_is_refused(collected, tmp_path):
    out = _copy(collected[0], tmp_path / "t")
    shard = out / read_manifest(out)["shards"][0]["path"]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceError, match="corrupt or truncated"):
        load_traces(out)


def test_other_feature_version_is_refused(collected, tmp_path):
    out = _copy(collected[0], tmp_path / "t")
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["feature_version"] = 999
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(TraceError, match="feature version 999"):
        load_traces(out)


def test_recurrence_report(collected):
    from learnkv.traces.recurrence import report

    table, png = report(collected[0])
    assert table.splitlines()[0].startswith("| layer |") and "| all |" in table
    assert png.exists() and png.stat().st_size > 1000


@pytest.mark.slow
def test_tiny_collection_on_the_default_model(smollm2, tmp_path):
    """The bundled SmolLM2 on real prompt sources: shards load back with the manifest's schema."""
    model, tok = smollm2
    cfg = CollectConfig(prompts=1, val_prompts=1, max_new_tokens=20, decisions_per_prompt=1, horizon=4,
                        prompts_per_shard=1, sources=("gsm_symbolic",))
    manifest, stats = collect(tmp_path, cfg, model=model, tokenizer=tok, progress=False)
    assert manifest["complete"] and manifest["n_layers"] == 30 and manifest["n_kv_heads"] == 3
    ds = load_traces(tmp_path)
    assert len(ds) == stats.rows == 2 * 30 - 30 * stats.dropped_decisions
    assert set(ds["split"]) <= {"train", "validation"} and set(ds["source"]) == {"gsm_symbolic"}
    row = ds[0]
    assert len(row["features"]) == 3 * row["n_tokens"] * N_FEATURES
    assert np.isfinite(np.asarray(row["features"])).all()
