"""The training pipeline behind `python train.py`: traces (collected if missing) -> fit -> budget recall -> export,
round after round (`PipelineConfig.rounds`), then the decode-time comparison (`learnkv.scorer.report`).

Round 1 collects under ``collect.policy`` (the full cache, or any evicting policy: traces under eviction) into
``trace_dir`` and trains. Each later round r collects under the previous round's learned scorer into
``trace_dir-round<r>`` (the states the learned policy itself reaches, labelled by branches of them) and trains on
the union of every round's traces, as DAgger does. Rounds before the last export into ``out_dir/round-<r>``; the
last one into ``out_dir``. Every round resumes like a single run: finished shards and rounds are never redone.
"""

from __future__ import annotations

import dataclasses
import json
import netrc
import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, WandbLogger

from learnkv.atomic import dir_lock, ensure_dir, write_json_atomic
from learnkv.config import PipelineConfig, save_config, to_dict
from learnkv.runlog import loud_wandb, quiet_wandb
from learnkv.scorer.artifact import ArtifactError, export_scorer, load_scorer
from learnkv.scorer.data import TraceDataModule, feature_stats
from learnkv.scorer.module import BUDGETS, ScorerModule, monitor_for
from learnkv.traces.collect import check_same_config, collect
from learnkv.traces.store import MANIFEST, read_manifest


def make_logger(cfg: PipelineConfig, out_dir: Path):
    """WandbLogger, offline unless the user has a wandb key (or WANDB_MODE says otherwise); CSV without wandb."""
    mode = os.environ.get("WANDB_MODE") or cfg.wandb.mode
    if mode == "auto":
        has_key = bool(os.environ.get("WANDB_API_KEY"))
        try:
            has_key = has_key or netrc.netrc().authenticators("api.wandb.ai") is not None
        except (FileNotFoundError, netrc.NetrcParseError):
            pass
        mode = "online" if has_key else "offline"
    try:
        import wandb  # noqa: F401  (absent on some GPU images)
    except ImportError:
        print("wandb is not installed: logging to CSV instead")
        return CSVLogger(str(out_dir), name="logs")
    return WandbLogger(project=cfg.wandb.project, save_dir=str(out_dir), mode=mode, config=to_dict(cfg))


def ensure_traces(cfg: PipelineConfig, progress: bool = True) -> dict:
    """The trace manifest, collecting traces first if the trace directory lacks a complete set. Traces of another
    format, feature version or collection config are refused, saying what differs."""
    if (Path(cfg.trace_dir) / MANIFEST).exists():
        manifest = read_manifest(cfg.trace_dir)
        check_same_config(manifest, cfg.collect, f"trace_dir {cfg.trace_dir}",
                          "set collect.* to the settings it was collected with, or use another trace_dir")
        if manifest["complete"]:
            return manifest
    print(f"collecting traces into {cfg.trace_dir}")
    manifest, stats = collect(cfg.trace_dir, cfg.collect, progress=progress)
    for line in stats.problems:
        print(f"note: {line}")
    print(stats.line())
    return read_manifest(cfg.trace_dir)


#: what a checkpoint records of the run that wrote it (`RunIdentity`), and what a resumed run must share
IDENTITY_KEY = "learnkv_run"


#: training settings a rerun may change to extend a run (more epochs, more patience) or to run it elsewhere: they
#: change when training stops or where it runs, not the weights an epoch produces. Every other training setting is
#: part of the run's identity
EXTENDABLE = ("max_epochs", "patience", "accelerator", "devices", "strategy")


def run_identity(cfg: PipelineConfig, trace_dirs: list[str] | None = None) -> dict:
    """Every setting that changes the weights a run trains: the seed, each training setting but `EXTENDABLE`, and
    the traces. ``trace_dirs``: every trace directory the run trains on (default: ``trace_dir``), each identified by
    the digest of its collection config."""
    dirs = trace_dirs or [cfg.trace_dir]
    digests = [cfg.collect.digest() if d == cfg.trace_dir else read_manifest(d).get("config_digest") for d in dirs]
    identity = {k: v for k, v in to_dict(cfg.train).items() if k not in EXTENDABLE}
    identity["seed"] = cfg.seed
    if len(dirs) == 1:
        return {**identity, "trace_dir": str(Path(dirs[0]).resolve()), "collect": digests[0]}
    return {**identity, "trace_dir": [str(Path(d).resolve()) for d in dirs], "collect": digests}


class RunIdentity(Callback):
    """Stores the run's identity in every checkpoint it writes, so the checkpoint itself says what it can resume."""

    def __init__(self, identity: dict):
        self.identity = identity

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        checkpoint[IDENTITY_KEY] = self.identity


def check_resumable(cfg: PipelineConfig, last: Path, identity: dict | None = None) -> None:
    """A rerun resumes from the checkpoint ``last``; refuse one whose scorer or data would not match it (read from
    the checkpoint itself, so nothing is written before it has been checked)."""
    if not last.exists():
        return
    try:
        previous = torch.load(last, map_location="cpu", weights_only=False).get(IDENTITY_KEY)
    except Exception as e:  # torch raises several types on a damaged file
        raise ValueError(f"checkpoint {last} cannot be read ({type(e).__name__}); "
                         "delete it to start this run over") from None
    if previous is None:
        raise ValueError(f"checkpoint {last} does not record the run it belongs to; delete it to start this run over")
    identity = identity or run_identity(cfg)
    # recorded only when true before every setting was recorded; objective: before the setting, every run was uniform
    previous = {"content": False, "objective": "uniform", **previous}
    changed = [k for k in identity if k in previous and previous[k] != identity[k]]
    if changed:
        shown = [k if k in ("trace_dir", "collect") else f"{k}: {previous[k]!r} there, {identity[k]!r} here"
                 for k in changed]
        raise ValueError(f"{last.parent.parent} holds a run with another {', '.join(changed)} ({'; '.join(shown)}): "
                         "these change the weights; rerun with its settings to resume or reuse it, or use another "
                         "out_dir to train anew")
    unknown = [k for k in identity if k not in previous]
    if unknown:
        raise ValueError(f"checkpoint {last} does not record the run's {', '.join(unknown)} (written by an older "
                         "learnkv), so resuming it could mix settings; delete it to start this run over, or use "
                         "another out_dir")


#: marks a finished run: the config it ran with and its artifact (a rerun of the same command then does nothing)
DONE = "done.json"


def _finish_config(cfg: PipelineConfig, identity: dict | None = None) -> dict:
    done = {k: v for k, v in to_dict(cfg).items() if k not in ("wandb", "report")}
    if identity is not None:  # the traces trained on, by config digest (a learned acting policy's weights included)
        done["traces"] = identity["collect"]
    return done


def finished_run(cfg: PipelineConfig, out: Path, identity: dict | None = None):
    """(artifact, metrics, teachers) if ``out`` holds a finished run of exactly this config, else None."""
    path = out / DONE
    if not path.is_file():
        return None
    try:
        done = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None  # not a record of a finished run: train (resuming) and export again
    if not isinstance(done, dict):
        return None
    recorded = done.get("config")
    if isinstance(recorded, dict) and isinstance(recorded.get("train"), dict):  # runs before the setting: uniform
        recorded["train"].setdefault("objective", "uniform")
    if recorded != _finish_config(cfg, identity):
        return None
    try:
        _, manifest = load_scorer(done["artifact"])
    except (ArtifactError, KeyError):
        return None  # the export is gone or damaged: train (resuming) and export again
    return Path(done["artifact"]), manifest["metrics"], manifest["teachers"]


def recall_table(metrics: dict, teachers: list[str]) -> str:
    cols = [round(b * 100) for b in BUDGETS]
    lines = ["| scorer | " + " | ".join(f"recall@{c}%" for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    lines.append("| **learned** | " + " | ".join(f"{metrics[f'val/recall@{c}']:.3f}" for c in cols) + " |")
    for name in teachers:
        lines.append(f"| {name} | " + " | ".join(f"{metrics[f'val/{name}/recall@{c}']:.3f}" for c in cols) + " |")
    if f"val/global_recall@{cols[0]}" in metrics:  # objective global: the pooled top-b of each decision's total
        lines += ["", "pooled over every layer and KV head of a decision (b: a share of its total):",
                  "| scorer | " + " | ".join(f"global recall@{c}%" for c in cols) + " |",
                  "|---" * (len(cols) + 1) + "|",
                  "| **learned** | " + " | ".join(f"{metrics[f'val/global_recall@{c}']:.3f}" for c in cols) + " |",
                  "| oracle, each head its own top share | "
                  + " | ".join(f"{metrics[f'val/oracle_per_head/global_recall@{c}']:.3f}" for c in cols) + " |"]
    return "\n".join(lines)


def round_config(cfg: PipelineConfig, r: int, previous: Path | None) -> PipelineConfig:
    """Round ``r``'s pipeline config (1-based): its trace and output directories and what it collects under: from
    round 2 the previous round's scorer, deployed as it was trained (a scorer of the global objective under the
    ``global`` allocation, where its KV heads hold different numbers of tokens)."""
    trace_dir = cfg.trace_dir if r == 1 else f"{cfg.trace_dir}-round{r}"
    out_dir = cfg.out_dir if r == cfg.rounds else str(Path(cfg.out_dir) / f"round-{r}")
    collect = cfg.collect
    if r > 1:
        params = {"scorer": str(previous)}
        if cfg.train.objective == "global":
            params["allocation"] = "global"
        collect = dataclasses.replace(collect, policy="learned", policy_params=params)
    return dataclasses.replace(cfg, trace_dir=trace_dir, out_dir=out_dir, collect=collect)


def train(cfg: PipelineConfig, progress: bool = True, verbose: bool = True) -> tuple[Path, dict, str]:
    """Run the pipeline, every round; returns (artifact path, validation metrics, recall table) of the last round.
    ``verbose=False``: wandb's terminal messages go to the `WANDB_LOGGER` logger (`learnkv.runlog.run_log` writes it
    to the run's log file)."""
    trace_dirs, artifact = [], None
    for r in range(1, cfg.rounds + 1):
        rcfg = round_config(cfg, r, artifact)
        if cfg.rounds > 1:
            print(f"round {r}/{cfg.rounds}: traces under {rcfg.collect.policy} in {rcfg.trace_dir}, "
                  f"training on {len(trace_dirs) + 1} trace director{'ies' if trace_dirs else 'y'}")
        trace_dirs.append(rcfg.trace_dir)
        artifact, metrics, table = train_round(rcfg, list(trace_dirs), progress, verbose)
    return artifact, metrics, table


def train_round(cfg: PipelineConfig, trace_dirs: list[str], progress: bool = True,
                verbose: bool = True) -> tuple[Path, dict, str]:
    """One round: collect ``cfg.trace_dir`` if incomplete, train on ``trace_dirs`` (the earlier rounds' and this
    one's), export into ``cfg.out_dir``."""
    out = ensure_dir(cfg.out_dir, "out_dir", create=False)  # created once the traces are there
    earlier = trace_dirs[:-1]  # finished rounds: their manifests identify them
    if all((Path(d) / "manifest.json").exists() for d in earlier):
        finished = finished_run(cfg, out, run_identity(cfg, trace_dirs))
        if finished is not None:
            artifact, metrics, teachers = finished
            print(f"{out} holds this run, finished: nothing to do (raise train.max_epochs to extend it, or use another "
                  "out_dir)")
            return artifact, metrics, recall_table(metrics, teachers)
    ckpt_dir = out / "checkpoints"
    last = ckpt_dir / "last.ckpt"
    if len(trace_dirs) == 1:
        check_resumable(cfg, last)  # before any collection: a run that cannot resume fails now
    manifest = ensure_traces(cfg, progress)
    identity = run_identity(cfg, trace_dirs)
    if len(trace_dirs) > 1:
        check_resumable(cfg, last, identity)
    out.mkdir(parents=True, exist_ok=True)
    with dir_lock(out, "out_dir"):  # one training run at a time writes a directory
        return _fit(cfg, trace_dirs, out, ckpt_dir, last, manifest, identity, progress, verbose)


def _fit(cfg: PipelineConfig, trace_dirs: list[str], out: Path, ckpt_dir: Path, last: Path, manifest: dict,
         identity: dict, progress: bool, verbose: bool) -> tuple[Path, dict, str]:
    """`train_round` once the run is checked and its directory locked: fit, validate, export."""
    teachers = manifest["teachers"]
    save_config(cfg, out / "config.yaml")

    # seeded here, after any collection: collecting in this process (loading the model, decoding) draws from the
    # global generators, and the scorer's initialisation must not depend on whether the traces were already there
    L.seed_everything(cfg.seed, verbose=False)
    t = cfg.train
    dm = TraceDataModule(trace_dirs, label=t.label, teachers=tuple(teachers), batch_size=t.batch_size, seed=cfg.seed,
                         values=t.content, objective=t.objective, n_layers=manifest["n_layers"])
    dm.setup()
    content_dim = int(dm.train_rows.ds[0]["head_dim"]) if t.content else 0
    module = ScorerModule(manifest["n_layers"], hidden=t.hidden, lr=t.lr, weight_decay=t.weight_decay,
                          temperature=t.temperature, membership_weight=t.membership_weight,
                          membership_budget=t.membership_budget, distill=dict(t.distill), teachers=tuple(teachers),
                          content_dim=content_dim,
                          n_heads=manifest["n_kv_heads"] if t.content or t.objective == "global" else 0,
                          ignore_features=tuple(t.ignore_features), objective=t.objective)
    module.scorer.set_normalization(*feature_stats(dm.train_rows, seed=cfg.seed))
    n_params = module.scorer.n_params()
    print(f"scorer: {n_params} parameters ({n_params // manifest['n_layers']} per layer), "
          f"{len(dm.train_rows)} train rows, {len(dm.val_rows)} validation rows"
          + (f" ({len(dm.train_set)} and {len(dm.val_set)} decisions)" if t.objective == "global" else ""))

    logger = make_logger(cfg, out)
    wandb_run = type(logger).__name__ == "WandbLogger"
    if wandb_run:
        quiet_wandb(verbose)
    monitor = monitor_for(t.objective)
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, filename="best", monitor=monitor, mode="max")
    # every epoch, improved or not: a killed run resumes from its last epoch (the best one may be long before)
    every_epoch = ModelCheckpoint(dirpath=ckpt_dir, filename="last", monitor=None, enable_version_counter=False)
    trainer = L.Trainer(
        max_epochs=t.max_epochs, accelerator=t.accelerator, devices=t.devices, strategy=t.strategy,
        logger=logger, callbacks=[checkpoint, every_epoch, EarlyStopping(monitor, mode="max", patience=t.patience),
                                  RunIdentity(identity)],
        default_root_dir=str(out), log_every_n_steps=1, num_sanity_val_steps=0, deterministic=True,
        enable_progress_bar=progress and sys.stderr.isatty(), enable_model_summary=False,
    )
    trainer.fit(module, datamodule=dm, ckpt_path=str(last) if last.exists() else None)
    best = ScorerModule.load_from_checkpoint(checkpoint.best_model_path) if checkpoint.best_model_path else module
    metrics = {k: float(v) for k, v in trainer.validate(best, datamodule=dm, verbose=False)[0].items()}
    if wandb_run:
        import wandb  # optional: only a run that logs to wandb has it

        wandb.finish()  # so a second run in the same process starts its own
        loud_wandb(verbose)
    table = recall_table(metrics, teachers)
    artifact = export_scorer(best.scorer.cpu(), out / "scorer", model=manifest["model"], n_kv_heads=manifest["n_kv_heads"],
                             config_digest=manifest["config_digest"], metrics=metrics,
                             extra={"trace_dir": [str(d) for d in trace_dirs] if len(trace_dirs) > 1 else
                                    str(cfg.trace_dir), "teachers": teachers, "train": to_dict(cfg.train)},
                             allocation=t.objective)  # the allocation it was trained for: uniform or global
    write_json_atomic(out / DONE, {"config": _finish_config(cfg, identity), "artifact": str(artifact)})
    return artifact, metrics, table
