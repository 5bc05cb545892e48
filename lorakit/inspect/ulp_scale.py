"""What an ulp distance means at the tensor's scale: relative error, zero crossings.

An ulp distance counts representable values between two numbers, so it is huge for
values near zero: bf16 ``+1e-5`` against ``-0.00087`` is 14,949 steps apart although
the two differ by less than a thousandth of a typical weight. :class:`ScaleStats`
gathers, beside the exact ulp histogram of
:class:`~lorakit.inspect.ulp_accumulate.Accumulator`, what puts a difference at the
tensor's scale:

- ``sumsq_a``: the sum of squares of A's values over the whole tensor (rms(A), "the
  tensor's typical magnitude": A is the first source of a comparison);
- ``sumsq_d``: the sum of ``(a - b)**2`` (so ``rel_rms = rms(a - b) / rms(A)``);
- ``sign_changes``: elements where A and B have opposite signs, both non-zero, and
  ``to_zero``: elements zero on one side only (together: the zero crossings);
- per binade of ``min(|a|, |b|)`` (the exponent field of the smaller magnitude), the
  count of differing elements and their largest ulp distance (``binades``: ``[exponent,
  count, max ulp]``, exponent None for zeros and subnormals). With rms(A) known at the
  end this gives the differing elements *near zero* (``near_zero``: ``min(|a|, |b|) <
  near_zero_below = 2**(floor(log2 rms) + NEAR_ZERO_LOG2)``, zeros and subnormals
  always) and the largest ulp
  distance *at typical magnitudes* (``max_ulp_typical``: over elements with
  ``min(|a|, |b|) >= typical_from = 2**floor(log2 rms)``), the figure to compare with
  the rounding of a fuse (0.5 ulp, a few ulps for double rounding).

Both ulp paths (C kernel and numpy) call the same code here, so their numbers agree.

>>> s = ScaleStats("BF16")
>>> a = np.array([0x3F80, 0x3F80, 0x3727], np.uint16)  # 1.0, 1.0, ~1e-5
>>> b = np.array([0x3F81, 0x3F80, 0xBA64], np.uint16)  # 1.0078125, 1.0, ~-0.00087
>>> s.add(a, b)
>>> r = s.finish(3, max_abs=float(0.00087 + 1e-5))
>>> r["sign_changes"], r["near_zero"], r["max_ulp_typical"]
(1, 1, 1)
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional

import numpy as np

from .. import numerics as nm

__all__ = ["NEAR_ZERO_LOG2", "SCALE_FIELDS", "ScaleStats", "ulp_at"]

#: what :meth:`ScaleStats.finish` returns (and TensorDiff carries)
SCALE_FIELDS = ("rms_a", "rel_rms", "max_rel", "max_ulp_at_rms", "sign_changes", "to_zero",
                "near_zero", "near_zero_below", "typical_from", "max_ulp_typical", "binades")

#: elements whose smaller magnitude is below 2**NEAR_ZERO_LOG2 * rms(A) (rounded down to
#: a power of two) are "near zero": their ulp distances say little about the error
NEAR_ZERO_LOG2 = -10
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


def _values(x: np.ndarray, code: str) -> np.ndarray:
    """Storage bits -> float32 values (bf16 by a shift; f16 through numpy)."""
    if code == "BF16":
        return (x.astype(np.uint32) << 16).view(np.float32)
    if code == "F16":
        with np.errstate(invalid="ignore"):
            return x.view(np.float16).astype(np.float32)
    return x.view(np.float32)


class ScaleStats:
    """Scale statistics of one tensor's comparison (see the module docstring)."""

    def __init__(self, code: str) -> None:
        self.code = code
        self.on = code in _FLOAT
        self.sumsq_a = 0.0
        self.covered = 0  # elements of A counted into sumsq_a
        self.sumsq_d = 0.0
        self.sign_changes = 0
        self.to_zero = 0  # one side +-0, the other not
        if self.on:
            f = nm.float_format(code)
            self._mb, self._sign, self._inf = f.mantissa_bits, f.bits - 1, f.inf_bits
            self._bias = f.emax
            nb = 1 << f.exponent_bits
            self.ecount = np.zeros(nb, np.int64)
            self.emax = np.zeros(nb, np.int64)

    def add_a(self, x: np.ndarray, kernel: Any = None) -> None:
        """Count A's values of a piece into rms(A) (a piece whose bytes are equal)."""
        if not self.on or not x.size:
            return
        if kernel is not None:
            self.sumsq_a += kernel.scale(x, x, _KERNEL_FMT[self.code], self.ecount,
                                         self.emax)[0]
            self.covered += x.size
            return
        with np.errstate(invalid="ignore"):
            v = _values(x, self.code).astype(np.float64)
        with np.errstate(over="ignore", invalid="ignore"):
            s = float(np.dot(v, v))  # inf or NaN in A: no rms (finish says None)
        self.sumsq_a += s
        self.covered += x.size

    def add(self, x: np.ndarray, y: np.ndarray, kernel: Any = None) -> None:
        """One piece of both tensors (storage bits): rms(A) and the differing elements.

        ``kernel``: the C ulp kernel (its ``scale`` function, the same numbers up to
        the order of float64 sums), or None for numpy."""
        if not self.on:
            return
        if kernel is not None:
            a2, d2, sc, tz = kernel.scale(np.ascontiguousarray(x), np.ascontiguousarray(y),
                                          _KERNEL_FMT[self.code], self.ecount, self.emax)
            self.sumsq_a += a2
            self.sumsq_d += d2
            self.sign_changes += sc
            self.to_zero += tz
            self.covered += x.size
            return
        self.add_a(x)
        idx = np.flatnonzero(x != y)
        if not idx.size:
            return
        xa, yb = x.take(idx), y.take(idx)
        wide = np.int64 if self.code == "F32" else np.int32
        am = (xa & (xa.dtype.type((1 << self._sign) - 1))).astype(wide)
        bm = (yb & (yb.dtype.type((1 << self._sign) - 1))).astype(wide)
        sa, sb = (xa >> self._sign).astype(bool), (yb >> self._sign).astype(bool)
        ok = (am <= self._inf) & (bm <= self._inf)  # NaN mismatches are counted elsewhere
        if not ok.all():
            am, bm, sa, sb, xa, yb = am[ok], bm[ok], sa[ok], sb[ok], xa[ok], yb[ok]
        d = np.abs(np.where(sa, -am, am) - np.where(sb, -bm, bm))
        za, zb = am == 0, bm == 0
        self.sign_changes += int(np.count_nonzero((sa != sb) & ~za & ~zb))
        self.to_zero += int(np.count_nonzero(za != zb))
        e = np.minimum(am, bm) >> self._mb
        self.ecount += np.bincount(e, minlength=self.ecount.size)
        np.maximum.at(self.emax, e, d)
        fin = (am < self._inf) & (bm < self._inf)
        va = _values(xa, self.code).astype(np.float64)
        vb = _values(yb, self.code).astype(np.float64)
        diff = va - vb
        if not fin.all():
            diff = diff[fin]
        self.sumsq_d += float(np.dot(diff, diff))

    def merge(self, o: "ScaleStats") -> None:
        self.sumsq_a += o.sumsq_a
        self.covered += o.covered
        self.sumsq_d += o.sumsq_d
        self.sign_changes += o.sign_changes
        self.to_zero += o.to_zero
        if self.on:
            self.ecount += o.ecount
            np.maximum(self.emax, o.emax, out=self.emax)

    def finish(self, n: int, max_abs: Optional[float]) -> Dict[str, Any]:
        """The statistics of a tensor of ``n`` elements (``max_abs``: largest |a - b|).

        ``rms_a`` is None unless every element of A was counted (see
        :meth:`add_a`); then the figures relative to it are None too.
        """
        out: Dict[str, Any] = dict.fromkeys(SCALE_FIELDS)
        if not self.on or not n:
            return out
        out["sign_changes"], out["to_zero"] = self.sign_changes, self.to_zero
        nz = np.flatnonzero(self.ecount)
        out["binades"] = [[int(b) - self._bias if b else None, int(self.ecount[b]),
                           int(self.emax[b])] for b in nz]
        if self.covered != n or not self.sumsq_a > 0 or not math.isfinite(self.sumsq_a):
            return out
        rms = math.sqrt(self.sumsq_a / n)
        rms_exp = math.frexp(rms)[1] - 1  # floor(log2(rms))
        # zeros and subnormals (binade 0) are always near zero
        tb = min(max(rms_exp + NEAR_ZERO_LOG2 + self._bias, 1), self.ecount.size)
        ta = min(max(rms_exp + self._bias, 1), self.ecount.size)
        out.update(rms_a=rms, rel_rms=math.sqrt(self.sumsq_d / n) / rms,
                   near_zero=int(self.ecount[:tb].sum()),
                   near_zero_below=2.0 ** (rms_exp + NEAR_ZERO_LOG2),
                   typical_from=2.0 ** rms_exp,
                   max_ulp_typical=int(self.emax[ta:].max()) if ta < self.emax.size else 0)
        if max_abs is not None and not math.isnan(max_abs):  # inf against a number: inf
            out["max_rel"] = max_abs / rms
            out["max_ulp_at_rms"] = max_abs / ulp_at(rms, self.code)
        return out
