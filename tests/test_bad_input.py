"""Bad input and interruptions never pass silently and never cost finished work (issue #16).

One test per class of defect, driving the real command line (``main(argv)`` of `python -m learnkv`, `train.py` and
`evaluate.py`, in process, or a subprocess where the process itself matters) or the public API, and asserting a
one-line message, a non-zero exit, and that nothing on disk was lost or relabelled. The README's reliability table
names these tests.
"""

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import random_ids
from learnkv import generate
from learnkv.__main__ import main as learnkv_cli
from learnkv.features import FEATURE_VERSION, N_FEATURES
from learnkv.scorer.artifact import ArtifactError, export_scorer, load_scorer
from learnkv.scorer.model import Scorer
from learnkv.traces.collect import CollectConfig
from learnkv.traces.store import write_manifest, write_shard

ROOT = Path(__file__).resolve().parents[1]
H, T, LAYERS = 2, 12, 2


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"_learnkv_{name}", ROOT / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def run(main, argv, capsys) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of a command-line ``main``."""
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line_error(code: int, err: str, *fragments: str, alone: bool = True) -> None:
    """Exit code 2 and one ``error: ...`` line naming ``fragments``; ``alone``: nothing else on stderr (training
    logs its setup there before it can fail)."""
    assert code == 2, err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == errors[0] and (not alone or err.strip() == errors[0]), err
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` and its bytes (to show that a refused command changed nothing)."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test: the error under test must come before it."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was refused")

    monkeypatch.setattr("learnkv.model.load_model", refuse)


def traces(out: Path, cfg: CollectConfig | None = None, rows=(16, 8), seed=0) -> Path:
    """A small, complete trace directory (random features) labelled with ``cfg`` (default: the default config)."""
    cfg = cfg or CollectConfig()
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)
    for index, (split, n) in enumerate(zip(("train", "validation"), rows)):
        f = rng.normal(size=(n, H, T, N_FEATURES)).astype(np.float32)
        cols = {"prompt_id": [f"{split}{r}" for r in range(n)], "source": ["synthetic"] * n, "split": [split] * n,
                "step": [1] * n, "layer": [r % LAYERS for r in range(n)], "n_heads": [H] * n, "n_tokens": [T] * n,
                "positions": [np.arange(T, dtype=np.int32)] * n, "features": [x.ravel() for x in f],
                "future_sum": [np.exp(x[..., 2]).ravel() for x in f],
                "future_max": [np.exp(x[..., 2]).ravel() for x in f],
                "future_out": [np.exp(x[..., 2]).ravel() for x in f],
                "reenter": [np.zeros(H * T, dtype=np.int8)] * n, "teacher_h2o": [x[..., 5].ravel() for x in f]}
        if cfg.record_values:  # the default config trains a content scorer, which reads them
            cols["head_dim"] = [4] * n
            cols["values"] = [rng.normal(size=H * T * 4).astype(np.float16) for _ in range(n)]
        write_shard(out, index, cols, cols["prompt_id"], cfg.digest())
    write_manifest(out, {"model": "synthetic", "n_layers": LAYERS, "n_kv_heads": H, "teachers": ["h2o"],
                         "config": dataclasses.asdict(cfg), "config_digest": cfg.digest()}, 2)
    return out


def train_args(tmp: Path, *overrides) -> list[str]:
    return ["--threads", "1", f"trace_dir={tmp / 'traces'}", f"out_dir={tmp / 'out'}", "wandb.mode=disabled",
            "train.max_epochs=2", "train.batch_size=8", "collect.teachers=[h2o]", "report.prompts=0", *overrides]


def collect_config(tmp: Path) -> CollectConfig:
    """The collection config `train.py train_args(tmp)` trains with (configs/default.yaml plus the overrides)."""
    from learnkv.config import load_config

    return load_config(ROOT / "configs" / "default.yaml", train_args(tmp)[2:]).collect


# -- 1. a scorer artifact that belongs to another model -----------------------------------------------------------


def test_scorer_of_another_model_is_refused_by_generate(tiny, tmp_path):
    from learnkv.model import tiny_model

    ids = random_ids(20)
    for path, message in [
        (export_scorer(Scorer(3), tmp_path / "layers", model="test", n_kv_heads=2), "3 layers, the model has 2"),
        (export_scorer(Scorer(2), tmp_path / "heads", model="test", n_kv_heads=4), "4 KV heads, the model has 2"),
    ]:
        with pytest.raises(ArtifactError, match=message):
            generate(tiny, input_ids=ids, policy="learned", budget=16, max_new_tokens=4,
                     policy_params={"scorer": str(path)})
    named = tiny_model(seed=0)
    named.config._name_or_path = "/models/smollm2-135m-instruct"  # loaded from a folder named like the alias
    bound = export_scorer(Scorer(2), tmp_path / "bound", model="smollm2-135m-instruct", n_kv_heads=2)
    generate(named, input_ids=ids, policy="learned", budget=16, max_new_tokens=2, policy_params={"scorer": str(bound)})
    named.config._name_or_path = "/models/qwen2.5-coder-0.5b-instruct"
    with pytest.raises(ArtifactError, match="trained for model 'smollm2-135m-instruct', not '/models/qwen2.5"):
        generate(named, input_ids=ids, policy="learned", budget=16, max_new_tokens=2,
                 policy_params={"scorer": str(bound)})


def test_scorer_of_another_model_is_refused_by_the_cli_before_loading(tmp_path, capsys, no_model):
    path = export_scorer(Scorer(30), tmp_path / "s", model="qwen2.5-coder-0.5b-instruct", n_kv_heads=3)
    code, _, err = run(learnkv_cli, ["generate", "--policy", "learned", "--scorer", path, "--budget", "32", "--prompt",
                                     "hi"], capsys)
    one_line_error(code, err, "trained for model 'qwen2.5-coder-0.5b-instruct', not 'smollm2-135m-instruct'")


@pytest.mark.parametrize("edit,message", [
    (lambda m: m["architecture"].update(hidden=16), "tensor shapes disagree with the manifest: b1 (2, 32)"),
    (lambda m: m["architecture"].update(n_layers=3), "architecture says n_layers=3, the manifest 2"),
    (lambda m: m.update(pooling="max"), "pooling rule 'max'"),
])
def test_inconsistent_manifest_is_an_artifact_error(tiny, tmp_path, edit, message):
    path = export_scorer(Scorer(2), tmp_path / "s", model="test", n_kv_heads=2)
    manifest = json.loads((path / "manifest.json").read_text())
    edit(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=message.replace("(", r"\(").replace(")", r"\)")):
        generate(tiny, input_ids=random_ids(20), policy="learned", budget=16, max_new_tokens=4,
                 policy_params={"scorer": str(path)})


# -- 3. a diverged training run ----------------------------------------------------------------------------------


def test_diverged_training_stops_and_exports_nothing(tmp_path, capsys):
    traces(tmp_path / "traces", collect_config(tmp_path))
    code, _, err = run(_script("train"), train_args(tmp_path, "train.lr=1e30", "train.weight_decay=0"), capsys)
    one_line_error(code, err, "training diverged", "lower train.lr", alone=False)
    assert not (tmp_path / "out" / "scorer").exists()


def test_non_finite_weights_are_neither_exported_nor_loaded(tmp_path):
    from safetensors.torch import save_file

    from learnkv.atomic import sha256_file

    scorer = Scorer(2)
    with torch.no_grad():
        scorer.w1[1, 0, 0] = float("nan")
    with pytest.raises(ArtifactError, match="non-finite weights \\(w1\\)"):
        export_scorer(scorer, tmp_path / "nan", model="test", n_kv_heads=2)
    assert not (tmp_path / "nan").exists()
    path = export_scorer(Scorer(2), tmp_path / "ok", model="test", n_kv_heads=2)
    save_file({k: v.contiguous() for k, v in scorer.state_dict().items()}, path / "scorer.safetensors")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["weights_sha256"] = sha256_file(path / "scorer.safetensors")  # a consistent, but diverged, artifact
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="non-finite weights in w1"):
        load_scorer(path)


# -- 4. traces of another feature version or collection config ----------------------------------------------------


def test_merge_refuses_another_feature_version_and_relabels_nothing(tmp_path, capsys):
    out = traces(tmp_path / "t")
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["feature_version"] = FEATURE_VERSION - 1
    (out / "manifest.json").write_text(json.dumps(manifest))
    before = snapshot(out)
    code, _, err = run(learnkv_cli, ["merge", out], capsys)
    one_line_error(code, err, f"feature version {FEATURE_VERSION - 1}", f"computes version {FEATURE_VERSION}")
    assert snapshot(out) == before


def test_collect_refuses_shards_of_another_version_or_config_before_loading(tmp_path, capsys, no_model):
    out = traces(tmp_path / "t")  # labelled with the default config, which `collect` with no options also has
    (out / "manifest.json").unlink()  # only the shards' own sidecars say what they are
    sidecar = (out / "shard-00001.json").read_bytes()
    (out / "shard-00001.json").write_text(json.dumps({**json.loads(sidecar), "feature_version": FEATURE_VERSION - 1}))
    before = snapshot(out)
    code, _, err = run(learnkv_cli, ["collect", "--out", out], capsys)
    one_line_error(code, err, f"shard-00001.json: shard of feature version {FEATURE_VERSION - 1}")
    assert snapshot(out) == before
    (out / "shard-00001.json").write_bytes(sidecar)
    code, _, err = run(learnkv_cli, ["collect", "--out", out, "--horizon", "8"], capsys)
    one_line_error(code, err, "shard-00000.json: shard collected with config digest")
    assert snapshot(out) == {**before, "shard-00001.json": sidecar}


def test_train_refuses_traces_of_another_config_and_says_what_differs(tmp_path, capsys):
    traces(tmp_path / "traces", dataclasses.replace(collect_config(tmp_path), horizon=8))
    before = snapshot(tmp_path / "traces")
    code, _, err = run(_script("train"), train_args(tmp_path), capsys)
    one_line_error(code, err, "holds traces of another config (horizon: 8 there, 32 here)", "collect.*")
    assert snapshot(tmp_path / "traces") == before and not (tmp_path / "out").exists()


# -- 5. a command's output that would be lost at the end ---------------------------------------------------------


def test_evaluate_output_that_is_a_file_is_refused_before_loading(tmp_path, capsys, no_model):
    target = tmp_path / "results"
    target.write_text("my notes")
    code, _, err = run(_script("evaluate"), ["--policy", "full", "--output", target], capsys)
    one_line_error(code, err, f"output directory {target} is a file")
    assert target.read_text() == "my notes"


@pytest.mark.parametrize("case", ["file", "under_a_file", "not_writable"])
def test_every_output_directory_is_checked_by_one_rule(tmp_path, case):
    """evaluate's results, collect's traces and fit's scorer all go through `ensure_dir`: each refusal names why."""
    from learnkv.atomic import ensure_dir
    from learnkv.traces.store import TraceError

    blocker = tmp_path / "notes"
    blocker.write_text("my notes")
    target, why = {"file": (blocker, "is a file"), "under_a_file": (blocker / "sub", "cannot create"),
                   "not_writable": (tmp_path / "ro", "is not writable")}[case]
    if case == "not_writable":
        target.mkdir()
        target.chmod(0o500)
        if os.access(target, os.W_OK):
            pytest.skip("running as a user who can write anywhere (root)")
    with pytest.raises(TraceError, match=why) as refused:
        ensure_dir(target, "trace directory", TraceError)
    assert f"trace directory {target}" in str(refused.value) and "\n" not in str(refused.value)
    assert blocker.read_text() == "my notes"
    assert ensure_dir(tmp_path / "new" / "dir", "output directory").is_dir()


def test_evaluate_rerun_keeps_the_earlier_results(tmp_path):
    from learnkv.eval.report import prepare_output, write_results

    def records(kl):
        return [{"policy": "full", "budget": 0.5, "task": "fidelity", "metrics": {"kl": kl, "kl_ci95": [kl, kl]},
                 "per_prompt": {"kl": [kl]}, "config": {"n_prompts": 1, "model": "tiny"}}]

    out = tmp_path / "eval"
    assert prepare_output(out) is None and out.is_dir()
    write_results(records(0.1), out)
    note = prepare_output(out)
    assert "holds an earlier run's results" in note and "earlier-" in note
    write_results(records(0.2), out)
    (kept,) = out.glob("earlier-*")
    assert json.loads((kept / "results.json").read_text())["records"][0]["metrics"]["kl"] == 0.1
    assert json.loads((out / "results.json").read_text())["records"][0]["metrics"]["kl"] == 0.2
    assert (kept / "fidelity_kl.png").is_file() and (out / "fidelity_kl.png").is_file()


# -- 6. config values of the wrong type or out of range ----------------------------------------------------------


@pytest.mark.parametrize("override,message", [
    ("train.hidden=abc", "train.hidden must be an integer, got 'abc'"),
    ("train.hidden=0", "train.hidden must be >= 1, got 0"),
    ("collect.prompts=abc", "collect.prompts must be an integer, got 'abc'"),
    ("train.lr=nan", "train.lr must be a finite number, got nan"),
    ("collect.label_budget=2", "collect.label_budget must be in (0, 1], got 2.0"),
    ("train.distill={h2o: -1}", "train.distill.h2o must be >= 0, got -1.0"),
    ("train.label=future", "train.label must be one of future_sum, future_max"),
    ("collect.sources=[nope]", "unknown prompt source(s) ['nope']"),
    ("report.prefill_policy=lazy", "report.prefill_policy: policy 'lazy' cannot be a prefill policy"),
])
def test_bad_config_values_are_one_line(tmp_path, capsys, override, message):
    code, _, err = run(_script("train"), train_args(tmp_path, override), capsys)
    one_line_error(code, err, message)
    assert not (tmp_path / "out").exists() and not (tmp_path / "traces").exists()


def test_yaml_1_1_exponents_are_numbers_and_malformed_yaml_names_the_line(tmp_path, capsys):
    from learnkv.config import load_config

    cfg = load_config(None, ["train.lr=1e-3", "train.max_epochs=1e1"])
    assert cfg.train.lr == 0.001 and cfg.train.max_epochs == 10 and isinstance(cfg.train.max_epochs, int)
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  lr: 1e-3\n  distill: {h2o: 0.1\n")
    code, _, err = run(_script("train"), ["--config", bad], capsys)
    one_line_error(code, err, f"{bad} line 4: malformed YAML")


# -- 7. merge names the shards it cannot use ---------------------------------------------------------------------


def test_merge_names_corrupt_and_missing_shards(tmp_path, capsys):
    out = traces(tmp_path / "t", rows=(16, 8))
    shard = out / "shard-00001.arrow"
    shard.write_bytes(shard.read_bytes()[:-100])
    code, out_text, err = run(learnkv_cli, ["merge", out], capsys)
    assert code == 0 and "shard-00001.arrow: checksum differs from its sidecar, will be recollected" in err
    assert "1/2 shards" in out_text and "incomplete" in out_text
    (out / "shard-00000.arrow").unlink()
    (out / "shard-00000.json").unlink()
    code, _, err = run(learnkv_cli, ["merge", out], capsys)
    assert "shard-00000.arrow: listed in the manifest but gone, with its sidecar, will be recollected" in err


# -- 8. Ctrl-C during collect, and the debris a kill leaves ------------------------------------------------------


def test_interrupted_collect_says_what_was_kept_and_resumes(tmp_path, capsys, monkeypatch, small):
    import learnkv.decode

    model, tok = small
    monkeypatch.setattr("learnkv.model.load_model", lambda *a, **k: (model, tok))
    real_generate, calls = learnkv.decode.generate, []

    def interrupted_on_the_second_prompt(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_generate(*args, **kwargs)

    monkeypatch.setattr("learnkv.decode.generate", interrupted_on_the_second_prompt)
    out = tmp_path / "t"
    argv = ["collect", "--out", out, "--prompts", "2", "--val-prompts", "0", "--max-new-tokens", "10", "--horizon", "3",
            "--decisions", "1", "--prompts-per-shard", "1"]
    code, _, err = run(learnkv_cli, argv, capsys)
    assert code == 130 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (f"interrupted: 1/2 shards are finished and kept in {out}; the shard in "
                                            "progress was discarded. Rerun the same command to resume.")
    kept = snapshot(out)
    (out / "shard-00001.arrow.tmp-99999999").write_bytes(b"half a shard")  # what a SIGKILL mid-write leaves
    code, text, err = run(learnkv_cli, argv, capsys)
    assert code == 0 and "1 new shards (1 already done)" in text and "(complete)" in text
    assert "removed 1 temporary file(s) an interrupted collector left: shard-00001.arrow.tmp-99999999" in err
    assert not list(out.glob("*.tmp-*"))
    assert all(snapshot(out)[name] == data for name, data in kept.items() if name != "manifest.json")


# -- 9 and 10. bad arguments, refused before any model loads -----------------------------------------------------


@pytest.mark.parametrize("args,message", [
    (["--policy", "h2o", "--budget", "-5"], "budget must be >= 1 token, got -5"),
    (["--policy", "h2o", "--budget", "8", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["--policy", "h2o", "--budget", "4", "--param", "n_recent=10"], "do not fit in a budget of 4 tokens"),
    (["--policy", "learned", "--scorer", "/no/such/scorer", "--budget", "32"], "'/no/such/scorer' does not exist"),
    (["--policy", "learned", "--scorer", "/no/such/scorer", "--budget", "0.5"], "'/no/such/scorer' does not exist"),
])
def test_generate_refuses_before_loading_the_model(capsys, no_model, args, message):
    code, _, err = run(learnkv_cli, ["generate", "--prompt", "hi", *args], capsys)
    one_line_error(code, err, message)


@pytest.mark.parametrize("args,message", [
    (["--source", "nope"], "unknown prompt source(s) ['nope']"),
    (["--prompts", "0"], "prompts must be >= 1, got 0"),
])
def test_collect_refuses_before_loading_the_model(tmp_path, capsys, no_model, args, message):
    code, _, err = run(learnkv_cli, ["collect", "--out", tmp_path / "t", *args], capsys)
    one_line_error(code, err, message)


def test_collect_out_that_is_a_file(tmp_path, capsys, no_model):
    target = tmp_path / "traces"
    target.write_text("not a directory")
    code, _, err = run(learnkv_cli, ["collect", "--out", target], capsys)
    one_line_error(code, err, f"trace directory {target} is a file")
    assert target.read_text() == "not a directory"


def test_one_empty_prompt_among_several_is_named():
    from learnkv.decode import encode_prompts

    with pytest.raises(ValueError, match="prompt 2 of 3 is empty"):
        encode_prompts(None, ["a question", "  ", "another"])


# -- 11. resuming and rerunning training -------------------------------------------------------------------------


def test_failed_resume_locks_nothing_out_and_finished_run_is_not_retrained(tmp_path, capsys):
    train = _script("train")
    traces(tmp_path / "traces", collect_config(tmp_path))
    # a learning rate too small to change any ranking: validation never improves after the first epoch
    code, text, err = run(train, train_args(tmp_path, "train.max_epochs=3", "train.lr=1e-12"), capsys)
    assert code == 0, err
    ckpts = tmp_path / "out" / "checkpoints"
    assert torch.load(ckpts / "last.ckpt", weights_only=False)["epoch"] == 2  # advanced without improving
    assert torch.load(next(ckpts.glob("best*.ckpt")), weights_only=False)["epoch"] == 0
    before = snapshot(tmp_path / "out")
    code, _, err = run(train, train_args(tmp_path, "train.max_epochs=3", "train.lr=1e-12", "train.hidden=8"), capsys)
    one_line_error(code, err, "holds a run with another hidden")
    assert snapshot(tmp_path / "out") == before  # nothing written by the refused attempt
    code, again, err = run(train, train_args(tmp_path, "train.max_epochs=3", "train.lr=1e-12"), capsys)
    assert code == 0, err
    assert "finished: nothing to do" in again and again.splitlines()[-1] == text.splitlines()[-1]
    assert snapshot(tmp_path / "out") == before  # not retrained, not re-exported


# -- the real processes: exit codes and one line on stderr --------------------------------------------------------


def test_real_cli_processes_exit_2_with_one_line(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    target = tmp_path / "file"
    target.write_text("x")
    for cmd, message in [
        ([sys.executable, "-m", "learnkv", "generate", "--prompt", "hi", "--policy", "h2o", "--budget", "-5"],
         "budget must be >= 1 token"),
        ([sys.executable, "train.py", "train.lr=abc"], "train.lr must be a number, got 'abc'"),
        ([sys.executable, "evaluate.py", "--policy", "full", "--output", str(target)], "is a file"),
    ]:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
        one_line_error(proc.returncode, proc.stderr, message)
