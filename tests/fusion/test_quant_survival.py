"""Per-code survival of a re-quantized fuse, shown per tensor and overall (issue 13).

The numbers in FuseResult's text, HTML, the CLI fuse summary and the fuse panel are
recomputed here from the files: codes unpacked with plain shifts (not
``unpack_codes``), survival from the merge check's own pass (``inspect/check``).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlx.core")

import lorakit
from lorakit.cli.main import main

DATA = Path(__file__).resolve().parents[2] / "data"
BASE = DATA / "tiny-qwen3-4bit"


def _codes(words: np.ndarray, bits: int = 4) -> np.ndarray:
    """4-bit codes of mlx's packed words, by shifts (eight per uint32, LSB first)."""
    w = words.astype(np.uint32).reshape(words.shape[0], -1)
    return np.stack([(w >> (bits * k)) & 0xF for k in range(32 // bits)], -1).reshape(
        w.shape[0], -1)


def _changed(out: Path):
    ck_b, ck_f = lorakit.open(BASE, checkpoint=True), lorakit.open(out, checkpoint=True)
    per, tot, n = {}, 0, 0
    for name, meta in ck_f.tensors.items():
        if meta.dtype != "U32" or not name.endswith(".weight"):
            continue
        ne = _codes(ck_b.read(name)) != _codes(ck_f.read(name))
        if ne.any():
            per[name] = ne.mean()
            tot, n = tot + int(ne.sum()), n + ne.size
    return per, tot / n


@pytest.fixture(scope="module", params=["lora-4bit", "lora-4bit-weak"])
def fused(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("surv") / "out"
    res = lorakit.fuse(BASE, DATA / "adapters" / request.param, out, progress=False)
    return request.param, out, res


def test_codes_changed_per_tensor_and_overall_match_the_files(fused):
    name, out, res = fused
    per, overall = _changed(out)
    text = str(res)
    m = re.search(r"codes changed\s+([\d.]+)% of ([\d,]+) codes", text)
    assert m and float(m.group(1)) == pytest.approx(100 * overall, abs=0.051)
    assert len(per) == 28 == len(res.requant)
    html = res._repr_html_()
    for t, frac in per.items():
        line = next(ln for ln in text.splitlines() if ln.strip().startswith(t + " "))
        shown = float(re.search(r"([\d.]+)% of", line).group(1))
        assert shown == pytest.approx(100 * frac, abs=0.051), t
        assert f"<td>{t}</td><td>{shown:.1f}% of" in html
    # the weak adapter moves far fewer codes: the display is not a constant
    assert (overall < 0.5) == (name == "lora-4bit-weak")


@pytest.mark.slow  # a merge check per adapter: about 2 s
def test_delta_survived_matches_the_merge_check(fused):
    name, out, res = fused
    rep = lorakit.check(out, BASE, DATA / "adapters" / name)
    by = {r["tensor"]: r["survived"] for r in rep.rows if r.get("survived") is not None}
    for s in res.requant:
        assert s.survived == pytest.approx(by[s.tensor], rel=1e-6)
    w = np.array([s.delta_sq for s in res.requant])
    overall = float((np.array([by[s.tensor] for s in res.requant]) * w).sum() / w.sum())
    m = re.search(r"delta survived\s+([\d.]+)%", str(res))
    assert float(m.group(1)) == pytest.approx(100 * overall, abs=0.051)
    assert "delta survived" in res._repr_html_()


def test_cli_fuse_prints_survival(tmp_path, capsys):
    code = main(["fuse", "--model", str(BASE), "--adapter-path",
                 str(DATA / "adapters" / "lora-4bit"), "--save-path", str(tmp_path / "o"),
                 "--quiet"])
    out = capsys.readouterr().out
    assert code == 0
    _, overall = _changed(tmp_path / "o")
    m = re.search(r"codes changed\s+([\d.]+)%", out)
    assert float(m.group(1)) == pytest.approx(100 * overall, abs=0.051)
    assert "delta survived" in out and "re-quantized tensors:" in out
    code = main(["fuse", "--model", str(BASE), "--adapter-path",
                 str(DATA / "adapters" / "lora-4bit"), "--save-path", str(tmp_path / "o"),
                 "--quiet", "--force", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["survival"]["codes_changed"] == pytest.approx(overall)
    assert len(data["requant"]) == 28 and all(r["codes"] > 0 for r in data["requant"])


def test_float_fuse_shows_no_survival(tmp_path):
    res = lorakit.fuse(DATA / "tiny-qwen3", DATA / "adapters" / "lora", tmp_path / "o",
                       progress=False)
    assert "codes changed" not in str(res) and "survived" not in res._repr_html_()
