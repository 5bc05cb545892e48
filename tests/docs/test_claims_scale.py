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


EXTRACT_JSON = ROOT / "benchmarks" / "results" / "extract.json"
EXTRACT_HEADING = "## Extract: a LoRA back out of a fused checkpoint"
EXTRACT_CASES = {"tiny-qwen3": "tiny-qwen3", "qwen3-1.7b": "Qwen3-1.7B shape"}


def test_extract_tables_are_the_json() -> None:
    """The extract section's three tables (bound, reproduction, beside mergekit) are
    benchmarks/results/extract.json, and the 1.7B shape meets the issue's bars:
    >= 99.9% reproduced, within 2x of a plain SVD's time."""
    d = json.loads(EXTRACT_JSON.read_text())
    text = (ROOT / "BENCHMARKS.md").read_text()
    bound = md_table(text, EXTRACT_HEADING, "| checkpoint | modules |")
    refuse = md_table(text, EXTRACT_HEADING, "| checkpoint | adapted elements |")
    plain = md_table(text, EXTRACT_HEADING, "| checkpoint | plain SVD time")
    for key, label in EXTRACT_CASES.items():
        c = d["cases"][key]
        x, r, p = c["extract"], c["refuse"], c["plain_svd"]
        b = next(v for k, v in bound.items() if k.startswith(label))
        assert b[1] == str(c["modules"])
        assert b[2] == f"{c['recovery']['max_err_over_e']:.3f} ({c['recovery']['median_err_over_e']:.3f})"
        assert b[5] == f"{x['extract_s']:.1f} s / {x['user_s'] + x['system_s']:.1f} s"
        assert b[7] == f"{x['peak_rss_bytes'] / 2 ** 20:,.0f} MiB"
        f = refuse[label]
        assert f[1] == f"{r['adapted_elements']:,}" and f[3].startswith(f"{r['differ']:,} (")
        share = 100 * (1 - r["differ"] / r["adapted_elements"])
        assert f[4] == f"{share:.3f}%" and f[5] == f"{r['differ_1ulp']:,}"
        assert f[6] == f"{r['differ_gt1ulp']:,}" and r["differ"] == r["differ_reported"]
        q = plain[label]
        assert q[1] == f"{p['svd_s']:.2f} s" if p["svd_s"] < 10 else q[1] == f"{p['svd_s']:.1f} s"
        assert q[3] == f"{x['extract_s'] / p['svd_s']:.2f}x"
        assert q[5] == f"{p['differ']:,} / {r['differ']:,}"
    big = d["cases"]["qwen3-1.7b"]
    assert 1 - big["refuse"]["differ"] / big["refuse"]["adapted_elements"] >= 0.999
    assert big["extract"]["extract_s"] <= 2 * big["plain_svd"]["svd_s"]
    assert big["recovery"]["all_within_bound"]


BAND_JSON = ROOT / "benchmarks" / "results" / "refit_band.json"
SETTINGS_JSON = ROOT / "benchmarks" / "results" / "refit_settings.json"


def refine_large_iters() -> int:
    from lorakit.algebra import refine

    return refine.LARGE_ITERS


def test_refit_band_table_and_prose_are_the_json() -> None:
    """"A narrower active band" (benchmarks/refit_band.py) and the figures the scale
    section quotes from it are benchmarks/results/refit_band.json."""
    d = json.loads(BAND_JSON.read_text())
    text = (ROOT / "BENCHMARKS.md").read_text()
    rows = md_table(text, "**A narrower active band.**", "| module |")
    assert set(rows) == {r["module"] for r in d["rows"]} | {"all five"}
    for r in d["rows"]:
        n, c, cells = r["narrow"], r["count"], rows[r["module"]]
        assert cells[2] == f"{100 * n['active_share']:.1f}% / {100 * c['active_share']:.1f}%"
        assert cells[3] == f"{n['cpu_s']:.2f} / {c['cpu_s']:.2f}"
        assert cells[4] == f"{n['outside_after']:,} / {c['outside_after']:,}"
        assert cells[5] == f"{n['outside_before']:,}" == f"{c['outside_before']:,}"
    t = d["total"]
    assert rows["all five"][3] == f"{t['narrow']['cpu_s']:.2f} / {t['count']['cpu_s']:.2f}"
    g = next(r for r in d["rows"] if r["module"].endswith("27.mlp.gate_proj"))
    prose = " ".join(text[text.index(HEADING):text.index("### The test suite")].split())
    per = g["narrow"]["pass_s_per_element"]
    assert f"held {100 * g['narrow']['active_share']:.1f}% of the elements" in prose
    assert f"{100 * g['count']['active_share']:.1f}% with the earlier 0.125-ulp band" in prose
    assert f"{per['normal_equations'] * 1e9:.1f} ns an element" in prose
    assert f"their step checks, {per['loss'] * 1e9:.1f} ns" in prose
    assert f"left {g['narrow']['outside_after']:,} of that module's" in prose
    s = json.loads(SETTINGS_JSON.read_text())
    now = next(r for r in s["settings"] if r["module"] == g["module"])["default"]
    assert f"leaves {now['outside_after']:,} after {refine_large_iters()}" in prose
    t = s["total_1_7b"]
    assert f"{t['default']['cpu_s'] / t['earlier']['cpu_s']:.2f}x the CPU of the five" in prose




def _frac(g) -> str:
    return f"1/{round(1 / float(g))}"


def test_refit_gap_and_cap_tables_are_the_json() -> None:
    """"The box's gap and the iteration cap" (benchmarks/refit_settings.py) is
    benchmarks/results/refit_settings.json; the size's gap is the sweep's best or one
    power of two from it, the gap the refit uses is margin_gap's, and the defaults
    leave no more elements outside than the earlier settings on every module, in less
    CPU on the five 1.7B modules."""
    from lorakit.algebra import refine

    d = json.loads(SETTINGS_JSON.read_text())
    text = (ROOT / "BENCHMARKS.md").read_text()
    head = "**The box's gap and the iteration cap.**"
    sweep = md_table(text, head, "| matrices |")
    gaps = list(d["sweep"][0]["outside"])
    assert set(sweep) == {r["matrices"] for r in d["sweep"]}
    for r in d["sweep"]:
        c = sweep[r["matrices"]]
        assert c[2] == f"{r['elements']:,}"
        assert c[3:3 + len(gaps)] == [f"{r['outside'][g]:,}" for g in gaps]
        assert c[3 + len(gaps):] == [_frac(r["default_gap"]), _frac(r["best_gap"])]
        assert r["best_gap"] == float(min(r["outside"], key=r["outside"].get))
        assert r["default_gap"] == refine.margin_gap(r["shapes"][0], 8)
        assert 0.5 <= r["default_gap"] / r["best_gap"] <= 2
    rows = md_table(text, head, "| module | elements |")
    for r in d["settings"]:
        e, n, c = r["earlier"], r["default"], rows[r["module"]]
        assert c[2] == f"{e['cpu_s']:.2f} / {n['cpu_s']:.2f}"
        assert c[3] == f"{e['outside_after']:,} / {n['outside_after']:,}"
        assert n["outside_after"] <= e["outside_after"]
    t = d["total_1_7b"]
    assert rows["the five 1.7B modules"][2] == f"{t['earlier']['cpu_s']:.2f} / {t['default']['cpu_s']:.2f}"
    assert t["default"]["cpu_s"] < t["earlier"]["cpu_s"]
    prose = " ".join(text[text.index(head):text.index("**Beside mergekit.**")].split())
    assert f"take {t['default']['cpu_s'] / t['earlier']['cpu_s']:.2f}x the earlier" in prose
    assert f"leave {t['default']['outside_after'] / t['earlier']['outside_after']:.2f}x as many" in prose
    assert d["earlier"] == {"margin": refine.MARGIN, "max_iters": refine.MAX_ITERS}
    assert d["defaults"] == {"max_iters": refine.MAX_ITERS, "large_iters": refine.LARGE_ITERS,
                             "large": refine.LARGE}
    # the ramp over all the iterations (the default where fewer than RAMP are allowed)
    # leaves fewer outside than one ending early, and the prose says so
    for r in d["ramp"]:
        assert r["max_iters"] == refine.LARGE_ITERS == r["to_last"]["ramp"] < refine.RAMP
        assert r["to_last"]["outside_after"] < r["early"]["outside_after"]
    early = d["ramp"][0]["max_iters"] - d["ramp"][0]["early"]["ramp"]
    assert (f"over all {refine.LARGE_ITERS} " + " and ".join(f"{r['to_last']['outside_after']:,}" for r in d["ramp"])
            ) in prose and f"ends {early} iterations early" in prose


START_JSON = ROOT / "benchmarks" / "results" / "svd_start.json"


def test_svd_start_table_is_the_json_and_the_default_is_the_fastest_here() -> None:
    """"The SVD start's products" (benchmarks/svd_start.py) is
    benchmarks/results/svd_start.json: numpy float64, the extract's products, is the
    fastest variant on the machine of the run, the float32 starts' residuals match its
    to 1e-9 of the noise and their refits end within 2% of its count, as the prose says."""
    d = json.loads(START_JSON.read_text())
    text = (ROOT / "BENCHMARKS.md").read_text()
    head = "**The SVD start's products: numpy or MLX.**"
    rows = md_table(text, head, "| products |")
    assert set(rows) == {r["variant"] for r in d["rows"]}
    for r in d["rows"]:
        c = rows[r["variant"]]
        assert c[1:] == [r["device"], f"{r['median_s']:.3f}", f"{r['time_vs_numpy_float64']:.2f}x",
                         f"{r['outside_svd']:,}", f"{r['residual_over_noise']:.4f}",
                         f"{r['outside_after']:,}"]
    by = {r["variant"]: r for r in d["rows"]}
    ref = by["numpy float64"]
    assert min(d["rows"], key=lambda r: r["median_s"]) is ref
    assert by["mlx float64"]["outside_after"] == ref["outside_after"]  # the same start
    for name in ("numpy float32", "mlx float32"):
        assert abs(by[name]["residual_over_noise"] - ref["residual_over_noise"]) < 1e-9
        assert abs(by[name]["outside_after"] / ref["outside_after"] - 1) < 0.02
    assert f"over {d['repeats']} rounds" in " ".join(text.split())
