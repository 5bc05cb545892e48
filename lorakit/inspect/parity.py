"""Parity of two checkpoints: are they the same, and where and by how much not?

The question after a fuse is usually "does lorakit's output equal ``mlx_lm
fuse``'s (or PEFT's, or yesterday's)?". :func:`parity` answers with one table:
first what matters for behaviour, the relative error ``rms(A - B) / rms(A)`` and the
largest ulp distance at typical magnitudes, then elements compared and differing,
those near zero (where ulp distances are huge and mean little: see
:mod:`lorakit.inspect.ulp_scale`), the largest ulp and absolute difference, per
tensor and in total, plus every dtype or shape mismatch and every tensor present
on one side only. It streams both checkpoints (see
:func:`lorakit.inspect.ulp_stream.compare_sources`): memory stays bounded and
identical bytes are skipped at ``memcmp`` speed.

:func:`ulp_compare` is the same comparison seen as ulp histograms: it runs
:func:`parity` and returns :meth:`ParityReport.ulp_report`.

``lorakit diff A B [--json]`` prints the same report.

>>> parity("data/tiny-qwen3", "data/tiny-qwen3").identical
True
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .._progress import Progress
from . import plots
from ..io.source import open_source
from .report import Report
from .ulp_accumulate import DEFAULT_MAX_BIN, TensorDiff, bin_labels
from .ulp_report import UlpReport, scale_row, scale_summary, ulp_report
from .ulp_stream import compare_sources

__all__ = ["ParityReport", "parity", "ulp_compare"]


@dataclass(repr=False)
class ParityReport(Report):
    """Rows: tensor, status, dtype, shape, elements, differing, frac, max_ulp, max_abs.

    ``identical`` is True when every tensor matches bit for bit and both sides hold
    the same names. ``labels`` / ``overall``: the ulp histogram over all tensors
    compared as same-dtype floats; ``diffs``: the per-tensor :class:`TensorDiff`;
    ``sources``: the labels of A and B.
    """

    column_help = {
        "tensor": "the tensor's name",
        "status": "equal (bit for bit), differs, or a mismatch of name, dtype or shape",
        "dtype": "stored dtype (A/B when they differ)",
        "shape": "the tensor's shape",
        "elements": "number of elements compared",
        "differing": "elements whose bits differ",
        "frac": "differing / elements",
        "max_ulp": "largest distance in units in the last place (ulp) of the dtype",
        "max_abs": "largest absolute difference |A - B|",
        "rel_err": "rms(A - B) / rms(A): the error at the tensor's own scale (what behaviour feels)",
        "max_ulp_typ": "largest ulp distance among elements of typical magnitude (>= the tensor's rms, "
                       "rounded down to a power of two)",
        "near_zero": "differing elements below 2^-10 of the tensor's scale: their ulps are tiny, "
                     "so large ulp distances there mean little",
    }

    identical: bool = False
    labels: List[str] = field(default_factory=list)
    overall: Optional[np.ndarray] = None
    diffs: List[TensorDiff] = field(default_factory=list)
    sources: Tuple[str, str] = ("A", "B")

    def differing(self) -> List[str]:
        """Names of the tensors that are not bit-identical (or one-sided)."""
        return [r["tensor"] for r in self.rows if r["status"] != "equal"]

    def ulp_report(self) -> UlpReport:
        """The same comparison as ulp histograms per tensor, per layer and overall."""
        return ulp_report(f"ulp distances {self.sources[0]} vs {self.sources[1]}", self.diffs,
                          self.labels, {"A": self.summary["A"], "B": self.summary["B"]})

    def plot(self, ax=None, kind: str = "tensors"):
        """``tensors``: fraction of differing elements per non-identical tensor;
        ``histogram``: the overall ulp histogram."""
        if kind == "histogram":
            return plots.histogram_bars(self.labels, {"all tensors": self.overall},
                                        title=self.title, ax=ax)
        rows = [r for r in self.rows if r["status"] == "differs"]
        return plots.grouped_bars([r["tensor"] for r in rows],
                                  {"differing fraction": [r["frac"] for r in rows]},
                                  title=self.title, ylabel="elements differing", ax=ax,
                                  log=True)

    figure = plot


def parity(a: Any, b: Any, *, max_bin: int = DEFAULT_MAX_BIN,
           names: Optional[Sequence[str]] = None, threads: Optional[int] = None,
           progress: Progress = True) -> ParityReport:
    """Compare two checkpoints (or adapters, files, in-memory models) tensor by tensor.

    Args:
        a, b: anything :func:`~lorakit.io.source.open_source` accepts.
        max_bin: top ulp histogram bin.
        names: restrict to these tensors.
        threads: pieces compared in parallel (default ``min(4, cpu_count)``).
        progress: a progress bar (tqdm.auto; none when stderr is not a terminal), or a
            callable ``progress(done_bytes, total_bytes)``; False for neither.

    Returns:
        A :class:`ParityReport`; ``.identical`` says whether A and B are bit-identical.
        Float tensors of the same dtype get exact ulp distances; tensors whose dtypes
        differ (a float32 "fused" weight against a bfloat16 one) are compared by value
        and listed as ``dtype mismatch``; integer tensors (packed quantized weights)
        by equality.
    """
    sa, sb = open_source(a), open_source(b)
    diffs = compare_sources(sa, sb, max_bin=max_bin, names=names, threads=threads,
                            progress=progress)
    labels = bin_labels(max_bin)
    overall = np.zeros(len(labels), np.int64)
    rows: List[Dict[str, Any]] = []
    flagged: List[int] = []
    for i, d in enumerate(diffs):
        if d.counts is not None:
            overall += d.counts
        shape = d.shape_a if d.shape_a is not None else d.shape_b
        if d.shape_a is not None and d.shape_b is not None and d.shape_a != d.shape_b:
            shape_s = f"{list(d.shape_a)} vs {list(d.shape_b)}"
        else:
            shape_s = str(list(shape)) if shape is not None else ""
        rows.append({
            "tensor": d.name, "status": d.status,
            "dtype": d.dtype_a if d.dtype_a == d.dtype_b else f"{d.dtype_a} vs {d.dtype_b}",
            "shape": shape_s, "elements": d.elements, "differing": d.differing,
            "frac": d.differing / d.elements if d.elements else None,
            **scale_row(d), "max_ulp": d.max_ulp, "max_abs": d.max_abs,
            "nan_mismatch": d.nan_mismatch,
        })
        if d.status != "equal":
            flagged.append(i)
    by_status: Dict[str, List[str]] = {}
    for d in diffs:
        by_status.setdefault(d.status, []).append(d.name)
    ulps = [d.max_ulp for d in diffs if d.max_ulp is not None]
    abss = [d.max_abs for d in diffs if d.max_abs is not None]
    elements = int(sum(d.elements for d in diffs))
    differing = int(sum(d.differing for d in diffs))
    identical = not flagged
    summary: Dict[str, Any] = {
        "A": str(sa.path or sa.label), "B": str(sb.path or sb.label),
        "identical": identical,
        **scale_summary(diffs),
        "tensors": len(diffs),
        "tensors differing": len(by_status.get("differs", [])),
        "elements compared": elements,
        "elements differing": differing,
        "fraction differing": differing / elements if elements else 0.0,
        "max ulp": max(ulps) if ulps else None,
        "max abs": max(abss) if abss else None,
    }
    for status, key in (("dtype mismatch", "dtype mismatches"), ("shape mismatch",
                        "shape mismatches"), ("only in A", "only in A"),
                        ("only in B", "only in B")):
        if by_status.get(status):
            summary[key] = len(by_status[status])
    nan = sum(d.nan_mismatch for d in diffs)
    if nan:
        summary["NaN mismatches"] = nan
    verdict = "identical" if identical else f"{len(flagged)} of {len(diffs)} tensors differ"
    rel = summary.get("relative error, rms(A - B) / rms(A)")
    if rel is not None:  # the figure that matters for behaviour leads the one-line verdict
        verdict += (f", relative error {rel:.2g}, at most "
                    f"{summary['max ulp at typical magnitudes (|a|, |b| >= rms(A))']} ulp at "
                    "typical magnitudes")
    return ParityReport(title=f"parity {sa.label} vs {sb.label}: {verdict}", rows=rows,
                        columns=["tensor", "status", "dtype", "shape", "elements", "differing",
                                 "frac", "rel_err", "max_ulp_typ", "near_zero", "max_ulp",
                                 "max_abs"],
                        summary=summary, flagged=flagged, identical=identical, labels=labels,
                        overall=overall, diffs=diffs, sources=(sa.label, sb.label))


def ulp_compare(a: Any, b: Any, *, max_bin: int = DEFAULT_MAX_BIN,
                names: Optional[Sequence[str]] = None, threads: Optional[int] = None,
                progress: Progress = True) -> UlpReport:
    """Ulp histograms between two checkpoints (or adapters, files, in-memory models).

    The comparison of :func:`parity` (same arguments), reported as histograms:
    ``parity(a, b).ulp_report()``. Streams tensor by tensor in pieces of about a MB,
    so memory stays bounded whatever the checkpoints' size. Tensors of different
    dtypes or shapes are listed with that status (see :func:`parity` for a verdict).

    >>> # ulp_compare("fused-lorakit", "fused-mlx-lm").plot()
    """
    return parity(a, b, max_bin=max_bin, names=names, threads=threads,
                  progress=progress).ulp_report()
