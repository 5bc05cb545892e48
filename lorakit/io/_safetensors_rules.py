"""The rules a safetensors header must follow, exactly as the reference reader applies them.

The reference is the ``safetensors`` package (Rust crate ``safetensors``, 0.8):
``SafeTensors::read_metadata`` parses the header with ``serde_json`` and
``Metadata::validate`` checks the layout. A file it refuses, lorakit refuses, and
the other way round, with one deliberate exception: a tensor name given twice in
one header (the reference keeps the last entry; other readers keep the first, so
the same file would load different weights) is refused. ``tests/
test_safetensors_reference.py`` feeds the same bytes to both and compares verdicts.

What ``serde_json`` does differently from Python's ``json`` and is repeated here:
no ``NaN``/``Infinity``, numbers beyond the float range refused (even where the
value is ignored), integers above ``2**64 - 1`` or negative zero are floats (so not
a size), unpaired UTF-16 surrogate escapes refused, at most 127 nested levels.
What the derived deserializer accepts and is accepted here too: unknown fields in a
tensor entry, an entry written as the array ``[dtype, shape, data_offsets]``, a
dtype written as ``{"F32": null}``, ``"__metadata__": null``, a metadata key given
twice (the last wins).
"""
from __future__ import annotations

import json
import math
import re
from typing import Any, Dict, List, Optional, Tuple

#: bits per element of every dtype the reference (safetensors 0.8) knows.
DTYPE_BITS: Dict[str, int] = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8,
    "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
    "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}

#: the reference refuses a longer header (``MAX_HEADER_SIZE``) before reading it.
MAX_HEADER_BYTES = 100_000_000

#: serde_json's recursion limit: 128 levels entered, the 128th refused.
MAX_JSON_DEPTH = 127

_U64 = 1 << 64  # usize on the 64-bit hosts the reference runs on
_SURROGATE = re.compile("[\ud800-\udfff]")
FIELDS = ("dtype", "shape", "data_offsets")


class HeaderJSONError(ValueError):
    """JSON that Python's parser reads but the reference's parser refuses."""


class Bad(Exception):
    """One broken rule: message, tensor (if any), expected, found."""

    def __init__(self, message: str, tensor: Optional[str] = None,
                 expected: Optional[str] = None, found: Optional[str] = None) -> None:
        super().__init__(message)
        self.message, self.tensor, self.expected, self.found = message, tensor, expected, found


class JSONObject(dict):
    """A JSON object as a dict (the last value of a repeated key wins, as in serde)
    that remembers which keys were repeated and the values they shadowed (serde
    still parses and type-checks those)."""

    repeated: Tuple[str, ...] = ()
    shadowed: Tuple[Any, ...] = ()


def _object(pairs: List[Tuple[str, Any]]) -> JSONObject:
    out = JSONObject(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        out.repeated = tuple(k for k, _ in pairs if k in seen or seen.add(k))
        last = {k: i for i, (k, _) in enumerate(pairs)}
        out.shadowed = tuple(v for i, (k, v) in enumerate(pairs) if last[k] != i)
    return out


def _int(s: str) -> Any:
    """An integer literal as serde_json reads it: u64 / i64, else a float."""
    if len(s) > 20:  # beyond every 64-bit integer: serde reads a float
        return _float(s)
    v = int(s)
    if s.startswith("-") and (v == 0 or v < -(1 << 63)):
        return float(s)  # serde: "-0" and below i64::MIN are floats
    if v >= _U64:
        return float(s)
    return v


def _float(s: str) -> float:
    v = float(s)
    if math.isinf(v):
        raise HeaderJSONError(f"number out of range: {s[:40]}")
    return v


def _constant(s: str) -> Any:
    raise HeaderJSONError(f"{s} is not JSON")


def _check_tree(obj: Any, text: str) -> None:
    """Nesting depth and unpaired surrogates, checked where they can occur."""
    check_surrogates = "\\u" in text  # valid UTF-8 cannot hold a surrogate otherwise
    check_depth = text.count("[") + text.count("{") > MAX_JSON_DEPTH
    if not (check_surrogates or check_depth):
        return
    stack: List[Tuple[Any, int]] = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            if check_surrogates and _SURROGATE.search(node):
                raise HeaderJSONError("lone UTF-16 surrogate in a string escape")
        elif isinstance(node, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise HeaderJSONError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
            if isinstance(node, dict):
                for k in node:
                    stack.append((k, depth))
                stack.extend((v, depth + 1) for v in node.values())
                stack.extend((v, depth + 1) for v in getattr(node, "shadowed", ()))
            else:
                stack.extend((v, depth + 1) for v in node)


def load_header_json(raw: bytes) -> Any:
    """Parse header bytes as the reference does.

    Raises ``UnicodeDecodeError``, ``ValueError`` (``json.JSONDecodeError`` or
    :class:`HeaderJSONError`) or ``RecursionError`` when it refuses them.
    """
    text = raw.decode("utf-8")
    obj = json.loads(text, object_pairs_hook=_object, parse_int=_int, parse_float=_float,
                     parse_constant=_constant)
    _check_tree(obj, text)
    return obj


def _size(x: Any) -> bool:
    return type(x) is int and 0 <= x < _U64


def _dtype(x: Any) -> Optional[str]:
    if isinstance(x, str):
        return x if x in DTYPE_BITS else None
    if isinstance(x, JSONObject) and len(x) == 1 and not x.repeated:
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
        twice = [k for k in getattr(entry, "repeated", ()) if k in FIELDS]
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
    """Bytes the data of a ``dtype`` tensor of ``shape`` fills, or :class:`Bad`.

    Overflow-safe: Python integers, refused past 64 bits at every step as the
    reference does (so ``[2**40, 2**40, 0]`` is refused although it holds nothing).
    """
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
