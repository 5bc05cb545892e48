"""What an ulp distance means at the tensor's scale: relative error, zero crossings.

An ulp distance counts representable values between two numbers, so it is huge for
values near zero: bf16 ``0`` against ``-0.00087`` is 14,949 steps apart although the
two differ by less than a hundredth of a typical weight. Beside the exact ulp
histogram of :class:`~lorakit.inspect.ulp_accumulate.Accumulator`,
:class:`ScaleStats` gathers what puts a difference at the tensor's scale:

- ``rms_a``: the rms of A's values over the whole tensor (A is the first source of a
  comparison: "the tensor's typical magnitude"), and ``rel_rms = rms(a - b) / rms_a``;
- ``sign_changes``: differing elements of opposite signs, both non-zero, and
  ``to_zero``: zero on one side only (together: the zero crossings);
- ``near_zero``: differing elements with ``min(|a|, |b|) < near_zero_below =
  2**(floor(log2 rms_a) + NEAR_ZERO_LOG2)`` (zeros and subnormals always count);
- ``max_ulp_typical``: the largest ulp distance among differing elements with
  ``min(|a|, |b|) >= typical_from = 2**floor(log2 rms_a)``: the figure to set beside
  the rounding of a fuse (0.5 ulp, a few ulps for double rounding).

The thresholds need rms(A) before the first differing piece of a tensor is compared:
:class:`TensorScale` computes it once, on demand (a tensor whose bytes are all equal
never needs it), so that each piece then costs one branch-free pass (the C kernel's
``scale``, or numpy: the same numbers up to the order of float sums).
:func:`binades` lists one tensor's differing elements by magnitude, for a closer look.

>>> a = np.array([0x3F80, 0x3F80, 0x3727, 0x3F00], np.uint16)  # 1, 1, ~1e-5, 0.5
>>> b = np.array([0x3F81, 0x3F80, 0xBA64, 0x3F00], np.uint16)  # 1.0078, 1, ~-0.00087, 0.5
>>> s = ScaleStats("BF16", TensorScale.of(a, "BF16"))
>>> s.add(a, b)
>>> r = s.finish(4, max_abs=0.0078125)
>>> r["sign_changes"], r["near_zero"], r["max_ulp_typical"]
(1, 1, 1)
"""
from __future__ import annotations

import math
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from .. import numerics as nm

__all__ = ["NEAR_ZERO_LOG2", "SCALE_FIELDS", "ScaleStats", "TensorScale", "binades", "ulp_at"]

#: differing elements whose smaller magnitude is below 2**NEAR_ZERO_LOG2 * rms(A)
#: (rounded down to a power of two) are "near zero": their ulp distances say little
NEAR_ZERO_LOG2 = -10
#: what :meth:`ScaleStats.finish` returns (and TensorDiff carries)
SCALE_FIELDS = ("rms_a", "rel_rms", "max_rel", "max_ulp_at_rms", "sign_changes", "to_zero",
                "near_zero", "near_zero_below", "typical_from", "max_ulp_typical")
_FLOAT = {"BF16", "F16", "F32"}
_KERNEL_FMT = {"BF16": 0, "F16": 1, "F32": 2}


def ulp_at(value: float, code: str) -> float:
    """The ulp (spacing of the format) at magnitude ``value``.

    >>> ulp_at(1.0, "BF16"), ulp_at(0.02, "BF16"), ulp_at(0.0, "F16") == 2.0 ** -24
    (0.0078125, 0.0001220703125, True)
    """
    f = nm.float_format(code)
    if not value > 0 or not math.isfinite(value):
        return f.min_subnormal
    e = math.frexp(value)[1] - 1  # floor(log2(value))
    return 2.0 ** (max(e, f.emin) - f.mantissa_bits)


def _values32(x: np.ndarray, code: str) -> np.ndarray:
    """Storage bits -> float32 values (exact for every format here)."""
    with np.errstate(invalid="ignore"):
        if code == "BF16":
            return (x.astype(np.uint32) << 16).view(np.float32)
        if code == "F16":
            return x.view(np.float16).astype(np.float32)
        return x.view(np.float32)


def sumsq(x: np.ndarray, code: str, kernel: Any = None) -> float:
    """Sum of squares of a piece's values (storage bits); inf or NaN give inf or NaN."""
    if kernel is not None and hasattr(kernel, "sumsq"):
        return kernel.sumsq(np.ascontiguousarray(x), _KERNEL_FMT[code])
    v = _values32(x, code)
    with np.errstate(over="ignore", invalid="ignore"):
        return float(np.dot(v, v))  # float32 products, BLAS's blocked sums


def _thresholds(rms: float, code: str) -> Tuple[int, int, float, float]:
    """(near_bits, typ_bits, near_zero_below, typical_from) for a tensor of this rms:
    magnitude-bit thresholds at whole binades, zeros and subnormals always near zero."""
    f = nm.float_format(code)
    rms_exp = math.frexp(rms)[1] - 1  # floor(log2(rms))
    nb = 1 << f.exponent_bits
    tn = min(max(rms_exp + NEAR_ZERO_LOG2 + f.emax, 1), nb - 1)
    tt = min(max(rms_exp + f.emax, 1), nb - 1)
    return (tn << f.mantissa_bits, tt << f.mantissa_bits, 2.0 ** (tn - f.emax),
            2.0 ** (tt - f.emax))


class TensorScale:
    """rms(A) of one tensor and the thresholds it sets, computed once on first use.

    ``sumsq_fn`` returns the sum of squares of A's values over the whole tensor of
    ``n`` elements. Shared by the pieces of a tensor (thread-safe)."""

    def __init__(self, code: str, n: int, sumsq_fn: Callable[[], float]) -> None:
        self.code, self.n, self._fn = code, n, sumsq_fn
        self._lock = threading.Lock()
        self._val: Optional[Tuple[float, Optional[Tuple[int, int, float, float]]]] = None

    @classmethod
    def of(cls, a_bits: np.ndarray, code: str, kernel: Any = None) -> "TensorScale":
        """The scale of a tensor held in memory (its storage bits)."""
        flat = a_bits.reshape(-1)
        return cls(code, flat.size, lambda: sumsq(flat, code, kernel))

    def get(self) -> Tuple[float, Optional[Tuple[int, int, float, float]]]:
        """``(sumsq_a, thresholds or None)``: None when rms(A) is 0 or not finite."""
        with self._lock:
            if self._val is None:
                s = float(self._fn())
                ok = self.n > 0 and s > 0 and math.isfinite(s)
                self._val = (s, _thresholds(math.sqrt(s / self.n), self.code) if ok else None)
            return self._val


class ScaleStats:
    """Scale statistics of one tensor's comparison (see the module docstring)."""

    def __init__(self, code: str, tensor: Optional[TensorScale] = None) -> None:
        self.code = code
        self.tensor = tensor
        self.on = code in _FLOAT and tensor is not None
        self.seen = False  # a differing piece was measured
        self.sumsq_d = 0.0
        self.sign_changes = self.to_zero = self.near_zero = self.max_ulp_typical = 0

    def add(self, x: np.ndarray, y: np.ndarray, kernel: Any = None) -> None:
        """One piece of both tensors (storage bits). ``kernel``: the C ulp kernel (its
        ``scale``), or None for numpy."""
        if not self.on or x.size == 0:
            return
        _, th = self.tensor.get()
        if th is None:
            return
        self.seen = True
        nb, tb = th[0], th[1]
        if kernel is not None and hasattr(kernel, "sumsq"):
            d2, sc, tz, near, typ = kernel.scale(np.ascontiguousarray(x),
                                                 np.ascontiguousarray(y),
                                                 _KERNEL_FMT[self.code], nb, tb)
        else:
            d2, sc, tz, near, typ = self._numpy(x, y, nb, tb)
        self.sumsq_d += d2
        self.sign_changes += sc
        self.to_zero += tz
        self.near_zero += near
        self.max_ulp_typical = max(self.max_ulp_typical, typ)

    def _numpy(self, x: np.ndarray, y: np.ndarray, nb: int, tb: int):
        f = nm.float_format(self.code)
        idx = np.flatnonzero(x != y)
        xa, yb = x.take(idx), y.take(idx)
        mask = xa.dtype.type(f.abs_mask)
        wide = np.int64 if f.bits == 32 else np.int32  # |pa - pb| fits: 2 * 0x7F80
        am, bm = (xa & mask).astype(wide), (yb & mask).astype(wide)
        if max(int(am.max()), int(bm.max())) > f.inf_bits:  # a NaN: left out (rare)
            ok = (am <= f.inf_bits) & (bm <= f.inf_bits)
            am, bm, xa, yb = am[ok], bm[ok], xa[ok], yb[ok]
        sg = ((xa ^ yb) >> (f.bits - 1)).astype(bool)
        v = np.where(sg, am + bm, np.abs(am - bm))
        lo = np.minimum(am, bm)
        nz = (am != 0) & (bm != 0)
        va, vb = _values32(xa, self.code), _values32(yb, self.code)
        with np.errstate(invalid="ignore", over="ignore"):
            d = (va - vb).astype(np.float64)
        if max(int(am.max(initial=0)), int(bm.max(initial=0))) >= f.inf_bits:
            d = d[(am < f.inf_bits) & (bm < f.inf_bits)]
        typ = v[lo >= tb]
        return (float(np.dot(d, d)), int(np.count_nonzero(sg & nz)),
                int(v.size - np.count_nonzero(nz) - np.count_nonzero((am == 0) & (bm == 0))),
                int(np.count_nonzero(lo < nb)), int(typ.max()) if typ.size else 0)

    def merge(self, o: "ScaleStats") -> None:
        self.seen |= o.seen
        self.sumsq_d += o.sumsq_d
        self.sign_changes += o.sign_changes
        self.to_zero += o.to_zero
        self.near_zero += o.near_zero
        self.max_ulp_typical = max(self.max_ulp_typical, o.max_ulp_typical)

    def finish(self, n: int, max_abs: Optional[float]) -> Dict[str, Any]:
        """The figures of a tensor of ``n`` elements (``max_abs``: largest |a - b|);
        all None unless a differing piece was measured against a finite, non-zero
        rms(A)."""
        out: Dict[str, Any] = dict.fromkeys(SCALE_FIELDS)
        if not self.seen or not n:
            return out
        s, th = self.tensor.get()
        rms = math.sqrt(s / n)
        out.update(rms_a=rms, rel_rms=math.sqrt(self.sumsq_d / n) / rms,
                   sign_changes=self.sign_changes, to_zero=self.to_zero,
                   near_zero=self.near_zero, near_zero_below=th[2], typical_from=th[3],
                   max_ulp_typical=self.max_ulp_typical)
        if max_abs is not None and not math.isnan(max_abs):  # inf against a number: inf
            out["max_rel"] = max_abs / rms
            out["max_ulp_at_rms"] = max_abs / ulp_at(rms, self.code)
        return out


def binades(a: np.ndarray, b: np.ndarray, code: str) -> List[List[Any]]:
    """One tensor's differing elements by binade of ``min(|a|, |b|)``: ``[[exponent,
    count, max ulp], ...]`` (exponent None for zeros and subnormals; NaN left out).

    >>> binades(np.array([0x3F80, 0x0000], np.uint16), np.array([0x3F81, 0x3727], np.uint16), "bf16")
    [[None, 1, 14119], [0, 1, 1]]
    """
    f = nm.float_format(code)
    x, y = np.asarray(a).reshape(-1), np.asarray(b).reshape(-1)
    ne = x != y
    x, y = x[ne], y[ne]
    am = (x & x.dtype.type(f.abs_mask)).astype(np.int64)
    bm = (y & y.dtype.type(f.abs_mask)).astype(np.int64)
    keep = (am <= f.inf_bits) & (bm <= f.inf_bits)  # NaN on either side: left out
    d = nm.ulp_distance(x[keep], y[keep], f).astype(np.int64)
    e = np.minimum(am[keep], bm[keep]) >> f.mantissa_bits
    out = []
    for k in np.unique(e):
        sel = e == k
        out.append([None if k == 0 else int(k) - f.emax, int(sel.sum()), int(d[sel].max())])
    return out
