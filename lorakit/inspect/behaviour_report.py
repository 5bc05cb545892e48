"""The report of :func:`lorakit.compare_outputs`: KL statistics, top-1 agreement,
perplexities, the tokens where the models part most, and the raw per-token arrays."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import numpy as np

from .report import Report, _jsonable
from . import plots

__all__ = ["BehaviourReport", "STAT_KEYS"]

#: the summary numbers, in the order the JSON and the text twin give them
STAT_KEYS = ("mean_kl", "median_kl", "p90_kl", "p99_kl", "p999_kl", "max_kl",
             "top1_agreement", "top1_agreement_strict", "ppl_ref", "ppl_test", "tokens")


def _piece(tokenizer: Any, i: int) -> str:
    return tokenizer.decode([int(i)])


def _shown(piece: str) -> str:
    """A token as one visible table cell: quoted (Python repr) when it has whitespace
    at an end or unprintable characters."""
    plain = piece and piece.isprintable() and piece.strip() == piece
    return piece if plain else repr(piece)


@dataclass(repr=False)
class BehaviourReport(Report):
    """KL(P_ref || P_test) per scored token, summarised.

    Attributes (besides :class:`Report`'s): ``stats`` (``mean_kl`` ... ``tokens``),
    ``arrays`` (per scored token, corpus order: ``kl``, ``ref_top1``, ``test_top1``,
    ``ref_nll``, ``test_nll``, ``top1_agree`` (one argmax among the other model's tied
    top tokens), ``target``; and both models' top candidates for the first scored
    tokens: ``ref_top_ids`` / ``ref_top_logp`` / ``test_top_ids`` / ``test_top_logp``),
    ``pieces`` (the decoded target token of each detailed position), ``ref_top_pieces``
    / ``test_top_pieces`` (decoded top candidates), ``context``.
    """

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

    def __getattr__(self, name: str) -> Any:  # rep.mean_kl, rep.top1_agreement, ...
        stats = self.__dict__.get("stats") or {}
        if name in stats:
            return stats[name]
        raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")

    @classmethod
    def build(cls, arrays: Dict[str, np.ndarray], *, reference: str, test: str, corpus: str,
              corpus_sha256: str, context: int, corpus_tokens: int, tokenizer: Any = None,
              worst: int = 10) -> "BehaviourReport":
        kl = arrays["kl"].astype(np.float64)
        n = int(kl.size)
        stats: Dict[str, Any] = {
            "mean_kl": float(kl.mean()),
            "median_kl": float(np.median(kl)),
            "p90_kl": float(np.percentile(kl, 90)),
            "p99_kl": float(np.percentile(kl, 99)),
            "p999_kl": float(np.percentile(kl, 99.9)),
            "max_kl": float(kl.max()),
            "top1_agreement": float(np.mean(arrays["top1_agree"])),
            "top1_agreement_strict": float(np.mean(arrays["ref_top1"] == arrays["test_top1"])),
            "ppl_ref": math.exp(float(arrays["ref_nll"].astype(np.float64).mean())),
            "ppl_test": math.exp(float(arrays["test_nll"].astype(np.float64).mean())),
            "tokens": n,
        }
        dec = (lambda i: _piece(tokenizer, i)) if tokenizer is not None else str
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
        summary = {"reference": reference, "test": test, "corpus": corpus,
                   "corpus_sha256": corpus_sha256, "corpus_tokens": corpus_tokens,
                   "context": context, "windows": n // max(context - 1, 1), **stats}
        return cls(title=f"behaviour: KL(reference || test) over {n} tokens", rows=rows,
                   summary=summary, stats=stats, arrays=arrays, pieces=pieces,
                   ref_top_pieces=rtp, test_top_pieces=ttp, context=context)

    def to_dict(self, per_token: bool = False) -> Dict[str, Any]:
        """The summary keys flat (``mean_kl``, ..., ``tokens``, ``context``, ``corpus``,
        ``corpus_sha256``, ``reference``, ``test``), the worst tokens as ``rows``, and
        with ``per_token=True`` the raw per-token arrays."""
        d = dict(self.summary)
        d["models"] = {"reference": self.summary["reference"], "test": self.summary["test"]}
        d["title"] = self.title
        d["rows"] = self.rows
        if per_token:
            d["per_token"] = {k: v for k, v in self.arrays.items()}
        return _jsonable(d)

    def plot(self, ax=None):
        """KL distribution (histogram, log scale) and KL along the text."""
        return plots.kl_figure(self.arrays["kl"], self.context, title=self.title, ax=ax)

    figure = plot
