"""Exact ulp distances between tensors and checkpoints, as histograms.

An ulp distance counts how many representable values of the format lie between
two values (:func:`lorakit.numerics.ulp_distance`: +0 and -0 are the same point,
the line runs through the subnormals, inf is one past the largest finite value,
NaN against NaN is 0 and NaN against a number is a mismatch). Histograms use the
bins of :func:`lorakit.numerics.ulp_histogram` (0, 1, 2, 3, 4-7, 8-15, ...), so
tensors, layers and checkpoints line up.

:func:`ulp_compare` streams two checkpoints tensor by tensor in fixed-size pieces
(a few MB each, whatever the tensor's size): each piece is first compared as raw
bytes (``memcmp`` speed) and only a piece whose bytes differ is decoded. Decoding
runs in the optional C kernel (``_ulpkernel.c``: one vectorised pass per block of
256 elements, built at install where a C compiler is found) or, without it, in
numpy: for 16-bit formats a few integer passes over the bits
(:func:`_positions16`), where few elements differ only those; pieces holding a
NaN, and float32 tensors, go through ``numerics.ulp_distance`` itself. Both paths
give the same numbers, bit for bit (tests/test_ulp_kernel.py).

:func:`ulp_vs_reference` measures a fused checkpoint against the exact fuse
``W + scale * B @ A`` computed in float64, in (fractional) ulps of the fused
format: a correctly rounded fuse is never above 0.5.

>>> bits_a = np.array([0x3F80, 0x0000, 0x8001], np.uint16)  # bf16 1.0, +0, -min_subnormal
>>> bits_b = np.array([0x3F81, 0x8000, 0x0001], np.uint16)  # next float up, -0, +min_sub.
>>> ulp_tensors(bits_a, bits_b, "bf16").rows[0]["max_ulp"]
2
"""
from __future__ import annotations

import math
import os
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from .. import numerics as nm
from ..errors import FormatError
from ..io.safetensors import FLOAT_CODES, NUMPY_STORAGE, TensorInfo
from .dtype_map import TensorSource, open_source, split_name, weight_f64
from .report import Report

__all__ = ["TensorDiff", "compare_sources", "UlpReport", "ulp_compare", "ulp_tensors",
           "RefUlpReport", "ulp_vs_reference", "error_histogram", "DEFAULT_MAX_BIN"]

DEFAULT_MAX_BIN = 1023

try:  # the optional C accelerator (pyproject: built where a C compiler is found)
    from . import _ulpkernel as _kernel
except ImportError:  # pragma: no cover - depends on the install
    _kernel = None
#: formats the C kernel takes, by its format number
_KERNEL_FMT = {"BF16": 0, "F16": 1, "F32": 2}
#: set to False (or LORAKIT_ULP_KERNEL=0 in the environment) to use the numpy path
USE_KERNEL = os.environ.get("LORAKIT_ULP_KERNEL", "1") != "0"


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
    """numpy dtype holding a tensor's storage as plain bits (unsigned ints for floats)."""
    return _BITS.get(code, NUMPY_STORAGE[code])


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

    @property
    def mean_ulp(self) -> Optional[float]:
        if self.max_ulp is None or not self.elements:
            return None
        return self.ulp_sum / max(1, self.elements - self.nan_mismatch)


class _Work:
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

    def fit(self, n: int) -> "_Work":
        return self if n <= self.n else _Work(n)

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


class _Acc:
    """Accumulates one tensor's comparison over pieces of raw storage (as bits)."""

    def __init__(self, code: str, max_bin: int, work: Optional[_Work] = None) -> None:
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
        n = x.size
        fmt = _KERNEL_FMT.get(self.code)
        if fmt is not None and _kernel is not None and USE_KERNEL and x.dtype.isnative \
                and y.dtype.isnative:
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
        w = self.work = (self.work or _Work(n)).fit(n)
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

    def merge(self, part: Union[int, "_Acc"]) -> None:
        """Fold in a piece: an equal-bytes element count, or a piece's accumulator."""
        if isinstance(part, int):
            self.equal(part)
            return
        self.n += part.n
        self.differing += part.differing
        self.nan += part.nan
        self.max_ulp = max(self.max_ulp, part.max_ulp)
        self.ulp_sum += part.ulp_sum
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
        return td


def _max_abs(x: np.ndarray, y: np.ndarray, code: str, w: Optional[_Work] = None) -> float:
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
    return nm.ulp_histogram(np.zeros(0, np.int64), max_bin)[0]


# -- streaming two sources ------------------------------------------------------------------
_PREADV = hasattr(os, "preadv")


class _Reader:
    """Reads byte ranges of files into one reusable buffer (no per-piece allocation)."""

    def __init__(self, size: int) -> None:
        self.buf = bytearray(size)
        self.view = memoryview(self.buf)
        self.fds: Dict[str, int] = {}

    def _fd(self, info: TensorInfo) -> int:
        key = str(info.file)
        fd = self.fds.get(key)
        if fd is None:
            fd = self.fds[key] = os.open(key, os.O_RDONLY)
            if hasattr(os, "posix_fadvise"):  # larger kernel readahead for a cold file
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        return fd

    def read(self, info: TensorInfo, offset: int, n: int) -> None:
        fd = self._fd(info)
        got = 0
        while got < n:
            pos = info.begin + offset + got
            if _PREADV:
                k = os.preadv(fd, [self.view[got:n]], pos)
            else:  # macOS builds without preadv: this reader's fd is its own, seek is safe
                os.lseek(fd, pos, os.SEEK_SET)
                k = os.readv(fd, [self.view[got:n]])
            if k <= 0:
                raise FormatError("file ended before the tensor's data", file=info.file,
                                  tensor=info.name)
            got += k

    def prefetch(self, info: TensorInfo) -> None:
        """Ask the kernel to start reading a tensor's bytes now (overlaps disk and compute)."""
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd(info), info.begin, info.nbytes, os.POSIX_FADV_WILLNEED)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


class _Local(threading.local):
    """Per-thread buffers: two readers and the numpy scratch arrays."""

    def __init__(self, size: int, registry: List["_Reader"]) -> None:
        self.ra, self.rb = _Reader(size), _Reader(size)
        self.work = _Work(size // 2)
        registry += [self.ra, self.rb]


def _file_piece(local: _Local, ia: TensorInfo, ib: TensorInfo, off: int, n: int, code: str,
                max_bin: int) -> Union[int, _Acc]:
    """Compare bytes [off, off + n) of two tensors: the element count when the bytes are
    equal (memcmp), else a partial :class:`_Acc` of the piece."""
    ra, rb = local.ra, local.rb
    ra.read(ia, off, n)
    rb.read(ib, off, n)
    if n < len(ra.buf):  # equal tails make whole-buffer memcmp valid for a short piece
        ra.buf[n:] = rb.buf[n:]
    storage = bits_dtype(code)
    k = n // storage.itemsize
    if ra.buf == rb.buf:
        return k
    acc = _Acc(code, max_bin, local.work)
    acc.add(np.frombuffer(ra.buf, storage, count=k), np.frombuffer(rb.buf, storage, count=k))
    acc.work = None  # the scratch arrays stay with the thread
    return acc


def _pieces_memory(a: np.ndarray, b: np.ndarray, elems: int):
    fa, fb = a.reshape(-1), b.reshape(-1)
    for s in range(0, fa.size, elems):
        x, y = fa[s:s + elems], fb[s:s + elems]
        yield x, y, x.size


def _compare_mixed(sa: TensorSource, sb: TensorSource, name_a: str, name_b: str,
                   td: TensorDiff) -> TensorDiff:
    """Two float tensors of different dtypes: compare values (float64), no ulps."""
    shape = td.shape_a or ()
    td.status = "dtype mismatch"
    n_rows = shape[0] if shape else 1
    row = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
    max_abs = 0.0
    for rows in (nm.chunks(n_rows, row, 1 << 20) if shape else [None]):
        va = weight_f64(sa, name_a, rows).reshape(-1)
        vb = weight_f64(sb, name_b, rows).reshape(-1)
        with np.errstate(invalid="ignore"):
            same = (va == vb) | (np.isnan(va) & np.isnan(vb))
            d = np.abs(va - vb)
        td.elements += va.size
        td.differing += int(va.size - np.count_nonzero(same))
        td.nan_mismatch += int(np.count_nonzero(np.isnan(va) ^ np.isnan(vb)))
        if d.size:
            m = float(np.fmax.reduce(d))
            if not math.isnan(m):
                max_abs = max(max_abs, m)
    td.max_abs = max_abs
    return td


def compare_sources(a: Any, b: Any, *, max_bin: int = DEFAULT_MAX_BIN,
                    names: Optional[Sequence[str]] = None,
                    chunk_bytes: int = CHUNK_BYTES, threads: Optional[int] = None,
                    progress: Union[bool, Callable[[int, int], None]] = False
                    ) -> List[TensorDiff]:
    """Compare every tensor of two sources, streaming; one :class:`TensorDiff` each.

    Args:
        a, b: checkpoint/adapter directories, .safetensors files, Checkpoints or
            in-memory mlx-lm models (anything :func:`~lorakit.inspect.dtype_map.open_source`
            takes).
        max_bin: top of the last power-of-two histogram bin.
        names: compare only these tensor names.
        chunk_bytes: bytes read per piece and side.
        threads: pieces compared at once (numpy releases the GIL); default
            ``min(4, cpu_count)``. Memory stays about ``threads * 12 * chunk_bytes``.
        progress: a progress bar over A's bytes (tqdm.auto: a widget in notebooks, a
            bar in terminals, nothing when stderr is not a terminal), or a callable
            ``progress(done_bytes, total_bytes)``.

    Rows come in A's order, then tensors only in B.
    """
    if max_bin < 3 or (max_bin + 1) & max_bin:
        raise ValueError(f"max_bin must be 2**k - 1 with k >= 2, got {max_bin}")
    sa, sb = open_source(a), open_source(b)
    chunk = max(64, chunk_bytes // 64 * 64)
    threads = max(1, threads if threads is not None else min(4, os.cpu_count() or 1))
    wanted = None if names is None else set(names)
    order = [n for n in sa.tensors if wanted is None or n in wanted]
    if all(sa.file_info(n) is not None for n in order):  # read A's files front to back
        order.sort(key=lambda n: (str(sa.tensors[n].file), sa.tensors[n].begin))
    readers: List[_Reader] = []
    local = _Local(chunk, readers)
    pool = ThreadPoolExecutor(threads) if threads > 1 else None
    pending: Deque[Tuple[_Acc, Any, int]] = deque()
    window = 4 * threads  # pieces in flight: bounds memory, keeps every thread busy
    out: List[TensorDiff] = []
    finish: List[Tuple[_Acc, TensorDiff]] = []
    streamed = [n for n in order if n in sb.tensors and sb.tensors[n].dtype == sa.tensors[n].dtype
                and tuple(sb.tensors[n].shape) == tuple(sa.tensors[n].shape)]
    tick = _progress(progress, sum(sa.tensors[n].nbytes for n in streamed))

    def drain(limit: int) -> None:
        while len(pending) > limit:
            acc, fut, nbytes = pending.popleft()
            acc.merge(fut.result() if pool is not None else fut)
            tick(nbytes)

    prefetched: set = set()
    try:
        for i, name in enumerate(order):
            ma = sa.tensors[name]
            mb = sb.tensors.get(name)
            td = TensorDiff(name, "", ma.dtype, mb.dtype if mb is not None else None,
                            tuple(ma.shape), tuple(mb.shape) if mb is not None else None)
            out.append(td)
            if mb is None:
                td.status = "only in A"
            elif tuple(ma.shape) != tuple(mb.shape):
                td.status = "shape mismatch"
            elif ma.dtype != mb.dtype:
                if ma.dtype in FLOAT_CODES and mb.dtype in FLOAT_CODES:
                    _compare_mixed(sa, sb, name, name, td)
                else:
                    td.status = "dtype mismatch"
            else:
                acc = _Acc(ma.dtype, max_bin)
                finish.append((acc, td))
                ia, ib = sa.file_info(name), sb.file_info(name)
                if ia is None or ib is None:  # in memory already: compare in place
                    storage = bits_dtype(ma.dtype)
                    acc.work = local.work
                    for x, y, _ in _pieces_memory(sa.read(name).view(storage),
                                                  sb.read(name).view(storage),
                                                  max(1, chunk // storage.itemsize)):
                        acc.add(x, y)
                        tick(x.nbytes)
                    acc.work = None
                    continue
                for nxt in order[i:i + 2]:  # this tensor and the next: disk runs ahead
                    if nxt not in prefetched and nxt in sb.tensors:
                        prefetched.add(nxt)
                        fa_, fb_ = sa.file_info(nxt), sb.file_info(nxt)
                        if fa_ is not None and fb_ is not None:
                            local.ra.prefetch(fa_)
                            local.rb.prefetch(fb_)
                for off in range(0, ia.nbytes, chunk):
                    n = min(chunk, ia.nbytes - off)
                    if pool is None:
                        pending.append((acc, _file_piece(local, ia, ib, off, n, ma.dtype,
                                                         max_bin), n))
                    else:
                        pending.append((acc, pool.submit(_file_piece, local, ia, ib, off, n,
                                                         ma.dtype, max_bin), n))
                    drain(window)
        drain(0)
        for acc, td in finish:
            acc.result(td)
        for name, mb in sb.tensors.items():
            if name not in sa.tensors and (wanted is None or name in wanted):
                out.append(TensorDiff(name, "only in B", None, mb.dtype, None, tuple(mb.shape)))
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        for r in readers:
            r.close()
        tick(None)
    return out


def _progress(progress: Union[bool, Callable[[int, int], None]], total: int
              ) -> Callable[[Optional[int]], None]:
    """``tick(nbytes)`` after each piece, ``tick(None)`` at the end (closes the bar)."""
    if callable(progress):
        done = [0]

        def call(n: Optional[int]) -> None:
            if n is not None:
                done[0] += n
                progress(done[0], total)  # type: ignore[operator]
        return call
    if not progress:
        return lambda n: None
    from tqdm.auto import tqdm

    # disable=None: no bar when stderr is not a terminal (logs, pipes, CI)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="lorakit diff", disable=None,
               leave=False)

    def update(n: Optional[int]) -> None:
        if n is None:
            bar.close()
        else:
            bar.update(n)
    return update


# -- ulp reports ---------------------------------------------------------------------------------
def _hist_text(labels: Sequence[str], counts: Optional[np.ndarray], top: int = 3) -> str:
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


@dataclass(repr=False)
class UlpReport(Report):
    """Ulp histograms of two sources, per tensor, per layer and overall.

    ``rows``: tensor, layer, kind, dtype, elements, differing, max_ulp, mean_ulp,
    hist. ``labels``: histogram bins. ``counts``: one histogram per row
    (``counts[i]``, zeros for rows without ulps). ``overall`` / ``per_layer``: sums.
    """

    labels: List[str] = field(default_factory=list)
    counts: Optional[np.ndarray] = None
    overall: Optional[np.ndarray] = None
    per_layer: Dict[str, np.ndarray] = field(default_factory=dict)
    diffs: List[TensorDiff] = field(default_factory=list)

    def histogram(self, tensor: Optional[str] = None, layer: Optional[str] = None
                  ) -> Dict[str, int]:
        """Bin label -> count for one tensor, one layer (``"3"``, ``"-"``), or overall."""
        if tensor is not None:
            i = [r["tensor"] for r in self.rows].index(tensor)
            c = self.counts[i]
        elif layer is not None:
            c = self.per_layer[str(layer)]
        else:
            c = self.overall
        return dict(zip(self.labels, (int(v) for v in c)))

    def plot(self, level: str = "overall", tensor: Optional[str] = None, ax=None):
        """``overall``: histogram bars; ``layers``: layer x bin heatmap (fraction of
        elements, log colour); ``tensor=name``: that tensor's histogram."""
        from . import plots

        if tensor is not None:
            return plots.histogram_bars(self.labels, {tensor: list(self.histogram(tensor).values())},
                                        title=f"ulp distances: {tensor}", ax=ax)
        if level == "layers":
            keys = sorted(self.per_layer, key=lambda k: (k != "-", int(k) if k != "-" else 0))
            m = np.array([self.per_layer[k] / max(1, self.per_layer[k].sum()) for k in keys])
            return plots.value_heatmap(keys, self.labels, m, title=self.title,
                                       cbar="fraction of elements", ax=ax, log=True)
        return plots.histogram_bars(self.labels, {"all tensors": self.overall},
                                    title=self.title, ax=ax)

    figure = plot


def _ulp_report(title: str, diffs: List[TensorDiff], max_bin: int,
                summary: Dict[str, Any]) -> UlpReport:
    labels = bin_labels(max_bin)
    rows: List[Dict[str, Any]] = []
    counts = np.zeros((len(diffs), len(labels)), np.int64)
    per_layer: Dict[str, np.ndarray] = {}
    flagged = []
    for i, d in enumerate(diffs):
        layer, kind, _, _ = split_name(d.name)
        if d.counts is not None:
            counts[i] = d.counts
            key = "-" if layer is None else str(layer)
            per_layer[key] = per_layer.get(key, 0) + d.counts
        rows.append({"tensor": d.name, "layer": layer, "kind": kind,
                     "dtype": d.dtype_a if d.dtype_a == d.dtype_b else
                     f"{d.dtype_a}/{d.dtype_b}", "status": d.status, "elements": d.elements,
                     "differing": d.differing, "max_ulp": d.max_ulp, "mean_ulp": d.mean_ulp,
                     "nan_mismatch": d.nan_mismatch,
                     "hist": _hist_text(labels, d.counts)})
        if d.status != "equal":
            flagged.append(i)
    overall = counts.sum(axis=0)
    ulps = [d.max_ulp for d in diffs if d.max_ulp is not None]
    summary = dict(summary)
    summary.update({
        "tensors": len(diffs),
        "elements": int(sum(d.elements for d in diffs)),
        "differing": int(sum(d.differing for d in diffs)),
        "max ulp": max(ulps) if ulps else None,
        "histogram": _hist_text(labels, overall, top=6),
    })
    return UlpReport(title=title, rows=rows, summary=summary, flagged=flagged,
                     columns=["tensor", "dtype", "status", "elements", "differing", "max_ulp",
                              "mean_ulp", "hist"],
                     labels=labels, counts=counts, overall=overall, per_layer=per_layer,
                     diffs=diffs)


def ulp_compare(a: Any, b: Any, *, max_bin: int = DEFAULT_MAX_BIN,
                names: Optional[Sequence[str]] = None, threads: Optional[int] = None,
                progress: Union[bool, Callable[[int, int], None]] = True) -> UlpReport:
    """Ulp histograms between two checkpoints (or adapters, files, in-memory models).

    Streams tensor by tensor in pieces of about a MB, so memory stays bounded
    whatever the checkpoints' size. Tensors of different dtypes or shapes are
    listed with that status (see :func:`lorakit.parity` for a verdict table).

    >>> import lorakit
    >>> a = lorakit.fuse("data/tiny-qwen3", "data/adapters/lora", "fused-lk").output
    >>> b = lorakit.fuse("data/tiny-qwen3", "data/adapters/lora", "fused-mlx", rounding="mlx-lm").output
    >>> rep = ulp_compare(a, b); rep.summary["tensors"], rep.summary["max ulp"] > 1
    (46, True)
    """
    sa, sb = open_source(a), open_source(b)
    diffs = compare_sources(sa, sb, max_bin=max_bin, names=names, threads=threads,
                            progress=progress)
    return _ulp_report(f"ulp distances {sa.label} vs {sb.label}", diffs, max_bin,
                       {"A": str(sa.path or sa.label), "B": str(sb.path or sb.label)})


def _as_bits(x: Any, fmt: Optional[str]) -> Tuple[np.ndarray, str]:
    """Storage bits and safetensors code of an array (numpy, mx, or bits with fmt)."""
    if type(x).__module__.startswith("mlx"):
        from ..io.safetensors import mx_to_raw

        raw, code = mx_to_raw(x)
        return np.asarray(raw), code
    arr = np.asarray(x)
    if fmt is not None:
        f = nm.float_format(fmt)
        return nm.to_storage(arr, f) if arr.dtype.kind == "f" else arr.view(f.storage), \
            f.safetensors
    if arr.dtype.kind == "f" or arr.dtype.name == "bfloat16":
        f = nm.float_format(arr.dtype)
        return arr.view(f.storage), f.safetensors
    raise FormatError("cannot tell the float format of an integer array", found=str(arr.dtype),
                      hint="pass fmt='bf16' (or f16, f32) for storage bits")


def ulp_tensors(a: Any, b: Any, fmt: Optional[str] = None, *, name: str = "tensor",
                max_bin: int = DEFAULT_MAX_BIN) -> UlpReport:
    """Ulp distance histogram between two tensors of one format.

    Args:
        a, b: numpy float arrays (float16/float32), mlx arrays, or storage bits
            (uint16/uint32) together with ``fmt``.
        fmt: the format (``"bf16"``, ``"f16"``, ``"f32"``) when passing bits.
    """
    xa, ca = _as_bits(a, fmt)
    xb, cb = _as_bits(b, fmt)
    if ca != cb or xa.shape != xb.shape:
        raise FormatError("tensors differ in format or shape", tensor=name,
                          expected=f"{ca}{list(xa.shape)}", found=f"{cb}{list(xb.shape)}")
    acc = _Acc(ca, max_bin)
    st = bits_dtype(ca)
    for x, y, _ in _pieces_memory(xa.view(st), xb.view(st), CHUNK_BYTES // 2):
        acc.add(x, y)
    td = acc.result(TensorDiff(name, "", ca, cb, xa.shape, xb.shape))
    return _ulp_report(f"ulp distances ({ca})", [td], max_bin, {})


# -- against the exact fuse -------------------------------------------------------------------
_ERR_EDGES = np.array([0.5] + [2.0 ** k for k in range(0, 11)])


def error_labels() -> List[str]:
    labs = ["0", "(0,0.5]"]
    prev = 0.5
    for e in _ERR_EDGES[1:]:
        labs.append(f"({prev:g},{e:g}]")
        prev = e
    return labs + [f">{prev:g}", "nan"]


def error_histogram(err: np.ndarray) -> np.ndarray:
    """Counts of fractional ulp errors in bins 0, (0,0.5], (0.5,1], (1,2], ..., >1024, nan."""
    e = np.asarray(err, np.float64).reshape(-1)
    nan = np.isnan(e)
    zero = e == 0
    idx = np.searchsorted(_ERR_EDGES, e[~nan & ~zero], side="left") + 1
    c = np.bincount(idx, minlength=len(_ERR_EDGES) + 2)
    c[0] = int(zero.sum())
    return np.concatenate([c, [int(nan.sum())]]).astype(np.int64)


@dataclass(repr=False)
class RefUlpReport(Report):
    """Ulp error of a fused checkpoint against the float64 fuse, per adapted tensor.

    ``rows``: tensor, dtype, elements, max_err, mean_err, not_nearest (elements more
    than 0.5 ulp off: not the correctly rounded value), hist. ``labels`` /
    ``counts`` / ``overall``: histograms of the error.
    """

    labels: List[str] = field(default_factory=list)
    counts: Optional[np.ndarray] = None
    overall: Optional[np.ndarray] = None

    def plot(self, tensor: Optional[str] = None, ax=None):
        from . import plots

        if tensor is not None:
            i = [r["tensor"] for r in self.rows].index(tensor)
            series = {tensor: self.counts[i]}
        else:
            series = {"all adapted tensors": self.overall}
        return plots.histogram_bars(self.labels, series, title=self.title, ax=ax,
                                    xlabel="|fused - exact| in ulps")

    figure = plot


def ulp_vs_reference(fused: Any, base: Any, adapter: Any) -> RefUlpReport:
    """Ulp error of each fused weight against the exact ``W + scale * B @ A`` (float64).

    The error is measured with :func:`numerics.ulp_error_vs_reference` in ulps of
    the fused tensor's own format: <= 0.5 everywhere means correctly rounded.
    Quantized fused weights are listed but not measured (see :func:`merge_check`).

    >>> import lorakit
    >>> _ = lorakit.fuse("data/tiny-qwen3", "data/adapters/lora", "fused")
    >>> rep = ulp_vs_reference("fused", "data/tiny-qwen3", "data/adapters/lora")
    >>> round(rep.summary["max error (ulp)"], 6), rep.summary["not correctly rounded"]
    (0.5, 0)
    """
    from ..io.adapter import Adapter, load_adapter
    from ..io.naming import bind, bindings_by_tensor
    from .merge_check import intended_pieces

    sf, sb = open_source(fused), open_source(base)
    ad = adapter if isinstance(adapter, Adapter) else load_adapter(adapter)
    by_tensor = bindings_by_tensor(bind(ad, sb))  # type: ignore[arg-type]
    labels = error_labels()
    rows: List[Dict[str, Any]] = []
    all_counts: List[np.ndarray] = []
    flagged: List[int] = []
    for tensor, binds in by_tensor.items():
        meta = sf.tensors.get(tensor)
        row: Dict[str, Any] = {"tensor": tensor, "dtype": meta.dtype if meta else None,
                               "elements": 0, "max_err": None, "mean_err": None,
                               "not_nearest": None, "hist": "", "status": "measured"}
        counts = np.zeros(len(labels), np.int64)
        module = tensor[: -len(".weight")]
        if meta is None:
            row["status"] = "missing in fused"
        elif meta.dtype not in ("BF16", "F16", "F32") or sf.quant_params(module) is not None:
            row["status"] = "quantized (not measured)"
        else:
            fmt = nm.float_format(meta.dtype)
            total, mx_err, bad = 0.0, 0.0, 0
            for raw_f, _, target in intended_pieces(sf, sb, tensor, binds):
                err = nm.ulp_error_vs_reference(raw_f, target, fmt)
                counts += error_histogram(err)
                finite = err[~np.isnan(err)]
                if finite.size:
                    mx_err = max(mx_err, float(finite.max()))
                    total += float(finite.sum())
                bad += int((err > 0.5).sum())
                row["elements"] += err.size
            row.update(max_err=mx_err, mean_err=total / max(1, row["elements"]),
                       not_nearest=bad, hist=_hist_text(labels, counts))
        if row["status"] != "measured" or (row["not_nearest"] or 0) > 0:
            flagged.append(len(rows))
        rows.append(row)
        all_counts.append(counts)
    counts_arr = np.array(all_counts) if all_counts else np.zeros((0, len(labels)), np.int64)
    overall = counts_arr.sum(axis=0)
    measured = [r for r in rows if r["status"] == "measured"]
    n = sum(r["elements"] for r in measured)
    summary = {
        "fused": str(sf.path or sf.label), "base": str(sb.path or sb.label),
        "adapter": str(ad.path), "tensors": len(rows), "elements": n,
        "max error (ulp)": max((r["max_err"] for r in measured), default=None),
        "mean error (ulp)": (sum(r["mean_err"] * r["elements"] for r in measured) / n)
        if n else None,
        "not correctly rounded": sum(r["not_nearest"] for r in measured),
        "histogram": _hist_text(labels, overall, top=6),
    }
    return RefUlpReport(title=f"ulp error of {sf.label} vs exact fuse", rows=rows,
                        columns=["tensor", "dtype", "status", "elements", "max_err", "mean_err",
                                 "not_nearest", "hist"],
                        summary=summary, flagged=flagged, labels=labels, counts=counts_arr,
                        overall=overall)
