"""Quiet by default: a long job prints its progress bars and its tables; library chatter goes to the run's log file.

Lightning's info lines (accelerator, tips, "`Trainer.fit` stopped"), every warning raised while the job runs
(Lightning's deprecations among them) and wandb's messages (run start, sync hints, run history and summary) are
written to ``LOG`` in the output directory instead of the terminal. ``verbose=True`` shows them on the terminal too.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from pathlib import Path

LOG = "train.log"
#: the logger wandb's terminal messages are handed to (`quiet_wandb`), written to the run's log like the rest
WANDB_LOGGER = "learnkv.wandb"
# the loggers whose records go to the log file: Lightning's two, captured warnings, wandb's terminal messages
_CHATTY = ("lightning.pytorch", "lightning.fabric", "py.warnings", WANDB_LOGGER)


class _LogFile(logging.FileHandler):
    """A file handler that creates its directory, and the file, only when the first record comes."""

    def _open(self):
        Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
        return super()._open()


@contextlib.contextmanager
def run_log(path: str | Path, verbose: bool = False):
    """Within the block, Lightning's and wandb's messages and every warning go to ``path`` (appended), and, with
    ``verbose``, to stderr as well; everything is put back on exit."""
    handler = _LogFile(str(path), delay=True, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
    saved = []
    for name in _CHATTY:
        log = logging.getLogger(name)
        saved.append((log, log.handlers[:], log.propagate, log.level))
        if not verbose:
            log.handlers = []
        elif not log.handlers:
            log.addHandler(logging.StreamHandler(sys.stderr))
        log.addHandler(handler)
        log.propagate = False
        log.setLevel(logging.INFO)
    logging.captureWarnings(True)
    try:
        yield
    finally:
        logging.captureWarnings(False)
        for log, handlers, propagate, level in saved:
            log.handlers, log.propagate = handlers, propagate
            log.setLevel(level)
        handler.close()


def quiet_wandb(verbose: bool) -> None:
    """Before a wandb run starts: without ``verbose``, its terminal messages (start-up, sync hints, run history and
    summary) go to the `WANDB_LOGGER` logger, i.e. the run's log file, instead of stderr. `loud_wandb` undoes it."""
    if verbose:
        return
    import wandb  # only called where wandb is installed (`make_logger` checks)

    wandb.setup()  # create wandb's singleton first: creating it later would set the terminal back
    wandb.termsetup(wandb.Settings(show_info=False, show_warnings=False), logging.getLogger(WANDB_LOGGER))


def loud_wandb(verbose: bool) -> None:
    """After the run: wandb's terminal messages back on the terminal."""
    if not verbose:
        import wandb  # optional: as in `quiet_wandb`

        wandb.termsetup(wandb.Settings(), None)
