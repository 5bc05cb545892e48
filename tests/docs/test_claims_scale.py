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


GPU_JSON = ROOT / "benchmarks" / "results" / "scale_gpu_qwen3-8b.json"
GPU_HEADING = "### The Qwen3-8B shape on an NVIDIA H100 (MLX CUDA)"
GPU_STEPS = {"cp -r": "cp", "lorakit fuse": "fuse", "lorakit check": "check",
             "lorakit extract --rank 8 --threads 16": "extract",
             "lorakit compare-outputs --tokens 1024": "compare"}


def _gpu_section() -> str:
    text = (ROOT / "BENCHMARKS.md").read_text()
    start = text.index(GPU_HEADING)
    return text[start:text.index("\n## ", start)]


def test_gpu_table_is_the_json() -> None:
    d = json.loads(GPU_JSON.read_text())
    s = d["steps"]
    rows = md_table(_gpu_section(), GPU_HEADING, "| step |")
    assert set(rows) == set(GPU_STEPS)
    ratios = {"fuse": f"{s['fuse']['wall_s'] / s['cp']['wall_s']:.2f}x cp -r",
              "check": f"{s['check']['wall_s'] / s['fuse']['wall_s']:.2f}x lorakit fuse"}
    for label, key in GPU_STEPS.items():
        v, c = s[key], rows[label]
        assert v["status"] == 0, label
        assert c[1:5] == [f"{v['wall_s']:.1f}", f"{v['cpu_s']:.1f}",
                          f"{v['peak_rss_gb']:.2f}", ratios.get(key, "")], label


def test_gpu_prose_is_the_json() -> None:
    d = json.loads(GPU_JSON.read_text())
    s, text = d["steps"], " ".join(_gpu_section().split())
    ch, x, c = s["check"]["summary"], s["extract"], s["compare"]["report"]
    assert ch["verdicts"] == "ok: 112" and s["check"]["flagged"] == []
    assert f"verdicts ok on 112 of 112, largest distance {ch['largest distance']:.3f}" in text
    assert x["within"] == x["modules"] == 112
    adapted = int(x["summary"]["re-fuse differs"].split(" of ")[1].split()[0].replace(",", ""))
    assert f"differs on {x['outside_svd']:,} of {adapted:,} adapted" in text
    assert f"saved refitted factors on {x['outside']:,}" in text
    share = 100 * (1 - x["outside"] / adapted)
    assert share >= 99.9 and f"({share:.3f}% reproduced" in text
    assert f"largest relative error {x['max_rel_error']:.4f}" in text
    assert f"mean KL {c['mean_kl']:.2e}".replace("e-04", "e-4") in text
    assert f"over {c['tokens']:,} tokens, top-1 agreement {100 * c['top1_agreement']:.1f}%" in text
    assert f"{100 * c['top1_agreement_strict']:.1f}%)" in text
    assert "benchmarks/scale_gpu.py --preset qwen3-8b" in text
