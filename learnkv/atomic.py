"""Checksums and atomic writes for every file learnkv writes (trace shards, manifests, scorer artifacts)."""

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


def write_json_atomic(path: Path, obj) -> None:
    """Write JSON to a temporary name and rename it: a reader never sees half a file."""
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)
