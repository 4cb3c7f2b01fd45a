"""Checksums, atomic writes and output-directory checks for every file learnkv writes (trace shards, manifests,
scorer artifacts, evaluation results)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def write_text_atomic(path: Path, text: str) -> None:
    """Write text to a temporary name and rename it: a reader never sees half a file."""
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json_atomic(path: Path, obj) -> None:
    write_text_atomic(path, json.dumps(obj, indent=1))


def ensure_dir(path: str | Path, what: str, error: type[Exception] = ValueError, create: bool = True) -> Path:
    """Create directory ``path`` (``what`` names it in messages) or raise ``error`` saying why it cannot hold output:
    a file is there, it cannot be created, or it is not writable. Called before any long work starts; with
    ``create=False`` a missing directory is left for later (a run that may still fail leaves nothing behind)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise error(f"{what} {path} is a file; give a directory")
    if not create and not path.exists():
        return path
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise error(f"cannot create {what} {path}: {e.strerror or e}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise error(f"{what} {path} is not writable")
    return path
