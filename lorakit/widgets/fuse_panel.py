"""FusePanel: pick a base and an adapter, choose how to fuse, run, see the
:class:`~lorakit.fusion.fuse.FuseResult` and the fused checkpoint's dtype map. Every
choice is one argument of :func:`lorakit.fuse`; outputs go to a temporary directory
(or ``out_dir``)."""
from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional

import ipywidgets as W

from ..errors import ArgumentError, PathLike
from ..fusion.fuse import FuseResult, fuse
from ..fusion.options import DTYPE_POLICIES, ROUNDINGS
from ..fusion.quant import survival_overall
from ..io.formats import source
from . import _assets
from ._base import ErrorBox, button, choice, hook, htmls
from .dtype_view import DtypeMapView

__all__ = ["FusePanel"]
QUANT_CHOICES = (("re-quantize", False), ("dequantize", True))
#: how a re-quantized base stores its adapted modules (``lorakit.fuse(quant_policy=)``)
QUANT_POLICIES = ("requant", "same-grid", "bits:5", "bits:6", "bits:8", "float", "auto",
                  "learned")


def _choices(found: dict) -> list:
    return [(name, str(path)) for name, path in found.items()]


def _chosen(typed: W.Text, picked: W.Dropdown) -> Optional[Path]:
    """A typed path if any, else the picked choice (None for none)."""
    text = typed.value.strip()
    return Path(text).expanduser() if text else Path(picked.value) if picked.value else None


class FusePanel(W.VBox):
    """A form over :func:`lorakit.fuse` with a progress bar, summary and dtype map.

    ``data``: the folder offering checkpoints and ``adapters/*`` (default: the repository's
    ``data/``). ``out_dir``: where ``<base>+<adapter>-<rounding>-<dtype>`` is written
    (default: a temporary directory removed with the panel). ``result`` is the last
    :class:`FuseResult`; ``runs`` counts finished fuses."""

    def __init__(self, data: Optional[PathLike] = None, out_dir: Optional[PathLike] = None,
                 base: Optional[str] = None, adapter: Optional[str] = None) -> None:
        self.data = Path(data) if data is not None else _assets.find_data()
        # a directory of its own is removed with the panel (or when Python exits)
        own = out_dir is None
        self._own = tempfile.TemporaryDirectory(prefix="lorakit-fusepanel-") if own else None
        self.out_dir = Path(out_dir) if out_dir is not None else Path(self._own.name)
        self.result: Optional[FuseResult] = None
        self.runs = 0
        style = {"description_width": "8em"}
        wide = W.Layout(width="32em")
        cks, ads = _choices(_assets.checkpoints(self.data)), _choices(_assets.adapters(self.data))

        def pick(name: str, label: str, options: Any, **kw: Any) -> Any:
            return choice(f"fuse-{name}", label, options, style=style, **kw)

        def path(name: str, what: str) -> W.Text:
            w = W.Text(placeholder=f"or {what} path", description="", layout=W.Layout(width="24em"))
            return hook(w, f"fuse-{name}-path")

        self.base = pick("base", "base", cks, layout=wide)
        self.base_path = path("base", "a checkpoint")
        self.adapter = pick("adapter", "adapter", ads, layout=wide)
        self.adapter_path = path("adapter", "an adapter")
        self.rounding = pick("rounding", "rounding", list(ROUNDINGS), value="nearest")
        self.dtype = pick("dtype", "dtype policy", list(DTYPE_POLICIES), value="preserve")
        tips = ["dequantize, fuse, re-quantize with the same bits and group size",
                "write float weights"]
        self.quant = pick("quant", "quantized", QUANT_CHOICES, kind=W.ToggleButtons, value=False,
                          tooltips=tips)
        self.quant_policy = pick("quant-policy", "quant policy", list(QUANT_POLICIES),
                                 value="requant")
        self.quant.observe(self._on_quant, names="value")
        self.button = button("fuse-run", "Fuse", "compress")
        width = W.Layout(width="20em")
        bar = W.FloatProgress(value=0.0, min=0.0, max=1.0, description="", layout=width)
        self.progress = hook(bar, "fuse-progress")
        self.status, self.summary = htmls("fuse", "status", "summary")
        self.error = ErrorBox("fuse-error")
        self.view = DtypeMapView()
        self.view.layout.display = "none"
        self._select(self.base, base)
        self._select(self.adapter, adapter)
        self.base.observe(self._on_base, names="value")
        self.base_path.observe(self._on_base, names="value")
        self._on_base()
        self.button.on_click(lambda _b: self.run())
        paths = [W.HBox([self.base, self.base_path]), W.HBox([self.adapter, self.adapter_path])]
        choices = [self.rounding, self.dtype, self.quant, self.quant_policy]
        run = W.HBox([self.button, self.progress, self.status])
        super().__init__(paths + choices + [run, self.error, self.summary, self.view])
        hook(self, "fuse-panel")

    @staticmethod
    def _select(dd: W.Dropdown, want: Optional[str]) -> None:
        if want is None:
            return
        for label, value in dd.options:
            if want in (label, value):
                dd.value = value
                return
        raise ArgumentError.bad(dd.description or "choice", want, ", ".join(
            label for label, _ in dd.options))

    def base_dir(self) -> Optional[Path]:
        return _chosen(self.base_path, self.base)

    def adapter_dir(self) -> Optional[Path]:
        return _chosen(self.adapter_path, self.adapter)

    def output_dir(self) -> Path:
        """Where the current settings' fuse goes."""
        b, a = self.base_dir(), self.adapter_dir()
        name = f"{b.name if b else 'base'}+{a.name if a else 'adapter'}-" \
               f"{self.rounding.value}-{self.dtype.value}" + ("-deq" if self.quant.value else "")
        if self._policy() != "requant":
            name += f"-{self._policy()}"
        return self.out_dir / re.sub(r"[^A-Za-z0-9_.+-]", "_", name)

    def _on_base(self, _change: Any = None) -> None:
        # the quantized choice only means something for a quantized base
        b = self.base_dir()
        quantized = False
        try:
            quantized = b is not None and source.open(b, checkpoint=True).quantization is not None
        except Exception:
            pass  # an unreadable path is reported when the user runs the fuse
        self.quant.disabled = not quantized
        self._on_quant()

    def _on_quant(self, _change: Any = None) -> None:
        # a quant policy says how re-quantized modules are stored: not for float output
        self.quant_policy.disabled = self.quant.disabled or bool(self.quant.value)

    def _policy(self) -> str:
        return "requant" if self.quant_policy.disabled else self.quant_policy.value

    def _on_progress(self, done: int, total: int) -> None:
        # the fuse is 5%..80% of the bar; inspecting the result is the rest
        self.progress.value = 0.05 + 0.75 * (done / total if total else 1.0)

    def run(self) -> Optional[FuseResult]:
        """Fuse with the current settings (what the button does)."""
        base, adapter = self.base_dir(), self.adapter_dir()
        self.error.show(None)
        self.button.disabled = True
        self.progress.bar_style = "info"
        self.progress.value = 0.05
        self.status.value = "fusing..."
        try:
            if base is None or adapter is None:
                missing = "base" if base is None else "adapter"
                raise ArgumentError.bad(missing, None, "choose a base checkpoint and an adapter")
            deq = bool(self.quant.value) and not self.quant.disabled
            kw: Dict[str, Any] = dict(rounding=self.rounding.value, dtype=self.dtype.value)
            kw.update(dequantize=deq, quant_policy=self._policy(), progress=self._on_progress)
            result = fuse(base, adapter, self.output_dir(), force=True, **kw)
            self.progress.value = 0.8
            self.status.value = "inspecting..."
            self.view.show(result.output)
        except Exception as e:  # shown in the panel: the user fixes a choice and retries
            self.progress.bar_style = "danger"
            self.status.value = "failed"
            self.error.show(e)
            return None
        finally:
            self.button.disabled = False
        self.result = result
        self.runs += 1
        self.progress.value = 1.0
        self.progress.bar_style = "success"
        self.status.value = f"done in {result.seconds:.2f} s"
        if result.requant:  # a re-quantized base: what of the delta the codes kept
            o = survival_overall(result.requant)
            self.status.value += (f"; codes changed {o['codes_changed']:.1%}, delta survived "
                                  f"{o['survived']:.1%}")
        self.summary.value = result._repr_html_()
        self.view.layout.display = None
        return result
