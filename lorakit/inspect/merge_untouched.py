"""The rest of a merge check: tensors the adapter does not touch, whole-tensor
replacements (PEFT ``modules_to_save``), tensors only one side has, and which dtype
conversion the fuse was asked for.

Untouched tensors must come through bit for bit, or, when the fuse converted every
float tensor to another dtype (``lorakit fuse --dtype float16``), be exactly the base
converted with one correct rounding (verdict ``converted``).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ..fusion.core import cast_raw
from ..io.source import TensorSource
from .layers import split_name
from .ulp_stream import compare_sources

__all__ = ["row", "requested_conversion", "untouched_rows", "extra_rows", "replacement_row",
           "FLOAT_CODES"]

FLOAT_CODES = ("BF16", "F16", "F32")
_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8}


def row(tensor: str, dtype: str, status: str, verdict: str, **values: Any) -> Dict[str, Any]:
    """A table row with every column, the numbers None unless given."""
    layer, kind, _, _ = split_name(tensor)
    r: Dict[str, Any] = {"tensor": tensor, "layer": layer, "kind": kind, "dtype": dtype,
                         "distance": None, "max_ulp": None, "beyond": None, "survived": None,
                         "expected": None, "fit": None, "corr": None, "changed": None,
                         "delta_ulps": None, "status": status, "verdict": verdict, "detail": ""}
    r.update(values)
    return r


def wider(code_out: str, code_in: str) -> bool:
    return _ITEMSIZE.get(code_out, 0) > _ITEMSIZE.get(code_in, 0)


def _skipped(sb: TensorSource, sf: TensorSource, name: str) -> bool:
    module = name.rsplit(".", 1)[0]
    return sb.quant_params(module) is not None and sf.quant_params(module) is None


def requested_conversion(sf: TensorSource, sb: TensorSource, adapted: set) -> Optional[str]:
    """The dtype every untouched float tensor of ``sf`` has, when all of them moved from
    the base's dtype to that one (a fuse asked for another dtype); else None. Headers only."""
    codes = set()
    for n, meta in sb.tensors.items():
        module = n.rsplit(".", 1)[0]
        if module in adapted or meta.dtype not in FLOAT_CODES or n not in sf.tensors or \
                sb.quant_params(module) is not None or _skipped(sb, sf, n):
            continue
        codes.add((meta.dtype == sf.tensors[n].dtype, sf.tensors[n].dtype))
    if len(codes) == 1:
        same, code = next(iter(codes))
        return None if same else code
    return None


def untouched_rows(sf: TensorSource, sb: TensorSource, names: List[str],
                   progress: Any) -> Tuple[List[Dict[str, Any]], int]:
    """Rows for the untouched tensors that are not bit for bit the base (or exactly its
    conversion), and how many of them there are. Converted ones get a ``converted`` row."""
    same, converted = [], []
    for n in names:
        f = sf.tensors.get(n)
        if f is not None and f.dtype != sb.tensors[n].dtype and f.dtype in FLOAT_CODES and \
                sb.tensors[n].dtype in FLOAT_CODES:
            converted.append(n)
        else:
            same.append(n)
    rows: List[Dict[str, Any]] = []
    changed = 0
    for d in compare_sources(sb, sf, names=same, progress=progress):
        if d.status != "equal":
            changed += 1
            dt = d.dtype_a if d.dtype_a == d.dtype_b else f"{d.dtype_a}->{d.dtype_b}"
            verdict = "missing" if d.status == "only in A" else "changed without adapter"
            rows.append(row(d.name, dt, "wrong", verdict,
                            changed=d.differing / max(1, d.elements) if d.elements else None,
                            detail="" if verdict == "missing" else
                            "a tensor the adapter does not touch differs from the base"))
    for n in converted:
        a, b = sb.tensors[n].dtype, sf.tensors[n].dtype
        want = cast_raw(np.asarray(sb.read(n)), a, b)
        got = np.asarray(sf.read(n))
        if tuple(got.shape) == tuple(want.shape) and np.array_equal(
                got.reshape(-1).view(np.uint8), np.ascontiguousarray(want).reshape(-1).view(np.uint8)):
            continue
        changed += 1
        rows.append(row(n, f"{a}->{b}", "wrong", "changed without adapter",
                        detail=f"not the base converted to {b} with one rounding"))
    return rows, changed


def extra_rows(sf: TensorSource, sb: TensorSource) -> List[Dict[str, Any]]:
    """Tensors the fused checkpoint has and the base does not (adapter factors saved
    into the model, another architecture's names)."""
    out = []
    for n, meta in sf.tensors.items():
        if n in sb.tensors:
            continue
        module = n.rsplit(".", 1)[0]
        if n.endswith((".scales", ".biases")) and sf.quant_params(module) is not None and \
                f"{module}.weight" in sb.tensors:
            continue  # a quantized fuse of a float base: packing parts are expected
        out.append(row(n, meta.dtype, "wrong", "extra tensor",
                       detail="in the fused checkpoint, not in the base"))
    return out


def replacement_row(sf: TensorSource, sb: TensorSource, tensor: str, r: Any) -> Dict[str, Any]:
    """A PEFT modules_to_save copy: the fused tensor must be the copy, rounded once to
    the fused tensor's dtype (verdict ``replaced``), bit for bit."""

    base_code = sb.tensors[tensor].dtype
    out = row(tensor, base_code, "ok", "replaced")
    meta = sf.tensors.get(tensor)
    module = tensor.rsplit(".", 1)[0]
    if meta is None:
        out.update(status="wrong", verdict="missing")
        return out
    if meta.dtype != base_code:
        out["dtype"] = f"{base_code}->{meta.dtype}"
    if sf.quant_params(module) is not None or meta.dtype not in ("BF16", "F16", "F32") or \
            tuple(meta.shape) != tuple(r.raw.shape):
        out.update(status="wrong", verdict="replacement not written")
        return out
    want = cast_raw(r.raw, r.code, meta.dtype).reshape(-1)
    got = np.asarray(sf.read(tensor)).reshape(-1).view(want.dtype)
    base = np.asarray(sb.read(tensor)).reshape(-1)
    out["changed"] = float(np.count_nonzero(got != base.view(got.dtype))) / max(1, got.size) \
        if base.dtype.itemsize == got.dtype.itemsize else None
    if not np.array_equal(got, want):
        out.update(status="wrong", verdict="replacement differs")
    return out
