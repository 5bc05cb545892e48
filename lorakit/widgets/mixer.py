"""AdapterMixer: two or three LoRA adapters, a weight slider each. Live norms of the mix
and its distance and cosine to each parent come from the deltas' Gram matrices
(``||sum w_i delta_i||^2 = w^T G w``); on request, greedy text of base, mix and parents,
and a button writing the combination (``lorakit.combine``, method ``exact``)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

import ipywidgets as W
import numpy as np

from ..algebra.combine import combine
from ..algebra.lowrank import delta_gram
from ..errors import ArgumentError, PathLike
from ..fusion.model import attach_adapter
from ..inspect.generation import GenerationReport, compare_generations
from ..io.adapters.base import Adapter
from ..io.adapters.load import load_adapter
from ._base import ErrorBox, button, facts_html, hook, htmls, rows_html

__all__ = ["AdapterMixer"]


def mix_stats(gram: Mapping[str, np.ndarray], labels: Sequence[str],
              weights: Sequence[float]) -> Dict[str, Any]:
    """Norms of the weighted sum of deltas from their Gram matrices: ``total`` (the
    mix's ``||.||_F`` over all modules), per parent ``distance`` (``||mix - delta_i||``)
    and ``cosine``, and per module ``rows``."""
    w = np.asarray(weights, np.float64)
    n = len(labels)
    tot = np.zeros((n, n))
    rows: List[Dict[str, Any]] = []
    for module, G in gram.items():
        tot += G
        norms = {lab: math.sqrt(max(float(G[i, i]), 0.0)) for i, lab in enumerate(labels)}
        rows.append({"module": module, "mix": math.sqrt(max(float(w @ G @ w), 0.0)), **norms})
    mix_sq = max(float(w @ tot @ w), 0.0)
    dist, cos = {}, {}
    for i, lab in enumerate(labels):
        e = np.zeros(n)
        e[i] = 1.0
        dist[lab] = math.sqrt(max(float((w - e) @ tot @ (w - e)), 0.0))
        den = math.sqrt(mix_sq * max(float(tot[i, i]), 0.0))
        cos[lab] = float(w @ tot[:, i]) / den if den > 0 else float("nan")
    return {"total": math.sqrt(mix_sq), "distance": dist, "cosine": cos, "rows": rows}


class AdapterMixer(W.VBox):
    """Mix two or three LoRA adapters (label -> directory or Adapter) of one ``base`` with a
    weight slider each (initial ``weights`` default 1/n). ``stats`` holds the live numbers
    (:func:`mix_stats`), ``generations`` the last greedy text, ``written`` the last write."""

    def __init__(self, adapters: Mapping[str, Union[PathLike, Adapter]], base: PathLike, *,
                 weights: Optional[Sequence[float]] = None,
                 prompt: str = "And it came to pass", max_tokens: int = 12) -> None:
        if not 2 <= len(adapters) <= 3:
            raise ArgumentError.bad("adapters", list(adapters), "two or three adapters")
        self.labels = list(adapters)
        self.specs = dict(adapters)
        self.adapters = [a if isinstance(a, Adapter) else load_adapter(a)
                         for a in adapters.values()]
        self.base = Path(base)
        self.gram = delta_gram(self.adapters)
        self.stats: Dict[str, Any] = {}
        self.generations: Optional[GenerationReport] = None
        self.written: Any = None
        n = len(self.labels)
        init = list(weights) if weights is not None else [1.0 / n] * n
        span = dict(min=-1.0, max=2.0, step=0.05, continuous_update=False)
        sliders = [W.FloatSlider(value=v, description=k, **span) for k, v in zip(self.labels, init)]
        self.sliders = [hook(s, f"mixer-weight-{i}") for i, s in enumerate(sliders)]
        self.summary, self.table, self.text, self.status = htmls(
            "mixer", "summary", "table", "text", "status")
        self.prompt = hook(W.Text(value=prompt, description="prompt"), "mixer-prompt")
        self.max_tokens = max_tokens
        self.generate_button = button("mixer-generate", "Greedy text", style="")
        path = W.Text(value="", placeholder="output adapter directory", description="save to")
        self.save_path = hook(path, "mixer-save-path")
        self.write_button = button("mixer-write", "Write combination")
        self.error = ErrorBox("mixer-error")
        self._holding = False
        for s in self.sliders:
            s.observe(lambda _c: None if self._holding else self.refresh(), names="value")
        self.generate_button.on_click(lambda _b: self.generate())
        self.write_button.on_click(lambda _b: self.write())
        details = W.Accordion([self.table], titles=("per-module norms",), selected_index=None)
        gen = W.HBox([self.prompt, self.generate_button])
        save = W.HBox([self.save_path, self.write_button])
        views = [self.error, self.summary, details]
        super().__init__([W.VBox(self.sliders), *views, gen, self.text, save, self.status])
        hook(self, "adapter-mixer")
        self.refresh()

    @property
    def weights(self) -> List[float]:
        return [float(s.value) for s in self.sliders]

    def set_weights(self, weights: Sequence[float]) -> None:
        """Move the sliders (the live view follows once, at the end)."""
        self._holding = True
        try:
            for s, v in zip(self.sliders, weights):
                s.value = float(v)
        finally:
            self._holding = False
        self.refresh()

    def refresh(self) -> Dict[str, Any]:
        """Recompute the live norms (what a slider move does)."""
        self.stats = mix_stats(self.gram, self.labels, self.weights)
        facts: Dict[str, Any] = {"weights": self.weights, "||mix||_F": self.stats["total"]}
        for lab in self.labels:
            facts[f"||mix - {lab}||_F"] = self.stats["distance"][lab]
            facts[f"cosine(mix, {lab})"] = self.stats["cosine"][lab]
        self.summary.value = facts_html(facts)
        self.table.value = rows_html(self.stats["rows"], ["module", "mix"] + self.labels)
        return self.stats

    def mix(self) -> Adapter:
        """The weighted sum as one adapter (``lorakit.combine``'s ``cat``)."""
        return combine(self.adapters, self.weights, method="cat").adapter

    def generate(self) -> Optional[GenerationReport]:
        """Greedy text of the base, the mix and each parent (what the button does)."""
        rep = self.error.attempt(lambda: compare_generations(
            self._models(), [self.prompt.value], self.max_tokens))
        if rep is None:
            return None
        self.generations = rep
        self.text.value = rep._repr_html_()
        return rep

    def write(self) -> Any:
        """Write the exact combination to the save path (what the button does)."""
        written = self.error.attempt(self._write)
        if written is None:
            return None
        self.written = written
        self.status.value = f"written: {self.save_path.value.strip()}"
        return self.written

    def _models(self) -> Dict[str, Any]:
        from mlx_lm import load  # lazy: mlx-lm is heavy

        model, tok = load(str(self.base))[:2]
        models: Dict[str, Any] = {"base": str(self.base),
                                  "mix": (attach_adapter(model, self.mix()), tok)}
        for lab, a in zip(self.labels, self.adapters):
            models[lab] = (str(self.base), a.path)
        return models

    def _write(self) -> Any:
        out = self.save_path.value.strip()
        if not out:
            raise ArgumentError.bad("save to", "", "an output directory")
        specs = [self.specs[lab] for lab in self.labels]
        return combine(specs, weights=self.weights, method="exact", save_path=out)
