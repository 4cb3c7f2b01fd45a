"""Trace shards on disk: Arrow IPC files read back as Hugging Face `datasets`, plus `manifest.json`.

Layout of a trace directory::

    manifest.json            header (model, features + version, horizon, split, seed, config) and `shards`
    shard-00000.arrow        one row per (prompt, decision step, layer); list columns hold [H, n(, F)] tensors of
                             the n resident tokens (positions included: on-policy, KV heads hold different tokens)
    shard-00000.json         the shard's sidecar: {"path", "rows", "sha256", "prompts", "feature_version",
                             "config_digest"}

Everything is written to a temporary name and renamed, so a killed writer never leaves a file under a final name
that could be read: a shard counts as done only once its sidecar exists, and the manifest is rebuilt from the
sidecars. Each sidecar records the feature version and collection-config digest its shard was made with, so a
shard of another version or config is refused by name wherever the directory is read, extended or merged, never
relabelled. Loading checks every shard's sha256 and the manifest's format and feature version.
"""

from __future__ import annotations

import os
from pathlib import Path

from learnkv.atomic import read_json_object, sha256_file, write_json_atomic
from learnkv.features import FEATURE_VERSION, FEATURES

FORMAT = "learnkv-traces"
FORMAT_VERSION = 2  # 2: positions per KV head [H, n] (on-policy caches differ by head), future_out, policy/budget
MANIFEST = "manifest.json"


class TraceError(ValueError):
    """A trace directory or shard that cannot be used; the message says which and why."""


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def write_shard(out_dir: Path, index: int, columns: dict[str, list], prompts: list[str], config_digest: str) -> dict:
    """Write one shard atomically (Arrow IPC stream, the format `datasets` memory-maps) and its sidecar, which
    records the feature version and the digest of the collection config (`CollectConfig.digest`)."""
    import pyarrow as pa  # with datasets: only where shards are written or read

    table = pa.table(columns)
    name = shard_name(index)
    final = out_dir / f"{name}.arrow"
    tmp = out_dir / f"{name}.arrow.tmp-{os.getpid()}"
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    os.replace(tmp, final)
    entry = {"path": final.name, "rows": table.num_rows, "sha256": sha256_file(final), "prompts": prompts,
             "feature_version": FEATURE_VERSION, "config_digest": config_digest}
    write_json_atomic(out_dir / f"{name}.json", entry)  # the shard is done once this exists
    return entry


def check_shard_identity(entry: dict, name: str, config_digest: str | None) -> None:
    """Refuse (`TraceError`) a shard made with another feature version or collection config than ``config_digest``."""
    version, digest = entry.get("feature_version"), entry.get("config_digest")
    if version is None:
        raise TraceError(f"{name}: shard records no feature version (written before learnkv recorded it), so it cannot "
                         "be checked; collect into another directory (or delete this one)")
    if version != FEATURE_VERSION:
        raise TraceError(f"{name}: shard of feature version {version}, this learnkv computes version "
                         f"{FEATURE_VERSION}; collect into another directory (or delete this one)")
    if digest != config_digest:
        raise TraceError(f"{name}: shard collected with config digest {digest}, this directory's is {config_digest}; "
                         "collect into another directory (or delete this one)")


def finished_shards(out_dir: Path, config_digest: str | None) -> tuple[dict[int, dict], dict[str, str]]:
    """Sidecars of shards that are complete and intact, and ``{file: why not}`` for those that are not (a shard
    whose file is missing or altered is redone). A shard of another feature version or config is refused."""
    done, problems = {}, {}
    for side in sorted(out_dir.glob("shard-*.json")):
        try:
            entry = read_json_object(side, "a shard sidecar")
            index = int(side.stem.split("-")[1])
        except ValueError:  # not JSON, not an object, not a shard's name
            problems[side.name] = "unreadable sidecar"
            continue
        check_shard_identity(entry, side.name, config_digest)
        path = out_dir / entry.get("path", "")
        if not path.is_file():
            problems[path.name] = "missing"
        elif sha256_file(path) != entry.get("sha256"):
            problems[path.name] = "checksum differs from its sidecar"
        else:
            done[index] = entry
    return done, problems


def remove_stale_temps(out_dir: Path, indices) -> list[str]:
    """Delete the temporary files a killed writer of these shards left behind; returns their names. (Only the
    collector that owns a shard writes it, so its temporaries are stale whenever that collector starts.)"""
    removed = []
    for index in indices:
        for tmp in out_dir.glob(f"{shard_name(index)}.*.tmp-*"):
            tmp.unlink(missing_ok=True)
            removed.append(tmp.name)
    return removed


def write_manifest(out_dir: Path, header: dict, n_planned: int, done: dict[int, dict] | None = None) -> dict:
    """Rebuild the manifest from the finished sidecars (safe to call from any collector process); ``done`` is what
    `finished_shards` returned, if the caller has it."""
    if done is None:
        done, _ = finished_shards(out_dir, header.get("config_digest"))
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "feature_version": FEATURE_VERSION,
        "features": list(FEATURES),
        **header,
        "n_shards_planned": n_planned,
        "complete": len(done) == n_planned,
        "shards": [done[i] for i in sorted(done)],
    }
    write_json_atomic(out_dir / MANIFEST, manifest)
    return manifest


def read_manifest(trace_dir: str | Path) -> dict:
    """The manifest, refusing another format or feature version with a clear message."""
    path = Path(trace_dir) / MANIFEST
    if not path.is_file():
        raise TraceError(f"no {MANIFEST} in {trace_dir}: not a trace directory (run `python -m learnkv collect --out {trace_dir}`)")
    manifest = read_json_object(path, "a trace manifest", TraceError)
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise TraceError(f"{path}: format {manifest.get('format')!r} v{manifest.get('format_version')}, expected {FORMAT!r} v{FORMAT_VERSION}")
    if manifest.get("feature_version") != FEATURE_VERSION or manifest.get("features") != list(FEATURES):
        raise TraceError(
            f"{path}: traces have feature version {manifest.get('feature_version')}, this learnkv computes version "
            f"{FEATURE_VERSION}; they cannot be used or extended: collect into another directory (or delete this one)"
        )
    for entry in manifest.get("shards", []):
        check_shard_identity(entry, f"{path}: {entry.get('path')}", manifest.get("config_digest"))
    return manifest


def load_traces(trace_dir: str | Path, split: str | None = None, verify: bool = True):
    """All shards as one `datasets.Dataset` (memory-mapped), optionally one split; corrupt shards are refused."""
    import datasets  # datasets (~1.4 s) only where shards are read: `import learnkv.config` stays quick

    trace_dir = Path(trace_dir)
    manifest = read_manifest(trace_dir)
    if not manifest["shards"]:
        raise TraceError(f"{trace_dir} holds no finished shard")
    parts = []
    for entry in manifest["shards"]:
        path = trace_dir / entry["path"]
        if not path.is_file():
            raise TraceError(f"shard {path} listed in the manifest is missing")
        if verify and sha256_file(path) != entry["sha256"]:
            raise TraceError(f"shard {path} is corrupt or truncated (sha256 differs from the manifest); delete it and its .json to recollect it")
        try:
            ds = datasets.Dataset.from_file(str(path))
        except Exception as e:  # pyarrow raises several types on a damaged file
            raise TraceError(f"shard {path} cannot be read as Arrow ({type(e).__name__}: {e})") from None
        if len(ds) != entry["rows"]:
            raise TraceError(f"shard {path} has {len(ds)} rows, the manifest says {entry['rows']}")
        parts.append(ds)
    ds = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    if split is not None:
        ds = ds.filter(lambda s: s == split, input_columns="split")
    return ds
