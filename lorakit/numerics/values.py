"""Values <-> storage bits: decoding, and correct rounding of float64 (or float32) values
into a format (one rounding, ties to even, subnormals, overflow to inf); an exact float32
fused multiply-add."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ..errors import FormatError
from .formats import (
    _F64_ABS,
    _F64_INF,
    _F64_MANT,
    _PIECE,
    _U64,
    FloatFormat,
    _is_native,
    float_format,
)

__all__ = ["to_float32", "to_float64", "from_storage", "isnan_bits", "round_to_format", "fma_f32",
           "to_storage"]


def _as_bits(x: Any, fmt: FloatFormat) -> np.ndarray:
    """Storage bits of `x`: integer arrays are taken as bits, floats must be exact."""
    arr = np.asarray(x)
    if arr.dtype.kind in "ui" and arr.dtype.itemsize == fmt.itemsize:
        return arr.view(fmt.storage)
    if arr.dtype.kind == "f" or arr.dtype.name == "bfloat16":
        return to_storage(arr, fmt)
    raise FormatError(
        f"cannot read {fmt.name} values from a {arr.dtype} array",
        expected=f"{fmt.storage} bits or a float array of {fmt.name} values",
        found=str(arr.dtype),
    )


def to_float32(bits: Any, fmt: Any) -> np.ndarray:
    """Decode storage bits (or an exact float array) of `fmt` to float32, exactly.

    >>> to_float32(np.array([0x3F80, 0xC000, 0x0001], np.uint16), "bfloat16").tolist()
    [1.0, -2.0, 9.183549615799121e-41]
    """
    fmt = float_format(fmt)
    b = _as_bits(bits, fmt)
    if fmt.name == "bfloat16":
        out = b.astype(np.uint32)
        out <<= np.uint32(16)
        return out.view(np.float32)
    if fmt.name == "float16":
        with np.errstate(invalid="ignore"):  # signalling NaNs raise the flag; still NaN
            return b.view(np.float16).astype(np.float32)
    return b.view(np.float32).copy()


def to_float64(bits: Any, fmt: Any) -> np.ndarray:
    """Decode storage bits (or an exact float array) of `fmt` to float64, exactly."""
    with np.errstate(invalid="ignore"):  # signalling NaNs raise the flag; still NaN
        return to_float32(bits, fmt).astype(np.float64)


def from_storage(bits: Any, fmt: Any) -> np.ndarray:
    """View bits as numpy's natural float array for `fmt` (float32 for bfloat16).

    float16 and float32 are zero-copy views; bfloat16 widens to float32.
    """
    fmt = float_format(fmt)
    b = _as_bits(bits, fmt)
    if fmt.numpy_dtype is not None:
        return b.view(fmt.numpy_dtype)
    return to_float32(b, fmt)


def isnan_bits(bits: Any, fmt: Any) -> np.ndarray:
    """Boolean mask of NaN patterns."""
    fmt = float_format(fmt)
    b = _as_bits(bits, fmt)
    return (b & fmt.storage.type(fmt.abs_mask)) > fmt.storage.type(fmt.inf_bits)



def _round_consts(fmt: FloatFormat) -> dict[str, Any]:
    s = 53 - fmt.precision  # f64 fraction bits dropped for a normal result
    minn = (fmt.emin + 1023) << 52  # f64 bits of 2**emin
    # f64 bits of max + half ulp: the smallest magnitude that rounds to inf.
    ovf = ((fmt.emax + 1023) << 52) | (((1 << fmt.precision) - 1) << (s - 1))
    return dict(
        s=_U64(s),
        minn=_U64(minn),
        ovf=_U64(ovf),
        lim=_U64(ovf - 1 - minn),
        # Re-adds 2**52 (D below is biased one binade low) plus the half-ulp-minus-one
        # that, with the kept lsb, makes the truncating shift round ties to even.
        k=_U64((1 << 52) + (1 << (s - 1)) - 1),
        sign_shift=_U64(64 - fmt.bits),
        sign=_U64(fmt.sign_mask),
    )


def _round_f64_bits_general(a: np.ndarray, fmt: FloatFormat) -> np.ndarray:
    """Round f64 bit patterns `a` (uint64) into `fmt` bits; every case, no tricks.

    Used on the few elements the fast path leaves out: zeros, subnormal and
    underflowing results, overflow, inf and NaN.
    """
    c = _round_consts(fmt)
    a = np.asarray(a, dtype=np.uint64)
    ab = a & _F64_ABS
    res = np.zeros(a.shape, np.uint64)

    normal = (ab >= c["minn"]) & (ab < c["ovf"])
    t = ab[normal] - (c["minn"] - _U64(1 << 52))  # re-biased: target exponent field
    res[normal] = (t + _U64((1 << (int(c["s"]) - 1)) - 1) + ((t >> c["s"]) & _U64(1))) >> c["s"]

    tiny = ab < c["minn"]
    at = ab[tiny]
    e64 = (at >> _U64(52)).astype(np.int64)
    sig = (at & _F64_MANT) | np.where(e64 > 0, _U64(1 << 52), _U64(0))
    # value = sig * 2**(e - 52), e the unbiased exponent (f64 subnormals use 1 - 1023);
    # the target's subnormal unit is 2**(emin - p + 1), so shift by the difference.
    e = np.maximum(e64, 1) - 1023
    shift = np.clip(fmt.emin - fmt.precision + 53 - e, 1, 63).astype(np.uint64)
    half_m1 = (_U64(1) << (shift - _U64(1))) - _U64(1)
    res[tiny] = (sig + half_m1 + ((sig >> shift) & _U64(1))) >> shift

    res[(ab >= c["ovf"]) & (ab <= _F64_INF)] = fmt.inf_bits
    res[ab > _F64_INF] = fmt.quiet_nan_bits
    res |= (a >> c["sign_shift"]) & c["sign"]
    return res.astype(fmt.storage)


def _round_f64_fast(x: np.ndarray, fmt: FloatFormat, out: np.ndarray) -> None:
    """Round a flat float array (any float dtype, widened per piece) into `out` bits."""
    c = _round_consts(fmt)
    s, k, sign, sign_shift = c["s"], c["k"], c["sign"], c["sign_shift"]
    minn, lim, one = c["minn"], c["lim"], _U64(1)
    n = x.size
    size = min(n, _PIECE)
    d_buf = np.empty(size, np.uint64)
    t_buf = np.empty(size, np.uint64)
    m_buf = np.empty(size, np.bool_)
    w_buf = None if x.dtype == np.float64 else np.empty(size, np.float64)
    for start in range(0, n, _PIECE):
        xs = x[start:start + _PIECE]
        m = xs.size
        if w_buf is not None:
            with np.errstate(invalid="ignore"):  # signalling NaNs flag it; still NaN
                np.copyto(w_buf[:m], xs)  # exact: every float dtype widens into f64
            xs = w_buf[:m]
        a = xs.view(np.uint64)
        d, t, mask, o = d_buf[:m], t_buf[:m], m_buf[:m], out[start:start + m]
        # D = |x| - 2**emin in bits: wraps for tiny |x|, so one unsigned compare
        # finds every element the normal-range formula cannot handle.
        np.bitwise_and(a, _F64_ABS, out=d)
        np.subtract(d, minn, out=d)
        np.greater(d, lim, out=mask)
        # Round to nearest even by integer add + shift; a carry out of the
        # fraction bumps the exponent, which is exactly right.
        np.right_shift(d, s, out=t)
        np.bitwise_and(t, one, out=t)
        np.add(d, t, out=d)
        np.add(d, k, out=d)
        np.right_shift(d, s, out=d)
        np.right_shift(a, sign_shift, out=t)
        np.bitwise_and(t, sign, out=t)
        np.bitwise_or(d, t, out=o, casting="unsafe")
        if mask.any():
            idx = np.flatnonzero(mask)
            o[idx] = _round_f64_bits_general(a[idx], fmt)


def _round_f32_to_bf16(x: np.ndarray, out: np.ndarray) -> None:
    """The standard RNE float32 -> bfloat16 cast on bits, with NaNs made quiet."""
    u32 = np.uint32
    n = x.size
    size = min(n, _PIECE)
    t_buf = np.empty(size, u32)
    m_buf = np.empty(size, np.bool_)
    for start in range(0, n, _PIECE):
        b = x[start:start + _PIECE].view(u32)
        m = b.size
        t, mask, o = t_buf[:m], m_buf[:m], out[start:start + m]
        np.right_shift(b, u32(16), out=t)
        np.bitwise_and(t, u32(1), out=t)
        np.add(t, b, out=t)  # no wrap: |b| <= inf + 0x8000 stays below the sign bit
        np.add(t, u32(0x7FFF), out=t)
        np.right_shift(t, u32(16), out=o, casting="unsafe")
        np.bitwise_and(b, u32(0x7FFF_FFFF), out=t)
        np.greater(t, u32(0x7F80_0000), out=mask)
        if mask.any():
            idx = np.flatnonzero(mask)
            o[idx] = ((b[idx] >> u32(16)) & u32(0x8000)) | u32(0x7FC0)


def _quiet_nans(bits: np.ndarray, fmt: FloatFormat) -> np.ndarray:
    """Replace every NaN pattern by the canonical quiet NaN, sign kept."""
    st = fmt.storage.type
    mask = (bits & st(fmt.abs_mask)) > st(fmt.inf_bits)
    if mask.any():
        bits[mask] = (bits[mask] & st(fmt.sign_mask)) | st(fmt.quiet_nan_bits)
    return bits


def round_to_format(x: Any, fmt: Any, out: Optional[np.ndarray] = None) -> np.ndarray:
    """Round values to `fmt`, correctly (nearest, ties to even), returning storage bits.

    One rounding from the exact input (never through float32 first); subnormals, signed
    zeros and overflow to inf as IEEE 754 says; NaN becomes `fmt`'s quiet NaN, sign
    kept. ``x``: any float array; ``out``: a C-contiguous `fmt.storage` array to fill.

    >>> round_to_format(np.array([65519.0, 65520.0, -0.0]), "float16").tolist()
    [31743, 31744, 32768]
    """
    fmt = float_format(fmt)
    arr = np.asarray(x)
    if not (arr.dtype.kind == "f" or arr.dtype.name == "bfloat16"):
        raise FormatError(
            f"round_to_format needs float values, got a {arr.dtype} array",
            expected="float64, float32 or float16 values",
            found=str(arr.dtype),
            hint="to read storage bits use to_float64(bits, fmt)",
        )
    if out is None:
        out = np.empty(arr.shape, fmt.storage)
    elif out.dtype != fmt.storage or out.shape != arr.shape or not out.flags.c_contiguous:
        raise FormatError(
            "round_to_format: unusable out array",
            expected=f"C-contiguous {fmt.storage} array of shape {arr.shape}",
            found=f"{out.dtype} array of shape {out.shape}",
        )
    flat_out = out.reshape(-1)
    flat = np.ascontiguousarray(arr).reshape(-1)
    if _is_native(arr.dtype, fmt):
        np.copyto(flat_out, flat.view(fmt.storage))  # already in the format
        _quiet_nans(flat_out, fmt)
    elif fmt.name == "bfloat16" and arr.dtype == np.float32:
        _round_f32_to_bf16(flat, flat_out)
    else:
        _round_f64_fast(flat, fmt, flat_out)
    return out



def fma_f32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Correctly rounded float32 ``a*b + c`` (one rounding), broadcasting like ``a*b+c``:
    the float64 sum of the exact product is made round-to-odd by an error-free two-sum,
    so the cast to float32 rounds once (53 >= 2*24 + 2 bits). For torch's CPU matmul.

    >>> fma_f32(np.float32(1 + 2**-23), np.float32(1 - 2**-23), np.float32(-1)).item()
    -1.4210854715202004e-14
    """
    p = np.asarray(a, np.float32).astype(np.float64) * np.asarray(b, np.float32)
    c64 = np.asarray(c, np.float32).astype(np.float64)
    s = p + c64
    bp = s - c64
    err = (p - bp) + (c64 - (s - bp))  # s + err == p + c exactly (TwoSum)
    bits = s.view(np.int64)
    inexact = err != 0
    if inexact.any():
        away = inexact & (np.signbit(err) != np.signbit(s))
        bits -= away  # one step toward zero where s overshot the exact sum
        bits |= inexact  # odd last bit: sticky, so the f32 rounding below is single
    return bits.view(np.float64).astype(np.float32)


def to_storage(values: Any, fmt: Any) -> np.ndarray:
    """Storage bits of values that are already exactly in `fmt`.

    A float16/float32 array of its own format is a zero-copy view. Any other
    float array (e.g. float32 holding bfloat16 values) must be exactly
    representable, NaN aside (else a FormatError; :func:`round_to_format` rounds).
    """
    fmt = float_format(fmt)
    arr = np.asarray(values)
    if arr.dtype.kind in "ui" and arr.dtype.itemsize == fmt.itemsize:
        return arr.view(fmt.storage)
    if _is_native(arr.dtype, fmt):
        return arr.view(fmt.storage)
    bits = round_to_format(arr, fmt)
    back = to_float64(bits, fmt)
    src = arr.astype(np.float64)
    bad = (back != src) & ~(np.isnan(back) & np.isnan(src))
    if bad.any():
        i = int(np.flatnonzero(bad.reshape(-1))[0])
        raise FormatError(
            f"{np.count_nonzero(bad)} values are not exactly representable in {fmt.name}",
            expected=f"{fmt.name} values",
            found=f"{src.reshape(-1)[i]!r} at flat index {i}",
            hint="use round_to_format() to round them",
        )
    return bits
