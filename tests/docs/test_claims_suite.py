"""The test suite's own time (BENCHMARKS "The test suite") is its committed JSON
(benchmarks/results/suite.json, from benchmarks/suite.py; issue 25's targets)."""
from __future__ import annotations

import json
from pathlib import Path

from helpers import md_table

ROOT = Path(__file__).resolve().parents[2]
JSON = ROOT / "benchmarks" / "results" / "suite.json"
HEADING = "### The test suite"
#: the issue's bars: the fast tier <= 45 s, the whole suite <= 8 minutes
LIMITS = {"bash tools/test-fast.sh": 45.0, "bash tools/test.sh": 480.0,
          "CI=true bash .ci/run (fresh clone)": 480.0}


def test_suite_table_is_the_json() -> None:
    d = json.loads(JSON.read_text())
    rows = md_table((ROOT / "BENCHMARKS.md").read_text(), HEADING, "| suite |")
    assert set(rows) == {r["suite"] for r in d["rows"]} == set(LIMITS)
    for r in d["rows"]:
        c = rows[r["suite"]]
        assert c[1] == f"{r['median_wall_s']:.1f}"
        assert c[2] == ", ".join(f"{x['wall_s']:.1f}" for x in r["runs"])
        assert c[3] == ", ".join(f"{x['pytest_s']:.1f}" for x in r["runs"])
        assert c[4:6] == [str(r["passed"]), str(r["skipped"])]
        assert c[7] == ("met" if r["met"] else "not met")


def test_suite_json_is_consistent() -> None:
    """Each median is its runs' median, ``met`` follows from it, and every run passed
    with nothing failing; the fresh clone ran the same tests as the whole suite."""
    d = json.loads(JSON.read_text())
    by = {r["suite"]: r for r in d["rows"]}
    for name, r in by.items():
        walls = sorted(x["wall_s"] for x in r["runs"])
        mid = len(walls) // 2
        median = walls[mid] if len(walls) % 2 else (walls[mid - 1] + walls[mid]) / 2
        assert abs(r["median_wall_s"] - median) < 1e-9
        assert r["met"] == (median <= LIMITS[name])
        assert all(x.get("failed", 0) == 0 and x["passed"] > 0 for x in r["runs"])
    full, ci = by["bash tools/test.sh"], by["CI=true bash .ci/run (fresh clone)"]
    assert full["passed"] == ci["passed"] and full["skipped"] == ci["skipped"]
    assert by["bash tools/test-fast.sh"]["passed"] < full["passed"]
