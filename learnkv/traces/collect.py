"""Collect attention traces: full-cache decoding over prompts, recorded by `Recorder`, written as shards.

    python -m learnkv collect --out traces/ --prompts 16 --max-new-tokens 128
    python -m learnkv collect --out traces/ --shard 0/2 &  python -m learnkv collect --out traces/ --shard 1/2
    python -m learnkv merge traces/

The prompt list is a deterministic function of the config, split into shards of ``prompts_per_shard`` prompts;
collector i of n takes the shards j with j % n == i. A finished shard is never redone, a half-written one never
read, and memory holds at most one shard's rows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from learnkv.fields import check_fields, setting
from learnkv.traces.record import Recorder
from learnkv.traces.store import (MANIFEST, TraceError, finished_shards, read_manifest, remove_stale_temps, shard_name,
                                  write_manifest, write_shard)

DEFAULT_TEACHERS = ("h2o", "tova", "snapkv", "knorm", "streaming", "roco", "lazy", "paged")


@dataclass
class CollectConfig:
    """Everything that determines a trace directory's content (its digest guards resumption)."""

    model: str = "smollm2-135m-instruct"
    sources: tuple[str, ...] = ("gsm_symbolic",)
    prompts: int = setting(8, ge=1)  # training prompts
    val_prompts: int = setting(2, ge=0)  # validation prompts (test prompts are left for evaluation)
    max_new_tokens: int = setting(128, ge=1)
    decisions_per_prompt: int = setting(4, ge=1)
    horizon: int = setting(32, ge=1)
    label_budget: float = setting(0.25, gt=0, le=1)
    teachers: tuple[str, ...] = DEFAULT_TEACHERS
    prompts_per_shard: int = setting(4, ge=1)
    seed: int = setting(0, ge=0)
    chat: bool = True

    def validate(self) -> None:
        """Coerce and range-check every field (`learnkv.fields`), then the rules between fields; no model needed."""
        from learnkv.policies import POLICIES
        from learnkv.prompts import SOURCES

        check_fields(self)
        if self.max_new_tokens <= self.horizon + 1:
            raise ValueError(f"max_new_tokens ({self.max_new_tokens}) must exceed horizon + 1 ({self.horizon + 1})")
        unknown = [s for s in self.sources if s not in SOURCES]
        if unknown or not self.sources:
            raise ValueError(f"unknown prompt source(s) {unknown}; known: {', '.join(sorted(SOURCES))}")
        unknown = [t for t in self.teachers if t not in POLICIES or not POLICIES[t].evicts]
        if unknown:
            raise ValueError(f"unknown teacher(s) {unknown}; teachers are evicting policies: {[n for n, c in POLICIES.items() if c.evicts]}")

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class CollectStats:
    rows: int = 0
    shards: int = 0
    skipped_shards: int = 0
    bytes: int = 0
    decode_tokens: int = 0
    dropped_decisions: int = 0
    seconds: float = 0.0
    shard_paths: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # unusable shards found on disk, recollected
    removed_temps: list[str] = field(default_factory=list)  # a killed collector's temporary files, deleted

    def line(self) -> str:
        rate = self.rows / max(self.seconds, 1e-9)
        return (f"collected {self.rows} rows in {self.shards} new shards ({self.skipped_shards} already done), "
                f"{self.bytes / 1e6:.1f} MB, {self.decode_tokens} decode tokens, {self.seconds:.1f} s "
                f"({rate:.1f} rows/s); {self.dropped_decisions} decisions dropped (generation ended before the horizon)")


def plan_prompts(cfg: CollectConfig, tokenizer) -> list:
    """The config's training then validation prompts, in a fixed order (sources interleaved)."""
    from learnkv.prompts import load_prompts

    planned = []
    for split, n in (("train", cfg.prompts), ("validation", cfg.val_prompts)):
        if n == 0:
            continue
        per_source = [load_prompts(src, n=n, seed=cfg.seed, split=split, tokenizer=tokenizer) for src in cfg.sources]
        mixed = [p for group in itertools.zip_longest(*per_source) for p in group if p is not None]
        planned += mixed[:n]
    return planned


def decision_steps(cfg: CollectConfig, prompt_id: str) -> frozenset[int]:
    """Seeded decode steps at which to snapshot (each with ``horizon`` steps of future inside the generation)."""
    rng = random.Random(f"{cfg.seed}:{prompt_id}")
    candidates = range(1, cfg.max_new_tokens - cfg.horizon)
    return frozenset(rng.sample(candidates, min(cfg.decisions_per_prompt, len(candidates))))


def rows_to_columns(prompt, recorder: Recorder, teachers: tuple[str, ...]) -> dict[str, list]:
    """One row per finished decision (batch of one): flat float32 lists for [H, T(, F)] tensors."""
    cols: dict[str, list] = {k: [] for k in ("prompt_id", "source", "split", "step", "layer", "n_heads", "n_tokens",
                                              "positions", "features", "future_sum", "future_max", "reenter")}
    for name in teachers:
        cols[f"teacher_{name}"] = []
    for p in sorted(recorder.rows, key=lambda r: (r.step, r.layer)):
        _, H, T = p.positions.shape
        cols["prompt_id"].append(prompt.id)
        cols["source"].append(prompt.source)
        cols["split"].append(prompt.split)
        cols["step"].append(p.step)
        cols["layer"].append(p.layer)
        cols["n_heads"].append(H)
        cols["n_tokens"].append(T)
        cols["positions"].append(p.positions[0, 0].numpy().astype(np.int32))
        cols["features"].append(p.features[0].numpy().astype(np.float32).ravel())
        cols["future_sum"].append(p.future_sum[0].numpy().astype(np.float32).ravel())
        cols["future_max"].append(p.future_max[0].numpy().astype(np.float32).ravel())
        cols["reenter"].append(p.reenter[0].numpy().astype(np.int8).ravel())
        for name in teachers:
            cols[f"teacher_{name}"].append(p.teachers[name][0].numpy().astype(np.float32).ravel())
    return cols


def collect(out: str | Path, cfg: CollectConfig | None = None, shard: tuple[int, int] = (0, 1), model=None,
            tokenizer=None, progress: bool = True, max_shards: int | None = None,
            prompts: list | None = None) -> tuple[dict, CollectStats]:
    """Collect traces into ``out`` (resuming); returns the manifest and this run's statistics.

    ``shard=(i, n)`` takes every n-th shard starting at i. ``max_shards`` stops after that many new shards.
    ``prompts`` overrides the config's prompt sources (objects with ``id``, ``source``, ``split``, ``text``).
    """
    from tqdm.auto import tqdm

    from learnkv.decode import generate
    from learnkv.model import load_model

    cfg = cfg or CollectConfig()
    cfg.validate()
    i, n = shard
    if not (n >= 1 and 0 <= i < n):
        raise ValueError(f"--shard must be i/n with 0 <= i < n, got {i}/{n}")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise TraceError(f"trace directory {out} is a file; give a directory for the traces")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TraceError(f"cannot create trace directory {out}: {e.strerror or e}") from None
    if (out / MANIFEST).exists():  # refuses another format, feature version or config before anything runs
        check_same_config(read_manifest(out), cfg, str(out), "use another --out or delete it")
    done, problems = finished_shards(out, cfg.digest())  # refuses a shard of another feature version or config
    if model is None:
        model, tokenizer = load_model(cfg.model)
    prompts = plan_prompts(cfg, tokenizer) if prompts is None else list(prompts)
    shards = [prompts[k: k + cfg.prompts_per_shard] for k in range(0, len(prompts), cfg.prompts_per_shard)]
    header = {
        "model": cfg.model,
        "tokenizer": getattr(tokenizer, "name_or_path", cfg.model),
        "n_layers": model.config.num_hidden_layers,
        "n_kv_heads": model.config.num_key_value_heads,
        "horizon": cfg.horizon,
        "label_budget": cfg.label_budget,
        "teachers": list(cfg.teachers),
        "seed": cfg.seed,
        "split": {"by": "sha256 of seed:prompt_id", "splits": sorted({p.split for p in prompts})},
        "config": dataclasses.asdict(cfg),
        "config_digest": cfg.digest(),
    }
    mine = [j for j in range(len(shards)) if j % n == i]
    stats = CollectStats(problems=[f"{name}: {why}, will be recollected" for name, why in problems.items()])
    stats.removed_temps = remove_stale_temps(out, mine)
    t0 = time.perf_counter()
    bar = tqdm(mine, desc="shards", unit="shard", disable=not progress)
    try:
        for j in bar:
            if j in done:
                stats.skipped_shards += 1
                continue
            if max_shards is not None and stats.shards >= max_shards:
                break
            columns: dict[str, list] = {}
            for prompt in tqdm(shards[j], desc=f"{shard_name(j)} prompts", unit="prompt", leave=False,
                               disable=not progress):
                rec = Recorder(n_layers=model.config.num_hidden_layers, teachers=tuple(cfg.teachers),
                               decision_steps=decision_steps(cfg, prompt.id), horizon=cfg.horizon,
                               label_budget=cfg.label_budget)
                result = generate(model, tokenizer, prompt.text, policy=rec, max_new_tokens=cfg.max_new_tokens,
                                  chat=cfg.chat, progress=progress)
                stats.decode_tokens += int(result.tokens.numel())
                stats.dropped_decisions += rec.unfinished()
                for k, v in rows_to_columns(prompt, rec, tuple(cfg.teachers)).items():
                    columns.setdefault(k, []).extend(v)
                del rec, result
            entry = write_shard(out, j, columns, [p.id for p in shards[j]], cfg.digest())
            write_manifest(out, header, len(shards))
            stats.rows += entry["rows"]
            stats.shards += 1
            stats.bytes += (out / entry["path"]).stat().st_size
            stats.shard_paths.append(entry["path"])
    except KeyboardInterrupt:
        # finished shards are on disk under their final names; the one in progress was only in memory (or a
        # temporary file, removed when a collector resumes): leave a manifest that lists exactly what is kept
        write_manifest(out, header, len(shards))
        raise
    stats.seconds = time.perf_counter() - t0
    manifest = write_manifest(out, header, len(shards))
    return manifest, stats


def config_differences(recorded: dict | None, cfg: CollectConfig) -> list[str]:
    """``"key: recorded vs current"`` for every setting in which ``recorded`` (a manifest's ``config``) differs."""
    if not isinstance(recorded, dict):
        return ["no collection config recorded"]
    current = json.loads(json.dumps(dataclasses.asdict(cfg)))  # tuples as the manifest's lists
    return [f"{k}: {recorded.get(k)!r} there, {current.get(k)!r} here" for k in sorted(set(recorded) | set(current))
            if recorded.get(k) != current.get(k)]


def check_same_config(manifest: dict, cfg: CollectConfig, where: str, hint: str) -> None:
    """Refuse (`TraceError`) traces collected with another config than ``cfg``, saying which settings differ."""
    if manifest.get("config_digest") == cfg.digest():
        return
    differences = config_differences(manifest.get("config"), cfg) or [
        f"config digest {manifest.get('config_digest')} there, {cfg.digest()} here"]
    raise TraceError(f"{where} holds traces of another config ({'; '.join(differences)}); {hint}")


def merge(out: str | Path) -> tuple[dict, list[str]]:
    """Rebuild the manifest from every finished shard (after n collectors ran with --shard i/n).

    Returns the manifest and one line per shard that is not usable and will be recollected by the next collector
    run (``"shard-00002.arrow: checksum differs from its sidecar"``). Traces of another format or feature version,
    and shards of another feature version or config, are refused, never relabelled.
    """
    out = Path(out)
    manifest = read_manifest(out)
    header = {k: v for k, v in manifest.items() if k not in ("format", "format_version", "feature_version", "features",
                                                          "n_shards_planned", "complete", "shards")}
    done, problems = finished_shards(out, manifest.get("config_digest"))
    kept = {entry["path"] for entry in done.values()}
    for entry in manifest["shards"]:  # listed before, now gone along with its sidecar
        if entry["path"] not in kept and entry["path"] not in problems:
            problems[entry["path"]] = "listed in the manifest but gone, with its sidecar"
    manifest = write_manifest(out, header, manifest["n_shards_planned"], done)
    return manifest, [f"{name}: {why}, will be recollected" for name, why in sorted(problems.items())]
