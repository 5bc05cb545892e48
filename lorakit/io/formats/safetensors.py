"""Safetensors headers, checked by the reference parser, and raw reads of one tensor.

The format: an 8-byte little-endian header length, a JSON header mapping tensor names to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (relative to the end of the header),
then the raw little-endian data. ``safetensors.safe_open`` gives the verdict: a file it
refuses, lorakit refuses, with one deliberate exception, a tensor name given twice (readers
disagree on which entry wins, so it is refused). A refused file is explained in lorakit's
words (which tensor, which rule) where a plain reading can say what is wrong, else in the
reference's. Reads hand out raw storage (bf16 as uint16 bits, which the reference's numpy
API cannot), only the bytes asked for.
"""
from __future__ import annotations

import json
import math
import re
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from safetensors import SafetensorError, safe_open

from ...errors import ArgumentError, FormatError, PathLike

if TYPE_CHECKING:
    import numpy as np

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

#: bytes per element of every dtype whose elements fill whole bytes (see :func:`nbytes_of`).
ITEMSIZE: Dict[str, int] = {k: b // 8 for k, b in DTYPE_BITS.items() if b % 8 == 0}

#: numpy dtype holding each code's raw data: bf16 bits as uint16, fp8 as uint8; the packed
#: sub-byte codes (F4, F6_*) have none: lorakit copies them through but cannot compute on them.
_STORAGE_SPEC: Dict[str, str] = {
    k: "?" if k == "BOOL" else f"<{'u' if k[:2] in ('BF', 'F8') else k[0].lower()}{n}"
    for k, n in ITEMSIZE.items()
}

#: dtypes packed below one byte per element: copied through untouched, never read.
PACKED_CODES = tuple(k for k, b in DTYPE_BITS.items() if b % 8)

FLOAT_CODES = ("BF16", "F16", "F32", "F64")


class Bad(Exception):
    """One broken rule of a header: args are (message, tensor, expected, found)."""


class _Object(dict):
    """A JSON object (the last value of a repeated key wins, as in serde) that names the
    keys given twice."""

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
    if isinstance(x, dict) and len(x) == 1 and not getattr(x, "twice", ()):
        # serde reads a unit enum variant from a one-key map with a null value too
        ((x, v),) = x.items()
        return x if x in DTYPE_BITS and v is None else None
    return x if isinstance(x, str) and x in DTYPE_BITS else None


def parse_entry(name: str, entry: Any) -> Tuple[str, Tuple[int, ...], int, int]:
    """(dtype, shape, begin, end) of one tensor entry, or :class:`Bad`."""
    want = '{"dtype", "shape", "data_offsets"}'
    if isinstance(entry, list) and len(entry) == 3:
        dtype, shape, offs = entry
    elif isinstance(entry, dict):
        twice = [k for k in getattr(entry, "twice", ()) if k in FIELDS]
        if twice:
            raise Bad("a tensor field appears twice", name, "each field once", f"{twice[0]!r} twice")
        missing = [k for k in FIELDS if k not in entry]
        if missing:
            raise Bad("tensor entry lacks a field", name, want, "no " + ", ".join(missing))
        dtype, shape, offs = (entry[k] for k in FIELDS)
    else:
        if isinstance(entry, list):
            want += " (or that array of 3)"
        raise Bad("tensor entry is not an object", name, want, repr(entry)[:80])
    code = _dtype(dtype)
    if code is None:
        raise Bad("unknown dtype", name, "one of " + ", ".join(DTYPE_BITS), repr(dtype)[:40])
    if not isinstance(shape, list) or not all(_size(d) for d in shape):
        want = "a list of integers in [0, 2**64)"
        raise Bad("shape must be a list of non-negative integers", name, want, repr(shape)[:80])
    if not (isinstance(offs, list) and len(offs) == 2 and all(_size(o) for o in offs)) or (
        offs[0] > offs[1]
    ):
        want = "[begin, end], integers, 0 <= begin <= end"
        raise Bad("data_offsets must be [begin, end] with 0 <= begin <= end", name, want,
                  repr(offs)[:80])
    return code, tuple(shape), offs[0], offs[1]


def byte_size(dtype: str, shape: Tuple[int, ...], name: Optional[str] = None) -> int:
    """Bytes of a ``dtype`` tensor of ``shape``, or :class:`Bad` (refused past 64 bits at
    every step, as the reference does)."""
    n, what = 1, f"{dtype}{list(shape)}"
    for d in shape:
        n *= d
        if n >= _U64:
            want = "fewer than 2**64 elements at every step"
            raise Bad("shape's element count overflows 64 bits", name, want, what[:80])
    bits = n * DTYPE_BITS[dtype]
    if bits >= _U64:
        raise Bad("tensor's size in bits overflows 64 bits", name, "fewer than 2**64 bits",
                  what[:80])
    if bits % 8:
        want = f"an element count times {DTYPE_BITS[dtype]} bits divisible by 8"
        raise Bad("sub-byte tensor does not fill whole bytes", name, want, f"{what} = {bits} bits")
    return bits // 8


def check_layout(spans: List[Tuple[int, int, str]], data_len: int) -> None:
    """Data ranges (begin, end, name), relative to the data start, must tile the data
    region exactly, the last ending at the end of the file. Raises :class:`Bad`."""
    start, prev = 0, None
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


class _NumpyStorage(Mapping):
    """code -> numpy dtype, numpy imported on the first lookup of a value: reading
    headers (``lorakit inspect`` of a checkpoint) never loads numpy."""

    def __getitem__(self, code: str) -> "np.dtype":
        import numpy as np  # lazy: header-only paths start without numpy

        return np.dtype(_STORAGE_SPEC[code])

    def __contains__(self, code: object) -> bool:
        return code in _STORAGE_SPEC

    def __iter__(self) -> Iterator[str]:
        return iter(_STORAGE_SPEC)

    def __len__(self) -> int:
        return len(_STORAGE_SPEC)


NUMPY_STORAGE: Mapping[str, "np.dtype"] = _NumpyStorage()


def nbytes_of(dtype: str, shape: Sequence[int]) -> int:
    """Bytes the data of a ``dtype`` tensor of ``shape`` fills (packed codes included).

    >>> nbytes_of("BF16", (2, 3)), nbytes_of("F4", (4,)), nbytes_of("F6_E2M3", (4,))
    (12, 2, 3)
    """
    return DTYPE_BITS[dtype] * math.prod(int(d) for d in shape) // 8


@dataclass(frozen=True)
class TensorSpec:
    """One tensor's name, safetensors dtype code and shape: what a header says of it,
    what a writer is told to expect, what an in-memory source reports."""

    name: str
    dtype: str
    shape: Tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(int(d) for d in self.shape)

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


def _file_kind(mode: int) -> str:
    kinds = {stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a FIFO", stat.S_ISSOCK: "a socket",
             stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device"}
    return next((kind for test, kind in kinds.items() if test(mode)), "not a regular file")


# A plain header: strings without escapes, non-negative integers, null, and objects of
# three fields (or string-valued metadata) nested as safetensors nests them. JSON-level
# quirks (escapes, signs, fractions, deeper nesting) all fall outside it; inside it the
# rules left are the ones ``_check_header`` applies, so the reference has nothing to add.
_VALUE = rb"(?:s|null|\[(?:\d+(?:,\d+)*)?\])"
_MEMBERS = rb"(?:s:\{s:V,s:V,s:V\}|s:\{(?:s:s(?:,s:s)*)?\}|s:\[V,V,V\]|s:null)".replace(b"V", _VALUE)
_PLAIN = re.compile(rb"\{(?:M(?:,M)*)?\}".replace(b"M", _MEMBERS))


def _plain(raw: bytes) -> bool:
    if b"\\" in raw or raw[:1] != b"{":  # the reference wants "{" first, no escapes here
        return False
    return _PLAIN.fullmatch(re.sub(rb"[ \t\n\r]+", b"", re.sub(rb'"[^"]*"', b"s", raw))) is not None


def read_header(path: PathLike) -> SafetensorsHeader:
    """Read a safetensors header, checked by the reference, without reading tensor data.

    A header the reference refuses, or one naming a tensor twice, raises
    :class:`~lorakit.errors.FormatError` naming the file, the tensor and the broken rule.

    >>> read_header("data/tiny-qwen3/model.safetensors").tensors["model.norm.weight"].shape
    (256,)
    """
    path = Path(path)
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            # a FIFO or device would block or stream forever; a directory cannot be read
            raise Bad("not a regular file", None, "a regular file", _file_kind(st.st_mode))
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise Bad("file shorter than the 8-byte header length", None, ">= 8 bytes",
                          f"{len(head)} bytes")
            (n,) = struct.unpack("<Q", head)
            if n > st.st_size - 8:
                raise Bad("header length is larger than the file", None,
                          f"<= {st.st_size - 8} bytes", f"{n} bytes")
            if n > MAX_HEADER_BYTES:
                raise Bad("header is implausibly large", None, f"<= {MAX_HEADER_BYTES} bytes",
                          f"{n} bytes")
            raw = f.read(n)
        try:
            obj = json.loads(raw.decode("utf-8"), object_pairs_hook=_pairs)
        except (ValueError, RecursionError) as e:  # JSON, UTF-8 and int-size errors
            raise Bad("header is not JSON", None, "a UTF-8 JSON object",
                      f"{type(e).__name__}: {str(e)[:80]}") from None
        if not isinstance(obj, dict):
            raise Bad("header is not a JSON object", None, "a JSON object", type(obj).__name__)
        meta, infos = _check_header(path, obj, 8 + n, st.st_size - 8 - n)
        if not _plain(raw):
            try:  # the reference's verdict (it imports numpy: a plain header does not need it)
                with safe_open(str(path), framework="numpy"):
                    pass
            except SafetensorError as e:
                raise Bad("the reference parser refuses the header", None,
                          "a header safetensors reads", str(e).split("header: ", 1)[-1][:200])
    except OSError as e:
        raise FormatError(f"cannot read safetensors file: {e.strerror or e}", file=path,
                          expected="a readable file", found=type(e).__name__) from None
    except Bad as e:
        message, tensor, expected, found = e.args
        raise FormatError(f"not a valid safetensors file: {message}", file=path, tensor=tensor,
                          expected=expected, found=found) from None
    return SafetensorsHeader(path, 8 + n, meta, {t.name: t for t in infos})


def _check_header(path: Path, obj: dict, data_start: int,
                  data_len: int) -> Tuple[Dict[str, str], List[TensorInfo]]:
    """Metadata and tensors of a parsed header, in data order; raises ``Bad``."""
    for key in getattr(obj, "twice", ()):
        # two entries for one name: readers keeping the first or the last would differ
        raise Bad("a name appears twice in the header", key, "unique tensor names", "duplicate")
    meta = obj.get("__metadata__")
    if meta is not None and not (
        isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())
    ):
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
        infos.append(TensorInfo(name, dtype, shape, path, data_start + begin, data_start + end))
    check_layout([(t.begin - data_start, t.end - data_start, t.name) for t in infos], data_len)
    infos.sort(key=lambda t: (t.begin, t.end))
    return {str(k): v for k, v in (meta or {}).items()}, infos


def read_raw(info: TensorInfo, rows: Optional[slice] = None) -> np.ndarray:
    """Read one tensor (or a slice of its leading axis) as its storage, read-only: floats
    as float16/32/64, bf16 as uint16 bits, fp8 as uint8. Only the bytes asked for are read;
    packed sub-byte dtypes (F4, F6_*) are refused by name."""
    def bad(message: str, expected: str, found: str, hint: Optional[str] = None) -> FormatError:
        return FormatError(message, file=info.file, tensor=info.name, expected=expected,
                           found=found, hint=hint)

    if info.dtype not in NUMPY_STORAGE:
        raise bad(f"lorakit cannot compute on {info.dtype} tensors (packed "
                  f"{DTYPE_BITS[info.dtype]}-bit elements)", "one of " + ", ".join(NUMPY_STORAGE),
                  info.dtype, "such tensors are copied through untouched; an adapter cannot be "
                  "fused into one")
    import numpy as np  # lazy: header-only paths start without numpy

    maxdims = 64 if int(np.__version__.split(".")[0]) >= 2 else 32
    if len(info.shape) > maxdims:
        raise bad("tensor has more dimensions than numpy supports", f"<= {maxdims} dimensions",
                  f"{len(info.shape)} dimensions")
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
        raise bad("read past the tensor's data", f"<= {info.nbytes} bytes", f"{want} bytes")
    buf = np.empty(count, dt)  # read straight into the array
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
        raise bad("file ended before the tensor's data", f"{want} bytes", f"{got} bytes")
    buf.flags.writeable = False  # a tensor read is the file's, not to edit
    try:
        return buf.reshape(shape)
    except ValueError:  # a dimension past numpy's index type (2**63), with zero elements
        raise bad("numpy cannot hold this tensor's shape", "dimensions below 2**63",
                  f"{list(info.shape)}"[:80]) from None


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


class _LazyCodes(dict):
    """mx dtype -> safetensors code, filled on first use (MLX imported only then)."""

    def __missing__(self, key):
        if not self:
            import mlx.core as mx  # lazy: MLX only when computing

            names = "bfloat16 float16 float32 float64 uint32 int32 uint8 int8 uint16 int16 int64"
            codes = "BF16 F16 F32 F64 U32 I32 U8 I8 U16 I16 I64 U64 BOOL C64".split()
            for name, code in zip(names.split() + ["uint64", "bool_", "complex64"], codes):
                self[getattr(mx, name)] = code
            if key in self:
                return self[key]
        raise KeyError(f"dtype {key} has no safetensors code")


MX_CODES: Mapping[object, str] = _LazyCodes()
