"""AdapterCompare: two adapters of one base side by side
(:func:`lorakit.inspect.compare_adapters`'s figures and per-module table).

>>> from lorakit.widgets import AdapterCompare
>>> w = AdapterCompare({"lora": "data/adapters/lora", "dora": "data/adapters/dora"},
...                    base="data/tiny-qwen3")
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional

import ipywidgets as W

from ..errors import ArgumentError, PathLike
from ..inspect.adapters import AdapterComparison, compare_adapters
from ._base import ErrorBox, FigureView, hook, summary_html

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
        self.a = hook(W.Dropdown(options=labels, value=a or labels[0], description="A",
                                 style=style), "adapters-a")
        self.b = hook(W.Dropdown(options=labels, value=b or labels[1], description="B",
                                 style=style), "adapters-b")
        self.button = hook(W.Button(description="Compare", button_style="primary"),
                           "adapters-compare")
        self.view = hook(W.ToggleButtons(options=list(VIEWS), value="norms",
                                         description="show", style=style), "adapters-view")
        self.summary = hook(W.HTML(""), "adapters-summary")
        self.figure = FigureView("adapters-figure")
        self.table = hook(W.HTML(""), "adapters-table")
        self.error = ErrorBox("adapters-error")
        details = W.Accordion([self.table])
        details.set_title(0, "per-module table")
        details.selected_index = None
        self.button.on_click(lambda _b: self.compare())
        self.view.observe(lambda _c: self.redraw(), names="value")
        super().__init__([W.HBox([self.a, self.b, self.button]), self.error, self.summary,
                          self.view, self.figure, details])
        hook(self, "adapter-compare")
        if compare:
            self.compare()

    def compare(self) -> Optional[AdapterComparison]:
        """Compare the chosen adapters (what the button does)."""
        self.error.show(None)
        try:
            rep = compare_adapters(self.adapters[self.a.value], self.adapters[self.b.value],
                                   self.base)
        except Exception as e:  # shown in the widget
            self.error.show(e)
            return None
        self.report = rep
        self.summary.value = summary_html(rep)
        self.table.value = rep._repr_html_()
        self.redraw()
        return rep

    def redraw(self) -> None:
        if self.report is not None:
            self.figure.show(self.report.plot(self.view.value))
