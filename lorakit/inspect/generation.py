"""Greedy outputs of several models side by side: where do they part ways, and how close was it?

The same prompts decoded in lockstep, recording per step each model's token and its
top1 - top2 logit margin (a divergence at a margin of 0.01 is a coin toss).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..errors import ArgumentError
from ..fusion.model import load_unfused
from ..report import Report
from . import plots
from .moe_cpu import cpu_notes, float32_if_refused, moe_float32_on_cpu

__all__ = ["GenerationReport", "compare_generations"]


@dataclass
class Divergence:
    """Where two greedy decodes first chose different tokens: the ``step``, both tokens,
    each model's top1 - top2 ``margin`` there, and ``gap_a`` = logit_a[token_a] -
    logit_a[token_b] (how much A preferred its token over B's; ``gap_b`` likewise)."""

    a: str
    b: str
    step: int
    token_a: int
    token_b: int
    margin_a: float
    margin_b: float
    gap_a: float
    gap_b: float


@dataclass
class Generation:
    """One model's greedy decode of one prompt: ids, text and per-step logit facts."""

    model: str
    prompt: str
    prompt_ids: List[int]
    tokens: List[int] = field(default_factory=list)
    top1: List[float] = field(default_factory=list)  # logit of the chosen token
    margin: List[float] = field(default_factory=list)  # top1 - top2 logit
    text: str = ""


@dataclass(repr=False)
class GenerationReport(Report):
    """``generations[p][m]``: the :class:`Generation` of prompt ``p`` by model ``m``;
    ``divergences[p]``: the :class:`Divergence` of every pair of models that parted."""

    column_help = {
        "prompt": "prompt number",
        "model": "which model generated (its label)",
        "tokens": "tokens generated",
        "diverges_at": "first step where it chose another token than the reference "
                       "(None: never)",
        "margin": "its top1 - top2 logit at that step (small: a near tie)",
        "ref_margin": "the reference's top1 - top2 logit at that step",
        "gap": "how much it preferred its own token over the reference's there (logits)",
        "text": "the generated text",
    }

    generations: List[Dict[str, Generation]] = field(default_factory=list)
    divergences: List[List[Divergence]] = field(default_factory=list)

    def first_divergence(self, prompt: int = 0, a: Optional[str] = None,
                         b: Optional[str] = None) -> Optional[Divergence]:
        labels = list(self.generations[prompt])
        pair = {a or labels[0], b or labels[1]}
        return next((d for d in self.divergences[prompt] if {d.a, d.b} == pair), None)

    def plot(self, prompt: int = 0, ax=None):
        """Per-step logit margins of every model for one prompt, first divergence marked."""
        gens = self.generations[prompt]
        steps = [d.step for d in self.divergences[prompt]]
        return plots.margin_lines({m: g.margin for m, g in gens.items()},
                                  title=f"prompt {prompt}: top1 - top2 logit per step",
                                  diverge=min(steps) if steps else None, ax=ax)


def load_pair(label: str, spec: Any) -> Tuple[Any, Any]:
    """(model, tokenizer) from a loaded pair, a path, or (path, adapter path or None)."""
    if isinstance(spec, (str, Path)):
        spec = (spec, None)
    if isinstance(spec, tuple) and len(spec) == 2 and hasattr(spec[0], "parameters"):
        return spec
    if isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], (str, Path)):
        from mlx_lm import load  # lazy: mlx-lm is heavy

        path, adapter = spec
        model, tok = load(str(path))[:2]
        return (load_unfused(model, adapter) if adapter else model), tok
    raise ArgumentError.bad(f"model {label!r}", type(spec).__name__,
                            "a path, (path, adapter_path or None), or (model, tokenizer)")


def _top2(logits: np.ndarray) -> Tuple[int, float, float]:
    i = int(np.argmax(logits))  # ties: the lowest id, as mx.argmax and mlx-lm's greedy
    rest = np.delete(logits, i)
    return i, float(logits[i]), float(rest.max() if rest.size else logits[i])


def eos_ids(tok: Any) -> set:
    """The tokenizer's end-of-sequence token ids."""
    ids = getattr(tok, "eos_token_ids", None)
    if ids:
        return set(int(i) for i in ids)
    e = getattr(tok, "eos_token_id", None)
    return {int(e)} if e is not None else set()


def _decode_lockstep(models: Dict[str, Tuple[Any, Any]], prompt: str, max_tokens: int,
                     chat: bool) -> Tuple[Dict[str, Generation], List[Divergence]]:
    import mlx.core as mx  # lazy: MLX only when computing
    from mlx_lm.models.cache import make_prompt_cache  # lazy: mlx-lm is heavy

    labels = list(models)
    gens: Dict[str, Generation] = {}
    caches, logits, done = {}, {}, {}
    for m in labels:
        model, tok = models[m]
        if chat and getattr(tok, "chat_template", None):
            ids = list(tok.apply_chat_template([{"role": "user", "content": prompt}],
                                               add_generation_prompt=True))
        else:
            ids = list(tok.encode(prompt))
        gens[m] = Generation(m, prompt, [int(i) for i in ids])
        caches[m] = make_prompt_cache(model)
        out = model(mx.array(ids)[None], cache=caches[m])
        logits[m] = np.array(out[0, -1].astype(mx.float32))
        done[m] = False
    in_sync = {(a, b) for i, a in enumerate(labels) for b in labels[i + 1:]
               if gens[a].prompt_ids == gens[b].prompt_ids}
    divs: List[Divergence] = []
    for step in range(max_tokens):
        chosen: Dict[str, int] = {}
        for m in labels:
            if done[m]:
                continue
            i, t1, t2 = _top2(logits[m])
            chosen[m] = i
            g = gens[m]
            g.tokens.append(i)
            g.top1.append(t1)
            g.margin.append(t1 - t2)
        for a, b in sorted(in_sync):
            ta, tb = chosen.get(a), chosen.get(b)
            if ta is None and tb is None:
                continue  # both stopped on the same tokens
            if ta != tb:
                la, lb, nan = logits[a], logits[b], float("nan")
                ma = gens[a].margin[step] if ta is not None else nan
                mb = gens[b].margin[step] if tb is not None else nan
                both = ta is not None and tb is not None
                ga, gb = (float(la[ta] - la[tb]), float(lb[tb] - lb[ta])) if both else (nan, nan)
                ia, ib = -1 if ta is None else ta, -1 if tb is None else tb
                divs.append(Divergence(a, b, step, ia, ib, ma, mb, ga, gb))
                in_sync.discard((a, b))
        for m, t in chosen.items():
            model, tok = models[m]
            if t in eos_ids(tok) or step == max_tokens - 1:
                done[m] = True
                continue
            out = model(mx.array([[t]]), cache=caches[m])
            logits[m] = np.array(out[0, -1].astype(mx.float32))
        if all(done.values()):
            break
    for m in labels:
        tok = models[m][1]
        gens[m].text = tok.decode([t for t in gens[m].tokens if t not in eos_ids(tok)])
    return gens, divs


def compare_generations(models: Mapping[str, Any], prompts: Sequence[str] | str,
                        max_tokens: int = 32, *, chat: bool = False) -> GenerationReport:
    """Greedy-decode ``prompts`` with every model and report where outputs part.

    ``models``: label -> a model directory, ``(path, adapter_path or None)`` or a loaded
    ``(model, tokenizer)``; the first is the reference. ``max_tokens`` per prompt and
    model (fewer on EOS); ``chat``: use the tokenizer's chat template. A
    :class:`GenerationReport`: text side by side, each model's first divergence from the
    reference with both logit margins there, per-step margins in ``generations``.
    """
    if len(models) < 2:
        raise ArgumentError.bad("models", f"{len(models)} model(s)", "at least two models")
    if isinstance(prompts, str):
        prompts = [prompts]
    loaded = {label: load_pair(label, spec) for label, spec in models.items()}
    # MoE experts on CPU: float32 (MLX's CPU GatherMM has no bf16), said in the summary
    moe = {label: len(moe_float32_on_cpu(m)) for label, (m, _) in loaded.items()}
    # any other op MLX's CPU refuses in the model's dtype: found by trying, whole model f32
    f32 = {label: float32_if_refused(m) for label, (m, _) in loaded.items()}
    labels = list(loaded)
    ref = labels[0]
    rows: List[Dict[str, Any]] = []
    all_gens: List[Dict[str, Generation]] = []
    all_divs: List[List[Divergence]] = []
    flagged: List[int] = []
    n_identical = 0
    for p, prompt in enumerate(prompts):
        gens, divs = _decode_lockstep(loaded, prompt, max_tokens, chat)
        all_gens.append(gens)
        all_divs.append(divs)
        by_other = {d.b: d for d in divs if d.a == ref}
        n_identical += all(gens[m].tokens == gens[ref].tokens for m in labels)
        for m in labels:
            d = by_other.get(m)
            g = gens[m]
            row = {"prompt": p, "model": m, "tokens": len(g.tokens),
                   "diverges_at": None if m == ref or d is None else d.step,
                   "margin": d.margin_b if d else None,
                   "ref_margin": d.margin_a if d else None,
                   "gap": d.gap_b if d else None, "ref_gap": d.gap_a if d else None,
                   "text": g.text}
            if d is not None:
                flagged.append(len(rows))
            rows.append(row)
    summary = {"models": ", ".join(labels), "reference": ref, "prompts": len(prompts),
               "max tokens": max_tokens, "decoding": "greedy (argmax)",
               "prompts with identical outputs": f"{n_identical} of {len(prompts)}"}
    cpu_notes(summary, moe, f32)
    return GenerationReport(title=f"greedy outputs of {len(labels)} models",
                            rows=rows, summary=summary, flagged=flagged,
                            columns="prompt model tokens diverges_at margin ref_margin gap text".split(),
                            generations=all_gens, divergences=all_divs)
