"""``lorakit.diff``: are two checkpoints the same, and where and by how much not?

:func:`diff` streams both checkpoints in pieces compared as raw bytes first, only
differing pieces decoded (:func:`compare_sources`), into one table: relative error, ulp
distances, near-zero elements, mismatches. :meth:`DiffReport.ulp_report` shows it as ulp
histograms; :func:`ulp_vs_reference` measures a fused checkpoint against the exact
float64 fuse in ulps of its format (a correctly rounded fuse is never above 0.5).

>>> diff("data/tiny-qwen3", "data/tiny-qwen3").identical
True
"""
from __future__ import annotations

import ctypes
import math
import mmap
import os
import threading
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .. import numerics as nm
from ..errors import ArgumentError, FormatError
from ..fusion.delta import intended_pieces
from ..io.adapters.base import Adapter
from ..io.adapters.load import load_adapter
from ..io.adapters.naming import bind, bindings_by_tensor
from ..io.formats import source
from ..io.formats.safetensors import FLOAT_CODES, TensorInfo, mx_to_raw
from ..io.formats.weights import weight_f64
from ..layers import split_name
from ..progress import Progress, progress_bar
from ..report import Report
from . import plots
from .ulp_count import (
    CHUNK_BYTES,
    DEFAULT_MAX_BIN,
    NEAR_ZERO_LOG2,
    Accumulator,
    TensorDiff,
    TensorScale,
    bin_labels,
    bits_dtype,
    hist_text,
    pieces_in_memory,
    scale_kernel,
    sumsq,
)

__all__ = ["diff", "UlpReport", "ulp_vs_reference"]


#: the columns DiffReport and UlpReport share, explained once
_HELP = {
    "tensor": "the tensor's name",
    "dtype": "stored dtype (A/B when they differ)",
    "elements": "number of elements compared",
    "differing": "elements whose bits differ",
    "max_ulp": "largest distance in units in the last place (ulp) of the dtype",
    "rel_err": "rms(A - B) / rms(A): the error at the tensor's own scale (what behaviour feels)",
    "max_ulp_typ": "largest ulp distance among elements of typical magnitude (>= the tensor's rms, "
                   "rounded down to a power of two)",
    "near_zero": "differing elements below 2^-10 of the tensor's scale: their ulps are tiny, "
                 "so large ulp distances there mean little",
}


@dataclass(repr=False)
class DiffReport(Report):
    """A row per tensor; ``identical``: bit for bit with the same names on both sides;
    ``overall``: the ulp histogram over all tensors; ``diffs``: the :class:`TensorDiff` s."""

    column_help = {
        **_HELP,
        "status": "equal (bit for bit), differs, or a mismatch of name, dtype or shape",
        "shape": "the tensor's shape",
        "frac": "differing / elements",
        "max_abs": "largest absolute difference |A - B|",
    }

    identical: bool = False
    labels: List[str] = field(default_factory=list)
    overall: Optional[np.ndarray] = None
    diffs: List[TensorDiff] = field(default_factory=list)
    sources: Tuple[str, str] = ("A", "B")

    def differing(self) -> List[str]:
        """Names of the tensors that are not bit-identical (or one-sided)."""
        return [r["tensor"] for r in self.rows if r["status"] != "equal"]

    def ulp_report(self) -> UlpReport:
        """The same comparison as ulp histograms per tensor, per layer and overall."""
        return ulp_report(f"ulp distances {self.sources[0]} vs {self.sources[1]}", self.diffs,
                          self.labels, {"A": self.summary["A"], "B": self.summary["B"]})

    def plot(self, ax=None, kind: str = "tensors"):
        """``tensors``: fraction of differing elements per non-identical tensor;
        ``histogram``: the overall ulp histogram."""
        if kind == "histogram":
            return plots.histogram_bars(self.labels, {"all tensors": self.overall},
                                        title=self.title, ax=ax)
        rows = [r for r in self.rows if r["status"] == "differs"]
        return plots.grouped_bars([r["tensor"] for r in rows],
                                  {"differing fraction": [r["frac"] for r in rows]},
                                  title=self.title, ylabel="elements differing", ax=ax,
                                  log=True)


def diff(a: Any, b: Any, *, max_bin: int = DEFAULT_MAX_BIN,
           names: Optional[Sequence[str]] = None, threads: Optional[int] = None,
           progress: Progress = True) -> DiffReport:
    """Compare two checkpoints (anything :func:`lorakit.open` accepts) tensor by tensor:
    a :class:`DiffReport` (``.identical``: bit for bit). Same-dtype floats get exact ulp
    distances, a dtype mismatch is compared by value, integer tensors by equality.
    ``names``: only these tensors; ``threads``: default ``min(4, cpu_count)``;
    ``progress``: tqdm, a callable ``(done_bytes, total_bytes)``, or False."""
    sa, sb = source.open(a), source.open(b)
    diffs = compare_sources(sa, sb, max_bin=max_bin, names=names, threads=threads,
                            progress=progress)
    labels = bin_labels(max_bin)
    overall = np.zeros(len(labels), np.int64)
    rows: List[Dict[str, Any]] = []
    flagged: List[int] = []
    for i, d in enumerate(diffs):
        if d.counts is not None:
            overall += d.counts
        shape = d.shape_a if d.shape_a is not None else d.shape_b
        if d.shape_a is not None and d.shape_b is not None and d.shape_a != d.shape_b:
            shape_s = f"{list(d.shape_a)} vs {list(d.shape_b)}"
        else:
            shape_s = str(list(shape)) if shape is not None else ""
        rows.append({
            "tensor": d.name, "status": d.status,
            "dtype": d.dtype_a if d.dtype_a == d.dtype_b else f"{d.dtype_a} vs {d.dtype_b}",
            "shape": shape_s, "elements": d.elements, "differing": d.differing,
            "frac": d.differing / d.elements if d.elements else None,
            **scale_row(d), "max_ulp": d.max_ulp, "max_abs": d.max_abs,
            "nan_mismatch": d.nan_mismatch,
        })
        if d.status != "equal":
            flagged.append(i)
    by_status = Counter(d.status for d in diffs)
    ulps = [d.max_ulp for d in diffs if d.max_ulp is not None]
    abss = [d.max_abs for d in diffs if d.max_abs is not None]
    elements = int(sum(d.elements for d in diffs))
    differing = int(sum(d.differing for d in diffs))
    identical = not flagged
    summary: Dict[str, Any] = {
        "A": str(sa.path or sa.label), "B": str(sb.path or sb.label),
        "identical": identical,
        **scale_summary(diffs),
        "tensors": len(diffs),
        "tensors differing": by_status["differs"],
        "elements compared": elements,
        "elements differing": differing,
        "fraction differing": differing / elements if elements else 0.0,
        "max ulp": max(ulps) if ulps else None,
        "max abs": max(abss) if abss else None,
    }
    for status in ("dtype mismatch", "shape mismatch", "only in A", "only in B"):
        if by_status[status]:  # "dtype mismatches", ..., "only in A"
            summary[status + "es" if "mismatch" in status else status] = by_status[status]
    nan = sum(d.nan_mismatch for d in diffs)
    if nan:
        summary["NaN mismatches"] = nan
    verdict = "identical" if identical else f"{len(flagged)} of {len(diffs)} tensors differ"
    rel = summary.get("relative error, rms(A - B) / rms(A)")
    if rel is not None:  # the figure that matters for behaviour leads the one-line verdict
        verdict += (f", relative error {rel:.2g}, at most "
                    f"{summary['max ulp at typical magnitudes (|a|, |b| >= rms(A))']} ulp at "
                    "typical magnitudes")
    return DiffReport(title=f"diff {sa.label} vs {sb.label}: {verdict}", rows=rows,
                        columns="tensor status dtype shape elements differing frac rel_err "
                        "max_ulp_typ near_zero max_ulp max_abs".split(),
                        summary=summary, flagged=flagged, identical=identical, labels=labels,
                        overall=overall, diffs=diffs, sources=(sa.label, sb.label))


# -- Two tensor sources compared tensor by tensor, streaming, one TensorDiff each.


class _Mapped:
    """The checkpoints' files mapped read-only: a piece of a tensor is a view of the page
    cache, compared and measured where it lies (no copy). Compared bytes leave this
    process's map in runs of 32 MB (they stay in the page cache), so memory stays bounded."""

    RUN = 32 << 20

    def __init__(self) -> None:
        self.files: Dict[str, Tuple[int, Any, np.ndarray]] = {}
        self.done: Dict[Tuple[str, str], Tuple[int, int]] = {}
        self.lock = threading.Lock()

    def _file(self, info: TensorInfo) -> Tuple[int, Any, np.ndarray]:
        key = str(info.file)
        with self.lock:
            got = self.files.get(key)
            if got is None:
                fd = os.open(key, os.O_RDONLY)
                try:
                    size = os.fstat(fd).st_size
                    mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ) if size else b""
                except BaseException:
                    os.close(fd)
                    raise
                if size and hasattr(mmap, "MADV_SEQUENTIAL"):  # larger readahead, cold file
                    mm.madvise(mmap.MADV_SEQUENTIAL)
                got = self.files[key] = (fd, mm, np.frombuffer(mm, np.uint8))
        return got

    def piece(self, info: TensorInfo, off: int, n: int, storage: np.dtype) -> np.ndarray:
        """Bytes [off, off + n) of a tensor as its storage bits."""
        data = self._file(info)[2]
        start = info.begin + off
        if start + n > data.size:
            raise FormatError("file ended before the tensor's data", file=info.file,
                              tensor=info.name)
        x = data[start:start + n]
        return (x.copy() if start % storage.itemsize else x).view(storage)  # kernels: aligned

    def release(self, info: TensorInfo, off: int, n: int, reader: str) -> None:
        """``reader`` is done with bytes [off, off + n): unmapped 32 MB at a time."""
        key, start = (reader, str(info.file)), info.begin + off
        with self.lock:
            lo, hi = self.done.get(key, (start, start))
            if start != hi:
                self._unmap(key[1], lo, hi)
                lo = start
            hi = start + n
            if hi - lo >= self.RUN:
                self._unmap(key[1], lo, hi)
                lo = hi
            self.done[key] = (lo, hi)

    def _unmap(self, file: str, lo: int, hi: int) -> None:
        if hi > lo and hasattr(mmap, "MADV_DONTNEED"):
            page = lo // mmap.PAGESIZE * mmap.PAGESIZE
            self.files[file][1].madvise(mmap.MADV_DONTNEED, page, hi - page)

    def prefetch(self, info: TensorInfo) -> None:
        """Ask the kernel to start reading a tensor's bytes now (overlaps disk and compute)."""
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._file(info)[0], info.begin, info.nbytes, os.POSIX_FADV_WILLNEED)

    def close(self) -> None:
        for fd, _, _ in self.files.values():
            os.close(fd)
        self.files.clear()  # each map goes with the last view of it


def _memcmp() -> Callable[[int, int, int], int]:
    """The C library's ``memcmp`` (ctypes releases the GIL while it runs)."""
    fn = ctypes.CDLL(None).memcmp
    fn.restype, fn.argtypes = ctypes.c_int, (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    return fn


def _file_piece(files: _Mapped, memcmp, work, ia, ib, off: int, n: int, code, max_bin, scale=None):
    """Bytes [off, off + n) of two tensors: the element count when equal, else the piece's
    :class:`Accumulator` (``work``: the thread's scratch arrays)."""
    storage = bits_dtype(code)
    x, y = files.piece(ia, off, n, storage), files.piece(ib, off, n, storage)
    if memcmp(x.ctypes.data, y.ctypes.data, n) == 0:
        return x.size
    acc = Accumulator(code, max_bin, getattr(work, "scratch", None), scale)
    acc.add(x, y)
    work.scratch, acc.work = acc.work, None
    return acc


def _compare_mixed(sa, sb, name_a: str, name_b: str, td: TensorDiff) -> TensorDiff:
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


def _file_scale(files: _Mapped, info: TensorInfo, code: str, chunk: int, threads: int):
    """rms(A) of a tensor on disk, read at its first differing piece on ``threads`` threads
    of its own (the sums added in order: the result does not depend on the threads)."""
    storage = bits_dtype(code)

    def piece(off: int) -> float:
        x = files.piece(info, off, min(chunk, info.nbytes - off), storage)
        return sumsq(x, code, scale_kernel())

    def total() -> float:
        offs = range(0, info.nbytes, chunk)
        pool = ThreadPoolExecutor(threads) if threads > 1 and len(offs) > 1 else None
        try:
            sums = []
            for off, s in zip(offs, map(piece, offs) if pool is None else pool.map(piece, offs)):
                sums.append(s)
                files.release(info, off, min(chunk, info.nbytes - off), "scale")
            return math.fsum(sums)
        finally:
            if pool is not None:
                pool.shutdown(cancel_futures=True)

    return TensorScale(code, info.nbytes // storage.itemsize, total)


def compare_sources(a: Any, b: Any, *, max_bin: int = DEFAULT_MAX_BIN,
                    names: Optional[Sequence[str]] = None,
                    chunk_bytes: int = CHUNK_BYTES, threads: Optional[int] = None,
                    progress: Progress = False
                    ) -> List[TensorDiff]:
    """Compare every tensor of two sources, streaming, in pieces of ``chunk_bytes`` per
    side; one :class:`TensorDiff` each, in A's order, then tensors only in B. Memory: the
    pieces in flight and under 32 MB per file still mapped."""
    if max_bin < 3 or (max_bin + 1) & max_bin:
        raise ArgumentError.bad("max_bin", max_bin, "2**k - 1 with k >= 2")
    sa, sb = source.open(a), source.open(b)
    chunk = max(64, chunk_bytes // 64 * 64)
    threads = max(1, threads if threads is not None else min(4, os.cpu_count() or 1))
    wanted = None if names is None else set(names)
    order = [n for n in sa.tensors if wanted is None or n in wanted]
    if all(sa.file_info(n) is not None for n in order):  # read A's files front to back
        order.sort(key=lambda n: (str(sa.tensors[n].file), sa.tensors[n].begin))
    files, memcmp, work = _Mapped(), _memcmp(), threading.local()
    pool = ThreadPoolExecutor(threads) if threads > 1 else None
    pending: Deque[Tuple[Accumulator, Any, TensorInfo, TensorInfo, int, int]] = deque()
    window = 4 * threads  # pieces in flight: bounds memory, keeps every thread busy
    out: List[TensorDiff] = []
    finish: List[Tuple[Accumulator, TensorDiff]] = []
    streamed = [n for n in order if n in sb.tensors and sb.tensors[n].dtype == sa.tensors[n].dtype
                and tuple(sb.tensors[n].shape) == tuple(sa.tensors[n].shape)]
    bar = progress_bar(progress, sum(sa.tensors[n].nbytes for n in streamed),
                       "lorakit diff")

    def drain(limit: int) -> None:
        while len(pending) > limit:
            acc, fut, ia, ib, off, n = pending.popleft()
            acc.merge(fut.result() if pool is not None else fut)
            files.release(ia, off, n, "a")
            files.release(ib, off, n, "b")
            bar.update(n)

    prefetched: set = set()
    try:
        for i, name in enumerate(order):
            ma = sa.tensors[name]
            mb = sb.tensors.get(name)
            dtype_b, shape_b = (None, None) if mb is None else (mb.dtype, tuple(mb.shape))
            td = TensorDiff(name, "", ma.dtype, dtype_b, tuple(ma.shape), shape_b)
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
                ia, ib = sa.file_info(name), sb.file_info(name)
                if ia is None or ib is None:  # in memory already: compare in place
                    storage = bits_dtype(ma.dtype)
                    xa = sa.read(name).view(storage)
                    acc = Accumulator(ma.dtype, max_bin, None,
                                      TensorScale.of(xa, ma.dtype, scale_kernel()))
                    finish.append((acc, td))
                    for x, y, _ in pieces_in_memory(xa, sb.read(name).view(storage),
                                                  max(1, chunk // storage.itemsize)):
                        acc.add(x, y)
                        bar.update(x.nbytes)
                    acc.work = None
                    continue
                scale = _file_scale(files, ia, ma.dtype, chunk, threads)
                acc = Accumulator(ma.dtype, max_bin, None, scale)
                finish.append((acc, td))
                for nxt in order[i:i + 2]:  # this tensor and the next: disk runs ahead
                    if nxt not in prefetched and nxt in sb.tensors:
                        prefetched.add(nxt)
                        fa_, fb_ = sa.file_info(nxt), sb.file_info(nxt)
                        if fa_ is not None and fb_ is not None:
                            files.prefetch(fa_)
                            files.prefetch(fb_)
                for off in range(0, ia.nbytes, chunk):
                    n = min(chunk, ia.nbytes - off)
                    args = (files, memcmp, work, ia, ib, off, n, ma.dtype, max_bin, scale)
                    fut = _file_piece(*args) if pool is None else pool.submit(_file_piece, *args)
                    pending.append((acc, fut, ia, ib, off, n))
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
        files.close()
        bar.close()
    return out


# -- Ulp histograms as a report: per tensor, per layer and overall.


def scale_row(d: TensorDiff) -> Dict[str, Any]:
    """A diff's figures at the tensor's scale, for a report row (0 for an equal tensor)."""
    eq = d.status == "equal"
    return {"rel_err": 0.0 if eq else d.rel_rms,
            "max_ulp_typ": 0 if eq else d.max_ulp_typical,
            "near_zero": 0 if eq else d.near_zero,
            "sign_changes": 0 if eq else d.sign_changes,
            "zero_one_side": 0 if eq else d.to_zero,
            "max_ulp_at_rms": 0.0 if eq else d.max_ulp_at_rms,
            "rms_a": d.rms_a}


def scale_summary(diffs: Sequence[TensorDiff]) -> Dict[str, Any]:
    """Summary lines that put the ulp distances at the tensors' scale, relative error first
    (empty when no differing tensor has ulps)."""
    ds = [d for d in diffs if d.differing and d.rel_rms is not None]
    if not ds:
        return {}
    a2 = sum(d.rms_a ** 2 * d.elements for d in ds)
    d2 = sum((d.rel_rms * d.rms_a) ** 2 * d.elements for d in ds)
    typ = max(d.max_ulp_typical for d in ds)
    at_rms = max((d.max_ulp_at_rms for d in ds if d.max_ulp_at_rms is not None), default=None)
    near = sum(d.near_zero for d in ds)
    signs, zeros = sum(d.sign_changes for d in ds), sum(d.to_zero for d in ds)
    top = max(d.max_ulp for d in ds)
    out: Dict[str, Any] = {
        "relative error, rms(A - B) / rms(A)": (d2 / a2) ** 0.5,
        "max |a - b| in ulps at rms(A)": at_rms,
        "max ulp at typical magnitudes (|a|, |b| >= rms(A))": typ,
        "differing near zero (< 2**-10 rms(A))": near,
        "zero on one side": zeros,
        "sign changes": signs,
    }
    if top > typ:
        out["why max ulp is large"] = (
            f"the {top} ulp are at small values, where the format's steps are tiny; at "
            f"typical magnitudes (>= rms(A)) the largest distance is {typ} ulp")
    return out


@dataclass(repr=False)
class UlpReport(Report):
    """Ulp histograms of two sources: ``counts[i]`` per row, ``per_layer``, ``overall``."""

    column_help = {
        **_HELP,
        "layer": "transformer block number (None: outside the blocks)",
        "kind": "what the tensor is (q/k/v/o projection, mlp part, norm, ...)",
        "status": "equal (bit for bit), differs, or why it was not compared",
        "mean_ulp": "mean distance in ulp over all elements",
        "hist": "share of elements per ulp distance (largest bins)",
    }

    labels: List[str] = field(default_factory=list)
    counts: Optional[np.ndarray] = None
    overall: Optional[np.ndarray] = None
    per_layer: Dict[str, np.ndarray] = field(default_factory=dict)
    diffs: List[TensorDiff] = field(default_factory=list)

    def histogram(self, tensor: Optional[str] = None, layer: Optional[str] = None) -> Dict:
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
        if tensor is not None:
            series = {tensor: list(self.histogram(tensor).values())}
            return plots.histogram_bars(self.labels, series,
                                        title=f"ulp distances: {tensor}", ax=ax)
        if level == "layers":
            keys = sorted(self.per_layer, key=lambda k: (k != "-", int(k) if k != "-" else 0))
            m = np.array([self.per_layer[k] / max(1, self.per_layer[k].sum()) for k in keys])
            return plots.value_heatmap(keys, self.labels, m, title=self.title,
                                       cbar="fraction of elements", ax=ax, log=True)
        return plots.histogram_bars(self.labels, {"all tensors": self.overall},
                                    title=self.title, ax=ax)


def ulp_report(title: str, diffs: Sequence[TensorDiff], labels: Sequence[str],
               summary: Dict[str, Any]) -> UlpReport:
    """The :class:`UlpReport` of a list of diffs (``labels``: their histogram bins)."""
    labels = list(labels)
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
                     "differing": d.differing, **scale_row(d), "max_ulp": d.max_ulp,
                     "mean_ulp": d.mean_ulp, "nan_mismatch": d.nan_mismatch,
                     "hist": hist_text(labels, d.counts)})
        if d.status != "equal":
            flagged.append(i)
    overall = counts.sum(axis=0)
    ulps = [d.max_ulp for d in diffs if d.max_ulp is not None]
    summary = dict(summary)
    summary.update(scale_summary(diffs))
    summary.update({
        "tensors": len(diffs),
        "elements": int(sum(d.elements for d in diffs)),
        "differing": int(sum(d.differing for d in diffs)),
        "max ulp": max(ulps) if ulps else None,
        "histogram": hist_text(labels, overall, top=6),
    })
    return UlpReport(title=title, rows=rows, summary=summary, flagged=flagged,
                     columns="tensor dtype status elements differing rel_err max_ulp_typ near_zero "
                     "max_ulp mean_ulp hist".split(),
                     labels=labels, counts=counts, overall=overall, per_layer=per_layer,
                     diffs=list(diffs))


def _as_bits(x: Any, fmt: Optional[str]) -> Tuple[np.ndarray, str]:
    """Storage bits and safetensors code of an array (numpy, mx, or bits with fmt)."""
    if type(x).__module__.startswith("mlx"):
        raw, code = mx_to_raw(x)
        return np.asarray(raw), code
    arr = np.asarray(x)
    if fmt is None and not (arr.dtype.kind == "f" or arr.dtype.name == "bfloat16"):
        raise FormatError("cannot tell the float format of an integer array",
                          found=str(arr.dtype), hint="pass fmt='bf16' (or f16, f32) for storage bits")
    f = nm.float_format(fmt if fmt is not None else arr.dtype)
    return nm.to_storage(arr, f), f.safetensors


def ulp_tensors(a, b, fmt: Optional[str] = None, *, name="tensor", max_bin=DEFAULT_MAX_BIN):
    """Ulp distance histogram between two tensors of one format: numpy or mlx float
    arrays, or storage bits (uint16/uint32) with ``fmt`` (``"bf16"``, ``"f16"``, ``"f32"``)."""
    xa, ca = _as_bits(a, fmt)
    xb, cb = _as_bits(b, fmt)
    if ca != cb or xa.shape != xb.shape:
        raise FormatError("tensors differ in format or shape", tensor=name,
                          expected=f"{ca}{list(xa.shape)}", found=f"{cb}{list(xb.shape)}")
    st = bits_dtype(ca)
    acc = Accumulator(ca, max_bin, scale=TensorScale.of(xa.view(st), ca, scale_kernel()))
    for x, y, _ in pieces_in_memory(xa.view(st), xb.view(st), CHUNK_BYTES // 2):
        acc.add(x, y)
    td = acc.result(TensorDiff(name, "", ca, cb, xa.shape, xb.shape))
    return ulp_report(f"ulp distances ({ca})", [td], bin_labels(max_bin), {})


# -- A fused checkpoint against the exact fuse, in (fractional) ulps of its format


_ERR_EDGES = np.array([0.5] + [2.0 ** k for k in range(0, 11)])


def error_labels() -> List[str]:
    """Bin labels of :func:`error_histogram`: ``0``, ``(0,0.5]``, ..., ``>1024``, ``nan``."""
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
    """Ulp error of a fused checkpoint against the float64 fuse, per adapted tensor, with
    histograms of the error (``labels`` / ``counts`` / ``overall``)."""

    column_help = {
        "tensor": "the adapted tensor's name",
        "dtype": "stored dtype of the fused tensor",
        "status": "measured, or why not (missing in fused, quantized)",
        "elements": "number of elements measured",
        "max_err": "largest error in ulp against the exact (float64) fuse",
        "mean_err": "mean error in ulp against the exact fuse",
        "not_nearest": "elements more than 0.5 ulp off: not the correctly rounded value",
        "hist": "share of elements per error range in ulp (largest bins)",
        "rel_err": "rms(fused - exact) / rms(exact): the error at the tensor's own scale",
        "max_err_typ": "largest error in ulp among elements of typical magnitude",
    }

    labels: List[str] = field(default_factory=list)
    counts: Optional[np.ndarray] = None
    overall: Optional[np.ndarray] = None

    def plot(self, tensor: Optional[str] = None, ax=None):
        if tensor is not None:
            i = [r["tensor"] for r in self.rows].index(tensor)
            series = {tensor: self.counts[i]}
        else:
            series = {"all adapted tensors": self.overall}
        return plots.histogram_bars(self.labels, series, title=self.title, ax=ax,
                                    xlabel="|fused - exact| in ulps")


class _RefScale:
    """rms(F - T) / rms(T), and per binade of |T| the largest ulp error and the elements
    not correctly rounded (typical magnitudes and near zero told apart at the end)."""

    _LO = -200  # binade index offset: exponents of float64 |T| clipped to [-200, 200)

    def __init__(self) -> None:
        self.t2 = self.d2 = 0.0
        self.emax = np.zeros(400)
        self.bad = np.zeros(400, np.int64)

    def add(self, f: np.ndarray, t: np.ndarray, err: np.ndarray) -> None:
        ok = np.isfinite(f) & np.isfinite(t) & ~np.isnan(err)
        f, t, err = f[ok], t[ok], err[ok]
        self.t2 += float(np.dot(t, t))
        d = f - t
        self.d2 += float(np.dot(d, d))
        e = np.clip(np.frexp(np.abs(t))[1] - 1, self._LO, -self._LO - 1) - self._LO
        np.maximum.at(self.emax, e, err)
        self.bad += np.bincount(e[err > 0.5], minlength=self.emax.size)

    def figures(self, n: int) -> Dict[str, Any]:
        """The row's figures for ``n`` elements (none without a non-zero rms(T)); ``_t2``
        and ``_d2`` stay for the summary."""
        if not self.t2 > 0:
            return {}
        rms = math.sqrt(self.t2 / max(1, n))
        ta = math.frexp(rms)[1] - 1 - self._LO
        tn = max(ta + NEAR_ZERO_LOG2, 0)
        return dict(rel_err=math.sqrt(self.d2 / self.t2),
                    max_err_typ=float(self.emax[max(ta, 0):].max()),
                    not_nearest_near_zero=int(self.bad[:tn].sum()), rms_t=rms, _t2=self.t2,
                    _d2=self.d2)


def _scale_summary(measured: List[Dict[str, Any]]) -> Dict[str, Any]:
    rows = [r for r in measured if r.get("_t2")]
    if not rows:
        return {}
    t2, d2 = sum(r.pop("_t2") for r in rows), sum(r.pop("_d2") for r in rows)
    typ = max(r["max_err_typ"] for r in rows)
    top = max(r["max_err"] for r in rows)
    out: Dict[str, Any] = {
        "relative error, rms(F - T) / rms(T)": math.sqrt(d2 / t2),
        "max error at typical magnitudes (ulp, |T| >= rms(T))": typ,
        "not correctly rounded near zero (|T| < 2**-10 rms(T))":
            sum(r["not_nearest_near_zero"] for r in rows),
    }
    if top > max(1.0, 2 * typ):  # the max is not what typical elements see
        out["why max error is large"] = (
            f"the {top:.4g} ulp are at small values of the exact result, where ulps are "
            f"tiny; at typical magnitudes the largest error is {typ:.4g} ulp")
    return out


def ulp_vs_reference(fused: Any, base: Any, adapter: Any) -> RefUlpReport:
    """Ulp error of each fused weight against the exact ``W + scale * B @ A`` (float64),
    in ulps of the fused tensor's own format: <= 0.5 everywhere means correctly rounded.
    Quantized fused weights are listed but not measured (see :func:`check`)."""
    sf, sb = source.open(fused), source.open(base)
    ad = adapter if isinstance(adapter, Adapter) else load_adapter(adapter)
    by_tensor = bindings_by_tensor(bind(ad, sb))
    labels = error_labels()
    rows: List[Dict[str, Any]] = []
    all_counts: List[np.ndarray] = []
    flagged: List[int] = []
    for tensor, binds in by_tensor.items():
        meta = sf.tensors.get(tensor)
        row: Dict[str, Any] = dict(tensor=tensor, dtype=meta.dtype if meta else None, elements=0)
        row.update(max_err=None, mean_err=None, not_nearest=None, hist="", status="measured",
                   rel_err=None, max_err_typ=None, not_nearest_near_zero=None)
        counts = np.zeros(len(labels), np.int64)
        module = tensor[: -len(".weight")]
        if meta is None:
            row["status"] = "missing in fused"
        elif meta.dtype not in ("BF16", "F16", "F32") or sf.quant_params(module) is not None:
            row["status"] = "quantized (not measured)"
        else:
            fmt = nm.float_format(meta.dtype)
            total, mx_err, bad = 0.0, 0.0, 0
            sc = _RefScale()
            for raw_f, _, target in intended_pieces(sf, sb, tensor, binds):
                err = nm.ulp_error_vs_reference(raw_f, target, fmt)
                counts += error_histogram(err)
                finite = err[~np.isnan(err)]
                if finite.size:
                    mx_err = max(mx_err, float(finite.max()))
                    total += float(finite.sum())
                bad += int((err > 0.5).sum())
                row["elements"] += err.size
                sc.add(nm.to_float64(raw_f, fmt).reshape(-1), target.reshape(-1),
                       err.reshape(-1))
            row.update(max_err=mx_err, mean_err=total / max(1, row["elements"]),
                       not_nearest=bad, hist=hist_text(labels, counts))
            row.update(sc.figures(row["elements"]))
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
        **_scale_summary(measured),
        "max error (ulp)": max((r["max_err"] for r in measured), default=None),
        "mean error (ulp)": sum(r["mean_err"] * r["elements"] for r in measured) / n if n else None,
        "not correctly rounded": sum(r["not_nearest"] for r in measured),
        "histogram": hist_text(labels, overall, top=6),
    }
    return RefUlpReport(title=f"ulp error of {sf.label} vs exact fuse", rows=rows,
                        columns="tensor dtype status elements rel_err max_err_typ max_err mean_err "
                        "not_nearest hist".split(),
                        summary=summary, flagged=flagged, labels=labels, counts=counts_arr,
                        overall=overall)
