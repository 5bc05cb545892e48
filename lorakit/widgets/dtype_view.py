"""DtypeMapView: :func:`lorakit.inspect.dtype_map`'s report as a layers x kinds grid
coloured by dtype (hover a cell for its tensors, click for a table), with its heatmap."""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import ipywidgets as W

from ..inspect.dtypes import DtypeMap, dtype_map
from ..inspect.plots import dtype_color
from ..layers import kind_label
from ..report import escape
from ._base import ErrorBox, FigureView, hook, rows_html, summary_html

__all__ = ["DtypeMapView"]

DETAIL_COLUMNS = ["tensor", "dtype", "shape", "bytes", "flag"]


class DtypeMapView(W.VBox):
    """Per-layer dtype/bytes map of anything :func:`lorakit.inspect.dtype_map` accepts (or a
    ready ``DtypeMap``); ``part`` picks the tensor part shown (``"scales"`` of a quantized
    model). ``selected`` is the clicked ``(layer label, kind)``; ``cells`` its buttons."""

    def __init__(self, source: Any = None, part: str = "weight") -> None:
        self.part = part
        self.report: Optional[DtypeMap] = None
        self.selected: Optional[Tuple[str, str]] = None
        self.cells: dict = {}
        self.summary = hook(W.HTML(), "dtype-summary")
        self.grid = hook(W.GridBox(), "dtype-grid")
        self.detail = hook(W.HTML("<i>click a cell for its tensors</i>"), "dtype-detail")
        self.figure = FigureView("dtype-figure")
        self.error = ErrorBox("dtype-error")
        tabs = W.Tab([W.VBox([self.grid, self.detail]), self.figure],
                     titles=("map (hover, click)", "heatmap figure"))
        super().__init__([self.summary, tabs, self.error])
        hook(self, "dtype-map-view")
        if source is not None:
            self.show(source)

    def show(self, source: Any) -> Optional[DtypeMap]:
        """Inspect ``source`` (or show a ready DtypeMap) and redraw everything."""
        rep = self.error.attempt(
            lambda: source if isinstance(source, DtypeMap) else dtype_map(source))
        if rep is None:
            return None
        self.report = rep
        self.selected = None
        self.summary.value = summary_html(rep)
        self._build_grid(rep)
        self.detail.value = "<i>click a cell for its tensors</i>"
        self.figure.show(rep.plot(part=self.part))
        return rep

    def _build_grid(self, rep: DtypeMap) -> None:
        labels, kinds, cells = rep.grid(self.part)
        flags = rep.flag_grid(self.part)
        children: List[W.Widget] = [W.HTML("<b>layer</b>")]
        # a reader's label ("post-attn norm", not "norm_attn"), wrapped onto two lines
        # when the column is narrow; the hover names the kind as tables spell it
        children += [hook(W.HTML(f"<b title='{escape(k)}: {escape(kind_label(k))}' "
                                 f"style='font-size:80%;line-height:1.1;white-space:normal;"
                                 f"display:block'>{escape(kind_label(k))}</b>"), "dtype-head")
                     for k in kinds]
        self.cells = {}
        for lab, row, frow in zip(labels, cells, flags):
            children.append(W.HTML(lab))
            for kind, code, flag in zip(kinds, row, frow):
                b = W.Button(description=code, layout=W.Layout(width="auto", height="24px",
                                                             padding="0px"))
                b.style.button_color = dtype_color(code) if code else "#ffffff"
                b.style.text_color = "white" if code else "#999999"
                b.style.font_weight = "bold" if flag else ""
                b.tooltip = self._tooltip(lab, kind)
                if flag:
                    b.add_class("t-dtype-flagged")
                b.add_class("t-dtype-cell")
                b.on_click(lambda _b, key=(lab, kind): self.select(*key))
                self.cells[(lab, kind)] = b
                children.append(b)
        self.grid.children = children
        # a column is as wide as its header's longest word ("embedding"), so no header
        # runs into the next one
        cols = f"3em repeat({len(kinds)}, minmax(4.2em, min-content))"
        self.grid.layout = W.Layout(grid_template_columns=cols, grid_gap="2px")

    def rows_at(self, layer: str, kind: str) -> List[int]:
        """Indices of the report rows in grid cell (layer label, kind)."""
        assert self.report is not None
        return [i for i, r in enumerate(self.report.rows)
                if ("-" if r["layer"] is None else str(r["layer"])) == layer
                and r["kind"] == kind]

    def _tooltip(self, layer: str, kind: str) -> str:
        rep = self.report
        assert rep is not None
        lines = [f"{rep.rows[i]['tensor']}: {rep.rows[i]['dtype']} "
                 f"{'x'.join(map(str, rep.rows[i]['shape']))}, {rep.rows[i]['bytes']:,} B"
                 + (f"  [{rep.rows[i]['flag']}]" if rep.rows[i]["flag"] else "")
                 for i in self.rows_at(layer, kind)]
        return "\n".join(lines) or "no tensor"

    def select(self, layer: str, kind: str) -> None:
        """Show the tensors of one cell (what a click does)."""
        assert self.report is not None
        idx = self.rows_at(layer, kind)
        flagged = set(self.report.flagged)
        rows = [self.report.rows[i] for i in idx]
        self.selected = (layer, kind)
        self.detail.value = (f"<b>layer {layer}, {escape(kind_label(kind))}</b>"
                             + rows_html(rows, DETAIL_COLUMNS,
                                         {j for j, i in enumerate(idx) if i in flagged},
                                         DtypeMap.column_help))
