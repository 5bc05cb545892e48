"""Clone and patch: a fused shard that shares the base shard's unchanged blocks.

A fuse that keeps every tensor's name, dtype and shape writes the base shard with some
byte ranges rewritten. On a copy-on-write file system (APFS; XFS with reflink, btrfs)
:func:`clone_shard` makes the output a clone of the base shard laid out as the base (the
header padded to the base's length, or on Linux plus whole blocks), and the writer writes
only the adapted tensors in place: the base never changes. Where it cannot clone, it says
why and the whole shard is written. ``LORAKIT_CLONE=0`` turns cloning off.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import struct
import sys
from pathlib import Path
from typing import BinaryIO, Optional, Sequence, Tuple

from ..formats.safetensors import SafetensorsHeader, TensorSpec

#: Linux ioctls (``linux/fs.h``): clone a whole file, clone a block-aligned range
FICLONE, FICLONERANGE = 0x40049409, 0x4020940D
#: the clone granularity assumed (XFS, btrfs and APFS use 4 KiB blocks)
BLOCK = 4096
WRITTEN = "written whole"
CLONED = "clone and patch"


def _layout(base: SafetensorsHeader, plan: Sequence[TensorSpec], blob: bytes) -> Tuple[bytes, str]:
    """The output's header (its 8-byte length first) laying the output out as ``base``,
    or ``b""`` and why it cannot be."""
    if os.environ.get("LORAKIT_CLONE") == "0":
        return b"", "cloning turned off (LORAKIT_CLONE=0)"
    infos = list(base.tensors.values())
    if [(p.name, p.dtype, tuple(p.shape)) for p in plan] != \
            [(t.name, t.dtype, tuple(t.shape)) for t in infos]:
        return b"", "tensors change dtype, shape or order"
    end = base.data_start
    for t in infos:
        if t.begin != end:
            return b"", "the base shard leaves gaps between tensors"
        end = t.end
    if end != base.path.stat().st_size:
        return b"", "the base shard has bytes after its last tensor"
    room = base.data_start - 8
    if len(blob) > room and not sys.platform.startswith("linux"):
        return b"", f"lorakit's metadata does not fit the base's header ({room} bytes)"
    if len(blob) > room and end <= -(-base.data_start // BLOCK) * BLOCK:
        return b"", "the shard's data lies within one block: nothing to share"
    size = room + -(-max(len(blob) - room, 0) // BLOCK) * BLOCK
    return struct.pack("<Q", size) + blob.rstrip(b" ").ljust(size), ""


def _pwrite_all(fd: int, data: bytes, at: int) -> None:
    while data:
        n = os.pwrite(fd, data, at)
        data, at = data[n:], at + n


def _why(e: OSError) -> str:
    name = errno.errorcode.get(e.errno or 0, str(e.errno))
    if e.errno == errno.EXDEV:
        return f"the base is on another file system ({name})"
    if e.errno in (errno.EOPNOTSUPP, errno.ENOTTY, errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return f"this file system cannot clone ({name})"
    return f"the clone failed ({name}: {e.strerror})"


def _clone(src: Path, dst: Path, start: int, base_start: int) -> BinaryIO:
    """``dst``, created as a clone of ``src`` whose data begins at ``start`` (the base's
    at ``base_start``), open for writing in place."""
    if sys.platform == "darwin":  # clonefile(2): whole files only, the output not there yet
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.clonefile(os.fsencode(str(src)), os.fsencode(str(dst)), 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        mask = os.umask(0)  # the clone has the base's mode, which may be read-only:
        os.umask(mask)  # give it the mode every other output gets under this umask
        os.chmod(dst, 0o666 & ~mask)
        return open(dst, "r+b", buffering=0)
    f = open(dst, "w+b", buffering=0)
    try:
        with open(src, "rb") as s:
            if start == base_start:
                fcntl.ioctl(f.fileno(), FICLONE, s.fileno())
            else:  # the data from the base's first whole block; the piece before it below
                first = -(-base_start // BLOCK) * BLOCK
                fcntl.ioctl(f.fileno(), FICLONERANGE,
                            struct.pack("<qQQQ", s.fileno(), first, 0, first + start - base_start))
                _pwrite_all(f.fileno(), os.pread(s.fileno(), first - base_start, base_start),
                            start)
    except BaseException:
        f.close()
        raise
    return f


def clone_shard(base: SafetensorsHeader, path: Path, plan: Sequence[TensorSpec],
                blob: bytes) -> Tuple[Optional[BinaryIO], int, str]:
    """Create ``path`` as a clone of the ``base`` shard with the header ``blob`` (the
    writer's JSON) written in: (the open file, where its data begins, "") or, where it
    cannot be cloned, (None, 0, why)."""
    head, why = _layout(base, plan, blob)
    if not head:
        return None, 0, why
    try:
        f = _clone(base.path, path, len(head), base.data_start)
    except OSError as e:
        try:
            os.unlink(path)
        except OSError:
            pass
        return None, 0, _why(e)
    try:
        _pwrite_all(f.fileno(), head, 0)
    except BaseException:
        f.close()
        raise
    return f, len(head), ""
