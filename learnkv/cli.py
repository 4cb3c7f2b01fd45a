"""What every command line shares (`python -m learnkv`, `train.py`, `evaluate.py`): argparse errors as one line, the
``--threads`` option's range, ``--shard i/n``, and SIGTERM handled like Ctrl-C (what a scheduler or `timeout`
sends)."""

from __future__ import annotations

import argparse
import signal
import threading


class OneLineParser(argparse.ArgumentParser):
    """An `ArgumentParser` whose errors are one line, ``error: ...``, and exit code 2 (argparse prints the whole
    usage); its subcommands' parsers are of this class too."""

    def error(self, message):
        self.exit(2, f"error: {message}\n")


def thread_count(text: str) -> int:
    """``--threads N``: torch CPU threads, an integer >= 1 (0 would silently run the default count, and a negative
    count is a torch RuntimeError)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of threads >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 thread, got {n}")
    return n


def shard_of(text: str) -> tuple[int, int]:
    """``--shard i/n`` (`collect`, `evaluate.py`): this process takes every n-th piece of work from the i-th, 0 <= i <
    n; raises ValueError on anything else."""
    i, sep, n = str(text).partition("/")
    if not (sep and i.isdigit() and n.isdigit() and int(i) < int(n)):
        raise ValueError(f"--shard takes i/n with 0 <= i < n (e.g. 0/4: the first of four processes), got {text!r}")
    return int(i), int(n)


def set_threads(n: int | None) -> None:
    """Use ``n`` torch CPU threads (None: torch's default)."""
    if n is not None:
        import torch  # only here: the CLI answers --help and bad arguments before torch's import (~1 s)

        torch.set_num_threads(n)


class Interruptible:
    """Within the block, SIGTERM raises KeyboardInterrupt as Ctrl-C does, so one handler says what was kept and how
    to resume; `code` is then the exit status (130 for Ctrl-C, 143 for SIGTERM) and `how` names the signal.

    Outside the main thread (no signal handlers there) it does nothing."""

    def __init__(self):
        self.code, self.how, self._previous = 130, "interrupted", None

    def _terminate(self, signum, frame):
        self.code, self.how = 128 + signum, "terminated (SIGTERM)"
        raise KeyboardInterrupt

    def __enter__(self) -> Interruptible:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._terminate)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
