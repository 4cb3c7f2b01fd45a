"""Progress of long work (evaluation, trace collection): one redraw rule and one live token count for every bar.

A decode of thousands of steps finishes a unit of work (a run, a batch of prompts) every few minutes, so a bar that
moves only per unit is silent for that long; `token_counter` is the `generate(on_step=)` hook that shows the
tokens decoded so far and their rate on the bar in between.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable


def redraw_seconds(stream=None) -> float:
    """How often a bar redraws: every second on a terminal, every 30 s into a log file (a line each time)."""
    stream = sys.stderr if stream is None else stream
    return 1.0 if stream.isatty() else 30.0


def token_counter(bar, every_s: float) -> Callable[..., None]:
    """A `generate(on_step=)` hook: counts the rows decoded at each step (every decode it is passed to) and shows
    the count and the rate on ``bar``'s postfix, redrawn at most every ``every_s`` seconds or when called with
    ``redraw=True`` (``hook(0, redraw=True)`` at the end of a unit of work, so the bar's last line has the count).
    ``hook(0, doing="h2o: prefill")`` names the work under way on the postfix from then on, redrawn at once: a
    prefill or a reference decode of many rows runs for minutes before its first counted step."""
    state = {"tokens": 0, "start": time.perf_counter(), "shown": time.perf_counter(), "doing": None}

    def on_step(n_rows: int, redraw: bool = False, doing: str | None = None) -> None:
        state["tokens"] += n_rows
        if doing is not None:
            state["doing"], redraw = doing, True
        now = time.perf_counter()
        if redraw or now - state["shown"] >= every_s:
            state["shown"] = now
            what = {"doing": state["doing"]} if state["doing"] else {}
            bar.set_postfix(**what, tokens=state["tokens"],
                            tok_s=f"{state['tokens'] / max(now - state['start'], 1e-9):.1f}")

    return on_step
