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
    ch, c = s["check"]["summary"], s["compare"]["report"]
    assert ch["verdicts"] == "ok: 112" and s["check"]["flagged"] == []
    assert f"verdicts ok on 112 of 112, largest distance {ch['largest distance']:.3f}" in text
    assert f"mean KL {c['mean_kl']:.2e}".replace("e-04", "e-4") in text
    assert f"over {c['tokens']:,} tokens, top-1 agreement {100 * c['top1_agreement']:.1f}%" in text
    assert f"{100 * c['top1_agreement_strict']:.1f}%)" in text
    assert "benchmarks/scale_gpu.py --preset qwen3-8b" in text


EXTRACT_JSON = ROOT / "benchmarks" / "results" / "extract.json"
EXTRACT_HEADING = "## Extract: a LoRA back out of a fused checkpoint"
EXTRACT_CASES = {"tiny-qwen3": "tiny-qwen3", "qwen3-1.7b": "Qwen3-1.7B shape"}


def test_extract_tables_are_the_json() -> None:
    """The extract section's tables (bound and cost, re-fuse, the SVD's variants) are
    benchmarks/results/extract.json: every module within the bound, the report's
    re-fuse count the real re-fuse's, the embedded model's behaviour close, and the
    randomized float32 SVD (the extract's) the fastest variant at the 1.7B shape."""
    d = json.loads(EXTRACT_JSON.read_text())
    text = (ROOT / "BENCHMARKS.md").read_text()
    bound = md_table(text, EXTRACT_HEADING, "| checkpoint | modules |")
    refuse = md_table(text, EXTRACT_HEADING, "| checkpoint | adapted elements |")
    svd = md_table(text, EXTRACT_HEADING, "| module | shape |")
    for key, label in EXTRACT_CASES.items():
        c = d["cases"][key]
        x, r, rec = c["extract"], c["refuse"], c["recovery"]
        b = next(v for k, v in bound.items() if k.startswith(label))
        assert b[1:7] == [str(c["modules"]),
                          f"{rec['max_err_over_e']:.3f} ({rec['median_err_over_e']:.3f})",
                          f"{rec['max_err_over_noise']:.3f}",
                          x["summary"]["within rounding noise"],
                          f"{x['extract_s']:.1f} s / {x['user_s'] + x['system_s']:.1f} s",
                          f"{x['peak_rss_bytes'] / 2 ** 20:,.0f} MiB"]
        beh = x["behaviour"]
        assert b[7] == ("off" if beh is None else f"mean KL {beh['mean_kl']:.1e}, top-1 "
                        f"{100 * beh['top1_agreement']:.1f}%")
        assert rec["all_within_bound"] and r["differ"] == r["differ_reported"]
        f = refuse[label]
        share = 100 * (1 - r["differ"] / r["adapted_elements"])
        assert f[1:] == [f"{r['adapted_elements']:,}", f"{r['differ']:,}", f"{share:.2f}%",
                         f"{r['differ_1ulp']:,}", f"{r['differ_gt1ulp']:,}",
                         "bit-identical" if r["other_tensors_identical"] else "differ"]
    assert d["cases"]["tiny-qwen3"]["extract"]["behaviour"]["mean_kl"] < 1e-3
    variants = d["cases"]["qwen3-1.7b"]["svd_variants"]
    assert set(svd) == set(variants)
    for name, v in variants.items():
        t = v["median_s"]
        assert svd[name][1:] == [" x ".join(map(str, v["shape"]))] + [
            f"{t[k]:.3f}" if k in t else "" for k in
            ("exact float64", "randomized float64", "randomized float32")]
        assert min(t, key=t.get) == "randomized float32"
