"""AdapterLab: the adapter lab live. A scale slider, the layer x kind heatmap of what each
LoRA layer carries (click a cell to switch its delta off and on), a prompt box, and the
base / adapter / current greedy text side by side, first divergence marked, with the KL
numbers beside them. Every number comes from a :class:`lorakit.inspect.lab.LabSession`;
the work runs in a background thread, and a move made while it runs supersedes it."""
from __future__ import annotations

import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import ipywidgets as W

from ..inspect.lab import TEXTS, LabPoint, LabSession, LayerEffects
from ..layers import kind_label, layer_kind_cells
from ..report import escape
from ._base import ErrorBox, FigureView, hook, htmls, rows_html
from .generation import MARK_STYLE, REF_MARK_STYLE, TEXT_STYLE

__all__ = ["AdapterLab"]

#: seconds the worker waits after a move for the next one (a drag sends several)
DEBOUNCE_S = 0.03
OFF_COLOR = "#9e9e9e"
KL_HELP = {"KL": "mean KL(base or adapter || current) per token, nats",
           "top-1": "how often the current top token is the base's or the adapter's"}


class AdapterLab(W.VBox):
    """The adapter lab on ``model`` with ``adapter`` (as for
    :func:`lorakit.inspect.scale_sweep`). ``effects``: a ready ``LayerEffects`` by
    module of the same model (default: computed here, ``2 * layers + 2`` forward passes).
    ``session`` is the held model, ``effects`` the heatmap's report, ``point`` the last
    :class:`~lorakit.inspect.lab.LabPoint` shown, ``off`` the LoRA layers switched off."""

    def __init__(self, model: Any, adapter: Any = None, *, prompt: str = "In the beginning",
                 max_tokens: int = 24, tokens: int = 64, context: int = 64,
                 effects: Optional[LayerEffects] = None) -> None:
        self.session = LabSession(model, adapter, tokens=tokens, context=context)
        self.effects = effects or self.session.effects("module")
        self.max_tokens = max_tokens
        self.off: set = set()
        self.point: Optional[LabPoint] = None
        self.seconds: Optional[float] = None  # the last update's compute time
        span = dict(min=0.0, max=2.0, step=0.1, readout_format=".1f", continuous_update=False)
        self.scale = hook(W.FloatSlider(1.0, description="scale", **span), "lab-scale")
        box = W.Text(prompt, description="prompt", continuous_update=False)
        self.prompt = hook(box, "lab-prompt")
        self.panes = dict(zip(TEXTS, htmls("lab-text", *TEXTS)))
        for p in self.panes.values():
            p.layout = W.Layout(width="30%")
        self.kl, self.status = htmls("lab", "kl", "status")
        self.error = ErrorBox("lab-error")
        self.cells: Dict[Tuple[str, str], W.Button] = {}
        self.members: Dict[Tuple[str, str], List[str]] = {}
        self.looks: Dict[Tuple[str, str], Tuple[str, str]] = {}  # colour, label when on
        self.grid = hook(W.GridBox(), "lab-grid")
        self.figure = FigureView("lab-figure")
        self._build_grid()
        self.figure.show(self.effects.plot())
        self._gen, self._shown = 0, 0
        self._wake, self._cond = threading.Event(), threading.Condition()
        self._lock = threading.Lock()
        self.scale.observe(lambda _c: self.request(), names="value")
        self.prompt.observe(lambda _c: self.request(), names="value")
        tabs = W.Tab([W.VBox([self.grid]), self.figure],
                     titles=("switch layers (click)", "heatmap figure"))
        texts = W.HBox([*self.panes.values(), self.kl])
        super().__init__([W.HBox([self.scale, self.prompt]), tabs, texts, self.status,
                          self.error])
        hook(self, "adapter-lab")
        self.update()
        threading.Thread(target=self._work, daemon=True, name="adapter-lab").start()

    # -- the heatmap ---------------------------------------------------------------------
    def _build_grid(self) -> None:
        from matplotlib import colormaps  # lazy: matplotlib only when drawing
        from matplotlib.colors import LogNorm, to_hex  # lazy: as above

        labels, kinds, vals = self.effects.grid("kl_removed")
        _, _, cells = layer_kind_cells(self.effects.rows)
        pos = vals[vals > 0]  # the figure's colours: viridis on a log scale
        norm = LogNorm(pos.min(), pos.max()) if pos.size else None
        kids: List[W.Widget] = [W.HTML("<b>layer</b>")]
        kids += [W.HTML(f"<b style='font-size:80%'>{escape(kind_label(k))}</b>") for k in kinds]
        for i, lab in enumerate(labels):
            kids.append(W.HTML(lab))
            for j, kind in enumerate(kinds):
                rows = cells.get((lab, kind), [])
                names = [r["group"] for r in rows]
                b = W.Button(description=f"{vals[i, j]:.2g}" if rows else "", disabled=not rows,
                             tooltip="\n".join(names + [f"KL lost without: {vals[i, j]:.4g}"]),
                             layout=W.Layout(width="auto"))
                rgba = colormaps["viridis"](norm(vals[i, j])) if norm and vals[i, j] > 0 else None
                self.looks[(lab, kind)] = (to_hex(rgba) if rgba else "#ffffff", b.description)
                b.style.button_color = self.looks[(lab, kind)][0]
                b.style.text_color = "white" if rgba and sum(rgba[:3]) < 1.5 else "black"
                hook(b, "lab-cell")
                b.on_click(lambda _b, key=(lab, kind): self.toggle(key))
                self.cells[(lab, kind)] = b
                self.members[(lab, kind)] = names
                kids.append(b)
        self.grid.children = kids
        self.grid.layout = W.Layout(grid_template_columns=f"4em repeat({len(kinds)}, 6em)")

    def toggle(self, cell: Tuple[str, str]) -> None:
        """Switch the LoRA layers of a (layer, kind) cell off, or back on (a click)."""
        names = set(self.members[cell])
        self.off ^= names
        b, gone = self.cells[cell], names <= self.off
        b.style.button_color, b.description = (OFF_COLOR, "off") if gone else self.looks[cell]
        self.request()

    # -- updates -------------------------------------------------------------------------
    def request(self) -> None:
        """Ask for a redraw at the current settings; returns at once (the worker draws,
        dropping any result a later request has superseded)."""
        with self._cond:
            self._gen += 1
        self._wake.set()

    def wait(self, timeout: float = 60.0) -> bool:
        """Block until every request so far is drawn (tests, scripts)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._shown >= self._gen, timeout)

    def update(self) -> Optional[LabPoint]:
        """Compute and draw the current settings now, in this thread."""
        gen = self._gen
        t0 = time.perf_counter()
        with self._lock:
            p = self.error.attempt(lambda: self.session.point(
                self.scale.value, sorted(self.off), self.prompt.value, self.max_tokens))
        if p is not None and gen == self._gen:  # else superseded: a newer request draws
            self.seconds = time.perf_counter() - t0
            self._draw(p)
        with self._cond:
            self._shown = max(self._shown, gen)
            self._cond.notify_all()
        return p

    def _work(self) -> None:
        while True:
            self._wake.wait()
            time.sleep(DEBOUNCE_S)
            self._wake.clear()
            self.update()

    def _draw(self, p: LabPoint) -> None:
        self.point = p
        rows = {r["model"]: r for r in p.rows}
        heads = {"base": "base (scale 0)", "adapter": "adapter (as trained)",
                 "current": f"current: scale {p.scale:g}, LoRA layers off: {len(p.off)}"}
        for k, pane in self.panes.items():
            before, mark, after = p.segments.get(k, ("", "", ""))
            step = rows.get(k, {}).get("diverges_at")
            style = REF_MARK_STYLE if k == "base" else MARK_STYLE
            note = ("reference" if k == "base" else "same as base" if step is None
                    else f"parts from base at token {step}")
            prompt = escape(p.summary.get("prompt", ""))
            pane.value = (f"<div style='{TEXT_STYLE}'><b>{escape(heads[k])}</b><br>"
                          f"<span style='color:#777'>{prompt}</span>{escape(before)}"
                          f"<span class='t-lab-diverge' style='{style}'>{escape(mark)}</span>"
                          f"{escape(after)}<br><small><i>{note}</i></small></div>")
        self.kl.value = rows_html(
            [{"current vs": k, "KL": p.stats[k]["mean_kl"], "top-1": p.stats[k]["top1_agreement"]}
             for k in ("base", "adapter")], ["current vs", "KL", "top-1"], help=KL_HELP
        ) + f"<small>KL(model || current), nats per token over {p.summary['tokens']} tokens</small>"
        self.status.value = f"<small>updated in {self.seconds:.2f} s</small>"
