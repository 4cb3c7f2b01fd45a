"""A killed evaluation resumes where it stopped.

An evaluation of the README's size runs for hours on a CPU. `evaluate` appends one JSON line per finished
(policy, budget) of a batch of prompts (the per-prompt metrics and costs) to ``partial.jsonl`` in the output
directory, after a first line naming the grid (`grid_identity`: model, tasks, policies with the scorer's weights
digest, budgets, prompts, seed, prefill policy, batch size). A rerun of the same grid into the same directory reads
what was finished and decodes only the rest (the full-cache reference of a batch is read back, see below, or
recomputed); so does the same grid given more policies (their runs are decoded on every batch, the finished ones
read back) or more prompts (a larger ``limit``: the batches of the prompts it adds are decoded; finished runs are
keyed by their prompts' ids); the values come back bit for bit (JSON keeps floats exact), so the results equal an
uninterrupted run's except the timings. A partial run of another grid, or a damaged file, is moved into
``earlier-<time>/`` (never deleted), and the run starts over. ``evaluate.py`` removes the file once
results.json is written. `Resume` is what `evaluate` holds of all this: what an earlier run finished, what this one
stores, and the references of the batch in progress.

One grid may be decoded by several processes at once (`evaluate.py --shard i/n`, one per core or machine on a shared
disk): shard i/n decodes the batches whose index is i modulo n into its own directory, ``shard-i-of-n/`` inside the
output directory (its own partial file, references and lock), and reads what the main directory and the other shards
have finished (`peer_dirs`) as its own, so nothing is decoded twice. The run without ``--shard`` (or
``--finished-only``) reads every shard's runs back the same way, and `finish` removes the shard directories once
results.json holds them.

The full-cache reference of a batch is kept too, while some of the batch's runs are left
(``reference-<digest>.safetensors``, `save_references`), and after it where small (`KEEP_REFERENCE_BYTES`): at
length it is the costliest single decode of a batch
(the long-chain table's: ~25 min per batch of 4 prompts, ~1 GB per prompt of logits and fp16 attention), so a
resumed run reads it back instead of decoding it again. A reference that holds something other than tensors, dataclasses of learnkv,
lists, dicts and plain values (a math task's parsed sympy answers) is not stored and is recomputed.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import importlib
import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from learnkv.atomic import ensure_dir, write_text_atomic
from learnkv.eval.report import keep_aside
from learnkv.scorer.artifact import read_artifact_manifest

PARTIAL = "partial.jsonl"
FORMAT = 1
SHARD_DIR = re.compile(r"shard-(\d+)-of-(\d+)")


def shard_dir(out_dir: str | Path, shard: tuple[int, int]) -> Path:
    """Where shard ``(i, n)`` of an evaluation into ``out_dir`` keeps its runs."""
    return Path(out_dir) / f"shard-{shard[0]}-of-{shard[1]}"


def peer_dirs(out_dir: str | Path) -> list[Path]:
    """The directories whose finished runs an evaluation into ``out_dir`` reads as its own: for the main output
    directory its shards' directories; for a shard's, the main directory and the other shards'."""
    out_dir = Path(out_dir)
    main = out_dir.parent if SHARD_DIR.fullmatch(out_dir.name) else out_dir
    shards = sorted(d for d in main.glob("shard-*-of-*") if SHARD_DIR.fullmatch(d.name) and d.is_dir())
    return [d for d in [main, *shards] if d != out_dir]


def scorer_identity(path: str) -> dict:
    """A scorer artifact named by its weights' digest, so retraining into the same path is a different grid."""
    return {"path": str(path), "weights_sha256": read_artifact_manifest(Path(path)).get("weights_sha256")}


def run_identity(run) -> dict:
    """A policy run as a grid names it: label, name, parameters (a scorer by its weights' digest)."""
    params = {k: (scorer_identity(v) if k == "scorer" else v) for k, v in sorted(run.params.items())}
    return {"label": run.label, "name": run.name, "params": params}


def grid_identity(spec, model_name: str | None) -> dict:
    """What makes two evaluations the same grid: a batch finished by one is a batch finished by the other."""
    identity = {
        "format": FORMAT,
        "model": model_name,
        "tasks": [{"name": t.name, "options": t.options()} for t in spec.tasks],
        "runs": [run_identity(r) for r in spec.runs],
        "budgets": list(spec.budgets),
        "limit": spec.limit,
        "seed": spec.seed,
        "prefill": run_identity(spec.prefill) if spec.prefill else None,
        "batch_size": spec.batch_size,
    }
    if spec.slack:  # speed only, but its peak KV differs; absent at 0, so grids from before it still resume
        identity["slack"] = spec.slack
    if spec.batch_budgets:  # speed only, but its costs are shares of other batches; absent when off, as slack
        identity["batch_budgets"] = True
    return json.loads(json.dumps(identity, default=str))  # the form it has after a round trip through the file


def differing_keys(head: dict, identity: dict) -> list[str]:
    """The keys whose values differ between two identities (either one's keys, in order)."""
    return [k for k in dict.fromkeys([*head, *identity]) if head.get(k) != identity.get(k)]


def _mismatch(head, identity: dict) -> str | None:
    """Why a partial file whose identity is ``head`` is not a run of this grid (None if it is)."""
    if head == identity:
        return None
    if head == "damaged":
        return "is damaged"
    return f"is a run of another grid ({', '.join(differing_keys(head, identity))} differ)"


def _read(path: Path) -> tuple[object, list[dict], list[str], bool]:
    """``(identity, entries, finished lines, torn)`` of a partial file (identity "damaged" if it cannot be read).
    A line is finished only with its newline: a run killed mid-write leaves a torn tail, which is not an entry."""
    lines = path.read_text().split("\n")
    complete, torn = lines[:-1], bool(lines[-1])
    try:
        head = json.loads(complete[0]) if complete else None
        entries = [json.loads(line) for line in complete[1:]]
    except (json.JSONDecodeError, IndexError):
        return "damaged", [], complete, torn
    return (head.get("identity") if isinstance(head, dict) else None) or "damaged", entries, complete, torn


def _by_batch(entries: list[dict]) -> dict:
    finished: dict = {}
    for entry in entries:
        finished.setdefault((entry["task"], tuple(entry["ids"])), {})[entry["policy"], entry["budget"]] = entry
    return finished


def open_partial(out_dir: str | Path, identity: dict) -> tuple[dict, str | None]:
    """The finished runs of an earlier run of this grid in ``out_dir`` and a line saying what was found.

    Returns
    -------
    finished : dict
        ``(task name, tuple of prompt ids) -> {(policy label, budget): entry}`` for every finished run of a batch
        of prompts (empty for a new run); the file then holds exactly the identity line and those entries, ready
        for `append_run`.
    note : str or None
        Resuming, or where a partial run of another grid (or a damaged file) was moved; None for a fresh start.
    """
    out_dir = ensure_dir(out_dir, "output directory")
    path = out_dir / PARTIAL
    if not path.is_file():
        _start(path, identity)
        return {}, None
    head, entries, complete, torn = _read(path)
    gained = ""
    if isinstance(head, dict) and _mismatch(head, identity) and _part_of(head, identity):  # more policies or prompts
        added = [run["label"] for run in identity["runs"] if run not in head["runs"]]
        more = [f"{', '.join(added)}: decoded on every batch"] if added else []
        if head.get("limit") != identity.get("limit"):
            more.append(f"prompts, --limit {head.get('limit')} -> {identity.get('limit') or 'all'}")
        gained = f" (the grid gained {'; '.join(more)})" if more else " (the same policies, in another order)"
        complete, torn = [json.dumps({"identity": identity}), *complete[1:]], True  # rewritten under the new grid
    elif why := _mismatch(head, identity):
        keep = keep_aside(out_dir, [path])
        _start(path, identity)
        return {}, f"{path} {why}; moved to {keep}/, starting over"
    if torn:  # drop the torn tail so the next append starts on a line of its own
        _write_lines(path, complete)
    finished = _by_batch(entries)
    return finished, (f"resuming from {path}: {len(entries)} runs of {len(finished)} batches of prompts already "
                      f"evaluated{gained}")


def read_partial(out_dir: str | Path, identity: dict) -> dict:
    """What a running or killed evaluation of this grid (or of a grid with more policies and otherwise the same) in
    ``out_dir`` has finished so far, read only (the file is left as it is, so the run that writes it can go on);
    raises ValueError if there is none."""
    path = Path(out_dir) / PARTIAL
    if not path.is_file():
        if partial_files(out_dir):  # only shards have run: their runs come in through `read_peers`
            return {}
        raise ValueError(f"{path} does not exist: no evaluation of this grid has started in {out_dir}")
    head, entries, _, _ = _read(path)
    if _some_runs_of(head, identity):  # a report on some of its policies (--finished-only --policy full,learned)
        head = identity
    if why := _mismatch(head, identity):
        raise ValueError(f"{path} {why}")
    return _by_batch(entries)


def read_peers(out_dir: str | Path, identity: dict, finished: dict) -> list[str]:
    """Add to ``finished`` (`_by_batch`'s form) the runs that the peers of ``out_dir`` (`peer_dirs`) finished of
    this grid (of any set of its policies), where ``finished`` has none for that (policy, budget) of the batch; the
    peers' files are only read. Returns the peer files of another grid, which are left out."""
    foreign = []
    for peer in peer_dirs(out_dir):
        path = peer / PARTIAL
        if not path.is_file():
            continue
        head, entries, _, _ = _read(path)
        if not _same_but_runs_and_limit(head, identity):
            foreign.append(str(path))
            continue
        for key, runs in _by_batch(entries).items():
            for run, entry in runs.items():
                finished.setdefault(key, {}).setdefault(run, entry)
    return foreign


def partial_files(out_dir: str | Path) -> list[Path]:
    """The partial files of an evaluation into ``out_dir`` and of its peers (`peer_dirs`) that exist."""
    return [d / PARTIAL for d in [Path(out_dir), *peer_dirs(out_dir)] if (d / PARTIAL).is_file()]


def _same_but_runs_and_limit(head, identity: dict) -> bool:
    """Whether ``head`` is ``identity``'s grid but perhaps for its policies and its number of prompts (``limit``):
    a finished run of a batch is keyed by its prompts' ids (`_by_batch`), so it counts wherever those ids make a
    batch of the other grid too."""
    return (isinstance(head, dict) and isinstance(head.get("runs"), list)
            and _mismatch({**head, "runs": identity["runs"], "limit": identity.get("limit")}, identity) is None)


def _some_runs_of(head, identity: dict) -> bool:
    """Whether ``identity`` is the grid of ``head`` but for fewer policies (and any number of prompts): a report on
    those, over the batches every one of them has finished, reads the same prompts' runs as the whole grid."""
    return _same_but_runs_and_limit(head, identity) and all(run in head["runs"] for run in identity["runs"])


def _part_of(head, identity: dict) -> bool:
    """Whether ``head`` is ``identity``'s grid but for fewer policies or prompts (a smaller ``limit``; None is all):
    ``identity`` resumes it, decoding the added policies on every batch and the added prompts' batches."""
    if not (_same_but_runs_and_limit(head, identity) and all(run in identity["runs"] for run in head["runs"])):
        return False
    small, big = head.get("limit"), identity.get("limit")
    return big is None or (small is not None and small <= big)


def _start(path: Path, identity: dict) -> None:
    _write_lines(path, [json.dumps({"identity": identity})])


def _write_lines(path: Path, lines: list[str]) -> None:
    write_text_atomic(path, "".join(line + "\n" for line in lines))


def append_run(out_dir: str | Path, entry: dict) -> None:
    """Append one finished run of a batch (``{"task", "ids", "policy", "budget", "metrics", "costs", "params"}``)
    durably: a crash after this returns loses nothing."""
    with open(Path(out_dir) / PARTIAL, "a") as f:
        f.write(json.dumps(entry) + "\n")
        f.flush()
        os.fsync(f.fileno())


def kept_runs(out_dir: str | Path) -> str:
    """What a stopped evaluation keeps in ``out_dir`` for the next run of its grid (one clause, for messages)."""
    path = Path(out_dir) / PARTIAL
    if not path.is_file():
        return f"no finished run is kept in {out_dir}"
    try:
        _, entries, _, _ = _read(path)
    except (OSError, UnicodeDecodeError):
        return f"finished runs are kept in {path}"
    batches = len({(e.get("task"), tuple(e.get("ids", ()))) for e in entries if isinstance(e, dict)})
    return f"{len(entries)} finished runs of {batches} batches of prompts are kept in {path}"


def finish(out_dir: str | Path) -> None:
    """The results are written: the partial file, any stored reference and the shards' directories have nothing
    left to give."""
    (Path(out_dir) / PARTIAL).unlink(missing_ok=True)
    for path in Path(out_dir).glob("reference-*.safetensors"):
        path.unlink(missing_ok=True)
    for shard in peer_dirs(out_dir):
        if SHARD_DIR.fullmatch(shard.name):  # never the main directory, whoever calls this
            shutil.rmtree(shard, ignore_errors=True)


class _NotStorable(Exception):
    pass


def _pack(value, tensors: dict, name: str):
    """``value`` as JSON, its tensors moved into ``tensors`` (named by their path in the value)."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        storage = t.untyped_storage()
        if any(o.untyped_storage().data_ptr() == storage.data_ptr() for o in tensors.values()) or \
                storage.nbytes() != t.numel() * t.element_size():
            t = t.clone()  # safetensors stores each tensor's own bytes: no views, no tensor twice
        tensors[name] = t
        return {"tensor": name}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        if not cls.__module__.startswith("learnkv."):
            raise _NotStorable(cls.__qualname__)
        return {"dataclass": f"{cls.__module__}:{cls.__qualname__}",
                "fields": {f.name: _pack(getattr(value, f.name), tensors, f"{name}.{f.name}")
                           for f in dataclasses.fields(value)}}  # fmt: skip
    if isinstance(value, (list, tuple)):
        return {"list": [_pack(v, tensors, f"{name}.{i}") for i, v in enumerate(value)]}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"dict": {k: _pack(v, tensors, f"{name}.{k}") for k, v in value.items()}}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    raise _NotStorable(type(value).__qualname__)


def _unpack(packed: dict, tensors: dict):
    if "tensor" in packed:
        return tensors[packed["tensor"]]
    if "dataclass" in packed:
        module, qualname = packed["dataclass"].split(":")
        if not module.startswith("learnkv."):
            raise ValueError(f"not a learnkv class: {packed['dataclass']}")
        cls = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
        return cls(**{k: _unpack(v, tensors) for k, v in packed["fields"].items()})
    if "list" in packed:
        return [_unpack(v, tensors) for v in packed["list"]]
    if "dict" in packed:
        return {k: _unpack(v, tensors) for k, v in packed["dict"].items()}
    return packed["value"]


def identity_digest(identity: dict) -> str:
    """The short digest that names a stored file by what it depends on (``identity``, JSON-able)."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _reference_path(out_dir: str | Path, identity: dict) -> Path:
    return Path(out_dir) / f"reference-{identity_digest(identity)}.safetensors"


def save_references(out_dir: str | Path, identity: dict, refs: list) -> Path | None:
    """Store a batch's references (``identity``: what they depend on: model, task and its options, prompt ids);
    None, and nothing written, where a reference holds something that cannot be stored."""
    if all(ref is None for ref in refs):  # a task without a reference
        return None
    tensors: dict = {}
    try:
        packed = _pack(list(refs), tensors, "refs")
    except _NotStorable:
        return None
    path = _reference_path(out_dir, identity)
    tmp = path.with_name(path.name + ".tmp")
    meta = json.dumps({"identity": identity, "refs": packed}, default=str)
    try:
        save_file(tensors, str(tmp), metadata={"learnkv": meta})
        os.replace(tmp, path)  # a run killed while writing leaves no torn file under the real name
    except Exception as e:  # a full disk: safetensors raises its own SafetensorError around the OSError
        tmp.unlink(missing_ok=True)  # no half-written reference left taking the space
        if isinstance(e, OSError):
            raise
        raise OSError(errno.EIO, f"cannot store the batch's full-cache reference ({type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''})", str(path)) from None
    return path


def load_references(out_dir: str | Path, identity: dict) -> list | None:
    """The references `save_references` stored for ``identity`` in ``out_dir`` or a peer's directory (`peer_dirs`),
    or None (none stored, or a damaged or foreign file: the caller decodes them again)."""
    paths = [_reference_path(d, identity) for d in [Path(out_dir), *peer_dirs(out_dir)]]
    path = next((p for p in paths if p.is_file()), None)
    if path is None:
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads(f.metadata()["learnkv"])
        if meta["identity"] != json.loads(json.dumps(identity, default=str)):
            return None
        return _unpack(meta["refs"], load_file(str(path)))
    except Exception:  # noqa: BLE001 - any damage means: decode the reference again
        return None


# A finished batch's stored reference is kept until the grid's results are written (`finish`) when it is smaller
# than this: a free run's tokens and answers (~0.1 MB for a batch of 8 chain prompts), which a grid later given
# more policies (`open_partial`) reads back instead of decoding the full cache again. Larger ones (the long table's
# logits and attention, ~1 GB a prompt) are dropped as soon as their batch is finished.
KEEP_REFERENCE_BYTES = 64 << 20


def drop_references(out_dir: str | Path, identity: dict, keep_small: bool = False) -> None:
    """A batch is finished: its stored references are no longer needed (``keep_small``: unless they weigh under
    `KEEP_REFERENCE_BYTES`)."""
    path = _reference_path(out_dir, identity)
    if keep_small and path.is_file() and path.stat().st_size < KEEP_REFERENCE_BYTES:
        return
    path.unlink(missing_ok=True)


def reference_identity(model_name: str | None, task, ids: list[str]) -> dict:
    """What a batch's full-cache references depend on (their file's name is its digest): model, task and its
    options, prompt ids."""
    return {"model": model_name, "task": task.name, "options": task.options(), "ids": ids}


class Resume:
    """An evaluation's resume state in ``out_dir``: what an earlier run of its grid finished (read back, not
    decoded again), what this run stores as it finishes it, and each batch's full-cache references while the
    batch has runs left. ``out_dir`` None: nothing is read or stored. ``finished_only``: the partial file is only
    read (`read_partial`: it raises if there is none of this grid, here or in a peer's directory), and nothing is
    stored. The peers' finished runs (`peer_dirs`) count as finished here too (`refresh`)."""

    def __init__(self, out_dir: str | Path | None, identity: dict, finished_only: bool = False):
        self.out_dir = None if out_dir is None else Path(out_dir)
        self.finished: dict = {}  # (task, prompt ids) -> {(policy label, budget): entry}
        self.note = None  # resuming, or where another grid's partial file was moved
        self.read_only = finished_only
        self.identity = identity
        if finished_only:
            if out_dir is None:
                raise ValueError("finished_only reads the finished runs of an evaluation into resume_dir: give it")
            self.finished = read_partial(out_dir, identity)
        elif out_dir is not None:
            self.finished, self.note = open_partial(out_dir, identity)
        self.refresh()

    def refresh(self) -> None:
        """Read again what the peers (`peer_dirs`: the shards, or the main directory and the other shards) have
        finished meanwhile, so a batch one of them finished is not decoded again here."""
        if self.out_dir is None:
            return
        foreign = read_peers(self.out_dir, self.identity, self.finished)
        if foreign and self.note is None:
            self.note = f"left out (runs of another grid): {', '.join(foreign)}"

    @property
    def stores(self) -> bool:
        return self.out_dir is not None and not self.read_only

    def stored(self, task: str, ids: list[str]) -> dict:
        """``{(policy label, budget): entry}``: what an earlier run finished of this batch of prompts."""
        return self.finished.get((task, tuple(ids)), {})

    def references(self, identity: dict, compute) -> list:
        """A batch's references: read back where stored, else computed and stored."""
        refs = load_references(self.out_dir, identity) if self.stores else None
        if refs is None:
            refs = compute()
            if self.stores:
                save_references(self.out_dir, identity, refs)
        return refs

    def store(self, task: str, ids: list[str], label: str, budget, result: tuple) -> None:
        """Keep one finished (policy, budget) of a batch: ``result`` is its ``(metrics, costs, params)``."""
        if self.stores:
            metrics, costs, params = result
            append_run(self.out_dir, {"task": task, "ids": ids, "policy": label, "budget": budget,
                                      "metrics": metrics, "costs": costs, "params": params})

    def batch_finished(self, identity: dict) -> None:
        """Every run of a batch is stored: its references are no longer needed, unless small enough to keep for
        policies a later run of the grid may add (`KEEP_REFERENCE_BYTES`)."""
        if self.stores:
            drop_references(self.out_dir, identity, keep_small=True)

    def n_finished(self) -> int:
        return sum(map(len, self.finished.values()))


__all__ = ["KEEP_REFERENCE_BYTES", "PARTIAL", "Resume", "append_run", "differing_keys", "drop_references", "finish",
           "grid_identity", "identity_digest", "kept_runs", "load_references", "open_partial", "partial_files",
           "peer_dirs", "read_peers", "reference_identity", "run_identity", "save_references", "shard_dir"]
