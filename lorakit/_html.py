"""The one HTML table builder behind every report, widget and result view.

Cells are escaped here, once: a cell's content is text unless it is :class:`Markup`
(HTML that lorakit built itself, e.g. a highlighted token), so callers never call
``html.escape`` on table content. Standard library only: importing this costs nothing.

>>> facts_table([("a<b", 1)])
"<table><tr><th style='text-align:left'>a&lt;b</th><td style='text-align:left'>1</td></tr></table>"
>>> table([[Cell(Markup("<i>x</i>"), colspan=2)]], head=["n", "v"])
'<table><thead><tr><th>n</th><th>v</th></tr></thead><tbody><tr><td colspan=2><i>x</i></td></tr></tbody></table>'
"""
from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence, Tuple, Union

__all__ = ["Markup", "Cell", "escape", "table", "facts_table", "head_cells",
           "collapsible", "LEFT", "FLAGGED", "COLLAPSE_ROWS"]

#: style of left-aligned cells (key/value tables)
LEFT = "text-align:left"
#: style of a highlighted (flagged) row
FLAGGED = "background:#fdd"
#: tables with more rows than this start collapsed (a summary line to click open)
COLLAPSE_ROWS = 20


class Markup(str):
    """HTML that is already safe (built by lorakit): a cell shows it as it is."""


def escape(value: Any) -> str:
    """``str(value)`` escaped for HTML, unless it is :class:`Markup`."""
    return value if isinstance(value, Markup) else html.escape(str(value))


@dataclass(frozen=True)
class Cell:
    """One table cell: its content (text, escaped; or :class:`Markup`), ``<th>`` when
    ``header``, an inline ``style``, a ``colspan`` and a ``title`` (the hover text)."""

    content: Any
    header: bool = False
    style: str = ""
    colspan: int = 1
    title: str = ""


CellLike = Union[Cell, Any]


def _cell(c: CellLike, header: bool = False) -> str:
    if not isinstance(c, Cell):
        c = Cell(c, header=header)
    tag = "th" if c.header else "td"
    attrs = (f" colspan={c.colspan}" if c.colspan != 1 else "") + \
        (f" style='{c.style}'" if c.style else "") + \
        (f" title='{html.escape(c.title, quote=True)}'" if c.title else "")
    return f"<{tag}{attrs}>{escape(c.content)}</{tag}>"


def _row(cells: Sequence[CellLike], style: str = "", header: bool = False) -> str:
    open_tag = f"<tr style='{style}'>" if style else "<tr>"
    return open_tag + "".join(_cell(c, header) for c in cells) + "</tr>"


def table(rows: Iterable[Sequence[CellLike]], head: Optional[Sequence[CellLike]] = None,
          row_styles: Optional[Mapping[int, str]] = None) -> str:
    """An HTML table: ``rows`` of cells (plain values or :class:`Cell`), an optional
    header row (``<thead>``/``<tbody>`` then), ``row_styles``: row index -> style."""
    styles = row_styles or {}
    body = "".join(_row(r, styles.get(i, "")) for i, r in enumerate(rows))
    if head is None:
        return f"<table>{body}</table>"
    return (f"<table><thead>{_row(head, header=True)}</thead>"
            f"<tbody>{body}</tbody></table>")


def facts_table(facts: Iterable[Tuple[Any, Any]], key_style: str = LEFT,
                value_style: str = LEFT) -> str:
    """Key/value pairs as a two-column table (keys as ``<th>``), no header row."""
    return table([Cell(k, header=True, style=key_style), Cell(v, style=value_style)]
                 for k, v in facts)


def head_cells(columns: Sequence[str], help: Mapping[str, str]) -> list:
    """Header cells for ``columns``, each with its one-line explanation as hover text."""
    return [Cell(c, header=True, title=help.get(c, "")) for c in columns]


def collapsible(summary: str, inner: str, rows: int) -> str:
    """``inner`` under a ``<details>`` summary line; open unless ``rows`` > COLLAPSE_ROWS."""
    state = " open" if rows <= COLLAPSE_ROWS else ""
    hint = "" if state else " (click to show)"
    return f"<details{state}><summary>{escape(summary)}{hint}</summary>{inner}</details>"

