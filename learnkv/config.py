"""Pipeline configuration: YAML files in configs/, dotted command-line overrides, strict validation.

    python train.py --config configs/smoke.yaml train.max_epochs=3 collect.prompts=4

Unknown keys are errors (with the valid keys listed); values are parsed as YAML scalars; the resolved config is
saved next to every output.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from learnkv.traces.collect import CollectConfig


@dataclass
class TrainConfig:
    """Scorer and optimisation settings (see `learnkv.scorer.module.ScorerModule`)."""

    hidden: int = 32
    lr: float = 3e-3
    weight_decay: float = 1e-4
    batch_size: int = 8
    max_epochs: int = 15
    patience: int = 4  # early stopping on val/recall@25
    label: str = "future_sum"  # or future_max
    temperature: float = 1.0
    membership_weight: float = 0.5
    membership_budget: float = 0.25
    distill: dict = field(default_factory=dict)  # teacher name -> weight
    accelerator: str = "auto"
    devices: int | str = 1
    strategy: str = "auto"  # Lightning strategy, e.g. "ddp" to scale out


@dataclass
class WandbConfig:
    mode: str = "auto"  # auto: online if a wandb key is configured, else offline; or online / offline / disabled
    project: str = "learnkv"


@dataclass
class PipelineConfig:
    seed: int = 0
    trace_dir: str = "runs/traces"
    out_dir: str = "runs/train"
    collect: CollectConfig = field(default_factory=CollectConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)


def _build(cls, data: dict, where: str):
    if not isinstance(data, dict):
        raise ValueError(f"config section {where or 'top level'} must be a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"unknown config key(s) {', '.join(where + k for k in unknown)}; valid: {', '.join(where + k for k in fields)}")
    kwargs = {}
    for name, value in data.items():
        default = getattr(cls(), name) if cls is not PipelineConfig else getattr(PipelineConfig(), name)
        if dataclasses.is_dataclass(default):
            kwargs[name] = _build(type(default), value, f"{where}{name}.")
        elif isinstance(default, tuple):
            kwargs[name] = tuple(value) if isinstance(value, (list, tuple)) else (value,)
        else:
            kwargs[name] = value
    return cls(**kwargs)


def _set(tree: dict, dotted: str, value) -> None:
    keys = dotted.split(".")
    for k in keys[:-1]:
        tree = tree.setdefault(k, {})
    tree[keys[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> PipelineConfig:
    """Defaults <- YAML file <- ``key.sub=value`` overrides; raises ValueError on anything unknown or malformed."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"config file {str(path)!r} does not exist")
        data = yaml.safe_load(path.read_text()) or {}
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like section.key=value")
        key, value = item.split("=", 1)
        _set(data, key.strip(), yaml.safe_load(value))
    cfg = _build(PipelineConfig, data, "")
    cfg.collect.validate()
    if cfg.wandb.mode not in ("auto", "online", "offline", "disabled"):
        raise ValueError(f"wandb.mode must be auto, online, offline or disabled, got {cfg.wandb.mode!r}")
    return cfg


def to_dict(cfg) -> dict:
    def plain(x):
        if isinstance(x, tuple):
            return list(x)
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        return x

    return plain(dataclasses.asdict(cfg))


def save_config(cfg: PipelineConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
