"""Pieces every lorakit widget shares: figure images, report HTML, error display, test
hooks. Figures are PNG bytes in an ``ipywidgets.Image`` (widget state, so a handler run
from a test or a background thread updates them as a click does)."""
from __future__ import annotations

import io
from typing import Any, Callable, Dict, List, Optional

import ipywidgets as W

from ..report import FLAGGED, LEFT, Report, escape, facts_table, format_value, head_cells, table

__all__ = []

#: Prefix of the CSS classes that tests select on (``widget.add_class("t-...")``).
HOOK = "t-"


def hook(widget: W.DOMWidget, name: str) -> W.DOMWidget:
    """Tag ``widget`` with the test-hook class ``t-<name>`` and return it."""
    widget.add_class(HOOK + name)
    return widget


def button(name: str, label: str, icon: str = "", style: str = "primary", **kw: Any) -> W.Button:
    """A button hooked ``t-<name>``."""
    return hook(W.Button(description=label, button_style=style, icon=icon, **kw), name)


def choice(name: str, label: str, options: Any, kind: type = W.Dropdown, **kw: Any) -> Any:
    """A dropdown (or another ``kind`` of selection widget) hooked ``t-<name>``."""
    return hook(kind(options=options, description=label, **kw), name)


def htmls(prefix: str, *names: str) -> List[W.HTML]:
    """Empty HTML outputs hooked ``t-<prefix>-<name>``, one per name."""
    return [hook(W.HTML(""), f"{prefix}-{n}") for n in names]


class FigureView(W.Image):
    """An image widget showing one matplotlib Figure; ``.figure`` keeps the Figure."""

    def __init__(self, name: str, **kw: Any) -> None:
        # its own size (flex-start: a box would stretch it to its width), never wider than
        # the cell: figures keep one scale across views
        super().__init__(format="png", layout=W.Layout(max_width="100%", height="auto",
                                                       align_self="flex-start"), **kw)
        self.figure: Optional[Any] = None
        hook(self, name)

    def show(self, fig: Any) -> None:
        self.figure, buf = fig, io.BytesIO()
        if fig is not None:
            fig.savefig(buf, format="png", dpi=96)
        self.value = buf.getvalue()
        self.layout.display = None if fig is not None else "none"

    def clear(self) -> None:
        self.show(None)


#: style of the key column in the widgets' key/value tables
KEY_STYLE = LEFT + ";padding-right:1em"


def summary_html(report: Report, title: bool = True) -> str:
    """A report's title and summary facts as a small HTML table (no rows)."""
    head = f"<b>{escape(report.title)}</b>" if title else ""
    return f"<div class='lorakit-summary'>{head}{facts_html(report.summary)}</div>"


def rows_html(rows: list, columns: list, flagged: Optional[set] = None,
              help: Optional[Dict[str, str]] = None) -> str:
    """Rows (dicts) as an HTML table of ``columns``, flagged rows shaded, ``help`` on hover."""
    return table([[format_value(r.get(c, "")) for c in columns] for r in rows],
                 head=head_cells(columns, help or {}),
                 row_styles={i: FLAGGED for i in flagged or ()})


def facts_html(facts: Dict[str, Any]) -> str:
    """Key/value facts (values formatted like report cells) as a two-column table."""
    return facts_table(((k, format_value(v)) for k, v in facts.items()), key_style=KEY_STYLE)


class ErrorBox(W.HTML):
    """Shows the last error of a widget's action, or nothing."""

    def __init__(self, name: str) -> None:
        super().__init__("")
        hook(self, name)
        self.layout.display = "none"

    def show(self, exc: Optional[BaseException]) -> None:
        # lorakit's own errors carry file, tensor and a hint in their text
        name = escape(type(exc).__name__)
        self.value = "" if exc is None else (
            f"<div style='color:#a00;white-space:pre-wrap'><b>{name}</b>: {escape(exc)}</div>")
        self.layout.display = None if exc is not None else "none"

    def attempt(self, action: Callable[[], Any], status: Optional[W.HTML] = None) -> Any:
        """``action()`` with this box cleared first; an exception is shown here (``status``
        then says "failed") and gives None: the user picks other inputs and retries."""
        self.show(None)
        try:
            return action()
        except Exception as e:
            if status is not None:
                status.value = "failed"
            self.show(e)
            return None
