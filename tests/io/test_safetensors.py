"""lorakit's safetensors reader accepts exactly what the reference (the ``safetensors``
package) accepts: a table of known cases, then a differential fuzz test that feeds the
same bytes to both and requires the same verdict.

The reference entry point is ``safetensors.deserialize(bytes)``: it runs the whole
header and layout validation (``SafeTensors::read_metadata``) and returns each tensor's
dtype code, shape and raw bytes without materialising any framework array, so BF16,
F8 and F4 tensors compare too (``safe_open(framework="numpy")`` cannot load bf16; the
table checks that it gives the same verdict as ``deserialize``).

The one deliberate difference: a tensor name given twice in one header is accepted by
the reference (the last entry wins) and refused by lorakit, since a reader keeping the
first entry would load other weights from the same file.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest

safetensors = pytest.importorskip("safetensors")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st

from lorakit.errors import FormatError, LorakitError  # noqa: E402
from lorakit.io.formats.safetensors import read_header, read_raw  # noqa: E402

#: every dtype code of safetensors 0.8 and its bits per element (the spec, written
#: out here rather than imported, so the test does not trust lorakit's own table).
SPEC_DTYPES = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8,
    "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16,
    "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64,
    "I64": 64, "U64": 64,
}
PACKED = {k for k, b in SPEC_DTYPES.items() if b % 8}


# -- the two readers ------------------------------------------------------------------------
def pack(header: Any, data: bytes = b"", length: Optional[int] = None) -> bytes:
    """A safetensors file: header given as an object (JSON-encoded) or as raw bytes."""
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(blob) if length is None else length) + blob + data


def reference(buf: bytes) -> Optional[Dict[str, Tuple[str, List[int], bytes]]]:
    """The reference's reading: name -> (dtype, shape, data), or None when it refuses."""
    try:
        return {n: (t["dtype"], list(t["shape"]), bytes(t["data"]))
                for n, t in safetensors.deserialize(buf)}
    except Exception:  # SafetensorError (its only error for bad input)
        return None


def repeated_tensor_name(buf: bytes) -> bool:
    """Whether the header's top-level object gives one tensor name twice (the one
    documented difference). Headers Python's json cannot read are not such a case."""
    calls: List[List[str]] = []

    def hook(pairs):
        calls.append([k for k, _ in pairs])
        return dict(pairs)
    try:
        (n,) = struct.unpack("<Q", buf[:8])
        json.loads(buf[8:8 + n].decode("utf-8"), object_pairs_hook=hook)
    except Exception:
        return False
    if not calls:
        return False
    keys = [k for k in calls[-1] if k != "__metadata__"]  # the top level closes last
    return len(keys) != len(set(keys))


def lorakit(path: Path) -> Optional[Dict[str, Tuple[str, List[int], Optional[bytes]]]]:
    """lorakit's reading: read_header, then every tensor it can compute on. Only
    lorakit errors may escape; packed dtypes must be refused by name."""
    try:
        h = read_header(path)
    except FormatError as e:
        assert "file:" in str(e) and str(path) in str(e), e
        return None
    out = {}
    for name, t in h.tensors.items():
        if t.dtype in PACKED or len(t.shape) > 32 or any(d >= 2 ** 63 for d in t.shape):
            with pytest.raises(LorakitError) as info:
                read_raw(t)
            assert name in str(info.value), info.value
            data = None
        else:
            data = read_raw(t).tobytes()
        out[name] = (t.dtype, list(t.shape), data)
    return out


def check_same(path: Path, buf: bytes) -> Optional[dict]:
    """Both readers give the same verdict, and when both accept, the same tensors."""
    path.write_bytes(buf)
    ref = reference(buf)
    mine = lorakit(path)
    if ref is not None and mine is None and repeated_tensor_name(buf):
        with pytest.raises(FormatError, match="appears twice"):
            read_header(path)
        return None
    assert (ref is None) == (mine is None), (
        f"reference {'refuses' if ref is None else 'accepts'}, lorakit "
        f"{'refuses' if mine is None else 'accepts'}: {buf[:300]!r}")
    if ref is not None:
        assert mine is not None and set(mine) == set(ref)
        for name, (dtype, shape, data) in ref.items():
            m_dtype, m_shape, m_data = mine[name]
            assert (m_dtype, m_shape) == (dtype, shape), name
            assert m_data is None or m_data == data, name
    return mine


@pytest.fixture(scope="module")
def scratch():
    shm = Path("/dev/shm")
    where = str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None
    d = Path(tempfile.mkdtemp(prefix="lorakit-stref-", dir=where))
    yield d
    shutil.rmtree(d, ignore_errors=True)


# -- 1. the known cases ------------------------------------------------------------------------
def T(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


F32 = T("F32", [1], 0, 4)
OK, REFUSED = True, False
E = b'"dtype":"F32","shape":[1],"data_offsets":[0,4]'  # one F32 entry's fields, as text

CASES = [  # id, file bytes, does the reference accept it
    ("minimal", pack({"a": F32}, b"\0" * 4), OK),
    ("no-tensors", pack({}), OK),
    ("trailing-byte", pack({"a": F32}, b"\0" * 5), REFUSED),
    ("trailing-bytes-no-tensors", pack({}, b"\0"), REFUSED),
    ("bytes-between-tensors", pack({"a": F32, "b": T("F32", [1], 8, 12)}, b"\0" * 12), REFUSED),
    ("gap-before-first", pack({"a": T("F32", [1], 4, 8)}, b"\0" * 8), REFUSED),
    ("overlap", pack({"a": F32, "b": F32}, b"\0" * 4), REFUSED),
    ("partial-overlap", pack({"a": T("F32", [2], 0, 8), "b": T("F32", [1], 4, 8)}, b"\0" * 8),
     REFUSED),
    ("truncated", pack({"a": T("F32", [2], 0, 8)}, b"\0" * 7), REFUSED),
    ("offsets-in-any-order", pack({"b": T("F32", [1], 4, 8), "a": F32}, b"\0" * 8), OK),
    ("reversed-offsets", pack({"a": T("F32", [0], 4, 0)}, b"\0" * 4), REFUSED),
    ("zero-sized", pack({"z": T("F32", [0], 0, 0)}), OK),
    ("zero-sized-between", pack({"a": F32, "z": T("F32", [0, 3], 4, 4),
                                 "b": T("F32", [1], 4, 8)}, b"\0" * 8), OK),
    ("zero-sized-past-end", pack({"a": F32, "z": T("F32", [0], 9, 9)}, b"\0" * 4), REFUSED),
    ("two-zero-sized-same-place", pack({"y": T("U8", [0], 0, 0), "z": T("U8", [0], 0, 0)}), OK),
    ("scalar", pack({"s": T("I32", [], 0, 4)}, b"\0" * 4), OK),
    ("shape-disagrees", pack({"a": T("F32", [2], 0, 4)}, b"\0" * 4), REFUSED),
    ("count-overflows-before-zero", pack({"a": T("F32", [2 ** 40, 2 ** 40, 0], 0, 0)}), REFUSED),
    ("bits-overflow", pack({"a": T("F64", [2 ** 59], 0, 0)}), REFUSED),
    ("dim-2**64", pack({"a": T("F32", [2 ** 64, 0], 0, 0)}), REFUSED),
    ("dim-u64-max-times-zero", pack({"a": T("F32", [2 ** 64 - 1, 0], 0, 0)}), OK),
    ("17-dims", pack({"a": T("U8", [1] * 17, 0, 1)}, b"\0"), OK),
    ("F4-even", pack({"a": T("F4", [4], 0, 2)}, b"\0" * 2), OK),
    ("F4-odd-count", pack({"a": T("F4", [3], 0, 2)}, b"\0" * 2), REFUSED),
    ("F6-whole-bytes", pack({"a": T("F6_E2M3", [4], 0, 3)}, b"\0" * 3), OK),
    ("F6-part-byte", pack({"a": T("F6_E3M2", [2], 0, 2)}, b"\0" * 2), REFUSED),
    ("C64", pack({"a": T("C64", [2], 0, 16)}, b"\0" * 16), OK),
    ("F8_E4M3FNUZ", pack({"a": T("F8_E4M3FNUZ", [3], 0, 3)}, b"\1\2\3"), OK),
    ("F8_E8M0", pack({"a": T("F8_E8M0", [1], 0, 1)}, b"\7"), OK),
    ("lower-case-dtype", pack({"a": T("f32", [1], 0, 4)}, b"\0" * 4), REFUSED),
    ("unknown-dtype", pack({"a": T("F12", [1], 0, 4)}, b"\0" * 4), REFUSED),
    ("dtype-as-unit-variant-map", pack({"a": {**F32, "dtype": {"F32": None}}}, b"\0" * 4), OK),
    ("dtype-as-map-with-value", pack({"a": {**F32, "dtype": {"F32": []}}}, b"\0" * 4), REFUSED),
    ("entry-as-array", pack({"a": ["F32", [1], [0, 4]]}, b"\0" * 4), OK),
    ("entry-as-array-of-4", pack({"a": ["F32", [1], [0, 4], 0]}, b"\0" * 4), REFUSED),
    ("entry-null", pack({"a": None}), REFUSED),
    ("entry-missing-field", pack({"a": {"dtype": "F32", "shape": [0]}}), REFUSED),
    ("extra-field", pack({"a": {**F32, "x": [1, {"y": None}]}}, b"\0" * 4), OK),
    ("offsets-three", pack({"a": {**F32, "data_offsets": [0, 4, 4]}}, b"\0" * 4), REFUSED),
    ("offsets-map", pack({"a": {**F32, "data_offsets": {"0": 0, "1": 4}}}, b"\0" * 4), REFUSED),
    ("shape-float", pack(b'{"a":{"dtype":"F32","shape":[1.0],"data_offsets":[0,4]}}',
                         b"\0" * 4), REFUSED),
    ("shape-bool", pack(b'{"a":{"dtype":"F32","shape":[true],"data_offsets":[0,4]}}',
                        b"\0" * 4), REFUSED),
    ("shape-minus-zero", pack(b'{"a":{"dtype":"F32","shape":[-0],"data_offsets":[0,0]}}'),
     REFUSED),
    ("metadata", pack({"__metadata__": {"format": "pt"}, "a": F32}, b"\0" * 4), OK),
    ("metadata-null", pack({"__metadata__": None}), OK),
    ("metadata-empty-list", pack({"__metadata__": []}), REFUSED),
    ("metadata-empty-string", pack({"__metadata__": ""}), REFUSED),
    ("metadata-false", pack({"__metadata__": False}), REFUSED),
    ("metadata-int-value", pack({"__metadata__": {"format": 1}}), REFUSED),
    ("metadata-null-value", pack({"__metadata__": {"format": None}}), REFUSED),
    ("metadata-nested", pack({"__metadata__": {"a": {"b": "c"}}}), REFUSED),
    ("metadata-twice", pack(b'{"__metadata__":{},"__metadata__":{}}'), REFUSED),
    ("metadata-escaped-twice", pack(b'{"__metadata__":{},"\\u005f_metadata__":{}}'), REFUSED),
    ("metadata-key-twice", pack(b'{"__metadata__":{"a":"1","a":"2"}}'), OK),
    ("metadata-key-twice-shadowed-int", pack(b'{"__metadata__":{"a":1,"a":"2"}}'), REFUSED),
    ("field-twice", pack(b'{"a":{"dtype":"F32",' + E + b'}}', b"\0" * 4), REFUSED),
    ("unknown-field-twice", pack(b'{"a":{"x":1,"x":2,' + E + b'}}', b"\0" * 4), OK),
    ("tensor-name-twice", pack(b'{"a":{' + E + b'},"a":{' + E + b'}}', b"\0" * 4), OK),
    ("tensor-name-twice-first-broken", pack(b'{"a":null,"a":{' + E + b'}}', b"\0" * 4), REFUSED),
    ("header-spaces-after", pack(b'{}    '), OK),
    ("header-whitespace-around", pack(b' \n\t\r{}\r\n '), OK),
    ("header-nul-padding", pack(b'{}\0\0'), REFUSED),
    ("header-bom", pack(b'\xef\xbb\xbf{}'), REFUSED),
    ("header-not-object", pack(b'[]'), REFUSED),
    ("header-empty", pack(b''), REFUSED),
    ("header-not-utf8", pack(b'{"\xff":{}}'), REFUSED),
    ("header-trailing-garbage", pack(b'{}x'), REFUSED),
    ("NaN-in-unknown-field", pack(b'{"a":{"x":NaN,' + E + b'}}', b"\0" * 4), REFUSED),
    ("Infinity-in-unknown-field", pack(b'{"a":{"x":-Infinity,' + E + b'}}', b"\0" * 4), REFUSED),
    ("float-out-of-range", pack(b'{"a":{"x":1e400,' + E + b'}}', b"\0" * 4), REFUSED),
    ("float-underflow", pack(b'{"a":{"x":1e-400,' + E + b'}}', b"\0" * 4), OK),
    ("int-beyond-u64-ignored", pack(b'{"a":{"x":' + b"9" * 30 + b',' + E + b'}}', b"\0" * 4),
     OK),
    ("int-beyond-f64-ignored", pack(b'{"a":{"x":' + b"9" * 309 + b',' + E + b'}}', b"\0" * 4),
     REFUSED),
    ("int-5000-digits-ignored", pack(b'{"a":{"x":' + b"1" * 5000 + b',' + E + b'}}',
                                     b"\0" * 4), REFUSED),
    ("lone-surrogate-ignored", pack(b'{"a":{"x":"\\ud800",' + E + b'}}', b"\0" * 4), REFUSED),
    ("lone-low-surrogate-name", pack(b'{"\\udc00":{' + E + b'}}', b"\0" * 4), REFUSED),
    ("surrogate-pair", pack(b'{"__metadata__":{"a":"\\ud83d\\ude00"}}'), OK),
    ("nesting-127", pack(b'{"a":{"x":' + b"[" * 125 + b"]" * 125 + b',' + E + b'}}',
                         b"\0" * 4), OK),
    ("nesting-128", pack(b'{"a":{"x":' + b"[" * 126 + b"]" * 126 + b',' + E + b'}}',
                         b"\0" * 4), REFUSED),
    ("nesting-2000", pack(b'{"a":{"x":' + b"[" * 2000 + b"]" * 2000 + b',' + E + b'}}',
                          b"\0" * 4), REFUSED),
    ("file-empty", b"", REFUSED),
    ("file-7-bytes", b"\2\0\0\0\0\0\0", REFUSED),
    ("length-past-file", pack(b'{}', length=3), REFUSED),
    ("length-short", pack(b'{} ', length=2), REFUSED),
    ("length-2**63", pack(b'{}', length=2 ** 63), REFUSED),
    ("length-over-100MB", pack(b'{}', length=100_000_001), REFUSED),
]


@pytest.mark.parametrize("name,buf,accepted", CASES, ids=[c[0] for c in CASES])
def test_known_case(scratch: Path, name: str, buf: bytes, accepted: bool) -> None:
    assert (reference(buf) is not None) == accepted, "the reference changed its mind"
    p = scratch / "case.safetensors"
    p.write_bytes(buf)
    try:  # safe_open validates the same way (it cannot load bf16, so only its verdict)
        with safetensors.safe_open(str(p), framework="numpy") as f:
            f.keys()
        opened = True
    except Exception:
        opened = False
    assert opened == accepted
    mine = check_same(p, buf)
    if name == "tensor-name-twice":
        assert mine is None  # the documented difference


def test_every_spec_dtype_reads_or_is_refused_by_name(scratch: Path) -> None:
    """Each dtype of the spec is read (bytes as stored) or refused naming the dtype."""
    for dtype, bits in SPEC_DTYPES.items():
        count = 8
        nbytes = count * bits // 8
        data = bytes(range(nbytes))
        p = scratch / f"{dtype}.safetensors"
        p.write_bytes(pack({"t": T(dtype, [2, 4], 0, nbytes)}, data))
        info = read_header(p).tensors["t"]
        assert info.nbytes == nbytes
        if dtype in PACKED:
            with pytest.raises(FormatError, match=dtype):
                read_raw(info)
        else:
            assert read_raw(info).tobytes() == data
            assert read_raw(info, slice(1, 2)).tobytes() == data[nbytes // 2:]


def test_errors_name_file_and_tensor(scratch: Path) -> None:
    p = scratch / "gap.safetensors"
    p.write_bytes(pack({"a": F32, "b": T("F32", [1], 8, 12)}, b"\0" * 12))
    with pytest.raises(FormatError) as info:
        read_header(p)
    msg = str(info.value)
    assert "bytes between tensors" in msg and "tensor: b" in msg and str(p) in msg
    p.write_bytes(pack({"a": F32}, b"\0" * 9))
    with pytest.raises(FormatError, match="after the last tensor") as info:
        read_header(p)
    assert "tensor: a" in str(info.value) and "found: 5 more bytes" in str(info.value)


# -- 2. the differential fuzz test ---------------------------------------------------------------
json_leaf = (st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70)
             | st.floats(allow_nan=True) | st.text(max_size=6)
             | st.sampled_from(sorted(SPEC_DTYPES)))
json_values = st.recursive(
    json_leaf, lambda kids: st.lists(kids, max_size=3)
    | st.dictionaries(st.text(max_size=4) | st.sampled_from(["dtype", "shape", "data_offsets"]),
                      kids, max_size=3), max_leaves=8)
TOKENS = [b"-0", b"1e400", b"NaN", b"Infinity", b'"\\ud800"', b"\\ud800", b"\\udc00", b"[",
          b"]", b"{", b"}", b",", b":", b'"', b"null", b" ", b"\t", b"\n", b"\x00", b"0", b"1",
          b"18446744073709551616", b"18446744073709551615", b"\xff", b"\xc3\xa9", b"1.0",
          b'"__metadata__"', b'"F4"', b'"dtype"', b'{"F32":null}', b"[" * 130, b"\\u005f"]


@st.composite
def safetensors_files(draw) -> bytes:
    """A valid file (any spec dtype, shapes, order, metadata) with 0-3 structural
    mutations of its header, 0-3 byte-level mutations of the header text, a cut or
    padded data region and, rarely, a wrong length prefix."""
    header: Dict[str, Any] = {}
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.dictionaries(st.text(max_size=4), st.text(max_size=4),
                                                      max_size=2))
    sizes = []
    for i in range(draw(st.integers(0, 4))):
        dtype = draw(st.sampled_from(sorted(SPEC_DTYPES)))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        numel = 1
        for d in shape:
            numel *= d
        if dtype in PACKED and draw(st.booleans()):
            shape, numel = shape + [4], numel * 4  # mostly whole bytes
        sizes.append((f"t{i}", dtype, shape, numel * SPEC_DTYPES[dtype] // 8))
    off = 0
    for name, dtype, shape, n in draw(st.permutations(sizes)):
        header[name] = T(dtype, shape, off, off + n)
        off += n
    data = bytes(i % 251 for i in range(off))
    names = sorted(header) + ["new"]
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(names))
        entry = header.get(name)
        op = draw(st.sampled_from(["field", "entry", "delete", "offsets", "as-array",
                                   "unit-dtype", "extra", "deep"]))
        if op == "delete":
            header.pop(name, None)
        elif op == "entry":
            header[name] = draw(json_values)
        elif not isinstance(entry, dict):
            continue
        elif op == "offsets":
            b = draw(st.integers(0, off + 8))
            entry["data_offsets"] = [b, b + draw(st.integers(0, 16))]
        elif op == "field":
            key = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
            entry[key] = draw(json_values)
        elif op == "as-array" and all(k in entry for k in ("dtype", "shape", "data_offsets")):
            header[name] = [entry["dtype"], entry["shape"], entry["data_offsets"]]
        elif op == "unit-dtype":
            entry["dtype"] = {entry.get("dtype"): None} if isinstance(entry.get("dtype"), str) \
                else None
        elif op == "extra":
            entry[draw(st.text(max_size=3))] = draw(json_values)
        elif op == "deep":
            k = draw(st.integers(120, 130))
            entry["x"] = json.loads("[" * k + "]" * k)
    blob = json.dumps(header, separators=draw(st.sampled_from([(",", ":"), (", ", ": ")])),
                      allow_nan=True).encode()
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(blob)))
        op = draw(st.sampled_from(["insert", "delete", "dup-entry"]))
        if op == "insert":
            blob = blob[:at] + draw(st.sampled_from(TOKENS)) + blob[at:]
        elif op == "delete":
            blob = blob[:at] + blob[at + draw(st.integers(1, 4)):]
        elif isinstance(header, dict) and len(header) and blob.endswith(b"}"):
            name = draw(st.sampled_from(sorted(header)))
            piece = json.dumps({name: header[name]})[1:-1].encode()
            blob = blob[:-1] + (b"," if len(blob) > 2 else b"") + piece + b"}"
    blob += draw(st.sampled_from([b"", b" " * (-len(blob) % 8), b"\n", b"\0"]))
    cut = draw(st.sampled_from([0, 0, 0, -1, 1, -4, 4, draw(st.integers(-16, 16))]))
    data = data[:max(len(data) + cut, 0)] if cut < 0 else data + b"\0" * cut
    length = len(blob) + draw(st.sampled_from([0] * 12 + [-1, 1, -8, 8]))
    return pack(blob, data, length=max(length, 0))


FUZZ = dict(deadline=None, database=None, derandomize=False,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                   HealthCheck.filter_too_much])


@settings(max_examples=150, **FUZZ)
@given(buf=safetensors_files())
def test_differential_quick(scratch: Path, buf: bytes) -> None:
    check_same(scratch / "fuzz.safetensors", buf)


@pytest.mark.slow
@settings(max_examples=2000, **FUZZ)
@given(buf=safetensors_files())
def test_differential(scratch: Path, buf: bytes) -> None:
    """The CI bound: 2000 files (about 10 s), zero disagreements."""
    check_same(scratch / "fuzz.safetensors", buf)


@pytest.mark.slow
@settings(max_examples=1000, **FUZZ)
@given(buf=st.binary(max_size=200) | st.builds(lambda n, b: struct.pack("<Q", n) + b,
                                               st.integers(0, 300), st.binary(max_size=300)))
def test_differential_random_bytes(scratch: Path, buf: bytes) -> None:
    check_same(scratch / "bytes.safetensors", buf)
