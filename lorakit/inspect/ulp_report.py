"""Ulp histograms as a report: per tensor, per layer and overall.

:class:`UlpReport` is what :func:`lorakit.ulp_compare` (two checkpoints, see
:mod:`lorakit.inspect.parity`) and :func:`ulp_tensors` (two arrays) return: a row
per tensor with its histogram in a few words, the histograms themselves
(``counts``, ``per_layer``, ``overall``) and plots of them.

>>> bits_a = np.array([0x3F80, 0x0000, 0x8001], np.uint16)  # bf16 1.0, +0, -min_subnormal
>>> bits_b = np.array([0x3F81, 0x8000, 0x0001], np.uint16)  # next float up, -0, +min_sub.
>>> ulp_tensors(bits_a, bits_b, "bf16").rows[0]["max_ulp"]
2
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .. import numerics as nm
from ..errors import FormatError
from ..io.safetensors import mx_to_raw
from . import plots
from .layers import split_name
from .report import Report
from .ulp_accumulate import (CHUNK_BYTES, DEFAULT_MAX_BIN, Accumulator, TensorDiff, bin_labels,
                             bits_dtype, hist_text, pieces_in_memory, scale_kernel)
from .ulp_scale import TensorScale

__all__ = ["UlpReport", "ulp_report", "ulp_tensors", "scale_row", "scale_summary"]


def scale_row(d: TensorDiff) -> Dict[str, Any]:
    """A diff's figures at the tensor's scale, for a report row (0 for an equal tensor):
    ``rel_err`` = rms(a - b) / rms(A), ``max_ulp_typ`` = the largest ulp distance among
    elements whose magnitudes are at least ``2**floor(log2 rms(A))``, ``near_zero`` =
    differing elements below ``2**-10`` of that (zeros and subnormals included)."""
    eq = d.status == "equal"
    return {"rel_err": 0.0 if eq else d.rel_rms,
            "max_ulp_typ": 0 if eq else d.max_ulp_typical,
            "near_zero": 0 if eq else d.near_zero,
            "sign_changes": 0 if eq else d.sign_changes,
            "zero_one_side": 0 if eq else d.to_zero,
            "max_ulp_at_rms": 0.0 if eq else d.max_ulp_at_rms,
            "rms_a": d.rms_a}


def scale_summary(diffs: Sequence[TensorDiff]) -> Dict[str, Any]:
    """Summary lines that put the ulp distances at the tensors' scale (first: the
    figure that matters for behaviour, the relative error), over the tensors that
    differ with ulps measured. Empty when none does."""
    ds = [d for d in diffs if d.differing and d.rel_rms is not None]
    if not ds:
        return {}
    a2 = sum(d.rms_a ** 2 * d.elements for d in ds)
    d2 = sum((d.rel_rms * d.rms_a) ** 2 * d.elements for d in ds)
    typ = max(d.max_ulp_typical for d in ds)
    at_rms = max((d.max_ulp_at_rms for d in ds if d.max_ulp_at_rms is not None), default=None)
    near = sum(d.near_zero for d in ds)
    signs, zeros = sum(d.sign_changes for d in ds), sum(d.to_zero for d in ds)
    top = max(d.max_ulp for d in ds)
    out: Dict[str, Any] = {
        "relative error, rms(A - B) / rms(A)": (d2 / a2) ** 0.5,
        "max |a - b| in ulps at rms(A)": at_rms,
        "max ulp at typical magnitudes (|a|, |b| >= rms(A))": typ,
        "differing near zero (< 2**-10 rms(A))": near,
        "zero on one side": zeros,
        "sign changes": signs,
    }
    if top > typ:
        out["why max ulp is large"] = (
            f"the {top} ulp are at small values, where the format's steps are tiny; at "
            f"typical magnitudes (>= rms(A)) the largest distance is {typ} ulp")
    return out


@dataclass(repr=False)
class UlpReport(Report):
    """Ulp histograms of two sources, per tensor, per layer and overall.

    ``rows``: tensor, layer, kind, dtype, elements, differing, max_ulp, mean_ulp,
    hist. ``labels``: histogram bins. ``counts``: one histogram per row
    (``counts[i]``, zeros for rows without ulps). ``overall`` / ``per_layer``: sums.
    """

    column_help = {
        "tensor": "the tensor's name",
        "layer": "transformer block number (None: outside the blocks)",
        "kind": "what the tensor is (q/k/v/o projection, mlp part, norm, ...)",
        "dtype": "stored dtype (A/B when they differ)",
        "status": "equal (bit for bit), differs, or why it was not compared",
        "elements": "number of elements compared",
        "differing": "elements whose bits differ",
        "max_ulp": "largest distance in units in the last place (ulp) of the dtype",
        "mean_ulp": "mean distance in ulp over all elements",
        "hist": "share of elements per ulp distance (largest bins)",
        "rel_err": "rms(A - B) / rms(A): the error at the tensor's own scale (what behaviour feels)",
        "max_ulp_typ": "largest ulp distance among elements of typical magnitude (>= the tensor's rms, "
                       "rounded down to a power of two)",
        "near_zero": "differing elements below 2^-10 of the tensor's scale: their ulps are tiny, "
                     "so large ulp distances there mean little",
    }

    labels: List[str] = field(default_factory=list)
    counts: Optional[np.ndarray] = None
    overall: Optional[np.ndarray] = None
    per_layer: Dict[str, np.ndarray] = field(default_factory=dict)
    diffs: List[TensorDiff] = field(default_factory=list)

    def histogram(self, tensor: Optional[str] = None, layer: Optional[str] = None
                  ) -> Dict[str, int]:
        """Bin label -> count for one tensor, one layer (``"3"``, ``"-"``), or overall."""
        if tensor is not None:
            i = [r["tensor"] for r in self.rows].index(tensor)
            c = self.counts[i]
        elif layer is not None:
            c = self.per_layer[str(layer)]
        else:
            c = self.overall
        return dict(zip(self.labels, (int(v) for v in c)))

    def plot(self, level: str = "overall", tensor: Optional[str] = None, ax=None):
        """``overall``: histogram bars; ``layers``: layer x bin heatmap (fraction of
        elements, log colour); ``tensor=name``: that tensor's histogram."""
        if tensor is not None:
            series = {tensor: list(self.histogram(tensor).values())}
            return plots.histogram_bars(self.labels, series,
                                        title=f"ulp distances: {tensor}", ax=ax)
        if level == "layers":
            keys = sorted(self.per_layer, key=lambda k: (k != "-", int(k) if k != "-" else 0))
            m = np.array([self.per_layer[k] / max(1, self.per_layer[k].sum()) for k in keys])
            return plots.value_heatmap(keys, self.labels, m, title=self.title,
                                       cbar="fraction of elements", ax=ax, log=True)
        return plots.histogram_bars(self.labels, {"all tensors": self.overall},
                                    title=self.title, ax=ax)

    figure = plot


def ulp_report(title: str, diffs: Sequence[TensorDiff], labels: Sequence[str],
               summary: Dict[str, Any]) -> UlpReport:
    """The :class:`UlpReport` of a list of diffs (``labels``: their histogram bins)."""
    labels = list(labels)
    rows: List[Dict[str, Any]] = []
    counts = np.zeros((len(diffs), len(labels)), np.int64)
    per_layer: Dict[str, np.ndarray] = {}
    flagged = []
    for i, d in enumerate(diffs):
        layer, kind, _, _ = split_name(d.name)
        if d.counts is not None:
            counts[i] = d.counts
            key = "-" if layer is None else str(layer)
            per_layer[key] = per_layer.get(key, 0) + d.counts
        rows.append({"tensor": d.name, "layer": layer, "kind": kind,
                     "dtype": d.dtype_a if d.dtype_a == d.dtype_b else
                     f"{d.dtype_a}/{d.dtype_b}", "status": d.status, "elements": d.elements,
                     "differing": d.differing, **scale_row(d), "max_ulp": d.max_ulp,
                     "mean_ulp": d.mean_ulp, "nan_mismatch": d.nan_mismatch,
                     "hist": hist_text(labels, d.counts)})
        if d.status != "equal":
            flagged.append(i)
    overall = counts.sum(axis=0)
    ulps = [d.max_ulp for d in diffs if d.max_ulp is not None]
    summary = dict(summary)
    summary.update(scale_summary(diffs))
    summary.update({
        "tensors": len(diffs),
        "elements": int(sum(d.elements for d in diffs)),
        "differing": int(sum(d.differing for d in diffs)),
        "max ulp": max(ulps) if ulps else None,
        "histogram": hist_text(labels, overall, top=6),
    })
    return UlpReport(title=title, rows=rows, summary=summary, flagged=flagged,
                     columns=["tensor", "dtype", "status", "elements", "differing", "rel_err",
                              "max_ulp_typ", "near_zero", "max_ulp", "mean_ulp", "hist"],
                     labels=labels, counts=counts, overall=overall, per_layer=per_layer,
                     diffs=list(diffs))


def _as_bits(x: Any, fmt: Optional[str]) -> Tuple[np.ndarray, str]:
    """Storage bits and safetensors code of an array (numpy, mx, or bits with fmt)."""
    if type(x).__module__.startswith("mlx"):
        raw, code = mx_to_raw(x)
        return np.asarray(raw), code
    arr = np.asarray(x)
    if fmt is not None:
        f = nm.float_format(fmt)
        return nm.to_storage(arr, f) if arr.dtype.kind == "f" else arr.view(f.storage), \
            f.safetensors
    if arr.dtype.kind == "f" or arr.dtype.name == "bfloat16":
        f = nm.float_format(arr.dtype)
        return arr.view(f.storage), f.safetensors
    raise FormatError("cannot tell the float format of an integer array", found=str(arr.dtype),
                      hint="pass fmt='bf16' (or f16, f32) for storage bits")


def ulp_tensors(a: Any, b: Any, fmt: Optional[str] = None, *, name: str = "tensor",
                max_bin: int = DEFAULT_MAX_BIN) -> UlpReport:
    """Ulp distance histogram between two tensors of one format.

    Args:
        a, b: numpy float arrays (float16/float32), mlx arrays, or storage bits
            (uint16/uint32) together with ``fmt``.
        fmt: the format (``"bf16"``, ``"f16"``, ``"f32"``) when passing bits.
    """
    xa, ca = _as_bits(a, fmt)
    xb, cb = _as_bits(b, fmt)
    if ca != cb or xa.shape != xb.shape:
        raise FormatError("tensors differ in format or shape", tensor=name,
                          expected=f"{ca}{list(xa.shape)}", found=f"{cb}{list(xb.shape)}")
    st = bits_dtype(ca)
    acc = Accumulator(ca, max_bin, scale=TensorScale.of(xa.view(st), ca, scale_kernel()))
    for x, y, _ in pieces_in_memory(xa.view(st), xb.view(st), CHUNK_BYTES // 2):
        acc.add(x, y)
    td = acc.result(TensorDiff(name, "", ca, cb, xa.shape, xb.shape))
    return ulp_report(f"ulp distances ({ca})", [td], bin_labels(max_bin), {})
