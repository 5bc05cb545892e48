"""The C fuse kernel (lorakit/fusion/_fusekernel.c) against the numpy path of the
``nearest`` rounding and against exact rationals: every in/out format pair, ranks 1, 8
and 64, per-rank-column scales, exact ties, near ties, cancellation to the last bit,
subnormal and overflowing results, non-finite weights, odd and non-contiguous shapes;
and its flags: no miss (every element its one f64 pass rounds wrong is flagged), few
false alarms on ordinary weights."""
from __future__ import annotations

import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lorakit import numerics as nm
from lorakit.errors import FuseError
from lorakit.fusion import nearest as nr
from lorakit.fusion.core import fuse_weight

pytestmark = pytest.mark.skipif(nr._kernel is None, reason="C fuse kernel not built here")

CODES = ("BF16", "F16", "F32")
POLICY = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
RANKS = (1, 8, 64)


def to_code(values: np.ndarray, code: str) -> np.ndarray:
    """Raw storage (fuse_weight's input convention) of f64 values, rounded correctly."""
    bits = nm.round_to_format(np.asarray(values, np.float64), nm.float_format(code))
    return bits if code == "BF16" else bits.view(np.float16 if code == "F16" else np.float32)


def both(monkeypatch, w, code, A, B, scale, policy="preserve"):
    """(kernel result, numpy result) of fuse_weight as bits; errors as their message."""
    res = []
    for on in (True, False):
        monkeypatch.setattr(nr, "USE_KERNEL", on)
        try:
            out, oc = fuse_weight(w, code, A, B, scale, dtype_policy=policy, name="t")
            res.append((oc, np.asarray(out).view(nm.float_format(oc).storage).copy()))
        except FuseError as e:
            res.append(("error", str(e)))
    return res


def assert_same(monkeypatch, w, code, A, B, scale, policy="preserve"):
    (ck, k), (cn, n) = both(monkeypatch, w, code, A, B, scale, policy)
    assert ck == cn
    if ck == "error":
        assert k == n
        return None
    assert k.shape == n.shape
    bad = np.flatnonzero(k.reshape(-1) != n.reshape(-1))
    assert bad.size == 0, f"{bad.size} elements differ, first at {bad[:5]}"
    return k


def pieces(seed, rows, cols, r, code, wscale=0.05, dscale=0.01):
    rng = np.random.default_rng(seed)
    w = to_code(rng.standard_normal((rows, cols)) * wscale, code)
    A = (rng.standard_normal((r, cols)) * dscale).astype(np.float32)
    B = (rng.standard_normal((rows, r)) * dscale).astype(np.float32)
    return w, A, B


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("out", CODES)
@pytest.mark.parametrize("r", RANKS)
def test_random_every_format_pair_and_rank(monkeypatch, code, out, r) -> None:
    w, A, B = pieces(r, 67, 301, r, code)
    assert_same(monkeypatch, w, code, A, B, 2.0, POLICY[out])
    # one scale per rank column (an exact combination of adapters)
    scales = np.random.default_rng(r).uniform(-3, 3, r)
    assert_same(monkeypatch, w, code, A, B, scales, POLICY[out])


def test_kernel_runs_where_it_should(monkeypatch) -> None:
    """The kernel takes a plain LoRA and leaves DoRA to numpy (counted calls through the
    real kernel, not a stand-in)."""
    calls = []
    real = nr._kernel

    class Counting:
        def fuse_nearest(self, *a):
            calls.append(a[2])
            return real.fuse_nearest(*a)

    monkeypatch.setattr(nr, "_kernel", Counting())
    monkeypatch.setattr(nr, "USE_KERNEL", True)
    w, A, B = pieces(0, 16, 40, 4, "BF16")
    fuse_weight(w, "BF16", A, B, 1.0)
    assert calls == [40]
    fuse_weight(w, "BF16", A, B, 1.0, magnitude=np.ones(16, np.float32))
    fuse_weight(w, "BF16", A, B, 1.0, rounding="round-once")
    assert calls == [40]
    monkeypatch.setattr(nr, "USE_KERNEL", False)
    fuse_weight(w, "BF16", A, B, 1.0)
    assert calls == [40]


@pytest.mark.parametrize("code,out", [("BF16", "BF16"), ("F16", "F16"), ("F32", "F32"),
                                      ("F32", "BF16"), ("BF16", "F16")])
def test_exact_and_near_ties(monkeypatch, code, out) -> None:
    """W + delta exactly on a tie of the output format (ties to even decide), and a
    hair (2**-40 and 2**-60) either side of it: one f64 pass cannot tell those apart,
    the exact redo must. Weights in [1, 2): half an ulp is 2**-p for all of them."""
    fo = nm.float_format(out)
    rng = np.random.default_rng(1)
    rows, cols = 24, 64
    w = to_code(rng.uniform(1, 2, (rows, cols)), code)
    hair = rng.choice([0.0, 2.0 ** -40, -(2.0 ** -40), 2.0 ** -60, -(2.0 ** -60)], cols)
    A = np.stack([np.full(cols, 2.0 ** -fo.precision), hair]).astype(np.float32)
    B = np.stack([rng.choice([-1.0, 1.0], rows), np.ones(rows)], 1).astype(np.float32)
    got = assert_same(monkeypatch, w, code, A, B, 1.0, POLICY[out])
    # and the ties went to even: the exact ties (hair 0) land on even significands
    tie_cols = np.flatnonzero(hair == 0)
    if code == out:
        assert np.all(got[:, tie_cols] & 1 == 0)


def exact_round(value: Fraction, f) -> int:
    """The correctly rounded bits of an exact rational (nearest, ties to even), found
    among the neighbours of its f64 rounding by exact comparison."""
    x = float(value)
    c = int(nm.round_to_format(np.array([abs(x)]), f)[0])
    cands = [b for b in range(max(c - 2, 0), min(c + 3, f.inf_bits + 1))]
    vals = nm.to_float64(np.array(cands, f.storage), f)
    best = min(zip(cands, vals.tolist()),
               key=lambda bv: (abs(Fraction(bv[1]) - abs(value)), bv[0] & 1))
    bits = best[0]
    if bits == f.inf_bits - 1 and abs(value) >= Fraction(f.max_value) + Fraction(
            2.0 ** (f.emax - f.precision)):
        bits = f.inf_bits
    return bits | (f.sign_mask if value < 0 or (value == 0 and x < 0) else 0)


@pytest.mark.parametrize("code,out", [("BF16", "BF16"), ("F16", "F16"), ("F32", "F32"),
                                      ("F32", "BF16"), ("BF16", "F16")])
def test_against_exact_rationals(monkeypatch, code, out) -> None:
    """A small matrix with ties, near ties, cancellation and subnormal results, each
    element compared with its exact rational value rounded by hand."""
    fo = nm.float_format(out)
    rng = np.random.default_rng(7)
    rows, cols, r = 6, 9, 3
    w = to_code(rng.standard_normal((rows, cols)) * 2.0 ** rng.integers(-10, 3, (rows, cols)),
                code)
    A = (rng.standard_normal((r, cols)) * 0.01).astype(np.float32)
    B = (rng.standard_normal((rows, r)) * 0.01).astype(np.float32)
    wv = nm.to_float64(np.asarray(w).view(nm.float_format(code).storage),
                       nm.float_format(code))
    B[0, :] = 0.0
    B[0, 0] = -1.0
    A[0, :] = wv[0].astype(np.float32)  # row 0: W - W = 0 exactly (cancellation)
    B[1, 1] = 2.0 ** -70  # row 1: tiny terms (hair-breadth off a tie or a value)
    scale = np.array([1.0, 0.75, -2.5])
    got = assert_same(monkeypatch, w, code, A, B, scale, POLICY[out])
    for i in range(rows):
        for j in range(cols):
            exact = Fraction(float(wv[i, j])) + sum(
                Fraction(float(scale[k])) * Fraction(float(B[i, k])) * Fraction(float(A[k, j]))
                for k in range(r))
            want = exact_round(exact, fo)
            if exact == 0:  # the sign of an exact zero follows the f64 sum
                assert int(got[i, j]) & fo.abs_mask == 0
            else:
                assert int(got[i, j]) == want, (i, j, float(exact))


@pytest.mark.parametrize("code", CODES)
def test_cancellation_to_the_last_bit(monkeypatch, code) -> None:
    """W = -delta exactly, plus a term far below W's ulp: the result is that term,
    rounded (subnormal for the 16-bit formats), which only the exact redo gets."""
    rng = np.random.default_rng(2)
    rows, cols = 32, 48
    w = to_code(rng.standard_normal((rows, cols)), code)
    f = nm.float_format(code)
    wv = nm.to_float64(np.asarray(w).view(f.storage), f)
    # rank 3 on one row i: 1 * (-W[i]) + 2**-30 * noise + 0; fused row by row
    for i in range(0, rows, 8):
        A = np.stack([-wv[i], rng.standard_normal(cols), np.ones(cols)]).astype(np.float32)
        B = np.array([[1.0, 2.0 ** -30, 0.0]], np.float32)
        assert_same(monkeypatch, w[i:i + 1], code, A, B, 1.0)
        assert_same(monkeypatch, w[i:i + 1], code, A, B, 1.0, "bfloat16")
        B[0, 1] = 0.0  # exactly zero
        assert_same(monkeypatch, w[i:i + 1], code, A, B, 1.0)


@pytest.mark.parametrize("code", CODES)
def test_cancellation_inside_the_sum(monkeypatch, code) -> None:
    """1 + tiny - 1 (+ W far below 1): f64 loses the tiny term in the partial sum, so
    the f64 result is off by all of it; only the cancellation bound flags these."""
    f = nm.float_format(code)
    rng = np.random.default_rng(6)
    rows, cols = 4, 520
    w = to_code(rng.standard_normal((rows, cols)) * 2.0 ** -62, code)
    wv = nm.to_float64(np.asarray(w).view(f.storage), f)
    A = np.stack([np.ones(cols), rng.standard_normal(cols) * 2.0 ** -60,
                  np.ones(cols)]).astype(np.float32)
    B = np.tile(np.array([[1.0, 1.0, -1.0]], np.float32), (rows, 1))
    got = assert_same(monkeypatch, w, code, A, B, 1.0)
    for i in range(rows):
        for j in range(0, cols, 37):
            exact = Fraction(float(wv[i, j])) + Fraction(float(A[1, j]))
            assert int(got[i, j]) == exact_round(exact, f), (i, j)


@pytest.mark.parametrize("out", CODES)
def test_cancellation_after_the_weight(monkeypatch, out) -> None:
    """W + p - p with |p| ~ 2**10 and |W| ~ 2**-40: a sum that adds W first (the
    kernel's order) keeps W only to p's ulp (2**-42), many ulps of the result off,
    and far from any tie: only the cancellation bound flags these."""
    rng = np.random.default_rng(8)
    rows, cols = 4, 520
    w = to_code(rng.standard_normal((rows, cols)) * 2.0 ** -40, "F32")
    p = (rng.uniform(1, 2, cols) * 2.0 ** 10).astype(np.float32)
    A = np.stack([p, p])
    B = np.tile(np.array([[1.0, -1.0]], np.float32), (rows, 1))
    got = assert_same(monkeypatch, w, "F32", A, B, 1.0, POLICY[out])
    want = nm.round_to_format(w.astype(np.float64), nm.float_format(out))
    assert np.array_equal(got, want)  # the exact value is W itself


def test_subnormal_and_overflowing_results(monkeypatch) -> None:
    rng = np.random.default_rng(4)
    rows, cols = 40, 50
    # f16 subnormals: weights and deltas around 2**-20
    w = to_code(rng.standard_normal((rows, cols)) * 2.0 ** -20, "F16")
    A = (rng.standard_normal((4, cols)) * 2.0 ** -10).astype(np.float32)
    B = (rng.standard_normal((rows, 4)) * 2.0 ** -12).astype(np.float32)
    assert_same(monkeypatch, w, "F16", A, B, 1.0)
    # bf16 subnormals out of f32 weights
    w32 = to_code(rng.standard_normal((rows, cols)) * 2.0 ** -128, "F32")
    assert_same(monkeypatch, w32, "F32", A * 2.0 ** -118, B, 1.0, "bfloat16")
    # overflow: f32 weights near f16's max fused into f16 (max + half ulp and over
    # become inf: fuse_weight refuses that; the raw kernel pass must agree bit for bit)
    w = to_code(np.full((rows, cols), 65504.0) * rng.choice([-1, 1], (rows, cols)), "F32")
    A = np.full((1, cols), 1.0, np.float32)
    B = rng.choice([0.0, 15.0, 16.0, 17.0, -16.0, 31.99], (rows, 1)).astype(np.float32)
    assert_same(monkeypatch, w, "F32", A, B, 1.0, "float16")
    f32, f16 = nm.float_format("F32"), nm.float_format("F16")
    outs = []
    for on in (True, False):
        monkeypatch.setattr(nr, "USE_KERNEL", on)
        outs.append(nr._fuse_nearest(w.view(np.uint32), f32, A, B, 1.0, None, f16))
    assert np.array_equal(outs[0], outs[1])
    assert (outs[0] == 0x7C00).any() and (outs[0] == 0x7BFF).any()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_weights_follow_the_numpy_path(monkeypatch, bad) -> None:
    w, A, B = pieces(5, 8, 16, 2, "F32")
    w = w.copy()
    w[3, 4] = bad
    f = nm.float_format("F32")
    g, rc, cm = nr._cancel_bound(A.astype(np.float64), B.astype(np.float64), f)
    out = np.empty(w.shape, np.uint32)
    _, special = nr._kernel.fuse_nearest(w, 2, 16, B.astype(np.float64), A.astype(np.float64),
                                         rc, cm, g, 2, out, 1)
    assert special == 1
    for policy in ("preserve", "bfloat16", "float16"):
        assert_same(monkeypatch, w, "F32", A, B, 1.0, policy)


def test_zero_weights_and_zero_adapter(monkeypatch) -> None:
    w = to_code(np.zeros((5, 7)), "BF16")
    A = np.zeros((2, 7), np.float32)
    B = np.zeros((5, 2), np.float32)
    assert np.all(assert_same(monkeypatch, w, "BF16", A, B, 1.0) == 0)
    w = to_code(-np.zeros((5, 7)), "F16")  # -0 + 0: +0 in round to nearest
    assert_same(monkeypatch, w, "F16", A, B, 1.0)
    assert_same(monkeypatch, w, "F16", A[:0], B[:, :0], 1.0)  # rank 0


@pytest.mark.parametrize("shape", [(1, 1), (1, 1025), (700, 3), (513, 517)])
def test_odd_and_non_contiguous_shapes(monkeypatch, shape) -> None:
    rows, cols = shape
    w, A, B = pieces(rows * cols, rows, 2 * cols, 8, "BF16")
    w_nc = w[:, ::2]  # a strided view
    assert not w_nc.flags.c_contiguous or cols == 1
    got = assert_same(monkeypatch, w_nc, "BF16", A[:, ::2].copy(), B, 0.5)
    monkeypatch.setattr(nr, "USE_KERNEL", True)
    ref, _ = fuse_weight(np.ascontiguousarray(w_nc), "BF16", np.asfortranarray(A[:, ::2]),
                         np.asfortranarray(B), 0.5)
    assert np.array_equal(got, ref)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", ["ordinary", "near-ties"])
def test_flags_never_miss_and_rarely_false_alarm(case, threads) -> None:
    """The raw kernel pass (before the exact redo) against the correct result: every
    element it rounds wrong is among its flags (misses: 0); on ordinary weights the
    flags stay rare (false alarms: below 1e-4 of elements)."""
    f = nm.float_format("BF16")
    rng = np.random.default_rng(11)
    rows, cols, r = 300, 700, 8
    w, A, B = pieces(11, rows, cols, r, "BF16")
    if case == "near-ties":  # every element a hair (~2**-60, below f64's ulp) off a tie
        rows = 4
        wv = rng.uniform(1, 2, (rows, cols))
        w = to_code(wv, "BF16")
        A = np.stack([np.full(cols, 2.0 ** -8)] + [rng.standard_normal(cols) * 2.0 ** -55
                                                    for _ in range(r - 1)]).astype(np.float32)
        B = np.concatenate([np.ones((rows, 1)), rng.standard_normal((rows, r - 1)) * 2.0 ** -5],
                           1).astype(np.float32)
    A64, B64 = A.astype(np.float64), B.astype(np.float64)
    g, rc, cm = nr._cancel_bound(A64, B64, f)
    raw = np.empty((rows, cols), np.uint16)
    flagged, special = nr._kernel.fuse_nearest(w, 0, cols, B64, A64, rc, cm, g, 0, raw, threads)
    assert special == 0
    flags = np.frombuffer(flagged, np.int64)
    assert np.unique(flags).size == flags.size
    try:
        nr.USE_KERNEL = False
        good = nr._fuse_nearest(w, f, A, B, 1.0, None, f)
    finally:
        nr.USE_KERNEL = True
    wrong = np.flatnonzero(raw.reshape(-1) != good.reshape(-1))
    assert np.isin(wrong, flags).all(), f"missed {np.setdiff1d(wrong, flags)[:5]}"
    if case == "near-ties":
        assert wrong.size > 250  # the test has teeth: one f64 pass gets many wrong
    else:
        assert flags.size <= 1e-4 * rows * cols


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2), st.integers(0, 2), st.integers(1, 40), st.integers(1, 90),
       st.sampled_from([1, 2, 8]), st.integers(-30, 10), st.integers(0, 2 ** 32 - 1))
def test_property_kernel_equals_numpy(fi, fo, rows, cols, r, e, seed) -> None:
    code, out = CODES[fi], CODES[fo]
    rng = np.random.default_rng(seed)
    w = to_code(rng.standard_normal((rows, cols)) * 2.0 ** rng.integers(e - 5, e + 5,
                                                                          (rows, cols)), code)
    A = (rng.standard_normal((r, cols)) * 2.0 ** e).astype(np.float32)
    B = (rng.standard_normal((rows, r))).astype(np.float32)
    B[rng.random((rows, r)) < 0.2] = 0
    scale = rng.uniform(-2, 2, r) if r > 1 and seed % 2 else 1.5
    res = []
    for on in (True, False):
        nr.USE_KERNEL = on
        try:
            o, c = fuse_weight(w, code, A, B, scale, dtype_policy=POLICY[out])
            res.append(np.asarray(o).view(nm.float_format(c).storage).tobytes())
        except FuseError as err:
            res.append(str(err))
        finally:
            nr.USE_KERNEL = True
    assert res[0] == res[1]


def test_kernel_rejects_bad_buffers() -> None:
    w = np.zeros((4, 6), np.uint16)
    A = np.zeros((2, 6))
    B = np.zeros((4, 2))
    rc, cm, out = np.zeros(4), np.zeros(6), np.zeros((4, 6), np.uint16)
    k = nr._kernel.fuse_nearest
    with pytest.raises(ValueError, match="formats"):
        k(w, 3, 6, B, A, rc, cm, 0.0, 0, out, 1)
    with pytest.raises(ValueError, match="whole rows"):
        k(w, 0, 5, B, A, rc, cm, 0.0, 0, out, 1)
    with pytest.raises(ValueError, match="must fit"):
        k(w, 0, 6, B[:3], A, rc, cm, 0.0, 0, out, 1)
    with pytest.raises(ValueError, match="must fit"):
        k(w, 0, 6, B, A, rc, cm, 0.0, 2, out, 1)  # f32 out needs twice the bytes
    with pytest.raises(TypeError):
        k(w, 0, 6, B, A, rc, cm, 0.0, 0, out[:, ::2], 1)  # not contiguous
    with pytest.raises(TypeError):
        k(w, 0, 6, B, A, rc, cm, 0.0, 0, w.tobytes(), 1)  # read-only out


def test_kernel_is_built_where_required() -> None:
    """CI builds the kernel (a C compiler is there): a silent fallback would hide a
    packaging break. Elsewhere the numpy path is a supported configuration."""
    if os.environ.get("LORAKIT_REQUIRE_KERNEL") == "1":
        assert nr.kernel_available()


@pytest.mark.slow
def test_environment_switch_turns_it_off() -> None:
    root = Path(__file__).resolve().parents[2]
    code = "from lorakit.fusion import nearest as n; print(n.USE_KERNEL, n.kernel_available())"
    env = dict(os.environ, PYTHONPATH=str(root), LORAKIT_FUSE_KERNEL="0")
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert got == ["False", "False"]
