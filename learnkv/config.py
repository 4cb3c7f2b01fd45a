"""Pipeline configuration: YAML files in configs/, dotted command-line overrides, strict validation.

    python train.py --config configs/smoke.yaml train.max_epochs=3 collect.prompts=4

Unknown keys are errors (with the valid keys listed); values are parsed as YAML scalars, then coerced to their
field's declared type and checked against its range (`learnkv.fields`), so ``train.lr=1e-3`` (a string in YAML 1.1)
is the number 0.001 and ``train.hidden=abc`` is refused at load time; the resolved config is saved next to every
output.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from learnkv.eval.run import prefill_run
from learnkv.features import FEATURES
from learnkv.fields import check_fields, setting
from learnkv.policies import POLICIES
from learnkv.settings import resolve_budget
from learnkv.traces.collect import CollectConfig


@dataclass
class TrainConfig:
    """Scorer and optimisation settings (see `learnkv.scorer.module.ScorerModule`)."""

    hidden: int = setting(32, ge=1)
    lr: float = setting(3e-3, gt=0)
    weight_decay: float = setting(1e-4, ge=0)
    batch_size: int = setting(8, ge=1)
    max_epochs: int = setting(15, ge=1)
    patience: int = setting(4, ge=0)  # early stopping on val/recall@25 (objective global: val/global_recall@25)
    label: str = setting("future_out", choices=("future_sum", "future_max", "future_out", "future_attnv"))
    temperature: float = setting(1.0, gt=0)
    membership_weight: float = setting(0.5, ge=0)
    # the top shares the membership loss separates from the rest: one, or several to train the boundary at each
    # budget the policy is deployed at (a cache under eviction keeps between the budget's share and all of it)
    membership_budget: tuple[float, ...] = setting((0.25,), gt=0, le=1)
    distill: dict[str, float] = setting({}, ge=0)  # teacher name -> weight
    content: bool = False  # also score each token's value vector (needs traces with collect.record_values)
    # what the scores rank: "uniform" every (layer, KV head) on its own (the policy keeps each head's top), "global"
    # every resident token of a decision over all layers and KV heads together, for allocation=global (the scorer
    # gets a bias per layer and KV head, the artifact records allocation "global"; batch_size then counts
    # decisions, each of n_layers trace rows; `learnkv.scorer.module`)
    objective: str = setting("uniform", choices=("uniform", "global"))
    # features the scorer may not read (their first-layer weights are held at zero), to ablate a group of them, e.g.
    # [acc_sum, age, n_returns]: the ones that grow with the decode length
    ignore_features: tuple[str, ...] = ()
    accelerator: str = "auto"
    devices: int | str = 1
    strategy: str = "auto"  # Lightning strategy, e.g. "ddp" to scale out


@dataclass
class ReportConfig:
    """The decode-time comparison `train.py` prints after training: the exported scorer against teachers on the
    validation prompts, teacher-forced along the full cache's continuation (`learnkv.eval`, task fidelity)."""

    prompts: int = setting(4, ge=0)  # validation prompts (0: no decode-time comparison)
    max_new_tokens: int = setting(64, ge=2)
    budgets: tuple[float, ...] = (0.25, 0.5)  # fractions of each prompt's final length
    policies: tuple[str, ...] = ("h2o", "tova", "roco", "rkv")
    batch_size: int = setting(4, ge=1)
    # compresses prompts over the budget at the prefill, then each policy decodes (as the README's headline runs;
    # none: each policy compresses them itself)
    prefill_policy: str | None = "snapkv"


@dataclass
class WandbConfig:
    # auto: online if a wandb key is configured, else offline
    mode: str = setting("auto", choices=("auto", "online", "offline", "disabled"))
    project: str = "learnkv"


@dataclass
class PipelineConfig:
    seed: int = setting(0, ge=0)
    trace_dir: str = "runs/traces"
    out_dir: str = "runs/train"
    # rounds of collection: round 1 collects under collect.policy; each later round collects under the previous
    # round's learned scorer (at collect.budgets) and trains on the union of every round's traces
    rounds: int = setting(1, ge=1)
    collect: CollectConfig = field(default_factory=CollectConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)


def _build(cls, data: dict, where: str):
    if not isinstance(data, dict):
        raise ValueError(f"config section {where or 'top level'} must be a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"unknown config key(s) {', '.join(where + k for k in unknown)}; valid: {', '.join(where + k for k in fields)}")
    defaults = cls()
    kwargs = {}
    for name, value in data.items():
        default = getattr(defaults, name)
        kwargs[name] = _build(type(default), value, f"{where}{name}.") if dataclasses.is_dataclass(default) else value
    return cls(**kwargs)  # values are coerced and range-checked by `check_fields` once the whole tree is built


def _set(tree: dict, dotted: str, value) -> None:
    keys = dotted.split(".")
    if not all(keys):
        raise ValueError(f"override key {dotted!r} must look like section.key")
    for depth, k in enumerate(keys[:-1]):
        tree = tree.setdefault(k, {})
        if not isinstance(tree, dict):
            raise ValueError(f"override {dotted}: {'.'.join(keys[: depth + 1])} is a value, not a section")
    tree[keys[-1]] = value


def _yaml(text: str, where: str):
    """Parsed YAML; a syntax error names ``where`` and the line."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ValueError(f"{where}{line}: malformed YAML ({problem})") from None


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> PipelineConfig:
    """Defaults <- YAML file <- ``key.sub=value`` overrides; raises ValueError on anything unknown or malformed."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"config file {str(path)!r} does not exist")
        data = _yaml(path.read_text(), str(path))
        data = {} if data is None else data
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a config file is a mapping of sections (seed:, collect:, train:, ...), got a "
                             f"{type(data).__name__}")
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like section.key=value")
        key, value = item.split("=", 1)
        _set(data, key.strip(), _yaml(value, f"override {item!r}"))
    cfg = _build(PipelineConfig, data, "")
    check_fields(cfg)
    cfg.collect.validate()
    unknown = sorted(set(cfg.train.distill) - set(cfg.collect.teachers))
    if unknown:
        raise ValueError(f"train.distill names {', '.join(unknown)}, not among collect.teachers "
                         f"({', '.join(cfg.collect.teachers)})")

    unknown = [f for f in cfg.train.ignore_features if f not in FEATURES]
    if unknown:
        raise ValueError(f"train.ignore_features names {', '.join(unknown)}, not features; features: {', '.join(FEATURES)}")
    check_report(cfg.report)
    return cfg


def check_report(report: ReportConfig) -> None:
    """The decode-time comparison's policies and budgets, checked before anything runs."""
    unknown = [p for p in report.policies if p not in POLICIES or p in ("learned", "full")]
    if unknown:
        raise ValueError(f"report.policies: {unknown} cannot be compared (registered heuristics: "
                         f"{', '.join(n for n, c in POLICIES.items() if c.evicts and n != 'learned')})")
    for b in report.budgets:
        if not 0 < b <= 1:
            raise ValueError(f"report.budgets are fractions of the final length in (0, 1], got {b}")
        resolve_budget(b, 1)
    if report.prefill_policy:
        prefill_run(report.prefill_policy, "report.prefill_policy")


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
