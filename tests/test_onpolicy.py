"""Traces collected under eviction (on-policy), and batched collection: what is recorded, and where labels come from."""

import dataclasses

import numpy as np
import pytest
import torch

import learnkv.attention as attention
from learnkv.decode import generate
from learnkv.prompts import Prompt
from learnkv.traces.collect import CollectConfig, collect, merge
from learnkv.traces.onpolicy import record
from learnkv.traces.record import FLOAT_LABELS, Recorder
from learnkv.traces.store import load_traces

from conftest import scorer_for


def make_prompt(id, text, split):
    """A real `Prompt` record (a test double of it once drifted from the real type)."""
    return Prompt(id=id, source="test", text=text, answer="", split=split)


TEXTS = ["Tom has 3 apples and buys 5 more. How many apples does he have now? Count them.",
         "A train travels 60 km per hour for 2 hours. How far does it go?",
         "What is 15 plus 27?",
         "Sara reads 12 pages a day. How many pages does she read in a week of seven days?"]
PROMPTS = [make_prompt(f"p{i}", t, s) for i, (t, s) in enumerate(zip(TEXTS, ["train", "validation", "train", "train"]))]
TEACHERS = ("h2o", "snapkv", "lazy", "rkv")
BASE = dict(prompts=4, max_new_tokens=24, decisions_per_prompt=2, horizon=6, prompts_per_shard=2, chat=False,
            teachers=TEACHERS)
ONPOLICY = CollectConfig(**BASE, policy="h2o", policy_params={"n_recent": 4}, budgets=(0.6, 20))


def _rows(trace_dir) -> dict:
    ds = load_traces(trace_dir)
    return {(r["prompt_id"], r["step"], r["layer"]): r for r in ds}


def _assert_same_rows(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for key in a:
        ra, rb = a[key], b[key]
        for col in ("n_tokens", "positions", "budget", "evicts", "reenter"):
            assert np.array_equal(np.asarray(ra[col]), np.asarray(rb[col])), (key, col)
        for col in ("features", *FLOAT_LABELS, *[f"teacher_{t}" for t in TEACHERS]):
            assert np.allclose(ra[col], rb[col], rtol=1e-4, atol=1e-5), (key, col)


@pytest.mark.parametrize("cfg", [CollectConfig(**BASE), ONPOLICY], ids=["full", "h2o"])
def test_batch_rows_record_what_they_record_alone(small, tmp_path, cfg):
    model, tok = small
    alone, batched = tmp_path / "alone", tmp_path / "batched"
    collect(alone, dataclasses.replace(cfg, batch_size=1), model=model, tokenizer=tok, prompts=PROMPTS, progress=False)
    collect(batched, dataclasses.replace(cfg, batch_size=2), model=model, tokenizer=tok, prompts=PROMPTS,
            progress=False)
    _assert_same_rows(_rows(alone), _rows(batched))


def test_onpolicy_records_only_resident_tokens(small):
    """A decision at step t records exactly the tokens the acting cache holds before it evicts at t: what it held
    after step t-1 plus the new token, never a token it had evicted."""
    model, tok = small
    budget, steps = 18, frozenset({3, 9, 14})
    decisions, result = record(model, tok, [TEXTS[0]], _h2o(), [budget], [steps], TEACHERS, horizon=5,
                               label_budget=0.25, max_new_tokens=24, chat=False)
    held = []  # after each forward pass: per layer, the positions each KV head holds
    plain = generate(model, tok, [TEXTS[0]], policy=_h2o(), budget=budget, max_new_tokens=24, chat=False,
                     observer=lambda c: held.append([layer.positions[0].clone() for layer in c.layers]))
    assert plain.tokens.tolist() == result.tokens.tolist()
    P = result.prompt_lengths[0]
    assert {d.step for d in decisions[0]} == steps and len(decisions[0]) == 2 * len(steps)
    for d in decisions[0]:
        before = held[d.step - 1][d.layer]  # [H, T] after the previous step's eviction
        for h in range(d.positions.shape[0]):
            expected = sorted(before[h][before[h] >= 0].tolist() + [P + d.step - 1])
            assert d.positions[h].tolist() == expected
        assert d.positions.shape[1] == budget + 1 and d.evicts and d.budget == budget


def _h2o(**kw) -> "Policy":  # noqa: F821
    from learnkv.policies import make_policy

    return make_policy("h2o", **{"n_recent": 4, **kw})


@pytest.mark.parametrize("allocation", ["uniform", "global"])
def test_labels_come_from_the_branched_future(small, monkeypatch, allocation):
    """Hand-computed: a lagged H2O evicts at step e and then not for `interval - 1` steps, so from the decision at
    t = e + 1 the acting run itself is the branch (no eviction, the same tokens). Its attention on the decision's
    tokens over steps t+1 .. t+H, read off the attention function, must be the recorded labels. Under ``global``
    the KV heads hold different numbers of tokens: each head's padding (position -1) gets no label."""
    model, tok = small
    H_steps = 5
    P = int(tok(TEXTS[3], return_tensors="pt")["input_ids"].shape[1])
    e = 6
    budget = P + e - 1  # the cache first overflows at step e
    policy = _h2o(n_recent=2, interval=H_steps + 3)
    seen = []  # (layer, step, probs [1, H, G, 1, T], positions [1, H, T], values [1, H, T, D])
    original = attention._hand_statistics

    def spy(cache, layer_idx, probs, query_pos):
        layer = cache.layers[layer_idx]
        seen.append((layer_idx, cache.step, probs.clone(), layer.positions.clone(), layer.values.clone()))
        original(cache, layer_idx, probs, query_pos)

    monkeypatch.setattr(attention, "_hand_statistics", spy)
    plain = generate(model, tok, [TEXTS[3]], policy=policy, budget=budget, max_new_tokens=20, chat=False,
                     allocation=allocation)
    monkeypatch.setattr(attention, "_hand_statistics", original)
    t = e + 1
    decisions, result = record(model, tok, [TEXTS[3]], policy, [budget], [frozenset({t})], TEACHERS, horizon=H_steps,
                               label_budget=0.25, max_new_tokens=20, chat=False, allocation=allocation)
    assert result.tokens.tolist() == plain.tokens.tolist()
    by_step = {(layer, step): (p, pos, v) for layer, step, p, pos, v in seen}
    for layer_idx in range(2):
        held = by_step[layer_idx, t][1][0]  # [H, T] the acting cache's positions at step t
        assert (held >= 0).sum(-1).max() < P + t  # the acting cache has evicted by then
    counts = [(d.positions >= 0).sum(-1) for d in decisions[0]]
    assert all(bool((c == c.max()).all()) for c in counts) == (allocation == "uniform")  # global: heads differ
    for d in decisions[0]:
        assert not d.evicts
        pad = d.positions < 0
        assert bool((pad[:, :-1] >= pad[:, 1:]).all())  # a head's padding comes first
        for k in FLOAT_LABELS:
            assert not bool(d.labels[k][pad].any())
        exp = {k: torch.zeros(d.positions.shape) for k in FLOAT_LABELS}
        for s in range(t + 1, t + H_steps + 1):
            probs, pos, values = by_step[d.layer, s]
            assert ((pos[0] >= 0).sum(-1) == (~pad).sum(-1) + s - t).all()  # no eviction since the decision
            for h in range(d.positions.shape[0]):
                a = probs[0, h, :, 0, :]  # [G, T]
                o = a @ values[0, h]  # [G, D]
                for j, p in enumerate(d.positions[h].tolist()):
                    if p < 0:
                        continue
                    slot = pos[0, h].tolist().index(p)
                    g = a[:, slot]
                    exp["future_sum"][h, j] += g.mean()
                    exp["future_max"][h, j] = max(exp["future_max"][h, j], g.max())
                    shift = torch.stack([(values[0, h, slot] - o[i]).norm() for i in range(len(g))])
                    exp["future_out"][h, j] += (g * shift / (1 - g)).mean()
        for k in FLOAT_LABELS:
            assert torch.allclose(d.labels[k], exp[k], rtol=1e-4, atol=1e-6), (d.layer, k)


def test_branch_without_eviction_is_the_full_cache_run(small):
    """At a budget no row reaches, the on-policy recorder's branches continue the same cache along the same tokens:
    features, teacher scores and labels equal the full-cache recorder's (rows of a padded batch)."""
    model, tok = small
    texts, steps = TEXTS[:2], [frozenset({2, 7}), frozenset({4, 11})]
    decisions, result = record(model, tok, texts, _h2o(), [1000, 1000], steps, TEACHERS, horizon=6,
                               label_budget=0.25, max_new_tokens=24, chat=False)
    rec = Recorder(n_layers=2, teachers=TEACHERS, decision_steps=tuple(steps), horizon=6, label_budget=0.25)
    full = generate(model, tok, texts, policy=rec, max_new_tokens=24, chat=False)
    assert full.tokens.tolist() == result.tokens.tolist()
    for b in range(2):
        ref = rec.decisions(b, full.new_tokens[b])
        assert len(ref) == len(decisions[b]) == 4
        for d, r in zip(decisions[b], ref):
            assert (d.step, d.layer) == (r.step, r.layer) and torch.equal(d.positions, r.positions)
            assert torch.allclose(d.features, r.features, atol=1e-5)
            for k in TEACHERS:
                assert torch.allclose(d.teachers[k], r.teachers[k], rtol=1e-4, atol=1e-6), k
            for k in FLOAT_LABELS:
                assert torch.allclose(d.labels[k], r.labels[k], rtol=1e-4, atol=1e-6), k
            assert torch.equal(d.labels["reenter"], r.labels["reenter"])


def test_onpolicy_collection_resumes_and_shards(small, tmp_path):
    model, tok = small
    reference = tmp_path / "ref"
    collect(reference, ONPOLICY, model=model, tokenizer=tok, prompts=PROMPTS, progress=False)
    killed = tmp_path / "killed"
    collect(killed, ONPOLICY, model=model, tokenizer=tok, prompts=PROMPTS, progress=False, max_shards=1)
    manifest, stats = collect(killed, ONPOLICY, model=model, tokenizer=tok, prompts=PROMPTS, progress=False)
    assert manifest["complete"] and stats.skipped_shards == 1 and stats.shards == 1
    sharded = tmp_path / "sharded"
    for i in range(2):
        collect(sharded, ONPOLICY, shard=(i, 2), model=model, tokenizer=tok, prompts=PROMPTS, progress=False)
    assert merge(sharded)[0]["complete"]
    ref = _rows(reference)
    _assert_same_rows(ref, _rows(killed))
    _assert_same_rows(ref, _rows(sharded))
    budgets = {int(r["budget"]) for r in ref.values()}
    assert load_traces(reference)["policy"][0] == "h2o" and 20 in budgets and len(budgets) > 1  # (0.6, 20), seeded


def test_learned_acting_policy_and_its_weights_in_the_digest(small, tmp_path):
    model, tok = small
    cfg = dataclasses.replace(ONPOLICY, policy="learned", policy_params={"scorer": scorer_for(2)}, budgets=(20,))
    manifest, stats = collect(tmp_path, cfg, model=model, tokenizer=tok, prompts=PROMPTS[:2], progress=False)
    assert stats.rows > 0 and manifest["policy"] == "learned"
    other = dataclasses.replace(cfg, policy_params={"scorer": scorer_for(2, model="another")})
    assert other.digest() != cfg.digest()  # another scorer's weights: other traces
    assert dataclasses.replace(cfg, batch_size=7).digest() == cfg.digest()  # speed only


@pytest.mark.parametrize("change, message", [
    ({"policy": "oracle"}, "needs the future"),
    ({"policy": "nope"}, "unknown collection policy"),
    ({"policy": "h2o", "policy_params": {"window": 3}}, "no parameter window"),
    ({"policy_params": {"n_recent": 3}}, "for the full cache"),
    ({"policy": "h2o", "budgets": ()}, "at least one budget"),
    ({"policy": "h2o", "budgets": (0,)}, "budget"),
])
def test_bad_collection_policy_is_refused(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(CollectConfig(), **change).validate()


def test_collection_under_the_global_allocation_records_each_heads_tokens(small, tmp_path):
    """``collect.policy_params: {allocation: global}`` decodes under ``global`` (it was once dropped silently): the
    trace rows hold each KV head's own tokens, a head that held fewer padded with position -1, and the training
    rows read that padding as no token (``live``)."""
    from learnkv.scorer.data import TraceRows

    model, tok = small
    cfg = dataclasses.replace(ONPOLICY, policy_params={"n_recent": 4, "allocation": "global"}, budgets=(0.5,))
    assert cfg.digest() != dataclasses.replace(cfg, policy_params={"n_recent": 4}).digest()
    collect(tmp_path, cfg, model=model, tokenizer=tok, prompts=PROMPTS, progress=False)
    ds = load_traces(tmp_path)
    rows = TraceRows(ds)
    padded = 0
    for i in range(len(ds)):
        positions = np.asarray(ds[i]["positions"]).reshape(ds[i]["n_heads"], ds[i]["n_tokens"])
        assert torch.equal(rows[i]["live"], torch.from_numpy(positions >= 0))
        assert not rows[i]["label"][~rows[i]["live"]].any()
        padded += int((positions < 0).any())
    assert padded > 0  # under uniform no row is padded (every head holds the same count)
