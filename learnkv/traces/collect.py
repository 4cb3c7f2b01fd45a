"""Collect attention traces: decode prompts, record decisions (`learnkv.traces.record`), write them as shards.

    python -m learnkv collect --out traces/ --prompts 16 --max-new-tokens 128          # full cache (off-policy)
    python -m learnkv collect --out traces-rkv/ --policy rkv --budget 0.25,0.5         # under eviction (on-policy)
    python -m learnkv collect --out traces-r2/ --policy learned --scorer runs/train/scorer --budget 0.25,0.5
    python -m learnkv collect --out traces/ --shard 0/2 &  python -m learnkv collect --out traces/ --shard 1/2
    python -m learnkv merge traces/

With ``policy: full`` the full cache decodes and the `Recorder` labels each decision from the same run's next
``horizon`` steps. With an evicting policy the `learnkv.traces.onpolicy.OnPolicyRecorder` decodes under it at a
budget (one of ``budgets`` per prompt, seeded), records the tokens actually resident, and labels each decision from
a branch of that state (`learnkv.traces.onpolicy.branch_labels`).

The prompt list is a deterministic function of the config, split into shards of ``prompts_per_shard`` prompts;
collector i of n takes the shards j with j % n == i. A finished shard is never redone, a half-written one never
read, and memory holds at most one shard's rows. A shard's prompts decode in batches of ``batch_size`` (each row
records exactly what it records alone; a batch never spans shards).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

import learnkv.decode  # generate and load_model are called through their modules: tests stand in for them there
import learnkv.model
from learnkv.atomic import dir_lock, ensure_dir
from learnkv.decode import encode_prompts
from learnkv.fields import check_fields, setting
from learnkv.policies import POLICIES
from learnkv.progress import redraw_seconds, token_counter
from learnkv.prompts import SOURCES, load_prompts
from learnkv.scorer.artifact import cached_kv_heads, caches_latent, read_artifact_manifest
from learnkv.settings import Eviction, batch_groups, resolve_budget
from learnkv.traces import onpolicy
from learnkv.traces.record import FLOAT_LABELS, Decision, Recorder, horizon_fits
from learnkv.traces.store import (MANIFEST, TraceError, finished_shards, read_manifest, remove_stale_temps,
                                  write_manifest, write_shard)

DEFAULT_TEACHERS = ("h2o", "tova", "snapkv", "knorm", "streaming", "roco", "lazy", "paged", "rkv")
#: settings that change how fast traces are collected, not what they hold (left out of the config digest)
SPEED_ONLY = ("batch_size",)


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
    # the acting policy: "full" records full-cache decoding; an evicting policy records under eviction (on-policy)
    policy: str = "full"
    policy_params: dict[str, str | int | float | bool] = setting({})  # e.g. {scorer: runs/train/scorer}
    budgets: tuple[int | float, ...] = (0.25, 0.5)  # on-policy: each prompt decodes at one of these (seeded)
    batch_size: int = setting(4, ge=1)  # prompts decoded together (speed only)
    record_values: bool = False  # also record each token's value vector (float16), for content features

    def validate(self) -> None:
        """Coerce and range-check every field (`learnkv.fields`), then the rules between fields; no model needed."""
        check_fields(self)
        if self.max_new_tokens <= self.horizon + 1:
            raise ValueError(f"max_new_tokens ({self.max_new_tokens}) must exceed horizon + 1 ({self.horizon + 1})")
        unknown = [s for s in self.sources if s not in SOURCES]
        if unknown or not self.sources:
            raise ValueError(f"unknown prompt source(s) {unknown}; known: {', '.join(sorted(SOURCES))}")
        unknown = [t for t in self.teachers if t not in POLICIES or not POLICIES[t].evicts]
        if unknown:
            raise ValueError(f"unknown teacher(s) {unknown}; teachers are evicting policies: {[n for n, c in POLICIES.items() if c.evicts]}")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown collection policy {self.policy!r}; known: {', '.join(POLICIES)}")
        if self.on_policy:
            if POLICIES[self.policy].needs_future:
                raise ValueError(f"collection policy {self.policy!r} needs the future; collect under a policy that "
                                 "decides on what it has seen (or 'full' for full-cache traces)")
            self.eviction.check()  # unknown or bad parameters fail here; a learned policy's scorer is readable
            if not self.budgets:
                raise ValueError("on-policy collection needs at least one budget (collect.budgets)")
            for b in self.budgets:
                resolve_budget(b, 1)
        elif self.policy_params:
            raise ValueError(f"collect.policy_params {self.policy_params} given for the full cache, which has none")

    @property
    def on_policy(self) -> bool:
        return self.policy != "full"

    @property
    def eviction(self) -> Eviction:
        """The acting policy's eviction settings (each prompt's budget is its own, `prompt_budget`)."""
        return Eviction(self.policy, self.policy_params)

    def digest(self) -> str:
        """What the traces depend on: every setting but `SPEED_ONLY` ones, and a learned acting policy's weights."""
        d = {k: v for k, v in dataclasses.asdict(self).items() if k not in SPEED_ONLY}
        if not self.on_policy:  # budgets and parameters of no acting policy: not part of full-cache traces
            d.pop("budgets")
            d.pop("policy_params")
        if "scorer" in self.policy_params:
            d["scorer_weights"] = read_artifact_manifest(self.policy_params["scorer"]).get("weights_sha256")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


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
                f"({rate:.1f} rows/s, {self.decode_tokens / max(self.seconds, 1e-9):.1f} tokens/s); "
                f"{self.dropped_decisions} decisions dropped (generation ended before the horizon)")


def plan_prompts(cfg: CollectConfig, tokenizer) -> list:
    """The config's training then validation prompts, in a fixed order (sources interleaved)."""
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


def prompt_budget(cfg: CollectConfig, prompt_id: str) -> int | float:
    """The budget a prompt is collected at on-policy: one of ``cfg.budgets``, by a seeded hash of its id."""
    digest = hashlib.sha256(f"budget:{cfg.seed}:{prompt_id}".encode()).digest()
    return cfg.budgets[int.from_bytes(digest[:4], "big") % len(cfg.budgets)]


def rows_to_columns(prompt, decisions: list[Decision], teachers: tuple[str, ...], policy: str = "full") -> dict[str, list]:
    """One row per decision of one prompt: flat lists for its [H, n(, F)] tensors (n = resident tokens)."""
    keys = ("prompt_id", "source", "split", "policy", "budget", "evicts", "step", "layer", "n_heads", "n_tokens",
            "positions", "features", *FLOAT_LABELS, "reenter")
    cols: dict[str, list] = {k: [] for k in keys}
    for name in teachers:
        cols[f"teacher_{name}"] = []
    for d in decisions:
        H, n = d.positions.shape
        cols["prompt_id"].append(prompt.id)
        cols["source"].append(prompt.source)
        cols["split"].append(prompt.split)
        cols["policy"].append(policy)
        cols["budget"].append(-1 if d.budget is None else int(d.budget))
        cols["evicts"].append(bool(d.evicts))
        cols["step"].append(d.step)
        cols["layer"].append(d.layer)
        cols["n_heads"].append(H)
        cols["n_tokens"].append(n)
        cols["positions"].append(d.positions.numpy().astype(np.int32).ravel())
        cols["features"].append(d.features.numpy().astype(np.float32).ravel())
        for name in FLOAT_LABELS:
            cols[name].append(d.labels[name].numpy().astype(np.float32).ravel())
        cols["reenter"].append(d.labels["reenter"].numpy().astype(np.int8).ravel())
        for name in teachers:
            cols[f"teacher_{name}"].append(d.teachers[name].numpy().astype(np.float32).ravel())
        if d.values is not None:
            cols.setdefault("head_dim", []).append(d.values.shape[-1])
            cols.setdefault("values", []).append(d.values.float().numpy().astype(np.float16).ravel())
    return cols


def _prompt_lengths(cfg: CollectConfig, tokenizer, prompts: list) -> list[int]:
    return [int(encode_prompts(tokenizer, p.text, chat=cfg.chat, reply_prefixes=[p.meta.get("response_prefix")])[1].sum())
            for p in prompts]


def record_batch(model, tokenizer, cfg: CollectConfig, prompts: list, on_step=None):
    """Decode ``prompts`` together and record them. Returns (per prompt: its decisions, tokens generated per prompt,
    decisions dropped because a generation ended before their horizon). ``on_step`` as in `learnkv.decode.generate`."""
    steps = [decision_steps(cfg, p.id) for p in prompts]
    decisions: list[list[Decision]] = [[] for _ in prompts]
    new_tokens = [0] * len(prompts)
    budgets = [None] * len(prompts)
    if cfg.on_policy:
        lengths = _prompt_lengths(cfg, tokenizer, prompts)
        budgets = [resolve_budget(prompt_budget(cfg, p.id), n + cfg.max_new_tokens) for p, n in zip(prompts, lengths)]
    for group in batch_groups(cfg.eviction, budgets):  # rows of one resolution (a budget-dependent default)
        texts = [prompts[i].text for i in group]
        prefixes = [prompts[i].meta.get("response_prefix") for i in group]  # a chain prompt's solved first problems
        if cfg.on_policy:
            got, result = onpolicy.record(model, tokenizer, texts, cfg.eviction.make(),
                                          [budgets[i] for i in group], [steps[i] for i in group], cfg.teachers,
                                          cfg.horizon, cfg.label_budget, cfg.max_new_tokens, chat=cfg.chat,
                                          reply_prefixes=prefixes, record_values=cfg.record_values,
                                          on_step=on_step, allocation=cfg.eviction.allocation)
        else:
            rec = Recorder(n_layers=model.config.num_hidden_layers, teachers=tuple(cfg.teachers),
                           decision_steps=tuple(steps[i] for i in group), horizon=cfg.horizon,
                           label_budget=cfg.label_budget, record_values=cfg.record_values)
            result = learnkv.decode.generate(model, tokenizer, texts, policy=rec, max_new_tokens=cfg.max_new_tokens,
                                             chat=cfg.chat, reply_prefixes=prefixes, on_step=on_step)
            got = [rec.decisions(b, n) for b, n in enumerate(result.new_tokens)]
        for j, i in enumerate(group):
            decisions[i], new_tokens[i] = got[j], result.new_tokens[j]
    dropped = sum(not horizon_fits(s, cfg.horizon, n) for st, n in zip(steps, new_tokens) for s in st)
    return decisions, new_tokens, dropped


def collect(out: str | Path, cfg: CollectConfig | None = None, shard: tuple[int, int] = (0, 1), model=None,
            tokenizer=None, progress: bool = True, max_shards: int | None = None,
            prompts: list | None = None) -> tuple[dict, CollectStats]:
    """Collect traces into ``out`` (resuming); returns the manifest and this run's statistics.

    ``shard=(i, n)`` takes every n-th shard starting at i. ``max_shards`` stops after that many new shards.
    ``prompts`` overrides the config's prompt sources (objects with ``id``, ``source``, ``split``, ``text``).
    ``progress`` shows a bar of prompts done (earlier runs' shards included), decode tokens, tokens/s and the time
    left, the tokens counted at every decode step (on a terminal it redraws every second; elsewhere it prints a line
    every 30 s).
    """
    cfg = cfg or CollectConfig()
    cfg.validate()
    i, n = shard
    if not (n >= 1 and 0 <= i < n):
        raise ValueError(f"--shard must be i/n with 0 <= i < n, got {i}/{n}")
    out = ensure_dir(out, "trace directory", TraceError)
    if (out / MANIFEST).exists():  # refuses another format, feature version or config before anything runs
        check_same_config(read_manifest(out), cfg, str(out), "use another --out or delete it")
    digest = cfg.digest()
    done, problems = finished_shards(out, digest)  # refuses a shard of another feature version or config
    # two collectors of the same shards into one directory would write each other's: one at a time (collectors of
    # other shards, --shard i/n, run side by side)
    with dir_lock(out, "trace directory", TraceError, name=f".lock-collect-{i}-of-{n}"):
        return _collect_shards(out, cfg, shard, digest, done, problems, model, tokenizer, progress, max_shards, prompts)


def _collect_shards(out: Path, cfg: CollectConfig, shard: tuple[int, int], digest: str, done: dict, problems: dict,
                    model, tokenizer, progress: bool, max_shards: int | None,
                    prompts: list | None) -> tuple[dict, CollectStats]:
    """`collect` once its input is checked and the directory is locked: decode and write this collector's shards."""
    i, n = shard
    if model is None:
        model, tokenizer = learnkv.model.load_model(cfg.model)
    if cfg.record_values and caches_latent(model.config):
        raise TraceError(f"{type(model).__name__} caches a latent and its rotary key part (MLA), not value vectors: "
                         "collect.record_values cannot record them (collect without it, train without train.content)")
    prompts = plan_prompts(cfg, tokenizer) if prompts is None else list(prompts)
    shards = [prompts[k: k + cfg.prompts_per_shard] for k in range(0, len(prompts), cfg.prompts_per_shard)]
    header = _header(cfg, model, tokenizer, prompts, digest)
    mine = [j for j in range(len(shards)) if j % n == i]
    stats = CollectStats(problems=[f"{name}: {why}, will be recollected" for name, why in problems.items()])
    stats.removed_temps = remove_stale_temps(out, mine)
    todo = [j for j in mine if j not in done]
    if max_shards is not None:
        todo = todo[:max_shards]
    stats.skipped_shards = len(mine) - len([j for j in mine if j not in done])
    # the bar counts every prompt of this collector's shards, those finished by an earlier run included, so a
    # resumed collection shows where it stands; tokens and tok/s come live from the decode (`token_counter`)
    redraw_s = redraw_seconds()
    bar = tqdm(total=sum(len(shards[j]) for j in mine if j in done or j in todo),
               initial=sum(len(shards[j]) for j in mine if j in done), desc=f"collect [{cfg.policy}]", unit="prompt",
               disable=not progress, mininterval=redraw_s, file=sys.stderr)
    on_step = token_counter(bar, every_s=redraw_s)
    t0 = time.perf_counter()
    try:
        for j in todo:
            columns = _shard_columns(model, tokenizer, cfg, shards[j], stats, bar, on_step)
            entry = write_shard(out, j, columns, [p.id for p in shards[j]], digest)
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
    finally:
        bar.close()
    stats.seconds = time.perf_counter() - t0
    manifest = write_manifest(out, header, len(shards))
    return manifest, stats


def _header(cfg: CollectConfig, model, tokenizer, prompts: list, digest: str) -> dict:
    """What the manifest says of every shard: the model, the labels, the collection config and its digest."""
    return {
        "model": cfg.model,
        "tokenizer": getattr(tokenizer, "name_or_path", cfg.model),
        "n_layers": model.config.num_hidden_layers,
        "n_kv_heads": cached_kv_heads(model.config),
        "horizon": cfg.horizon,
        "label_budget": cfg.label_budget,
        "teachers": list(cfg.teachers),
        "policy": cfg.policy,
        "labels": "branch" if cfg.on_policy else "full cache",
        "seed": cfg.seed,
        "split": {"by": "sha256 of seed:prompt_id", "splits": sorted({p.split for p in prompts})},
        "config": json.loads(json.dumps(dataclasses.asdict(cfg))),
        "config_digest": digest,
    }


def _shard_columns(model, tokenizer, cfg: CollectConfig, prompts: list, stats: CollectStats, bar,
                   on_step) -> dict[str, list]:
    """One shard's records as columns, its prompts decoded ``cfg.batch_size`` at a time (counted in ``stats`` and
    on ``bar``)."""
    columns: dict[str, list] = {}
    for k in range(0, len(prompts), cfg.batch_size):
        batch = prompts[k: k + cfg.batch_size]
        decisions, new_tokens, dropped = record_batch(model, tokenizer, cfg, batch, on_step=on_step)
        stats.decode_tokens += sum(new_tokens)
        stats.dropped_decisions += dropped
        for prompt, rows in zip(batch, decisions):
            for key, v in rows_to_columns(prompt, rows, tuple(cfg.teachers), cfg.policy).items():
                columns.setdefault(key, []).extend(v)
        bar.update(len(batch))
        on_step(0, redraw=True)
    return columns


def config_differences(recorded: dict | None, cfg: CollectConfig) -> list[str]:
    """``"key: recorded vs current"`` for every setting in which ``recorded`` (a manifest's ``config``) differs."""
    if not isinstance(recorded, dict):
        return ["no collection config recorded"]
    current = json.loads(json.dumps(dataclasses.asdict(cfg)))  # tuples as the manifest's lists
    return [f"{k}: {recorded.get(k)!r} there, {current.get(k)!r} here" for k in sorted(set(recorded) | set(current))
            if recorded.get(k) != current.get(k) and k not in SPEED_ONLY]


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
