"""Adapter against adapter: do two fine-tunes change the same weights the same way?

Per module both adapters touch, from the factors only: the delta norms, the cosine of
the deltas (``s1 s2 trace((B1^T B2)(A2 A1^T))``: an r1 x r2 product) and the principal
angles between their column and row spaces.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ..algebra.lowrank import factor_svd
from ..fusion.delta import target_pieces
from ..io.adapters.base import Adapter, LoraTarget
from ..io.adapters.load import load_adapter
from ..io.adapters.naming import strip_prefix
from ..io.formats import source
from ..layers import split_name
from ..report import Report
from . import plots
from .deltas import layer_kind_grid, numerical_rank, slots_norm, weight_slots

__all__ = ["AdapterComparison", "compare_adapters"]

_NUMBERS = "fro_a fro_b cosine col_angle col_overlap row_angle row_overlap".split()

def delta_inner(A1: np.ndarray, B1: np.ndarray, s1: float, A2: np.ndarray, B2: np.ndarray,
                s2: float) -> float:
    """Frobenius inner product <s1 B1 A1, s2 B2 A2> without forming either product."""
    B1, B2 = np.asarray(B1, np.float64), np.asarray(B2, np.float64)
    A1, A2 = np.asarray(A1, np.float64), np.asarray(A2, np.float64)
    return float(s1 * s2 * np.trace((B1.T @ B2) @ (A2 @ A1.T)))


def principal_angles(U1: np.ndarray, U2: np.ndarray) -> np.ndarray:
    """Principal angles (degrees, ascending) between the spans of two orthonormal bases."""
    if U1.shape[1] == 0 or U2.shape[1] == 0:
        return np.zeros(0)
    c = np.linalg.svd(U1.T @ U2, compute_uv=False)
    return np.degrees(np.arccos(np.clip(c, 0.0, 1.0)))


@dataclass(repr=False)
class AdapterComparison(Report):
    """A row per module; ``col_angles[i]`` / ``row_angles[i]``: row i's principal angles."""

    column_help = {
        "module": "the adapted module",
        "expert": "expert number in a mixture-of-experts layer",
        "status": "both, only in A or only in B",
        "fro_a": "||dW||_F of adapter A's delta on this module",
        "fro_b": "||dW||_F of adapter B's delta",
        "rel_a": "||dW||_F / ||W||_F for A: its change relative to the base weight",
        "rel_b": "||dW||_F / ||W||_F for B",
        "cosine": "cosine similarity of the two deltas (1 = same, 0 = unrelated, "
                  "-1 = opposite)",
        "col_angle": "smallest angle (degrees) between the deltas' column spaces",
        "col_overlap": "mean cos^2 of the column-space angles (1 = same subspace, "
                       "0 = orthogonal)",
        "row_angle": "smallest angle (degrees) between the deltas' row spaces",
        "row_overlap": "mean cos^2 of the row-space angles (1 = same, 0 = orthogonal)",
    }

    col_angles: List[np.ndarray] = field(default_factory=list)
    row_angles: List[np.ndarray] = field(default_factory=list)

    def plot(self, value: str = "norms", ax=None):
        """``norms``: side-by-side bars of ||dW||_F per target (relative with a base);
        ``cosine`` / ``col_overlap`` / ``row_overlap``: layer x kind heatmaps."""

        both = [r for r in self.rows if r["status"] == "both"]
        if value == "norms":
            rel = all(r.get("rel_a") is not None for r in both) and both
            ka, kb = ("rel_a", "rel_b") if rel else ("fro_a", "fro_b")
            names = [r["module"] + (f"[{r['expert']}]" if r["expert"] is not None else "")
                     for r in both]
            return plots.grouped_bars(names, {f"A: {self.summary['A']}": [r[ka] for r in both],
                                              f"B: {self.summary['B']}": [r[kb] for r in both]},
                                      title=self.title,
                                      ylabel="||dW||_F / ||W||_F" if rel else "||dW||_F",
                                      ax=ax)
        labels, kinds, grid = _mean_grid(both, value)
        lo = -1.0 if value == "cosine" else 0.0
        return plots.value_heatmap(labels, kinds, grid, title=f"{value}: {self.title}",
                                   cbar=value, ax=ax, cmap="coolwarm" if lo < 0 else "viridis",
                                   vmin=lo, vmax=1.0)

    figure = plot


def _mean_grid(rows: List[Dict[str, Any]], key: str) -> Tuple[List[str], List[str], np.ndarray]:
    """Mean of ``key`` per layer x kind (experts averaged)."""
    labels, kinds, _ = layer_kind_grid(rows, "fro_a")
    acc: Dict[Tuple[str, str], List[float]] = {}
    for r in rows:
        if r.get(key) is None:
            continue
        lab = "-" if r["layer"] is None else str(r["layer"])
        acc.setdefault((lab, r["kind"]), []).append(float(r[key]))
    grid = np.full((len(labels), len(kinds)), np.nan)
    for i, lab in enumerate(labels):
        for j, k in enumerate(kinds):
            if (lab, k) in acc:
                grid[i, j] = float(np.mean(acc[(lab, k)]))
    return labels, kinds, grid


def _parts(ad: Adapter) -> Dict[Tuple[str, Optional[int]], Tuple[LoraTarget, np.ndarray,
                                                                 np.ndarray]]:
    out = {}
    for t in ad.targets:
        for p in target_pieces(t):
            out[(strip_prefix(t.module), p.expert)] = (t, p.A, p.B)
    return out


def compare_adapters(a: Any, b: Any, checkpoint: Any = None, *,
                     rtol: Optional[float] = None) -> AdapterComparison:
    """Compare two adapters (mlx-lm or PEFT, mixed is fine) of one base, module by module,
    from their factors. A base ``checkpoint`` adds ||dW|| / ||W|| per side; ``rtol``: the
    numerical rank's tolerance that sets each subspace's dimension."""
    ada = a if isinstance(a, Adapter) else load_adapter(a)
    adb = b if isinstance(b, Adapter) else load_adapter(b)
    src = source.open(checkpoint) if checkpoint is not None else None
    slots_a = weight_slots(ada, src) if src is not None else {}
    pa, pb = _parts(ada), _parts(adb)
    keys = list(pa) + [k for k in pb if k not in pa]
    rows: List[Dict[str, Any]] = []
    col_angles: List[np.ndarray] = []
    row_angles: List[np.ndarray] = []
    wnorm: Dict[Tuple[str, Optional[int]], float] = {}
    for key in keys:
        module, expert = key
        layer, kind, _, _ = split_name(module)
        row: Dict[str, Any] = dict(module=module, layer=layer, kind=kind, expert=expert,
                                   status="both", **dict.fromkeys(_NUMBERS))
        ca = ra = np.zeros(0)
        svds = {}
        for side, parts in (("a", pa), ("b", pb)):
            if key in parts:
                t, A, B = parts[key]
                U, S, Vt = factor_svd(A, B, t.scale)
                k = numerical_rank(S, (B.shape[0], A.shape[1]), rtol)
                svds[side] = (t, A, B, U[:, :k], Vt[:k].T)
                row[f"fro_{side}"] = float(math.sqrt(float((S * S).sum())))
                row[f"rank_{side}"] = int(A.shape[0])
        if "a" not in svds or "b" not in svds:
            row["status"] = "only in A" if "a" in svds else "only in B"
        else:
            ta, A1, B1, U1, V1 = svds["a"]
            tb, A2, B2, U2, V2 = svds["b"]
            if B1.shape[0] != B2.shape[0] or A1.shape[1] != A2.shape[1]:
                row["status"] = "shape mismatch"
            else:
                inner = delta_inner(A1, B1, ta.scale, A2, B2, tb.scale)
                den = row["fro_a"] * row["fro_b"]
                row["cosine"] = inner / den if den > 0 else None
                ca, ra = principal_angles(U1, U2), principal_angles(V1, V2)
                for space, ang in (("col", ca), ("row", ra)):
                    if ang.size:
                        row[f"{space}_angle"] = float(ang[0])
                        row[f"{space}_overlap"] = float((np.cos(np.radians(ang)) ** 2).mean())
        if src is not None:
            t = (svds.get("a") or svds.get("b"))[0]
            owner = ada if "a" in svds else adb
            slots = slots_a if owner is ada else weight_slots(adb, src)
            key = tuple(slots[(t.module, expert)])
            if key not in wnorm:
                wnorm[key] = slots_norm(src, list(key))
            w = wnorm[key]
            for side in ("a", "b"):
                f = row[f"fro_{side}"]
                row[f"rel_{side}"] = f / w if f is not None and w > 0 else None
        rows.append(row)
        col_angles.append(ca)
        row_angles.append(ra)
    both = [r for r in rows if r["status"] == "both" and r["cosine"] is not None]
    cos = np.array([r["cosine"] for r in both]) if both else np.zeros(0)
    summary: Dict[str, Any] = {
        "A": ada.path.name, "B": adb.path.name,
        "modules in both": len(both),
        "only in A": sum(r["status"] == "only in A" for r in rows),
        "only in B": sum(r["status"] == "only in B" for r in rows),
        "mean cosine": float(cos.mean()) if cos.size else None,
        "min cosine": float(cos.min()) if cos.size else None,
        "max cosine": float(cos.max()) if cos.size else None,
    }
    if both:
        # overall cosine of the concatenated deltas: energy-weighted, as one vector
        num = sum(r["cosine"] * r["fro_a"] * r["fro_b"] for r in both)
        den = math.sqrt(sum(r["fro_a"] ** 2 for r in both) * sum(r["fro_b"] ** 2 for r in both))
        summary["overall cosine"] = num / den if den > 0 else None
    cols = ["module", "status", *_NUMBERS]
    if any(r["expert"] is not None for r in rows):
        cols.insert(1, "expert")
    if src is not None:
        cols[cols.index("fro_b") + 1:cols.index("fro_b") + 1] = ["rel_a", "rel_b"]
    flagged = [i for i, r in enumerate(rows) if r["status"] != "both"]
    return AdapterComparison(title=f"adapters {ada.path.name} vs {adb.path.name}", rows=rows,
                             columns=cols, summary=summary, flagged=flagged,
                             col_angles=col_angles, row_angles=row_angles)
