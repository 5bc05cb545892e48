"""``lorakit.extract``: :mod:`lorakit.algebra.extract` with its behaviour line, the
tuned model against base + the extracted adapter (unfused) on the embedded corpus
(:func:`lorakit.compare_outputs`). Both checkpoints must be model folders, else the
summary says it was not measured; ``behaviour=False`` skips it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from ..algebra.extract import ExtractOptions, ExtractReport
from ..algebra.extract import extract as extract_lowrank
from ..progress import Progress
from .behaviour import compare_outputs
from .check import CONTEXT, behaviour_line, behaviour_stats, behaviour_tokens

__all__ = ["extract"]


def extract(base: Any, tuned: Any, options: Optional[ExtractOptions] = None, *,
            save_path: Any = None, force: bool = False, progress: Progress = True,
            **settings: Any) -> ExtractReport:
    """Extract a LoRA adapter from a tuned checkpoint and its base (a truncated SVD per
    module) and score how it behaves: :func:`lorakit.algebra.extract.extract`'s arguments
    (``rank=`` or ``energy=``, ``modules=``...), ``behaviour`` True (1024 tokens, the
    default), a token count or False. An ``ExtractReport`` with ``.behaviour``."""
    opts = ExtractOptions.of(options, settings)
    rep = extract_lowrank(base, tuned, opts, save_path=save_path, force=force,
                          progress=progress)
    tokens = behaviour_tokens(opts.behaviour)
    if tokens:
        add_behaviour(rep, tokens, progress=True if progress is True else None)
    return rep


def add_behaviour(rep: ExtractReport, tokens: int, *, progress: Any = None) -> ExtractReport:
    """Fill ``rep.behaviour`` and the summary's ``behaviour`` line (in place): the tuned
    model (reference) against base + ``rep.adapter`` (test) on ``tokens`` corpus tokens."""
    base, tuned = rep.summary["base"], rep.summary["tuned"]
    if not all((Path(p) / "config.json").is_file() for p in (base, tuned)):
        rep.summary["behaviour"] = "not measured: base and tuned are not both model folders"
        return rep
    out = compare_outputs(tuned, (base, rep.adapter), tokens=tokens,
                          context=min(CONTEXT, tokens), detail=0, progress=progress)
    rep.behaviour = behaviour_stats(out)
    rep.summary["behaviour"] = "tuned vs base + extracted: " + behaviour_line(rep.behaviour)
    return rep
