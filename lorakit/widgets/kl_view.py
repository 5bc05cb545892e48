"""The text of a :func:`lorakit.compare_outputs` run, each token shaded by its KL; hover a
token for both models' top candidates (only the first ``detail`` tokens carry them)."""
from __future__ import annotations

import html
import math
from typing import Any

__all__ = ["KLTextView"]


def _shade(kl: float, top: float) -> str:
    """White at 0, red at ``top`` (log scale over six decades below it)."""
    if not kl > 0 or top <= 0:
        return "#ffffff"
    t = min(max((math.log10(kl) - math.log10(top) + 6) / 6, 0.0), 1.0)
    g = int(round(255 * (1 - t)))
    return f"#ff{g:02x}{g:02x}"


def kl_html(report: Any, max_tokens: int = 256) -> str:
    """A span per detailed token, shaded by KL, both models' top candidates on hover."""
    kl = report.arrays["kl"]
    n = min(max_tokens, len(report.pieces))
    top = float(max(kl[:n].max(), 0)) if n else 0.0
    spans = []
    for i in range(n):
        cands = [f"KL {float(kl[i]):.3g} nats"]
        for who, ids, lps in (("ref", report.ref_top_pieces, report.arrays["ref_top_logp"]),
                              ("test", report.test_top_pieces, report.arrays["test_top_logp"])):
            cands.append(who + ": " + ", ".join(f"{p!r} {float(lp):.2f}"
                                               for p, lp in zip(ids[i], lps[i])))
        title = html.escape("\n".join(cands), quote=True)
        text = html.escape(report.pieces[i]).replace("\n", "&#8629;<br>")
        spans.append(f"<span title=\"{title}\" style=\"background:{_shade(float(kl[i]), top)};"
                     f"white-space:pre-wrap\">{text}</span>")
    head = (f"<div class='lorakit-kl'><b>{html.escape(report.title)}</b>: first {n} "
            f"scored tokens, shaded by KL (white 0, red {top:.3g} nats; log scale); "
            f"hover a token for both models' top candidates<div style='font-family:"
            f"monospace;line-height:1.6'>")
    return head + "".join(spans) + "</div></div>"


class KLTextView:
    """``KLTextView(report)``: the shaded text as an ipywidgets.HTML (``.widget``)."""

    def __init__(self, report: Any, max_tokens: int = 256) -> None:
        import ipywidgets as w  # lazy: ipywidgets is the notebook extra

        self.report = report
        self.widget = w.HTML(kl_html(report, max_tokens))

    def _ipython_display_(self) -> None:  # pragma: no cover - needs a kernel
        from IPython.display import display  # lazy: only in a kernel

        display(self.widget)
