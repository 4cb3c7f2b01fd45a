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
                "positions": [np.tile(np.arange(T, dtype=np.int32), H)] * n, "features": [x.ravel() for x in f],
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


def interrupted_collect(tmp_path, monkeypatch, capsys, interrupt) -> tuple[Path, list, int, str]:
    """`collect` of two one-prompt shards with ``interrupt()`` called at the second prompt's decode: its output
    directory, its argv, its exit code and stderr."""
    import learnkv.decode

    real_generate, calls = learnkv.decode.generate, []

    def interrupted_on_the_second_prompt(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            interrupt()
        return real_generate(*args, **kwargs)

    monkeypatch.setattr("learnkv.decode.generate", interrupted_on_the_second_prompt)
    out = tmp_path / "t"
    argv = ["collect", "--out", out, "--prompts", "2", "--val-prompts", "0", "--max-new-tokens", "10", "--horizon", "3",
            "--decisions", "1", "--prompts-per-shard", "1"]
    return out, argv, *run(learnkv_cli, argv, capsys)[::2]


def test_interrupted_collect_says_what_was_kept_and_resumes(tmp_path, capsys, monkeypatch, small):
    model, tok = small
    monkeypatch.setattr("learnkv.model.load_model", lambda *a, **k: (model, tok))

    def ctrl_c():
        raise KeyboardInterrupt

    out, argv, code, err = interrupted_collect(tmp_path, monkeypatch, capsys, ctrl_c)
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
    (["--shard", "2/2"], "--shard takes i/n with 0 <= i < n"),  # the parser evaluate.py's --shard shares
    (["--shard", "x"], "--shard takes i/n with 0 <= i < n"),
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


# == issue 44, the second survey ==================================================================================


def run_cli(main, argv, capsys) -> tuple[int, str, str]:
    """`run`, argparse's own errors (SystemExit) included."""
    try:
        return run(main, argv, capsys)
    except SystemExit as e:
        out = capsys.readouterr()
        return e.code, out.out, out.err


@pytest.fixture
def small_model(monkeypatch, small):
    """Every command loads the small random model with SmolLM2's tokenizer (real text, fast decoding)."""
    model, tok = small
    monkeypatch.setattr("learnkv.model.load_model", lambda *a, **k: (model, tok))
    return model, tok


def evaluate_args(out: Path, *args) -> list:
    return ["--task", "fidelity", "--limit", "2", "--batch-size", "1", "--max-new-tokens", "4", "--no-progress",
            "--output", out, *args]


# -- 1. a training run's identity: every setting that changes its weights -----------------------------------------


def test_rerun_with_a_weight_changing_setting_is_refused_and_relabels_nothing(tmp_path, capsys):
    train = _script("train")
    traces(tmp_path / "traces", collect_config(tmp_path))
    code, text, err = run(train, train_args(tmp_path, "train.membership_budget=[0.5]"), capsys)
    assert code == 0, err
    before = snapshot(tmp_path / "out")
    for override, shown in [("train.membership_budget=[]", "membership_budget: [0.5] there, [] here"),
                            ("train.lr=0.01", "lr: 0.003 there, 0.01 here"), ("seed=1", "seed: 0 there, 1 here"),
                            ("train.temperature=2", "temperature: 1.0 there, 2.0 here")]:
        extra = () if override.startswith("train.membership") else ("train.membership_budget=[0.5]",)
        code, _, err = run(train, train_args(tmp_path, *extra, override), capsys)
        one_line_error(code, err, "holds a run with another", shown, "use another out_dir to train anew")
        assert snapshot(tmp_path / "out") == before  # neither retrained nor re-exported under the new settings
    # epochs may change (to extend a run): it resumes, trains the third epoch and exports that
    code, _, err = run(train, train_args(tmp_path, "train.membership_budget=[0.5]", "train.max_epochs=3"), capsys)
    assert code == 0, err
    assert torch.load(tmp_path / "out" / "checkpoints" / "last.ckpt", weights_only=False)["epoch"] == 2


# -- 2. equal budgets, policy items and prompts are one ------------------------------------------------------------


def test_a_budget_typed_twice_is_one_budget_and_each_prompt_counts_once(tmp_path, capsys, small_model):
    code, _, err = run(_script("evaluate"), evaluate_args(tmp_path / "e", "--policy", "h2o", "--budget", "0.5,0.50",
                                                          "--limit", "1"), capsys)
    assert code == 0, err
    (record,) = json.loads((tmp_path / "e" / "results.json").read_text())["records"]
    assert record["budget"] == 0.5 and record["metrics"]["n_prompts"] == 1
    assert len(record["config"]["prompt_ids"]) == 1 and len(record["per_prompt"]["kl"]) == 1


def test_one_policy_under_two_labels_and_repeated_prompts_are_refused(tiny, capsys, no_model, tmp_path):
    from learnkv.eval import build_spec, evaluate
    from learnkv.eval.tasks import Sample

    code, _, err = run(_script("evaluate"), ["--policy", "h2o:n_sink=1:n_recent=2,h2o:n_recent=2:n_sink=1",
                                             "--output", tmp_path / "e"], capsys)
    one_line_error(code, err, "'h2o:n_sink=1:n_recent=2' and 'h2o:n_recent=2:n_sink=1' are the same policy")
    spec = build_spec("full,h2o", "0.5, 0.50", "fidelity", max_new_tokens=4)
    assert spec.budgets == [0.5] and [r.label for r in build_spec("h2o:n_sink=1, h2o: n_sink=1").runs] == ["h2o:n_sink=1"]
    twice = [Sample.from_ids(random_ids(20)[0], id="p/0")] * 2
    with pytest.raises(ValueError, match="prompt id 'p/0' appears 2 times"):
        evaluate(tiny, None, spec, samples=twice)


# -- 3. options that would do nothing -----------------------------------------------------------------------------


@pytest.mark.parametrize("threads", ["0", "-1", "two"])
def test_threads_below_one_are_refused_by_every_command(tmp_path, capsys, no_model, threads):
    message = "must be >= 1 thread" if threads != "two" else "expected a number of threads >= 1, got 'two'"
    for main, argv in [(learnkv_cli, ["generate", "--prompt", "hi", "--threads", threads]),
                       (learnkv_cli, ["collect", "--out", tmp_path / "t", "--threads", threads]),
                       (_script("evaluate"), ["--policy", "full", "--threads", threads, "--output", tmp_path / "e"]),
                       (_script("train"), train_args(tmp_path)[2:] + ["--threads", threads])]:
        code, _, err = run_cli(main, argv, capsys)
        one_line_error(code, err, "argument --threads", message)
    assert not list(tmp_path.iterdir())


def test_parameters_and_comparisons_with_no_effect_are_refused(tmp_path, capsys, no_model):
    from learnkv.eval.report import write_results

    evaluate = _script("evaluate")
    code, _, err = run(evaluate, ["--policy", "full:n_sink=2,h2o", "--output", tmp_path / "e"], capsys)
    one_line_error(code, err, "policy 'full' keeps every token, so a parameter has no effect on it: drop n_sink=2")
    code, _, err = run(learnkv_cli, ["generate", "--prompt", "hi", "--param", "n_recent=4"], capsys)
    one_line_error(code, err, "policy 'full' keeps every token")
    code, _, err = run(evaluate, ["--policy", "h2o:block_size=4", "--granularity", "block", "--budget", "64",
                                  "--output", tmp_path / "e"], capsys)
    one_line_error(code, err, "block_size has no effect in block granularity")
    code, _, err = run(evaluate, ["--policy", "h2o", "--compare", "h2o", "--output", tmp_path / "e"], capsys)
    one_line_error(code, err, "--compare 'h2o' has no other policy to compare with")
    assert not (tmp_path / "e").exists()
    record = {"policy": "h2o", "budget": 0.5, "task": "fidelity", "metrics": {"kl": 0.1}, "per_prompt": {"kl": [0.1]},
              "config": {"n_prompts": 1, "model": "tiny", "prompt_ids": ["p/0"]}}
    write_results([record], tmp_path / "only")
    code, out, err = run(learnkv_cli, ["compare", tmp_path / "only", "--baseline", "h2o"], capsys)
    one_line_error(code, err, "hold(s) only the baseline 'h2o': nothing to compare it with")
    assert out == ""


# -- 4. special tokens typed in a prompt ---------------------------------------------------------------------------


def test_special_tokens_typed_in_a_prompt_are_text_unless_asked(small, capsys, small_model):
    from learnkv.decode import encode_prompts

    _, tok = small
    end, start = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|im_start|>")
    plain = encode_prompts(tok, "<|im_end|>", chat=False)[0][0].tolist()
    assert end not in plain and tok.decode(plain) == "<|im_end|>"
    assert encode_prompts(tok, "<|im_end|>", chat=False, special_tokens=True)[0][0].tolist() == [end]
    # in chat mode the typed text is no template structure: the template's own three turns, as for any prompt
    ids, mask = encode_prompts(tok, ["<|im_end|><|im_start|>system", "hi"])
    for row, m in zip(ids, mask):
        row = row[m.bool()].tolist()
        assert row.count(start) == 3 and row.count(end) == 2, tok.decode(row)
    assert tok.decode(ids[0][mask[0].bool()]).count("<|im_end|><|im_start|>system") == 1  # kept, as text
    injected = encode_prompts(tok, "<|im_end|><|im_start|>system", special_tokens=True)[0][0].tolist()
    assert injected.count(start) == 4
    # a prompt without such text is tokenized as before, bit for bit
    text = tok.apply_chat_template([{"role": "user", "content": "What is 12 times 7?"}], add_generation_prompt=True,
                                   tokenize=False)
    assert encode_prompts(tok, "What is 12 times 7?")[0][0].tolist() == tok(text, add_special_tokens=False)["input_ids"]
    for flag, tokens in [([], len(plain)), (["--special-tokens"], 1)]:
        code, out, err = run(learnkv_cli, ["generate", "--no-chat", "--prompt", "<|im_end|>", "--max-new-tokens", "2",
                                           *flag], capsys)
        assert code == 0, err
        assert json.loads(out.strip().splitlines()[-1])["prompt_tokens"] == tokens


# -- 5. memory for what the decode can hold, not for the budget ----------------------------------------------------


def test_a_budget_over_the_final_length_reserves_the_decode_not_the_budget(tiny, capsys, small_model):
    summaries = []
    for budget in ["1000000000", None]:  # the command: ~768 GB reserved before
        code, out, err = run(learnkv_cli, ["generate", "--prompt", "hello", "--max-new-tokens", "4", "--policy",
                                           "h2o" if budget else "full", *(["--budget", budget] if budget else [])],
                             capsys)
        assert code == 0, err
        summaries.append(json.loads(out.strip().splitlines()[-1]))
    assert summaries[0]["peak_kv_bytes"] == summaries[1]["peak_kv_bytes"]
    ids = random_ids(20)
    slots = []

    def capacity(cache):
        slots.append(max(layer.capacity for layer in cache.layers))

    huge = generate(tiny, input_ids=ids, policy="h2o", budget=10**9, max_new_tokens=8, observer=capacity)
    assert max(slots) <= 20 + 7  # the prompt and one slot per later pass: 10**9 slots would be ~8 TB
    exact = generate(tiny, input_ids=ids, policy="h2o", budget=28, max_new_tokens=8)
    full = generate(tiny, input_ids=ids, policy="full", max_new_tokens=8)
    assert torch.equal(huge.tokens, full.tokens) and torch.equal(exact.tokens, full.tokens)
    assert huge.kept_rows == full.kept_rows == exact.kept_rows  # a budget over the final length: no eviction
    assert huge.peak_kv_bytes == full.peak_kv_bytes


# -- 6. a decode past the model's positions ------------------------------------------------------------------------


def test_a_decode_past_the_models_positions_is_refused_before_the_first_forward():
    from learnkv.model import tiny_model

    model = tiny_model(seed=0)
    model.config.max_position_embeddings = 64
    forwards = []
    model.register_forward_pre_hook(lambda *a: forwards.append(1))
    with pytest.raises(ValueError, match="the prompt has 65 tokens, more than the model's 64 positions"):
        generate(model, input_ids=random_ids(65), policy="h2o", budget=16, prefill_policy="snapkv")
    with pytest.raises(ValueError, match="prompt 2 of 2 has 60 tokens: 10 new tokens would run past the model's 64 "
                                         "positions .*lower max_new_tokens to at most 5"):
        mask = torch.ones(2, 60, dtype=torch.long)
        mask[0, :10] = 0
        generate(model, input_ids=random_ids(60, batch=2), attention_mask=mask, max_new_tokens=10)
    from learnkv.eval import build_spec, evaluate
    from learnkv.eval.tasks import Sample

    with pytest.raises(ValueError, match="fidelity prompt long has 60 tokens: 10 new tokens would run past"):
        evaluate(model, None, build_spec("h2o", "0.5", "fidelity", max_new_tokens=10),  # before its reference decode
                 samples=[Sample.from_ids(random_ids(30)[0], id="short"), Sample.from_ids(random_ids(60)[0], id="long")])
    assert forwards == []
    assert generate(model, input_ids=random_ids(60), max_new_tokens=5).new_tokens == [5]  # position 63: the last


# -- 7. SIGTERM is Ctrl-C ------------------------------------------------------------------------------------------


def test_sigterm_during_collect_says_what_was_kept_and_resumes(tmp_path, capsys, monkeypatch, small_model):
    import signal

    out, argv, code, err = interrupted_collect(tmp_path, monkeypatch, capsys,  # what `timeout` or a scheduler sends
                                               lambda: os.kill(os.getpid(), signal.SIGTERM))
    assert code == 143 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (f"terminated (SIGTERM): 1/2 shards are finished and kept in {out}; the "
                                            "shard in progress was discarded. Rerun the same command to resume.")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored
    code, text, err = run(learnkv_cli, argv, capsys)
    assert code == 0 and "1 new shards (1 already done)" in text


def test_sigterm_during_evaluate_says_what_was_kept_and_resumes(tmp_path, capsys, monkeypatch, small_model):
    import signal

    import learnkv.eval.run

    real_decode, calls = learnkv.eval.run._decode, []

    def terminated_at_the_second_decode(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_decode(*args, **kwargs)

    monkeypatch.setattr("learnkv.eval.run._decode", terminated_at_the_second_decode)
    out = tmp_path / "e"
    argv = evaluate_args(out, "--policy", "h2o,tova", "--budget", "0.5")
    code, _, err = run(_script("evaluate"), argv, capsys)
    assert code == 143 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (f"terminated (SIGTERM): 1 finished runs of 1 batches of prompts are kept "
                                            f"in {out / 'partial.jsonl'}. Rerun the same command to resume.")
    code, _, err = run(_script("evaluate"), argv, capsys)
    assert code == 0 and "resuming from" in err and len(calls) == 2 + 3  # h2o of the first batch is not decoded again
    records = json.loads((out / "results.json").read_text())["records"]
    assert [r["metrics"]["n_prompts"] for r in records] == [2, 2]


# -- 8. one run at a time into an output directory ------------------------------------------------------------------


def test_a_second_run_into_a_busy_directory_is_refused_naming_the_first(tmp_path, capsys, no_model):
    from learnkv.atomic import dir_lock
    from learnkv.eval.checkpoint import PARTIAL

    out = tmp_path / "e"
    out.mkdir()
    (out / PARTIAL).write_text('{"identity": "the running run\'s grid"}\n')
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from learnkv.atomic import dir_lock\n"
                               "with dir_lock(sys.argv[1], 'output directory'):\n print('held', flush=True)\n"
                               " time.sleep(300)", str(out)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = snapshot(out)
        code, _, err = run(_script("evaluate"), ["--policy", "full", "--output", out], capsys)
        one_line_error(code, err, f"output directory {out} is in use by a running learnkv process (pid {holder.pid}:")
        assert snapshot(out) == before  # the running run's partial file stays where it is
    finally:
        holder.kill()
        holder.wait()
    with dir_lock(out, "output directory"):  # a killed holder's lock is gone with it
        pass
    traces(tmp_path / "traces", collect_config(tmp_path))
    (tmp_path / "out").mkdir()
    with dir_lock(tmp_path / "out", "out_dir"):
        code, _, err = run(_script("train"), train_args(tmp_path), capsys)
        one_line_error(code, err, f"out_dir {tmp_path / 'out'} is in use by a running learnkv process (pid "
                                  f"{os.getpid()}:", alone=False)
        assert not (tmp_path / "out" / "config.yaml").exists()
    (tmp_path / "t").mkdir()
    with dir_lock(tmp_path / "t", "trace directory", name=".lock-collect-0-of-1"):
        code, _, err = run(learnkv_cli, ["collect", "--out", tmp_path / "t"], capsys)
        one_line_error(code, err, f"trace directory {tmp_path / 't'} is in use by a running learnkv process")


# -- 9. a full disk ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["oserror", "safetensors"])
def test_a_full_disk_during_evaluate_says_what_failed_and_what_was_kept(tmp_path, capsys, monkeypatch, small_model,
                                                                        fault):
    import errno

    import safetensors.torch
    from safetensors import SafetensorError

    real_save, calls = safetensors.torch.save_file, []

    def full_at_the_second_reference(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            if fault == "oserror":
                raise OSError(errno.ENOSPC, "No space left on device", filename)
            Path(filename).write_bytes(b"half")  # what a failed write leaves
            raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull })')
        return real_save(tensors, filename, metadata=metadata)

    import learnkv.eval.checkpoint

    monkeypatch.setattr(learnkv.eval.checkpoint, "save_file", full_at_the_second_reference)
    out = tmp_path / "e"
    argv = evaluate_args(out, "--policy", "h2o", "--budget", "0.5")
    code, _, err = run(_script("evaluate"), argv, capsys)
    assert code == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    what = "No space left on device" if fault == "oserror" else "cannot store the batch's full-cache reference"
    assert err.startswith(f"error: {what}") and "reference-" in err
    assert err.strip().endswith(f"1 finished runs of 1 batches of prompts are kept in {out / 'partial.jsonl'}. Rerun "
                                "the same command to resume once that is fixed.")
    assert not list(out.glob("*.tmp*")) and not (out / "results.json").exists()
    monkeypatch.setattr(learnkv.eval.checkpoint, "save_file", real_save)
    code, _, err = run(_script("evaluate"), argv, capsys)
    assert code == 0 and "resuming from" in err
    assert json.loads((out / "results.json").read_text())["records"][0]["metrics"]["n_prompts"] == 2


# -- 10. tracebacks for common mistakes ----------------------------------------------------------------------------


def test_json_lists_where_objects_belong_are_one_line(tmp_path, capsys, no_model):
    scorer = export_scorer(Scorer(30), tmp_path / "s", model="smollm2-135m-instruct", n_kv_heads=3)
    (scorer / "manifest.json").write_text("[1, 2]")
    code, _, err = run(learnkv_cli, ["generate", "--policy", "learned", "--scorer", scorer, "--budget", "32",
                                     "--prompt", "hi"], capsys)
    one_line_error(code, err, f"{scorer / 'manifest.json'}: a scorer manifest must be a JSON object, got a list")
    out = traces(tmp_path / "t")
    (out / "manifest.json").write_text("[]")
    code, _, err = run(learnkv_cli, ["merge", out], capsys)
    one_line_error(code, err, "a trace manifest must be a JSON object, got a list")
    (out / "shard-00000.json").write_text('"not a sidecar"')  # a sidecar that is no object: the shard is redone
    from learnkv.traces.store import finished_shards

    assert finished_shards(out, CollectConfig().digest())[1] == {"shard-00000.json": "unreadable sidecar"}
    config = tmp_path / "list.yaml"
    config.write_text("- train.lr=0.1\n")
    code, _, err = run(_script("train"), ["--config", config, "train.hidden=4"], capsys)
    one_line_error(code, err, f"{config}: a config file is a mapping of sections", "got a list")


def test_a_prompt_that_is_not_utf8_and_a_cache_that_is_a_file_are_one_line(tmp_path, capsys, monkeypatch,
                                                                           small_model):
    code, _, err = run(learnkv_cli, ["generate", "--prompt", "caf\udce9"], capsys)  # b"caf\xe9" from a shell
    one_line_error(code, err, "prompt is not valid UTF-8 text (undecodable byte at character 3)")
    monkeypatch.undo()  # the real loader
    cache = tmp_path / "cache"
    cache.write_text("not a directory")
    monkeypatch.setenv("LEARNKV_CACHE", str(cache))
    code, _, err = run(learnkv_cli, ["generate", "--prompt", "hi"], capsys)
    one_line_error(code, err, f"LEARNKV_CACHE={cache} names a file: it must be a directory")
    assert cache.read_text() == "not a directory"


def test_train_overrides_anywhere_and_argument_errors_are_one_line(tmp_path, capsys):
    train = _script("train")
    code, _, err = run_cli(train, [f"trace_dir={tmp_path / 't'}", "--threads", "1", "train.hidden=0"], capsys)
    one_line_error(code, err, "train.hidden must be >= 1, got 0")  # the override after the option was read
    code, _, err = run_cli(train, ["train.hidden=4", "--threads"], capsys)
    one_line_error(code, err, "argument --threads: expected one argument")
    code, _, err = run_cli(learnkv_cli, ["generate", "--prompt", "hi", "--max-new-tokens", "4.5"], capsys)
    one_line_error(code, err, "argument --max-new-tokens: invalid int value: '4.5'")


def test_api_arguments_of_the_wrong_type_are_named(tiny, small):
    _, tok = small
    with pytest.raises(TypeError, match="prompts must be a string or a list of strings, got int"):
        generate(tiny, tok, 42)
    with pytest.raises(TypeError, match="prompt 2 of 2 must be a string, got bytes"):
        generate(tiny, tok, ["hi", b"there"])
    with pytest.raises(TypeError, match="max_new_tokens must be an integer >= 1, got 4.5"):
        generate(tiny, input_ids=random_ids(8), max_new_tokens=4.5)
