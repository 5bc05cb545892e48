"""Safetensors, read lazily and written as a stream.

The format is an 8-byte little-endian header length, a JSON header mapping tensor
names to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to
the end of the header), then the raw little-endian data.

``safetensors`` and ``mx.load`` read whole files or need every tensor in memory to
write one. lorakit needs three things they do not give: a header read that checks
every claim a downloaded file makes before trusting it (sizes, offsets, overlaps),
reads of one tensor (or some of its rows) without touching the rest, and a writer
that takes tensors one at a time, so a checkpoint larger than RAM can be fused.
The files it writes are plain safetensors that ``mx.load``, ``safetensors`` and
``mlx_lm.load`` open.
"""
from __future__ import annotations

import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

if TYPE_CHECKING:
    import numpy as np

from ..errors import FormatError
from ._safetensors_rules import (DTYPE_BITS, MAX_HEADER_BYTES, Bad, byte_size, check_layout,
                                 load_header_json, parse_entry)

PathLike = Union[str, Path]

#: bytes per element of every dtype whose elements fill whole bytes. The sub-byte
#: codes (F4, F6_*) are only in DTYPE_BITS: use :func:`nbytes_of` for sizes.
ITEMSIZE: Dict[str, int] = {k: b // 8 for k, b in DTYPE_BITS.items() if b % 8 == 0}

#: numpy dtype used to hold each code's raw data. bf16 has no numpy type: its
#: bits are held as uint16 (see :mod:`lorakit.numerics`); fp8 as uint8. The packed
#: sub-byte codes have none: lorakit copies them through but cannot compute on them.
_STORAGE_SPEC: Dict[str, str] = {
    "BOOL": "?", "U8": "<u1", "I8": "<i1",
    "F8_E4M3": "<u1", "F8_E5M2": "<u1", "F8_E8M0": "<u1",
    "F8_E4M3FNUZ": "<u1", "F8_E5M2FNUZ": "<u1",
    "I16": "<i2", "U16": "<u2", "F16": "<f2",
    "BF16": "<u2", "I32": "<i4", "U32": "<u4",
    "F32": "<f4", "I64": "<i8", "U64": "<u8",
    "F64": "<f8", "C64": "<c8",
}


class _NumpyStorage(Mapping):
    """code -> numpy dtype, numpy imported on the first lookup of a value: reading
    headers (``lorakit inspect`` of a checkpoint) never loads numpy."""

    def __init__(self) -> None:
        self._dtypes: Dict[str, "np.dtype"] = {}

    def __getitem__(self, code: str) -> "np.dtype":
        dt = self._dtypes.get(code)
        if dt is None:
            import numpy as np  # lazy: header-only paths start without numpy

            dt = self._dtypes[code] = np.dtype(_STORAGE_SPEC[code])
        return dt

    def __contains__(self, code: object) -> bool:
        return code in _STORAGE_SPEC

    def __iter__(self) -> Iterator[str]:
        return iter(_STORAGE_SPEC)

    def __len__(self) -> int:
        return len(_STORAGE_SPEC)


NUMPY_STORAGE: Mapping[str, "np.dtype"] = _NumpyStorage()

#: dtypes packed below one byte per element: copied through untouched, never read.
PACKED_CODES = tuple(k for k, b in DTYPE_BITS.items() if b % 8)


def nbytes_of(dtype: str, shape: Sequence[int]) -> int:
    """Bytes the data of a ``dtype`` tensor of ``shape`` fills (packed codes included).

    >>> nbytes_of("BF16", (2, 3)), nbytes_of("F4", (4,)), nbytes_of("F6_E2M3", (4,))
    (12, 2, 3)
    """
    n = DTYPE_BITS[dtype]
    for d in shape:
        n *= int(d)
    return n // 8


FLOAT_CODES = ("BF16", "F16", "F32", "F64")



@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: file, dtype code, shape and absolute byte range."""

    name: str
    dtype: str
    shape: Tuple[int, ...]
    file: Path
    begin: int  # absolute offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def packed(self) -> bool:
        """Whether elements are packed below a byte (F4, F6_*): copy only, never computed on."""
        return self.dtype in PACKED_CODES

    def __repr__(self) -> str:  # cheap: never reads data
        return f"TensorInfo({self.name!r}, {self.dtype}, {list(self.shape)}, {self.file.name})"


@dataclass
class SafetensorsHeader:
    """A parsed, validated header. ``tensors`` is ordered by data offset."""

    path: Path
    data_start: int
    metadata: Dict[str, str]
    tensors: Dict[str, TensorInfo] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def _bad(path: Path, message: str, tensor: Optional[str] = None, expected: Optional[str] = None,
         found: Optional[str] = None) -> FormatError:
    return FormatError(f"not a valid safetensors file: {message}", file=path, tensor=tensor,
                       expected=expected, found=found)


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a regular file"


def read_header(path: PathLike) -> SafetensorsHeader:
    """Read and check a safetensors header without reading any tensor data.

    Accepts exactly the files the ``safetensors`` package accepts (rules in
    :mod:`lorakit.io._safetensors_rules`), except a tensor name given twice: the
    header length against the file size, the JSON, each dtype and shape, and the
    byte ranges, which must tile the data region exactly (no overlaps, no unclaimed
    bytes between tensors or after the last). A failed check raises
    :class:`~lorakit.errors.FormatError` naming the file and tensor.

    >>> read_header("data/tiny-qwen3/model.safetensors").tensors["model.norm.weight"].shape
    (256,)
    """
    path = Path(path)
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            # a FIFO or device would block or stream forever; a directory cannot be read
            raise _bad(path, "not a regular file", expected="a regular file",
                       found=_file_kind(st.st_mode))
        size = st.st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _bad(path, "file shorter than the 8-byte header length",
                           expected=">= 8 bytes", found=f"{len(head)} bytes")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise _bad(path, "header length is larger than the file",
                           expected=f"<= {size - 8} bytes", found=f"{n} bytes")
            if n > MAX_HEADER_BYTES:
                raise _bad(path, "header is implausibly large",
                           expected=f"<= {MAX_HEADER_BYTES} bytes", found=f"{n} bytes")
            raw = f.read(n)
    except OSError as e:
        raise FormatError(f"cannot read safetensors file: {e.strerror or e}", file=path,
                          expected="a readable file", found=type(e).__name__) from None
    if len(raw) != n:  # the file shrank while we read it
        raise _bad(path, "file ended inside the header", expected=f"{n} bytes",
                   found=f"{len(raw)} bytes")
    try:
        obj = load_header_json(raw)
    except (ValueError, RecursionError) as e:  # JSON, UTF-8, number and depth errors
        raise _bad(path, "header is not JSON", expected="a UTF-8 JSON object",
                   found=f"{type(e).__name__}: {str(e)[:80]}") from None
    if not isinstance(obj, dict):
        raise _bad(path, "header is not a JSON object", expected="a JSON object",
                   found=type(obj).__name__)
    data_start = 8 + n
    data_len = size - data_start
    try:
        meta, infos = _check_header(path, obj, data_start, data_len)
    except Bad as e:
        raise _bad(path, e.message, tensor=e.tensor, expected=e.expected,
                   found=e.found) from None
    return SafetensorsHeader(path, data_start, meta, {t.name: t for t in infos})


def _check_header(path: Path, obj: dict, data_start: int,
                  data_len: int) -> Tuple[Dict[str, str], List[TensorInfo]]:
    """Metadata and tensors of a parsed header, in data order; raises ``Bad``."""
    for key in getattr(obj, "repeated", ()):
        # two entries for one name: readers that keep the first and readers that keep
        # the last would load different weights from the same file
        raise Bad("a name appears twice in the header", key, "unique tensor names",
                  "duplicate")
    meta = obj.get("__metadata__")
    values = list(meta.values()) + list(meta.shadowed) if isinstance(meta, dict) else []
    if meta is not None and not (isinstance(meta, dict)
                                 and all(isinstance(v, str) for v in values)):
        raise Bad("__metadata__ must map strings to strings", "__metadata__",
                  "an object of string values", repr(meta)[:80])
    infos: List[TensorInfo] = []
    for name, entry in obj.items():
        if name == "__metadata__":
            continue
        dtype, shape, begin, end = parse_entry(name, entry)
        want = byte_size(dtype, shape, name)
        if end - begin != want:
            raise Bad("byte length disagrees with shape and dtype", name,
                      f"{want} bytes for {dtype}{list(shape)}", f"{end - begin} bytes")
        if end > data_len:
            raise Bad("tensor data runs past the end of the file (truncated?)", name,
                      f"end <= {data_len}", f"end = {end}")
        infos.append(TensorInfo(name, dtype, shape, path, data_start + begin,
                                data_start + end))
    check_layout([(t.begin - data_start, t.end - data_start, t.name) for t in infos], data_len)
    infos.sort(key=lambda t: (t.begin, t.end))
    return {str(k): v for k, v in (meta or {}).items()}, infos


def read_raw(info: TensorInfo, rows: Optional[slice] = None) -> np.ndarray:
    """Read one tensor (or a slice of its leading axis) into a numpy array.

    Floats come back as their storage: float16/float32/float64 arrays, bf16 as
    uint16 bits, fp8 as uint8. Only the bytes asked for are read. Packed sub-byte
    dtypes (F4, F6_*) are refused by name: lorakit copies them but cannot compute on them.
    """
    if info.dtype not in NUMPY_STORAGE:
        raise FormatError(f"lorakit cannot compute on {info.dtype} tensors (packed "
                          f"{DTYPE_BITS[info.dtype]}-bit elements)", file=info.file,
                          tensor=info.name, expected="one of " + ", ".join(NUMPY_STORAGE),
                          found=info.dtype,
                          hint="such tensors are copied through untouched; an adapter "
                          "cannot be fused into one")
    import numpy as np  # lazy: header-only paths start without numpy

    if len(info.shape) > _numpy_maxdims():
        raise FormatError("tensor has more dimensions than numpy supports", file=info.file,
                          tensor=info.name, expected=f"<= {_numpy_maxdims()} dimensions",
                          found=f"{len(info.shape)} dimensions")
    dt = NUMPY_STORAGE[info.dtype]
    shape = info.shape
    begin, count = info.begin, info.numel
    if rows is not None:
        if not shape:
            raise ValueError("cannot slice rows of a scalar tensor")
        start, stop, step = rows.indices(shape[0])
        if step != 1:
            raise ValueError("row slices must be contiguous")
        row = info.numel // shape[0] if shape[0] else 0
        begin += start * row * dt.itemsize
        count = max(stop - start, 0) * row
        shape = (max(stop - start, 0),) + tuple(shape[1:])
    want = count * dt.itemsize  # Python ints: no overflow; the header check bounded it
    if begin + want > info.end:
        raise FormatError("read past the tensor's data", file=info.file, tensor=info.name,
                          expected=f"<= {info.nbytes} bytes", found=f"{want} bytes")
    # straight into the array (no bytes object to allocate, fault in and wrap)
    buf = np.empty(count, dt)
    view = memoryview(buf).cast("B")
    got = 0
    with open(info.file, "rb", buffering=0) as f:
        f.seek(begin)
        while got < want:
            n = f.readinto(view[got:])
            if not n:
                break
            got += n
    if got != want:
        raise FormatError("file ended before the tensor's data", file=info.file,
                          tensor=info.name, expected=f"{want} bytes",
                          found=f"{got} bytes")
    buf.flags.writeable = False  # as before: a tensor read is the file's, not to edit
    try:
        return buf.reshape(shape)
    except ValueError:  # a dimension past numpy's index type (2**63), with zero elements
        raise FormatError("numpy cannot hold this tensor's shape", file=info.file,
                          tensor=info.name, expected="dimensions below 2**63",
                          found=f"{list(info.shape)}"[:80]) from None


def _numpy_maxdims() -> int:
    """numpy 2 arrays have at most 64 dimensions (numpy 1: 32)."""
    import numpy as np  # lazy: header-only paths start without numpy

    return 64 if int(np.__version__.split(".")[0]) >= 2 else 32


def raw_to_mx(raw: np.ndarray, dtype: str):
    """Turn raw storage from :func:`read_raw` into an ``mx.array`` of the right dtype."""
    import mlx.core as mx  # lazy: MLX only when computing
    import numpy as np  # lazy: header-only paths start without numpy

    if dtype == "BF16":
        return mx.array(raw.view(np.uint16)).view(mx.bfloat16)
    return mx.array(raw)


def mx_to_raw(arr) -> Tuple[np.ndarray, str]:
    """Turn an ``mx.array`` into (numpy storage, safetensors dtype code)."""
    import mlx.core as mx  # lazy: MLX only when computing
    import numpy as np  # lazy: header-only paths start without numpy

    code = MX_CODES[arr.dtype]
    if arr.dtype == mx.bfloat16:
        return np.array(arr.view(mx.uint16), copy=False), code
    return np.array(arr, copy=False), code


def _mx_codes() -> Dict[object, str]:
    try:
        import mlx.core as mx  # lazy: MLX only when computing
    except ImportError:  # pragma: no cover - mlx is a hard dependency
        return {}
    return {mx.bfloat16: "BF16", mx.float16: "F16", mx.float32: "F32", mx.float64: "F64",
            mx.uint32: "U32", mx.int32: "I32", mx.uint8: "U8", mx.int8: "I8",
            mx.uint16: "U16", mx.int16: "I16", mx.int64: "I64", mx.uint64: "U64",
            mx.bool_: "BOOL", mx.complex64: "C64"}


class _LazyCodes(dict):
    def __missing__(self, key):
        if not self:
            self.update(_mx_codes())
            if key in self:
                return self[key]
        raise KeyError(f"dtype {key} has no safetensors code")


MX_CODES: Mapping[object, str] = _LazyCodes()
