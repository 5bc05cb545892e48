"""Decode timings side by side: a live run here beside a committed benchmark run
(``benchmarks/results/*.json``), both judged by the same verdict code."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Dict, List, Union

from ..errors import LorakitError
from ..report import Report
from .table import VARIANTS, DecodeTiming, device_where, verdict_words

__all__ = ["load_benchmark", "load_seed", "side_by_side"]

# the committed benchmark results of this source tree
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _path(path: Union[str, Path]) -> Path:
    p = Path(path)
    if not p.exists() and p.parent == Path(".") and (RESULTS / p).exists():
        p = RESULTS / p
    if not p.is_file():
        raise LorakitError("no such benchmark result", file=str(p),
                           expected=f"a JSON file, or a name under {RESULTS}")
    return p


def load_benchmark(path: Union[str, Path]) -> DecodeTiming:
    """A committed result (a bare name: from :data:`RESULTS`), judged by this verdict code."""
    return DecodeTiming.from_json(_path(path).read_text())


def load_seed(path: Union[str, Path] = "seed-report.json") -> Report:
    """The seed report's table (a user's run, not measured here) from its committed JSON."""
    d = json.loads(_path(path).read_text())
    rows = [{"variant": n, "decode tok/s": v.get("decode_tps", "-".join(
                 str(x) for x in v.get("decode_tps_range", [])) or None),
             "peak GB": v.get("peak_gb")} for n, v in d["variants"].items()]
    return Report(title=f"seed report: {d['model']} on {d['machine']}", rows=rows,
                  summary={"what": d["what"], "source": d["source"],
                           "command": d["command"]},
                  columns=["variant", "decode tok/s", "peak GB"])


def side_by_side(runs: Dict[str, DecodeTiming]) -> Report:
    """One row per variant, per run its ratios, the ratio its weight bytes predict, its
    verdict and why ("bytes explain it" or "not the bytes"); flagged if flagged in any run."""
    names = [n for n in VARIANTS if any(t.ran(n) for t in runs.values())]
    rows: List[Dict[str, object]] = []
    flagged: List[int] = []
    columns = ["variant"]
    for label in runs:
        columns += [f"{label} {c}" for c in ("decode x base", "interval", "weights x base",
                                             "bytes predict", "verdict", "why")]
    for i, n in enumerate(names):
        row: Dict[str, object] = {"variant": n}
        hit = False
        for label, t in runs.items():
            if not t.ran(n):
                continue
            d = t.verdicts().get(n, {})
            lo, hi = t.interval(n)
            row[f"{label} decode x base"] = round(t.ratio(n, "decode"), 2)
            row[f"{label} interval"] = "" if math.isnan(lo) else f"{lo:.2f}-{hi:.2f}"
            row[f"{label} weights x base"] = round(d.get("bytes_ratio", 1.0), 2)
            row[f"{label} bytes predict"] = round(d.get("bytes_predicted", 1.0), 2)
            row[f"{label} verdict"] = verdict_words(d)
            row[f"{label} why"] = d.get("why", "")
            hit = hit or bool(d.get("speed_flag") or d.get("bytes_flag"))
        rows.append(row)
        if hit:
            flagged.append(i)
    summary = {label: f"{Path(t.settings.get('model', '?')).name} on "
               f"{device_where(t.variants) or '?'}, {t.rounds_run()} round(s)"
               + (f"; command: {t.settings['command']}" if t.settings.get("command") else "")
               for label, t in runs.items()}
    return Report(title="decode timing side by side: " + " | ".join(runs), rows=rows,
                  summary=summary, flagged=flagged, columns=columns)
