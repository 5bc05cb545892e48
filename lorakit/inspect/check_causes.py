"""Why a merge is wrong: the fused weight tested against the weights other mistakes make.

A tensor past the rounding bound is compared, in the bound's units, with the exact
result of each named mistake; the nearest within the bound names the cause. When none
fits, ``F - W`` is fitted as ``k`` times the intended delta and the rest read: within
the bound ``wrong scale``, of low rank ``another adapter``, of full rank with ``k`` near
1 ``different base``, else ``changed otherwise``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from ..fusion.delta import Piece, intended

__all__ = []

#: (name, detail, build(W, rows) -> T_h, piece whose bound applies or None, bound factor)
Candidate = Tuple[str, str, Callable[[np.ndarray, Optional[slice]], np.ndarray],
                  Optional[Piece], float]

_LOW_RANK_ENERGY = 0.9
_SAMPLE_ROWS = 512


def scaled(p: Piece, k: float) -> Piece:
    return dataclasses.replace(p, target=dataclasses.replace(p.target, scale=p.scale * k))


def _factors(p: Piece) -> List[Tuple[float, str]]:
    r = p.A.shape[0]
    out = [(0.0, ""), (2.0, "x2"), (0.5, "x0.5"),
           (float(r), f"x{r} = r: alpha used as the scale instead of alpha/r"),
           (1.0 / r, f"x1/{r} = 1/r: the scale divided by the rank once more"),
           (math.sqrt(r), f"x{math.sqrt(r):.3g} = sqrt(r): rsLoRA's alpha/sqrt(r) instead "
                          "of alpha/r"),
           (1 / math.sqrt(r), f"x{1 / math.sqrt(r):.3g} = 1/sqrt(r): alpha/r instead of "
                              "rsLoRA's alpha/sqrt(r)"),
           (-1.0, "x-1: the delta subtracted")]
    if np.ndim(p.scale) == 0 and p.scale not in (0, 1):  # one scale (not per rank column)
        out.append((1.0 / p.scale, f"x{1 / p.scale:.3g} = 1/scale: B @ A added without "
                                   "its scale"))
    seen, kept = set(), []
    for k, why in out[1:]:
        key = round(k, 9)
        if key not in seen and key != 1.0:
            seen.add(key)
            kept.append((k, why))
    return kept


def candidates(p: Piece, rnd: Callable[[np.ndarray], np.ndarray]) -> List[Candidate]:
    """The named mistakes for one piece (see the module docstring); ``rnd`` rounds to the
    stored format (applying twice fuses into the first fuse's rounded result, which is
    what tells it from a scale of 2 for LoRA)."""
    out: List[Candidate] = [("not applied", "the fused weight is the base",
                             lambda W, rows: W, None, 1.0),
                            ("applied twice", "the adapter fused into an already fused weight",
                             lambda W, rows: intended(rnd(intended(W, p, rows)), p, rows),
                             None, 2.0)]
    for k, why in _factors(p):
        q = scaled(p, k)
        out.append(("wrong scale", why, lambda W, rows, q=q: intended(W, q, rows), q, 1.0))
    if p.magnitude is not None:
        q = dataclasses.replace(p, magnitude=None)
        out.append(("DoRA magnitude missing", "W + scale * B @ A without the rescaling to m",
                    lambda W, rows, q=q: intended(W, q, rows), q, 1.0))
    out_dim, in_dim = p.shape
    if out_dim == in_dim and p.magnitude is None:
        # (B @ A)^T = A^T @ B^T: a piece of its own, so the bound is the transposed sum's
        t = dataclasses.replace(p, A=p.B.T, B=p.A.T)
        out.append(("transposed", "the delta added as (B @ A)^T",
                    lambda W, rows, t=t: intended(W, t, rows), t, 1.0))
    return out


@dataclasses.dataclass
class CauseStats:
    """Sums over one failing tensor, read in a second pass."""

    names: List[Tuple[str, str]]
    sq: np.ndarray  # per candidate: sum ((F - T_h) / its own bound)^2 (fits if RMS <= 1)
    sq_common: np.ndarray  # the same over the intended result's bound (ranks candidates)
    n: int = 0
    RR: float = 0.0  # weighted sums for the fitted factor: <R,R>, <R,D>, <D,D> / bound^2
    RD: float = 0.0
    DD: float = 0.0
    rank: int = 0
    R_sample: Optional[np.ndarray] = None
    D_sample: Optional[np.ndarray] = None

    @classmethod
    def start(cls, cands: List[Candidate], rank: int) -> "CauseStats":
        return cls([(c[0], c[1]) for c in cands], np.zeros(len(cands)), np.zeros(len(cands)),
                   rank=rank)

    def add(self, F, W, T, tol, cands: List[Candidate], rows, bound_of: Callable) -> None:
        for i, (_, _, build, q, factor) in enumerate(cands):
            Th = build(W, rows)
            t = bound_of(Th, q) if q is not None else tol * factor
            self.sq[i] += float(np.sum(np.square((F - Th) / t)))
            self.sq_common[i] += float(np.sum(np.square((F - Th) / tol)))
        self.n += F.size
        R, D = F - W, T - W
        w = 1.0 / np.square(tol)
        self.RR += float(np.sum(R * R * w))
        self.RD += float(np.sum(R * D * w))
        self.DD += float(np.sum(D * D * w))
        if self.R_sample is None:
            self.R_sample, self.D_sample = R[:_SAMPLE_ROWS], D[:_SAMPLE_ROWS]

    def fitted(self) -> float:
        return self.RD / self.DD if self.DD > 0 else 0.0


def _low_rank(E: np.ndarray, rank: int) -> Optional[bool]:
    """Whether E's energy sits in its top 2*rank singular values (None: too small to tell)."""
    k = 2 * max(rank, 1)
    if min(E.shape) < 4 * k:
        return None
    s = np.linalg.svd(E, compute_uv=False)
    total = float(np.sum(s * s))
    return total > 0 and float(np.sum(s[:k] ** 2)) >= _LOW_RANK_ENERGY * total


def diagnose(st: CauseStats,
             scaled_rms: Optional[Callable[[float], Tuple[float, float]]] = None,
             k_scale: Optional[float] = None) -> Tuple[str, str, Dict[str, float]]:
    """(verdict, detail, numbers) for a tensor that failed its bound. DoRA (not linear in
    the scale) passes ``k_scale``, the fitted factor, and ``scaled_rms(k)``: the RMS
    distance at a factor refined from ``k``, and that factor."""
    n = max(1, st.n)
    rms = np.sqrt(st.sq / n)
    common = np.where(rms <= 1.0, np.sqrt(st.sq_common / n), np.inf)
    best = int(np.argmin(common)) if rms.size else -1
    k = st.fitted()
    corr = st.RD / math.sqrt(st.RR * st.DD) if st.RR > 0 and st.DD > 0 else 0.0
    resid = max(0.0, st.RR - 2 * k * st.RD + k * k * st.DD)  # sum ((R - k D) / bound)^2
    fit_rms = math.sqrt(resid / n)
    nums = {"fit": k, "corr": corr, "fit_rms": fit_rms}
    # k differs from 1 by more than its own noise (the bound-weighted fit's sigma)
    k_real = st.DD > 0 and abs(k - 1) > 4 / math.sqrt(st.DD)
    if scaled_rms is not None and k_scale is not None:
        k, k_real = k_scale, abs(k_scale - 1) > 1e-4
        nums["fit"] = k
        if k_real and not (best >= 0 and np.isfinite(common[best])):
            fit_rms, k = scaled_rms(k)
            nums.update(fit_rms=fit_rms, fit=k)
    if best >= 0 and np.isfinite(common[best]) and \
            not (k_real and fit_rms <= 1.0 and fit_rms < 0.8 * common[best]):
        name, why = st.names[best]
        nums["candidate_rms"] = float(rms[best])
        return name, why, nums
    if fit_rms <= 1.0:
        if k_real:
            return "wrong scale", f"x{k:.4g} (fitted: the change is the delta times {k:.4g})", \
                nums
        return "changed otherwise", (f"the delta is there (x{k:.4f}), but "
                                     "some elements lie beyond what rounding explains"), nums
    low = None
    if st.R_sample is not None and st.D_sample is not None:
        low = _low_rank(st.R_sample - k * st.D_sample, st.rank)
    if low:
        return "another adapter", (f"a low-rank change sharing {k:.2f} of the intended delta "
                                   f"(correlation {corr:.2f})"), nums
    if abs(k - 1) < 0.25:  # "different base" when most tensors look so (check)
        nums["base_like"] = 1.0
        return "changed otherwise", (f"the intended delta is there (x{k:.2f}) on top of a "
                                     "full-rank change"), nums
    return "changed otherwise", f"fitted x{k:.3g} of the delta, correlation {corr:.2f}", nums
