"""Low-rank approximation: the arithmetic of extract and resize.

:func:`matrix_svd` takes a dense delta: LAPACK's exact SVD in float64 where ``min(out,
in) <= EXACT_MAX``, else a randomized range finder in float32 (Halko, Martinsson & Tropp
2011, Alg. 4.4; the sketch doubles until an energy target is met). :func:`factor_svd`
takes ``scale * B @ A`` from its factors without forming it; :func:`delta_gram` gives
adapters' delta Gram matrices; :func:`choose_rank` picks a rank or an energy cut.

>>> rng = np.random.default_rng(0)
>>> D = rng.normal(size=(40, 3)) @ rng.normal(size=(3, 50))
>>> U, S, Vt, how = matrix_svd(D, rank=3)
>>> how, bool(np.allclose((U * S) @ Vt, D))
('exact', True)
"""
from __future__ import annotations

import math
import numbers
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import ArgumentError
from ..io.adapters.base import Adapter, LoraTarget

__all__ = ["factor_svd", "delta_gram"]

#: largest min(out, in) for which the exact SVD is used
EXACT_MAX = 64
#: extra sketch columns of the randomized SVD
OVERSAMPLE = 16
#: power iterations of the randomized SVD
POWER_ITERS = 2


def choose_rank(S: np.ndarray, total_sq: float, rank: Optional[int] = None,
                energy: Optional[float] = None) -> int:
    """How many singular values to keep: ``rank`` (at most ``len(S)``), or the fewest
    whose squares hold ``energy`` of ``total_sq`` (``||D||_F^2``); 0 for a zero delta.

    >>> choose_rank(np.array([3.0, 2.0, 1.0]), 14.0, energy=0.9)
    2
    """
    if total_sq <= 0 or len(S) == 0:
        return 0
    if rank is not None:
        return min(int(rank), len(S))
    cum = np.cumsum(np.asarray(S, np.float64) ** 2) / total_sq
    k = int(np.searchsorted(cum, float(energy) * (1 - 1e-12))) + 1  # tolerate last-bit noise
    return min(k, len(S))


def check_target(rank: Optional[int], energy: Optional[float]) -> None:
    """Exactly one of ``rank`` (a positive int) and ``energy`` (in (0, 1]) is given."""
    if (rank is None) == (energy is None):
        raise ArgumentError.bad("rank / energy", (rank, energy), "exactly one of rank=R "
                                "and energy=E")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or rank < 1):
        raise ArgumentError.bad("rank", rank, "a positive int")
    if energy is not None and (isinstance(energy, bool) or not isinstance(energy, numbers.Real)
                               or not 0 < energy <= 1):
        raise ArgumentError.bad("energy", energy, "a fraction, 0 < energy <= 1")


def _randomized(D: np.ndarray, width: int, rng: np.random.Generator
                ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Randomized SVD of ``D`` (float32) with a sketch of ``width`` columns."""
    Q, _ = np.linalg.qr(D @ rng.standard_normal((D.shape[1], width), np.float32))
    for _ in range(POWER_ITERS):
        Z, _ = np.linalg.qr(D.T @ Q)
        Q, _ = np.linalg.qr(D @ Z)
    Ub, S, Vt = np.linalg.svd(Q.T @ D, full_matrices=False)
    return Q @ Ub, S, Vt


def matrix_svd(D: np.ndarray, rank: Optional[int] = None, energy: Optional[float] = None,
               *, exact_max: int = EXACT_MAX, seed: int = 0, total: Optional[float] = None
               ) -> Tuple[np.ndarray, np.ndarray, np.ndarray, str]:
    """The leading singular triplets of a dense ``D`` (out, in).

    ``total``: ``||D||_F^2`` if the caller has it (float64). Returns (U, S, Vt, method)
    holding at least the kept rank (more when they come for free); ``method`` is
    ``"exact"`` (float64) or ``"randomized"`` (float32).
    """
    n = min(D.shape)
    if n <= exact_max:
        return (*np.linalg.svd(np.asarray(D, np.float64), full_matrices=False), "exact")
    D32 = np.asarray(D, np.float32)
    rng = np.random.default_rng(seed)
    if total is None:
        total = float(np.einsum("ij,ij->", D, D, dtype=np.float64))
    k = int(rank) if rank is not None else 64
    while True:
        width = min(k + OVERSAMPLE, n)
        if width * 2 > n:  # the sketch is no longer small: the exact SVD is cheaper
            return (*np.linalg.svd(np.asarray(D, np.float64), full_matrices=False), "exact")
        U, S, Vt = _randomized(D32, width, rng)
        S = S.astype(np.float64)
        if rank is not None or total == 0:
            return U, S, Vt, "randomized"
        if choose_rank(S, total, energy=energy) < len(S) or \
                float(np.sum(S ** 2)) >= energy * total * (1 - 1e-12):
            return U, S, Vt, "randomized"
        k *= 2


def factor_svd(A: np.ndarray, B: np.ndarray, scale: float = 1.0
               ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Thin SVD (U, S, Vt) of ``scale * B @ A`` from QR of ``B`` and ``A^T`` and the SVD
    of the r x r core, in float64, never forming the product (one per stacked expert).

    >>> rng = np.random.default_rng(1)
    >>> A, B = rng.normal(size=(4, 30)), rng.normal(size=(20, 4))
    >>> U, S, Vt = factor_svd(A, B, 0.5)
    >>> bool(np.allclose((U * S) @ Vt, 0.5 * B @ A))
    True
    """
    Qb, Rb = np.linalg.qr(np.asarray(B, np.float64))
    Qa, Ra = np.linalg.qr(_t(np.asarray(A, np.float64)))
    Uc, S, Vct = np.linalg.svd(float(scale) * (Rb @ _t(Ra)))
    return Qb @ Uc, S, Vct @ _t(Qa)


def _t(x: np.ndarray) -> np.ndarray:
    """The last two axes swapped (``.T`` of a matrix, per expert of a stack)."""
    return np.swapaxes(x, -1, -2)


def split_factors(U: np.ndarray, S: np.ndarray, Vt: np.ndarray, k: int, scale: float = 1.0
                  ) -> Tuple[np.ndarray, np.ndarray]:
    """Factors ``(A (k, in), B (out, k))`` as float32 with ``scale * B @ A`` the rank-k
    truncation ``U_k S_k Vt_k``: the singular values split evenly (``sqrt(S)`` on each
    side), ``B`` divided by ``scale``."""
    if not math.isfinite(scale) or scale == 0:
        raise ArgumentError.bad("scale", scale, "finite and non-zero")
    root = np.sqrt(S[:k])
    B = (U[:, :k] * root) / float(scale)
    A = root[:, None] * Vt[:k]
    return A.astype(np.float32), B.astype(np.float32)


def delta_gram(adapters: Sequence[Adapter]) -> Dict[str, np.ndarray]:
    """Per module, the n x n Gram matrix ``G[i, j] = <delta_i, delta_j>_F`` of n
    adapters' deltas from their factors (``s_i s_j trace((B_i^T B_j)(A_j A_i^T))``, an
    r x r product; zero where an adapter leaves the module alone). Any weighted sum's
    norm is then ``sqrt(w^T G w)``, without forming a delta."""
    n = len(adapters)
    by_module: Dict[str, List[Optional[LoraTarget]]] = {}
    for i, ad in enumerate(adapters):
        for t in ad.targets:
            by_module.setdefault(t.module, [None] * n)[i] = t
    out: Dict[str, np.ndarray] = {}
    for module, ts in by_module.items():
        G = np.zeros((n, n))
        for i, a in enumerate(ts):
            for j, b in enumerate(ts[: i + 1]):
                if a is None or b is None:
                    continue
                Ba, Bb = a.B.astype(np.float64), b.B.astype(np.float64)
                Aa, Ab = a.A.astype(np.float64), b.A.astype(np.float64)
                g = a.scale * b.scale * float(np.einsum(
                    "...or,...os,...si,...ri->", Ba, Bb, Ab, Aa, optimize=True))
                G[i, j] = G[j, i] = g
        out[module] = G
    return out
