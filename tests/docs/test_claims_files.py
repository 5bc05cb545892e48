"""The files-check table in BENCHMARKS.md and the count in docs/check.md are the committed
JSON of benchmarks/files_check.py, and the run has no false alarm and no miss."""
from __future__ import annotations

import json
from pathlib import Path

from helpers import md_table

ROOT = Path(__file__).resolve().parents[2]
RESULT = json.loads((ROOT / "benchmarks" / "results" / "files_check.json").read_text())


def test_files_table_is_the_json() -> None:
    d, cases = RESULT, RESULT["cases"]
    rows = md_table((ROOT / "BENCHMARKS.md").read_text(),
                    "## Files check: the folder around the tensors", "| folders |")
    good = [c for c in cases if c["kind"] == "correct"]
    bad = [c for c in cases if c["kind"] == "defect"]
    assert rows["correct"][1:] == [str(len(good)), str(sum(bool(c["found"]) for c in good)),
                                   f"false alarms {d['false alarm rate']:.1%}"]
    assert rows["defective"][1:] == [str(len(bad)), str(sum(not c["miss"] for c in bad)),
                                     f"misses {d['miss rate']:.1%}"]
    assert (d["correct"], d["defects"]) == (len(good), len(bad))


def test_no_false_alarm_no_miss_on_enough_cases() -> None:
    assert RESULT["correct"] + RESULT["defects"] >= 20
    assert RESULT["false alarms"] == RESULT["misses"] == 0
    assert all(c["found"] == [] and c["exit code"] in (0, 1, 3) for c in RESULT["cases"]
               if c["kind"] == "correct")
    assert all(c["expected"] in c["found"] and c["exit code"] == 4 for c in RESULT["cases"]
               if c["kind"] == "defect")
    check_md = (ROOT / "docs" / "check.md").read_text()
    n = RESULT["correct"] + RESULT["defects"]
    assert f"Measured on {n} folders ({RESULT['correct']} correct fuses" in check_md
