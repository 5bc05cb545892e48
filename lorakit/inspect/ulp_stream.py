"""Two tensor sources compared tensor by tensor, streaming, one TensorDiff each.

:func:`compare_sources` reads two checkpoints (or adapters, files, in-memory models)
in fixed-size pieces (a few MB each, whatever the tensor's size): each piece is
first compared as raw bytes (``memcmp`` speed) and only a piece whose bytes differ
is decoded, by an :class:`~lorakit.inspect.ulp_accumulate.Accumulator`. Pieces are
compared on a few threads (numpy and the C kernel release the GIL) while the kernel
reads ahead, so memory stays bounded whatever the checkpoints' size.
:func:`lorakit.parity` and :func:`lorakit.ulp_compare` turn the diffs into reports.

>>> sorted({d.status for d in compare_sources("data/tiny-qwen3", "data/tiny-qwen3")})
['equal']
"""
from __future__ import annotations

import math
import os
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from .. import numerics as nm
from .._progress import Progress, progress_bar
from ..errors import FormatError
from ..io.safetensors import FLOAT_CODES, TensorInfo
from ..io.source import TensorSource, open_source
from ..io.weights import weight_f64
from .ulp_accumulate import (CHUNK_BYTES, DEFAULT_MAX_BIN, Accumulator, Scratch, TensorDiff,
                             bits_dtype, pieces_in_memory, scale_kernel)
from .ulp_scale import TensorScale, sumsq

__all__ = ["compare_sources"]

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
        self.work = Scratch(size // 2)
        registry += [self.ra, self.rb]


def _file_piece(local: _Local, ia: TensorInfo, ib: TensorInfo, off: int, n: int, code: str,
                max_bin: int, scale: Optional[TensorScale] = None) -> Union[int, Accumulator]:
    """Compare bytes [off, off + n) of two tensors: the element count when the bytes are
    equal (memcmp), else a partial :class:`Accumulator` of the piece."""
    ra, rb = local.ra, local.rb
    ra.read(ia, off, n)
    rb.read(ib, off, n)
    if n < len(ra.buf):  # equal tails make whole-buffer memcmp valid for a short piece
        ra.buf[n:] = rb.buf[n:]
    storage = bits_dtype(code)
    k = n // storage.itemsize
    if ra.buf == rb.buf:
        return k
    acc = Accumulator(code, max_bin, local.work, scale)
    acc.add(np.frombuffer(ra.buf, storage, count=k), np.frombuffer(rb.buf, storage, count=k))
    acc.work = None  # the scratch arrays stay with the thread
    return acc




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


def _file_scale(info: TensorInfo, code: str, chunk: int, threads: int) -> TensorScale:
    """rms(A) of a tensor on disk, read on first use (its first differing piece) by
    ``threads`` readers of its own (the stream's threads wait for it; the pieces'
    sums are added in order, so the result does not depend on the threads)."""
    storage = bits_dtype(code)
    local = threading.local()

    def piece(off: int) -> float:
        r = getattr(local, "r", None)
        if r is None:
            r = local.r = _Reader(chunk)
            readers.append(r)
        n = min(chunk, info.nbytes - off)
        r.read(info, off, n)
        return sumsq(np.frombuffer(r.buf, storage, count=n // storage.itemsize), code,
                     scale_kernel())

    readers: List[_Reader] = []

    def total() -> float:
        offs = range(0, info.nbytes, chunk)
        try:
            if threads > 1 and len(offs) > 1:
                with ThreadPoolExecutor(threads) as pool:
                    return math.fsum(pool.map(piece, offs))
            return math.fsum(piece(off) for off in offs)
        finally:
            for r in readers:
                r.close()

    return TensorScale(code, info.nbytes // storage.itemsize, total)


def compare_sources(a: Any, b: Any, *, max_bin: int = DEFAULT_MAX_BIN,
                    names: Optional[Sequence[str]] = None,
                    chunk_bytes: int = CHUNK_BYTES, threads: Optional[int] = None,
                    progress: Progress = False
                    ) -> List[TensorDiff]:
    """Compare every tensor of two sources, streaming; one :class:`TensorDiff` each.

    Args:
        a, b: checkpoint/adapter directories, .safetensors files, Checkpoints or
            in-memory mlx-lm models (anything :func:`~lorakit.io.source.open_source`
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
    pending: Deque[Tuple[Accumulator, Any, int]] = deque()
    window = 4 * threads  # pieces in flight: bounds memory, keeps every thread busy
    out: List[TensorDiff] = []
    finish: List[Tuple[Accumulator, TensorDiff]] = []
    streamed = [n for n in order if n in sb.tensors and sb.tensors[n].dtype == sa.tensors[n].dtype
                and tuple(sb.tensors[n].shape) == tuple(sa.tensors[n].shape)]
    bar = progress_bar(progress, sum(sa.tensors[n].nbytes for n in streamed),
                       "lorakit diff")

    def drain(limit: int) -> None:
        while len(pending) > limit:
            acc, fut, nbytes = pending.popleft()
            acc.merge(fut.result() if pool is not None else fut)
            bar.update(nbytes)

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
                ia, ib = sa.file_info(name), sb.file_info(name)
                if ia is None or ib is None:  # in memory already: compare in place
                    storage = bits_dtype(ma.dtype)
                    xa = sa.read(name).view(storage)
                    acc = Accumulator(ma.dtype, max_bin, local.work,
                                      TensorScale.of(xa, ma.dtype, scale_kernel()))
                    finish.append((acc, td))
                    for x, y, _ in pieces_in_memory(xa, sb.read(name).view(storage),
                                                  max(1, chunk // storage.itemsize)):
                        acc.add(x, y)
                        bar.update(x.nbytes)
                    acc.work = None
                    continue
                scale = _file_scale(ia, ma.dtype, chunk, threads)
                acc = Accumulator(ma.dtype, max_bin, None, scale)
                finish.append((acc, td))
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
                                                         max_bin, scale), n))
                    else:
                        pending.append((acc, pool.submit(_file_piece, local, ia, ib, off, n,
                                                         ma.dtype, max_bin, scale), n))
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
        bar.close()
    return out

