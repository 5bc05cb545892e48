"""A fused checkpoint against the exact fuse, in (fractional) ulps of its format.

:func:`ulp_vs_reference` measures each fused weight against ``W + scale * B @ A``
computed in float64 (the intended change of :func:`~lorakit.inspect.merge_check.intended_pieces`),
in ulps of the fused tensor's own format: a correctly rounded fuse is never above
0.5. :class:`RefUlpReport` holds the rows and the error histograms.

>>> error_histogram(np.array([0.0, 0.25, 0.5, 0.75, 3.0, np.nan]))[:6].tolist()
[1, 2, 1, 0, 1, 0]
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import math

import numpy as np

from .. import numerics as nm
from ..io.adapter import Adapter, load_adapter
from ..io.naming import bind, bindings_by_tensor
from . import plots
from ..io.source import open_source
from .merge_check import intended_pieces
from .report import Report
from .ulp_accumulate import hist_text
from .ulp_scale import NEAR_ZERO_LOG2

__all__ = ["RefUlpReport", "ulp_vs_reference", "error_histogram", "error_labels"]

_ERR_EDGES = np.array([0.5] + [2.0 ** k for k in range(0, 11)])


def error_labels() -> List[str]:
    """Bin labels of :func:`error_histogram`: ``0``, ``(0,0.5]``, ..., ``>1024``, ``nan``."""
    labs = ["0", "(0,0.5]"]
    prev = 0.5
    for e in _ERR_EDGES[1:]:
        labs.append(f"({prev:g},{e:g}]")
        prev = e
    return labs + [f">{prev:g}", "nan"]


def error_histogram(err: np.ndarray) -> np.ndarray:
    """Counts of fractional ulp errors in bins 0, (0,0.5], (0.5,1], (1,2], ..., >1024, nan."""
    e = np.asarray(err, np.float64).reshape(-1)
    nan = np.isnan(e)
    zero = e == 0
    idx = np.searchsorted(_ERR_EDGES, e[~nan & ~zero], side="left") + 1
    c = np.bincount(idx, minlength=len(_ERR_EDGES) + 2)
    c[0] = int(zero.sum())
    return np.concatenate([c, [int(nan.sum())]]).astype(np.int64)


@dataclass(repr=False)
class RefUlpReport(Report):
    """Ulp error of a fused checkpoint against the float64 fuse, per adapted tensor.

    ``rows``: tensor, dtype, elements, max_err, mean_err, not_nearest (elements more
    than 0.5 ulp off: not the correctly rounded value), hist. ``labels`` /
    ``counts`` / ``overall``: histograms of the error.
    """

    column_help = {
        "tensor": "the adapted tensor's name",
        "dtype": "stored dtype of the fused tensor",
        "status": "measured, or why not (missing in fused, quantized)",
        "elements": "number of elements measured",
        "max_err": "largest error in ulp against the exact (float64) fuse",
        "mean_err": "mean error in ulp against the exact fuse",
        "not_nearest": "elements more than 0.5 ulp off: not the correctly rounded value",
        "hist": "share of elements per error range in ulp (largest bins)",
        "rel_err": "rms(fused - exact) / rms(exact): the error at the tensor's own scale",
        "max_err_typ": "largest error in ulp among elements of typical magnitude",
    }

    labels: List[str] = field(default_factory=list)
    counts: Optional[np.ndarray] = None
    overall: Optional[np.ndarray] = None

    def plot(self, tensor: Optional[str] = None, ax=None):
        if tensor is not None:
            i = [r["tensor"] for r in self.rows].index(tensor)
            series = {tensor: self.counts[i]}
        else:
            series = {"all adapted tensors": self.overall}
        return plots.histogram_bars(self.labels, series, title=self.title, ax=ax,
                                    xlabel="|fused - exact| in ulps")

    figure = plot


class _RefScale:
    """The error at the tensor's scale: rms(F - T) / rms(T), and per binade of |T|
    the largest ulp error and the elements not correctly rounded, so that the error at
    typical magnitudes (|T| >= 2**floor(log2 rms(T))) and near zero can be told apart
    once rms(T) is known (see :mod:`lorakit.inspect.ulp_scale`)."""

    _LO = -200  # binade index offset: exponents of float64 |T| clipped to [-200, 200)

    def __init__(self) -> None:
        self.t2 = self.d2 = 0.0
        self.emax = np.zeros(400)
        self.bad = np.zeros(400, np.int64)

    def add(self, f: np.ndarray, t: np.ndarray, err: np.ndarray) -> None:
        ok = np.isfinite(f) & np.isfinite(t) & ~np.isnan(err)
        f, t, err = f[ok], t[ok], err[ok]
        self.t2 += float(np.dot(t, t))
        d = f - t
        self.d2 += float(np.dot(d, d))
        e = np.clip(np.frexp(np.abs(t))[1] - 1, self._LO, -self._LO - 1) - self._LO
        np.maximum.at(self.emax, e, err)
        self.bad += np.bincount(e[err > 0.5], minlength=self.emax.size)

    def finish(self) -> Dict[str, Any]:
        """Raw sums for the row (:func:`_finish_scale` turns them into figures)."""
        if not self.t2 > 0:
            return {}
        return {"_t2": self.t2, "_d2": self.d2, "_emax": self.emax, "_bad": self.bad}


def _finish_scale(row: Dict[str, Any]) -> None:
    """Turn a row's raw scale sums into its figures (rms(T) needs the element count)."""
    if "_t2" not in row:
        row.setdefault("rel_err", None)
        row.setdefault("max_err_typ", None)
        row.setdefault("not_nearest_near_zero", None)
        return
    t2, d2, emax, bad = (row.pop(k) for k in ("_t2", "_d2", "_emax", "_bad"))
    rms = math.sqrt(t2 / max(1, row["elements"]))
    ta = math.frexp(rms)[1] - 1 - _RefScale._LO
    tn = max(ta + NEAR_ZERO_LOG2, 0)
    row.update(rel_err=math.sqrt(d2 / t2), max_err_typ=float(emax[max(ta, 0):].max()),
               not_nearest_near_zero=int(bad[:tn].sum()), rms_t=rms, _t2=t2, _d2=d2)


def _scale_summary(measured: List[Dict[str, Any]]) -> Dict[str, Any]:
    rows = [r for r in measured if r.get("_t2")]
    if not rows:
        return {}
    t2, d2 = sum(r.pop("_t2") for r in rows), sum(r.pop("_d2") for r in rows)
    typ = max(r["max_err_typ"] for r in rows)
    top = max(r["max_err"] for r in rows)
    out: Dict[str, Any] = {
        "relative error, rms(F - T) / rms(T)": math.sqrt(d2 / t2),
        "max error at typical magnitudes (ulp, |T| >= rms(T))": typ,
        "not correctly rounded near zero (|T| < 2**-10 rms(T))":
            sum(r["not_nearest_near_zero"] for r in rows),
    }
    if top > max(1.0, 2 * typ):  # the max is not what typical elements see
        out["why max error is large"] = (
            f"the {top:.4g} ulp are at small values of the exact result, where ulps are "
            f"tiny; at typical magnitudes the largest error is {typ:.4g} ulp")
    return out


def ulp_vs_reference(fused: Any, base: Any, adapter: Any) -> RefUlpReport:
    """Ulp error of each fused weight against the exact ``W + scale * B @ A`` (float64).

    The error is measured with :func:`numerics.ulp_error_vs_reference` in ulps of
    the fused tensor's own format: <= 0.5 everywhere means correctly rounded.
    Quantized fused weights are listed but not measured (see :func:`merge_check`).

    >>> import lorakit
    >>> _ = lorakit.fuse("data/tiny-qwen3", "data/adapters/lora", "fused")
    >>> rep = ulp_vs_reference("fused", "data/tiny-qwen3", "data/adapters/lora")
    >>> round(rep.summary["max error (ulp)"], 6), rep.summary["not correctly rounded"]
    (0.5, 0)
    """
    sf, sb = open_source(fused), open_source(base)
    ad = adapter if isinstance(adapter, Adapter) else load_adapter(adapter)
    by_tensor = bindings_by_tensor(bind(ad, sb))
    labels = error_labels()
    rows: List[Dict[str, Any]] = []
    all_counts: List[np.ndarray] = []
    flagged: List[int] = []
    for tensor, binds in by_tensor.items():
        meta = sf.tensors.get(tensor)
        row: Dict[str, Any] = {"tensor": tensor, "dtype": meta.dtype if meta else None,
                               "elements": 0, "max_err": None, "mean_err": None,
                               "not_nearest": None, "hist": "", "status": "measured"}
        counts = np.zeros(len(labels), np.int64)
        module = tensor[: -len(".weight")]
        if meta is None:
            row["status"] = "missing in fused"
        elif meta.dtype not in ("BF16", "F16", "F32") or sf.quant_params(module) is not None:
            row["status"] = "quantized (not measured)"
        else:
            fmt = nm.float_format(meta.dtype)
            total, mx_err, bad = 0.0, 0.0, 0
            sc = _RefScale()
            for raw_f, _, target in intended_pieces(sf, sb, tensor, binds):
                err = nm.ulp_error_vs_reference(raw_f, target, fmt)
                counts += error_histogram(err)
                finite = err[~np.isnan(err)]
                if finite.size:
                    mx_err = max(mx_err, float(finite.max()))
                    total += float(finite.sum())
                bad += int((err > 0.5).sum())
                row["elements"] += err.size
                sc.add(nm.to_float64(raw_f, fmt).reshape(-1), target.reshape(-1),
                       err.reshape(-1))
            row.update(max_err=mx_err, mean_err=total / max(1, row["elements"]),
                       not_nearest=bad, hist=hist_text(labels, counts), **sc.finish())
        _finish_scale(row)
        if row["status"] != "measured" or (row["not_nearest"] or 0) > 0:
            flagged.append(len(rows))
        rows.append(row)
        all_counts.append(counts)
    counts_arr = np.array(all_counts) if all_counts else np.zeros((0, len(labels)), np.int64)
    overall = counts_arr.sum(axis=0)
    measured = [r for r in rows if r["status"] == "measured"]
    n = sum(r["elements"] for r in measured)
    summary = {
        "fused": str(sf.path or sf.label), "base": str(sb.path or sb.label),
        "adapter": str(ad.path), "tensors": len(rows), "elements": n,
        **_scale_summary(measured),
        "max error (ulp)": max((r["max_err"] for r in measured), default=None),
        "mean error (ulp)": (sum(r["mean_err"] * r["elements"] for r in measured) / n)
        if n else None,
        "not correctly rounded": sum(r["not_nearest"] for r in measured),
        "histogram": hist_text(labels, overall, top=6),
    }
    return RefUlpReport(title=f"ulp error of {sf.label} vs exact fuse", rows=rows,
                        columns=["tensor", "dtype", "status", "elements", "rel_err", "max_err_typ",
                                 "max_err", "mean_err", "not_nearest", "hist"],
                        summary=summary, flagged=flagged, labels=labels, counts=counts_arr,
                        overall=overall)
