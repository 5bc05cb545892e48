"""How sure a decode timing is: paired bootstrap intervals of each variant's ratio to
base (rounds drawn with replacement, the same for both, then runs inside rounds), and
the verdict words. Seeded ``random``: the same runs give the same interval."""
from __future__ import annotations

import math
import random
import statistics
from typing import Dict, List, Optional, Sequence, Tuple

from ..bootstrap import CONFIDENCE, RESAMPLES, percentile_span

__all__ = []

SPEED_THRESHOLD = 0.10  # a decode ratio below 0.90 (and outside its interval) is flagged
BYTES_THRESHOLD = 0.02  # weight bytes above 1.02x base are flagged (exact, from headers)
#: interleaved rounds a speed flag needs (two rounds give at most three distinct draws)
MIN_ROUNDS = 3


def by_round(values: Sequence[float], rounds: Optional[Sequence[int]],
             per_round: Optional[int] = None) -> Dict[int, List[float]]:
    """Runs grouped by round; without labels, by ``per_round`` consecutive runs, or as one."""
    vals = [float(x) for x in values]
    if rounds is not None and len(rounds) == len(vals):
        labels = [int(r) for r in rounds]
    elif per_round:
        labels = [i // per_round for i in range(len(vals))]
    else:
        labels = [0] * len(vals)
    out: Dict[int, List[float]] = {}
    for r, x in zip(labels, vals):
        out.setdefault(r, []).append(x)
    return out


def ratio_interval(runs: Sequence[float], rounds: Optional[Sequence[int]],
                   base_runs: Sequence[float], base_rounds: Optional[Sequence[int]], *,
                   per_round: Optional[int] = None, confidence: float = CONFIDENCE,
                   resamples: int = RESAMPLES, seed: int = 0) -> Tuple[float, float]:
    """Percentile bootstrap interval of ``median(runs) / median(base_runs)``,
    resampling rounds (paired: the same rounds for both) and runs inside rounds.
    ``(nan, nan)`` when either side has fewer than 2 runs."""
    a, b = by_round(runs, rounds, per_round), by_round(base_runs, base_rounds, per_round)
    if len(runs) < 2 or len(base_runs) < 2:  # one run: nothing to resample
        return math.nan, math.nan
    common = sorted(set(a) & set(b))
    rng = random.Random(seed)
    ratios: List[float] = []
    for _ in range(resamples):
        if len(common) >= 2:
            drawn = [rng.choice(common) for _ in common]
            xa = [x for r in drawn for x in rng.choices(a[r], k=len(a[r]))]
            xb = [x for r in drawn for x in rng.choices(b[r], k=len(b[r]))]
        else:  # one round (or none in common): only the runs can be resampled
            pa = [x for r in sorted(a) for x in a[r]]
            pb = [x for r in sorted(b) for x in b[r]]
            xa, xb = rng.choices(pa, k=len(pa)), rng.choices(pb, k=len(pb))
        ratios.append(statistics.median(xa) / statistics.median(xb))
    return percentile_span(ratios, confidence)


def noise_band(base_runs: Sequence[float], base_rounds: Optional[Sequence[int]], *,
               per_round: Optional[int] = None, confidence: float = CONFIDENCE,
               resamples: int = RESAMPLES, seed: int = 1) -> Tuple[float, float]:
    """The base against itself: the band of ``median(draw1) / median(draw2)``, both
    draws resampling the base's rounds independently; a ratio inside it says nothing.
    ``(nan, nan)`` with fewer than 2 base runs."""
    b = by_round(base_runs, base_rounds, per_round)
    keys = sorted(b)
    if sum(len(x) for x in b.values()) < 2:
        return math.nan, math.nan
    rng = random.Random(seed)

    def draw() -> List[float]:
        if len(keys) >= 2:
            return [x for r in (rng.choice(keys) for _ in keys)
                    for x in rng.choices(b[r], k=len(b[r]))]
        pool = b[keys[0]]
        return rng.choices(pool, k=len(pool))

    return percentile_span([statistics.median(draw()) / statistics.median(draw())
                            for _ in range(resamples)], confidence)


def speed_verdict(ratio: float, interval: Tuple[float, float], *, rounds: int,
                  threshold: float = SPEED_THRESHOLD,
                  noise: Optional[Tuple[float, float]] = None) -> Tuple[bool, str]:
    """(flagged, words) for a decode ratio to base and its interval; fewer than
    :data:`MIN_ROUNDS` rounds, or a ratio inside the ``noise`` band, never flag."""
    lo, hi = interval
    if math.isnan(ratio):
        return False, "no interval"
    if math.isnan(lo):
        return False, f"{ratio:.2f}x; no interval from one run (repeats or rounds >= 2)"
    span = f"{ratio:.2f}x, {CONFIDENCE:.0%} interval {lo:.2f}-{hi:.2f}"
    if hi < 1 and ratio < 1 - threshold:
        if rounds < MIN_ROUNDS:
            return False, (f"too few rounds to call it slower ({rounds} < {MIN_ROUNDS}: "
                           f"{span})")
        if noise is not None and not math.isnan(noise[0]) and ratio >= noise[0]:
            return False, (f"same speed within noise ({span}; base against itself "
                           f"{noise[0]:.2f}-{noise[1]:.2f})")
        return True, f"slower: {span}"
    if lo > 1 and ratio > 1 + threshold:
        return False, f"faster: {span}"
    if lo <= 1 <= hi:
        return False, f"same speed within noise ({span})"
    return False, f"within {threshold:.0%} of base ({span})"


def bytes_verdict(ratio: float, f32_bytes: int, *,
                  threshold: float = BYTES_THRESHOLD) -> Tuple[bool, str]:
    """(flagged, words) for a weight-bytes ratio to base: exact, so no interval."""
    if math.isnan(ratio) or ratio <= 1 + threshold:
        return False, ""
    return True, f"{ratio:.2f}x weight bytes" + (f" (f32 {human_bytes(f32_bytes)})"
                                                 if f32_bytes else "")


def human_bytes(n: float) -> str:
    """``5.77 MB``, ``12.3 GB``: three significant digits, decimal units."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


def bytes_explain(ratio: float, interval: Tuple[float, float], bytes_ratio: float, *,
                  noise: Optional[Tuple[float, float]] = None) -> Tuple[float, str]:
    """(predicted ratio, words): a decode step reads every weight once, so the bytes
    predict ``1 / bytes_ratio``; "bytes explain it" when that lies inside the interval
    widened by ``noise``, else "not the bytes" (a slower path below it; launches or
    compute above it). ``""`` without an interval."""
    if math.isnan(bytes_ratio) or bytes_ratio <= 0:
        return math.nan, ""
    pred = 1 / bytes_ratio
    lo, hi = interval
    if math.isnan(ratio) or math.isnan(lo):
        return pred, ""
    n_lo, n_hi = noise if noise is not None and not math.isnan(noise[0]) else (1.0, 1.0)
    if lo * min(n_lo, 1.0) <= pred <= hi * max(n_hi, 1.0):
        return pred, f"bytes explain it (they predict {pred:.2f}x)"
    if ratio < pred:
        return pred, f"not the bytes: a slower path (bytes predict {pred:.2f}x)"
    return pred, (f"not the bytes: bound by launches or compute, not weight reads "
                  f"(bytes predict {pred:.2f}x)")
