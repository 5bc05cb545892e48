"""The "Every verb at real scale" table in BENCHMARKS.md is its committed JSON
(benchmarks/results/scale.json, from benchmarks/scale.py; issue 25)."""
from __future__ import annotations

import json
from pathlib import Path

from helpers import md_table

ROOT = Path(__file__).resolve().parents[2]
JSON = ROOT / "benchmarks" / "results" / "scale.json"
HEADING = "## Every verb at real scale"


def _data() -> dict:
    return json.loads(JSON.read_text())


def test_scale_table_is_the_json() -> None:
    d = _data()
    rows = md_table((ROOT / "BENCHMARKS.md").read_text(), HEADING, "| verb |")
    assert set(rows) == {r["verb"] for r in d["rows"]}
    for r in d["rows"]:
        c = rows[r["verb"]]
        assert c[1] == f"{r['median_wall_s']:.1f}"
        assert c[2] == ", ".join(f"{x:.1f}" for x in r["wall_s"])
        assert c[3] == f"{r['median_cpu_s']:.1f}"
        assert c[4] == f"{r['median_rss_bytes'] / 1e9:.2f}"
        ratio = "" if r.get("ratio") is None else f"{r['ratio']:.2f}x {r['against']}"
        assert c[5] == ratio
        assert c[6] == r.get("target", "")
        assert c[7] == ("" if "met" not in r else "met" if r["met"] else "not met")


def test_scale_json_is_consistent() -> None:
    """Each ratio is the medians' quotient, ``met`` follows from it, and the mlx-lm
    rounding stayed bit-identical to mlx_lm fuse in the run."""
    d = _data()
    by = {r["verb"]: r for r in d["rows"]}
    limits = {"lorakit fuse": ("cp -r", 1.5), "lorakit fuse --rounding mlx-lm":
              ("mlx_lm fuse", 0.25), "lorakit check": ("lorakit fuse", 1.5)}
    for verb, (against, limit) in limits.items():
        r = by[verb]
        assert r["against"] == against
        assert abs(r["ratio"] - r["median_wall_s"] / by[against]["median_wall_s"]) < 1e-9
        assert r["met"] == (r["ratio"] <= limit)
    assert d["checks"]["lorakit mlx-lm vs mlx_lm fuse"]["identical"] is True
    assert len(by["lorakit check"]["wall_s"]) == d["runs"]
