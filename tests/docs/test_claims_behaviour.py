"""The behaviour numbers BENCHMARKS.md and docs/check.md state (fused vs unfused on the
embedded model) are the committed JSONs' numbers, and those runs say what issue 15 asks."""
from __future__ import annotations

import json
import re
from pathlib import Path

from helpers import md_table

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def test_fused_vs_unfused_table_is_the_json() -> None:
    runs = json.loads((RESULTS / "kl_fused_vs_unfused_cpu.json").read_text())
    text = (ROOT / "BENCHMARKS.md").read_text()
    text = text[text.index("Fused vs unfused on the embedded model"):]
    table = md_table(text, "Fused vs unfused", "| test vs unfused adapter |")
    for label, key in (("lorakit fuse (bf16, nearest)", "fused"), ("base (no adapter)", "base")):
        r = runs[key]["result"]
        cells = table[label]
        assert int(cells[1]) == r["tokens"]
        for cell, k in zip(cells[2:5], ("mean_kl", "p999_kl", "max_kl")):
            assert float(cell) == float(f"{r[k]:.3e}"), (label, k)
        assert cells[5] == f"{100 * r['top1_agreement']:.2f}%"
        assert cells[6] == f"{100 * r['top1_agreement_strict']:.2f}%"
    fused, base = runs["fused"]["result"], runs["base"]["result"]
    # issue 15: >= 1000x below the base's KL, top-1 agreement >= 99.5%
    assert fused["mean_kl"] * 1000 <= base["mean_kl"]
    assert fused["top1_agreement"] >= 0.995
    ratio = re.search(r"mean KL is (\d+)x smaller", text).group(1)
    assert int(ratio) == int(base["mean_kl"] / fused["mean_kl"])
    ties, flips = re.search(r"(\d+) of its (\d+) flips are such ties", text).groups()
    assert int(flips) == round(fused["tokens"] * (1 - fused["top1_agreement_strict"]))
    assert int(ties) == round(fused["tokens"] * (fused["top1_agreement"]
                                                 - fused["top1_agreement_strict"]))


def test_check_kl_line_is_the_json() -> None:
    d = json.loads((RESULTS / "check_kl.json").read_text())
    line = d["check"]["summary"]["fused vs unfused"]
    assert f"`fused vs unfused: {line}`" in (ROOT / "docs" / "check.md").read_text()


KL_SPEED = ("kl_h200_qwen3-1.7b", "kl_h200_qwen3-1.7b_topk0", "kl_h200_tiny", "kl_cpu16_tiny",
            "kl_cpu_tiny")


def test_kl_speed_table_is_the_json() -> None:
    """Each row of the KL-speed table is its run (in the order above): tokens x vocab, the
    two medians, their ratio, and the command's flags."""
    text = (ROOT / "BENCHMARKS.md").read_text()
    rows = list(md_table(text, "## Behaviour (KL)", "| where |").values())
    assert len(rows) == len(KL_SPEED)
    for cells, name in zip(rows, KL_SPEED):
        d = json.loads((RESULTS / f"{name}.json").read_text())
        assert cells[2:6] == [f"{d['tokens_scored']} x {d['vocab']}",
                              f"{d['median_plain_s']:#.4g} s", f"{d['median_kl_s']:#.4g} s",
                              f"{d['overhead']:.3g}x"], name
        flags = cells[6].strip("`").replace("...", "").split()
        assert all(f in d["command"].split() for f in flags if f not in ("python",)), name
