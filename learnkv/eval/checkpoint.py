"""A killed evaluation resumes where it stopped.

An evaluation of the README's size runs for hours on a CPU. `evaluate` appends one JSON line per finished
(policy, budget) of a batch of prompts (the per-prompt metrics and costs) to ``partial.jsonl`` in the output
directory, after a first line naming the grid (`grid_identity`: model, tasks, policies with the scorer's weights
digest, budgets, prompts, seed, prefill policy, batch size). A rerun of the same grid into the same directory reads
what was finished and decodes only the rest (the full-cache reference of a batch is recomputed if any of its
runs is left); the values come back bit for bit (JSON keeps floats exact), so the results equal an uninterrupted
run's except the timings. A partial run of another grid, or a damaged file, is moved
into ``earlier-<time>/`` (never deleted), and the run starts over. ``evaluate.py`` removes the file once
results.json is written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from learnkv.atomic import ensure_dir, write_text_atomic
from learnkv.eval.report import keep_aside

PARTIAL = "partial.jsonl"
FORMAT = 1


def _scorer_identity(path: str) -> dict:
    """A scorer artifact named by its weights' digest, so retraining into the same path is a different grid."""
    from learnkv.scorer.artifact import read_artifact_manifest

    return {"path": str(path), "weights_sha256": read_artifact_manifest(Path(path)).get("weights_sha256")}


def _run_identity(run) -> dict:
    params = {k: (_scorer_identity(v) if k == "scorer" else v) for k, v in sorted(run.params.items())}
    return {"label": run.label, "name": run.name, "params": params}


def grid_identity(spec, model_name: str | None) -> dict:
    """What makes two evaluations the same grid: a batch finished by one is a batch finished by the other."""
    identity = {
        "format": FORMAT,
        "model": model_name,
        "tasks": [{"name": t.name, "options": t.options()} for t in spec.tasks],
        "runs": [_run_identity(r) for r in spec.runs],
        "budgets": list(spec.budgets),
        "limit": spec.limit,
        "seed": spec.seed,
        "prefill": _run_identity(spec.prefill) if spec.prefill else None,
        "batch_size": spec.batch_size,
    }
    if spec.slack:  # speed only, but its peak KV differs; absent at 0, so grids from before it still resume
        identity["slack"] = spec.slack
    return json.loads(json.dumps(identity, default=str))  # the form it has after a round trip through the file


def _differences(old: dict, new: dict) -> list[str]:
    return [k for k in dict.fromkeys([*old, *new]) if old.get(k) != new.get(k)]


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
    finished: dict = {}
    if not path.is_file():
        _start(path, identity)
        return finished, None
    lines = path.read_text().split("\n")
    complete = lines[:-1]  # a line is finished only with its newline: a run killed mid-write leaves a torn tail
    try:
        head = json.loads(complete[0]) if complete else None
        entries = [json.loads(line) for line in complete[1:]]
    except (json.JSONDecodeError, IndexError):
        head, entries = "damaged", []
    if not isinstance(head, dict) or head.get("identity") != identity:
        why = ("is damaged" if head == "damaged" or not isinstance(head, dict) else
               f"is a run of another grid ({', '.join(_differences(head.get('identity') or {}, identity))} differ)")
        keep = keep_aside(out_dir, [path])
        _start(path, identity)
        return finished, f"{path} {why}; moved to {keep}/, starting over"
    for entry in entries:
        finished.setdefault((entry["task"], tuple(entry["ids"])), {})[entry["policy"], entry["budget"]] = entry
    if lines[-1]:  # drop the torn tail so the next append starts on a line of its own
        _write_lines(path, complete)
    return finished, (f"resuming from {path}: {len(entries)} runs of {len(finished)} batches of prompts already "
                      "evaluated")


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


def finish(out_dir: str | Path) -> None:
    """The results are written: the partial file has nothing left to give."""
    (Path(out_dir) / PARTIAL).unlink(missing_ok=True)


__all__ = ["PARTIAL", "append_run", "finish", "grid_identity", "open_partial"]
