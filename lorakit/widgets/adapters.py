"""AdapterCompare: two adapters of one base side by side
(:func:`lorakit.inspect.compare_adapters`'s figures and per-module table)."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional

import ipywidgets as W

from ..errors import ArgumentError, PathLike
from ..inspect.adapters import AdapterComparison, compare_adapters
from ._base import ErrorBox, FigureView, button, choice, hook, htmls, rows_html, summary_html

__all__ = ["AdapterCompare"]
VIEWS = (("delta norms", "norms"), ("cosine", "cosine"), ("column overlap", "col_overlap"),
         ("row overlap", "row_overlap"))


class AdapterCompare(W.VBox):
    """Delta norms, cosine similarity and subspace overlap of two adapters, chosen among
    ``adapters`` (label -> directory); ``base`` makes norms relative to ``||W||``;
    ``report`` is the last :class:`AdapterComparison`."""

    def __init__(self, adapters: Mapping[str, PathLike], *, a: Optional[str] = None,
                 b: Optional[str] = None, base: Optional[PathLike] = None,
                 compare: bool = True) -> None:
        self.adapters = {k: Path(v) for k, v in adapters.items()}
        labels = list(self.adapters)
        if len(labels) < 2:
            raise ArgumentError.bad("adapters", labels, "at least two adapters")
        self.base = Path(base) if base is not None else None
        self.report: Optional[AdapterComparison] = None
        style = {"description_width": "4em"}
        self.a = choice("adapters-a", "A", labels, value=a or labels[0], style=style)
        self.b = choice("adapters-b", "B", labels, value=b or labels[1], style=style)
        self.button = button("adapters-compare", "Compare")
        self.view = choice("adapters-view", "show", VIEWS, W.ToggleButtons, value="norms",
                           style=style)
        self.summary, self.table = htmls("adapters", "summary", "table")
        self.figure = FigureView("adapters-figure")
        self.error = ErrorBox("adapters-error")
        details = W.Accordion([self.table], titles=("per-module table",), selected_index=None)
        self.button.on_click(lambda _b: self.compare())
        self.view.observe(lambda _c: self.redraw(), names="value")
        row = W.HBox([self.a, self.b, self.button])
        super().__init__([row, self.error, self.summary, self.view, self.figure, details])
        hook(self, "adapter-compare")
        if compare:
            self.compare()

    def compare(self) -> Optional[AdapterComparison]:
        """Compare the chosen adapters (what the button does)."""
        a, b = self.adapters[self.a.value], self.adapters[self.b.value]
        rep = self.error.attempt(lambda: compare_adapters(a, b, self.base))
        if rep is None:
            return None
        self.report = rep
        self.summary.value = summary_html(rep)
        # the rows alone: the summary is shown above, once; the accordion is the one expander
        self.table.value = rows_html(rep.rows, rep.cols(), set(rep.flagged), rep.column_help)
        self.redraw()
        return rep

    def redraw(self) -> None:
        if self.report is not None:
            self.figure.show(self.report.plot(self.view.value))
