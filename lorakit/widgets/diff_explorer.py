"""DiffExplorer: how far apart two checkpoints are, overall, per layer, per tensor: the
histograms and numbers of :func:`lorakit.diff` (or of ``ulp_vs_reference`` against the
exact float64 fuse)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, List, Mapping, Optional

import ipywidgets as W

from ..errors import ArgumentError, PathLike
from ..inspect.diff import UlpReport, diff, ulp_vs_reference
from ..inspect.plots import histogram_bars
from ..inspect.ulp_count import binades, bits_dtype
from ..io.formats import source
from ..report import Report
from ._base import ErrorBox, FigureView, button, choice, facts_html, htmls, rows_html, summary_html

__all__ = ["DiffExplorer"]
#: the B choice meaning "the exact fuse of base + adapter, in float64"
REFERENCE = "exact fuse (float64)"
VIEWS = ("overall", "layers", "layer", "tensor")
TENSOR_FACTS = tuple("""status dtype elements differing rel_err max_ulp_at_rms max_ulp_typ
    near_zero zero_one_side sign_changes rms_a max_ulp mean_ulp nan_mismatch max_err_typ max_err
    mean_err not_nearest not_nearest_near_zero hist""".split())


class DiffExplorer(W.VBox):
    """Ulp histograms of checkpoint A against B, chosen among ``checkpoints`` (label ->
    directory); with ``base`` and ``adapter``, B may be ``REFERENCE`` (the exact float64
    fuse). ``report`` is the last report; ``view`` / ``layer`` / ``tensor`` select what is
    drawn; ``compared`` counts comparisons."""

    def __init__(self, checkpoints: Mapping[str, PathLike], *, a: Optional[str] = None,
                 b: Optional[str] = None, base: Optional[PathLike] = None,
                 adapter: Optional[PathLike] = None, compare: bool = True) -> None:
        self.checkpoints = {k: Path(v) for k, v in checkpoints.items()}
        self.base = Path(base) if base is not None else None
        self.adapter = Path(adapter) if adapter is not None else None
        labels = list(self.checkpoints)
        b_labels = labels + ([REFERENCE] if self.base and self.adapter else [])
        if not labels:
            raise ArgumentError.bad("checkpoints", labels, "at least one checkpoint")
        self.report: Optional[Report] = None
        self.compared = 0
        self._quiet = False
        style = {"description_width": "5em"}
        self.a = choice("ulp-a", "A", labels, value=a or labels[0], style=style)
        default_b = b or (b_labels[1] if len(b_labels) > 1 else b_labels[0])
        self.b = choice("ulp-b", "B", b_labels, value=default_b, style=style)
        self.button = button("ulp-compare", "Compare", "balance-scale")
        self.view = choice("ulp-view", "show", VIEWS, W.ToggleButtons, value="overall", style=style)
        self.layer = choice("ulp-layer", "layer", [], style=style)
        self.tensor = choice("ulp-tensor", "tensor", [], style=style,
                               layout=W.Layout(width="34em"))
        self.status, self.summary, self.facts = htmls("ulp", "status", "summary", "facts")
        self.figure = FigureView("ulp-figure")
        self.error = ErrorBox("ulp-error")
        self.button.on_click(lambda _b: self.compare())
        self.view.observe(lambda _c: self.redraw(), names="value")
        self.layer.observe(self._on_layer, names="value")
        self.tensor.observe(lambda _c: self._on_tensor(), names="value")
        top = W.HBox([self.a, self.b, self.button, self.status])
        picks = W.HBox([self.layer, self.tensor])
        super().__init__([top, self.error, self.summary, self.view, picks, self.facts, self.figure])
        self.add_class("t-diff-explorer")
        if compare:
            self.compare()

    def compare(self) -> Optional[Report]:
        """Compare the chosen A and B (what the button does)."""
        self.status.value = "comparing..."
        rep = self.error.attempt(self._diff_now, self.status)
        if rep is None:
            return None
        self.report = rep
        self.compared += 1
        self.status.value = f"{self.a.value} vs {self.b.value}"
        self.summary.value = summary_html(rep)
        is_ulp = isinstance(rep, UlpReport)
        # against the exact fuse there is no per-layer histogram: only overall / tensor
        self.view.options = list(VIEWS) if is_ulp else ["overall", "tensor"]
        layers = sorted(rep.per_layer, key=_layer_key) if is_ulp else []
        self._quiet = True  # refill the selectors without a redraw per change
        try:
            self.layer.options = ["all"] + layers
            self.layer.value = "all"
            self.tensor.options = self._tensors("all")
            self.tensor.value = None
        finally:
            self._quiet = False
        self.redraw()
        return rep

    def _diff_now(self) -> Report:
        a, b = self.checkpoints[self.a.value], self.b.value
        if b == REFERENCE:
            return ulp_vs_reference(a, self.base, self.adapter)
        return diff(a, self.checkpoints[b]).ulp_report()

    def _tensors(self, layer: str) -> List[str]:
        assert self.report is not None
        return [r["tensor"] for r in self.report.rows
                if layer == "all" or _layer_label(r.get("layer")) == layer]

    def _on_layer(self, _change: Any = None) -> None:
        if self.report is None or self._quiet:
            return
        self.tensor.options = self._tensors(self.layer.value or "all")
        if self.view.value in ("overall", "layers") and self.layer.value != "all":
            self.view.value = "layer"  # picking a layer means: show that layer
        else:
            self.redraw()

    def _on_tensor(self) -> None:
        if self._quiet:
            return
        if self.report is not None and self.view.value != "tensor" and self.tensor.value:
            self.view.value = "tensor"
        else:
            self.redraw()

    def redraw(self) -> None:
        """Draw the current view of the current report."""
        rep = self.report
        if rep is None or self._quiet:
            return
        view = self.view.value
        if view == "layer" and self.layer.value == "all":
            view = "overall"
        if view == "tensor" and not self.tensor.value:
            view = "overall"
        if view in ("overall", "layers"):
            fig = rep.plot(level="layers") if view == "layers" else rep.plot()
            self.facts.value = ""
        elif view == "layer":
            assert isinstance(rep, UlpReport)
            lab = self.layer.value
            fig = histogram_bars(rep.labels, {f"layer {lab}": rep.per_layer[lab]},
                                 title=f"{rep.title}: layer {lab}")
            idx = [i for i, r in enumerate(rep.rows) if _layer_label(r.get("layer")) == lab]
            self.facts.value = rows_html([rep.rows[i] for i in idx],
                                         [c for c in rep.cols() if c != "hist"],
                                         {j for j, i in enumerate(idx) if i in set(rep.flagged)},
                                         type(rep).column_help)
        else:
            name = self.tensor.value
            row = next(r for r in rep.rows if r["tensor"] == name)
            if isinstance(rep, UlpReport):
                fig = histogram_bars(rep.labels, {name: list(rep.histogram(name).values())},
                                     title=f"ulp distances: {name}")
            else:
                fig = rep.plot(tensor=name)
            extra = ""
            if isinstance(rep, UlpReport) and self.b.value != REFERENCE:
                d = next((d for d in rep.diffs if d.name == name), None)
                extra = _by_magnitude(self.checkpoints[self.a.value],
                                      self.checkpoints[self.b.value], d)
            self.facts.value = f"<b>{name}</b>" + facts_html(
                {k: row[k] for k in TENSOR_FACTS if k in row}) + extra
        self.figure.show(fig)


def _by_magnitude(a: Path, b: Path, d: Any) -> str:
    """One tensor's differing elements by binade of min(|a|, |b|): how many, and their
    largest ulp distance (the large ones sit near zero, where steps are tiny)."""
    if d is None or not d.differing or d.counts is None:
        return ""
    sa, sb = source.open(a), source.open(b)
    st = bits_dtype(d.dtype_a)
    rows = [{"|a|, |b| from": 0.0 if e is None else 2.0 ** e, "differing": c, "max_ulp": m}
            for e, c, m in binades(sa.read(d.name).view(st), sb.read(d.name).view(st),
                                   d.dtype_a)]
    return ("<div class='lorakit-binades'><b>differing elements by magnitude</b>" +
            rows_html(rows, ["|a|, |b| from", "differing", "max_ulp"]) + "</div>")


def _layer_label(layer: Any) -> str:
    return "-" if layer is None else str(layer)


def _layer_key(label: str):
    return (label != "-", int(label) if label.lstrip("-").isdigit() and label != "-" else 0)
