"""BENCHMARKS.md's adapter algebra table and sentence are benchmarks/results/algebra.json
(``PYTHONPATH=$PWD .venv/bin/python benchmarks/algebra.py --json
benchmarks/results/algebra.json``)."""
from __future__ import annotations

import json
from pathlib import Path

from helpers import md_table

ROOT = Path(__file__).resolve().parents[2]
HEADING = "## Adapter algebra: combining adapters exactly, and PEFT parity"


def test_algebra_table_is_the_json() -> None:
    d = json.loads((ROOT / "benchmarks" / "results" / "algebra.json").read_text())
    text = (ROOT / "BENCHMARKS.md").read_text()
    rows = list(md_table(text, HEADING, "| fuse |").values())
    fuses = d["combination"]["fuses"]
    assert len(rows) == len(fuses)
    for row, f in zip(rows, fuses):
        assert row[1:] == [f"{f['over_half_ulp']:,}", f"{f['max_err_ulp']:.3g}"]
    assert fuses[0]["over_half_ulp"] == 0 and fuses[0]["max_err_ulp"] <= 0.5
    assert f"{fuses[0]['elements']:,} adapted elements" in " ".join(text.split())
    x = d["linear_cross_terms"]
    assert (f"median {100 * x['median_rel_frobenius']:.0f}% (max "
            f"{100 * x['max_rel_frobenius']:.0f}%)") in " ".join(text.split())
    peft = {m["method"]: m["differ"] for m in d["like_peft"]}
    assert all(peft[m] == 0 for m in ("linear", "cat", "ties", "magnitude_prune"))
    assert f"`svd` on {peft['svd']} (1 ulp each)" in " ".join(text.split())
