"""Did the merge take? A fused checkpoint checked against its base and adapter.

For each adapted weight, with ``W`` the base, ``F`` the fused weight and ``D`` the
intended change (``scale * B @ A``, or the DoRA rescaling), all in float64:

* ``R = F - W`` is the change the fuse really made;
* ``survived = <R, D> / <D, D>``: the fraction of the delta that is there
  (1 = all of it, 0 = none, 2 = twice);
* ``corr = <R, D> / (|R| |D|)``: whether the change points the intended way;
* ``delta_ulps = |D| / |ulp(W)|``: the delta's RMS in units of the RMS spacing of
  the fused float format at W (well below 1: rounding will eat most of it);
* ``ref_dev = |R - Q| / |Q|``, Q the change a correct fuse makes (below): 0 when
  the fused weight is exactly the correctly rounded one;
* ``expected``: the same projection for a *correct* fuse of the same format
  (exact sum rounded once to the fused dtype, or re-quantized with the fused
  weight's own bits and group size), which is below 1 when the delta is small
  against the format's spacing. ``scale_est = survived / expected`` then reads
  1 for a good fuse, 2 for an adapter applied twice, 0.5 for a halved scale.

Verdicts: ``ok`` (the fused weight is, or scales like, the correct one);
``not applied`` (F == W although a correct fuse would change
it); ``applied twice``; ``wrong scale (xK)``; ``unrelated change`` (R does not
point along D); ``rounding-limited`` (the delta is too small for the format: even
a correct fuse keeps under 80% of it, or leaves the weight unchanged);
``partially lost to quantization`` / ``lost to quantization`` (the same for
quantized weights); ``missing`` / ``shape mismatch``. Tensors the adapter carries
whole (PEFT ``modules_to_save``): ``replaced`` when the fused tensor is that copy
rounded once to its dtype, else ``replacement differs`` / ``replacement not written``.

Base tensors the adapter does not touch must come through bit for bit; any that
changed are listed with the verdict ``changed without adapter``.

>>> import lorakit
>>> _ = lorakit.fuse("data/tiny-qwen3", "data/adapters/lora", "fused")
>>> merge_check("fused", "data/tiny-qwen3", "data/adapters/lora").ok
True
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np

from .. import numerics as nm
from ..io.adapter import Adapter, load_adapter
from ..fusion.delta import intended, tensor_pieces
from ..io.source import TensorSource, open_source, weight_f64
from .layers import split_name
from .report import Report
from .ulp_stream import compare_sources
from ..io.safetensors import raw_to_mx
from ..io.naming import bind, bind_replacements, bindings_by_tensor
from ..fusion.core import cast_raw
from . import plots

__all__ = ["MergeCheck", "merge_check", "intended_pieces", "VERDICTS_OK"]

#: verdicts that mean the fuse did what it should
VERDICTS_OK = ("ok", "rounding-limited", "partially lost to quantization", "lost to quantization",
               "replaced")
_SCALE_TOL = 0.15  # |scale_est - 1| allowed for "ok": rounding noise of a different order
_TWICE_TOL = 0.3
_LIMITED = 0.8  # a correct fuse keeping less than this of the delta is "limited"
_SAME_REF = 0.05  # |R - Q| <= this * |Q|: the fuse wrote what a correct one writes


class _Weights:
    """Reads one weight of a source in pieces, as float64 or raw bits."""

    def __init__(self, src: TensorSource, tensor: str) -> None:
        self.src, self.tensor = src, tensor
        self.q = src.quant_params(tensor[: -len(".weight")])
        self._full: Optional[np.ndarray] = None

    def f64(self, expert: Optional[int], rows: slice) -> np.ndarray:
        if self.q is not None:  # packed: dequantize once, slice in memory
            if self._full is None:
                self._full = weight_f64(self.src, self.tensor)
            x = self._full if expert is None else self._full[expert]
            return x[rows]
        if expert is not None:
            return weight_f64(self.src, self.tensor, slice(expert, expert + 1))[0][rows]
        return weight_f64(self.src, self.tensor, rows)

    def raw(self, expert: Optional[int], rows: slice) -> np.ndarray:
        if expert is not None:
            return self.src.read(self.tensor, slice(expert, expert + 1))[0][rows]
        return self.src.read(self.tensor, rows)


def intended_pieces(fused: TensorSource, base: TensorSource, tensor: str, binds: list, *,
                    raw: bool = True) -> Iterator[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(fused piece, base piece W, exact target T) over the changed blocks of a weight.

    The fused piece is raw bits (``raw=True``) or float64 (dequantized if packed); W
    and T are float64. T is ``W + scale * B @ A``, or DoRA's
    ``m * (W + scale * B @ A) / ||W + scale * B @ A||_row``. Pieces are row chunks
    of about a million elements (one expert at a time for stacked experts).
    """
    wb, wf = _Weights(base, tensor), _Weights(fused, tensor)
    for p in tensor_pieces(binds):
        plan = [slice(None)] if p.slot is not None else list(nm.chunks(*p.shape))
        for rows in plan:
            W = wb.f64(p.slot, rows)
            T = intended(W, p, rows)
            F = wf.raw(p.slot, rows) if raw else wf.f64(p.slot, rows)
            yield F, W, T


def _reference_change(T: np.ndarray, W: np.ndarray, fused: TensorSource, tensor: str,
                      base_scales_code: Optional[str]) -> np.ndarray:
    """What a correct fuse changes: T rounded once to the fused dtype (or re-quantized
    with the fused weight's packing), minus W."""
    module = tensor[: -len(".weight")]
    q = fused.quant_params(module)
    if q is None:
        fmt = nm.float_format(fused.tensors[tensor].dtype)
        return nm.to_float64(nm.round_to_format(T, fmt), fmt) - W
    import mlx.core as mx  # lazy: MLX only when computing

    code = fused.tensors.get(f"{module}.scales")
    code = code.dtype if code is not None else (base_scales_code or "BF16")
    fmt = nm.float_format(code)
    x = nm.round_to_format(T, fmt)  # lorakit and mlx-lm fuse in the scales' dtype

    xm = raw_to_mx(x, fmt.safetensors)
    parts = mx.quantize(xm, group_size=q.group_size, bits=q.bits, mode=q.mode)
    w, s = parts[0], parts[1]
    b = parts[2] if len(parts) > 2 else None
    back = mx.dequantize(w, s, b, group_size=q.group_size, bits=q.bits, mode=q.mode)
    return np.array(back.astype(mx.float32)).astype(np.float64) - W


@dataclass(repr=False)
class MergeCheck(Report):
    """Per adapted tensor: survived, expected, scale_est, corr, ref_dev, changed
    (fraction of elements the fuse changed), delta_ulps, verdict.

    ``ok`` is True when every verdict is one of :data:`VERDICTS_OK`."""

    @property
    def ok(self) -> bool:
        return all(r["verdict"] in VERDICTS_OK for r in self.rows)

    def verdicts(self) -> Dict[str, str]:
        return {r["tensor"]: r["verdict"] for r in self.rows}

    def plot(self, ax=None):
        """Survived vs expected fraction of each delta, side by side."""

        rows = [r for r in self.rows if r.get("survived") is not None]
        return plots.grouped_bars([r["tensor"].replace(".weight", "") for r in rows],
                                  {"survived": [r["survived"] for r in rows],
                                   "a correct fuse": [r["expected"] for r in rows]},
                                  title=self.title, ylabel="<F - W, D> / <D, D>", ax=ax)

    figure = plot


def _verdict(s: Dict[str, float], quantized: bool) -> str:
    limited = "partially lost to quantization" if quantized else "rounding-limited"
    gone = "lost to quantization" if quantized else "rounding-limited"
    expected, survived = s["expected"], s["survived"]
    if s["EE"] <= _SAME_REF ** 2 * s["QQ"]:
        # the fused weight is (within a few elements' rounding) what a correct fuse
        # writes: judge only how much of the delta the format can carry
        if expected >= _LIMITED:
            return "ok"
        return limited if expected >= 0.2 else gone
    if s["RR"] == 0:
        return gone if expected < 0.2 else "not applied"
    if expected <= 0.05:  # a correct fuse keeps (almost) nothing: no scale can be read
        return gone if abs(survived) < 0.2 else "unrelated change"
    if s["corr"] < 0.5 * max(s["corr_ref"], 0.2):
        return "unrelated change"
    k = survived / expected
    if abs(k - 1) <= _SCALE_TOL:
        return limited if expected < _LIMITED else "ok"
    if abs(k - 2) <= _TWICE_TOL:
        return "applied twice"
    if k < 0.2 and quantized:
        return "lost to quantization" if expected < 0.2 else "not applied"
    return f"wrong scale (x{k:.2g})"


def merge_check(fused: Any, base: Any, adapter: Any, *, check_untouched: bool = True,
                progress: Any = True) -> MergeCheck:
    """Check that a fused checkpoint carries its adapter's deltas, tensor by tensor.

    Args:
        fused: the fused checkpoint (directory, Checkpoint or in-memory model).
        base: the base it was fused from.
        adapter: the adapter directory (or a loaded Adapter).
        check_untouched: also verify that every tensor the adapter does not change is
            bit-identical in the fused checkpoint (reads both checkpoints fully).
        progress: a progress bar over that comparison (tqdm.auto; none when stderr is
            not a terminal), a callable ``progress(done_bytes, total_bytes)``, or False.

    Returns:
        A :class:`MergeCheck` (``.ok``, ``.verdicts()``, rows with the numbers).
    """

    sf, sb = open_source(fused), open_source(base)
    ad = adapter if isinstance(adapter, Adapter) else load_adapter(adapter)
    by_tensor = bindings_by_tensor(bind(ad, sb))
    rows: List[Dict[str, Any]] = []
    for tensor, binds in by_tensor.items():
        module = tensor[: -len(".weight")]
        qb = sb.quant_params(module)
        base_code = sb.tensors[tensor].dtype if qb is None else \
            sb.tensors[f"{module}.scales"].dtype
        row = _row(tensor, base_code, "")
        meta = sf.tensors.get(tensor)
        if meta is None:
            row["verdict"] = "missing"
            rows.append(row)
            continue
        qf = sf.quant_params(module)
        fused_code = meta.dtype if qf is None else sf.tensors[f"{module}.scales"].dtype
        row["dtype"] = base_code if fused_code == base_code else f"{base_code}->{fused_code}"
        if qf is None and qb is None and tuple(meta.shape) != tuple(sb.tensors[tensor].shape):
            row["verdict"] = "shape mismatch"
            rows.append(row)
            continue
        s = dict(RD=0.0, RR=0.0, DD=0.0, QD=0.0, QQ=0.0, EE=0.0, n=0, changed=0, uu=0.0)
        ufmt = nm.float_format(fused_code)
        for F, W, T in intended_pieces(sf, sb, tensor, binds, raw=False):
            R = F - W
            D = T - W
            Q = _reference_change(T, W, sf, tensor, base_code)
            s["RD"] += float(np.vdot(R, D))
            s["RR"] += float(np.vdot(R, R))
            s["DD"] += float(np.vdot(D, D))
            s["QD"] += float(np.vdot(Q, D))
            s["QQ"] += float(np.vdot(Q, Q))
            E = R - Q
            s["EE"] += float(np.vdot(E, E))
            s["n"] += R.size
            s["changed"] += int(np.count_nonzero(R))
            u = nm.ulp(W, ufmt)
            s["uu"] += float(np.vdot(u, u))
        dd = s["DD"]
        s["survived"] = s["RD"] / dd if dd > 0 else 1.0
        s["expected"] = s["QD"] / dd if dd > 0 else 1.0
        s["corr"] = s["RD"] / math.sqrt(s["RR"] * dd) if s["RR"] > 0 and dd > 0 else 0.0
        s["corr_ref"] = s["QD"] / math.sqrt(s["QQ"] * dd) if s["QQ"] > 0 and dd > 0 else 0.0
        row.update(survived=s["survived"], expected=s["expected"], corr=s["corr"],
                   scale_est=s["survived"] / s["expected"] if s["expected"] > 0.05 else None,
                   changed=s["changed"] / max(1, s["n"]),
                   delta_ulps=math.sqrt(dd / s["uu"]) if s["uu"] > 0 else None)
        row["ref_dev"] = math.sqrt(s["EE"] / s["QQ"]) if s["QQ"] > 0 else (
            0.0 if s["EE"] == 0 else float("inf"))
        row["verdict"] = "no delta" if dd == 0 else _verdict(s, qf is not None)
        rows.append(row)
    replaced = bind_replacements(ad, sb, dequantize=True)
    for tensor, r in replaced.items():
        rows.append(_replacement_row(sf, sb, tensor, r))
    untouched_changed = 0
    if check_untouched:
        adapted = {t[: -len(".weight")] for t in by_tensor}
        names = []
        for n in sb.tensors:
            module = n.rsplit(".", 1)[0]
            if module in adapted or n in replaced:
                continue
            if sb.quant_params(module) is not None and sf.quant_params(module) is None:
                continue  # dequantized output: packed parts are meant to change
            names.append(n)
        for d in compare_sources(sb, sf, names=names, progress=progress):
            if d.status != "equal":
                untouched_changed += 1
                rows.append(_row(d.name, d.dtype_a if d.dtype_a == d.dtype_b
                                 else f"{d.dtype_a}->{d.dtype_b}",
                                 "missing" if d.status == "only in A" else
                                 "changed without adapter",
                                 changed=d.differing / max(1, d.elements) if d.elements
                                 else None))
    flagged = [i for i, r in enumerate(rows)
               if r["verdict"] not in VERDICTS_OK or "->" in str(r["dtype"])]
    counts: Dict[str, int] = {}
    for r in rows:
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    summary: Dict[str, Any] = {
        "fused": str(sf.path or sf.label), "base": str(sb.path or sb.label),
        "adapter": str(ad.path), "adapted tensors": len(by_tensor),
        **({"replaced tensors": len(replaced)} if replaced else {}),
        "verdicts": ", ".join(f"{k}: {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])),
        "dtype changes": sum("->" in str(r["dtype"]) for r in rows),
    }
    if check_untouched:
        summary["untouched tensors changed"] = untouched_changed
    summary["ok"] = all(r["verdict"] in VERDICTS_OK for r in rows)
    return MergeCheck(title=f"merge check of {sf.label}", rows=rows,
                      columns=["tensor", "dtype", "survived", "expected", "scale_est", "corr",
                               "ref_dev", "changed", "delta_ulps", "verdict"],
                      summary=summary, flagged=flagged)


def _replacement_row(sf: TensorSource, sb: TensorSource, tensor: str, r: Any) -> Dict[str, Any]:
    """A PEFT modules_to_save copy: the fused tensor must be the copy, rounded once to
    the fused tensor's dtype (verdict ``replaced``), bit for bit."""

    base_code = sb.tensors[tensor].dtype
    row = _row(tensor, base_code, "replaced")
    meta = sf.tensors.get(tensor)
    module = tensor.rsplit(".", 1)[0]
    if meta is None:
        row["verdict"] = "missing"
        return row
    if meta.dtype != base_code:
        row["dtype"] = f"{base_code}->{meta.dtype}"
    if sf.quant_params(module) is not None or meta.dtype not in ("BF16", "F16", "F32") or \
            tuple(meta.shape) != tuple(r.raw.shape):
        row["verdict"] = "replacement not written"
        return row
    want = cast_raw(r.raw, r.code, meta.dtype).reshape(-1)
    got = np.asarray(sf.read(tensor)).reshape(-1).view(want.dtype)
    base = np.asarray(sb.read(tensor)).reshape(-1)
    row["changed"] = float(np.count_nonzero(got != base.view(got.dtype))) / max(1, got.size) \
        if base.dtype.itemsize == got.dtype.itemsize else None
    if not np.array_equal(got, want):
        row["verdict"] = "replacement differs"
    return row


def _row(tensor: str, dtype: str, verdict: str, **values: Any) -> Dict[str, Any]:
    """A table row with every column, the numbers None unless given."""
    layer, kind, _, _ = split_name(tensor)
    row: Dict[str, Any] = {"tensor": tensor, "layer": layer, "kind": kind, "dtype": dtype,
                           "survived": None, "expected": None, "scale_est": None,
                           "corr": None, "changed": None, "ref_dev": None,
                           "delta_ulps": None, "verdict": verdict}
    row.update(values)
    return row
