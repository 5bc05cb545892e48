"""Ulp reports that explain themselves (issue 13): the figures at the tensor's scale.

Every figure of :mod:`lorakit.inspect.ulp_count` is recomputed here by brute force
from decoded float64 values and :func:`lorakit.numerics.ulp_distance`, through both
paths (C kernel and numpy) and through the streaming comparison of two files (small
pieces, so that memcmp-equal pieces need the rms pass afterwards). Then the
explanation itself: it must appear when the large ulps sit near zero (the mlx-lm
order's case) and must not when a large ulp distance is a real error at a typical
magnitude.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

import lorakit
from lorakit import kernels
from lorakit import numerics as nm
from lorakit.cli.main import main
from lorakit.inspect import ulp_count as ua
from lorakit.inspect.diff import compare_sources, diff, ulp_tensors
from lorakit.inspect.ulp_count import Accumulator, TensorDiff, TensorScale, binades


def write_safetensors_raw(path: Path, tensors: dict) -> None:
    """name -> (dtype code, shape, storage bits) into one .safetensors file."""
    header, blobs, off = {}, [], 0
    for name, (code, shape, bits) in tensors.items():
        b = np.ascontiguousarray(bits).tobytes()
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(len(h).to_bytes(8, "little") + h + b"".join(blobs))


def _pair(code: str, seed: int = 0, n: int = 50_001):
    """Weights of rms ~0.05 with zeros, tiny values, sign flips and 1-ulp noise."""
    f = nm.float_format(code)
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(n) * 0.05
    w[:500] = 0
    w[500:1500] *= 1e-4
    x = nm.round_to_format(w, f)
    noisy = w + rng.standard_normal(n) * 5e-4 * (rng.random(n) < 0.3)
    y = nm.round_to_format(noisy, f)
    y[2000:2010] = x[2000:2010] ^ np.array(f.sign_mask, x.dtype)
    return x, y


def _brute(x: np.ndarray, y: np.ndarray, code: str) -> dict:
    f = nm.float_format(code)
    va, vb = nm.to_float64(x, f), nm.to_float64(y, f)
    rms = math.sqrt(float((va * va).mean()))
    ne = x != y
    d = nm.ulp_distance(x, y, f).astype(np.int64)
    lo = np.minimum(np.abs(va), np.abs(vb))
    e = math.frexp(rms)[1] - 1
    near_thr, typ = max(2.0 ** (e - 10), f.min_normal), max(2.0 ** e, f.min_normal)
    return {
        "rms_a": rms,
        "rel_rms": math.sqrt(float(((va - vb) ** 2).mean())) / rms,
        "sign_changes": int((ne & (np.sign(va) * np.sign(vb) < 0)).sum()),
        "to_zero": int((ne & ((va == 0) != (vb == 0))).sum()),
        "near_zero": int((ne & (lo < near_thr)).sum()),
        "max_ulp_typical": int(d[ne & (lo >= typ)].max(initial=0)),
        "max_ulp_at_rms": float(np.abs(va - vb).max()) / float(nm.ulp(np.array([rms]), f)[0]),
    }


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("code", ["BF16", "F16", "F32"])
def test_scale_figures_match_brute_force(code, kernel):
    if kernel and ua.scale_kernel() is None:
        pytest.skip("C ulp kernel not built")
    x, y = _pair(code)
    with kernels.use_kernels(kernel):
        scale = TensorScale.of(x, code, ua.scale_kernel())
        acc = Accumulator(code, 1023, scale=scale)
        for s in range(0, x.size, 7_000):  # several pieces, merged as the stream does
            part = Accumulator(code, 1023, scale=scale)
            part.add(x[s:s + 7_000], y[s:s + 7_000])
            acc.merge(part)
    td = acc.result(TensorDiff("t", "", code, code, x.shape, x.shape))
    want = _brute(x, y, code)
    for k, v in want.items():
        got = getattr(td, k)
        if isinstance(v, float):
            assert got == pytest.approx(v, rel=1e-6), k
        else:
            assert got == v, k
    bins = binades(x, y, code)
    assert sum(c for _, c, _ in bins) == td.differing
    assert max(m for _, _, m in bins) == td.max_ulp
    typ = math.frexp(want["rms_a"])[1] - 1
    assert max((m for e, _, m in bins if e is not None and e >= typ), default=0) == \
        td.max_ulp_typical


def test_stream_counts_pieces_memcmp_skipped_into_rms(tmp_path):
    x, y = _pair("BF16", seed=3, n=64 * 1024)
    y[: 60 * 1024] = x[: 60 * 1024]  # most pieces equal: memcmp skips them
    write_safetensors_raw(tmp_path / "a.safetensors", {"w": ("BF16", [64, 1024], x)})
    write_safetensors_raw(tmp_path / "b.safetensors", {"w": ("BF16", [64, 1024], y)})
    (td,) = compare_sources(tmp_path / "a.safetensors", tmp_path / "b.safetensors",
                            chunk_bytes=4096, threads=2)
    want = _brute(x, y, "BF16")
    assert td.rms_a == pytest.approx(want["rms_a"], rel=1e-6)
    assert td.rel_rms == pytest.approx(want["rel_rms"], rel=1e-6)
    assert td.near_zero == want["near_zero"] and td.max_ulp_typical == want["max_ulp_typical"]


def test_explanation_only_when_large_ulps_sit_near_zero():
    f = nm.float_format("bf16")
    w = np.random.default_rng(5).standard_normal(4096) * 0.05
    a = nm.round_to_format(w, f)
    # near zero: one element +1e-5 against 0 is ~14,000 ulps, a tiny absolute change
    b = a.copy()
    a[7], b[7] = nm.round_to_format(np.array([1e-5]), f)[0], 0
    rep = ulp_tensors(a, b, "bf16")
    assert rep.summary["max ulp"] > 10_000
    assert rep.summary["max ulp at typical magnitudes (|a|, |b| >= rms(A))"] == 0
    assert rep.summary["zero on one side"] == 1 and "why max ulp is large" in rep.summary
    assert rep.summary["relative error, rms(A - B) / rms(A)"] < 1e-3
    # a real error at a typical magnitude: no excuse offered, the typical max is large
    c = a.copy()
    big = int(np.argmax(np.abs(nm.to_float64(a, f))))
    c[big] = a[big] + 200
    rep = ulp_tensors(a, c, "bf16")
    assert rep.summary["max ulp at typical magnitudes (|a|, |b| >= rms(A))"] == 200
    assert "why max ulp is large" not in rep.summary
    assert rep.summary["differing near zero (< 2**-10 rms(A))"] == 0


@pytest.fixture(scope="module")
def two_orders(qwen3_fused):
    return qwen3_fused["nearest"], qwen3_fused["mlx-lm"]


def test_cli_diff_text_and_json_lead_with_the_relative_error(two_orders, capsys):
    a, b = two_orders
    rep = diff(a, b, progress=False)
    assert main(["diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    summary = [ln.strip() for ln in out.splitlines()[1:] if ln.startswith("  ")]
    keys = [ln.split(":")[0] for ln in summary]
    assert keys.index("relative error, rms(A - B) / rms(A)") < keys.index("max ulp")
    assert "why max ulp is large" in out and "rel_err" in out and "near_zero" in out
    assert main(["diff", str(a), str(b), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)["diff"]
    s = data["summary"]
    assert s["relative error, rms(A - B) / rms(A)"] == pytest.approx(
        rep.summary["relative error, rms(A - B) / rms(A)"])
    assert s["max ulp at typical magnitudes (|a|, |b| >= rms(A))"] < 10 < s["max ulp"]
    row = next(r for r in data["rows"] if r["status"] == "differs")
    assert {"rel_err", "max_ulp_typ", "near_zero", "sign_changes", "zero_one_side"} <= set(row)


@pytest.fixture(scope="module")
def qwen3_paths(qwen3, qwen3_fused):
    return qwen3["base"], qwen3["ad"], qwen3_fused["nearest"], qwen3_fused["mlx-lm"]


def test_reference_error_leads_with_relative_error(qwen3_paths):
    from lorakit.fusion.delta import intended_pieces
    from lorakit.inspect.diff import ulp_vs_reference
    from lorakit.io.adapters.load import load_adapter
    from lorakit.io.adapters.naming import bind, bindings_by_tensor

    base, ad, near, mlx = qwen3_paths
    rn, rm = ulp_vs_reference(near, base, ad), ulp_vs_reference(mlx, base, ad)
    key_typ = "max error at typical magnitudes (ulp, |T| >= rms(T))"
    key_rel = "relative error, rms(F - T) / rms(T)"
    assert rn.summary[key_typ] <= 0.5 and "why max error is large" not in rn.summary
    assert rm.summary[key_typ] < 4 < rm.summary["max error (ulp)"]
    assert "why max error is large" in rm.summary
    assert rn.summary[key_rel] < rm.summary[key_rel]
    keys = list(rm.summary)
    assert keys.index(key_rel) < keys.index("max error (ulp)")
    # brute force for one tensor: rms(F - T) / rms(T) from the exact pieces
    sf, sb = lorakit.open(mlx), lorakit.open(base)
    by = bindings_by_tensor(bind(load_adapter(ad), sb))
    name = next(iter(by))
    t2 = d2 = 0.0
    for f, _, t in intended_pieces(sf, sb, name, by[name]):
        fv = nm.to_float64(f, sf.tensors[name].dtype)
        t2 += float((t * t).sum())
        d2 += float(((fv - t) ** 2).sum())
    row = next(r for r in rm.rows if r["tensor"] == name)
    assert row["rel_err"] == pytest.approx(math.sqrt(d2 / t2), rel=1e-9)
