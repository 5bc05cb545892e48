"""Exact distances in ulps between values of one format, and their histograms."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ArgumentError, FormatError
from .formats import _F64_EXP, _PIECE, _U64, NAN_MISMATCH, FloatFormat, float_format
from .values import _as_bits, isnan_bits, round_to_format, to_float64  # noqa: F401  (doctests)

__all__ = ["ulp", "ulp_error_vs_reference", "ulp_distance", "nan_mismatch", "ulp_histogram"]


def ulp(x: Any, fmt: Any) -> np.ndarray:
    """Spacing of `fmt` at each value of `x`, as float64: 2**(floor(log2|x|) - p + 1),
    the subnormal spacing below 2**emin (zero included) and the top binade's beyond it
    (inf/NaN too, so an overflow is a large but finite number of ulps).

    >>> ulp(np.array([1.0, 1.99, 2.0, 0.0]), "bfloat16").tolist()
    [0.0078125, 0.0078125, 0.015625, 9.183549615799121e-41]
    """
    fmt = float_format(fmt)
    a = np.asarray(x, dtype=np.float64).view(np.uint64)
    e = a & _F64_EXP
    np.maximum(e, _U64((fmt.emin + 1023) << 52), out=e)
    np.minimum(e, _U64((fmt.emax + 1023) << 52), out=e)
    e -= _U64(fmt.mantissa_bits << 52)
    return e.view(np.float64)


def ulp_error_vs_reference(bits: Any, reference: Any, fmt: Any) -> np.ndarray:
    """|value - reference| in ulps of `fmt` at the reference, as float64.

    A correctly rounded value is always <= 0.5, and exactly 0.5 only when the
    reference is a tie. NaN against NaN and equal infinities count 0; NaN
    against a number gives NaN; an overflow to inf from a finite reference is inf.

    >>> ref = np.array([1 + 2**-8, 1 + 2**-9])
    >>> ulp_error_vs_reference(round_to_format(ref, "bf16"), ref, "bf16").tolist()
    [0.5, 0.25]
    """
    fmt = float_format(fmt)
    b = _as_bits(bits, fmt)
    r = np.asarray(reference, dtype=np.float64)
    if b.shape != r.shape:
        raise FormatError(
            "ulp_error_vs_reference: shapes differ",
            expected=str(b.shape), found=str(r.shape),
        )
    err = np.empty(r.shape, np.float64)
    fb, fr, fe = b.reshape(-1), np.ascontiguousarray(r).reshape(-1), err.reshape(-1)
    for start in range(0, fe.size, _PIECE):
        stop = start + _PIECE
        v, ref, e = to_float64(fb[start:stop], fmt), fr[start:stop], fe[start:stop]
        with np.errstate(invalid="ignore"):
            np.subtract(v, ref, out=e)
            np.abs(e, out=e)
            e /= ulp(ref, fmt)  # a power of two: exact
            same = v == ref  # exact hits and equal infinities (inf - inf is NaN)
            same |= np.isnan(v) & np.isnan(ref)
        e[same] = 0.0
    return err


def _ordered(bits: np.ndarray, fmt: FloatFormat) -> tuple[np.ndarray, np.ndarray]:
    """Sign-magnitude bits -> int64 on a monotone line (+0 == -0 == 0), NaN mask."""
    if fmt.bits == 16:
        x = bits.view(np.int16).astype(np.int32)
        m = x >> 31  # 0 or -1 (arithmetic shift)
        mag = x & np.int32(0x7FFF)
    else:
        x = bits.view(np.int32).astype(np.int64)
        m = x >> 63
        mag = x & np.int64(0x7FFF_FFFF)
    nan = mag > fmt.inf_bits
    # (mag ^ m) - m is mag for m == 0 and -mag for m == -1.
    mag ^= m
    mag -= m
    return mag.astype(np.int64, copy=False), nan


def ulp_distance(a_bits: Any, b_bits: Any, fmt: Any) -> np.ndarray:
    """Exact number of `fmt` steps between two arrays of the same format, as int64: on
    one integer line (+0 == -0, +-min_subnormal 2 apart, inf one past the largest finite
    value); NaN against NaN is 0, NaN against anything else :data:`NAN_MISMATCH`.

    >>> bf = round_to_format(np.array([1.0, -0.0, 2.0**-133]), "bf16")
    >>> neg = round_to_format(np.array([1.0 + 2**-7, 0.0, -2.0**-133]), "bf16")
    >>> ulp_distance(bf, neg, "bf16").tolist()
    [1, 0, 2]
    """
    fmt = float_format(fmt)
    a = _as_bits(a_bits, fmt)
    b = _as_bits(b_bits, fmt)
    if a.shape != b.shape:
        a, b = np.broadcast_arrays(a, b)
    out = np.empty(a.shape, np.int64)
    fa, fb, fo = a.reshape(-1), b.reshape(-1), out.reshape(-1)
    for start in range(0, fa.size, _PIECE):
        stop = start + _PIECE
        oa, na = _ordered(fa[start:stop], fmt)
        ob, nb = _ordered(fb[start:stop], fmt)
        o = fo[start:stop]
        np.subtract(oa, ob, out=o)
        np.abs(o, out=o)
        na ^= nb  # exactly one side NaN
        if na.any():
            o[na] = NAN_MISMATCH
        nb &= ~na  # both NaN: the sides agree
        if nb.any():
            o[nb] = 0
    return out


def nan_mismatch(a_bits: Any, b_bits: Any, fmt: Any) -> np.ndarray:
    """Boolean mask where exactly one side is NaN (ulp_distance == NAN_MISMATCH)."""
    fmt = float_format(fmt)
    return isnan_bits(a_bits, fmt) ^ isnan_bits(b_bits, fmt)


def ulp_histogram(distances: Any, max_bin: int = 1023) -> tuple[list[str], np.ndarray]:
    """Count ulp distances into bins 0, 1, 2, 3, 4-7, 8-15, ..., >max_bin, nan
    (``max_bin`` = 2**k - 1, k >= 2; NAN_MISMATCH counts as nan). Returns (labels, int64
    counts); the bins do not depend on the data, so histograms of tensors line up.

    >>> labels, counts = ulp_histogram(np.array([0, 0, 1, 5, 9, 40, NAN_MISMATCH]), 15)
    >>> list(zip(labels, counts.tolist()))
    [('0', 2), ('1', 1), ('2', 0), ('3', 0), ('4-7', 1), ('8-15', 1), ('>15', 1), ('nan', 1)]
    """
    if max_bin < 3 or (max_bin + 1) & max_bin:
        raise ArgumentError.bad("max_bin", max_bin, "2**k - 1 with k >= 2")
    d = np.asarray(distances).reshape(-1)
    if d.dtype.kind not in "iu":
        raise FormatError("ulp_histogram needs integer distances", found=str(d.dtype))
    if d.size and d.dtype.kind == "i" and d.min() < 0:
        raise FormatError("ulp_histogram: negative distance", found=str(int(d.min())))
    raw = np.zeros(max_bin + 2, np.int64)
    buf = np.empty(min(d.size, _PIECE), np.int64)
    for start in range(0, d.size, _PIECE):
        piece = buf[: min(_PIECE, d.size - start)]
        np.minimum(d[start:start + _PIECE], max_bin + 1, out=piece, casting="unsafe")
        raw += np.bincount(piece, minlength=max_bin + 2)
    n_nan = 0
    if raw[max_bin + 1] and d.dtype == np.int64:  # sentinels sit in the top bin
        n_nan = int(np.count_nonzero(d == NAN_MISMATCH))
        raw[max_bin + 1] -= n_nan
    return fold_bins(raw, n_nan, max_bin)


def fold_bins(raw: np.ndarray, nan: int, max_bin: int) -> tuple[list[str], np.ndarray]:
    """Dense counts of distances 0..max_bin and one overflow counter (``raw``) folded into
    :func:`ulp_histogram`'s bins, ``nan`` last: (labels, int64 counts)."""
    labels, counts, lo = ["0", "1", "2", "3"], [int(c) for c in raw[:4]], 4
    while lo <= max_bin:
        labels.append(f"{lo}-{2 * lo - 1}")
        counts.append(int(raw[lo:2 * lo].sum()))
        lo *= 2
    return labels + [f">{max_bin}", "nan"], np.array(counts + [int(raw[max_bin + 1]), nan],
                                                        dtype=np.int64)
