"""Time several decodes that take turns, one step each, so that every one of them runs on the same machine.

Why: on the shared 2-core CPU a process's speed drifts by 10-20% over minutes (memory-bandwidth neighbours: the
same batch-8 decode ran at 60-73 tokens/s in one process, 2026-11-30, with no steal time), so two decodes timed
minutes apart carry that drift into their ratio. Decodes that alternate step by step see the same drift; their
ratio keeps only what each costs.

Each decode runs in its own thread, but only the one holding the turn runs: its ``on_step`` (`learnkv.generate`'s
callback after the prefill and after every decode step) reads the clock, hands the turn on and waits for it again,
so a decode's own time is the sum of its spans between getting the turn and its next ``on_step``: its prefill (the
first span) and each decode step, with no other decode's work inside. (glibc's per-thread arenas and OpenMP's
per-thread teams are the cost of threads; only one team works at a time.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from learnkv.eval.stats import ratio_of_sums


class _Stopped(Exception):
    """Raised in a decode's ``on_step`` when the caller was interrupted: its `generate` unwinds, its thread ends."""


@dataclass
class Turned:
    """One decode's outcome: what its job returned, its prefill's seconds and each decode step's."""

    result: object = None
    prefill_s: float = 0.0
    step_s: list[float] = field(default_factory=list)
    error: BaseException | None = None

    @property
    def decode_s(self) -> float:
        return sum(self.step_s)


def take_turns(jobs: list[Callable[[Callable[[int], None]], object]],
               after_step: Callable[[int], None] | None = None) -> list[Turned]:
    """Run ``jobs`` (each called with the ``on_step`` callback to hand its `generate`) in turns, in the given order,
    one step each, and return each one's result and own times. ``after_step(i)`` is called (untimed, on job ``i``'s
    turn) after each of its steps, e.g. to tick a progress bar. An exception in a job ends it (the others go on) and
    is raised here once all have ended."""
    cond = threading.Condition()
    turn, stopping = [0], [False]
    done = [False] * len(jobs)
    out = [Turned() for _ in jobs]

    def pass_on(i: int) -> None:  # with cond held: the next job that has not ended, in order
        n = len(jobs)
        for k in range(1, n + 1):
            if not done[(i + k) % n]:
                turn[0] = (i + k) % n
                break
        cond.notify_all()

    def wait_for(i: int) -> None:
        with cond:
            cond.wait_for(lambda: turn[0] == i or stopping[0])
        if stopping[0]:
            raise _Stopped

    def run(i: int) -> None:
        try:
            wait_for(i)
        except _Stopped:
            return
        started, calls = [time.perf_counter()], [0]

        def on_step(_rows: int) -> None:
            spent = time.perf_counter() - started[0]
            calls[0] += 1
            if calls[0] == 1:  # the first call follows the prefill
                out[i].prefill_s = spent
            else:
                out[i].step_s.append(spent)
            if after_step is not None:
                after_step(i)
            with cond:
                pass_on(i)
            wait_for(i)
            started[0] = time.perf_counter()

        try:
            out[i].result = jobs[i](on_step)
        except _Stopped:
            pass
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            out[i].error = e
        with cond:
            done[i] = True
            pass_on(i)
            if all(done):
                ended.set()

    ended = threading.Event()
    threads = [threading.Thread(target=run, args=(i,), name=f"turns-{i}") for i in range(len(jobs))]
    for t in threads:
        t.start()
    try:
        # waited on an event, not a join: Ctrl-C inside Python 3.11's `Thread.join` marks the joined thread stopped
        # while it runs (bpo-45274's handling), so a later join would return at once
        while jobs and not ended.wait(timeout=0.5):  # with a timeout, Ctrl-C / SIGTERM reach the main thread
            pass
    except BaseException:  # interrupted: each decode stops at its next step's end, then the interrupt goes on
        with cond:
            stopping[0] = True
            cond.notify_all()
        ended.wait()
        raise
    finally:
        for t in threads:
            t.join()
    for o in out:
        if o.error is not None:
            raise o.error
    return out


def block_ratio_interval(base_s: list[float], other_s: list[float], block: int = 16, draws: int = 2000,
                         seed: int = 0) -> tuple[float, float, float]:
    """Speed of ``other`` relative to ``base`` (the ratio of their summed step times, base / other) and its 95%
    bootstrap interval over blocks of ``block`` consecutive steps, the two decodes' step ``k`` paired (they ran in
    turns): (ratio, low, high). A block keeps a compaction's step with the steps it serves (slack 16: one in 17)."""
    n = min(len(base_s), len(other_s))
    blocks = [(sum(base_s[j:j + block]), sum(other_s[j:j + block])) for j in range(0, n, block)]
    return ratio_of_sums(blocks, n_resamples=draws, seed=seed)
