"""Checksums, atomic writes and output-directory checks for every file learnkv writes (trace shards, manifests,
scorer artifacts, evaluation results)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
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


def read_json_object(path: str | Path, what: str, error: type[Exception] = ValueError) -> dict:
    """The JSON object in file ``path`` (``what`` names it); raises ``error`` in one line if the file is not JSON or
    holds something else (a list, a number) where learnkv expects an object."""
    try:
        data = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: {what} must be a JSON object, got a {type(data).__name__}")
    return data


@contextlib.contextmanager
def dir_lock(path: str | Path, what: str, error: type[Exception] = ValueError, name: str = ".learnkv.lock"):
    """Hold directory ``path``'s lock (the file ``name`` in it) for the block: a second learnkv process writing into
    the same directory meanwhile is refused, naming the process that holds it. The lock is an advisory `flock`,
    which the kernel releases when its holder ends, killed or not, so no stale lock outlives a run; the file stays,
    saying which process held it last."""
    try:
        import fcntl  # POSIX only (no flock on Windows, where runs go unlocked)
    except ImportError:  # no flock (Windows): unlocked
        yield
        return
    with open(Path(path) / name, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            raise error(f"{what} {path} is in use by a running learnkv process ({holder}); wait for it to end or use "
                        "another directory") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()}: {' '.join(sys.argv)}"[:500] + "\n")
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


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
