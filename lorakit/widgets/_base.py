"""Pieces every lorakit widget shares: figure images, report HTML, error display,
test hooks.

Figures are shown as PNG bytes in an ``ipywidgets.Image`` rather than through an
``Output`` widget: the bytes are widget state, so a handler run outside a kernel (a
test) or from a background thread (``DecodeRace``) updates them the same way as a
click in JupyterLab, and the widget keeps the matplotlib ``Figure`` for anyone who
wants to look closer (``widget.figure``).
"""
from __future__ import annotations

import html
import io
from typing import Any, Dict, Optional

import ipywidgets as W

from ..inspect.report import Report, _fmt

#: Prefix of the CSS classes that tests select on (``widget.add_class("t-...")``).
HOOK = "t-"


def hook(widget: W.DOMWidget, name: str) -> W.DOMWidget:
    """Tag ``widget`` with the test-hook class ``t-<name>`` and return it."""
    widget.add_class(HOOK + name)
    return widget


def figure_png(fig: Any, dpi: int = 96) -> bytes:
    """A matplotlib Figure as PNG bytes (works with pyplot-free ``Figure`` objects)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


class FigureView(W.Image):
    """An image widget showing one matplotlib Figure; ``.figure`` keeps the Figure."""

    def __init__(self, name: str, **kw: Any) -> None:
        super().__init__(format="png", layout=W.Layout(max_width="100%", height="auto"), **kw)
        self.figure: Optional[Any] = None
        hook(self, name)

    def show(self, fig: Any) -> None:
        self.figure = fig
        self.value = figure_png(fig) if fig is not None else b""
        self.layout.display = None if fig is not None else "none"

    def clear(self) -> None:
        self.show(None)


def summary_html(report: Report, title: bool = True) -> str:
    """A report's title and summary facts as a small HTML table (no rows)."""
    e = html.escape
    head = f"<b>{e(report.title)}</b>" if title else ""
    body = "".join(f"<tr><th style='text-align:left;padding-right:1em'>{e(str(k))}</th>"
                   f"<td style='text-align:left'>{e(_fmt(v))}</td></tr>"
                   for k, v in report.summary.items())
    return f"<div class='lorakit-summary'>{head}<table>{body}</table></div>"


def rows_html(rows: list, columns: list, flagged: Optional[set] = None) -> str:
    """Rows (dicts) as an HTML table with the given columns; flagged rows shaded."""
    e = html.escape
    flagged = flagged or set()
    head = "".join(f"<th>{e(c)}</th>" for c in columns)
    body = "".join(
        ("<tr style='background:#fdd'>" if i in flagged else "<tr>")
        + "".join(f"<td>{e(_fmt(r.get(c, '')))}</td>" for c in columns) + "</tr>"
        for i, r in enumerate(rows))
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def error_html(exc: BaseException) -> str:
    """A user-facing error: lorakit's own errors carry file, tensor and a hint."""
    return (f"<div style='color:#a00;white-space:pre-wrap'><b>{html.escape(type(exc).__name__)}"
            f"</b>: {html.escape(str(exc))}</div>")


def facts_html(facts: Dict[str, Any]) -> str:
    e = html.escape
    return "<table>" + "".join(
        f"<tr><th style='text-align:left;padding-right:1em'>{e(str(k))}</th>"
        f"<td style='text-align:left'>{e(_fmt(v))}</td></tr>" for k, v in facts.items()
    ) + "</table>"


class ErrorBox(W.HTML):
    """Shows the last error of a widget's action, or nothing."""

    def __init__(self, name: str) -> None:
        super().__init__("")
        hook(self, name)
        self.layout.display = "none"

    def show(self, exc: Optional[BaseException]) -> None:
        self.value = error_html(exc) if exc is not None else ""
        self.layout.display = None if exc is not None else "none"
