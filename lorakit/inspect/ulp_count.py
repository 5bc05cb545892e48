"""Exact ulp distances of two pieces of storage, counted into histograms.

An ulp distance counts the representable values between two values
(:func:`lorakit.numerics.ulp_distance`); histograms use the bins of
:func:`lorakit.numerics.ulp_histogram`. :class:`Accumulator` folds pieces of one
tensor's storage bits into a histogram and totals, in the optional C kernel
(``_ulpkernel.c``) or in numpy: the same numbers, bit for bit
(tests/inspect/test_ulp_count.py). :class:`ScaleStats` puts the differences at the
tensor's scale (relative error, zero crossings, near-zero elements), since ulp
distances near zero are huge and mean little.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from .. import kernels
from .. import numerics as nm
from ..io.formats.safetensors import FLOAT_CODES, NUMPY_STORAGE
from ..numerics.ulps import fold_bins

__all__ = ["bits_dtype", "binades"]


DEFAULT_MAX_BIN = 1023

#: formats the C kernel takes, by its format number
_KERNEL_FMT = {"BF16": 0, "F16": 1, "F32": 2}


def scale_kernel():
    """The C ulp kernel where it is built and kernels are on, else None (numpy)."""
    return kernels.load("lorakit.inspect._ulpkernel")


#: bytes per piece and side: the int32 temporaries of a differing piece stay in cache
CHUNK_BYTES = 1 << 20
_ULP16 = ("BF16", "F16")
#: float tensors are compared as their bits (NaN payloads included), never as floats
_BITS = dict(BF16=np.dtype("<u2"), F16=np.dtype("<u2"), F32=np.dtype("<u4"), F64=np.dtype("<u8"))


def bits_dtype(code: str) -> np.dtype:
    """numpy dtype holding a tensor's storage as plain bits (unsigned ints for floats;
    bytes for the packed sub-byte codes, F4 / F6_*, compared byte by byte)."""
    return _BITS.get(code) or NUMPY_STORAGE.get(code) or np.dtype("<u1")


# -- per-tensor accumulation -------------------------------------------------------------
@dataclass
class TensorDiff:
    """How two tensors of the same name compare. ``status``: ``equal`` (bit for bit),
    ``differs``, ``dtype mismatch``, ``shape mismatch``, ``only in A`` or ``only in B``;
    ``counts``: the ulp histogram (same-dtype floats only); ``max_ulp`` / ``ulp_sum``
    leave NaN mismatches out (``nan_mismatch``)."""

    name: str
    status: str
    dtype_a: Optional[str]
    dtype_b: Optional[str]
    shape_a: Optional[Tuple[int, ...]]
    shape_b: Optional[Tuple[int, ...]]
    elements: int = 0
    differing: int = 0
    nan_mismatch: int = 0
    max_ulp: Optional[int] = None
    ulp_sum: float = 0.0
    max_abs: Optional[float] = None
    counts: Optional[np.ndarray] = None
    #: at the tensor's scale (SCALE_FIELDS, see ScaleStats)
    rms_a: Optional[float] = None
    rel_rms: Optional[float] = None
    max_rel: Optional[float] = None
    max_ulp_at_rms: Optional[float] = None
    sign_changes: Optional[int] = None
    to_zero: Optional[int] = None
    near_zero: Optional[int] = None
    near_zero_below: Optional[float] = None
    typical_from: Optional[float] = None
    max_ulp_typical: Optional[int] = None

    @property
    def mean_ulp(self) -> Optional[float]:
        if self.max_ulp is None or not self.elements:
            return None
        return self.ulp_sum / max(1, self.elements - self.nan_mismatch)


class Scratch:
    """Scratch arrays reused by every piece (numpy's ``out=``)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.mask = np.empty(n, np.bool_)
        self.s16 = np.empty(n, np.int16)
        self.a16 = np.empty(n, np.int16)
        self.b16 = np.empty(n, np.int16)
        # int64 (intp): np.bincount would otherwise copy its input to intp first
        self.i1 = np.empty(n, np.int64)
        self.i2 = np.empty(n, np.int64)
        self.u1 = np.empty(n, np.uint32)
        self.u2 = np.empty(n, np.uint32)
        self._caps: Dict[int, np.ndarray] = {}

    def fit(self, n: int) -> "Scratch":
        return self if n <= self.n else Scratch(n)

    def cap16(self, value: int, k: int) -> np.ndarray:
        """``k`` copies of ``value`` as int16 (``np.minimum`` against an array is SIMD)."""
        c = self._caps.get(value)
        if c is None:
            c = self._caps[value] = np.full(self.n, value, np.int16)
        return c[:k]


def _positions16(x: np.ndarray, out: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Sign-magnitude 16-bit floats -> int16 positions on the ulp line (``-(x & 0x7FFF)``
    for a negative sign: +0 and -0 both at 0), in place, in four int16 passes."""
    xv = x.view(np.int16)
    np.right_shift(xv, 15, out=s)  # -1 for negative, 0 otherwise
    np.bitwise_and(s, 0x7FFF, out=out)
    np.bitwise_xor(xv, out, out=out)  # negative: -1 - magnitude
    np.subtract(out, s, out=out)  # negative: -magnitude
    return out


class Accumulator:
    """Accumulates one tensor's comparison over pieces of raw storage (as bits)."""

    def __init__(self, code: str, max_bin: int, work=None, scale=None) -> None:
        self.code = code
        self.max_bin = max_bin
        self.ulps = code in _ULP16 or code == "F32"
        # dense counts of every distance seen, 0..max_bin+1 (the last: larger ones)
        self.raw = np.zeros(max_bin + 2, np.int64) if self.ulps else None
        self.n = 0
        self.differing = 0
        self.nan = 0
        self.max_ulp = 0
        self.ulp_sum = 0
        self.max_abs = 0.0 if code in FLOAT_CODES else None
        self.work = work
        self.scale = ScaleStats(code, scale)  # figures at the tensor's scale
        if code in _ULP16:
            self._inf = nm.float_format(code).inf_bits

    def equal(self, n: int) -> None:
        self.n += n
        if self.raw is not None:
            self.raw[0] += n

    def _count(self, d: np.ndarray) -> None:
        """Add non-negative distances to the histogram and totals (capped to ``max_bin +
        1`` first, so that ``np.bincount`` fills at most ``max_bin + 2`` counters)."""
        if not d.size:
            return
        k = d.size
        top = int(d.max())
        cap = self.max_bin + 1
        self.max_ulp = max(self.max_ulp, top)
        w = self.work if self.work is not None and k <= self.work.n else None
        if top >= cap:  # the exact sum first (int32 where it cannot overflow: 2x faster)
            small = d.dtype.itemsize <= 2 and top * k < (1 << 31)
            self.ulp_sum += int(np.add.reduce(d, dtype=np.int32) if small
                                else d.sum(dtype=np.int64))
            if d.dtype == np.int16 and w is not None and cap <= 0x7FFF and \
                    not np.may_share_memory(d, w.s16):
                d = np.minimum(d, w.cap16(cap, k), out=w.s16[:k])
            else:
                d = np.minimum(d, cap)
        if d.dtype != np.intp and w is not None:
            # bincount wants intp: widen into the reused scratch buffer, not a fresh array
            np.copyto(w.i1[:k], d)
            d = w.i1[:k]
        c = np.bincount(d)
        if top < cap:
            self.ulp_sum += int(np.multiply(c, np.arange(c.size, dtype=np.int64)).sum())
        self.raw[:c.size] += c

    def add(self, x: np.ndarray, y: np.ndarray) -> None:
        before = self.differing
        self._add(x, y)
        if self.differing > before:  # only a differing piece needs the tensor's scale
            native = x.dtype.isnative and y.dtype.isnative
            self.scale.add(x, y, scale_kernel() if native else None)

    def _add(self, x: np.ndarray, y: np.ndarray) -> None:
        n = x.size
        fmt = _KERNEL_FMT.get(self.code)
        kernel = scale_kernel() if fmt is not None else None
        if kernel is not None and x.dtype.isnative and y.dtype.isnative:
            self._take(n, *kernel.accumulate(np.ascontiguousarray(x), np.ascontiguousarray(y),
                                              fmt, self.raw))
            return
        w = self.work = (self.work or Scratch(n)).fit(n)
        per = 8 // x.itemsize
        if n % per == 0:
            # differing 8-byte words first: where few differ, only those are looked at again
            words = np.not_equal(x.view(np.uint64), y.view(np.uint64), out=w.mask[:n // per])
            nwords = int(np.count_nonzero(words))
            if nwords == 0:
                self.equal(n)
                return
            if nwords * per * 16 < n:  # under 1/16 of the words: gather them
                widx = np.flatnonzero(words)
                eidx = (widx[:, None] * per + np.arange(per)).reshape(-1)
                x, y = x.take(eidx), y.take(eidx)
        ne = np.not_equal(x, y, out=w.mask[:x.size])
        nd = int(np.count_nonzero(ne))
        if nd == 0:  # only reached by a piece that is not a whole number of words
            self.equal(n)
            return
        self.n += n
        self.differing += nd
        if x.size == n and nd * 4 < n:  # sparse: work on the differing elements only
            idx = np.flatnonzero(ne)  # 3x faster than boolean indexing, twice
            x, y = x.take(idx), y.take(idx)
        k = x.size
        if self.raw is not None:
            self.raw[0] += n - k  # the equal elements left out above
        code = self.code
        if code in _ULP16:
            pa = _positions16(x, w.a16[:k], w.s16[:k])
            pb = _positions16(y, w.b16[:k], w.s16[:k])
            ra = max(int(pa.max()), -int(pa.min()))
            rb = max(int(pb.max()), -int(pb.min()))
            if max(ra, rb) > self._inf:  # a NaN somewhere in this piece: exact rules, rare
                d = nm.ulp_distance(x, y, code)
                bad = d == nm.NAN_MISMATCH
                self.nan += int(bad.sum())
                self._count(d[~bad])
            elif ra + rb <= 0x7FFF:  # |pa - pb| fits int16: the usual case (|values| < 2)
                np.subtract(pa, pb, out=pa)
                np.abs(pa, out=pa)
                self._count(pa)
            else:  # widen: differences reach +-2**16
                d, e = w.i1[:k], w.i2[:k]
                np.copyto(d, pa)
                np.copyto(e, pb)
                np.subtract(d, e, out=d)
                np.abs(d, out=d)
                self._count(d)
        elif code == "F32":
            d = nm.ulp_distance(x, y, "float32")
            bad = d == nm.NAN_MISMATCH
            nb = int(bad.sum())
            if nb:
                self.nan += nb
                d = d[~bad]
            self._count(d)
        if self.max_abs is not None:
            self.max_abs = max(self.max_abs, _max_abs(x, y, code, w))

    def merge(self, part: Union[int, "Accumulator"]) -> None:
        """Fold in a piece: an equal-bytes element count, or a piece's accumulator."""
        if isinstance(part, int):
            self.equal(part)
            return
        self._take(part.n, part.differing, part.nan, part.max_ulp, part.ulp_sum, part.max_abs)
        self.scale.merge(part.scale)
        if self.raw is not None:
            self.raw += part.raw

    def _take(self, n: int, differing: int, nan: int, top: int, total: int, max_abs) -> None:
        """Add a piece's totals (the kernel's, or a piece's accumulator's)."""
        self.n += n
        self.differing += differing
        self.nan += nan
        self.max_ulp = max(self.max_ulp, top)
        self.ulp_sum += total
        if self.max_abs is not None:
            self.max_abs = max(self.max_abs, max_abs)

    def result(self, td: TensorDiff) -> TensorDiff:
        td.elements, td.differing, td.nan_mismatch = self.n, self.differing, self.nan
        td.status = "differs" if self.differing else "equal"
        td.max_abs = self.max_abs
        if self.raw is not None:
            td.max_ulp, td.ulp_sum = self.max_ulp, float(self.ulp_sum)
            td.counts = fold_bins(self.raw, self.nan, self.max_bin)[1]
        for k, v in self.scale.finish(self.n, self.max_abs).items():
            setattr(td, k, v)
        return td


def _max_abs(x: np.ndarray, y: np.ndarray, code: str, w: Optional[Scratch] = None) -> float:
    """Largest |a - b| over finite pairs (NaN pairs ignored, inf against a number is inf)."""
    k = x.size
    if not k:
        return 0.0
    if code == "F64":
        va, vb = x.view(np.float64), y.view(np.float64)
    elif code == "F32":
        va, vb = x.view(np.float32), y.view(np.float32)
    elif w is not None and code == "BF16":  # bf16 -> f32 is a 16-bit shift, done in place
        va, vb = w.u1[:k], w.u2[:k]
        np.copyto(va, x)
        np.left_shift(va, 16, out=va)
        np.copyto(vb, y)
        np.left_shift(vb, 16, out=vb)
        va, vb = va.view(np.float32), vb.view(np.float32)
    else:  # differences of 16-bit values in float32: exact unless exponents are far apart
        va, vb = nm.to_float32(x, code), nm.to_float32(y, code)
    with np.errstate(invalid="ignore", over="ignore"):
        if w is not None and code == "BF16":
            d = np.subtract(va, vb, out=va)  # in the scratch buffer
        else:
            d = va - vb
    # fmax/fmin skip NaN (inf - inf, NaN operands); two reductions beat an abs pass
    m = max(float(np.fmax.reduce(d)), -float(np.fmin.reduce(d)))
    return 0.0 if math.isnan(m) else m


def bin_labels(max_bin: int = DEFAULT_MAX_BIN) -> List[str]:
    """The histogram's bin labels: ``0, 1, 2, 3, 4-7, ...``, the overflow bin, ``nan``."""
    return nm.ulp_histogram(np.zeros(0, np.int64), max_bin)[0]


def pieces_in_memory(a: np.ndarray, b: np.ndarray, elems: int
                     ) -> Iterator[Tuple[np.ndarray, np.ndarray, int]]:
    """Two in-memory arrays as flat pieces of ``elems`` elements: ``(x, y, size)``."""
    fa, fb = a.reshape(-1), b.reshape(-1)
    for s in range(0, fa.size, elems):
        x, y = fa[s:s + elems], fb[s:s + elems]
        yield x, y, x.size


# -- histogram text ---------------------------------------------------------------------
def hist_text(labels: Sequence[str], counts: Optional[np.ndarray], top: int = 3) -> str:
    """The ``top`` fullest bins (always with the highest one occupied), in bin order,
    as percentages: ``"0:96.5% 1:3.4% 4-7:0.01%"``."""
    if counts is None:
        return ""
    c = np.asarray(counts)
    total = int(c.sum())
    if not total:
        return ""
    nz = np.flatnonzero(c)
    keep = set(nz[np.argsort(-c[nz], kind="stable")][: max(1, top - 1)].tolist())
    keep.add(int(nz[-1]))
    if len(keep) < top:
        keep |= set(nz[np.argsort(-c[nz], kind="stable")][:top].tolist())
    return " ".join(f"{labels[i]}:{100 * c[i] / total:.3g}%" for i in sorted(keep))


# -- What an ulp distance means at the tensor's scale: relative error, zero crossings.


#: "near zero": min(|a|, |b|) below 2**NEAR_ZERO_LOG2 * rms(A) (a power of two)
NEAR_ZERO_LOG2 = -10
#: what :meth:`ScaleStats.finish` returns (and TensorDiff carries)
SCALE_FIELDS = ("rms_a rel_rms max_rel max_ulp_at_rms sign_changes to_zero near_zero "
                "near_zero_below typical_from max_ulp_typical").split()
_FLOAT = {"BF16", "F16", "F32"}


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


def sumsq(x: np.ndarray, code: str, kernel: Any = None) -> float:
    """Sum of squares of a piece's values (storage bits); inf or NaN give inf or NaN."""
    if kernel is not None and hasattr(kernel, "sumsq"):
        return kernel.sumsq(np.ascontiguousarray(x), _KERNEL_FMT[code])
    # float64 sums (a float32 dot's rounding depends on the BLAS build), 2**20 at a time
    v, total = nm.to_float32(x, code).reshape(-1), 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for s in range(0, v.size, 1 << 20):
            c = v[s:s + (1 << 20)].astype(np.float64)
            total += float(np.dot(c, c))
    return total


def _thresholds(rms: float, code: str) -> Tuple[int, int, float, float]:
    """(near_bits, typ_bits, near_zero_below, typical_from) for a tensor of this rms:
    magnitude-bit thresholds at whole binades, zeros and subnormals always near zero."""
    f = nm.float_format(code)
    rms_exp = math.frexp(rms)[1] - 1  # floor(log2(rms))
    nb = 1 << f.exponent_bits
    tn = min(max(rms_exp + NEAR_ZERO_LOG2 + f.emax, 1), nb - 1)
    tt = min(max(rms_exp + f.emax, 1), nb - 1)
    m, e = f.mantissa_bits, f.emax
    return tn << m, tt << m, 2.0 ** (tn - e), 2.0 ** (tt - e)


class TensorScale:
    """rms(A) of one tensor of ``n`` elements and the thresholds it sets, computed once on
    first use by ``sumsq_fn`` (thread-safe: shared by the tensor's pieces)."""

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
    """Scale statistics of one tensor's comparison: ``rms_a`` and ``rel_rms = rms(a - b)
    / rms_a``; ``sign_changes`` and ``to_zero`` (zero on one side only); ``near_zero``:
    differing elements with ``min(|a|, |b|) < near_zero_below`` (2**NEAR_ZERO_LOG2 of
    rms(A), rounded down to a power of two); ``max_ulp_typical``: the largest ulp
    distance where ``min(|a|, |b|) >= typical_from`` (rms(A) rounded down likewise)."""

    def __init__(self, code: str, tensor: Optional[TensorScale] = None) -> None:
        self.code = code
        self.tensor = tensor
        self.on = code in _FLOAT and tensor is not None
        self.seen = False  # a differing piece was measured
        self.sumsq_d = 0.0
        self.sign_changes = self.to_zero = self.near_zero = self.max_ulp_typical = 0

    def add(self, x: np.ndarray, y: np.ndarray, kernel: Any = None) -> None:
        """One piece of both tensors (storage bits), in the C kernel or numpy."""
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
        va, vb = nm.to_float32(xa, self.code), nm.to_float32(yb, self.code)
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
        """The figures of a tensor of ``n`` elements; all None unless a differing piece was
        measured against a finite, non-zero rms(A)."""
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
    count, max ulp], ...]`` (exponent None for zeros and subnormals; NaN left out)."""
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
