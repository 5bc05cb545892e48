"""``lorakit.resize``: an adapter at a lower rank, from its factors alone.

Each module's delta ``scale * B @ A`` (B (out, r), A (r, in)) is factored by QR of
``B`` and ``A^T`` and the SVD of the r x r core (:func:`lorakit.algebra.lowrank.factor_svd`);
the full delta is never formed. Its best rank-k approximation keeps the k largest
singular values, and the error is exact from the discarded ones:
``||delta - delta_k||_F = sqrt(sum_{i>k} s_i^2)`` (Eckart-Young). Stacked MoE
targets keep one rank for all experts (the largest any expert needs).

DoRA: the low-rank part is resized and the magnitudes are kept. The error in the
rows is the low-rank part's; with ``base=`` each DoRA row also gets ``dora_error``,
``||T_k - T||_F`` of the DoRA-normalised weights (``m * (W + delta) / ||W + delta||``
by rows), which renormalising makes smaller or larger than the low-rank error.

>>> r = resize("data/adapters/lora", rank=4)
>>> r.summary["ranks"], r.rows[0]["rank_before"], r.rows[0]["rank"]
([4], 8, 4)
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np

from ..fusion.delta import intended, target_pieces
from ..io.adapters.load import Adapter, LoraTarget, load_adapter
from ..io.naming import bind
from ..io.source import open_source
from ..io.weights import weight_f64
from ..report import Report
from .extract import save_result
from .lowrank import check_target, choose_rank, factor_svd, split_factors

__all__ = ["ResizeReport", "resize"]


@dataclass(repr=False)
class ResizeReport(Report):
    """Rows: module, expert count, rank_before, rank, fro (``||delta||_F``), error
    (``||delta - delta_k||_F``, exact), rel_error, energy kept, dora_error (DoRA with a
    base). ``adapter``: the resized :class:`~lorakit.io.adapters.base.Adapter`;
    ``singular_values[module]``: each module's spectrum (per expert for MoE)."""
    column_help = {
        "module": "the adapted module",
        "experts": "number of stacked MoE experts (1 for a plain module)",
        "rank_before": "the adapter's rank",
        "rank": "rank kept",
        "fro": "||delta||_F of the adapter's low-rank delta",
        "error": "||delta - delta_k||_F, exact from the discarded singular values",
        "rel_error": "error / fro",
        "energy": "share of ||delta||_F^2 kept",
        "dora_error": "DoRA only, with base=: the error after DoRA's row normalisation",
    }

    adapter: Optional[Adapter] = None
    saved: Optional[Path] = None
    singular_values: Optional[Dict[str, List[np.ndarray]]] = None


def _resize_target(t: LoraTarget, rank: Optional[int], energy: Optional[float]):
    svds = [factor_svd(p.A, p.B, p.scale) for p in target_pieces(t)]
    k = max(choose_rank(S, float(np.sum(S ** 2)), rank, energy) for _, S, _ in svds)
    k = max(k, 1)
    parts = [split_factors(U, S, Vt, k, t.scale) for U, S, Vt in svds]
    if t.kind == "switch":
        A = np.stack([a for a, _ in parts])
        B = np.stack([b for _, b in parts])
    else:
        (A, B), = parts
    fro = math.sqrt(sum(float(np.sum(S ** 2)) for _, S, _ in svds))
    err = math.sqrt(sum(float(np.sum(S[k:] ** 2)) for _, S, _ in svds))
    return replace(t, A=A, B=B), k, fro, err, [S for _, S, _ in svds]


def _dora_error(old: LoraTarget, new: LoraTarget, binds: Dict[str, Any], src) -> float:
    """``||T_new - T_old||_F`` of the DoRA-normalised weights on the base."""
    b = binds[old.module]
    W = weight_f64(src, b.tensor)
    sq = 0.0
    for po, pn in zip(target_pieces(old), target_pieces(new)):
        Ws = W if po.slot is None or W.ndim == 2 else W[po.slot]
        d = intended(Ws, pn) - intended(Ws, po)
        sq += float(np.einsum("ij,ij->", d, d))
    return math.sqrt(sq)


def resize(adapter: Any, *, rank: Optional[int] = None, energy: Optional[float] = None,
           base: Any = None, save_path: Any = None, format: str = "peft",
           force: bool = False) -> ResizeReport:
    """Resize an adapter to rank ``rank`` (or, per module, the fewest singular values
    holding ``energy`` of ``||delta||_F^2``), with the exact error per module.

    Args:
        adapter: an adapter directory (mlx-lm or PEFT) or a loaded Adapter.
        rank / energy: exactly one; a module already at or below ``rank`` keeps its
            delta exactly (re-factored).
        base: optional base checkpoint: DoRA rows then also report ``dora_error``.
        save_path / format / force: also write the result (as :func:`lorakit.extract`).

    Returns:
        A :class:`ResizeReport`; ``.adapter`` is the resized adapter.
    """
    check_target(rank, energy)
    ad = adapter if isinstance(adapter, Adapter) else load_adapter(adapter)
    src = open_source(base) if base is not None else None
    binds = {b.target.module: b for b in bind(ad, src)} if src is not None and ad.is_dora \
        else {}
    targets: List[LoraTarget] = []
    rows: List[Dict[str, Any]] = []
    spectra: Dict[str, List[np.ndarray]] = {}
    for t in ad.targets:
        new, k, fro, err, Ss = _resize_target(t, rank, energy)
        targets.append(new)
        spectra[t.module] = Ss
        row: Dict[str, Any] = {
            "module": t.module, "experts": len(Ss) if t.kind == "switch" else "-",
            "rank_before": t.rank, "rank": k, "fro": fro, "error": err,
            "rel_error": err / fro if fro else 0.0,
            "energy": 1 - (err / fro) ** 2 if fro else 1.0, "dora_error": "-"}
        if t.is_dora and binds:
            row["dora_error"] = _dora_error(t, new, binds, src)
        rows.append(row)
    out = replace(ad, targets=targets, _sha256=None)
    out.config = dict(ad.config, resized={"rank": rank, "energy": energy})
    h = hashlib.sha256(str(ad.path).encode())
    for t in targets:
        h.update(t.module.encode() + t.A.tobytes() + t.B.tobytes())
    out._sha256 = h.hexdigest()
    summary: Dict[str, Any] = {
        "adapter": str(ad.path), "target": f"rank {rank}" if rank is not None
        else f"energy {energy}", "modules": len(rows),
        "ranks": sorted({r["rank"] for r in rows}),
        "max rel_error": max((r["rel_error"] for r in rows), default=0.0),
        "dora": "low-rank part resized, magnitudes kept" if ad.is_dora else "no",
        "method": "QR of B and A^T, SVD of the r x r core (full delta never formed)",
    }
    rep = ResizeReport(f"resize: {ad.path.name}", rows, summary=summary, adapter=out,
                       singular_values=spectra)
    if save_path is not None:
        rep.saved = save_result(out, save_path, format=format, force=force, verb="resize",
                                provenance={"source": str(ad.path),
                                            "target": summary["target"]})
        rep.summary["saved to"] = str(rep.saved)
    return rep
