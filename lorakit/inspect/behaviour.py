"""Behaviour on a corpus: per-token KL(P_ref || P_test), top-1 agreement and perplexity.

llama.cpp's ``llama-perplexity --kl-divergence`` with its choices made explicit
(docs/behaviour.md): windows of ``context`` tokens, float32, natural logs, exact logit
ties counted as top-1 agreement. One compiled MLX pass per window, queued ahead.

>>> rep = compare_outputs("data/tiny-qwen3", ("data/tiny-qwen3", "data/adapters/lora"),
...                       tokens=512, context=128)
>>> rep.tokens, rep.top1_agreement < 1
(508, True)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..bootstrap import window_intervals
from ..errors import ArgumentError, LorakitError, PathLike
from ..fusion.model import attach_adapter
from ..io.formats.corpus import encode_text, read_corpus
from ..io.formats.paths import resolve_model_path
from ..progress import Progress, progress_bar
from ..report import Report, jsonable
from . import plots
from .moe_cpu import float32_if_refused

__all__ = ["compare_outputs"]

#: positions x vocab above which a window's math is done in chunks of positions
CHUNK_ELEMENTS = 1 << 28
#: the per-token arrays of one scored pair, in :func:`_window_math`'s order
KEYS = ("kl", "ref_top1", "test_top1", "ref_nll", "test_nll", "top1_agree")


def windows(ids: Sequence[int], context: int, tokens: Optional[int] = None) -> np.ndarray:
    """The ids cut to the first ``tokens`` and split into consecutive windows of
    ``context`` (a last partial window dropped): an int32 array [windows, context]."""
    if context < 2:
        raise ArgumentError.bad("context", context, ">= 2 (a window holds at least two tokens)")
    ids = np.asarray(ids, dtype=np.int64)
    if tokens is not None:
        ids = ids[:tokens]
    n = len(ids) // context
    if n == 0:
        raise LorakitError("the corpus is shorter than one window",
                           expected=f"at least {context} tokens", found=f"{len(ids)} tokens",
                           hint="pass a smaller context or a longer corpus")
    return ids[: n * context].reshape(n, context).astype(np.int32)


@dataclass
class Side:
    """One side of the comparison: a loaded model, its tokenizer and a label."""

    model: Any
    tokenizer: Any
    label: str


def _load(spec: PathLike, label: str) -> Tuple[Any, Any]:
    """mlx-lm's ``load``; the test side needs no tokenizer (the reference's tokenizes
    the corpus), so a checkpoint folder without one still loads there."""
    import mlx_lm  # lazy: mlx-lm is heavy
    from mlx_lm.utils import load_model  # lazy: mlx-lm is heavy

    try:
        return tuple(mlx_lm.load(str(spec))[:2])
    except Exception as e:  # noqa: BLE001 - mlx-lm and transformers raise many kinds
        error = e
    if label == "test" and Path(spec).is_dir():
        try:
            return load_model(Path(spec))[0], None
        except Exception as e:  # noqa: BLE001
            error = e
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    raise LorakitError(f"cannot load the {label} model with mlx-lm", file=str(spec),
                       expected="an mlx-lm checkpoint (config.json, weights"
                                + (", tokenizer)" if label == "reference" else ")"),
                       found=f"{type(error).__name__}: {first}"[:300]) from None


def _side(spec: Any, adapter: Optional[PathLike], label: str) -> Side:
    """A checkpoint path / hub id (with ``adapter`` attached unfused), a
    ``(path, adapter or None)`` pair, or a loaded ``(model, tokenizer)``."""
    name = label
    if isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], (str, Path)):
        spec, pair_adapter = spec
        if adapter is not None and pair_adapter is not None:
            raise ArgumentError.bad(f"{label} adapter", f"{pair_adapter} and {adapter}",
                                    f"one adapter for the {label} model")
        adapter = adapter if adapter is not None else pair_adapter
    if isinstance(spec, (str, Path)):
        model, tok = _load(resolve_model_path(spec), label)
        name = str(spec) + (f" + {adapter}" if adapter is not None else "")
    elif isinstance(spec, tuple) and len(spec) == 2 and hasattr(spec[0], "parameters"):
        model, tok = spec
    else:
        raise ArgumentError.bad(label, type(spec).__name__,
                                "a path or hub id, (path, adapter or None), or (model, tokenizer)")
    return Side(attach_adapter(model, adapter) if adapter is not None else model, tok, name)


_STEP = None


def _window_math():
    """The compiled per-chunk math: (ref logits, test logits, next ids) ->
    (kl, ref top-1, test top-1, ref nll, test nll, top-1 agreement counting ties)."""
    global _STEP
    if _STEP is None:
        import mlx.core as mx  # lazy: mlx is heavy

        def step(lr, lt, y):
            # KL = sum_v p_ref (lr - lt) - (lse_ref - lse_test): no log-probabilities
            # materialised (float32 conversion of bf16/f16 is exact)
            r32 = lr.astype(mx.float32)
            t32 = lt.astype(mx.float32)
            lser = mx.logsumexp(r32, axis=-1)
            lset = mx.logsumexp(t32, axis=-1)
            e = mx.sum(mx.exp(r32 - lser[:, None]) * (r32 - t32), axis=-1)
            kl = (e - lser) + lset
            yy = y[:, None]
            nr = lser - mx.take_along_axis(r32, yy, axis=-1)[:, 0]
            nt = lset - mx.take_along_axis(t32, yy, axis=-1)[:, 0]
            ir = mx.argmax(lr, axis=-1)
            it = mx.argmax(lt, axis=-1)
            # one model's argmax among the other's tied top tokens (exact compares:
            # both logits are the same model's values)
            tied = ((ir == it)
                    | (mx.take_along_axis(lr, it[:, None], axis=-1)[:, 0] == mx.max(lr, axis=-1))
                    | (mx.take_along_axis(lt, ir[:, None], axis=-1)[:, 0] == mx.max(lt, axis=-1)))
            return kl, ir, it, nr, nt, tied

        _STEP = mx.compile(step)
    return _STEP


def _topk(logits, k: int):
    """The ``k`` largest log-probabilities per row and their ids, largest first."""
    import mlx.core as mx  # lazy: mlx is heavy

    lp = logits.astype(mx.float32)
    lse = mx.logsumexp(lp, axis=-1, keepdims=True)
    # k rounds of argmax (lowest id on ties) and masking: no sort of the vocabulary
    ids, vals, cols = [], [], mx.arange(lp.shape[-1])[None]
    for _ in range(min(k, lp.shape[-1])):
        i = mx.argmax(lp, axis=-1, keepdims=True)
        ids.append(i)
        vals.append(mx.take_along_axis(lp, i, axis=-1))
        lp = mx.where(cols == i, -mx.inf, lp)
    return mx.concatenate(ids, axis=-1), mx.concatenate(vals, axis=-1) - lse


def _ordered(idx: np.ndarray, val: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Each row's candidates largest first, ties by the lowest id (as argmax)."""
    order = np.lexsort((idx, -val), axis=-1)
    return (np.take_along_axis(idx, order, -1).astype(np.int32),
            np.take_along_axis(val, order, -1).astype(np.float32))


def score_windows(ref_model: Any, test_model: Any, wins: np.ndarray, *, top_k: int = 5,
                  detail: int = 256, progress: Progress = None) -> Dict[str, np.ndarray]:
    """Score every window through both models: the arrays of
    :attr:`BehaviourReport.arrays`, per scored token in corpus order."""
    import mlx.core as mx  # lazy: mlx is heavy

    step = _window_math()
    n_win, ctx = wins.shape
    out: Dict[str, List[np.ndarray]] = {k: [] for k in KEYS}
    tops: Dict[str, List[np.ndarray]] = {k: [] for k in ("ref_top_ids", "ref_top_logp",
                                                         "test_top_ids", "test_top_logp")}
    pending: Optional[Tuple[Any, ...]] = None
    scored = 0

    def drain(res) -> None:
        parts, top = res
        for k, arrays in zip(KEYS, zip(*parts)):
            out[k].append(np.concatenate([np.array(a) for a in arrays]))
        if top is not None:
            ri, rv, ti, tv = (np.array(a) for a in top)
            for k, a in zip(tops, (*_ordered(ri, rv), *_ordered(ti, tv))):
                tops[k].append(a)

    with progress_bar(progress, n_win, "kl") as bar:
        for w in range(n_win):
            x = mx.array(wins[w])[None]
            y = mx.array(wins[w, 1:])
            lr = ref_model(x)[0, :-1]
            lt = test_model(x)[0, :-1]
            vocab = lr.shape[-1]
            if lt.shape[-1] != vocab:
                raise LorakitError("the two models' vocabularies differ: their next-token "
                                   "distributions cannot be compared",
                                   expected=f"{vocab} logits per token (the reference's)",
                                   found=f"{lt.shape[-1]} (the test model's)")
            rows = max(1, CHUNK_ELEMENTS // max(vocab, 1))
            parts = [step(lr[s:s + rows], lt[s:s + rows], y[s:s + rows])
                     for s in range(0, ctx - 1, rows)]
            top = None
            if scored < detail and top_k > 0:
                m = min(detail - scored, ctx - 1)
                top = (*_topk(lr[:m], top_k), *_topk(lt[:m], top_k))
            scored += ctx - 1
            res = (parts, top)
            mx.async_eval([a for p in parts for a in p] + list(top or ()))
            if pending is not None:
                drain(pending)
                bar.update(1)
            pending = res
        if pending is not None:
            drain(pending)
            bar.update(1)
    result = {k: np.concatenate(v) for k, v in out.items()}
    result["target"] = wins[:, 1:].reshape(-1).copy()
    k = max(top_k, 0)
    for name, v in tops.items():
        dt = np.int32 if name.endswith("ids") else np.float32
        result[name] = np.concatenate(v) if v else np.zeros((0, k), dt)
    return result


def compare_outputs(reference: Any, test: Any, corpus: Optional[PathLike] = None, *,
                    tokens: Optional[int] = None, context: int = 512,
                    ref_adapter: Optional[PathLike] = None,
                    test_adapter: Optional[PathLike] = None, top_k: int = 5,
                    detail: int = 256, progress: Progress = None, base: Any = None):
    """How differently two models behave on a corpus: a :class:`BehaviourReport`.

    ``reference`` / ``test``: a path or hub id, ``(path, adapter or None)`` or a loaded
    ``(model, tokenizer)``; ``*_adapter`` attach an adapter unfused. ``corpus``: text or
    ``.jsonl`` (default: the embedded validation text), cut to ``tokens``; ``top_k``
    candidates for the first ``detail`` tokens. ``base`` (the model without the adapter)
    adds the *effect kept*, 1 - KL(ref || test) / KL(ref || base). Every mean has a 95%
    bootstrap interval over windows (``mean_kl_interval``...).
    """
    ref = _side(reference, ref_adapter, "reference")
    tst = _side(test, test_adapter, "test")
    text, name, sha = read_corpus(corpus)
    ids = encode_text(ref.tokenizer, text)
    wins = windows(ids, context, tokens)
    # a model whose dtype MLX's CPU refuses for some op (bf16 GatherMM...): float32
    bse = _side(base, None, "base") if base is not None else None
    sides = (("reference", ref), ("test", tst)) + ((("base", bse),) if bse else ())
    notes = {side: float32_if_refused(s.model) for side, s in sides}
    arrays = score_windows(ref.model, tst.model, wins, top_k=top_k, detail=detail,
                           progress=progress)
    if bse is not None:
        arrays["base_kl"] = score_windows(ref.model, bse.model, wins, top_k=0, detail=0)["kl"]
    rep = BehaviourReport.build(arrays, reference=ref.label, test=tst.label, corpus=name,
                                corpus_sha256=sha, context=context,
                                corpus_tokens=len(ids), tokenizer=ref.tokenizer,
                                base=bse.label if bse else None)
    return with_float32_note(rep, notes)


def with_float32_note(rep: Any, notes: Dict[str, str]) -> Any:
    """Say which models ran in float32 and why: ``rep.float32`` and the summary's ``note``."""
    f32 = [side for side, n in notes.items() if n]
    rep.float32 = f32
    if f32:
        rep.summary["note"] = f"{' and '.join(f32)} {notes[f32[0]]}"
    return rep


# -- The report: KL statistics, top-1 agreement, perplexities, the worst tokens, the arrays


def _shown(piece: str) -> str:
    """A token as one visible table cell: quoted (Python repr) when it has whitespace
    at an end or unprintable characters."""
    plain = piece and piece.isprintable() and piece.strip() == piece
    return piece if plain else repr(piece)


def kl_stats(arrays: Dict[str, np.ndarray], per: int) -> Dict[str, Any]:
    """The summary numbers of per-token arrays (:data:`KEYS`; with ``base_kl`` the effect
    kept, also per token into ``arrays["effect_kept"]``), each mean with its 95% bootstrap
    interval over windows of ``per`` scored tokens (``<name>_interval``)."""
    kl = arrays["kl"].astype(np.float64)
    n = int(kl.size)
    w = max(n // max(per, 1), 1)
    sums = lambda a: a[: w * (n // w)].astype(np.float64).reshape(w, -1).sum(1)  # noqa: E731
    cols = {"kl": sums(kl), "agree": sums(arrays["top1_agree"]), "nr": sums(arrays["ref_nll"]),
            "nt": sums(arrays["test_nll"]), "n": np.full(w, n // w, np.float64)}
    means = {"mean_kl": lambda t: t["kl"] / t["n"], "top1_agreement": lambda t: t["agree"] / t["n"],
             "ppl_ref": lambda t: math.exp(t["nr"] / t["n"]),
             "ppl_test": lambda t: math.exp(t["nt"] / t["n"])}
    base = arrays.get("base_kl")
    if base is not None:
        b = base.astype(np.float64)
        cols["base"] = sums(b)
        means["effect_kept"] = lambda t: 1 - t["kl"] / t["base"] if t["base"] > 0 else math.nan
        with np.errstate(divide="ignore", invalid="ignore"):
            arrays["effect_kept"] = np.where(b > 0, 1 - kl / b, np.nan)
    spans = window_intervals(cols, means)
    stats: Dict[str, Any] = {
        "mean_kl": float(kl.mean()), "mean_kl_interval": list(spans["mean_kl"]),
        "median_kl": float(np.median(kl)),
        **{f"p{q}_kl".replace(".", ""): float(np.percentile(kl, q)) for q in (90, 99, 99.9)},
        "max_kl": float(kl.max()),
        "top1_agreement": float(np.mean(arrays["top1_agree"])),
        "top1_agreement_interval": list(spans["top1_agreement"]),
        "top1_agreement_strict": float(np.mean(arrays["ref_top1"] == arrays["test_top1"])),
        "ppl_ref": math.exp(float(arrays["ref_nll"].astype(np.float64).mean())),
        "ppl_ref_interval": list(spans["ppl_ref"]),
        "ppl_test": math.exp(float(arrays["test_nll"].astype(np.float64).mean())),
        "ppl_test_interval": list(spans["ppl_test"]),
        "tokens": n,
    }
    if base is not None:
        total = float(cols["base"].sum())
        stats.update(mean_kl_base=float(b.mean()),
                     effect_kept=1 - float(kl.sum()) / total if total > 0 else math.nan,
                     effect_kept_interval=list(spans["effect_kept"]))
    return stats


@dataclass(repr=False)
class BehaviourReport(Report):
    """KL(P_ref || P_test) per scored token, summarised: ``stats``, ``arrays`` (per token
    :data:`KEYS` and ``target``; for the first tokens ``ref_top_ids`` / ``_logp`` and the
    test's), their decoded ``pieces`` / ``*_top_pieces``, and ``float32`` (the sides run
    in float32 because MLX's CPU refused their dtype)."""

    column_help = {
        "position": "index of the scored token in the corpus (after tokenization)",
        "token": "the token that actually came next in the text",
        "kl": "KL(P_ref || P_test) at this position, natural log",
        "ref_top1": "the reference model's most likely next token",
        "test_top1": "the test model's most likely next token",
        "ref_nll": "the reference model's -log p(actual next token)",
        "test_nll": "the test model's -log p(actual next token)",
    }

    stats: Dict[str, Any] = field(default_factory=dict)
    arrays: Dict[str, np.ndarray] = field(default_factory=dict)
    pieces: List[str] = field(default_factory=list)
    ref_top_pieces: List[List[str]] = field(default_factory=list)
    test_top_pieces: List[List[str]] = field(default_factory=list)
    context: int = 0
    float32: List[str] = field(default_factory=list)  # sides run in float32 (MLX's CPU)

    def __getattr__(self, name: str) -> Any:  # rep.mean_kl, rep.top1_agreement, ...
        stats = self.__dict__.get("stats") or {}
        if name in stats:
            return stats[name]
        raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")

    @classmethod
    def build(cls, arrays: Dict[str, np.ndarray], *, reference: str, test: str, corpus: str,
              corpus_sha256: str, context: int, corpus_tokens: int, tokenizer: Any = None,
              worst: int = 10, base: Optional[str] = None) -> "BehaviourReport":
        kl = arrays["kl"].astype(np.float64)
        n = int(kl.size)
        stats = kl_stats(arrays, context - 1)
        dec = (lambda i: tokenizer.decode([int(i)])) if tokenizer is not None else str
        order = np.argsort(-kl, kind="stable")[:worst]
        rows = []
        for i in order:
            rows.append({"position": int(i), "token": _shown(dec(arrays["target"][i])),
                         "kl": float(kl[i]), "ref_top1": _shown(dec(arrays["ref_top1"][i])),
                         "test_top1": _shown(dec(arrays["test_top1"][i])),
                         "ref_nll": float(arrays["ref_nll"][i]),
                         "test_nll": float(arrays["test_nll"][i])})
        m = len(arrays.get("ref_top_ids", ()))
        pieces = [dec(t) for t in arrays["target"][:m]]
        rtp = [[dec(t) for t in r] for r in arrays.get("ref_top_ids", ())]
        ttp = [[dec(t) for t in r] for r in arrays.get("test_top_ids", ())]
        summary = {"reference": reference, "test": test, **({"base": base} if base else {}),
                   "corpus": corpus,
                   "corpus_sha256": corpus_sha256, "corpus_tokens": corpus_tokens,
                   "context": context, "windows": n // max(context - 1, 1), **stats}
        return cls(title=f"behaviour: KL(reference || test) over {n} tokens", rows=rows,
                   summary=summary, stats=stats, arrays=arrays, pieces=pieces,
                   ref_top_pieces=rtp, test_top_pieces=ttp, context=context)

    def to_dict(self, per_token: bool = False) -> Dict[str, Any]:
        """The summary keys flat, the worst tokens as ``rows``, and with ``per_token=True``
        the raw per-token arrays."""
        d = {**self.summary, "models": {k: self.summary[k] for k in ("reference", "test")},
             "title": self.title, "rows": self.rows, "float32": list(self.float32)}
        if per_token:
            d["per_token"] = dict(self.arrays)
        return jsonable(d)

    def plot(self, ax=None):
        """KL distribution (histogram, log scale) and KL along the text."""
        return plots.kl_figure(self.arrays["kl"], self.context, title=self.title, ax=ax)
