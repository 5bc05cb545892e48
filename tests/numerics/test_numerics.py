"""Tests for lorakit.numerics: every rounding and ulp claim checked against
references that share no code with the library (exact fractions, exhaustive
enumeration of 16-bit formats, numpy's float16/float32 casts, mlx's bf16 cast)."""
from __future__ import annotations

import doctest
import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lorakit import numerics
from lorakit.errors import FormatError
from lorakit.numerics import (
    FORMATS,
    NAN_MISMATCH,
    chunks,
    float_format,
    from_storage,
    isnan_bits,
    nan_mismatch,
    round_to_format,
    to_float32,
    to_float64,
    to_storage,
    ulp,
    ulp_distance,
    ulp_error_vs_reference,
    ulp_histogram,
)

BF16, F16, F32 = FORMATS["bfloat16"], FORMATS["float16"], FORMATS["float32"]
SMALL = [BF16, F16]
ALL = [BF16, F16, F32]


# ---------------------------------------------------------------------------
# slow, independent references (pure Python integers and fractions)


def ref_decode(bits: int, fmt) -> float:
    """Value of a bit pattern, from the IEEE 754 definition."""
    p, nb = fmt.precision, fmt.bits
    ebits = nb - p
    sign = -1 if bits >> (nb - 1) else 1
    e = (bits >> (p - 1)) & ((1 << ebits) - 1)
    m = bits & ((1 << (p - 1)) - 1)
    if e == (1 << ebits) - 1:
        return math.nan if m else sign * math.inf
    if e == 0:
        val = Fraction(m) * Fraction(2) ** (fmt.emin - p + 1)
    else:
        val = Fraction((1 << (p - 1)) + m) * Fraction(2) ** (e - fmt.emax - p + 1)
    return float(sign * val) if val else math.copysign(0.0, sign)


def ref_round(x: float, fmt) -> int:
    """Bits of x rounded to nearest, ties to even, computed with exact fractions."""
    p, nb = fmt.precision, fmt.bits
    inf = ((1 << (nb - p)) - 1) << (p - 1)
    sign = (1 << (nb - 1)) if math.copysign(1.0, x) < 0 else 0
    if math.isnan(x):
        return sign | inf | (1 << (p - 2))
    if math.isinf(x):
        return sign | inf
    q = abs(Fraction(x))
    if q == 0:
        return sign
    e = q.numerator.bit_length() - q.denominator.bit_length()
    if Fraction(2) ** e > q:
        e -= 1  # now 2**e <= q < 2**(e+1)
    e = max(e, fmt.emin)
    m = q / Fraction(2) ** (e - p + 1)
    n = m.numerator // m.denominator
    rem = m - n
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and n % 2 == 1):
        n += 1
    if n == 1 << p:
        n >>= 1
        e += 1
    if e > fmt.emax:
        return sign | inf
    if n < 1 << (p - 1):
        return sign | n  # subnormal
    return sign | ((e + fmt.emax) << (p - 1)) | (n - (1 << (p - 1)))


def all_patterns(fmt) -> np.ndarray:
    return np.arange(1 << 16, dtype=np.uint32).astype(fmt.storage)


def nan_ok_equal(got: np.ndarray, want: np.ndarray, fmt) -> None:
    """Bits equal, except that any NaN must meet the canonical quiet NaN, sign kept."""
    got, want = np.asarray(got).astype(np.int64), np.asarray(want).astype(np.int64)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (
        f"{bad.size} mismatches, first at {bad[:5]}: got {[hex(v) for v in got[bad[:5]]]}"
        f" want {[hex(v) for v in want[bad[:5]]]}"
    )


def neighbours(fmt, ks: np.ndarray):
    """lo = value(k), hi = value(k+1) (2**(emax+1) in place of inf), mid between."""
    lo = to_float64(ks.astype(fmt.storage), fmt)
    hi = to_float64((ks + 1).astype(fmt.storage), fmt)
    hi[np.isinf(hi)] = 2.0 ** (fmt.emax + 1)
    return lo, hi, (lo + hi) / 2  # exact: p + 1 <= 25 bits


# ---------------------------------------------------------------------------
# formats


def test_format_table():
    assert (BF16.precision, BF16.emin, BF16.emax, BF16.bits, BF16.itemsize) == (8, -126, 127, 16, 2)
    assert (F16.precision, F16.emin, F16.emax, F16.storage) == (11, -14, 15, np.dtype(np.uint16))
    assert (F32.precision, F32.emin, F32.emax, F32.storage) == (24, -126, 127, np.dtype(np.uint32))
    assert [f.safetensors for f in ALL] == ["BF16", "F16", "F32"]
    assert BF16.max_bits == 0x7F7F and F16.max_bits == 0x7BFF and F32.max_bits == 0x7F7FFFFF
    assert F16.max_value == 65504.0
    assert F32.max_value == float(np.finfo(np.float32).max)
    assert F16.min_subnormal == 2.0**-24 and BF16.min_subnormal == 2.0**-133
    for fmt in ALL:
        assert ref_decode(fmt.max_bits, fmt) == fmt.max_value
        assert ref_decode(1, fmt) == fmt.min_subnormal
        assert ref_decode(1 << fmt.mantissa_bits, fmt) == fmt.min_normal
        assert math.isnan(ref_decode(fmt.quiet_nan_bits, fmt))


@pytest.mark.parametrize(
    "spec, name",
    [
        ("bfloat16", "bfloat16"), ("BF16", "bfloat16"), ("bf16", "bfloat16"),
        ("float16", "float16"), ("F16", "float16"), ("fp16", "float16"),
        (np.float16, "float16"), (np.dtype("float16"), "float16"),
        ("F32", "float32"), (np.float32, "float32"), ("torch.bfloat16", "bfloat16"),
        ("mlx.core.float16", "float16"),
    ],
)
def test_float_format_aliases(spec, name):
    assert float_format(spec) is FORMATS[name]


def test_float_format_mlx_dtypes():
    mx = pytest.importorskip("mlx.core")
    assert float_format(mx.bfloat16) is BF16
    assert float_format(mx.float16) is F16
    assert float_format(mx.float32) is F32


@pytest.mark.parametrize("spec", ["float64", np.float64, "F8_E4M3", "int16", 3])
def test_float_format_rejects(spec):
    with pytest.raises(FormatError):
        float_format(spec)


# ---------------------------------------------------------------------------
# decoding


@pytest.mark.parametrize("fmt", SMALL, ids=lambda f: f.name)
def test_decode_exhaustive(fmt):
    bits = all_patterns(fmt)
    want = np.array([ref_decode(int(b), fmt) for b in bits])
    got64 = to_float64(bits, fmt)
    got32 = to_float32(bits, fmt)
    assert got32.dtype == np.float32 and got64.dtype == np.float64
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got64), nan) and np.array_equal(isnan_bits(bits, fmt), nan)
    assert np.array_equal(got64[~nan], want[~nan])
    assert np.array_equal(np.signbit(got64[~nan]), np.signbit(want[~nan]))  # -0.0 kept
    assert np.array_equal(got32[~nan].astype(np.float64), want[~nan])


def test_decode_float32_bits():
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 1 << 32, 20_000, dtype=np.uint64).astype(np.uint32)
    got = to_float64(bits, F32)
    want = np.array([ref_decode(int(b), F32) for b in bits[:2000]])
    nan = np.isnan(want)
    assert np.array_equal(got[:2000][~nan], want[~nan])
    assert np.array_equal(np.isnan(got[:2000]), nan)
    assert np.array_equal(to_float32(bits, F32).view(np.uint32), bits)


def test_from_and_to_storage():
    h = np.array([1.5, -0.0, 65504.0, np.inf], np.float16)
    bits = to_storage(h, F16)
    assert bits.dtype == np.uint16 and np.shares_memory(bits, h)  # zero-copy view
    assert from_storage(bits, F16).dtype == np.float16
    assert np.array_equal(from_storage(bits, F16), h)
    bf = to_storage(np.array([1.0, -2.5, 1.5 * 2.0**127, np.nan], np.float32), BF16)
    assert [hex(v) for v in bf.tolist()] == ["0x3f80", "0xc020", "0x7f40", "0x7fc0"]
    assert from_storage(bf, BF16).dtype == np.float32
    assert np.array_equal(to_storage(np.array([0.25, -4.0]), F32).view(np.float32), [0.25, -4.0])
    # float inputs to the decoders are accepted only when exact in the format
    assert to_float32(np.array([1.0, 2.0**-133], np.float32), BF16).tolist() == [1.0, 2.0**-133]
    with pytest.raises(FormatError, match="not exactly representable"):
        to_storage(np.array([1.0, 1.0 + 2.0**-10], np.float32), BF16)
    with pytest.raises(FormatError):
        to_float64(np.array([0.1]), F32)
    with pytest.raises(FormatError):
        to_float32(np.array([1, 2], np.uint8), BF16)


# ---------------------------------------------------------------------------
# rounding: exhaustive over 16-bit formats


@pytest.mark.parametrize("fmt", SMALL, ids=lambda f: f.name)
@pytest.mark.parametrize("src", [np.float64, np.float32])
def test_roundtrip_every_pattern(fmt, src):
    bits = all_patterns(fmt)
    vals = to_float64(bits, fmt).astype(src)
    got = round_to_format(vals, fmt)
    assert got.dtype == fmt.storage
    nan = np.isnan(vals)
    assert np.array_equal(got[~nan], bits[~nan])
    sign = bits[nan] & fmt.sign_mask
    assert np.array_equal(got[nan], sign | fmt.quiet_nan_bits)  # quiet, sign kept


@pytest.mark.parametrize("fmt", SMALL, ids=lambda f: f.name)
@pytest.mark.parametrize("src", [np.float64, np.float32])
def test_every_midpoint_and_its_neighbours(fmt, src):
    """Ties go to the even pattern, one step either side goes to the nearer value."""
    ks = np.arange(fmt.inf_bits, dtype=np.int64)  # every non-negative finite pattern
    lo, hi, mid = neighbours(fmt, ks)
    mid = mid.astype(src)
    assert np.array_equal(mid.astype(np.float64), (lo + hi) / 2)  # still exact in src
    even = np.where(ks % 2 == 0, ks, ks + 1)
    below = np.nextafter(mid, src(0))
    above = np.nextafter(mid, src(np.inf))
    for sgn in (1, -1):
        sbit = 0 if sgn == 1 else fmt.sign_mask
        nan_ok_equal(round_to_format(sgn * mid, fmt), even | sbit, fmt)
        nan_ok_equal(round_to_format(sgn * below, fmt), ks | sbit, fmt)
        nan_ok_equal(round_to_format(sgn * above, fmt), (ks + 1) | sbit, fmt)


def test_every_f16_midpoint_against_numpy():
    ks = np.arange(F16.inf_bits, dtype=np.int64)
    _, _, mid = neighbours(F16, ks)
    x = np.concatenate([mid, np.nextafter(mid, 0), np.nextafter(mid, np.inf)])
    x = np.concatenate([x, -x])
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    assert np.array_equal(round_to_format(x, F16), want)


def test_f32_midpoints_random_patterns():
    rng = np.random.default_rng(2)
    ks = rng.integers(0, F32.inf_bits, 400_000, dtype=np.int64)
    ks[:4] = [0, 1, F32.max_bits - 1, F32.max_bits]
    lo, hi, mid = neighbours(F32, ks)
    even = np.where(ks % 2 == 0, ks, ks + 1)
    below, above = np.nextafter(mid, 0), np.nextafter(mid, np.inf)
    assert np.array_equal(round_to_format(mid, F32), even)
    assert np.array_equal(round_to_format(-below, F32), ks | F32.sign_mask)
    assert np.array_equal(round_to_format(above, F32), ks + 1)
    x = np.concatenate([mid, below, above, lo, -mid])
    with np.errstate(over="ignore"):
        want = x.astype(np.float32).view(np.uint32)  # hardware cast: correctly rounded
    assert np.array_equal(round_to_format(x, F32), want)


# ---------------------------------------------------------------------------
# rounding: independent references on random inputs


def random_f64(rng, n: int, lo_exp: int, hi_exp: int) -> np.ndarray:
    """Random signs, exponents in [lo_exp, hi_exp], full 52-bit fractions,
    a quarter of them pushed onto or next to a 16-bit-format midpoint."""
    e = rng.integers(lo_exp + 1023, hi_exp + 1023 + 1, n, dtype=np.int64).clip(0, 2046)
    frac = rng.integers(0, 1 << 52, n, dtype=np.int64)
    near = rng.random(n) < 0.25
    # clear low fraction bits, set the bit below a bf16/fp16/f32 lsb, then nudge by -1/0/+1
    keep = rng.choice([45, 42, 29], n)
    frac = np.where(near, ((frac >> keep) << keep) | (1 << (keep - 1)), frac)
    frac = np.where(near, frac + rng.integers(-1, 2, n), frac) & ((1 << 52) - 1)
    sign = rng.integers(0, 2, n, dtype=np.int64) << 63
    return ((e << 52) | frac | sign).astype(np.uint64).view(np.float64)


def special_f64() -> np.ndarray:
    return np.array(
        [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 5e-324, -5e-324, 2.0**-1022,
         1e300, -1e300, 1.0, 65504.0, 65519.99, 65520.0, 3.3895313892515355e38,
         3.4028235677973366e38, 3.402823669209385e38, 2.0**-24, 2.0**-25, 2.0**-133,
         2.0**-134, 2.0**-149, 2.0**-150, 1.5 * 2.0**-149, 2.0**-126 - 2.0**-134]
    )


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_random_against_fraction_reference(fmt):
    rng = np.random.default_rng(3)
    x = np.concatenate([
        special_f64(),
        random_f64(rng, 1500, fmt.emin - fmt.precision - 2, fmt.emax + 1),  # the format's range
        random_f64(rng, 300, -1074, 1023),  # anywhere
    ])
    want = np.array([ref_round(float(v), fmt) for v in x], dtype=np.int64)
    nan_ok_equal(round_to_format(x, fmt), want, fmt)
    with np.errstate(over="ignore"):
        x32 = x.astype(np.float32)
    want32 = np.array([ref_round(float(v), fmt) for v in x32], dtype=np.int64)
    nan_ok_equal(round_to_format(x32, fmt), want32, fmt)


@settings(max_examples=300, deadline=None)
@given(x=st.floats(allow_nan=True, allow_infinity=True, width=64), i=st.integers(0, 2))
def test_hypothesis_against_fraction_reference(x, i):
    fmt = ALL[i]
    got = round_to_format(np.array([x]), fmt)
    assert int(got[0]) == ref_round(x, fmt)


@settings(max_examples=200, deadline=None)
@given(x=st.floats(min_value=-1e6, max_value=1e6, width=32), i=st.integers(0, 2))
def test_hypothesis_float32_input(x, i):
    fmt = ALL[i]
    got = round_to_format(np.array([x], np.float32), fmt)
    assert int(got[0]) == ref_round(float(np.float32(x)), fmt)


@pytest.mark.parametrize("fmt, npdt", [(F16, np.float16), (F32, np.float32)], ids=["f16", "f32"])
def test_random_against_numpy_cast(fmt, npdt):
    rng = np.random.default_rng(4)
    x = np.concatenate([
        special_f64(),
        random_f64(rng, 1_000_000, fmt.emin - fmt.precision - 2, fmt.emax + 1),
    ])
    with np.errstate(over="ignore"):
        want = x.astype(npdt).view(fmt.storage)
    got = round_to_format(x, fmt)
    nan = np.isnan(x)
    assert np.array_equal(got[~nan], want[~nan])
    if fmt is F16:  # float32 -> float16 as well
        with np.errstate(over="ignore"):
            x32 = x.astype(np.float32)
            want = x32.astype(np.float16).view(np.uint16)
        assert np.array_equal(round_to_format(x32, F16)[~nan], want[~nan])


def test_f32_to_bf16_against_mlx():
    mx = pytest.importorskip("mlx.core")
    rng = np.random.default_rng(5)
    n = 1_000_000
    hi = rng.integers(0, 1 << 16, n, dtype=np.uint32)
    lows = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)
    lo = np.where(rng.random(n) < 0.6, rng.choice(lows, n), rng.integers(0, 1 << 16, n, dtype=np.uint32))
    x = ((hi << 16) | lo).view(np.float32)
    want = np.array(mx.array(x).astype(mx.bfloat16).view(mx.uint16))
    got = round_to_format(x, BF16)
    nan = np.isnan(x)
    assert nan.sum() > 100  # NaN patterns are in the sample
    assert np.array_equal(got[~nan], want[~nan])
    assert np.array_equal(isnan_bits(got, BF16), nan)
    assert np.array_equal(got[nan], (got[nan] & 0x8000) | 0x7FC0)


def test_f64_rounds_once_not_through_f32():
    # 1 + 2**-8 + 2**-40: through float32 it becomes the tie 1 + 2**-8 and then 1.0;
    # rounded once it is above the tie and must go up to 1 + 2**-7.
    x = np.array([1 + 2.0**-8 + 2.0**-40, -(1 + 2.0**-8 + 2.0**-40)])
    assert round_to_format(x, BF16).tolist() == [0x3F81, 0xBF81]
    assert round_to_format(x.astype(np.float32), BF16).tolist() == [0x3F80, 0xBF80]


# ---------------------------------------------------------------------------
# rounding: named edge cases


@pytest.mark.parametrize(
    "fmt, x, want",
    [
        # ties to even
        (BF16, 1 + 2.0**-8, 0x3F80), (BF16, 1 + 3 * 2.0**-8, 0x3F82),
        (F16, 2049.0, 0x6800), (F16, 2051.0, 0x6802), (F32, 1 + 2.0**-24, 0x3F800000),
        # overflow boundary: max + half ulp goes to inf, anything below it to max
        (BF16, 3.3895313892515355e38, 0x7F7F),
        (BF16, (2 - 2.0**-8) * 2.0**127, 0x7F80),
        (BF16, np.nextafter((2 - 2.0**-8) * 2.0**127, 0), 0x7F7F),
        (BF16, -(2 - 2.0**-8) * 2.0**127, 0xFF80),
        (F16, 65504.0, 0x7BFF), (F16, 65519.99999999999, 0x7BFF), (F16, 65520.0, 0x7C00),
        (F16, -65520.0, 0xFC00), (F16, 1e10, 0x7C00),
        (F32, (2 - 2.0**-24) * 2.0**127, 0x7F800000),
        (F32, np.nextafter((2 - 2.0**-24) * 2.0**127, 0), 0x7F7FFFFF),
        # signed zeros and underflow to zero keep the sign
        (BF16, 0.0, 0x0000), (BF16, -0.0, 0x8000), (F16, -1e-300, 0x8000),
        (F32, -5e-324, 0x80000000), (F16, 2.0**-25, 0x0000), (F16, -(2.0**-25), 0x8000),
        # subnormals: ties to even, and the carry into the smallest normal
        (F16, np.nextafter(2.0**-25, 1), 0x0001), (F16, 1.5 * 2.0**-24, 0x0002),
        (F16, 2.5 * 2.0**-24, 0x0002), (BF16, 2.0**-134, 0x0000), (BF16, 3 * 2.0**-134, 0x0002),
        (BF16, 2.0**-126 - 2.0**-134, 0x0080), (BF16, 2.0**-126 - 2.0**-133, 0x007F),
        (F32, 2.0**-150, 0x0), (F32, 3 * 2.0**-150, 0x2), (F32, 2.0**-149, 0x1),
        # infinities and NaN
        (BF16, np.inf, 0x7F80), (F16, -np.inf, 0xFC00), (F32, np.nan, 0x7FC00000),
        (BF16, -np.nan, 0xFFC0), (F16, np.nan, 0x7E00),
    ],
)
def test_named_cases(fmt, x, want):
    for src in (np.float64, np.float32):
        xs = np.array([x], np.float64)
        if src is np.float32:
            with np.errstate(over="ignore"):
                if xs.astype(np.float32)[0] != xs[0] and not np.isnan(xs[0]):
                    continue  # not representable in float32: float64-only case
            xs = xs.astype(np.float32)
        got = int(round_to_format(xs, fmt)[0])
        assert got == want, (fmt.name, src.__name__, x, hex(got), hex(want))
        assert ref_round(float(xs[0]), fmt) == want  # the reference agrees


def test_signaling_nan_becomes_quiet():
    x = np.array([0x7F800001, 0xFFFFFFFF, 0x7FA00000], np.uint32).view(np.float32)
    assert round_to_format(x, BF16).tolist() == [0x7FC0, 0xFFC0, 0x7FC0]
    assert round_to_format(x, F32).tolist() == [0x7FC00000, 0xFFC00000, 0x7FC00000]
    assert round_to_format(x, F16).tolist() == [0x7E00, 0xFE00, 0x7E00]
    h = np.array([0x7C01, 0xFE01], np.uint16).view(np.float16)
    assert round_to_format(h, F16).tolist() == [0x7E00, 0xFE00]


def test_shapes_pieces_and_out():
    rng = np.random.default_rng(6)
    pool = np.concatenate([special_f64(), random_f64(rng, 1000, -150, 130)])
    want_pool = {fmt.name: np.array([ref_round(float(v), fmt) for v in pool]) for fmt in ALL}
    # far more elements than one internal piece, specials scattered across piece borders
    idx = rng.integers(0, pool.size, 3 * (1 << 16) + 1234)
    x = pool[idx]
    for fmt in ALL:
        nan_ok_equal(round_to_format(x, fmt), want_pool[fmt.name][idx], fmt)
    # any shape, non-contiguous input, 0-d and empty arrays, preallocated out
    x3 = x[: 2 * 3 * 5000].reshape(2, 3, 5000)
    xt = x3.transpose(2, 0, 1)
    got = round_to_format(xt, BF16)
    assert got.shape == (5000, 2, 3)
    assert np.array_equal(got, round_to_format(x3, BF16).transpose(2, 0, 1))
    assert round_to_format(np.float64(1.0), BF16).shape == ()
    assert round_to_format(np.zeros((0, 4)), F16).shape == (0, 4)
    out = np.empty(x3.shape, np.uint16)
    assert round_to_format(x3, F16, out=out) is out
    assert np.array_equal(out, round_to_format(x3, F16))
    with pytest.raises(FormatError):
        round_to_format(x3, F16, out=np.empty(x3.shape, np.uint32))
    with pytest.raises(FormatError):
        round_to_format(np.arange(4), BF16)  # integers are not values


# ---------------------------------------------------------------------------
# ulp distance


def rank_reference(fmt):
    """Rank of each pattern among the sorted distinct values (+0 and -0 one value)."""
    vals = to_float64(all_patterns(fmt), fmt)
    finite_or_inf = vals[~np.isnan(vals)]
    line = np.unique(finite_or_inf)
    return vals, line


@pytest.mark.parametrize("fmt", SMALL, ids=lambda f: f.name)
def test_ulp_distance_against_rank(fmt):
    vals, line = rank_reference(fmt)
    rng = np.random.default_rng(7)
    bits = all_patterns(fmt)
    ok = ~np.isnan(vals)
    a = rng.choice(bits[ok], 500_000)
    b = rng.choice(bits[ok], 500_000)
    # also: each pattern against its mirror image, and each against its successor
    pos = bits[: fmt.inf_bits]
    mirror = pos | fmt.sign_mask
    a = np.concatenate([a, pos, pos, mirror])
    b = np.concatenate([b, mirror, pos + 1, mirror + 1])
    ra = np.searchsorted(line, to_float64(a, fmt))
    rb = np.searchsorted(line, to_float64(b, fmt))
    d = ulp_distance(a, b, fmt)
    assert d.dtype == np.int64
    assert np.array_equal(d, np.abs(ra - rb))
    assert np.array_equal(d, ulp_distance(b, a, fmt))  # symmetric


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_ulp_distance_landmarks(fmt):
    sb, inf, mx = fmt.sign_mask, fmt.inf_bits, fmt.max_bits
    pairs = [
        (0, sb, 0),  # +0 and -0
        (1, sb | 1, 2),  # +min_subnormal and -min_subnormal
        (1, 0, 1), (sb | 1, sb, 1), (sb | 1, 0, 1),
        (mx, inf, 1), (sb | inf, inf, 2 * inf), (sb | mx, mx, 2 * mx),
        (1 << fmt.mantissa_bits, (1 << fmt.mantissa_bits) - 1, 1),  # normal/subnormal border
    ]
    a = np.array([p[0] for p in pairs], np.uint64).astype(fmt.storage)
    b = np.array([p[1] for p in pairs], np.uint64).astype(fmt.storage)
    assert ulp_distance(a, b, fmt).tolist() == [p[2] for p in pairs]


def test_ulp_distance_float32_random():
    rng = np.random.default_rng(8)
    n = 200_000
    x = random_f64(rng, n, -150, 127).astype(np.float32)
    x[:3] = [0.0, -0.0, -1.4e-45]
    up = np.nextafter(x, np.float32(np.inf))
    down = np.nextafter(x, np.float32(-np.inf))
    bits = lambda v: v.view(np.uint32)  # noqa: E731
    fin = np.isfinite(up) & np.isfinite(down)
    assert np.all(ulp_distance(bits(x[fin]), bits(up[fin]), F32) <= 1)  # nextafter(-0.) is +min
    nz = fin & (x != 0)
    assert np.all(ulp_distance(bits(x[nz]), bits(up[nz]), F32) == 1)
    assert np.all(ulp_distance(bits(down[nz]), bits(up[nz]), F32) == 2)
    # reference in Python integers on a sample
    y = random_f64(rng, n, -150, 127).astype(np.float32)

    def line(u: int) -> int:
        return -(u & 0x7FFFFFFF) if u >> 31 else u

    d = ulp_distance(bits(x), bits(y), F32)
    for i in rng.integers(0, n, 3000):
        want = abs(line(int(bits(x)[i])) - line(int(bits(y)[i])))
        if np.isnan(x[i]) or np.isnan(y[i]):
            continue
        assert d[i] == want
    # accepts float32 arrays directly, and broadcasts
    assert np.array_equal(ulp_distance(x, y, F32), d)
    assert ulp_distance(np.float32(1.0), np.array([1.0, 2.0], np.float32), F32).tolist() == [0, 1 << 23]


def test_ulp_distance_nan():
    a = np.array([0x7FC0, 0x7F81, 0x7FC0, 0x7F7F, 0xFFC0, 0x3F80], np.uint16)
    b = np.array([0xFFFF, 0x7FC0, 0x3F80, 0x7F80, 0x0000, 0x3F81], np.uint16)
    d = ulp_distance(a, b, BF16)
    assert d.tolist() == [0, 0, NAN_MISMATCH, 1, NAN_MISMATCH, 1]
    assert nan_mismatch(a, b, BF16).tolist() == [False, False, True, False, True, False]
    assert np.array_equal(d == NAN_MISMATCH, nan_mismatch(a, b, BF16))
    assert np.count_nonzero(d > 0) == 4  # a NaN mismatch counts as a difference
    h = np.array([np.nan, 1.0], np.float16)
    assert ulp_distance(h, np.array([1.0, np.nan], np.float16), F16).tolist() == [NAN_MISMATCH] * 2


# ---------------------------------------------------------------------------
# ulp and error against a reference


@pytest.mark.parametrize("fmt", SMALL, ids=lambda f: f.name)
def test_ulp_is_the_spacing_above_every_value(fmt):
    ks = np.arange(fmt.max_bits, dtype=np.int64)  # every finite x >= 0 below max
    lo, hi, _ = neighbours(fmt, ks)
    assert np.array_equal(ulp(lo, fmt), hi - lo)
    assert np.array_equal(ulp(-lo, fmt), hi - lo)


def test_ulp_values():
    assert ulp(np.array([1.0, 1.999, 2.0, 0.0, -3.0]), BF16).tolist() == [2.0**-7, 2.0**-7, 2.0**-6, 2.0**-133, 2.0**-6]
    assert ulp(np.array([65504.0, 1e9, np.inf, 2.0**-20, 2.0**-14]), F16).tolist() == [32.0, 32.0, 32.0, 2.0**-24, 2.0**-24]
    assert ulp(np.array([1.0, 2.0**-140, 5e-324]), F32).tolist() == [2.0**-23, 2.0**-149, 2.0**-149]


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_ulp_error_of_correct_rounding(fmt):
    rng = np.random.default_rng(9)
    x = random_f64(rng, 300_000, fmt.emin - fmt.precision, fmt.emax)
    with np.errstate(over="ignore"):
        x = x[np.abs(x) < fmt.max_value]  # keep overflow out: it is inf ulps by design
    err = ulp_error_vs_reference(round_to_format(x, fmt), x, fmt)
    assert err.max() <= 0.5
    # exactly 0.5 at ties, and only there
    ks = rng.integers(0, fmt.max_bits, 50_000)
    _, _, mid = neighbours(fmt, ks)
    e_mid = ulp_error_vs_reference(round_to_format(mid, fmt), mid, fmt)
    assert np.all(e_mid == 0.5)
    off = np.nextafter(mid, np.inf)
    assert np.all(ulp_error_vs_reference(round_to_format(off, fmt), off, fmt) < 0.5)
    # exact against fractions on a sample, including values that are not the rounding
    bits = round_to_format(x[:1500], fmt)
    bits = (bits.astype(np.int64) + rng.integers(-2, 3, bits.size)).astype(fmt.storage)
    got = ulp_error_vs_reference(bits, x[:1500], fmt)
    for b, r, g in zip(bits.tolist(), x[:1500].tolist(), got.tolist()):
        v = ref_decode(b, fmt)
        if math.isinf(v) or math.isnan(v):
            continue
        want = abs(Fraction(v) - Fraction(r)) / Fraction(ulp(np.array([r]), fmt)[0])
        assert g == float(want), (hex(b), r)


def test_ulp_error_specials():
    bits = round_to_format(np.array([np.inf, np.nan, np.nan, np.inf, 1.0, -np.inf]), BF16)
    ref = np.array([np.inf, np.nan, 1.0, 3.4e38, 1.0, np.inf])
    err = ulp_error_vs_reference(bits, ref, BF16)
    assert err[0] == 0 and err[1] == 0 and np.isnan(err[2])
    assert err[3] == np.inf and err[4] == 0 and err[5] == np.inf
    with pytest.raises(FormatError):
        ulp_error_vs_reference(bits, ref[:2], BF16)


# ---------------------------------------------------------------------------
# histogram and chunks


def test_ulp_histogram():
    d = np.array([0, 0, 0, 1, 2, 3, 3, 4, 7, 8, 15, 16, 1023, 1024, 10**9, NAN_MISMATCH])
    labels, counts = ulp_histogram(d)
    assert labels[:7] == ["0", "1", "2", "3", "4-7", "8-15", "16-31"]
    assert labels[-3:] == ["512-1023", ">1023", "nan"]
    got = dict(zip(labels, counts.tolist()))
    assert got["0"] == 3 and got["1"] == 1 and got["2"] == 1 and got["3"] == 2
    assert got["4-7"] == 2 and got["8-15"] == 2 and got["16-31"] == 1 and got["512-1023"] == 1
    assert got[">1023"] == 2 and got["nan"] == 1
    assert counts.sum() == d.size and counts.dtype == np.int64
    labels, counts = ulp_histogram(np.zeros(5, np.uint8), max_bin=3)
    assert labels == ["0", "1", "2", "3", ">3", "nan"] and counts.tolist() == [5, 0, 0, 0, 0, 0]
    big = np.random.default_rng(10).integers(0, 40, 300_000)
    _, counts = ulp_histogram(big, max_bin=15)
    assert counts.tolist()[:4] == [np.count_nonzero(big == k) for k in range(4)]
    assert counts[6] == np.count_nonzero(big > 15) and counts.sum() == big.size
    for bad in (0, 2, 10, 1000):
        with pytest.raises(ValueError):
            ulp_histogram(d, max_bin=bad)
    with pytest.raises(FormatError):
        ulp_histogram(np.array([-1, 2]))
    with pytest.raises(FormatError):
        ulp_histogram(np.array([0.5]))


@pytest.mark.parametrize("n_rows, row_elems, target", [(10, 3, 7), (5, 100, 10), (0, 4, 8), (1000, 1, 1 << 20), (7, 2, 14)])
def test_chunks(n_rows, row_elems, target):
    pieces = list(chunks(n_rows, row_elems, target_elems=target))
    covered = [r for s in pieces for r in range(s.start, s.stop)]
    assert covered == list(range(n_rows))
    for s in pieces:
        rows = s.stop - s.start
        assert rows >= 1 and (rows == 1 or rows * row_elems <= target)
    if n_rows:
        assert (pieces[0].stop - pieces[0].start) == min(n_rows, max(1, target // row_elems))


def test_docstring_examples():
    result = doctest.testmod(numerics, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 10 and result.failed == 0
