"""Float formats and the exact float math lorakit stands on.

Values of a 16-bit checkpoint travel through lorakit as their *storage bits*
(``uint16`` for bfloat16 and float16, ``uint32`` for float32): numpy has no
bfloat16, and bits are what a safetensors file holds. This module decodes bits,
rounds float64 (or float32) values into a format exactly as IEEE 754 says
(round to nearest, ties to even, one rounding, subnormals, overflow to inf),
and measures how far two results are apart in ulps.

Everything is vectorised numpy and works on arrays of any shape. Large inputs
are processed in cache-sized pieces internally; callers streaming tensors can
use :func:`chunks` to pick row slices of their own.

>>> bits = round_to_format(np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8]), "bfloat16")
>>> [hex(b) for b in bits.tolist()]
['0x3f80', '0x3f80', '0x3f82']
>>> to_float64(bits, "bf16").tolist()
[1.0, 1.0, 1.015625]
>>> ulp_distance(bits[:1], bits[2:], "bfloat16").tolist()
[2]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional

import numpy as np

from .errors import FormatError

__all__ = [
    "FloatFormat",
    "FORMATS",
    "NAN_MISMATCH",
    "float_format",
    "to_float32",
    "to_float64",
    "from_storage",
    "to_storage",
    "round_to_format",
    "isnan_bits",
    "ulp",
    "ulp_distance",
    "nan_mismatch",
    "ulp_error_vs_reference",
    "ulp_histogram",
    "chunks",
]

# Elements per internal piece: a few 512 KiB scratch buffers stay in L2/L3,
# which makes the dozen elementwise passes below ~3x faster than whole-array ops.
_PIECE = 1 << 16

_U64 = np.uint64
_F64_ABS = _U64(0x7FFF_FFFF_FFFF_FFFF)
_F64_EXP = _U64(0x7FF0_0000_0000_0000)
_F64_MANT = _U64(0x000F_FFFF_FFFF_FFFF)
_F64_INF = _U64(0x7FF0_0000_0000_0000)

#: Distance :func:`ulp_distance` reports where exactly one side is NaN. It is the
#: largest int64, so ``d > 0``, ``d.max()`` and ``d >= k`` all flag the mismatch
#: instead of hiding it (a ``-1`` would vanish from every such test).
NAN_MISMATCH: int = int(np.iinfo(np.int64).max)


@dataclass(frozen=True)
class FloatFormat:
    """One binary floating-point storage format.

    Attributes:
        name: canonical name ("bfloat16", "float16", "float32").
        safetensors: the dtype code in a safetensors header ("BF16", "F16", "F32").
        bits: storage width in bits (16 or 32).
        precision: significand bits p, implicit bit included (8, 11, 24).
        emin: exponent of the smallest normal number, 2**emin.
        emax: exponent of the largest binade; max finite is (2 - 2**(1-p)) * 2**emax.
        storage: numpy unsigned dtype that holds the bits.
        itemsize: bytes per element.
    """

    name: str
    safetensors: str
    bits: int
    precision: int
    emin: int
    emax: int
    storage: np.dtype
    itemsize: int

    @property
    def mantissa_bits(self) -> int:
        """Stored fraction bits (p - 1)."""
        return self.precision - 1

    @property
    def exponent_bits(self) -> int:
        return self.bits - self.precision

    @property
    def sign_mask(self) -> int:
        return 1 << (self.bits - 1)

    @property
    def abs_mask(self) -> int:
        return (1 << (self.bits - 1)) - 1

    @property
    def inf_bits(self) -> int:
        """Bits of +inf; one past the largest finite pattern."""
        return ((1 << self.exponent_bits) - 1) << self.mantissa_bits

    @property
    def max_bits(self) -> int:
        """Bits of the largest finite value."""
        return self.inf_bits - 1

    @property
    def quiet_nan_bits(self) -> int:
        """Bits of the canonical positive quiet NaN lorakit writes."""
        return self.inf_bits | (1 << (self.mantissa_bits - 1))

    @property
    def max_value(self) -> float:
        return (2.0 - 2.0 ** (1 - self.precision)) * 2.0**self.emax

    @property
    def min_normal(self) -> float:
        return 2.0**self.emin

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.emin - self.precision + 1)

    @property
    def numpy_dtype(self) -> Optional[np.dtype]:
        """numpy's own float dtype for this format, or None (bfloat16)."""
        return {"float16": np.dtype(np.float16), "float32": np.dtype(np.float32)}.get(self.name)


def _make(name: str, code: str, bits: int, p: int, emax: int) -> FloatFormat:
    storage = np.dtype(np.uint16 if bits == 16 else np.uint32)
    return FloatFormat(name, code, bits, p, 1 - emax, emax, storage, bits // 8)


FORMATS: dict[str, FloatFormat] = {
    "bfloat16": _make("bfloat16", "BF16", 16, 8, 127),
    "float16": _make("float16", "F16", 16, 11, 15),
    "float32": _make("float32", "F32", 32, 24, 127),
}

_ALIASES = {
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "f16": "float16", "fp16": "float16", "half": "float16",
    "float32": "float32", "f32": "float32", "fp32": "float32", "single": "float32",
}


def float_format(spec: Any) -> FloatFormat:
    """Look up a format by name, safetensors code, numpy dtype or mlx/torch dtype.

    >>> float_format("BF16").name, float_format(np.float16).precision
    ('bfloat16', 11)
    """
    if isinstance(spec, FloatFormat):
        return spec
    if isinstance(spec, str):
        key = spec
    else:
        try:
            key = np.dtype(spec).name  # numpy dtypes and scalar types
        except TypeError:
            key = str(spec)  # mlx.core.bfloat16, torch.bfloat16, ...
    key = key.strip().lower().rsplit(".", 1)[-1]
    if key in _ALIASES:
        return FORMATS[_ALIASES[key]]
    raise FormatError(
        f"unsupported float format {spec!r}",
        expected="bfloat16/BF16, float16/F16 or float32/F32",
        found=repr(spec),
    )


# ---------------------------------------------------------------------------
# bits <-> values


def _is_native(dtype: np.dtype, fmt: FloatFormat) -> bool:
    """True for a float dtype that stores exactly `fmt` (ml_dtypes.bfloat16 included)."""
    # Compare names: np.dtype(...) == None is True for float64, a trap with numpy_dtype.
    return dtype.name == fmt.name


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


def to_storage(values: Any, fmt: Any) -> np.ndarray:
    """Storage bits of values that are already exactly in `fmt`.

    A float16/float32 array of its own format is a zero-copy view. Any other
    float array (e.g. float32 holding bfloat16 values) must be exactly
    representable, NaN aside; use :func:`round_to_format` to round instead.

    Raises:
        FormatError: a value is not exactly representable in `fmt`.
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


def isnan_bits(bits: Any, fmt: Any) -> np.ndarray:
    """Boolean mask of NaN patterns."""
    fmt = float_format(fmt)
    b = _as_bits(bits, fmt)
    return (b & fmt.storage.type(fmt.abs_mask)) > fmt.storage.type(fmt.inf_bits)


# ---------------------------------------------------------------------------
# correct rounding


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

    One rounding straight from the exact input value: float64 input is never
    passed through float32 first (that double rounding gives the wrong bfloat16
    for about one random input in 2**17). Subnormal results, signed zeros and
    overflow follow IEEE 754: a magnitude >= max + half an ulp becomes inf.
    NaN becomes the canonical quiet NaN of `fmt`, sign kept.

    Args:
        x: float array (float64, float32, float16 or ml_dtypes bfloat16), any shape.
        fmt: target format (anything :func:`float_format` accepts).
        out: optional C-contiguous array of `fmt.storage` with x's shape to fill.

    Returns:
        Array of `fmt.storage` bits with x's shape (`out` if given).

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


# ---------------------------------------------------------------------------
# ulps


def ulp(x: Any, fmt: Any) -> np.ndarray:
    """Spacing of `fmt` at each value of `x`, as float64.

    ulp(x) = 2**(floor(log2|x|) - p + 1) for |x| >= 2**emin, and the subnormal
    spacing 2**(emin - p + 1) below (zero included). Beyond the largest binade
    (and for inf/NaN) the top binade's spacing is used, so an overflow shows as
    a large but finite number of ulps.

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

    Args:
        bits: storage bits (or exact float array) of `fmt`.
        reference: exact values (float64, or anything that widens to it).
        fmt: the format of `bits`.

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
    """Exact number of `fmt` steps between two arrays of the same format, as int64.

    Values are placed on one integer line: consecutive floats are 1 apart, +0
    and -0 are the same point, the line crosses zero through the subnormals
    (so +min_subnormal and -min_subnormal are 2 apart), and inf sits one past
    the largest finite value. NaN against NaN is 0 (both sides agree); NaN
    against anything else is :data:`NAN_MISMATCH` (see :func:`nan_mismatch`).

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
    """Count ulp distances into bins 0, 1, 2, 3, 4-7, 8-15, ..., >max_bin, nan.

    Args:
        distances: int array from :func:`ulp_distance` (NAN_MISMATCH counts as "nan").
        max_bin: top of the last power-of-two bin; 2**k - 1 with k >= 2.

    Returns:
        (labels, counts): labels as strings, counts an int64 array of the same
        length. The bins do not depend on the data, so histograms of different
        tensors line up.

    >>> labels, counts = ulp_histogram(np.array([0, 0, 1, 5, 9, 40, NAN_MISMATCH]), 15)
    >>> list(zip(labels, counts.tolist()))
    [('0', 2), ('1', 1), ('2', 0), ('3', 0), ('4-7', 1), ('8-15', 1), ('>15', 1), ('nan', 1)]
    """
    if max_bin < 3 or (max_bin + 1) & max_bin:
        raise ValueError(f"max_bin must be 2**k - 1 with k >= 2, got {max_bin}")
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
    labels = ["0", "1", "2", "3"]
    counts = [int(c) for c in raw[:4]]
    lo = 4
    while lo <= max_bin:
        labels.append(f"{lo}-{2 * lo - 1}")
        counts.append(int(raw[lo:2 * lo].sum()))
        lo *= 2
    labels += [f">{max_bin}", "nan"]
    counts += [int(raw[max_bin + 1]) - n_nan, n_nan]
    return labels, np.array(counts, dtype=np.int64)


def chunks(n_rows: int, row_elems: int, target_elems: int = 1 << 20) -> Iterator[slice]:
    """Row slices covering ``range(n_rows)``, each about `target_elems` elements.

    Every slice holds at least one row, so a row longer than `target_elems`
    comes alone.

    >>> list(chunks(5, 3, target_elems=6))
    [slice(0, 2, None), slice(2, 4, None), slice(4, 5, None)]
    """
    step = max(1, target_elems // max(1, row_elems))
    for start in range(0, n_rows, step):
        yield slice(start, min(start + step, n_rows))


# ---------------------------------------------------------------------------
# float32 fused multiply-add, emulated exactly


def fma_f32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Correctly rounded float32 ``a*b + c`` (one rounding), broadcasting like ``a*b+c``.

    numpy has no fma. The product of two float32 is exact in float64; the float64
    sum ``s`` is corrected to round-to-odd with an error-free two-sum, which makes
    the final cast to float32 a single correct rounding (53 >= 2*24 + 2 bits).
    Used to reproduce BLAS kernels that accumulate with fma (torch's CPU matmul).

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
