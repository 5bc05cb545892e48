"""Refit extracted LoRA factors so that fusing them gives the tuned checkpoint back.

A checkpoint fused from a rank-r adapter holds ``T = round(W + delta)``. The rank-r
SVD of ``T - W = delta + e`` (``e`` the rounding error) keeps the part of ``e`` that
lies in the delta's own row and column spaces, so ``round(W + D_r)`` differs from
``T`` wherever ``W + delta`` sat near a rounding boundary, and by many ulps where the
sum nearly cancels (the ulp of ``T`` is far below the ulp of ``W`` there).

:func:`refine_factors` looks for rank-r float32 factors with ``W + B @ A`` inside the
*rounding box* of every element: the values that round to ``T`` (half the spacing on
each side; the spacing towards zero halves at a power of two, :func:`rounding_box`).
It minimises the squared distance of ``W + B A`` outside a box shrunk to
``MARGIN`` (31/64) of the half spacings, weighted by ``(ulp(T) / max ulp)**-p``, by
alternating damped Gauss-Newton steps on the rows of ``B`` (``A`` fixed: each row is
an r-variable least-squares problem over its violating elements) and the columns of
``A``. ``p`` ramps from 0 (absolute distances: the bulk of the elements first) to 2
(distances in ulps of ``T``: the near-cancelling elements last) over ``RAMP``
iterations. A step is kept per row (column) only if it lowers that row's (column's)
loss; the factors are rounded to float32 after every step, so the count is that of
the stored adapter. The normal equations are built from the violating elements only
(``bincount`` over them); each iteration streams the matrix in row chunks three
times. Stops when every element rounds to ``T``, when the count of elements outside
has not fallen for ``PATIENCE`` iterations after the ramp, or at ``max_iters``; the
best factors seen are returned (never worse than the input).

>>> rng = np.random.default_rng(0)
>>> W = nm.to_float64(nm.round_to_format(rng.normal(size=(64, 48)) * 0.02, "BF16"), "BF16")
>>> B0, A0 = rng.normal(size=(64, 4)) * 0.05, rng.normal(size=(4, 48)) * 0.05
>>> Tb = nm.round_to_format(W + B0 @ A0, "BF16")
>>> U, S, Vt = np.linalg.svd(nm.to_float64(Tb, "BF16") - W)
>>> A, B = (S[:4, None] ** 0.5 * Vt[:4]).astype(np.float32), (U[:, :4] * S[:4] ** 0.5).astype(np.float32)
>>> res = refine_factors(W, Tb, "BF16", A, B)
>>> res.outside_before > res.outside_after
True
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Tuple

import numpy as np

from .. import numerics as nm

__all__ = ["MARGIN", "RAMP", "MAX_ITERS", "PATIENCE", "RefineResult", "rounding_box",
           "outside_count", "refine_factors"]

#: the box the refit aims for, as a share of the half spacings (a dyadic 31/64, so the
#: shrunken edges of a bf16/fp16 value are exact in float32)
MARGIN = 31 / 64
#: iterations over which the weight exponent ramps from 0 to 2
RAMP = 30
#: at most this many iterations
MAX_ITERS = 50
#: stop when the count has not fallen for this many iterations (after the ramp)
PATIENCE = 5
_CHUNK = 1 << 18  # elements per row chunk: temporaries stay a few MiB
_WEIGHT_SPAN = 2.0 ** -30  # ulps below max ulp * this weigh as much as it (conditioning)


@dataclass
class RefineResult:
    """Refined float32 factors and what the refit achieved: ``outside_before`` /
    ``outside_after`` count the elements of ``W + B @ A`` that do not round to ``T``."""
    A: np.ndarray
    B: np.ndarray
    iterations: int
    outside_before: int
    outside_after: int
    seconds: float
    history: Tuple[int, ...] = ()


def rounding_box(T: np.ndarray, code: str, margin: float = 0.5
                 ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(lo, hi, ulp)``: the values ``margin`` of the way to the rounding boundaries
    below and above each value of ``T`` (float64, values of format ``code``), and the
    ulp of ``T``. With ``margin = 0.5`` they are the boundaries themselves (a value on
    one rounds to the neighbour with the even significand). The spacing towards zero
    halves at a power of two above the smallest normal; a zero's box is one-sided (its
    sign).

    >>> T = np.array([1.0, -1.0, 1.5])
    >>> lo, hi, u = rounding_box(T, "BF16")
    >>> (T - lo).tolist(), (hi - T).tolist()
    ([0.001953125, 0.00390625, 0.00390625], [0.00390625, 0.001953125, 0.00390625])
    """
    fmt = nm.float_format(code)
    T = np.asarray(T, np.float64)
    u = nm.ulp(T, fmt)
    mant, _ = np.frexp(np.abs(T))
    toward = np.where((mant == 0.5) & (np.abs(T) > 2.0 ** fmt.emin), 0.5 * u, u)
    pos = T > 0
    up = np.where(pos, u, toward)
    down = np.where(pos, toward, u)
    # a signed zero: only its own side rounds to it (values just below +0 give -0)
    zero = T == 0
    up[zero & np.signbit(T)] = 0.0
    down[zero & ~np.signbit(T)] = 0.0
    return T - margin * down, T + margin * up, u


def _edge_dtype(code: str) -> type:
    # a bf16/fp16 value plus 31/64 of half its spacing fits float32's 24 bits
    return np.float32 if nm.float_format(code).precision <= 11 else np.float64


def _f32(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32).astype(np.float64)


def outside_count(W: np.ndarray, T_bits: np.ndarray, code: str, A: np.ndarray,
                  B: np.ndarray) -> int:
    """Elements where ``round(W + B @ A)`` (float64 sum, one rounding to ``code``)
    differs from the stored ``T_bits``."""
    A64, B64 = np.asarray(A, np.float64), np.asarray(B, np.float64)
    fmt = nm.float_format(code)
    bad = 0
    for rows in nm.chunks(W.shape[0], W.shape[1], _CHUNK):
        X = B64[rows] @ A64
        X += W[rows]
        bad += int(np.count_nonzero(nm.round_to_format(X, fmt) != T_bits[rows]))
    return bad


class _Problem:
    """The fixed data of one refit: base, box edges and ulps (compact dtypes), and
    the row-chunk passes that compute residuals of ``W + B @ A`` outside the box."""

    def __init__(self, W: np.ndarray, T_bits: np.ndarray, code: str, margin: float):
        self.fmt = nm.float_format(code)
        self.T_bits = T_bits
        edge = _edge_dtype(code)
        n, m = W.shape
        self.W = W.astype(np.float32) if edge is np.float32 and \
            np.array_equal(W.astype(np.float32), W) else W
        self.lo, self.hi = np.empty((n, m), edge), np.empty((n, m), edge)
        self.logu = np.empty((n, m), np.int16)
        for rows in nm.chunks(n, m, _CHUNK):
            T = nm.to_float64(T_bits[rows], self.fmt)
            lo, hi, u = rounding_box(T, code, margin)
            self.lo[rows], self.hi[rows] = lo, hi
            self.logu[rows] = np.frexp(u)[1]
        self.top = int(self.logu.max(initial=0))
        self.floor = self.top + int(np.log2(_WEIGHT_SPAN))

    def fused(self, rows: slice, B: np.ndarray, A: np.ndarray) -> np.ndarray:
        """``W + B @ A`` on ``rows`` (``B`` holds just those rows), float64."""
        X = B @ A
        X += self.W[rows]
        return X

    def chunks(self):
        return nm.chunks(self.W.shape[0], self.W.shape[1], _CHUNK)

    def violations(self, rows: slice, X: np.ndarray, p: float
                   ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Flat indices of the elements of ``X`` (rows of ``W + B A``) outside the
        box, their signed distances outside it and their weights."""
        hi, lo = self.hi[rows], self.lo[rows]
        flat = np.flatnonzero((X > hi) | (X < lo))
        x = X.reshape(-1)[flat]
        h = hi.reshape(-1)[flat]
        r = np.where(x > h, x - h, x - lo.reshape(-1)[flat])
        e = np.maximum(self.logu[rows].reshape(-1)[flat], self.floor) - self.top
        return flat, r, np.exp2(-p * e.astype(np.float64))

    def count(self, rows: slice, X: np.ndarray, flat: np.ndarray) -> int:
        """Elements of ``X`` that do not round to ``T`` (all among ``flat``, the
        elements outside the shrunken box)."""
        x = X.reshape(-1)[flat]
        return int(np.count_nonzero(nm.round_to_format(x, self.fmt)
                                    != self.T_bits[rows].reshape(-1)[flat]))


def _pairs(F: np.ndarray) -> np.ndarray:
    """``(len, k(k+1)/2)``: the products ``f_a f_b`` (a <= b) of each row of ``F``."""
    a, b = np.triu_indices(F.shape[1])
    return F[:, a] * F[:, b]


def _unpair(Gp: np.ndarray, k: int) -> np.ndarray:
    G = np.empty((Gp.shape[0], k, k))
    a, b = np.triu_indices(k)
    G[:, a, b] = Gp
    G[:, b, a] = Gp
    return G


def _normal_eqs(shape: Tuple[int, int], flat: np.ndarray, w: np.ndarray, r: np.ndarray,
                F: np.ndarray, pairs: np.ndarray, rows_side: bool
                ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row (``rows_side``) or per column of a chunk: ``G = sum w f f^T``,
    ``g = sum w r f`` and ``loss = sum w r^2`` (``G`` as its upper triangle) over its violating elements, with
    ``F`` the other factor's vectors (columns of A as rows, or rows of B) and
    ``pairs = _pairs(F)``. Scattered into dense (rows, cols) arrays and reduced by
    BLAS: 64 + 8 multiply-adds per element, cheaper than gathering per violator."""
    Mw = np.zeros(shape)
    Mw.reshape(-1)[flat] = w
    Mr = np.zeros(shape)
    Mr.reshape(-1)[flat] = w * r
    if rows_side:
        Gp, g = Mw @ pairs, Mr @ F
        seg = flat // shape[1]
        size = shape[0]
    else:
        Gp, g = Mw.T @ pairs, Mr.T @ F
        seg = flat % shape[1]
        size = shape[1]
    return Gp, g, np.bincount(seg, w * r * r, minlength=size)


def _solve(Gp: np.ndarray, g: np.ndarray, mu: np.ndarray) -> np.ndarray:
    k = g.shape[-1]
    G = _unpair(Gp, k)
    tr = np.trace(G, axis1=1, axis2=2) / k
    damp = np.where(tr > 0, mu * tr, 1.0)
    return np.linalg.solve(G + damp[:, None, None] * np.eye(k), g[..., None])[..., 0]


def _adapt(mu: np.ndarray, idx: np.ndarray, ok: np.ndarray) -> None:
    mu[idx] = np.where(ok, np.maximum(mu[idx] * 0.3, 1e-6), np.minimum(mu[idx] * 10, 1e6))


def _step_B(prob: _Problem, A: np.ndarray, B: np.ndarray, p: float, mu: np.ndarray) -> int:
    """Gauss-Newton on each row of ``B`` (in place, per row kept only if its loss
    falls); returns the count of elements outside the true box before the step."""
    outside = 0
    At = np.ascontiguousarray(A.T)
    pairs_a = _pairs(At)
    for rows in prob.chunks():
        X = prob.fused(rows, B[rows], A)
        flat, r, w = prob.violations(rows, X, p)
        if flat.size == 0:
            continue
        outside += prob.count(rows, X, flat)
        G, g, loss0 = _normal_eqs(X.shape, flat, w, r, At, pairs_a, True)
        act = np.flatnonzero(loss0 > 0)
        sub = slice(rows.start + act[0], rows.start + act[-1] + 1)  # the active rows' span
        Bn = B[sub].copy()
        Bn[act - act[0]] = _f32(B[rows.start + act] - _solve(G[act], g[act], mu[rows.start + act]))
        Xn = prob.fused(sub, Bn, A)
        f1, r1, w1 = prob.violations(sub, Xn, p)
        loss1 = np.bincount(f1 // Xn.shape[1], w1 * r1 * r1, minlength=Xn.shape[0])
        ok = loss1[act - act[0]] < loss0[act]
        B[rows.start + act[ok]] = Bn[act[ok] - act[0]]
        _adapt(mu, rows.start + act, ok)
    return outside


def _step_A(prob: _Problem, A: np.ndarray, B: np.ndarray, p: float, mu: np.ndarray) -> None:
    """Gauss-Newton on each column of ``A`` (in place, per column kept only if its
    loss falls): one pass to build the normal equations, one to check the step."""
    m, k = A.shape[1], A.shape[0]
    G, g, loss0 = np.zeros((m, k * (k + 1) // 2)), np.zeros((m, k)), np.zeros(m)
    pairs_b = _pairs(B)
    for rows in prob.chunks():
        X = prob.fused(rows, B[rows], A)
        flat, r, w = prob.violations(rows, X, p)
        if flat.size == 0:
            continue
        Gc, gc, lc = _normal_eqs(X.shape, flat, w, r, B[rows], pairs_b[rows], False)
        G += Gc
        g += gc
        loss0 += lc
    act = np.flatnonzero(loss0 > 0)
    if act.size == 0:
        return
    An = A.copy()
    An[:, act] = _f32(A[:, act] - _solve(G[act], g[act], mu[act]).T)
    loss1 = np.zeros(m)
    for rows in prob.chunks():
        X = prob.fused(rows, B[rows], An)
        flat, r, w = prob.violations(rows, X, p)
        loss1 += np.bincount(flat % m, w * r * r, minlength=m)
    ok = loss1[act] < loss0[act]
    A[:, act[ok]] = An[:, act[ok]]
    _adapt(mu, act, ok)


def refine_factors(W: np.ndarray, T_bits: np.ndarray, code: str, A: np.ndarray,
                   B: np.ndarray, *, max_iters: int = MAX_ITERS, margin: float = MARGIN,
                   ramp: int = RAMP, patience: int = PATIENCE) -> RefineResult:
    """Refit rank-r factors so that ``round(W + B @ A)`` equals ``T_bits`` on as many
    elements as it can (see the module docstring).

    Args:
        W: the base weight, float64 (out, in).
        T_bits: the tuned weight's storage bits (format ``code``, e.g. ``"BF16"``).
        A, B: starting factors (r, in) and (out, r), e.g. the truncated SVD's.
        max_iters, margin, ramp, patience: the refit's knobs (module constants).

    Returns:
        A :class:`RefineResult` with float32 factors, never more elements outside
        than the starting ones.
    """
    t0 = time.perf_counter()
    prob = _Problem(np.asarray(W, np.float64), np.asarray(T_bits), code, margin)
    A = _f32(np.asarray(A, np.float64))
    B = _f32(np.asarray(B, np.float64))
    mu_b, mu_a = np.full(B.shape[0], 1e-3), np.full(A.shape[1], 1e-3)
    best = (outside_count(prob.W, prob.T_bits, code, A, B), A.copy(), B.copy())
    before, since, it, history = best[0], 0, 0, []
    while it < max_iters and best[0] > 0:
        p = min(2.0, 2.0 * it / max(ramp, 1))
        start = (A.copy(), B.copy())
        outside = _step_B(prob, A, B, p, mu_b)  # counted at ``start``, before the step
        history.append(outside)
        if outside < best[0]:
            best, since = (outside, *start), 0
        elif it > ramp:
            since += 1
            if since >= patience:
                break
        _step_A(prob, A, B, p, mu_a)
        it += 1
    last = outside_count(prob.W, prob.T_bits, code, A, B)
    if last < best[0]:
        best = (last, A, B)
    return RefineResult(best[1].astype(np.float32), best[2].astype(np.float32), it, before,
                        best[0], time.perf_counter() - t0, tuple(history + [last]))
