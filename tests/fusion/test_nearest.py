"""The ``nearest`` rounding (lorakit/fusion/nearest.py) against exact rationals: every
in/out format pair, per-rank-column scales, exact ties, near ties, cancellation to the last
bit, subnormal and overflowing results, zeros, odd and non-contiguous shapes."""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from lorakit import numerics as nm
from lorakit.errors import FuseError
from lorakit.fusion import nearest as nr
from lorakit.fusion.core import fuse_weight, output_code

CODES = ("BF16", "F16", "F32")
POLICY = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def to_code(values: np.ndarray, code: str) -> np.ndarray:
    """Raw storage (fuse_weight's input convention) of f64 values, rounded correctly."""
    bits = nm.round_to_format(np.asarray(values, np.float64), nm.float_format(code))
    return bits if code == "BF16" else bits.view(np.float16 if code == "F16" else np.float32)


def fused(w, code, A, B, scale, policy="preserve"):
    """fuse_weight's result as bits, or None where it refuses (a non-finite result)."""
    try:
        out, oc = fuse_weight(w, code, A, B, scale, dtype_policy=policy, name="t")
    except FuseError:
        return None
    return np.asarray(out).view(nm.float_format(oc).storage).copy()


def assert_exact(w, code, A, B, scale, policy="preserve"):
    """Every element of the fuse is the exact rational W + sum_k s_k B A, rounded by hand."""
    got = fused(w, code, A, B, scale, policy)
    fi = nm.float_format(code)
    fo = nm.float_format(output_code(code, policy))
    wv = nm.to_float64(np.asarray(w).view(fi.storage), fi)
    sk = np.broadcast_to(np.asarray(scale, np.float64), (A.shape[0],))
    for i in range(w.shape[0]):
        for j in range(w.shape[1]):
            exact = Fraction(float(wv[i, j])) + sum(
                Fraction(float(sk[k])) * Fraction(float(B[i, k])) * Fraction(float(A[k, j]))
                for k in range(A.shape[0]))
            if exact == 0:  # the sign of an exact zero follows the f64 sum
                assert int(got[i, j]) & fo.abs_mask == 0
            else:
                assert int(got[i, j]) == exact_round(exact, fo), (i, j, float(exact))
    return got


def pieces(seed, rows, cols, r, code, wscale=0.05, dscale=0.01):
    rng = np.random.default_rng(seed)
    w = to_code(rng.standard_normal((rows, cols)) * wscale, code)
    A = (rng.standard_normal((r, cols)) * dscale).astype(np.float32)
    B = (rng.standard_normal((rows, r)) * dscale).astype(np.float32)
    return w, A, B


@pytest.mark.parametrize("code,out", [("BF16", "BF16"), ("F16", "F16"), ("F32", "F32"),
                                      ("F32", "BF16"), ("BF16", "F16")])
def test_exact_and_near_ties(code, out) -> None:
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
    got = fused(w, code, A, B, 1.0, POLICY[out])
    # and the ties went to even: the exact ties (hair 0) land on even significands
    tie_cols = np.flatnonzero(hair == 0)
    if code == out:
        assert np.all(got[:, tie_cols] & 1 == 0)


@pytest.mark.parametrize("code,out", [("BF16", "BF16"), ("F16", "F16"), ("F32", "BF16"),
                                      ("F32", "F16")])
def test_float32_lands_on_a_tie(code, out) -> None:
    """bfloat16 and float16 results round through float32, which is exact unless float32
    lands on a tie of the output: W + delta a hair off a tie (2**-26 and 2**-25: outside
    the near-tie band, inside half a float32 ulp) must round away from it, by its side."""
    fo = nm.float_format(out)
    rng = np.random.default_rng(3)
    rows, cols = 12, 16
    on_grid = nm.to_float64(nm.round_to_format(rng.uniform(1, 2, (rows, cols)), fo), fo)
    w = to_code(on_grid, code)  # W on the output's grid: W +- half its ulp is a tie
    hair = rng.choice([2.0 ** -26, -(2.0 ** -26), 2.0 ** -25 * 0.75, -(2.0 ** -25 * 0.75)], cols)
    A = np.stack([np.full(cols, 2.0 ** -fo.precision), hair]).astype(np.float32)
    B = np.stack([rng.choice([-1.0, 1.0], rows), np.ones(rows)], 1).astype(np.float32)
    assert_exact(w, code, A, B, 1.0, POLICY[out])


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
def test_against_exact_rationals(code, out) -> None:
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
    got = fused(w, code, A, B, scale, POLICY[out])
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
def test_cancellation_to_the_last_bit(code) -> None:
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
        assert_exact(w[i:i + 1], code, A, B, 1.0)
        assert_exact(w[i:i + 1], code, A, B, 1.0, "bfloat16")
        B[0, 1] = 0.0  # exactly zero
        assert_exact(w[i:i + 1], code, A, B, 1.0)


@pytest.mark.parametrize("code", CODES)
def test_cancellation_inside_the_sum(code) -> None:
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
    got = fused(w, code, A, B, 1.0)
    for i in range(rows):
        for j in range(0, cols, 37):
            exact = Fraction(float(wv[i, j])) + Fraction(float(A[1, j]))
            assert int(got[i, j]) == exact_round(exact, f), (i, j)


@pytest.mark.parametrize("out", CODES)
def test_cancellation_after_the_weight(out) -> None:
    """W + p - p with |p| ~ 2**10 and |W| ~ 2**-40: a sum that adds W first (the
    kernel's order) keeps W only to p's ulp (2**-42), many ulps of the result off,
    and far from any tie: only the cancellation bound flags these."""
    rng = np.random.default_rng(8)
    rows, cols = 4, 520
    w = to_code(rng.standard_normal((rows, cols)) * 2.0 ** -40, "F32")
    p = (rng.uniform(1, 2, cols) * 2.0 ** 10).astype(np.float32)
    A = np.stack([p, p])
    B = np.tile(np.array([[1.0, -1.0]], np.float32), (rows, 1))
    got = fused(w, "F32", A, B, 1.0, POLICY[out])
    want = nm.round_to_format(w.astype(np.float64), nm.float_format(out))
    assert np.array_equal(got, want)  # the exact value is W itself


def test_subnormal_and_overflowing_results() -> None:
    rng = np.random.default_rng(4)
    rows, cols = 40, 50
    # f16 subnormals: weights and deltas around 2**-20
    w = to_code(rng.standard_normal((rows, cols)) * 2.0 ** -20, "F16")
    A = (rng.standard_normal((4, cols)) * 2.0 ** -10).astype(np.float32)
    B = (rng.standard_normal((rows, 4)) * 2.0 ** -12).astype(np.float32)
    assert_exact(w, "F16", A, B, 1.0)
    # bf16 subnormals out of f32 weights
    w32 = to_code(rng.standard_normal((rows, cols)) * 2.0 ** -128, "F32")
    assert_exact(w32, "F32", A * 2.0 ** -118, B, 1.0, "bfloat16")
    # overflow: f32 weights near f16's max fused into f16 (max + half ulp and over
    # become inf: fuse_weight refuses that; the raw pass writes inf)
    w = to_code(np.full((rows, cols), 65504.0) * rng.choice([-1, 1], (rows, cols)), "F32")
    A = np.full((1, cols), 1.0, np.float32)
    B = rng.choice([0.0, 15.0, 16.0, 17.0, -16.0, 31.99], (rows, 1)).astype(np.float32)
    assert fused(w, "F32", A, B, 1.0, "float16") is None
    f32, f16 = nm.float_format("F32"), nm.float_format("F16")
    out = nr._fuse_nearest(w.view(np.uint32), f32, A, B, 1.0, None, f16)
    assert (out == 0x7C00).any() and (out == 0x7BFF).any()


def test_zero_weights_and_zero_adapter() -> None:
    w = to_code(np.zeros((5, 7)), "BF16")
    A = np.zeros((2, 7), np.float32)
    B = np.zeros((5, 2), np.float32)
    assert np.all(fused(w, "BF16", A, B, 1.0) == 0)
    w = to_code(-np.zeros((5, 7)), "F16")  # -0 + 0: +0 in round to nearest
    fused(w, "F16", A, B, 1.0)
    fused(w, "F16", A[:0], B[:, :0], 1.0)  # rank 0


@pytest.mark.parametrize("shape", [(1, 1), (1, 1025), (700, 3), (513, 517)])
def test_odd_and_non_contiguous_shapes(shape) -> None:
    rows, cols = shape
    w, A, B = pieces(rows * cols, rows, 2 * cols, 8, "BF16")
    w_nc = w[:, ::2]  # a strided view
    assert not w_nc.flags.c_contiguous or cols == 1
    got = fused(w_nc, "BF16", A[:, ::2].copy(), B, 0.5)
    ref, _ = fuse_weight(np.ascontiguousarray(w_nc), "BF16", np.asfortranarray(A[:, ::2]),
                         np.asfortranarray(B), 0.5)
    assert np.array_equal(got, ref)
