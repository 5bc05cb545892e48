"""Report objects (what every inspection helper returns) and the one HTML table builder
behind every report, widget and result view.

A report holds its raw ``rows``, renders as HTML in notebooks, as aligned text in
terminals (``str()``, the text twin) and as JSON (``to_dict()`` / ``to_json()``). Cells
are escaped here, once: content is text unless it is :class:`Markup`. Standard library
only."""
from __future__ import annotations

import html
import json
import math
import sys
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from .layers import model_order

__all__ = ["Markup", "Cell", "escape", "table", "facts_table", "head_cells", "LEFT", "FLAGGED"]


def _numpy() -> Any:
    """numpy if something loaded it, else None (a report of headers alone never loads it)."""
    return sys.modules.get("numpy")


def format_value(v: Any) -> str:
    """A cell's text: floats to 4 significant digits, integers with thousands
    separators (byte counts read at a glance)."""
    np = _numpy()
    if isinstance(v, int) and not isinstance(v, bool) or np is not None and isinstance(
            v, np.integer):
        return f"{int(v):,}"
    if isinstance(v, float) or np is not None and isinstance(v, np.floating):
        v = float(v)
        if math.isnan(v):
            return "nan"
        if v == 0:
            return "0"
        if abs(v) >= 1e4 or abs(v) < 1e-3:
            return f"{v:.3e}"
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(format_value(x) for x in v) + "]"
    return str(v)


def jsonable(v: Any) -> Any:
    np = _numpy()
    if np is not None and isinstance(v, np.ndarray):
        return v.tolist()
    if np is not None and isinstance(v, np.integer):
        return int(v)
    if np is not None and isinstance(v, np.floating):
        v = float(v)
    if isinstance(v, float) and math.isnan(v):
        return None
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if hasattr(v, "__fspath__"):
        return str(v)
    return v


@dataclass
class Report:
    """A table of results: a ``title``, ``summary`` facts shown above the table, raw
    ``rows`` (one dict each), the ``columns`` shown (default: the first row's keys),
    ``flagged`` row indices to highlight and ``max_rows`` shown before eliding. The class
    attribute ``column_help`` explains each column (hover text in HTML, a legend in text)."""

    column_help: ClassVar[Dict[str, str]] = {}

    title: str
    rows: List[Dict[str, Any]] = field(default_factory=list)
    columns: Optional[Sequence[str]] = None
    summary: Dict[str, Any] = field(default_factory=dict)
    flagged: List[int] = field(default_factory=list)
    max_rows: int = 60

    # -- raw data ------------------------------------------------------------------------
    def cols(self) -> List[str]:
        if self.columns is not None:
            return list(self.columns)
        return list(self.rows[0].keys()) if self.rows else []

    def column(self, key: str) -> List[Any]:
        return [r.get(key) for r in self.rows]

    def to_dict(self) -> Dict[str, Any]:
        return jsonable({k: getattr(self, k) for k in ("title", "summary", "rows", "flagged")})

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **kw)

    def figure(self, *args: Any, **kw: Any):
        """The same as ``plot()`` (reports that draw one)."""
        return self.plot(*args, **kw)  # type: ignore[attr-defined]

    def to_dataframe(self):  # pragma: no cover - pandas is optional
        import pandas as pd  # lazy: pandas is optional

        return pd.DataFrame(self.rows)

    # -- display order -------------------------------------------------------------------
    def _order(self) -> List[int]:
        """Row indices in display order: model order when rows name tensors or modules."""
        key = next((c for c in ("tensor", "module") if c in self.cols()), None)
        if key is None:
            return list(range(len(self.rows)))
        return model_order([str(r.get(key) or "") for r in self.rows])

    def _shown(self) -> List[Tuple[int, int]]:
        """(position, row index) of the rows shown: the first ``max_rows``, then flagged rows
        beyond them (up to ``max_rows`` more)."""
        flag = set(self.flagged)
        shown = []
        for pos, i in enumerate(self._order()):
            if pos < self.max_rows or (i in flag and len(shown) < 2 * self.max_rows):
                shown.append((pos, i))
        return shown

    def _walk(self) -> Iterable[Tuple[str, int]]:
        """The shown rows in display order: ("row", index), ("gap", rows elided) between
        them and ("more", rows elided) at the end."""
        prev = -1
        for pos, i in self._shown():
            if pos != prev + 1:
                yield "gap", pos - prev - 1
            yield "row", i
            prev = pos
        if prev != len(self.rows) - 1:
            yield "more", len(self.rows) - 1 - prev

    # -- text twin -----------------------------------------------------------------------
    def __str__(self) -> str:
        lines = [self.title] + [f"  {k}: {format_value(v)}" for k, v in self.summary.items()]
        cols = self.cols()
        if cols and self.rows:
            n, flag, walk = len(self.rows), set(self.flagged), list(self._walk())
            cells = {i: [format_value(self.rows[i].get(c, "")) for c in cols]
                     for kind, i in walk if kind == "row"}
            widths = [max([len(c)] + [len(r[j]) for r in cells.values()])
                      for j, c in enumerate(cols)]
            lines += ["", "  " + "  ".join(h.ljust(w) for h, w in zip(cols, widths))]
            for kind, i in walk:
                if kind == "row":
                    text = "  ".join(c.ljust(w) for c, w in zip(cells[i], widths)).rstrip()
                    lines.append(("! " if i in flag else "  ") + text)
                else:
                    lines.append(f"  ... {i} {'more ' if kind == 'more' else ''}rows ...")
            if len(cells) < n:
                lines.append(f"  ({n - len(cells)} of {n} rows not shown: raise max_rows, "
                             "or --max-rows in the CLI)")
            legend = [(c, self.column_help[c]) for c in cols if self.column_help.get(c)]
            if legend:
                w = max(len(c) for c, _ in legend)
                lines += ["", "  columns:"] + [f"    {c.ljust(w)}  {h}" for c, h in legend]
        return "\n".join(lines)

    def __repr__(self) -> str:  # cheap
        return f"<{type(self).__name__}: {self.title} ({len(self.rows)} rows)>"

    # -- notebook view -------------------------------------------------------------------
    def _repr_html_(self) -> str:
        parts = [f"<div class='lorakit-report'><b>{escape(self.title)}</b>"]
        if self.summary:
            parts.append(facts_table((k, format_value(v)) for k, v in self.summary.items()))
        cols = self.cols()
        if cols and self.rows:
            flag = set(self.flagged)
            body: List[List[Any]] = []
            styles: Dict[int, str] = {}
            for kind, i in self._walk():
                if kind == "row":
                    styles.update({len(body): FLAGGED} if i in flag else {})
                    body.append([format_value(self.rows[i].get(c, "")) for c in cols])
                else:
                    more = " more rows (raise <code>max_rows</code> to show them)"
                    text = Markup(f"&hellip; {i}" + (more if kind == "more" else " rows"))
                    body.append([Cell(text, colspan=len(cols))])
            head = head_cells(cols, type(self).column_help)
            summary = f"{len(self.rows)} rows" + (f", {len(flag)} flagged" if flag else "")
            # a wide table scrolls sideways in its own box rather than squeezing columns
            wide = f"<div style='overflow-x:auto'>{table(body, head=head, row_styles=styles)}</div>"
            parts.append(collapsible(summary, wide, len(self.rows)))
        parts.append("</div>")
        return "".join(parts)


# -- the HTML table builder ---------------------------------------------------

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


#: style added to a plain-text cell of words longer than LONG_TEXT characters: a sentence
#: keeps a readable width (the table scrolls sideways instead of squeezing it a word per line)
LONG_STYLE, LONG_TEXT = "min-width:16em", 24


def _cell(c: CellLike, header: bool = False) -> str:
    if not isinstance(c, Cell):
        c = Cell(c, header=header)
    tag = "th" if c.header else "td"
    style = c.style
    text = str(c.content)
    if (not c.header and not isinstance(c.content, Markup) and c.colspan == 1
            and len(text) > LONG_TEXT and " " in text):
        style = ";".join(x for x in (style, LONG_STYLE) if x)
    attrs = (f" colspan={c.colspan}" if c.colspan != 1 else "") + \
        (f" style='{style}'" if style else "") + \
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
