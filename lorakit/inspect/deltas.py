"""How large each adapter delta is: norms, spectra and ranks, from the factors alone.

``dW = s * B @ A`` has rank <= r: with thin QRs ``B = Qb Rb`` and ``A^T = Qa Ra``, its
singular values are those of the r x r core ``s Rb Ra^T``, so the out x in matrix is
never formed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .. import numerics as nm
from ..algebra.lowrank import factor_svd
from ..fusion.delta import target_pieces
from ..io.adapters.base import Adapter
from ..io.adapters.layout import switch_parts
from ..io.adapters.load import load_adapter
from ..io.adapters.naming import bind
from ..io.formats import source
from ..io.formats.source import TensorSource
from ..io.formats.weights import weight_f64
from ..layers import layer_kind_cells, split_name
from ..report import Report
from . import plots

__all__ = ["delta_norms"]

_EPS32 = float(np.finfo(np.float32).eps)


def effective_rank(S: np.ndarray) -> float:
    """Entropy effective rank exp(H(p)), p = S / sum(S) (Roy & Vetterli, 2007): k for k
    equal non-zero singular values, less when they decay."""
    S = np.asarray(S, np.float64)
    total = S.sum()
    if total <= 0:
        return 0.0
    p = S[S > 0] / total
    return float(round(math.exp(-(p * np.log(p)).sum()), 12))


def numerical_rank(S: np.ndarray, shape: Tuple[int, ...], rtol: Optional[float] = None) -> int:
    """Singular values above ``rtol * S[0]``; the default rtol is numpy's matrix_rank
    tolerance for float32 data, ``max(out, in) * eps32`` (the factors are float32)."""
    S = np.asarray(S, np.float64)
    if not S.size or S[0] <= 0:
        return 0
    tol = (max(shape[-2:]) * _EPS32) if rtol is None else rtol
    return int((S > tol * S[0]).sum())


def _weight_norm(src: TensorSource, tensor: str, expert: Optional[int]) -> float:
    module = tensor[: -len(".weight")]
    if src.quant_params(module) is not None:
        w = weight_f64(src, tensor)
        return float(np.linalg.norm(w[expert] if expert is not None else w))
    shape = src.tensors[tensor].shape
    if expert is not None:
        return float(np.linalg.norm(weight_f64(src, tensor, slice(expert, expert + 1))))
    total = 0.0
    for rows in nm.chunks(shape[0], int(np.prod(shape[1:], dtype=np.int64))):
        w = weight_f64(src, tensor, rows)
        total += float(np.einsum("ij,ij->", w, w)) if w.ndim == 2 else float((w * w).sum())
    return math.sqrt(total)


def weight_slots(adapter: Adapter, src: TensorSource
                 ) -> Dict[Tuple[str, Optional[int]], List[Tuple[str, Optional[int]]]]:
    """(target module, target expert) -> the (checkpoint tensor, slice of it or None) it
    changes (two for a fused gate_up_proj landing on gate_proj and up_proj)."""
    origin = {p.module: t.module for t in adapter.targets for p in switch_parts(t)}
    out: Dict[Tuple[str, Optional[int]], List[Tuple[str, Optional[int]]]] = {}
    for b in bind(adapter, src):
        t = b.target
        m = origin.get(t.module, t.module)
        if b.target_expert is not None:
            out.setdefault((m, b.target_expert), []).append((b.tensor, None))
        elif b.weight_expert is not None:
            out.setdefault((m, None), []).append((b.tensor, b.weight_expert))
        elif t.kind == "switch":
            for e in range(t.A.shape[0]):
                out.setdefault((m, e), []).append((b.tensor, e))
        else:
            out.setdefault((m, None), []).append((b.tensor, None))
    return out


def slots_norm(src: TensorSource, slots: List[Tuple[str, Optional[int]]]) -> float:
    """The Frobenius norm of the weight (slices) a target changes."""
    return math.sqrt(sum(_weight_norm(src, t, e) ** 2 for t, e in slots))


def layer_kind_grid(rows: List[Dict[str, Any]], num: str, den: Optional[str] = None
                    ) -> Tuple[List[str], List[str], np.ndarray]:
    """Aggregate rows into a layer x kind grid: root-sum-square of ``num`` per cell,
    divided by that of ``den`` when given (so experts of one layer pool correctly)."""
    def present(r: Dict[str, Any]) -> bool:
        v = r.get(num)
        return v is not None and not (isinstance(v, float) and math.isnan(v))

    labels, ks, cells = layer_kind_cells([r for r in rows if present(r)])
    acc: Dict[Tuple[str, str], List[float]] = {}
    for key, rs in cells.items():
        a = acc[key] = [sum(float(r[num]) ** 2 for r in rs), 0.0]
        if den is not None:
            a[1] = sum(float(r[den]) ** 2 if r.get(den) is not None else float("nan")
                       for r in rs)
    grid = np.full((len(labels), len(ks)), np.nan)
    for i, lab in enumerate(labels):
        for j, k in enumerate(ks):
            a = acc.get((lab, k))
            if a is not None:
                grid[i, j] = math.sqrt(a[0]) / math.sqrt(a[1]) if den else math.sqrt(a[0])
    return labels, ks, grid


@dataclass(repr=False)
class DeltaNorms(Report):
    """Per-target delta norms; ``singular_values[i]`` holds row i's spectrum."""

    column_help = {
        "module": "the adapted module (the delta dW = scale x B @ A lands on its weight)",
        "expert": "expert number in a mixture-of-experts layer",
        "shape": "shape of dW (out, in)",
        "rank": "the adapter's rank r for this module",
        "fro": "Frobenius norm ||dW||_F: the size of the change",
        "rel": "||dW||_F / ||W||_F: the change relative to the base weight",
        "spectral": "largest singular value ||dW||_2",
        "erank": "effective rank (entropy of the singular values): how many directions "
                 "really carry the change",
        "nrank": "numerical rank: singular values above float noise (<= rank)",
    }

    singular_values: List[np.ndarray] = field(default_factory=list)

    def plot(self, value: Optional[str] = None, ax=None, log: bool = True):
        """Heatmap (layers x kinds) of ``rel`` (with a base) or ``fro``; or
        ``value="spectra"`` for the singular value spectra."""

        if value == "spectra":
            return self.plot_spectra(ax=ax)
        value = value or ("rel" if any(r.get("rel") is not None for r in self.rows) else "fro")
        den = "w_fro" if value == "rel" else None
        labels, kinds, grid = layer_kind_grid(self.rows, "fro" if value == "rel" else value, den)
        names = {"rel": "||dW||_F / ||W||_F", "fro": "||dW||_F", "spectral": "||dW||_2",
                 "erank": "effective rank"}
        return plots.value_heatmap(labels, kinds, grid, title=self.title,
                                   cbar=names.get(value, value), ax=ax,
                                   log=log and value != "erank")

    def plot_spectra(self, ax=None, limit: int = 24):
        curves = [(r["module"] + (f"[{r['expert']}]" if r["expert"] is not None else ""), s)
                  for r, s in zip(self.rows, self.singular_values)]
        return plots.spectra(curves, title=f"singular values: {self.title}", ax=ax, limit=limit)


def delta_norms(adapter: Any, checkpoint: Any = None, *, rtol: Optional[float] = None
                ) -> DeltaNorms:
    """Norms, spectra and ranks of every delta ``dW = scale * B @ A`` of an adapter (for
    DoRA, of the low-rank part). A base ``checkpoint`` adds ``||W||_F`` and
    ``||dW||_F / ||W||_F``; ``rtol``: the numerical rank's tolerance.

    >>> n = delta_norms("data/adapters/lora", "data/tiny-qwen3")
    >>> n.summary["targets"], n.summary["largest ||dW||_F"]
    (28, 'model.layers.2.self_attn.q_proj')
    """
    ad = adapter if isinstance(adapter, Adapter) else load_adapter(adapter)
    src = source.open(checkpoint) if checkpoint is not None else None
    slots = weight_slots(ad, src) if src is not None else {}
    rows: List[Dict[str, Any]] = []
    spectra: List[np.ndarray] = []
    for t in ad.targets:
        for p in target_pieces(t):
            expert, A, B, mag = p.expert, p.A, p.B, p.magnitude
            _, S, _ = factor_svd(A, B, t.scale)
            layer, kind, _, _ = split_name(t.module)
            shape = (int(B.shape[0]), int(A.shape[1]))
            fro = float(math.sqrt(float((S * S).sum())))
            row: Dict[str, Any] = {
                "module": t.module, "layer": layer, "kind": kind, "expert": expert,
                "shape": list(shape), "rank": int(A.shape[0]), "scale": t.scale,
                "fro": fro, "spectral": float(S[0]) if S.size else 0.0,
                "erank": effective_rank(S), "nrank": numerical_rank(S, shape, rtol),
                "dora": mag is not None,
            }
            if src is not None:
                w = slots_norm(src, slots[(t.module, expert)])
                row["w_fro"] = w
                row["rel"] = fro / w if w > 0 else float("inf")
            rows.append(row)
            spectra.append(S)
    fros = np.array([r["fro"] for r in rows])
    summary: Dict[str, Any] = {
        "adapter": str(ad.path), "format": ad.format, "type": ad.fine_tune_type,
        "targets": len(ad.targets), "rows": len(rows),
        "total ||dW||_F": float(math.sqrt(float((fros ** 2).sum()))),
        "largest ||dW||_F": rows[int(fros.argmax())]["module"] if rows else "",
    }
    cols = ["module", "expert", "shape", "rank", "fro", "spectral", "erank", "nrank"]
    if src is not None:
        rels = np.array([r["rel"] for r in rows])
        summary["base"] = str(src.path) if src.path is not None else src.label
        summary["median rel"] = float(np.median(rels))
        summary["max rel"] = float(rels.max())
        cols.insert(5, "rel")
    if not any(r["expert"] is not None for r in rows):
        cols.remove("expert")
    return DeltaNorms(title=f"delta norms of {ad.path.name}", rows=rows, columns=cols,
                      summary=summary, singular_values=spectra)
