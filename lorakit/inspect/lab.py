"""The adapter lab: what an adapter does to a model's behaviour, how much, and where.

Both verbs attach the adapter unfused and move only the LoRA layers' ``scale`` (a
*setting* is one scale per LoRA layer), scoring pairs of settings with
:func:`lorakit.compare_outputs`' math (:func:`~lorakit.inspect.behaviour.kl_stats`).
:func:`scale_sweep` is a dose-response curve against the base and the trained adapter;
:func:`layer_effects` says per group of LoRA layers what is lost without it and what it
does alone; a :class:`LabSession` holds the model for repeated questions (the
``AdapterLab`` widget's): :meth:`LabSession.point` is the behaviour at one scale with some
LoRA layers off. A scale of exactly 0 gives the base's logits bit for bit. A loaded
``(model, tokenizer)`` is given back as it came (scales restored, an adapter attached here
taken off).
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
from .behaviour import CHUNK_ELEMENTS, KEYS, _side, _window_math, kl_stats, windows
from .generation import Generation, _decode_lockstep, eos_ids

__all__ = ["scale_sweep", "layer_effects", "ScaleSweep", "LayerEffects", "LabSession",
           "LabPoint"]

#: the LoRA layer classes whose ``scale`` the lab moves (DoRA's magnitude is no scale)
LORA_CLASSES = ("LoRALinear", "LoRASwitchLinear", "LoRAEmbedding")


class _Lab:
    """The model with its LoRA layers, their trained scales, and the corpus windows;
    a context manager that gives a loaded model back as it came. ``memo`` (a session's):
    the logits and texts of the base and the trained adapter, kept."""

    memo: Optional[Dict[Any, Any]] = None

    def __init__(self, model: Any, adapter: Any, corpus: Optional[PathLike], tokens: int,
                 context: int) -> None:
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
            from mlx.utils import tree_unflatten  # lazy: mlx is heavy

            inner = [(n, m.linear if "linear" in m else m.embedding) for n, m in
                     zip(self.names, self.layers) if n in self.attached]
            self.model.update_modules(tree_unflatten(inner))

    @property
    def fixed(self) -> set:
        """The settings a session keeps results of: the base and the trained adapter."""
        return {tuple(0 * self.trained), tuple(self.trained)}

    def greedy(self, setting: np.ndarray, prompt: str, max_tokens: int) -> Generation:
        """The greedy decode of ``prompt`` at ``setting``."""
        key = ("text", tuple(setting), prompt, max_tokens)
        if self.memo is not None and key in self.memo:
            return self.memo[key]
        self.set(setting)
        gens, _ = _decode_lockstep({"s": (self.model, self.tokenizer)}, prompt, max_tokens,
                                   chat=False)
        self.set(self.trained)
        if self.memo is not None and tuple(setting) in self.fixed:
            self.memo[key] = gens["s"]
        return gens["s"]

    def set(self, scales: np.ndarray) -> None:
        for m, s in zip(self.layers, scales):
            m.scale = float(s)

    def score(self, settings: Sequence[np.ndarray], pairs: Sequence[Tuple[int, int]],
              progress: Progress = None) -> List[Dict[str, np.ndarray]]:
        """Per scored token, for each ``(ref, test)`` pair of indices into ``settings``,
        the arrays of :data:`KEYS`. Settings equal in value run once."""
        import mlx.core as mx  # lazy: mlx is heavy

        step = _window_math()
        keys = [tuple(np.asarray(s, dtype=np.float64)) for s in settings]
        canon = [keys.index(k) for k in keys]  # equal settings run once
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

                def run(i: int) -> Any:
                    key = (keys[i], w)
                    if self.memo is not None and key in self.memo:
                        return self.memo[key]
                    self.set(settings[i])
                    lg = self.model(x)[:, :-1]
                    lg = lg.reshape(-1, lg.shape[-1])
                    if self.memo is not None and keys[i] in self.fixed:
                        self.memo[key] = lg
                    return lg

                logits = {r: run(r) for r in refs}
                parts: Dict[int, Any] = {}
                for t in [None] + tests:  # None: pairs between two references
                    if t is not None:
                        logits[t] = run(t)
                    for j, (r, tt) in enumerate(pairs):
                        if j not in parts and canon[tt] in logits:
                            parts[j] = step(logits[canon[r]], logits[canon[tt]], y)
                    mx.eval(list(parts.values()))
                    logits.pop(t, None)
                for j, p in parts.items():
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


def _to_dict(rep: Report, names: Sequence[str], per_token: bool = False) -> Dict[str, Any]:
    """The summary, the title and the report's fields ``names``; with ``per_token=True``
    the per-token arrays (a scale sweep's)."""
    d = {**rep.summary, "title": rep.title, **{k: getattr(rep, k) for k in names}}
    if per_token:
        d["per_token"] = rep.arrays
    return jsonable(d)


@dataclass(repr=False)
class ScaleSweep(Report):
    """The adapter at each scale against the base and against the adapter as trained:
    ``scales``; ``stats`` per scale ``{"base": ..., "adapter": ...}``; ``arrays`` per scale
    the per-token ``kl_base`` and ``kl_adapter``; ``texts`` the greedy text per scale."""

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
        """The summary, ``rows``, ``scales``, ``stats`` (with the intervals) and with
        ``per_token=True`` the per-token KLs."""
        return _to_dict(self, ("rows", "scales", "stats"), per_token)

    def plot(self, ax=None):
        """Dose-response: mean KL against the base and the trained adapter per scale
        (95% intervals as bars), top-1 agreement on a second axis."""
        kl = {f"KL({w} || s)": [(s[w]["mean_kl"], *s[w]["mean_kl_interval"]) for s in self.stats]
              for w in ("base", "adapter")}
        top1 = {f"top-1 = {w}": [s[w]["top1_agreement"] for s in self.stats]
                for w in ("base", "adapter")}
        return plots.dose_response(self.scales, kl, top1, title=self.title, ax=ax)

    figure = plot


def scale_sweep(model: Any, adapter: Any = None,
                scales: Sequence[float] = (0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 2),
                corpus: Optional[PathLike] = None, *, tokens: int = 512, context: int = 128,
                prompt: Optional[str] = None, max_tokens: int = 24,
                progress: Progress = None) -> ScaleSweep:
    """The adapter at ``s`` times its trained scale for each ``s`` in ``scales``:
    KL(base || s) and KL(adapter at 1 || s) per token as :func:`lorakit.compare_outputs`
    computes them, top-1 agreement with each, perplexity, and the greedy text of
    ``prompt`` (``max_tokens`` tokens). ``model``: a path or hub id, ``(path, adapter)``
    or a loaded ``(model, tokenizer)``; ``adapter``: a path or
    :class:`~lorakit.io.adapters.base.Adapter` (None: the model's own LoRA layers).
    One forward pass over the ``tokens`` per distinct scale, 0 and 1 included.

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
        texts = [lab.greedy(s, prompt, max_tokens).text
                 for s in (settings[2:] if prompt is not None else ())]
    stats, arrays, rows = [], [], []
    for i, s in enumerate(scales):
        b, a = scored[2 * i], scored[2 * i + 1]
        sb, sa = kl_stats(b, context - 1), kl_stats(a, context - 1)
        stats.append({"base": sb, "adapter": sa})
        arrays.append({"kl_base": b["kl"], "kl_adapter": a["kl"]})
        rows.append({"scale": s, "kl_base": sb["mean_kl"], "kl_base_p90": sb["p90_kl"],
                     "kl_adapter": sa["mean_kl"], "kl_adapter_p90": sa["p90_kl"],
                     "top1_base": sb["top1_agreement"], "top1_adapter": sa["top1_agreement"],
                     "ppl": sa["ppl_test"]})
        if texts:  # generated text as one table cell: newlines and tabs as escapes
            rows[-1]["text"] = texts[i].replace("\n", "\\n").replace("\t", "\\t")
    summary = _summary(lab, **({"prompt": prompt} if prompt is not None else {}))
    return ScaleSweep(title=f"scale sweep: {len(scales)} scales over {summary['tokens']} tokens",
                      rows=rows, summary=summary, scales=scales, stats=stats, arrays=arrays,
                      texts=texts)


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
    """Per group of LoRA layers, what is lost without it and what it does alone: ``by``;
    ``stats`` per group ``{"removed": ..., "alone": ...}``; ``whole`` (``removed``:
    KL(adapter || base), ``alone``: KL(base || adapter)); the summary's ``sum_*`` (the
    parts' mean KLs added up) and ``gap_*`` (whole minus sum: the interaction gap)."""

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
        return _to_dict(self, ("by", "rows", "stats", "whole"))

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
    one block; ``"kind"``: one projection kind; ``"module"``: one layer) KL(adapter ||
    adapter without g) and KL(base || base with only g) per token, and the parts' sum
    against the whole: the interaction gap. Arguments as for :func:`scale_sweep`; cost
    ``2 * groups + 2`` forward passes over the ``tokens`` (BENCHMARKS.md "The adapter lab").
    """
    _groups([], by)  # a bad ``by`` fails before a model loads
    with _Lab(model, adapter, corpus, tokens, context) as lab:
        return _effects(lab, by, progress)


def _effects(lab: _Lab, by: str, progress: Progress) -> LayerEffects:
    context = lab.context
    groups = _groups(lab.names, by)
    full = lab.trained
    settings = [0 * full, full]
    for idx in groups.values():
        mask = np.isin(np.arange(len(full)), idx)
        settings += [np.where(mask, 0, full), np.where(mask, full, 0)]
    pairs = [(1, 0), (0, 1)] + [(1 - k, 2 + 2 * g + k) for g in range(len(groups))
                                for k in (0, 1)]
    scored = [kl_stats(a, context - 1) for a in lab.score(settings, pairs, progress)]
    whole = {"removed": scored[0], "alone": scored[1]}
    stats = [{"removed": scored[2 + 2 * g], "alone": scored[3 + 2 * g]}
             for g in range(len(groups))]
    rows = []
    for (label, idx), st in zip(groups.items(), stats):
        rem, alone = st["removed"]["mean_kl"], st["alone"]["mean_kl"]
        layer, kind, _, _ = split_name(lab.names[idx[0]])
        total = whole["removed"]["mean_kl"]
        rows.append({"group": label,
                     "layer": "all" if by == "kind" else "-" if layer is None else str(layer),
                     "kind": "all" if by == "layer" else kind, "modules": len(idx),
                     "kl_removed": rem, "top1_removed": st["removed"]["top1_agreement"],
                     "kl_alone": alone, "top1_alone": st["alone"]["top1_agreement"],
                     "share_removed": rem / total if total > 0 else float("nan")})
    parts = {}
    for k in ("removed", "alone"):
        total = sum(r[f"kl_{k}"] for r in rows)
        parts.update({f"whole_{k}": whole[k]["mean_kl"], f"sum_{k}": total,
                      f"gap_{k}": whole[k]["mean_kl"] - total})
    summary = _summary(lab, by=by, groups=len(rows), **parts)
    return LayerEffects(title=f"layer effects by {by}: {len(rows)} groups over "
                              f"{summary['tokens']} tokens", rows=rows, summary=summary,
                        by=by, stats=stats, whole=whole)


#: how a generated end-of-text token reads in a lab text (never the raw special token)
END_MARK = "[end]"
TEXTS = ("base", "adapter", "current")


@dataclass(repr=False)
class LabPoint(Report):
    """The adapter at ``scale`` with the LoRA layers ``off`` switched off ("current"),
    against the base and the adapter as trained: ``stats`` ``{"base": KL(base || current)
    stats, "adapter": KL(adapter || current) stats}`` (with intervals); ``texts`` the
    greedy :class:`~lorakit.inspect.generation.Generation` of each of :data:`TEXTS`;
    ``segments`` each text cut at its first divergence: (before, the token there, after),
    an end of text read as :data:`END_MARK`. Rows: one per text."""

    column_help = {
        "model": "base (scale 0), adapter (as trained) or current (this scale, layers off)",
        "diverges_at": "first step where it chose another token than the base (None: never)",
        "text": "the greedy continuation of the prompt",
    }

    scale: float = 1.0
    off: List[str] = field(default_factory=list)
    stats: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    texts: Dict[str, Generation] = field(default_factory=dict)
    segments: Dict[str, Tuple[str, str, str]] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        return _to_dict(self, ("rows", "scale", "off", "stats"))


class LabSession(_Lab):
    """A model held with its adapter for repeated questions (what ``AdapterLab`` moves):
    :meth:`point` and :meth:`effects`. The base's and the trained adapter's logits and
    texts are kept, so a point costs one forward pass over ``tokens`` and one greedy
    decode. Arguments as for :func:`scale_sweep`; ``with`` gives a loaded model back as
    it came.

    >>> with LabSession("data/tiny-qwen3", "data/adapters/lora") as lab:
    ...     p = lab.point(0.0, prompt="In the beginning", max_tokens=4)
    >>> p.stats["base"]["mean_kl"], p.rows[2]["diverges_at"]
    (0.0, None)
    """

    def __init__(self, model: Any, adapter: Any = None, corpus: Optional[PathLike] = None, *,
                 tokens: int = 128, context: int = 64) -> None:
        super().__init__(model, adapter, corpus, tokens, context)
        self.memo = {}

    def effects(self, by: str = "module", progress: Progress = None) -> LayerEffects:
        """:func:`layer_effects` of the held model."""
        return _effects(self, by, progress)

    def point(self, scale: float = 1.0, off: Sequence[str] = (), prompt: Optional[str] = None,
              max_tokens: int = 24) -> LabPoint:
        """The adapter at ``scale`` times its trained scale with the LoRA layers named in
        ``off`` (``self.names``) switched off: KL(base || it) and KL(adapter || it) per
        token as :func:`lorakit.compare_outputs` computes them, and with a ``prompt`` the
        greedy texts of base, adapter and it, each cut at its first divergence from the
        base."""
        off = list(off)
        bad = [n for n in off if n not in self.names]
        if bad:
            raise ArgumentError.bad("off", bad[0], "names of the adapter's LoRA layers")
        settings = [0 * self.trained, self.trained,
                    np.where(np.isin(self.names, off), 0.0, float(scale) * self.trained)]
        scored = self.score(settings, [(0, 2), (1, 2)])
        stats = {k: kl_stats(a, self.context - 1) for k, a in zip(TEXTS, scored)}
        texts = ({k: self.greedy(s, prompt, max_tokens) for k, s in zip(TEXTS, settings)}
                 if prompt is not None else {})
        eos = eos_ids(self.tokenizer)

        def read(ids: Sequence[int]) -> str:
            return (self.tokenizer.decode([t for t in ids if t not in eos])
                    + (END_MARK if ids and ids[-1] in eos else ""))

        steps: Dict[str, Optional[int]] = {}
        for k, g in texts.items():
            ref = texts["base"].tokens
            steps[k] = next((i for i, (a, b) in enumerate(zip(g.tokens, ref)) if a != b), None)
        parted = [s for s in steps.values() if s is not None]
        steps["base"] = min(parted) if parted else None
        segments, rows = {}, []
        for k, g in texts.items():
            s = steps[k] if steps[k] is not None else len(g.tokens)
            segments[k] = (read(g.tokens[:s]), read(g.tokens[s:s + 1]), read(g.tokens[s + 1:]))
            text = "".join(segments[k]).replace("\n", "\\n").replace("\t", "\\t")  # one cell
            rows.append({"model": k, "diverges_at": None if k == "base" else steps[k],
                         "text": text})
        summary = _summary(self, scale=float(scale), off=len(off),
                           kl_base=stats["base"]["mean_kl"], kl_adapter=stats["adapter"]["mean_kl"],
                           top1_base=stats["base"]["top1_agreement"],
                           top1_adapter=stats["adapter"]["top1_agreement"],
                           **({"prompt": prompt} if prompt is not None else {}))
        return LabPoint(title=f"the adapter at scale {float(scale):g}, {len(off)} LoRA layers off",
                        rows=rows, summary=summary, scale=float(scale), off=off,
                        stats=stats, texts=texts, segments=segments)
