"""Safetensors written as a stream, tensor by tensor in a declared order.

The header is written first from a plan (:class:`TensorSpec`), so no tensor waits in
memory for the others; untouched tensors are copied inside the kernel where it can, or,
given the base shard (``clone_of``), shared with it by a clone
(:mod:`lorakit.io.outputs.clone`). The files are plain safetensors.
"""
from __future__ import annotations

import functools
import json
import os
import struct
import sys
from pathlib import Path
from typing import Callable, Dict, Iterable, Mapping, Optional, Sequence

import numpy as np

from ...errors import FormatError, PathLike
from ..formats.safetensors import SafetensorsHeader, TensorInfo, TensorSpec
from .clone import CLONED, WRITTEN, clone_shard

__all__ = ["SafetensorsWriter"]


class SafetensorsWriter:
    """Write a safetensors file tensor by tensor, each checked against its plan.

    >>> with SafetensorsWriter("w.safetensors", [TensorSpec("w", "BF16", (2, 2))]) as w:
    ...     w.write("w", np.zeros((2, 2), np.uint16))
    >>> from lorakit.io.formats.safetensors import read_header
    >>> read_header("w.safetensors").tensors["w"].dtype
    'BF16'
    """

    def __init__(self, path: PathLike, plan: Sequence[TensorSpec],
                 metadata: Optional[Mapping[str, str]] = None,
                 clone_of: Optional[SafetensorsHeader] = None) -> None:
        self.path = Path(path)
        self.plan = list(plan)
        header: Dict[str, object] = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        off = 0
        for p in self.plan:
            header[p.name] = {"dtype": p.dtype, "shape": list(p.shape),
                              "data_offsets": [off, off + p.nbytes]}
            off += p.nbytes
        self.total = off
        blob = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode()
        blob += b" " * (-len(blob) % 8)  # data aligned to 8 bytes, as the reference writer does
        #: how the shard was written: clone.CLONED, or clone.WRITTEN and why not cloned
        self.how, self.shared = WRITTEN, 0
        f, start = None, 0
        if clone_of is not None:  # a clone of the base shard, patched in place
            f, start, why = clone_shard(clone_of, self.path, self.plan, blob)
            self.how = CLONED if f is not None else f"{WRITTEN}: {why}"
        if f is None:  # unbuffered: no copy through a Python buffer
            f = open(self.path, "wb", buffering=0)
            _write_all(f, struct.pack("<Q", len(blob)) + blob)
            start = 8 + len(blob)
        self._f, self.cloned = f, self.how == CLONED
        self._next = 0
        self.bytes_written = 0
        self._pos = self._synced = start

    def _expect(self, name: str) -> TensorSpec:
        if self._next >= len(self.plan) or self.plan[self._next].name != name:
            want = self.plan[self._next].name if self._next < len(self.plan) else "nothing"
            raise RuntimeError(f"writer expected {want}, got {name}")
        p = self.plan[self._next]
        self._next += 1
        return p

    def write(self, name: str, data: np.ndarray) -> None:
        """Write the next tensor from a numpy array holding its raw storage."""
        p = self._expect(name)
        data = np.ascontiguousarray(data)
        if data.nbytes != p.nbytes or tuple(data.shape) != p.shape:
            raise RuntimeError(f"{name}: planned {p.dtype}{list(p.shape)} ({p.nbytes} bytes), "
                               f"got {data.dtype}{list(data.shape)} ({data.nbytes} bytes)")
        self._put(p, [data])

    def write_chunks(self, name: str, chunks: Iterable[np.ndarray]) -> None:
        """Write the next tensor from consecutive pieces of its raw storage."""
        self._put(self._expect(name), chunks)

    def _put(self, p: TensorSpec, chunks: Iterable[np.ndarray]) -> None:
        n = 0
        if self.cloned:
            self._f.seek(self._pos)
        for c in chunks:
            c = np.ascontiguousarray(c)
            _write_all(self._f, memoryview(c.reshape(-1)).cast("B"))
            n += c.nbytes
        if n != p.nbytes:
            raise RuntimeError(f"{p.name}: planned {p.nbytes} bytes, got {n}")
        self._advance(n)

    def copy(self, name: str, src: TensorInfo) -> None:
        """Write the next tensor by copying its bytes from another file, unchanged."""
        p = self._expect(name)
        if src.nbytes != p.nbytes:
            raise RuntimeError(f"{name}: planned {p.nbytes} bytes, source has {src.nbytes}")
        if self.cloned:  # the clone holds these bytes already, shared with the base
            self.shared += p.nbytes
            self._pos = self._synced = self._pos + p.nbytes
            return
        copy_range(src.file, src.begin, src.nbytes, self._f)
        self._advance(p.nbytes)

    def _advance(self, n: int) -> None:
        """Count ``n`` bytes written; every :data:`WRITEBACK_BYTES` start the disk
        write of what is new, so the final ``fsync`` waits for a tail, not the file."""
        self.bytes_written += n
        self._pos += n
        if WRITEBACK_BYTES and self._pos - self._synced >= WRITEBACK_BYTES:
            start_writeback(self._f.fileno(), self._synced, self._pos - self._synced)
            self._synced = self._pos

    def close(self) -> None:
        if self._f.closed:
            return
        missing = [p.name for p in self.plan[self._next:]]
        os.fsync(self._f.fileno())
        self._f.close()
        if missing:
            raise RuntimeError(f"{self.path}: {len(missing)} planned tensors never written, "
                               f"first {missing[0]}")

    def abort(self) -> None:
        if not self._f.closed:
            self._f.close()

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


_COPY_CHUNK = 16 * 1024 * 1024

#: bytes written between two starts of writeback (0: leave it all to the final fsync)
WRITEBACK_BYTES = 64 << 20


#: bytes per write() call: larger calls are far slower per byte (BENCHMARKS.md, "fuse steps")
WRITE_CHUNK = 1 << 20


def _write_all(f, buf) -> None:
    """Write all of ``buf`` to the unbuffered file ``f`` in calls of at most
    :data:`WRITE_CHUNK` bytes (a raw write may be partial)."""
    mv = memoryview(buf).cast("B")
    while mv.nbytes:
        n = f.write(mv[:WRITE_CHUNK])
        mv = mv[n:]


@functools.lru_cache(maxsize=None)
def _sync_file_range() -> Optional[Callable[..., int]]:
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes  # lazy: sync_file_range is Linux's and not in the os module

        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


def start_writeback(fd: int, offset: int, count: int) -> None:
    """Start the disk write of a range of ``fd`` without waiting (Linux's
    ``sync_file_range``; elsewhere nothing): the disk works while the fuse computes."""
    fn = _sync_file_range()
    if fn is not None:
        fn(fd, offset, count, 2)  # SYNC_FILE_RANGE_WRITE; a failure is harmless here


def copy_range(src: Path, offset: int, count: int, dst) -> None:
    """Append ``count`` bytes of ``src`` from ``offset`` to the open file ``dst``, by the
    kernel's ``copy_file_range`` where there is one."""
    dst.flush()
    with open(src, "rb") as f:
        fd_in, fd_out = f.fileno(), dst.fileno()
        done = 0
        if hasattr(os, "copy_file_range"):
            try:
                while done < count:
                    n = os.copy_file_range(fd_in, fd_out, min(count - done, 1 << 30),
                                           offset + done)
                    if n == 0:
                        break
                    done += n
            except OSError:
                pass  # cross-device or unsupported: fall back to read/write below
            if done:
                dst.seek(0, os.SEEK_END)
        f.seek(offset + done)
        while done < count:
            buf = f.read(min(_COPY_CHUNK, count - done))
            if not buf:
                raise FormatError("file ended while copying a tensor", file=src,
                                  expected=f"{count} bytes from offset {offset}",
                                  found=f"{done} bytes")
            _write_all(dst, buf)
            done += len(buf)
