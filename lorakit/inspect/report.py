"""Report objects: what every inspection helper returns.

A report holds its raw numbers (``rows``: a list of dicts, one per table row, plus
any arrays a subclass keeps), renders as an HTML table in notebooks
(``_repr_html_``), as aligned text in terminals and tests (``str()``, the text twin),
and as JSON for scripts (``to_dict()`` / ``to_json()``). Figures are made on
request (``plot()``), so matplotlib is imported only then.
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from .._html import FLAGGED, Cell, Markup, escape, facts_table, table


def _numpy() -> Any:
    """numpy if something loaded it, else None: a value can be a numpy scalar or array
    only once numpy is imported, so a report of headers alone never loads it."""
    return sys.modules.get("numpy")


def _fmt(v: Any) -> str:
    np = _numpy()
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
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return str(v)


def _jsonable(v: Any) -> Any:
    np = _numpy()
    if np is not None and isinstance(v, np.ndarray):
        return v.tolist()
    if np is not None and isinstance(v, (np.floating,)):
        f = float(v)
        return None if math.isnan(f) else f
    if isinstance(v, float) and math.isnan(v):
        return None
    if np is not None and isinstance(v, np.integer):
        return int(v)
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if hasattr(v, "__fspath__"):
        return str(v)
    return v


@dataclass
class Report:
    """A table of results with a title, a summary and its raw rows.

    Attributes:
        title: one line naming what was inspected.
        rows: one dict per table row (the raw numbers).
        columns: which row keys the table shows, in order (default: all of the first row).
        summary: ordered key -> value facts shown above the table.
        flagged: row indices to highlight (e.g. tensors with an unexpected dtype).
        max_rows: rows shown in text/HTML before eliding (the data keeps all).
    """

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
        return _jsonable({"title": self.title, "summary": self.summary, "rows": self.rows,
                          "flagged": self.flagged})

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **kw)

    def to_dataframe(self):  # pragma: no cover - pandas is optional
        import pandas as pd  # lazy: pandas is optional

        return pd.DataFrame(self.rows)

    # -- text twin -----------------------------------------------------------------------
    def _shown(self) -> List[int]:
        n = len(self.rows)
        if n <= self.max_rows:
            return list(range(n))
        keep = set(range(self.max_rows // 2)) | set(range(n - self.max_rows // 2, n))
        keep |= set(self.flagged[: self.max_rows])
        return sorted(keep)

    def __str__(self) -> str:
        lines = [self.title]
        for k, v in self.summary.items():
            lines.append(f"  {k}: {_fmt(v)}")
        cols = self.cols()
        if cols and self.rows:
            shown = self._shown()
            table = [[c for c in cols]] + [[_fmt(self.rows[i].get(c, "")) for c in cols]
                                           for i in shown]
            widths = [max(len(r[j]) for r in table) for j in range(len(cols))]
            flag = set(self.flagged)
            lines.append("")
            lines.append("  " + "  ".join(h.ljust(w) for h, w in zip(table[0], widths)))
            prev = -1
            for i, row in zip(shown, table[1:]):
                if i != prev + 1:
                    lines.append(f"  ... {i - prev - 1} rows ...")
                mark = "!" if i in flag else " "
                lines.append(mark + " " + "  ".join(c.ljust(w) for c, w in zip(row, widths))
                             .rstrip())
                prev = i
            if prev != len(self.rows) - 1:
                lines.append(f"  ... {len(self.rows) - 1 - prev} rows ...")
        return "\n".join(lines)

    def __repr__(self) -> str:  # cheap
        return f"<{type(self).__name__}: {self.title} ({len(self.rows)} rows)>"

    # -- notebook view -------------------------------------------------------------------
    def _repr_html_(self) -> str:
        parts = [f"<div class='lorakit-report'><b>{escape(self.title)}</b>"]
        if self.summary:
            parts.append(facts_table((k, _fmt(v)) for k, v in self.summary.items()))
        cols = self.cols()
        if cols and self.rows:
            flag = set(self.flagged)
            body: List[List[Any]] = []
            styles: Dict[int, str] = {}
            prev = -1
            for i in self._shown():
                if i != prev + 1:
                    body.append([Cell(Markup(f"&hellip; {i - prev - 1} rows"),
                                      colspan=len(cols))])
                if i in flag:
                    styles[len(body)] = FLAGGED
                body.append([_fmt(self.rows[i].get(c, "")) for c in cols])
                prev = i
            parts.append(f"<details open><summary>{len(self.rows)} rows</summary>"
                         f"{table(body, head=cols, row_styles=styles)}</details>")
        parts.append("</div>")
        return "".join(parts)
