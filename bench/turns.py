"""Time several decodes that take turns, one step each, so that every one of them runs on the same machine.

Why: on the shared 2-core CPU a process's speed drifts by 10-20% over minutes (memory-bandwidth neighbours: the
same batch-8 decode ran at 60-73 tokens/s in one process, 2026-11-30, with no steal time), so two decodes timed
minutes apart carry that drift into their ratio. Decodes that alternate step by step see the same drift; their
ratio keeps only what each costs.

Each decode is a `learnkv.generate_steps` generator, resumed in turns in the calling thread: a decode's own time is
the sum of its spans from a resume to its next yield, its prefill (the first span) and each decode step, with no
other decode's work inside. One thread, not one per decode: torch's CPU ops run on OpenMP (GNU libgomp), which
gives each calling thread its own team of workers, and beside a second, idle team a small op ([16, 3, 1290]
``log1p``, 2 threads) took 2.5x its time alone (`bench/omp_teams.py`, 2026-12-04); decodes in threads paid that on
every op, the learned policy's refresh most of all (bench/RESULTS.md, "Turns in one thread"). And no decode hands
the heap's free pages back while they take turns (`learnkv.memory.paused_trims`): in one process each decode's look at
the resident size sees the others' growth, so the first to look (the full cache, in the long table's order) trimmed
at every look and paid 31-37 ms a trim, where a steady decode alone never trims (bench/RESULTS.md, "The full cache's
trims in turns").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from learnkv.eval.stats import ratio_of_sums
from learnkv.memory import paused_trims


@dataclass
class Turned:
    """One decode's outcome: what its generator returned, its prefill's seconds and each decode step's."""

    result: object = None
    prefill_s: float = 0.0
    step_s: list[float] = field(default_factory=list)
    error: Exception | None = None

    @property
    def decode_s(self) -> float:
        return sum(self.step_s)


def take_turns(jobs: list[Callable[[], Iterator]], after_step: Callable[[int], None] | None = None) -> list[Turned]:
    """Run ``jobs`` in turns, in the given order, one step each, in this thread, and return each one's result and own
    times. A job is called once (its call is timed with its prefill) and returns a generator that yields after its
    prefill and after each decode step and returns its result (`learnkv.generate_steps`). ``after_step(i)`` is
    called (untimed) after each of job ``i``'s steps, e.g. to tick a progress bar. An exception in a job ends it
    (the others go on) and is raised here once all have ended; an interrupt (Ctrl-C) ends every one at once (their
    generators are closed) and goes on to the caller."""
    out = [Turned() for _ in jobs]
    running: dict[int, Iterator | None] = dict.fromkeys(range(len(jobs)))  # None: not started yet
    try:
        with paused_trims():  # no decode hands back pages the others are about to take again
            while running:
                for i in list(running):
                    started, first = time.perf_counter(), running[i] is None
                    try:
                        if first:
                            running[i] = jobs[i]()
                        next(running[i])
                    except StopIteration as end:
                        out[i].result = end.value
                        del running[i]
                        continue
                    except Exception as e:  # noqa: BLE001 - handed to the caller once every job has ended
                        out[i].error = e
                        del running[i]
                        continue
                    spent = time.perf_counter() - started
                    if first:  # the job's call and its prefill
                        out[i].prefill_s = spent
                    else:
                        out[i].step_s.append(spent)
                    if after_step is not None:
                        after_step(i)
    finally:
        for steps in running.values():
            if steps is not None:
                steps.close()
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
