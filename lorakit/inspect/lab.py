"""The adapter lab: what an adapter does to a model's behaviour, how much, and where.

Both verbs attach the adapter unfused (:func:`lorakit.fusion.attach_adapter`, nothing
written) and move only the LoRA layers' ``scale``: a *setting* is one scale per LoRA
layer, and each verb scores pairs of settings with the KL math of
:func:`lorakit.compare_outputs` (the same compiled per-token step, the same summary
numbers and bootstrap intervals, :func:`lorakit.inspect.behaviour.kl_stats`).

* :func:`scale_sweep`: the adapter at ``s`` times its scale for each ``s``, against the
  base (``s = 0``) and against the adapter as trained (``s = 1``): a dose-response
  curve, what ``--lora-scaled 0.5`` in llama.cpp or a smaller scale in mlx-lm does.
* :func:`layer_effects`: for each group of LoRA layers (a layer, a kind or a module)
  the behaviour lost when its deltas are switched off, KL(adapter || adapter without
  g), and the behaviour it carries alone, KL(base || base with only g); the sum of
  the parts against the whole shows how much the groups interact.

A scale of exactly 0 adds an exact 0 to each layer's output: the base's logits come
out bit for bit, so KL(base || s=0) is exactly 0. The model runs on the windows of
the corpus in batches (every window of a batch in one forward pass); the reference
settings' logits are kept for the batch, each other setting's are scored and dropped.

A loaded ``(model, tokenizer)`` is given back as it came (its LoRA layers' scales
restored; an adapter attached here is taken off again); pass ``adapter=None`` for a
model that already has LoRA layers (``mlx_lm.load(path, adapter_path=...)``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import AdapterError, ArgumentError, PathLike
from ..io.formats.corpus import encode_text, read_corpus
from ..layers import KIND_LABELS, layer_kind_cells, model_order, split_name
from ..progress import Progress, progress_bar
from ..report import Report, jsonable
from . import plots
from .behaviour import CHUNK_ELEMENTS, _side, _window_math, kl_stats, windows
from .generation import _decode_lockstep

__all__ = ["scale_sweep", "layer_effects", "ScaleSweep", "LayerEffects"]

#: the LoRA layer classes whose ``scale`` the lab moves (DoRA's magnitude is no scale)
LORA_CLASSES = ("LoRALinear", "LoRASwitchLinear", "LoRAEmbedding")
#: the per-token arrays of one scored pair (as :func:`behaviour.score_windows`)
KEYS = ("kl", "ref_top1", "test_top1", "ref_nll", "test_nll", "top1_agree")


class _Lab:
    """The model with its LoRA layers, their trained scales, and the corpus windows;
    a context manager that gives a loaded model back as it came."""

    def __init__(self, model: Any, adapter: Any, corpus: Optional[PathLike], tokens: int,
                 context: int) -> None:
        from mlx.utils import tree_unflatten  # lazy: mlx is heavy

        self._unflatten = tree_unflatten
        loaded = isinstance(model, tuple) and hasattr(model[0], "parameters")
        before = set(_lora(model[0])) if loaded else set()
        side = _side(model, adapter, "model")
        self.model, self.tokenizer, self.label = side.model, side.tokenizer, side.label
        if self.tokenizer is None:
            raise ArgumentError.bad("model", self.label, "a model with its tokenizer")
        found = _lora(self.model)
        dora = [n for n, m in found.items() if type(m).__name__ not in LORA_CLASSES]
        if dora:
            raise AdapterError("the lab scales LoRA deltas; a DoRA layer's magnitude is not "
                               "a scale", tensor=dora[0], expected="LoRA layers",
                               found=type(found[dora[0]]).__name__)
        if not found:
            raise ArgumentError.bad("adapter", adapter, "an adapter (the model has no LoRA "
                                    "layers)")
        self.names = [list(found)[i] for i in model_order(list(found))]
        self.layers = [found[n] for n in self.names]
        self.trained = np.array([float(m.scale) for m in self.layers])
        self.attached = [n for n in self.names if n not in before] if loaded else []
        text, self.corpus, self.corpus_sha256 = read_corpus(corpus)
        self.wins = windows(encode_text(self.tokenizer, text), context, tokens)
        self.context = context

    def __enter__(self) -> "_Lab":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.set(self.trained)
        if self.attached:  # take off what was attached here: the caller's model as it came
            inner = [(n, m.linear if "linear" in m else m.embedding) for n, m in
                     zip(self.names, self.layers) if n in self.attached]
            self.model.update_modules(self._unflatten(inner))

    def set(self, scales: np.ndarray) -> None:
        for m, s in zip(self.layers, scales):
            m.scale = float(s)

    def score(self, settings: Sequence[np.ndarray], pairs: Sequence[Tuple[int, int]],
              progress: Progress = None) -> List[Dict[str, np.ndarray]]:
        """Per scored token, for each ``(ref, test)`` pair of indices into ``settings``,
        the arrays of :data:`KEYS`. Settings equal in value run once."""
        import mlx.core as mx  # lazy: mlx is heavy

        step = _window_math()
        key = {i: tuple(np.asarray(s, dtype=np.float64)) for i, s in enumerate(settings)}
        first = {}
        for i, k in key.items():
            first.setdefault(k, i)
        canon = {i: first[k] for i, k in key.items()}
        refs = sorted({canon[r] for r, _ in pairs})
        tests = sorted({canon[t] for _, t in pairs} - set(refs))
        n_win, ctx = self.wins.shape
        vocab = int(getattr(getattr(self.model, "args", None), "vocab_size", 0) or 1 << 17)
        batch = max(1, min(n_win, CHUNK_ELEMENTS // (ctx * vocab)))
        out: List[Dict[str, List[np.ndarray]]] = [{k: [] for k in KEYS} for _ in pairs]
        with progress_bar(progress, n_win, "lab", unit="it") as bar:
            for w in range(0, n_win, batch):
                x = mx.array(self.wins[w:w + batch])
                y = x[:, 1:].reshape(-1)
                logits: Dict[int, Any] = {}

                def run(i: int) -> Any:
                    self.set(settings[i])
                    lg = self.model(x)[:, :-1]
                    return lg.reshape(-1, lg.shape[-1])

                for r in refs:
                    logits[r] = run(r)
                parts: List[Any] = [None] * len(pairs)
                for t in [None] + tests:  # None: pairs between two references
                    if t is not None:
                        logits[t] = run(t)
                    for j, (r, tt) in enumerate(pairs):
                        if parts[j] is None and canon[tt] in logits:
                            parts[j] = step(logits[canon[r]], logits[canon[tt]], y)
                    if t is not None:
                        mx.eval([a for p in parts if p is not None for a in p])
                        del logits[t]
                mx.eval([a for p in parts for a in p])
                for j, p in enumerate(parts):
                    for k, a in zip(KEYS, p):
                        out[j][k].append(np.array(a))
                bar.update(len(self.wins[w:w + batch]))
        self.set(self.trained)
        return [{k: np.concatenate(v) for k, v in o.items()} for o in out]


def _lora(model: Any) -> Dict[str, Any]:
    return {n: m for n, m in model.named_modules() if "lora_a" in m and hasattr(m, "scale")}


def _summary(lab: _Lab, **extra: Any) -> Dict[str, Any]:
    n_win, ctx = lab.wins.shape
    return {"model": lab.label, "corpus": lab.corpus, "corpus_sha256": lab.corpus_sha256,
            "context": ctx, "windows": n_win, "tokens": n_win * (ctx - 1),
            "lora_layers": len(lab.layers), **extra}


# ---------------------------------------------------------------------------
# scale_sweep


@dataclass(repr=False)
class ScaleSweep(Report):
    """The adapter at each scale against the base and against the adapter as trained.

    Attributes (besides :class:`Report`'s): ``scales``; ``stats``: per scale, the
    summary numbers of both comparisons (``{"base": {...}, "adapter": {...}}``, each as
    :func:`~lorakit.inspect.behaviour.kl_stats`: ``mean_kl``, ``mean_kl_interval``,
    ``median_kl``, ``p90_kl``, ``p99_kl``, ``top1_agreement``, ``ppl_test``...);
    ``arrays``: per scale the per-token KL against each (``kl_base``, ``kl_adapter``);
    ``texts``: the greedy text for the prompt per scale (empty without a prompt).
    """

    column_help = {
        "scale": "the adapter's deltas at this multiple of its trained scale",
        "kl_base": "mean KL(base || this scale) per token, nats",
        "kl_base_p90": "90th percentile of KL(base || this scale)",
        "kl_adapter": "mean KL(adapter at 1 || this scale) per token, nats",
        "kl_adapter_p90": "90th percentile of KL(adapter at 1 || this scale)",
        "top1_base": "how often the top token agrees with the base's",
        "top1_adapter": "how often the top token agrees with the adapter's at scale 1",
        "ppl": "perplexity of the corpus at this scale",
        "text": "greedy continuation of the prompt at this scale",
    }

    scales: List[float] = field(default_factory=list)
    stats: List[Dict[str, Dict[str, Any]]] = field(default_factory=list)
    arrays: List[Dict[str, np.ndarray]] = field(default_factory=list)
    texts: List[str] = field(default_factory=list)

    def to_dict(self, per_token: bool = False) -> Dict[str, Any]:
        """The summary, ``rows``, ``scales``, the full ``stats`` per scale (with the
        intervals) and with ``per_token=True`` the per-token KLs."""
        d = {**self.summary, "title": self.title, "rows": self.rows, "scales": self.scales,
             "stats": self.stats}
        if per_token:
            d["per_token"] = self.arrays
        return jsonable(d)

    def plot(self, ax=None):
        """Dose-response: mean KL against the base and the trained adapter per scale
        (95% intervals as bars), top-1 agreement on a second axis."""
        return plots.dose_response(self.scales, {
            "KL(base || s)": [(s["base"]["mean_kl"], *s["base"]["mean_kl_interval"])
                              for s in self.stats],
            "KL(adapter || s)": [(s["adapter"]["mean_kl"], *s["adapter"]["mean_kl_interval"])
                                 for s in self.stats]},
            {"top-1 = base": [s["base"]["top1_agreement"] for s in self.stats],
             "top-1 = adapter": [s["adapter"]["top1_agreement"] for s in self.stats]},
            title=self.title, ax=ax)

    figure = plot


def scale_sweep(model: Any, adapter: Any = None,
                scales: Sequence[float] = (0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 2),
                corpus: Optional[PathLike] = None, *, tokens: int = 512, context: int = 128,
                prompt: Optional[str] = None, max_tokens: int = 24,
                progress: Progress = None) -> ScaleSweep:
    """The adapter applied at ``s`` times its trained scale, for each ``s`` in
    ``scales`` (in memory: only the LoRA layers' ``scale`` changes): KL(base || s) and
    KL(adapter at 1 || s) per token as :func:`lorakit.compare_outputs` computes them
    (mean with its 95% interval, median, p90, p99), top-1 agreement with each,
    perplexity, and the greedy text of ``prompt`` (``max_tokens`` tokens).

    ``model``: a checkpoint path or hub id, ``(path, adapter)`` or a loaded ``(model,
    tokenizer)``; ``adapter``: a path or :class:`~lorakit.io.adapters.base.Adapter`
    (None: the model's own LoRA layers). ``corpus`` / ``tokens`` / ``context`` as for
    :func:`lorakit.compare_outputs`. Cost: one forward pass over the ``tokens`` per
    distinct scale, 0 and 1 included (the references; 8 for the default scales). Returns a
    :class:`ScaleSweep`; ``.plot()`` draws the dose-response curve.

    >>> sw = scale_sweep("data/tiny-qwen3", "data/adapters/lora", scales=(0, 1), tokens=256)
    >>> sw.stats[0]["base"]["mean_kl"], sw.stats[1]["adapter"]["mean_kl"]
    (0.0, 0.0)
    """
    scales = [float(s) for s in scales]
    if not scales:
        raise ArgumentError.bad("scales", scales, "at least one scale")
    with _Lab(model, adapter, corpus, tokens, context) as lab:
        settings = [0 * lab.trained, lab.trained] + [s * lab.trained for s in scales]
        pairs = [p for i in range(len(scales)) for p in ((0, i + 2), (1, i + 2))]
        scored = lab.score(settings, pairs, progress=progress)
        texts = []
        if prompt is not None:
            for s in settings[2:]:
                lab.set(s)
                gens, _ = _decode_lockstep({"s": (lab.model, lab.tokenizer)}, prompt,
                                           max_tokens, chat=False)
                texts.append(gens["s"].text)
    per = context - 1
    stats, arrays, rows = [], [], []
    for i, s in enumerate(scales):
        b, a = scored[2 * i], scored[2 * i + 1]
        sb, sa = kl_stats(b, per), kl_stats(a, per)
        stats.append({"base": sb, "adapter": sa})
        arrays.append({"kl_base": b["kl"], "kl_adapter": a["kl"]})
        rows.append({"scale": s, "kl_base": sb["mean_kl"], "kl_base_p90": sb["p90_kl"],
                     "kl_adapter": sa["mean_kl"], "kl_adapter_p90": sa["p90_kl"],
                     "top1_base": sb["top1_agreement"], "top1_adapter": sa["top1_agreement"],
                     "ppl": sa["ppl_test"], **({"text": _one_line(texts[i])} if texts else {})})
    summary = _summary(lab, **({"prompt": prompt} if prompt is not None else {}))
    return ScaleSweep(title=f"scale sweep: {len(scales)} scales over {summary['tokens']} tokens",
                      rows=rows, summary=summary, scales=scales, stats=stats, arrays=arrays,
                      texts=texts)


def _one_line(text: str) -> str:
    """Generated text as one table cell: newlines and tabs shown as escapes."""
    return text.replace("\n", "\\n").replace("\t", "\\t")


# ---------------------------------------------------------------------------
# layer_effects


BY = ("layer", "kind", "module")


def _groups(names: Sequence[str], by: str) -> Dict[str, List[int]]:
    """Group label -> indices of the LoRA layers in it, in model order."""
    if by not in BY:
        raise ArgumentError.bad("by", by, " | ".join(f'"{b}"' for b in BY))
    out: Dict[str, List[int]] = {}
    for i, n in enumerate(names):
        layer, kind, _, _ = split_name(n)
        label = {"layer": "-" if layer is None else str(layer), "kind": kind, "module": n}[by]
        out.setdefault(label, []).append(i)
    return out


@dataclass(repr=False)
class LayerEffects(Report):
    """Per group of LoRA layers: what is lost without it, what it does alone.

    Attributes (besides :class:`Report`'s): ``by``; ``stats``: per group (rows' order)
    ``{"removed": ..., "alone": ...}`` as :func:`~lorakit.inspect.behaviour.kl_stats`,
    and ``whole`` (``removed``: KL(adapter || base), ``alone``: KL(base || adapter));
    the summary's ``sum_removed`` / ``sum_alone`` (the parts' mean KLs added up) and
    ``gap_removed`` / ``gap_alone`` (whole minus the sum: the interaction gap).
    """

    column_help = {
        "group": "the LoRA layers switched off (removed) or kept alone",
        "layer": "the block the group sits in ('all' when grouped by kind)",
        "kind": "the projection kind ('all' when grouped by layer)",
        "modules": "LoRA layers in the group",
        "kl_removed": "mean KL(adapter || adapter without this group), nats",
        "top1_removed": "top-1 agreement of the adapter with and without this group",
        "kl_alone": "mean KL(base || base with only this group), nats",
        "top1_alone": "top-1 agreement of the base with and without this group alone",
        "share_removed": "kl_removed / KL(adapter || base): share of the whole effect",
    }

    by: str = "layer"
    stats: List[Dict[str, Dict[str, Any]]] = field(default_factory=list)
    whole: Dict[str, Dict[str, Any]] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        return jsonable({**self.summary, "title": self.title, "by": self.by, "rows": self.rows,
                         "stats": self.stats, "whole": self.whole})

    def grid(self, key: str = "kl_removed") -> Tuple[List[str], List[str], np.ndarray]:
        """(layer labels, kinds, values): ``key`` of each row on a layer x kind grid."""
        labels, kinds, cells = layer_kind_cells(self.rows)
        vals = np.full((len(labels), len(kinds)), np.nan)
        for (lab, kind), rs in cells.items():
            vals[labels.index(lab), kinds.index(kind)] = sum(r[key] for r in rs)
        return labels, kinds, vals

    def plot(self, ax=None, key: str = "kl_removed"):
        """Layer x kind heatmap of ``key`` (``kl_removed`` or ``kl_alone``; log colours)."""
        labels, kinds, vals = self.grid(key)
        cbar = {"kl_removed": "KL(adapter || without group)",
                "kl_alone": "KL(base || only group)"}.get(key, key)
        return plots.value_heatmap(labels, [KIND_LABELS.get(k, k) for k in kinds], vals,
                                   title=self.title, cbar=cbar, ax=ax, log=True)

    figure = plot


def layer_effects(model: Any, adapter: Any = None, corpus: Optional[PathLike] = None, *,
                  tokens: int = 256, context: int = 128, by: str = "layer",
                  progress: Progress = None) -> LayerEffects:
    """Where an adapter acts: for each group ``g`` of its LoRA layers (``by="layer"``:
    one block; ``"kind"``: one projection kind across blocks; ``"module"``: one layer)
    the behaviour lost without g, KL(adapter || adapter without g), and the behaviour
    g carries alone, KL(base || base with only g), per token as
    :func:`lorakit.compare_outputs` computes them; and the parts' sum against the whole
    (KL(adapter || base), KL(base || adapter)): the interaction gap.

    Cost: ``2 * groups + 2`` forward passes of the whole model over ``tokens`` corpus
    tokens (the windows of a batch in one pass), and nothing more measurable. On the
    embedded model (4 layers, 28 LoRA layers, 256 tokens; a pass 0.4-1.8 s on 2 shared
    CPU cores) by layer 10 passes, 8 s; by module 58 passes, 65 s (medians;
    ``benchmarks/lab.py``, BENCHMARKS.md "The adapter lab").

    Arguments as for :func:`scale_sweep`. Returns a :class:`LayerEffects`; ``.plot()``
    draws the layer x kind heatmap.
    """
    _groups([], by)  # a bad ``by`` fails before a model loads
    with _Lab(model, adapter, corpus, tokens, context) as lab:
        groups = _groups(lab.names, by)
        base, full = 0 * lab.trained, lab.trained
        settings = [base, full]
        for idx in groups.values():
            mask = np.zeros_like(full, dtype=bool)
            mask[idx] = True
            settings += [np.where(mask, 0, full), np.where(mask, full, 0)]
        pairs = [(1, 0), (0, 1)] + [p for g in range(len(groups))
                                    for p in ((1, 2 + 2 * g), (0, 3 + 2 * g))]
        scored = lab.score(settings, pairs, progress=progress)
    per = context - 1
    whole = {"removed": kl_stats(scored[0], per), "alone": kl_stats(scored[1], per)}
    stats, rows = [], []
    for g, (label, idx) in enumerate(groups.items()):
        rem, alone = kl_stats(scored[2 + 2 * g], per), kl_stats(scored[3 + 2 * g], per)
        stats.append({"removed": rem, "alone": alone})
        layer, kind, _, _ = split_name(lab.names[idx[0]])
        rows.append({"group": label,
                     "layer": "all" if by == "kind" else "-" if layer is None else str(layer),
                     "kind": "all" if by == "layer" else kind, "modules": len(idx),
                     "kl_removed": rem["mean_kl"], "top1_removed": rem["top1_agreement"],
                     "kl_alone": alone["mean_kl"], "top1_alone": alone["top1_agreement"],
                     "share_removed": rem["mean_kl"] / whole["removed"]["mean_kl"]
                     if whole["removed"]["mean_kl"] > 0 else float("nan")})
    sum_rem = sum(r["kl_removed"] for r in rows)
    sum_alone = sum(r["kl_alone"] for r in rows)
    summary = _summary(lab, by=by, groups=len(rows),
                       whole_removed=whole["removed"]["mean_kl"], sum_removed=sum_rem,
                       gap_removed=whole["removed"]["mean_kl"] - sum_rem,
                       whole_alone=whole["alone"]["mean_kl"], sum_alone=sum_alone,
                       gap_alone=whole["alone"]["mean_kl"] - sum_alone)
    return LayerEffects(title=f"layer effects by {by}: {len(rows)} groups over "
                              f"{summary['tokens']} tokens", rows=rows, summary=summary,
                        by=by, stats=stats, whole=whole)
