"""Intervals over prompts: how sure a mean over a handful of prompts is, and whether policy A beats policy B.

Pure functions of per-prompt values (numpy, seeded), no model. Every per-prompt metric of an evaluation gets a 95%
percentile-bootstrap interval of its mean over prompts (`bootstrap_ci`); a comparison of two policies on the same
prompts resamples the prompts' paired differences (`paired_difference`), which cancels what the prompts share
(an easy prompt is easy for both). A difference "excludes zero" when its whole interval is on one side of zero.

The percentile bootstrap is the simple, assumption-light choice; with few prompts it is too narrow rather than too
wide, so treat a borderline interval from 4-8 prompts as no evidence.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np

N_RESAMPLES = 2000
LEVEL = 0.95


def _values(values: Sequence[float | None]) -> np.ndarray:
    return np.asarray([v for v in values if v is not None], dtype=np.float64)


def bootstrap_ci(values: Sequence[float | None], level: float = LEVEL, n_resamples: int = N_RESAMPLES,
                 seed: int = 0) -> list[float] | None:
    """``[lo, hi]``: the percentile-bootstrap interval of the mean of ``values`` (None entries dropped).

    Returns None when there is no value; a single value (or all equal) gives a zero-width interval.
    """
    x = _values(values)
    if x.size == 0:
        return None
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(n_resamples, x.size))].mean(axis=1)
    tail = (1.0 - level) / 2
    lo, hi = np.quantile(means, [tail, 1.0 - tail])
    return [float(min(lo, x.mean())), float(max(hi, x.mean()))]


def paired_difference(a: Sequence[float | None], b: Sequence[float | None], level: float = LEVEL,
                      n_resamples: int = N_RESAMPLES, seed: int = 0) -> dict | None:
    """Mean of ``a - b`` over the prompts where both have a value, with its paired-bootstrap interval.

    Returns
    -------
    dict or None
        ``{"mean_diff", "ci95": [lo, hi], "n", "excludes_zero"}``; None when no prompt has both values.
    """
    if len(a) != len(b):
        raise ValueError(f"paired values need one value per prompt on both sides, got {len(a)} and {len(b)}")
    diffs = [x - y for x, y in zip(a, b) if x is not None and y is not None]
    ci = bootstrap_ci(diffs, level, n_resamples, seed)
    if ci is None:
        return None
    return {"mean_diff": float(np.mean(diffs)), "ci95": ci, "n": len(diffs),
            "excludes_zero": bool(ci[0] > 0 or ci[1] < 0)}


def ratio_of_sums(pairs: Sequence[tuple[float, float]], level: float = LEVEL, n_resamples: int = N_RESAMPLES,
                  seed: int = 0) -> tuple[float, float, float]:
    """``sum(a) / sum(b)`` over paired units ``(a, b)`` and its percentile-bootstrap interval over the units:
    ``(ratio, low, high)``. For a ratio of totals (two decodes' summed step times, blocks of steps as the units),
    where a mean of per-unit ratios would weight a fast unit like a slow one."""
    total = sum(a for a, _ in pairs) / sum(b for _, b in pairs)
    rng = random.Random(seed)
    drawn = []
    for _ in range(n_resamples):
        pick = [pairs[rng.randrange(len(pairs))] for _ in pairs]
        drawn.append(sum(a for a, _ in pick) / sum(b for _, b in pick))
    drawn.sort()
    tail = (1.0 - level) / 2
    return total, drawn[int(tail * n_resamples)], drawn[int((1.0 - tail) * n_resamples) - 1]
