"""Safetensors, read lazily and written as a stream.

The format is an 8-byte little-endian header length, a JSON header mapping tensor
names to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to
the end of the header), then the raw little-endian data.

The verdict on a header is the reference's: ``safetensors.safe_open`` (the Rust crate,
0.8) checks the JSON, each dtype and shape, and that the byte ranges tile the data
region exactly. A file it refuses, lorakit refuses, and the other way round, with one
deliberate exception: a tensor name given twice in one header (the reference keeps the
last entry; other readers keep the first, so the same file would load different
weights) is refused. A refused file is then explained in lorakit's words where a plain
reading can say what is wrong (the length, the JSON, which tensor and which rule); else
the reference's own words are quoted.

What the reference does not give, and lorakit needs, is here: reads of one tensor (or
some of its rows) as raw storage without touching the rest (bf16 as uint16 bits, which
its numpy API cannot hand out), and a writer that takes tensors one at a time
(``safetensors_write.py``), so a checkpoint larger than RAM can be fused. The files it
writes are plain safetensors that ``mx.load``, ``safetensors`` and ``mlx_lm.load`` open.
"""
from __future__ import annotations

import json
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import (
    TYPE_CHECKING,
    Any,
    Dict,
    Iterator,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
)

from safetensors import SafetensorError, safe_open

from ...errors import ArgumentError, FormatError, PathLike

__all__ = ["ITEMSIZE", "NUMPY_STORAGE", "FLOAT_CODES", "TensorSpec", "TensorInfo", "read_header", "raw_to_mx", "mx_to_raw"]

#: bits per element of every dtype the reference (safetensors 0.8) knows.
DTYPE_BITS: Dict[str, int] = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8,
    "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
    "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}

#: the reference refuses a longer header (``MAX_HEADER_SIZE``) before reading it.
MAX_HEADER_BYTES = 100_000_000

_U64 = 1 << 64  # usize on the 64-bit hosts the reference runs on
FIELDS = ("dtype", "shape", "data_offsets")


class Bad(Exception):
    """One broken rule, as lorakit explains a refused header: message, tensor (if any),
    expected, found."""

    def __init__(self, message: str, tensor: Optional[str] = None,
                 expected: Optional[str] = None, found: Optional[str] = None) -> None:
        super().__init__(message)
        self.message, self.tensor, self.expected, self.found = message, tensor, expected, found


class _Object(dict):
    """A JSON object as a dict (the last value of a repeated key wins, as in serde)
    that names the keys given twice."""

    twice: Tuple[str, ...] = ()


def _pairs(pairs: List[Tuple[str, Any]]) -> _Object:
    out = _Object(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        out.twice = tuple(k for k, _ in pairs if k in seen or seen.add(k))
    return out


def _size(x: Any) -> bool:
    return type(x) is int and 0 <= x < _U64


def _dtype(x: Any) -> Optional[str]:
    if isinstance(x, str):
        return x if x in DTYPE_BITS else None
    if isinstance(x, dict) and len(x) == 1 and not getattr(x, "twice", ()):
        # serde reads a unit enum variant from a one-key map with a null value too
        (k, v), = x.items()
        return k if k in DTYPE_BITS and v is None else None
    return None


def parse_entry(name: str, entry: Any) -> Tuple[str, Tuple[int, ...], int, int]:
    """(dtype, shape, begin, end) of one tensor entry, or :class:`Bad`."""
    if isinstance(entry, list):
        if len(entry) != 3:
            raise Bad("tensor entry is not an object", name,
                      '{"dtype", "shape", "data_offsets"} (or that array of 3)',
                      repr(entry)[:80])
        dtype, shape, offs = entry
    elif isinstance(entry, dict):
        twice = [k for k in getattr(entry, "twice", ()) if k in FIELDS]
        if twice:
            raise Bad("a tensor field appears twice", name, "each field once",
                      f"{twice[0]!r} twice")
        missing = [k for k in FIELDS if k not in entry]
        if missing:
            raise Bad("tensor entry lacks a field", name, '{"dtype", "shape", "data_offsets"}',
                      "no " + ", ".join(missing))
        dtype, shape, offs = (entry[k] for k in FIELDS)
    else:
        raise Bad("tensor entry is not an object", name, '{"dtype", "shape", "data_offsets"}',
                  repr(entry)[:80])
    code = _dtype(dtype)
    if code is None:
        raise Bad("unknown dtype", name, "one of " + ", ".join(DTYPE_BITS), repr(dtype)[:40])
    if not isinstance(shape, list) or not all(_size(d) for d in shape):
        raise Bad("shape must be a list of non-negative integers", name,
                  "a list of integers in [0, 2**64)", repr(shape)[:80])
    if (not isinstance(offs, list) or len(offs) != 2 or not all(_size(o) for o in offs)
            or offs[0] > offs[1]):
        raise Bad("data_offsets must be [begin, end] with 0 <= begin <= end", name,
                  "[begin, end], integers, 0 <= begin <= end", repr(offs)[:80])
    return code, tuple(shape), offs[0], offs[1]


def byte_size(dtype: str, shape: Tuple[int, ...], name: Optional[str] = None) -> int:
    """Bytes the data of a ``dtype`` tensor of ``shape`` fills, or :class:`Bad`
    (refused past 64 bits at every step, as the reference does)."""
    n = 1
    for d in shape:
        n *= d
        if n >= _U64:
            raise Bad("shape's element count overflows 64 bits", name,
                      "fewer than 2**64 elements at every step", f"{list(shape)}"[:80])
    bits = n * DTYPE_BITS[dtype]
    if bits >= _U64:
        raise Bad("tensor's size in bits overflows 64 bits", name, "fewer than 2**64 bits",
                  f"{dtype}{list(shape)}"[:80])
    if bits % 8:
        raise Bad("sub-byte tensor does not fill whole bytes", name,
                  f"an element count times {DTYPE_BITS[dtype]} bits divisible by 8",
                  f"{dtype}{list(shape)} = {bits} bits")
    return bits // 8


def check_layout(spans: List[Tuple[int, int, str]], data_len: int) -> None:
    """Data ranges (begin, end, name), relative to the data start, must tile the
    data region exactly: sorted, each beginning where the previous ended, the last
    ending at the end of the file. Raises :class:`Bad`."""
    start = 0
    prev = None
    for begin, end, name in sorted(spans, key=lambda s: (s[0], s[1])):
        if begin < start:
            raise Bad("tensors overlap", name, f"begin >= {start} (end of {prev})",
                      f"begin = {begin}")
        if begin > start:
            raise Bad("bytes between tensors belong to no tensor", name,
                      f"begin = {start} (where {prev or 'the data'} ends)",
                      f"begin = {begin}, {begin - start} unclaimed bytes before it")
        start, prev = end, name
    if start != data_len:
        raise Bad("bytes after the last tensor belong to no tensor", prev,
                  f"the data to end at byte {start} of the data region",
                  f"{data_len - start} more bytes")


if TYPE_CHECKING:
    import numpy as np

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
class TensorSpec:
    """One tensor's name, safetensors dtype code and shape: what a header says of it,
    what a writer is told to expect, what an in-memory source reports."""

    name: str
    dtype: str
    shape: Tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.dtype, self.shape)


@dataclass(frozen=True)
class TensorInfo(TensorSpec):
    """Where one tensor of a file lives: its spec and absolute byte range."""

    file: Path = Path()
    begin: int = 0  # absolute offset in the file
    end: int = 0

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

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
    """Read a safetensors header, checked by the reference, without reading tensor data.

    A header the reference (``safetensors.safe_open``) refuses, or one naming a tensor
    twice, raises :class:`~lorakit.errors.FormatError` naming the file, the tensor and
    the broken rule (see :mod:`lorakit.io.formats.safetensors`).

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
        try:
            with safe_open(str(path), framework="numpy"):
                pass
        except SafetensorError as e:
            raise _explain(path, st.st_size, str(e)) from None
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            obj = json.loads(f.read(n).decode("utf-8"), object_pairs_hook=_pairs)
    except OSError as e:
        raise FormatError(f"cannot read safetensors file: {e.strerror or e}", file=path,
                          expected="a readable file", found=type(e).__name__) from None
    data_start = 8 + n
    try:
        meta, infos = _check_header(path, obj, data_start, st.st_size - data_start)
    except Bad as e:  # a name twice: the reference keeps the last, lorakit refuses
        raise _bad(path, e.message, tensor=e.tensor, expected=e.expected,
                   found=e.found) from None
    return SafetensorsHeader(path, data_start, meta, {t.name: t for t in infos})


def _explain(path: Path, size: int, reference: str) -> FormatError:
    """A header the reference refused, explained in lorakit's words where a plain
    reading of it can say what is wrong; else in the reference's."""
    said = reference.split("header: ", 1)[-1]
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return _bad(path, "file shorter than the 8-byte header length",
                        expected=">= 8 bytes", found=f"{len(head)} bytes")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            return _bad(path, "header length is larger than the file",
                        expected=f"<= {size - 8} bytes", found=f"{n} bytes")
        if n > MAX_HEADER_BYTES:
            return _bad(path, "header is implausibly large",
                        expected=f"<= {MAX_HEADER_BYTES} bytes", found=f"{n} bytes")
        raw = f.read(n)
    try:
        obj = json.loads(raw.decode("utf-8"), object_pairs_hook=_pairs)
    except (ValueError, RecursionError) as e:  # JSON, UTF-8 and int-size errors
        return _bad(path, "header is not JSON", expected="a UTF-8 JSON object",
                    found=f"{type(e).__name__}: {str(e)[:80]}")
    if not isinstance(obj, dict):
        return _bad(path, "header is not a JSON object", expected="a JSON object",
                    found=type(obj).__name__)
    try:
        _check_header(path, obj, 8 + n, size - 8 - n)
    except Bad as e:
        return _bad(path, e.message, tensor=e.tensor, expected=e.expected, found=e.found)
    return _bad(path, "the reference parser refuses the header",
                expected="a header safetensors reads", found=said[:200])


def _check_header(path: Path, obj: dict, data_start: int,
                  data_len: int) -> Tuple[Dict[str, str], List[TensorInfo]]:
    """Metadata and tensors of a parsed header, in data order; raises ``Bad``."""
    for key in getattr(obj, "twice", ()):
        # two entries for one name: readers that keep the first and readers that keep
        # the last would load different weights from the same file
        raise Bad("a name appears twice in the header", key, "unique tensor names",
                  "duplicate")
    meta = obj.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict)
                                 and all(isinstance(v, str) for v in meta.values())):
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
            raise ArgumentError.bad("rows", rows, "None: a scalar tensor has no rows")
        start, stop, step = rows.indices(shape[0])
        if step != 1:
            raise ArgumentError.bad("rows", rows, "a contiguous slice (step 1)")
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
