"""Exact ulp distances of two pieces of storage, counted into histograms.

An ulp distance counts how many representable values of the format lie between
two values (:func:`lorakit.numerics.ulp_distance`: +0 and -0 are the same point,
the line runs through the subnormals, inf is one past the largest finite value,
NaN against NaN is 0 and NaN against a number is a mismatch). Histograms use the
bins of :func:`lorakit.numerics.ulp_histogram` (0, 1, 2, 3, 4-7, 8-15, ...), so
tensors, layers and checkpoints line up.

:class:`Accumulator` folds pieces of one tensor's raw storage (as bits) into a
histogram and totals, and :meth:`Accumulator.result` writes them into a
:class:`TensorDiff`. Decoding runs in the optional C kernel (``_ulpkernel.c``: one
vectorised pass per block of 256 elements, built at install where a C compiler is
found) or, without it, in numpy: for 16-bit formats a few integer passes over the
bits (:func:`_positions16`), where few elements differ only those; pieces holding a
NaN, and float32 tensors, go through ``numerics.ulp_distance`` itself. Both paths
give the same numbers, bit for bit (tests/test_ulp_kernel.py).

>>> acc = Accumulator("BF16", DEFAULT_MAX_BIN)
>>> acc.add(np.array([0x3F80, 0x0000], np.uint16), np.array([0x3F81, 0x8000], np.uint16))
>>> td = acc.result(TensorDiff("t", "", "BF16", "BF16", (2,), (2,)))
>>> (td.differing, td.max_ulp, hist_text(bin_labels(), td.counts))
(2, 1, '0:50% 1:50%')
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from .. import numerics as nm
from ..io.safetensors import FLOAT_CODES, NUMPY_STORAGE
from .ulp_scale import ScaleStats, TensorScale

__all__ = ["DEFAULT_MAX_BIN", "CHUNK_BYTES", "USE_KERNEL", "kernel_available", "bits_dtype",
           "TensorDiff", "Scratch", "Accumulator", "bin_labels", "hist_text",
           "pieces_in_memory"]

DEFAULT_MAX_BIN = 1023

try:  # the optional C accelerator (pyproject: built where a C compiler is found)
    from . import _ulpkernel as _kernel
except ImportError:  # pragma: no cover - depends on the install
    _kernel = None
#: formats the C kernel takes, by its format number
_KERNEL_FMT = {"BF16": 0, "F16": 1, "F32": 2}
#: set to False (or LORAKIT_ULP_KERNEL=0 in the environment) to use the numpy path
USE_KERNEL = os.environ.get("LORAKIT_ULP_KERNEL", "1") != "0"


def scale_kernel():
    """The kernel when it has ``scale`` / ``sumsq`` (an older build lacks them: numpy
    does that part)."""
    return _kernel if USE_KERNEL and hasattr(_kernel, "sumsq") else None


def kernel_available() -> bool:
    """True when the C ulp kernel is built and in use (see :data:`USE_KERNEL`)."""
    return _kernel is not None and USE_KERNEL


#: bytes per piece and side: big enough that syscalls are cheap, small enough that
#: the int32 temporaries of a fully differing piece stay in the CPU's caches.
CHUNK_BYTES = 1 << 20
_ULP16 = ("BF16", "F16")
#: float tensors are compared as their bits (NaN payloads included), never as floats
_BITS = {"BF16": np.dtype("<u2"), "F16": np.dtype("<u2"), "F32": np.dtype("<u4"),
         "F64": np.dtype("<u8")}


def bits_dtype(code: str) -> np.dtype:
    """numpy dtype holding a tensor's storage as plain bits (unsigned ints for floats;
    bytes for the packed sub-byte codes, F4 / F6_*, compared byte by byte).

    >>> bits_dtype("BF16"), bits_dtype("I8"), bits_dtype("F4")
    (dtype('uint16'), dtype('int8'), dtype('uint8'))
    """
    return _BITS.get(code) or NUMPY_STORAGE.get(code) or np.dtype("<u1")


# -- per-tensor accumulation -------------------------------------------------------------
@dataclass
class TensorDiff:
    """How two tensors of the same name compare.

    ``status``: ``equal`` (bit for bit), ``differs``, ``dtype mismatch``, ``shape
    mismatch``, ``only in A``, ``only in B``. ``differing`` counts elements whose
    bits differ (for a dtype mismatch: whose values differ). ``counts`` is the ulp
    histogram (bins of :func:`numerics.ulp_histogram`) for float tensors of one
    dtype, None otherwise; ``max_ulp`` / ``ulp_sum`` leave NaN mismatches out
    (they are counted in ``nan_mismatch``).
    """

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
    #: at the tensor's scale (lorakit.inspect.ulp_scale, fields SCALE_FIELDS): rms of A,
    #: rms(a - b) / rms(A), max |a - b| / rms(A) and in ulps at rms(A), sign changes,
    #: elements zero on one side, differing elements near zero and the largest ulp
    #: distance at typical magnitudes
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
    """Scratch arrays reused by every piece: numpy ops write into them (``out=``), so a
    fully differing piece allocates (almost) nothing and stays in the CPU caches."""

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
        """``k`` copies of ``value`` as int16: ``np.minimum`` against an array runs in
        SIMD, against a Python scalar it is six times slower."""
        c = self._caps.get(value)
        if c is None:
            c = self._caps[value] = np.full(self.n, value, np.int16)
        return c[:k]


def _positions16(x: np.ndarray, out: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Sign-magnitude 16-bit floats -> int16 positions on the ulp line, in place.

    ``pos = x`` for a positive sign, ``-(x & 0x7FFF)`` for a negative one: +0 and -0
    both land on 0 and neighbouring floats are 1 apart (NaNs are handled by the caller).
    Four int16 passes, no table lookups: a gather costs ten times more per element.
    """
    xv = x.view(np.int16)
    np.right_shift(xv, 15, out=s)  # -1 for negative, 0 otherwise
    np.bitwise_and(s, 0x7FFF, out=out)
    np.bitwise_xor(xv, out, out=out)  # negative: -1 - magnitude
    np.subtract(out, s, out=out)  # negative: -magnitude
    return out


class Accumulator:
    """Accumulates one tensor's comparison over pieces of raw storage (as bits)."""

    def __init__(self, code: str, max_bin: int, work: Optional[Scratch] = None,
                 scale: Optional[TensorScale] = None) -> None:
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
        """Add non-negative distances (no NaN sentinels) to the histogram and totals.

        Distances above ``max_bin`` are capped to ``max_bin + 1`` before counting, so
        ``np.bincount`` fills at most ``max_bin + 2`` counters whatever the distances
        (a count vector as long as the largest distance costs more than the counting).
        """
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
        fast = fmt is not None and _kernel is not None and USE_KERNEL and \
            x.dtype.isnative and y.dtype.isnative
        if fast:
            # one pass in C: the same numbers as the numpy path below, 3-4x faster
            diff, nan, top, total, mabs = _kernel.accumulate(
                np.ascontiguousarray(x), np.ascontiguousarray(y), fmt, self.raw)
            self.n += n
            self.differing += diff
            self.nan += nan
            self.max_ulp = max(self.max_ulp, top)
            self.ulp_sum += total
            self.max_abs = max(self.max_abs, mabs)
            return
        w = self.work = (self.work or Scratch(n)).fit(n)
        per = 8 // x.itemsize
        if n % per == 0:
            # Find differing 8-byte words first: a quarter of the elements to scan (for
            # 16-bit data), and where few differ only those words are looked at again.
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
        self.n += part.n
        self.differing += part.differing
        self.nan += part.nan
        self.max_ulp = max(self.max_ulp, part.max_ulp)
        self.ulp_sum += part.ulp_sum
        self.scale.merge(part.scale)
        if self.raw is not None:
            self.raw += part.raw
        if self.max_abs is not None:
            self.max_abs = max(self.max_abs, part.max_abs)

    def result(self, td: TensorDiff) -> TensorDiff:
        td.elements, td.differing, td.nan_mismatch = self.n, self.differing, self.nan
        td.status = "differs" if self.differing else "equal"
        td.max_abs = self.max_abs
        if self.raw is not None:
            td.max_ulp, td.ulp_sum = self.max_ulp, float(self.ulp_sum)
            td.counts = _binned(self.raw, self.nan, self.max_bin)
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


def _binned(raw: np.ndarray, nan: int, max_bin: int) -> np.ndarray:
    """Fold a dense 0..max_bin+1 count vector (NaN mismatches not in it) into
    ulp_histogram's bins, NaN mismatches last."""
    counts = [int(c) for c in raw[:4]]
    lo = 4
    while lo <= max_bin:
        counts.append(int(raw[lo:2 * lo].sum()))
        lo *= 2
    counts += [int(raw[max_bin + 1]), nan]
    return np.array(counts, dtype=np.int64)


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

