"""Quantized survival counts codes, not packed words (issue 13)."""
import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from lorakit.fusion.quant import unpack_codes


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_unpacked_codes_dequantize_like_mlx(bits):
    w = mx.random.normal((4, 128), key=mx.random.key(bits))
    q, s, b = mx.quantize(w, group_size=64, bits=bits)
    codes = unpack_codes(np.array(q), bits)
    assert codes.shape == (4, 128) and codes.max() < 2 ** bits
    mine = codes.reshape(4, 2, 64) * np.array(s)[..., None] + np.array(b)[..., None]
    ref = np.array(mx.dequantize(q, s, b, group_size=64, bits=bits))
    np.testing.assert_allclose(mine.reshape(4, 128), ref, atol=1e-6)


def test_one_changed_code_counts_once_not_as_a_word():
    q, _, _ = mx.quantize(mx.random.normal((1, 64), key=mx.random.key(0)), group_size=64, bits=4)
    a = np.array(q)
    c = a.copy()
    c[0, 0] ^= np.uint32(1)  # flip one bit of the first code only
    changed = (unpack_codes(a, 4) != unpack_codes(c, 4)).mean()
    assert changed == pytest.approx(1 / 64)
    assert (a != c).mean() == pytest.approx(1 / 8)  # the old per-word count


# -- README, docs/ and notebook claims about rounding, ulps, survival and bytes ---------------
# Each number is parsed out of the text and recomputed (on the embedded data) or read from
# the committed benchmark JSON that produced it: a changed text without changed data fails.
import json  # noqa: E402
import re  # noqa: E402
from pathlib import Path  # noqa: E402

import lorakit  # noqa: E402
from lorakit import numerics as nm  # noqa: E402
from lorakit.inspect.ulp_count import CHUNK_BYTES  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data"
REL = "relative error, rms(A - B) / rms(A)"
TYP = "max ulp at typical magnitudes (|a|, |b| >= rms(A))"


def _flat(text: str) -> str:
    return " ".join(text.split())


README = _flat((ROOT / "README.md").read_text())
FUSING = _flat((ROOT / "docs/fusing.md").read_text())  # rounding orders, the embedded diff
QUANTIZED = _flat((ROOT / "docs/quantized.md").read_text())  # survival on a 4-bit base
DIFF = _flat((ROOT / "docs/diff.md").read_text())  # how diff streams


def _markdown(nb: str) -> str:
    path = next((ROOT / "notebooks").glob(f"{nb}_*.ipynb"))
    cells = json.loads(path.read_text())["cells"]
    return _flat(" ".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown"))


def _find(text: str, pattern: str) -> re.Match:
    m = re.search(pattern, text)
    assert m, f"claim not found (text changed?): {pattern}"
    return m


def _num(s: str) -> float:
    return float(s.replace(",", ""))


@pytest.fixture(scope="module")
def rounding_json():
    data = json.loads((ROOT / "benchmarks/results/rounding.json").read_text())
    by = {}
    for r in data["results"]:
        by.setdefault(r["mode"], []).append(r)
    return data, by


def test_readme_rounding_numbers_come_from_the_committed_benchmark(rounding_json):
    data, by = rounding_json
    assert _flat(data["command"]).replace("python ", "") in FUSING.replace("python ", "")
    m = _find(FUSING, r"`round-once` differs from the correctly rounded result on "
                      r"(\d+(?:\.\d+)?(?:e[+-]\d+)?) to (\d+(?:\.\d+)?(?:e[+-]\d+)?) of elements")
    ro = [r["differ_from_correct"] for r in by["round-once"]]
    assert (m.group(1), m.group(2)) == (f"{min(ro):.1e}", f"{max(ro):.1e}")
    m = _find(FUSING, r"`mlx-lm` on ([\d.]+)-([\d.]+) % of elements depending on the "
                      r"delta's size, by up to (\d+) ulps of the exact value")
    ml = by["mlx-lm"]
    fr = [r["differ_from_correct"] for r in ml]
    assert (m.group(1), m.group(2)) == (f"{100 * min(fr):.2f}", f"{100 * max(fr):.2f}")
    assert _num(m.group(3)) == round(max(r["max_ulp_error"] for r in ml))
    m = _find(FUSING, r"that is up to ([\d,]+) ulps, at values near zero")
    assert _num(m.group(1)) == max(r["vs_correct"]["max_ulp"] for r in ml)
    m = _find(FUSING, r"\(\|w\| >= its rms\) the two are at most (\d+) ulp apart, and "
                      r"rms\(difference\) / rms\(weight\) is (\d+(?:\.\d+)?(?:e[+-]\d+)?) to (\d+(?:\.\d+)?(?:e[+-]\d+)?)")
    assert _num(m.group(1)) == max(r["vs_correct"]["max_ulp_typical"] for r in ml)
    rel = [r["vs_correct"]["rel_err"] for r in ml]
    assert (m.group(2), m.group(3)) == (f"{min(rel):.1e}", f"{max(rel):.1e}")
    # "never more than 0.5 ulp off": the benchmark's nearest rows
    _find(FUSING, r"never more than 0\.5 ulp off")
    assert max(r["max_ulp_error"] for r in by["nearest"]) <= 0.5
    assert all(r["differ_from_correct"] == 0 for r in by["nearest"])


@pytest.fixture(scope="module")
def embedded_fuses(tmp_path_factory):
    root = tmp_path_factory.mktemp("claims")
    out = {r: lorakit.fuse(DATA / "tiny-qwen3", DATA / "adapters" / "lora", root / r,
                           rounding=r, progress=False).output for r in ("nearest", "mlx-lm")}
    return out


def test_readme_embedded_diff_numbers_are_measured(embedded_fuses):
    rep = lorakit.diff(embedded_fuses["nearest"], embedded_fuses["mlx-lm"], progress=False)
    s = rep.summary
    m = _find(FUSING, r"finds ([\d.]+) % of elements differing and a max of ([\d,]+) ulps "
                      r"\(an element that is zero in one fuse\), yet at most (\d+) ulps at "
                      r"typical magnitudes and a relative error of (\d+(?:\.\d+)?(?:e[+-]\d+)?)\.")
    assert m.group(1) == f"{100 * s['fraction differing']:.1f}"
    assert _num(m.group(2)) == s["max ulp"]
    assert _num(m.group(3)) == s[TYP]
    assert m.group(4) == f"{s[REL]:.1e}"
    # the max sits at an element that is zero on one side (binade None holds it)
    top = max(rep.diffs, key=lambda d: d.max_ulp or 0)
    from lorakit.inspect.ulp_count import binades

    ta = lorakit.open(embedded_fuses["nearest"]).read(top.name).view(np.uint16)
    tb = lorakit.open(embedded_fuses["mlx-lm"]).read(top.name).view(np.uint16)
    assert any(e is None and mx == s["max ulp"] for e, _, mx in binades(ta, tb, "bf16"))
    # notebook 02 names that element's value
    nb = _markdown("02")
    m = _find(nb, r"an element that is 0 in one fuse and (-?[\d.]+) in the other is "
                  r"([\d,]+) bfloat16 steps apart")
    a = lorakit.open(embedded_fuses["nearest"]).read(top.name).view(np.uint16).ravel()
    b = lorakit.open(embedded_fuses["mlx-lm"]).read(top.name).view(np.uint16).ravel()
    d = nm.ulp_distance(a, b, "bf16")
    i = int(np.argmax(d))
    vals = nm.to_float64(np.array([a[i], b[i]], np.uint16), "bf16")
    assert 0.0 in vals and _num(m.group(2)) == d[i] == s["max ulp"]
    assert f"{vals[vals != 0][0]:.5f}" == m.group(1)


def test_readme_survival_numbers_are_measured(tmp_path):
    res = lorakit.fuse(DATA / "tiny-qwen3-4bit", DATA / "adapters" / "lora-4bit",
                       tmp_path / "q", progress=False)
    from lorakit.fusion.quant import survival_overall

    o = survival_overall(res.requant)
    m = _find(QUANTIZED, r"on the embedded `lora-4bit` adapter .*? ([\d.]+) % of codes changed "
                      r"and ([\d.]+) % of the delta survived")
    assert (m.group(1), m.group(2)) == (f"{100 * o['codes_changed']:.1f}",
                                        f"{100 * o['survived']:.1f}")


def test_twice_the_bytes_and_bytes_per_number(tmp_path):
    _find(README, r"twice the bytes")
    out = lorakit.fuse(DATA / "tiny-qwen3", DATA / "adapters" / "lora", tmp_path / "p",
                       dtype="promote", progress=False)
    base, fused = lorakit.open(DATA / "tiny-qwen3"), lorakit.open(out.output)
    adapted = [n for n in out.fused_names]
    assert adapted and all(fused.tensors[n].nbytes == 2 * base.tensors[n].nbytes
                           for n in adapted)
    nb1 = _markdown("01")
    m = _find(nb1, r"`W` in bfloat16 \((\d) bytes per number\)\. .*? float32 \((\d) bytes\)")
    assert int(m.group(1)) == base.tensors[adapted[0]].nbytes // np.prod(
        base.tensors[adapted[0]].shape) == nm.float_format("bf16").itemsize
    ad = lorakit.open(DATA / "adapters" / "lora")
    assert {ad.tensors[n].dtype for n in ad.tensors} == {"F32"}
    assert int(m.group(2)) == nm.float_format("f32").itemsize


def test_notebook_ulp_and_quantization_claims():
    nb2 = _markdown("02")
    m = _find(nb2, r"For bfloat16 near ([\d.]+) it is 2\^(-\d+), about (\d+\.\d+)")
    u = float(nm.ulp(np.array([float(m.group(1))]), "bf16")[0])
    assert u == 2.0 ** int(m.group(2)) and f"{u:.2g}" == f"{float(m.group(3)):.2g}"
    nb6 = _markdown("06")
    m = _find(nb6, r"a bfloat16 scale and bias per group of (\d+) values")
    cfg = json.loads((DATA / "tiny-qwen3-4bit" / "config.json").read_text())
    assert int(m.group(1)) == cfg["quantization"]["group_size"]
    from lorakit.fusion.quant import dequantize_raw

    ck = lorakit.open(DATA / "tiny-qwen3-4bit", checkpoint=True)
    ratios, stds = [], []
    for n in ck.tensors:
        if n.endswith(".scales"):
            w = nm.to_float64(dequantize_raw(ck, n[: -len(".scales")], None), "bf16")
            stds.append(w.std())
            ratios.append(np.median(np.abs(nm.to_float64(ck.read(n), "bf16"))) / w.std())
    m = _find(nb6, r"about ([\d.]+) of the weights' spread \(the median group's step")
    assert m.group(1) == f"{np.median(ratios):.2f}"
    m = _find(nb6, r"standard deviation ([\d.]+) per element \(about (\d+)% of the weights'")
    assert m.group(2) == f"{100 * float(m.group(1)) / np.median(stds):.0f}"


def test_diff_streams_in_1_mb_pieces():
    m = _find(DIFF, r"streams both in (\d+) MB pieces")
    assert CHUNK_BYTES == int(m.group(1)) << 20


def test_benchmarks_scale_cost_table_matches_its_json():
    data = json.loads((ROOT / "benchmarks/results/ulp_scale_speed.json").read_text())
    text = _flat((ROOT / "BENCHMARKS.md").read_text())
    assert _flat(data["command"]).replace("python ", "") in text.replace("python ", "")
    b = data["seconds_min"]
    for case, ratio in (("6 of 8 tensors differ", data["ratio_differing"]),
                        ("identical", data["ratio_identical"])):
        key = "differing" if case != "identical" else "identical"
        m = _find(text, rf"\| {case} \| ([\d.]+) \| ([\d.]+) \| ([\d.]+)x \|")
        assert m.group(1) == f"{1e3 * b[f'{key}, on']:.1f}"
        assert m.group(2) == f"{1e3 * b[f'{key}, off']:.1f}"
        assert m.group(3) == f"{ratio:.2f}"
    m = _find(text, r"of 2048 x 4096 \((\d+) MiB each\)")
    assert int(m.group(1)) << 20 == data["bytes_per_side"]
