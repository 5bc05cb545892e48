"""DecodeRace: :func:`lorakit.time_decode` in a background thread, the chart and table
redrawn as each variant's result arrives (``race.start()``; ``race.wait()`` returns the
:class:`DecodeTiming`)."""
from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List, Optional

import ipywidgets as W

from ..errors import ArgumentError, PathLike
from ..timing.decode import DecodeOptions, auto_rounds, time_decode, weight_bytes
from ..timing.table import VARIANTS, DecodeTiming, VariantTiming
from ._base import ErrorBox, FigureView, button, hook, htmls

__all__ = ["DecodeRace"]


class DecodeRace(W.VBox):
    """Live decode timing of base / unfused / promoted / fused / mlx-lm-fused.

    ``options`` (a :class:`~lorakit.timing.decode.DecodeOptions`, default 64 tokens and a
    64-token prompt) and ``**settings`` set what Start runs; the form's variants, tokens,
    prompt tokens and repeats replace them. ``timing`` grows one variant at a time;
    ``result`` is what ``time_decode`` returned; ``updates`` counts chart redraws."""

    def __init__(self, model: PathLike, adapter: Optional[PathLike] = None, *,
                 options: Optional[DecodeOptions] = None, **settings: Any) -> None:
        self.model = Path(model)
        self.adapter = Path(adapter) if adapter is not None else None
        self.options = replace(options or DecodeOptions(tokens=64, prompt_tokens=64),
                               **settings)
        o = self.options
        offered = list(VARIANTS) if self.adapter is not None else ["base"]
        chosen = list(o.variants or offered)
        self.timing: Optional[DecodeTiming] = None
        self.result: Optional[DecodeTiming] = None
        self.updates = 0
        self._done = 0
        self._thread: Optional[threading.Thread] = None
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        self.checks: Dict[str, W.Checkbox] = {}
        for v in offered:
            cb = W.Checkbox(v in chosen, description=v, indent=False, layout=W.Layout(width="9em"))
            self.checks[v] = hook(cb, f"race-{v}")

        def box(value: int, top: int, label: str) -> W.BoundedIntText:
            # the label as wide as its words: a fixed 7em cut "prompt tokens" to "prompt tok..."
            look = {"style": {"description_width": "initial"}, "layout": W.Layout(width="15em")}
            w = W.BoundedIntText(value, min=1, max=top, description=label, **look)
            return hook(w, "race-" + label.replace(" ", "-"))

        self.tokens = box(o.tokens, 4096, "tokens")
        self.prompt_tokens = box(o.prompt_tokens, 8192, "prompt tokens")
        self.repeats = box(o.repeats, 50, "repeats")
        self.start_button = button("race-start", "Start", "play")
        self.stop_button = button("race-stop", "Stop", "stop", "", disabled=True)
        bar = W.IntProgress(0, min=0, max=1, layout=W.Layout(width="16em"))
        self.progress = hook(bar, "race-progress")
        self.status, self.table = htmls("race", "status", "table")
        self.chart = FigureView("race-chart")
        self.error = ErrorBox("race-error")
        self.start_button.on_click(lambda _b: self.start())
        self.stop_button.on_click(lambda _b: self.stop())
        name = self.model.name + (f" + {self.adapter.name}" if self.adapter else "")
        sizes = W.HBox([self.prompt_tokens, self.tokens, self.repeats])
        run = W.HBox([self.start_button, self.stop_button, self.progress, self.status])
        head = [W.HTML(f"<b>Decode race</b>: {name}"), W.HBox(list(self.checks.values()))]
        super().__init__(head + [sizes, run, self.error, self.chart, self.table])
        hook(self, "decode-race")

    @property
    def variants(self) -> List[str]:
        return [v for v, c in self.checks.items() if c.value]

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> threading.Thread:
        """Start timing in a background thread and return it at once."""
        if self.running:
            raise RuntimeError("a decode race is already running")
        names = self.variants
        try:
            sizes = {k: getattr(self, k).value for k in ("prompt_tokens", "tokens", "repeats")}
            self.options = opts = replace(self.options, variants=tuple(names), **sizes)
        except ArgumentError as e:  # no variant checked, say: shown, not only raised
            self.error.show(e)
            raise
        adapter = str(self.adapter) if self.adapter else None
        settings = {"model": str(self.model), "adapter_path": adapter, **opts.settings()}
        self.timing = DecodeTiming(title="", settings=settings)
        self.result = None
        self._cancel.clear()
        self.error.show(None)
        self.chart.clear()
        self.table.value = ""
        rounds = opts.rounds or auto_rounds(sum(weight_bytes(self.model).values()))
        self.progress.max = max(1, len(names) * rounds)  # one step per variant and round
        self.progress.value = self._done = 0
        self.progress.bar_style = "info"
        self.status.value = f"preparing {', '.join(names)}..."
        self.start_button.disabled = True
        self.stop_button.disabled = False
        self._thread = threading.Thread(target=self._work, args=(opts,), daemon=True,
                                        name="lorakit-decode-race")
        self._thread.start()
        return self._thread

    def stop(self) -> None:
        """Ask the running race to stop (the running variant's process is killed)."""
        self._cancel.set()
        self.status.value = "stopping..."

    def wait(self, timeout: Optional[float] = None) -> Optional[DecodeTiming]:
        """Block until the race ends; return its result (None if it failed)."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self.result

    def _on_result(self, v: VariantTiming) -> None:
        with self._lock:
            assert self.timing is not None
            self.timing.add(v)
            self._done += 1
            self.progress.value = self._done
            done = ", ".join(x.variant for x in self.timing.variants)
            self.status.value = f"measured: {done}"
            self.chart.show(self.timing.plot())
            self.table.value = self.timing._repr_html_()
            self.updates += 1

    def _work(self, opts: DecodeOptions) -> None:
        t0 = time.perf_counter()
        try:
            live = {"progress": False, "on_result": self._on_result, "cancel": self._cancel}
            self.result = time_decode(self.model, self.adapter, options=opts, **live)
            stopped = self._cancel.is_set()
            self.progress.bar_style = "warning" if stopped else "success"
            took = f" in {time.perf_counter() - t0:.1f} s"
            self.status.value = ("stopped" if stopped else "finished") + took
        except Exception as e:  # shown in the widget: a thread's exception is otherwise lost
            self.progress.bar_style = "danger"
            self.status.value = "failed"
            self.error.show(e)
        finally:
            self.start_button.disabled = False
            self.stop_button.disabled = True
