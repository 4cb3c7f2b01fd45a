"""Scorer training: it learns a known function, resumes to the same result, and train.py runs end to end."""

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from learnkv.config import load_config
from learnkv.features import N_FEATURES
from learnkv.traces.store import write_manifest, write_shard

ROOT = Path(__file__).resolve().parents[1]
H, T, LAYERS = 2, 40, 2


def synthetic_traces(out: Path, rows_per_split=(96, 24), seed=0, decisions=False) -> None:
    """Traces whose future utility is a known function of two features (plus two useless teachers), labelled with
    the default collection config (what `config` trains with). Every row is its own prompt's, unless
    ``decisions``: then rows ``r`` of one prompt are the LAYERS layers of one decision (the global objective's)."""
    import dataclasses

    from learnkv.traces.collect import CollectConfig

    collect_cfg = CollectConfig()
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)
    for index, (split, n) in enumerate(zip(("train", "validation"), rows_per_split)):
        cols = {k: [] for k in ("prompt_id", "source", "split", "step", "layer", "n_heads", "n_tokens", "positions",
                                "features", "future_sum", "future_max", "future_out", "reenter", "teacher_noise", "teacher_f5")}
        for r in range(n):
            f = rng.normal(size=(H, T, N_FEATURES)).astype(np.float32)
            utility = np.exp(1.5 * f[..., 2] - 1.0 * f[..., 7])  # the ground truth the scorer must find
            cols["prompt_id"].append(f"{split}{r // LAYERS if decisions else r}")
            cols["source"].append("synthetic")
            cols["split"].append(split)
            cols["step"].append(1)
            cols["layer"].append(r % LAYERS)
            cols["n_heads"].append(H)
            cols["n_tokens"].append(T)
            cols["positions"].append(np.tile(np.arange(T, dtype=np.int32), H))
            cols["features"].append(f.ravel())
            cols["future_sum"].append(utility.astype(np.float32).ravel())
            cols["future_max"].append(utility.astype(np.float32).ravel())
            cols["future_out"].append(utility.astype(np.float32).ravel())
            cols["reenter"].append(np.zeros(H * T, dtype=np.int8))
            cols["teacher_noise"].append(rng.normal(size=H * T).astype(np.float32))
            cols["teacher_f5"].append(f[..., 5].ravel())
        write_shard(out, index, cols, [f"{split}{r}" for r in range(n)], collect_cfg.digest())
    write_manifest(out, {"model": "synthetic", "n_layers": LAYERS, "n_kv_heads": H, "teachers": ["noise", "f5"],
                         "horizon": 8, "label_budget": 0.25, "config": dataclasses.asdict(collect_cfg),
                         "config_digest": collect_cfg.digest()}, 2)


def config(tmp: Path, *overrides):
    return load_config(None, [f"trace_dir={tmp / 'traces'}", f"out_dir={tmp / 'out'}", "wandb.mode=disabled",
                              "train.max_epochs=12", "train.patience=100", "train.lr=0.01", "train.batch_size=8",
                              *overrides])


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory):
    from learnkv.scorer.fit import train

    tmp = tmp_path_factory.mktemp("synthetic")
    synthetic_traces(tmp / "traces")
    artifact, metrics, table = train(config(tmp), progress=False)
    return tmp, artifact, metrics, table


def test_scorer_learns_a_known_utility(synthetic_run):
    _, _, metrics, table = synthetic_run
    assert metrics["val/recall@25"] >= 0.95, table
    assert metrics["val/recall@10"] >= 0.9 and metrics["val/recall@50"] >= 0.95
    assert metrics["val/noise/recall@25"] < 0.5  # a useless teacher stays at chance level: the metric can fail
    assert "| **learned** |" in table and "| noise |" in table


def test_exported_artifact_reproduces_the_trained_scores(synthetic_run):
    from learnkv.scorer.artifact import load_scorer
    from learnkv.scorer.module import ScorerModule

    tmp, artifact, metrics, _ = synthetic_run
    scorer, manifest = load_scorer(artifact)
    best = ScorerModule.load_from_checkpoint(next((tmp / "out" / "checkpoints").glob("best*.ckpt")))
    x = torch.randn(3, H, T, N_FEATURES)
    assert torch.equal(scorer(x, 1), best.scorer(x, 1))
    assert manifest["metrics"]["val/recall@25"] == metrics["val/recall@25"]
    assert manifest["model"] == "synthetic" and manifest["n_kv_heads"] == H


def test_an_ignored_feature_is_never_read(synthetic_run, tmp_path):
    """`train.ignore_features` holds a feature's weights at exactly zero: ignoring one of the two features the utility
    depends on costs recall (so the ablation can show a feature matters), and the exported scores do not move when
    that feature does."""
    from learnkv.features import FEATURES
    from learnkv.scorer.artifact import load_scorer
    from learnkv.scorer.fit import train

    src, _, full_metrics, _ = synthetic_run
    artifact, metrics, _ = train(config(tmp_path, f"trace_dir={src / 'traces'}", f"train.ignore_features=[{FEATURES[2]}]"),
                                 progress=False)
    assert metrics["val/recall@25"] < full_metrics["val/recall@25"] - 0.1
    scorer, _ = load_scorer(artifact)
    assert torch.count_nonzero(scorer.w1[:, 2, :]) == 0 and torch.count_nonzero(scorer.w1[:, 7, :]) > 0
    x = torch.randn(3, H, T, N_FEATURES)
    moved = x.clone()
    moved[..., 2] += 5.0
    assert torch.equal(scorer(x, 1), scorer(moved, 1))
    with pytest.raises(ValueError, match="not features"):
        config(tmp_path, "train.ignore_features=[acc_total]")


def test_resumed_run_ends_like_an_uninterrupted_one(tmp_path):
    from learnkv.scorer.fit import train

    synthetic_traces(tmp_path / "traces")
    _, straight, _ = train(config(tmp_path, "train.max_epochs=4", f"out_dir={tmp_path / 'a'}"), progress=False)
    # "killed" after epoch 2 (its last checkpoint survives), then the same command runs to the end
    train(config(tmp_path, "train.max_epochs=2", f"out_dir={tmp_path / 'b'}"), progress=False)
    _, resumed, _ = train(config(tmp_path, "train.max_epochs=4", f"out_dir={tmp_path / 'b'}"), progress=False)
    for key, value in straight.items():
        assert math.isclose(resumed[key], value, rel_tol=1e-4, abs_tol=1e-6), key


def test_training_does_not_depend_on_what_ran_before_it(synthetic_run, tmp_path, monkeypatch):
    """Collecting in the same process draws from the global random generators (model loading, decoding); the
    scorer must come out the same as when the traces were already there."""
    from learnkv.scorer import fit

    src, artifact, _, _ = synthetic_run
    ensure = fit.ensure_traces

    def collect_then_return(cfg, progress=True):
        torch.rand(1000), np.random.rand(10)  # what a collection would draw
        return ensure(cfg, progress)

    monkeypatch.setattr(fit, "ensure_traces", collect_then_return)
    again, _, _ = fit.train(config(tmp_path, f"trace_dir={src / 'traces'}"), progress=False)
    from safetensors.torch import load_file

    a, b = (load_file(next(Path(p).glob("*.safetensors"))) for p in (artifact, again))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_membership_at_several_budgets(synthetic_run, tmp_path):
    """`train.membership_budget` takes one share or several (the loss averages them); a scalar still loads, an
    out-of-range share is refused by name."""
    from learnkv.scorer.fit import train
    from learnkv.scorer.module import membership_loss, membership_shares

    assert config(tmp_path, "train.membership_budget=0.3").train.membership_budget == (0.3,)
    with pytest.raises(ValueError, match=r"train.membership_budget\[1\] must be in \(0, 1\]"):
        config(tmp_path, "train.membership_budget=[0.25,1.5]")
    assert membership_shares(0.25) == (0.25,) and membership_shares([0.25, 0.5]) == (0.25, 0.5)
    # a ranking right about the top quarter but reversed below it: only the loss at 50% sees the error
    label = torch.arange(8.0, 0, -1)[None]
    mask = torch.ones_like(label, dtype=torch.bool)
    scores = torch.tensor([[8.0, 7.0, -10.0, -9.0, -8.0, -7.0, -6.0, -5.0]])
    good = torch.tensor([[8.0, 7.0, -5.0, -6.0, -7.0, -8.0, -9.0, -10.0]])
    assert membership_loss(scores, label, mask, 0.5) > membership_loss(good, label, mask, 0.5) + 0.5
    assert membership_loss(scores, label, mask, 0.25) == pytest.approx(membership_loss(good, label, mask, 0.25).item())

    src, _, _, _ = synthetic_run
    _, metrics, _ = train(config(tmp_path, f"trace_dir={src / 'traces'}", "train.membership_budget=[0.25,0.5]"),
                          progress=False)
    assert metrics["val/recall@25"] >= 0.95 and metrics["val/recall@50"] >= 0.95


def test_global_objective_ranks_across_layers_and_heads():
    """Two layers, two KV heads, one decision. Scores right within every head (the log of the head's share of its
    future mass) but off by a constant per head cost nothing under the per-head objective and cost under the global
    one, listwise and membership alike; the right scores on one scale are the global optimum's."""
    from learnkv.scorer.module import head_shares, listwise_loss, membership_loss, ranking_groups

    label = torch.tensor([[[9.0, 0.5, 0.3, 0.2], [3.0, 3.0, 2.0, 2.0]],   # layer 0: a peaked head, a flat head
                          [[0.4, 0.3, 0.2, 0.1], [6.0, 1.0, 1.0, 0.0]]])  # layer 1: query counts differ per head
    mask = torch.ones_like(label, dtype=torch.bool)
    right = torch.log(head_shares(label, mask) + 1e-6)
    wrong = right + torch.tensor([[3.0, -2.0], [-4.0, 1.0]])[..., None]  # the same order within every head
    for share in (0.25, 0.5):
        assert membership_loss(right, label, mask, share).item() == pytest.approx(
            membership_loss(wrong, label, mask, share).item(), abs=1e-5)
    assert listwise_loss(right, label, mask) == pytest.approx(listwise_loss(wrong, label, mask).item(), abs=1e-5)
    pooled = {name: ranking_groups(s, label, mask, decisions=1) for name, s in (("right", right), ("wrong", wrong))}
    assert pooled["right"][0].shape == (1, 16) and pooled["right"][1].sum().item() == pytest.approx(4.0)
    assert listwise_loss(*pooled["wrong"]) > listwise_loss(*pooled["right"]) + 0.5
    for share in (0.25, 0.5):
        assert membership_loss(*pooled["wrong"], share) > membership_loss(*pooled["right"], share) + 0.1
    # per head, the global loss sees the uniform one's error too: it is a ranking over the heads' union
    reversed_within = right.flip(-1)
    assert listwise_loss(*ranking_groups(reversed_within, label, mask, 1)) > listwise_loss(*pooled["right"]) + 0.5


@pytest.fixture(scope="module")
def global_run(tmp_path_factory):
    from learnkv.scorer.fit import train

    tmp = tmp_path_factory.mktemp("global")
    synthetic_traces(tmp / "traces", decisions=True)
    artifact, metrics, table = train(config(tmp, "train.objective=global", "train.batch_size=2"), progress=False)
    return tmp, artifact, metrics, table


def test_global_objective_trains_and_exports_a_global_scorer(global_run, synthetic_run):
    """`train.objective=global` ranks each decision's tokens over both layers and heads, reports the pooled recall
    beside the per-head one, and exports an artifact bound to allocation global, which the learned policy compares
    as it is (``raw``); a per-head scorer stays ``logit``."""
    from learnkv.allocation import normalisation_for
    from learnkv.policies.learned import Learned
    from learnkv.scorer.artifact import load_scorer, trained_allocation

    _, artifact, metrics, table = global_run
    scorer, manifest = load_scorer(artifact, expect_allocation="global")
    assert trained_allocation(manifest) == "global" and manifest["train"]["objective"] == "global"
    assert scorer.head_bias and tuple(scorer.bh.shape) == (LAYERS, H) and bool(scorer.bh.ne(0).any())
    for b in (10, 25, 50):
        assert manifest["metrics"][f"val/global_recall@{b}"] == metrics[f"val/global_recall@{b}"]
        assert f"val/recall@{b}" in metrics and f"val/oracle_per_head/global_recall@{b}" in metrics
    # chance is 0.25; the pooled target divides by each head's total, which no feature sees, so 1 is out of reach
    assert metrics["val/global_recall@25"] >= 0.8 and metrics["val/recall@25"] >= 0.9, table
    assert "global recall@25%" in table and "| oracle, each head its own top share |" in table
    assert normalisation_for(Learned(scorer=str(artifact))) == "raw"
    _, uniform, _, uniform_table = synthetic_run
    assert normalisation_for(Learned(scorer=str(uniform))) == "logit"
    assert trained_allocation(load_scorer(uniform)[1]) == "uniform" and "global" not in uniform_table


def test_global_objective_needs_whole_decisions_and_no_distillation(synthetic_run, global_run, tmp_path):
    from learnkv.scorer.fit import train
    from learnkv.traces.store import TraceError

    src, _, _, _ = synthetic_run  # one row per prompt: no decision holds both layers
    with pytest.raises(TraceError, match=r"has trace rows of layers \[[01]\], not all 2"):
        train(config(tmp_path, f"trace_dir={src / 'traces'}", "train.objective=global"), progress=False)
    whole, _, _, _ = global_run
    with pytest.raises(ValueError, match="does not combine with objective global"):
        train(config(tmp_path, f"trace_dir={whole / 'traces'}", "train.objective=global",
                     "train.distill={h2o: 0.1}"), progress=False)
    with pytest.raises(ValueError, match="train.objective"):
        config(tmp_path, "train.objective=pooled")


TRAINING_CONFIGS = ["default", "smoke"] + sorted(p.stem for p in (ROOT / "configs").glob("train-*.yaml"))


@pytest.mark.parametrize("name", TRAINING_CONFIGS)
def test_every_training_config_loads_and_validates(name):
    """The training configs in configs/ load and pass collection's checks without a model (a typo fails here, not
    an hour into a run)."""
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / f"{name}.yaml")
    cfg.collect.validate()


def test_bad_config_is_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  lrate: 1\n")
    out = subprocess.run([sys.executable, "train.py", "--config", str(bad)], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2 and "unknown config key(s) train.lrate" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow
def test_smoke_pipeline_end_to_end(tmp_path):
    """`python train.py --config configs/smoke.yaml` on the bundled model; the artifact drives the learned policy."""
    out = subprocess.run(
        [sys.executable, "train.py", "--config", "configs/smoke.yaml", "--threads", "1",
         f"trace_dir={tmp_path / 'traces'}", f"out_dir={tmp_path / 'train'}"],
        capture_output=True, text=True, cwd=ROOT, timeout=900, env={**__import__("os").environ, "WANDB_MODE": "disabled"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-1].startswith("artifact: ")
    artifact = lines[-1].split("artifact: ", 1)[1]
    assert "| **learned** |" in out.stdout and "| lazy |" in out.stdout

    from learnkv import generate, load_model

    model, tok = load_model()
    result = generate(model, tok, "What is 6 times 7?", policy="learned", budget=48, max_new_tokens=24,
                      policy_params={"scorer": artifact})
    assert result.max_kept_tokens <= 48 and result.texts[0].strip()


def test_rerun_with_another_scorer_shape_is_refused(synthetic_run):
    from learnkv.scorer.fit import train

    tmp, _, _, _ = synthetic_run
    with pytest.raises(ValueError, match="another hidden"):
        train(config(tmp, "train.hidden=8"), progress=False)


def test_rounds_collect_under_the_previous_scorer_and_train_on_the_union(synthetic_run, tmp_path):
    """Round r > 1 collects under the learned policy of round r - 1 into its own trace directory, and trains on every
    round's traces (here two synthetic directories stand for two rounds)."""
    from learnkv.scorer.fit import round_config, train_round

    tmp, artifact, _, _ = synthetic_run
    cfg = config(tmp, "rounds=3", f"out_dir={tmp_path / 'out'}")
    r1, r2 = round_config(cfg, 1, None), round_config(cfg, 2, artifact)
    assert (r1.trace_dir, r1.collect.policy) == (cfg.trace_dir, cfg.collect.policy)
    assert r2.trace_dir == f"{cfg.trace_dir}-round2" and r2.out_dir == str(tmp_path / "out" / "round-2")
    assert r2.collect.policy == "learned" and r2.collect.policy_params == {"scorer": str(artifact)}
    assert round_config(cfg, 3, artifact).out_dir == str(tmp_path / "out")
    second = tmp_path / "second"
    synthetic_traces(second, rows_per_split=(32, 8), seed=1)
    union = config(tmp, f"out_dir={tmp_path / 'union'}", "train.max_epochs=2")
    _, metrics, _ = train_round(union, [union.trace_dir, str(second)], progress=False)
    assert metrics["val/recall@25"] > 0.5
    from learnkv.scorer.data import TraceDataModule

    dm = TraceDataModule([union.trace_dir, str(second)])
    dm.setup()
    assert len(dm.train_rows) == 96 + 32 and len(dm.val_rows) == 24 + 8


def test_rounds_of_the_global_objective_collect_under_global(synthetic_run):
    """A scorer of the global objective is deployed under the ``global`` allocation: so are its on-policy rounds."""
    from learnkv.scorer.fit import round_config

    tmp, artifact, _, _ = synthetic_run
    r2 = round_config(config(tmp, "rounds=2", "train.objective=global"), 2, artifact)
    assert r2.collect.policy_params == {"scorer": str(artifact), "allocation": "global"}
    assert r2.collect.eviction.resolved_allocation.mode == "global"


@pytest.mark.parametrize("objective", ["uniform", "global"])
def test_a_heads_padding_is_no_token_in_training(objective, monkeypatch):
    """A head that held fewer tokens than the row's fullest (positions -1 at the front, `resident`) adds nothing to
    the loss or the validation recalls: garbage in its padded features and labels changes neither."""
    from learnkv.scorer.data import collate, collate_decisions
    from learnkv.scorer.module import ScorerModule

    H, T, F = 2, 6, N_FEATURES
    g = torch.Generator().manual_seed(0)
    live = torch.ones(H, T, dtype=torch.bool)
    live[1, :2] = False  # head 1 held two tokens fewer

    def item(layer, garbage):
        features, label = torch.randn(H, T, F, generator=g), torch.rand(H, T, generator=g)
        features[~live] = garbage
        label[~live] = garbage
        return {"features": features, "label": label, "layer": layer, "live": live}

    def batch(garbage):
        g.manual_seed(1)
        if objective == "global":
            return collate_decisions([[item(0, garbage), item(1, garbage)]])
        return collate([item(0, garbage), item(1, garbage)])

    torch.manual_seed(0)
    module = ScorerModule(n_layers=2, hidden=8, objective=objective, membership_budget=(0.25, 0.5), n_heads=H)
    logs = []
    monkeypatch.setattr(module, "log_dict", lambda d, **kw: logs.append({k: float(v) for k, v in d.items()}))
    clean, dirty = module._step(batch(0.0), "val"), module._step(batch(50.0), "val")
    assert batch(0.0)["mask"].shape == (2, H, T) and torch.equal(batch(0.0)["mask"][0], live)
    assert clean.item() == pytest.approx(dirty.item(), rel=1e-6)
    assert logs[0] == pytest.approx(logs[1], rel=1e-6)
    assert module._step(batch(0.0), "val").item() != pytest.approx(  # the same garbage where tokens live counts
        module._step({**batch(0.0), "mask": torch.ones(2, H, T, dtype=torch.bool)}, "val").item(), rel=1e-6)


def _train_py(tmp_path, *flags):
    """`python train.py` on the synthetic traces with wandb offline (its run summary and Lightning's deprecation
    warnings are what a default run used to print), no decode-time report (no model)."""
    import os

    synthetic_traces(tmp_path / "traces")
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="offline", WANDB_DIR=str(tmp_path), WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"),
               PYTHONWARNINGS="default")
    out = subprocess.run(
        [sys.executable, "train.py", "--config", str(empty), *flags, f"trace_dir={tmp_path / 'traces'}",
         f"out_dir={tmp_path / 'out'}", "wandb.mode=offline", "train.max_epochs=2", "report.prompts=0"],
        capture_output=True, text=True, cwd=ROOT, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return out, tmp_path / "out" / "train.log"


CHATTER = ("wandb:", "Run summary", "GPU available", "deprecated", "Warning", "`Trainer.fit` stopped")


def test_train_py_is_quiet_by_default_and_logs_the_chatter(tmp_path):
    out, log = _train_py(tmp_path)
    printed = out.stdout + out.stderr
    assert not [c for c in CHATTER if c in printed], printed[-3000:]
    assert "| **learned** |" in out.stdout and out.stdout.strip().splitlines()[-1].startswith("artifact: ")
    logged = log.read_text()
    # what used to be printed is in the run's log: Lightning's info lines, the wandb run and its summary
    assert "GPU available" in logged and "`Trainer.fit` stopped" in logged
    assert "Tracking run with wandb" in logged and "Run summary" in logged, logged[-3000:]


def test_train_py_verbose_shows_the_chatter(tmp_path):
    out, log = _train_py(tmp_path, "--verbose")
    printed = out.stdout + out.stderr
    assert "GPU available" in printed and "Run summary" in printed, printed[-3000:]
    assert "| **learned** |" in out.stdout and "GPU available" in log.read_text()
