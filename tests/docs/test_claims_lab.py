"""BENCHMARKS.md's "The adapter lab" tables are their committed JSON
(benchmarks/results/lab.json, from benchmarks/lab.py; issue 42)."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from helpers import md_table

ROOT = Path(__file__).resolve().parents[2]
HEADING = "## The adapter lab"


def test_lab_tables_are_the_json() -> None:
    d = json.loads((ROOT / "benchmarks" / "results" / "lab.json").read_text())
    text = (ROOT / "BENCHMARKS.md").read_text()
    cost = md_table(text, HEADING, "| verb |")
    assert set(cost) == set(d["cost"])
    for k, v in d["cost"].items():
        assert cost[k][1:] == [f"{v['median_s']:.2f} s", ", ".join(f"{x:.2f}" for x in v["runs_s"]),
                               str(v["forward_passes"]), f"{v['in_forward_passes']:.1f}"]
    kept = md_table(text, HEADING, "| test |")
    assert set(kept) == set(d["effect_kept"])
    for k, v in d["effect_kept"].items():
        assert kept[k][1] == f"{v['effect_kept']:.6f}"
        assert kept[k][2] == f"{v['interval'][0]:.6f}-{v['interval'][1]:.6f}"
    # the claims the docs make of these numbers
    assert d["effect_kept"]["right fuse"]["effect_kept"] >= 0.99
    assert all(d["effect_kept"][k]["interval"][1] < 0.99 for k in ("half the scale",
                                                                   "layer 0 dropped"))
    assert d["cost"]["layer_effects by layer"]["forward_passes"] == 2 * 4 + 2


def test_lab_widget_redraw_is_the_json() -> None:
    """AdapterLab's slider-to-redraw line (benchmarks/lab_widget.py, from the browser test)."""
    d = json.loads((ROOT / "benchmarks" / "results" / "lab_widget.json").read_text())
    text = (ROOT / "BENCHMARKS.md").read_text()
    section = text[text.index(HEADING):]
    section = section[:section.index("\n## ", 1)]
    loads = [x for r in d["runs"] for x in (r["load_before"], r["load_after"])]
    assert (f"median of\n10 moves: {d['median_s']:.2f} s at load {min(loads):.1f}-"
            f"{max(loads):.1f} ({len(d['runs'])} runs).") in section
    assert f"`{d['command']}`" in section
    assert all(len(r["moves_s"]) == 10 and r["median_s"] == statistics.median(r["moves_s"])
               for r in d["runs"])
    assert d["median_s"] <= 1.0  # the lab's promise: every move redraws within a second
