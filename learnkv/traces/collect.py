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

from learnkv.traces.record import Recorder
from learnkv.traces.store import TraceError, finished_shards, read_manifest, shard_name, write_manifest, write_shard

DEFAULT_TEACHERS = ("h2o", "tova", "snapkv", "knorm", "streaming", "roco", "lazy", "paged")


@dataclass
class CollectConfig:
    """Everything that determines a trace directory's content (its digest guards resumption)."""

    model: str = "smollm2-135m-instruct"
    sources: tuple[str, ...] = ("gsm_symbolic",)
    prompts: int = 8  # training prompts
    val_prompts: int = 2  # validation prompts (test prompts are left for evaluation)
    max_new_tokens: int = 128
    decisions_per_prompt: int = 4
    horizon: int = 32
    label_budget: float = 0.25
    teachers: tuple[str, ...] = DEFAULT_TEACHERS
    prompts_per_shard: int = 4
    seed: int = 0
    chat: bool = True

    def validate(self) -> None:
        from learnkv.policies import POLICIES

        if self.prompts < 1 or self.val_prompts < 0 or self.prompts_per_shard < 1:
            raise ValueError("prompts and prompts_per_shard must be >= 1, val_prompts >= 0")
        if self.horizon < 1 or self.max_new_tokens <= self.horizon + 1:
            raise ValueError(f"max_new_tokens ({self.max_new_tokens}) must exceed horizon + 1 ({self.horizon + 1})")
        if not 0 < self.label_budget <= 1:
            raise ValueError(f"label_budget must be in (0, 1], got {self.label_budget}")
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
    out.mkdir(parents=True, exist_ok=True)
    if (out / "manifest.json").exists():
        existing = json.loads((out / "manifest.json").read_text()).get("config_digest")
        if existing is not None and existing != cfg.digest():
            raise TraceError(f"{out} holds traces of another config (digest {existing}, this one {cfg.digest()}); "
                             "use another --out or delete it")
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
    done = finished_shards(out)
    mine = [j for j in range(len(shards)) if j % n == i]
    stats = CollectStats()
    t0 = time.perf_counter()
    bar = tqdm(mine, desc="shards", unit="shard", disable=not progress)
    for j in bar:
        if j in done:
            stats.skipped_shards += 1
            continue
        if max_shards is not None and stats.shards >= max_shards:
            break
        columns: dict[str, list] = {}
        for prompt in tqdm(shards[j], desc=f"{shard_name(j)} prompts", unit="prompt", leave=False, disable=not progress):
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
        entry = write_shard(out, j, columns, [p.id for p in shards[j]])
        write_manifest(out, header, len(shards))
        stats.rows += entry["rows"]
        stats.shards += 1
        stats.bytes += (out / entry["path"]).stat().st_size
        stats.shard_paths.append(entry["path"])
    stats.seconds = time.perf_counter() - t0
    manifest = write_manifest(out, header, len(shards))
    return manifest, stats


def merge(out: str | Path) -> dict:
    """Rebuild the manifest from every finished shard (after n collectors ran with --shard i/n)."""
    out = Path(out)
    path = out / "manifest.json"
    if not path.exists():
        raise TraceError(f"no manifest.json in {out}: run a collector first")
    manifest = json.loads(path.read_text())
    header = {k: v for k, v in manifest.items() if k not in ("format", "format_version", "feature_version", "features",
                                                          "n_shards_planned", "complete", "shards")}
    manifest = write_manifest(out, header, manifest["n_shards_planned"])
    return read_manifest(out) if manifest["complete"] else manifest
