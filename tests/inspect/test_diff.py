"""Ulp distances, streaming checkpoint comparison, the diff and its ulp-histogram view, and
error vs the exact fuse."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from lorakit import numerics as nm
from lorakit.inspect.diff import (
    UlpReport,
    compare_sources,
    diff,
    error_histogram,
    ulp_report,
    ulp_tensors,
    ulp_vs_reference,
)
from lorakit.inspect.ulp_count import Accumulator as _Acc
from lorakit.inspect.ulp_count import TensorDiff, bin_labels
from lorakit.io.formats.checkpoint import Checkpoint
from lorakit.io.formats.safetensors import TensorSpec
from lorakit.io.outputs.safetensors_write import SafetensorsWriter

BF16 = nm.float_format("bf16")


def bf(values) -> np.ndarray:
    return nm.round_to_format(np.asarray(values, np.float64), BF16)


def write_file(path: Path, tensors: dict) -> Path:
    """tensors: name -> (code, raw array)."""
    plan = [TensorSpec(n, c, tuple(a.shape)) for n, (c, a) in tensors.items()]
    with SafetensorsWriter(path, plan) as w:
        for n, (c, a) in tensors.items():
            w.write(n, a)
    return path


# -- known answers ---------------------------------------------------------------------------
def test_across_zero_and_consecutive_floats() -> None:
    tiny = 2.0 ** -133  # bf16 smallest subnormal
    a = bf([1.0, 0.0, tiny, -tiny, 1.0, BF16.max_value, -1.0])
    b = bf([1.0 + 2 ** -7, -0.0, -tiny, -tiny * 3, -1.0, np.inf, -1.0 - 2 ** -7])
    rep = ulp_tensors(a, b, "bf16")
    # next float, +0/-0, across zero through the subnormals, 1 to -1, max to inf
    assert nm.ulp_distance(a, b, "bf16").tolist() == [1, 0, 2, 2, 2 * 0x3F80, 1, 1]
    row = rep.rows[0]
    assert row["max_ulp"] == 2 * 0x3F80
    assert row["differing"] == 7  # -0 vs +0 differ in bits although 0 ulps apart
    h = rep.histogram()
    assert h["0"] == 1 and h["1"] == 3 and h["2"] == 2 and h[">1023"] == 1
    assert sum(h.values()) == 7


def test_nan_rules_and_float32() -> None:
    nan = float("nan")
    a = np.array([nan, nan, 1.0, np.inf, 0.0], np.float32)
    b = np.array([nan, 1.0, 1.0, np.float32(3.4028235e38), -0.0], np.float32)
    rep = ulp_tensors(a, b)
    assert rep.rows[0]["dtype"] == "F32"
    h = rep.histogram()
    assert h["nan"] == 1  # NaN against a number
    assert h["0"] == 3 and h["1"] == 1  # NaN-NaN, equal, +-0; inf is one past max
    assert rep.rows[0]["max_ulp"] == 1


@pytest.mark.parametrize("code", ["BF16", "F16"])
def test_fast_16bit_path_matches_numerics_on_every_pattern(code: str) -> None:
    """The integer fast path equals numerics.ulp_distance: all 65,536 patterns against
    shuffled partners (NaN, inf, subnormals, both zeros included), in dense and sparse
    pieces."""
    rng = np.random.default_rng(0)
    x = np.arange(1 << 16, dtype=np.uint16)
    sparse = x.copy()
    sparse[::50] = rng.permutation(x)[::50]  # few differences: the word-level sparse path
    for y in (rng.permutation(x), x ^ np.uint16(1), x.copy(), sparse):
        y[::977] = x[::977]  # some equal elements in every piece
        for size in (1 << 16, 4096, 333, 64):
            acc = _Acc(code, 1023)
            for s in range(0, x.size, size):
                acc.add(x[s:s + size], y[s:s + size])
            td = acc.result(TensorDiff("t", "", code, code, x.shape, x.shape))
            ref = nm.ulp_distance(x, y, code)
            labels, counts = nm.ulp_histogram(ref)
            assert td.counts.tolist() == counts.tolist()
            finite = ref[ref != nm.NAN_MISMATCH]
            assert td.max_ulp == int(finite.max())
            assert td.ulp_sum == float(finite.sum())
            assert td.differing == int((x != y).sum())


def test_error_histogram_bins() -> None:
    err = np.array([0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 3.0, 5000.0, np.nan, np.inf])
    c = error_histogram(err)
    from lorakit.inspect.diff import error_labels

    h = dict(zip(error_labels(), c.tolist()))
    assert h["0"] == 1 and h["(0,0.5]"] == 2 and h["(0.5,1]"] == 2 and h["(1,2]"] == 1
    assert h["(2,4]"] == 1 and h[">1024"] == 2 and h["nan"] == 1


# -- streaming two files -------------------------------------------------------------------------
def test_compare_files_in_small_pieces(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    w = bf(rng.normal(0, 0.05, size=(40, 33)))
    w2 = w.copy()
    flat = w2.reshape(-1)
    for k in range(1, 9):  # +k on the bits of a finite value: k ulps away from zero
        flat[k * 97] = np.uint16(int(flat[k * 97]) + k)
    norm = bf(np.ones(33))
    a = write_file(tmp_path / "a.safetensors", {
        "model.layers.0.mlp.up_proj.weight": ("BF16", w),
        "model.layers.1.mlp.up_proj.weight": ("BF16", w),
        "model.norm.weight": ("BF16", norm),
        "only_a": ("BF16", norm)})
    b = write_file(tmp_path / "b.safetensors", {
        "model.layers.0.mlp.up_proj.weight": ("BF16", w2),
        "model.layers.1.mlp.up_proj.weight": ("BF16", w),
        "model.norm.weight": ("F32", np.ones(33, np.float32)),
        "only_b": ("BF16", norm)})
    for chunk in (64, 1 << 20):  # pieces far smaller than a tensor, and one piece
        diffs = {d.name: d for d in compare_sources(a, b, chunk_bytes=chunk)}
        d0 = diffs["model.layers.0.mlp.up_proj.weight"]
        assert d0.status == "differs" and d0.differing == 8 and d0.max_ulp == 8
        assert d0.ulp_sum == sum(range(1, 9))
        assert diffs["model.layers.1.mlp.up_proj.weight"].status == "equal"
        norm_d = diffs["model.norm.weight"]
        assert norm_d.status == "dtype mismatch" and norm_d.differing == 0  # same values
        assert diffs["only_a"].status == "only in A" and diffs["only_b"].status == "only in B"
    rep = diff(a, b).ulp_report()
    assert rep.histogram(layer="0")["4-7"] == 4 and rep.histogram(layer="1")["0"] == w.size
    assert rep.histogram()["8-15"] == 1
    assert "model.layers.0.mlp.up_proj.weight" in str(rep)


def test_ulp_report_is_the_diff_seen_as_histograms(tmp_path: Path) -> None:
    """``diff(a, b).ulp_report()`` is the same comparison (``compare_sources``) seen as ulp
    histograms per tensor, per layer and overall, and its overall histogram is the diff's."""
    rng = np.random.default_rng(0)
    w = {f"model.layers.{i}.mlp.up_proj.weight": rng.normal(0, 0.02, (64, 48)) for i in range(3)}
    ta = {n: ("BF16", bf(v)) for n, v in w.items()}
    tb = {n: ("BF16", bf(v * (1 + 0.01 * k))) for k, (n, v) in enumerate(w.items())}
    tb["only.in.b"] = ("BF16", ta["model.layers.0.mlp.up_proj.weight"][1][:2])
    a = write_file(tmp_path / "a.safetensors", ta)
    b = write_file(tmp_path / "b.safetensors", tb)
    d = diff(a, b, progress=False)
    rep = d.ulp_report()
    direct = ulp_report("ulp distances a.safetensors vs b.safetensors", compare_sources(a, b),
                        bin_labels(), {"A": str(a), "B": str(b)})
    assert isinstance(rep, UlpReport)
    assert str(rep) == str(direct)
    assert rep.counts.tolist() == direct.counts.tolist()
    assert {k: v.tolist() for k, v in rep.per_layer.items()} == \
        {k: v.tolist() for k, v in direct.per_layer.items()}
    assert [r["status"] for r in rep.rows] == ["equal", "differs", "differs", "only in B"]
    assert d.overall.tolist() == rep.overall.tolist()


# -- checkpoints made by real fuses -------------------------------------------------------------
@pytest.fixture(scope="module")
def fused(qwen3, qwen3_fused) -> dict:
    """The shared qwen3 base, adapter and its nearest / mlx-lm / promoted fuses."""
    return {"base": qwen3["base"], "ad": qwen3["ad"], "nearest": qwen3_fused["nearest"],
            "mlx": qwen3_fused["mlx-lm"], "f32": qwen3_fused["promote"]}


def test_parity_identical_and_rounding_difference(fused: dict, tmp_path: Path) -> None:
    same = diff(fused["nearest"], fused["nearest"])
    assert same.identical and same.summary["elements differing"] == 0
    rep = diff(fused["nearest"], fused["mlx"])
    assert not rep.identical
    a, b = Checkpoint(fused["nearest"]), Checkpoint(fused["mlx"])
    want = sum(int((a.read(n) != b.read(n)).sum()) for n in a.tensors)
    assert rep.summary["elements differing"] == want > 0
    for r in rep.rows:
        if r["status"] == "differs":
            x, y = a.read(r["tensor"]), b.read(r["tensor"])
            assert r["max_ulp"] == int(nm.ulp_distance(x, y, BF16).max())
            vx, vy = nm.to_float64(x, BF16), nm.to_float64(y, BF16)
            assert r["max_abs"] == pytest.approx(float(np.abs(vx - vy).max()), rel=1e-6)
    assert set(rep.differing()) == {r["tensor"] for r in rep.rows if r["status"] != "equal"}


def test_parity_dtype_and_missing(fused: dict, tmp_path: Path) -> None:
    rep = diff(fused["nearest"], fused["f32"])
    assert rep.summary["dtype mismatches"] == 6
    row = next(r for r in rep.rows if r["status"] == "dtype mismatch")
    assert row["dtype"] == "BF16 vs F32" and row["max_ulp"] is None and row["max_abs"] > 0
    # a copy with one tensor dropped and one reshaped
    ck = Checkpoint(fused["nearest"])
    names = list(ck.tensors)
    drop, reshape = names[0], next(n for n in names if len(ck.tensors[n].shape) == 2)
    tensors = {n: (ck.tensors[n].dtype, ck.read(n)) for n in names if n != drop}
    c, x = tensors[reshape]
    tensors[reshape] = (c, x.reshape(x.shape[1], x.shape[0]))
    other = tmp_path / "other"
    shutil.copytree(fused["nearest"], other)
    for f in other.glob("*.safetensors*"):
        f.unlink()
    write_file(other / "model.safetensors", tensors)
    rep = diff(fused["nearest"], other)
    st = {r["tensor"]: r["status"] for r in rep.rows}
    assert st[drop] == "only in A" and st[reshape] == "shape mismatch"
    assert rep.summary["only in A"] == 1 and rep.summary["shape mismatches"] == 1


def test_ulp_vs_reference(fused: dict) -> None:
    good = ulp_vs_reference(fused["nearest"], fused["base"], fused["ad"])
    assert good.summary["max error (ulp)"] <= 0.5
    assert good.summary["not correctly rounded"] == 0 and good.summary["elements"] > 0
    mlx = ulp_vs_reference(fused["mlx"], fused["base"], fused["ad"])
    # exactly the elements where mlx-lm's double rounding left the nearest value
    assert mlx.summary["not correctly rounded"] == \
        diff(fused["nearest"], fused["mlx"]).summary["elements differing"]
    assert mlx.summary["max error (ulp)"] > 0.5
    f32 = ulp_vs_reference(fused["f32"], fused["base"], fused["ad"])
    assert {r["dtype"] for r in f32.rows} == {"F32"}


def test_plots_smoke(fused: dict) -> None:
    from matplotlib.figure import Figure

    rep = diff(fused["nearest"], fused["mlx"]).ulp_report()
    assert isinstance(rep.plot(), Figure)
    assert isinstance(rep.plot("layers"), Figure)
    assert isinstance(rep.plot(tensor=rep.rows[0]["tensor"]), Figure)
    p = diff(fused["nearest"], fused["mlx"])
    assert isinstance(p.plot(), Figure) and isinstance(p.plot(kind="histogram"), Figure)
    assert isinstance(ulp_vs_reference(fused["mlx"], fused["base"], fused["ad"]).plot(), Figure)
    assert "<table>" in p._repr_html_()


def test_progress_callable_sees_every_byte(fused: dict, tmp_path: Path) -> None:
    """parity reports progress over A's bytes: a callable gets (done, total) after each
    piece, ending at total; progress=False calls nothing."""
    from lorakit.io.formats.checkpoint import Checkpoint as Ck

    a, b = fused["nearest"], fused["mlx"]
    calls = []
    diff(a, b, progress=lambda done, total: calls.append((done, total)))
    total = sum(Ck(a).info(n).nbytes for n in Ck(a).tensors)
    assert calls and calls[-1] == (total, total)
    assert all(x[0] <= y[0] for x, y in zip(calls, calls[1:]))
    assert all(t == total for _, t in calls)
    # tensors compared by value (dtype mismatch) are not streamed: the bar still ends full
    calls.clear()
    diff(a, fused["f32"], progress=lambda done, total: calls.append((done, total)))
    assert calls and calls[-1][0] == calls[-1][1] and calls[-1][1] < total
    calls.clear()
    diff(a, b, progress=False)
    assert calls == []
