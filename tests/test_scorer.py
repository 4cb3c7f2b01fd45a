"""Scorer artifact: export -> load gives identical scores; tampering, wrong versions and wrong models are refused."""

import json

import pytest
import torch

from conftest import random_ids
from learnkv import generate
from learnkv.features import N_FEATURES
from learnkv.scorer.artifact import (ArtifactError, check_binding, export_scorer, load_scorer, read_artifact_manifest,
                                     trained_allocation)
from learnkv.scorer.model import Scorer


@pytest.fixture
def exported(tmp_path):
    torch.manual_seed(0)
    scorer = Scorer(n_layers=3, hidden=8)
    scorer.set_normalization(torch.randn(N_FEATURES), torch.rand(N_FEATURES) + 0.5)
    path = export_scorer(scorer, tmp_path / "art", model="tiny", n_kv_heads=2, config_digest="abc",
                         metrics={"val/recall@25": 0.5})
    return scorer, path


def test_round_trip_identical_scores(exported):
    scorer, path = exported
    loaded, manifest = load_scorer(path, expect_model="tiny", expect_layers=3)
    x = torch.randn(2, 5, 7, N_FEATURES)
    for layer in range(3):
        assert torch.equal(scorer(x, layer), loaded(x, layer))
    # a tensor of layer indices scores mixed-layer batches the same as one layer at a time
    layers = torch.tensor([0, 2, 1])[:, None]
    mixed = loaded(x[0, :3, :4], layers)
    assert torch.allclose(mixed, torch.stack([loaded(x[0, i, :4], int(layers[i])) for i in range(3)]), atol=1e-6)
    assert manifest["metrics"] == {"val/recall@25": 0.5} and manifest["n_kv_heads"] == 2


def test_the_artifact_records_the_allocation_it_was_trained_for(exported, tmp_path):
    _, path = exported  # exported without saying: a per-head scorer, as every artifact before the field
    _, manifest = load_scorer(path, expect_allocation="uniform")
    assert trained_allocation(manifest) == "uniform"
    with pytest.raises(ArtifactError, match="trained for allocation 'uniform', not 'global'"):
        load_scorer(path, expect_allocation="global")
    glob = export_scorer(Scorer(n_layers=3, hidden=8), tmp_path / "global", model="tiny", n_kv_heads=2,
                         allocation="global")
    assert trained_allocation(load_scorer(glob, expect_allocation="global")[1]) == "global"
    with pytest.raises(ArtifactError, match="not 'uniform'"):
        check_binding(read_artifact_manifest(glob), glob, allocation="uniform")
    check_binding(read_artifact_manifest(path), path, allocation="pyramid")  # compared within a head, as uniform
    check_binding(read_artifact_manifest(glob), glob)  # not asked: the decode loop may run it under any allocation
    old = dict(read_artifact_manifest(path))
    del old["allocation"]
    assert trained_allocation(old) == "uniform"  # artifacts written before the field


def test_per_layer_weights_differ(exported):
    scorer, _ = exported
    x = torch.randn(10, N_FEATURES)
    assert not torch.allclose(scorer(x, 0), scorer(x, 1))


def test_tampered_weights_refused(exported):
    _, path = exported
    w = path / "scorer.safetensors"
    data = bytearray(w.read_bytes())
    data[-1] ^= 0xFF
    w.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="does not match"):
        load_scorer(path)


@pytest.mark.parametrize("key,value,message", [
    ("format_version", 99, "version 99"),
    ("feature_version", 0, "feature version 0"),
    ("format", "something-else", "'something-else'"),
])
def test_wrong_version_refused(exported, key, value, message):
    _, path = exported
    manifest = json.loads((path / "manifest.json").read_text())
    manifest[key] = value
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=message):
        load_scorer(path)


def test_wrong_model_binding_refused(exported):
    _, path = exported
    with pytest.raises(ArtifactError, match="trained for model 'tiny', not 'smollm2'"):
        load_scorer(path, expect_model="smollm2")
    with pytest.raises(ArtifactError, match="3 layers, the model has 30"):
        load_scorer(path, expect_layers=30)


def test_missing_artifact_is_clear(tmp_path):
    with pytest.raises(ArtifactError, match="no scorer artifact"):
        load_scorer(tmp_path)


def test_learned_policy_needs_a_scorer(tiny):
    with pytest.raises(ValueError, match="needs a scorer artifact"):
        generate(tiny, input_ids=random_ids(10), policy="learned", budget=8, max_new_tokens=2)
    with pytest.raises(ValueError, match="does not exist"):
        generate(tiny, input_ids=random_ids(10), policy="learned", budget=8, max_new_tokens=2,
                 policy_params={"scorer": "/no/such/scorer"})


def test_learned_policy_evicts_by_the_scorer(tiny, tmp_path):
    """A scorer that only looks at rel_pos (weight +) keeps the newest tokens: the learned policy follows it."""
    from learnkv.features import feature_index

    scorer = Scorer(n_layers=2, hidden=1)
    with torch.no_grad():
        scorer.w1.zero_()
        scorer.w1[:, feature_index("rel_pos"), 0] = 1.0
        scorer.b1.fill_(0.0)
        scorer.w2.fill_(1.0)
    path = export_scorer(scorer, tmp_path / "recency", model="tiny", n_kv_heads=2)
    kept = []
    generate(tiny, input_ids=random_ids(30), policy="learned", budget=12, max_new_tokens=6,
             policy_params={"scorer": str(path), "n_sink": 0, "n_recent": 0},
             observer=lambda c: kept.append(c.layers[0].positions[0, 0].tolist()))
    assert kept[-1] == list(range(35 - 12, 35))  # the 12 newest of 35 positions


def test_artifact_loader_needs_neither_transformers_nor_lightning(exported):
    """Serving loads artifacts with torch + safetensors only."""
    import subprocess
    import sys

    _, path = exported
    code = (f"import sys; from learnkv.scorer.artifact import load_scorer; load_scorer({str(path)!r}); "
            "bad = [m for m in ('transformers', 'lightning', 'datasets', 'wandb') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_content_gate_reads_the_value_vectors(tiny, tmp_path):
    """A scorer with content features (a gate on each token's value vector) round-trips through its artifact and drives
    the learned policy: with the MLP silenced, it keeps the tokens whose value has the largest first component."""
    scorer = Scorer(n_layers=2, hidden=1, content_dim=16, n_heads=2)
    with torch.no_grad():
        scorer.w2.zero_()
        scorer.wc.zero_()
        scorer.wc[:, :, 0] = 1.0
    path = export_scorer(scorer, tmp_path / "content", model="tiny", n_kv_heads=2)
    loaded, manifest = load_scorer(path)
    assert manifest["architecture"]["content_dim"] == 16
    x, v = torch.randn(1, 2, 7, N_FEATURES), torch.randn(1, 2, 7, 16)
    assert torch.equal(loaded(x, 1, v), scorer(x, 1, v)) and torch.allclose(loaded(x, 1, v), v[..., 0])
    with pytest.raises(ValueError, match="value vectors"):
        loaded(x, 1)
    ids = random_ids(30)
    full = []
    generate(tiny, input_ids=ids, policy="full", max_new_tokens=1, observer=lambda c: full.append(c.layers[0].values))
    held = []
    generate(tiny, input_ids=ids, policy="learned", budget=12, max_new_tokens=2,
             policy_params={"scorer": str(path), "n_sink": 0, "n_recent": 1},
             observer=lambda c: held.append(c.layers[0].positions[0].clone()))
    for h in range(2):  # after the prefill's compression: the newest token and the 11 largest first components
        best = full[0][0, h, :29, 0].topk(11).indices.tolist()
        assert held[0][h].tolist() == sorted(best) + [29]


def test_the_same_scorer_exports_the_same_bytes(tmp_path):
    """An artifact's digest (``weights_sha256``, which evaluation records and resumes check) depends on the weights
    alone: safetensors writes a metadata dict in hash order, which differs from one write to the next when it has
    more than one key, so two trainings with bit-identical weights once gave two digests."""
    torch.manual_seed(0)
    scorer = Scorer(n_layers=2, hidden=8)
    digests = {json.loads((export_scorer(scorer, tmp_path / f"art{i}", model="tiny", n_kv_heads=2) / "manifest.json")
                          .read_text())["weights_sha256"] for i in range(12)}
    assert len(digests) == 1


def test_a_global_scorer_decodes_under_global_with_raw_scores(tiny, tmp_path, monkeypatch):
    """A scorer exported for allocation global (with its head bias) loads back score for score, and the learned
    policy under ``allocation=global`` compares its scores across layers and heads as they are (``raw``); the same
    weights exported as a per-head scorer go through the per-head softmax (``logit``)."""
    import learnkv.cache

    torch.manual_seed(0)
    scorer = Scorer(n_layers=2, hidden=4, n_heads=2, head_bias=True)
    with torch.no_grad():
        scorer.bh.copy_(torch.tensor([[2.0, -1.0], [0.5, 0.0]]))
    x = torch.randn(3, 2, 7, N_FEATURES)
    unbiased = Scorer(n_layers=2, hidden=4)
    unbiased.load_state_dict({k: v for k, v in scorer.state_dict().items() if k != "bh"})
    assert torch.allclose(scorer(x, 1) - unbiased(x, 1), torch.tensor([0.5, 0.0])[:, None].expand(3, 2, 7))
    # in training, a batch of rows of several layers: each row gets its own layer's head offsets
    layers = torch.tensor([0, 1, 0])[:, None, None]
    assert torch.allclose(scorer(x, layers), torch.stack([scorer(x[i:i + 1], int(layers[i]))[0] for i in range(3)]))
    rules = []
    normalise = learnkv.cache.normalise_scores
    monkeypatch.setattr(learnkv.cache, "normalise_scores", lambda s, v, rule: rules.append(rule) or normalise(s, v, rule))
    for allocation, rule in (("global", "raw"), ("uniform", "logit")):
        path = export_scorer(scorer, tmp_path / allocation, model="tiny", n_kv_heads=2, allocation=allocation)
        loaded, _ = load_scorer(path)
        assert torch.equal(loaded(x, 1), scorer(x, 1)) and loaded.head_bias
        rules.clear()
        generate(tiny, input_ids=random_ids(30), policy="learned", budget=12, max_new_tokens=6, allocation="global",
                 policy_params={"scorer": str(path), "n_sink": 0, "n_recent": 0})
        assert set(rules) == {rule}
