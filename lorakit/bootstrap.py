"""Percentile bootstrap intervals for the decode timing and the behaviour reports; pure
Python with a fixed seed: the same numbers give the same interval.

>>> window_intervals({"x": [1.0, 2, 3, 4]}, {"mean": lambda t: t["x"] / 4})["mean"]
(1.5, 3.5)
"""
from __future__ import annotations

import math
import random
from typing import Callable, Dict, List, Mapping, Sequence, Tuple

__all__ = ["percentile_span", "window_intervals"]

CONFIDENCE = 0.95
RESAMPLES = 2000


def percentile_span(draws: Sequence[float],
                    confidence: float = CONFIDENCE) -> Tuple[float, float]:
    """The central ``confidence`` span of bootstrap draws (the percentile interval)."""
    v, n = sorted(draws), len(draws)
    tail = (1 - confidence) / 2
    return v[max(0, int(math.floor(tail * n)))], v[min(n - 1, int(math.ceil((1 - tail) * n)) - 1)]


def window_intervals(columns: Mapping[str, Sequence[float]],
                     statistics: Mapping[str, Callable[[Dict[str, float]], float]], *,
                     confidence: float = CONFIDENCE, resamples: int = RESAMPLES,
                     seed: int = 0) -> Dict[str, Tuple[float, float]]:
    """Percentile bootstrap intervals over windows: ``columns`` holds one sum per window
    each; a resample draws windows with replacement and evaluates every statistic on the
    drawn column totals (one draw for all: ratios are paired). ``(nan, nan)`` with fewer
    than 2 windows, or where a statistic is undefined on a draw."""
    cols = {k: [float(x) for x in v] for k, v in columns.items()}
    n = len(next(iter(cols.values()), []))
    if n < 2:
        return {k: (math.nan, math.nan) for k in statistics}
    rng = random.Random(seed)
    draws: Dict[str, List[float]] = {k: [] for k in statistics}
    for _ in range(resamples):
        idx = rng.choices(range(n), k=n)
        totals = {k: math.fsum(v[i] for i in idx) for k, v in cols.items()}
        for k, f in statistics.items():
            draws[k].append(f(totals))
    return {k: (percentile_span(d, confidence) if not any(map(math.isnan, d))
                else (math.nan, math.nan)) for k, d in draws.items()}
