"""Refit extracted LoRA factors so that fusing them gives the tuned checkpoint back.

A checkpoint fused from a rank-r adapter holds ``T = round(W + delta)``. The rank-r
SVD of ``T - W = delta + e`` (``e`` the rounding error) keeps the part of ``e`` that
lies in the delta's own row and column spaces, so ``round(W + D_r)`` differs from
``T`` wherever ``W + delta`` sat near a rounding boundary, and by many ulps where the
sum nearly cancels (the ulp of ``T`` is far below the ulp of ``W`` there).

:func:`refine_factors` looks for rank-r float32 factors with ``W + B @ A`` inside the
*rounding box* of every element: the values that round to ``T`` (half the spacing on
each side; the spacing towards zero halves at a power of two, :func:`rounding_box`).
It minimises the squared distance of ``W + B A`` outside a box shrunk by a *gap* of
:func:`margin_gap` (``r / min(out, in)`` of a half spacing, dyadic, between 1/4096 and
1/64) on each side, weighted by ``(ulp(T) / max ulp)**-p``, by
alternating damped Gauss-Newton steps on the rows of ``B`` (``A`` fixed: each row is
an r-variable least-squares problem over its violating elements) and the columns of
``A``. ``p`` ramps from 0 (absolute distances: the bulk of the elements first) to 2
(distances in ulps of ``T``: the near-cancelling elements last) over ``RAMP``
iterations, or over all of them when fewer are allowed (a ramp that ends at the last
iteration left fewer elements outside, at the same count, than one that ends earlier:
benchmarks/refit_settings.py). A step is kept per row (column) only if it lowers that row's (column's)
loss; the factors are rounded to float32 after every step, so the count is that of
the stored adapter. A larger matrix pins each row of ``B`` (column of ``A``) with more
elements, so the fit's own uncertainty, and with it the gap that serves best, shrinks
like ``r / min(out, in)``. Measured with gaps 1/32 to 1/1024 (benchmarks/refit_settings.py,
22 iterations for these sizes) the best were 1/64 at min(out, in) 128-256, 1/128 at
1024 and 1/256 at 2048, the rule's choices; at 4096, 1/256 (the rule: 1/512, next best).

The iterations run on an *active set*: a full scan (one pass over the module) keeps
the elements outside the shrunken box and those whose slack to its nearer edge is
below one absolute distance ``s = SLACK * 2**(dense - 1)`` (``SLACK`` ulps of the
binade ``dense``, ``DENSE_BINADES`` below the median ulp: a larger value's band is
narrower in its own ulps, a tiny value's wider, all of it where it is below ``s``);
the normal equations and the step checks are then sums over that gathered set alone.
An inactive element has a slack of at least ``s``; since the scan, no element
moved by more than ``max||dB_i|| max||A_j|| + max||B_i|| max||dA_j|| + max||dB_i||
max||dA_j||`` (``d``: the change since the scan), so while that bound is below ``s``
no inactive element can have left the box and the active loss is the full loss (a
trial step, kept only if it lowers the loss, is judged over the active set alone). A
new active set comes when the bound reaches ``s``. The *counting* scans, whose count outside the shrunken box is the
history, picks the best factors and stops the refit, come when the bound since the
last one reaches the smallest slack of a ``COUNT_SLACK`` band, or after ``RESCAN``
iterations: the narrow ``SLACK`` band keeps the active set small and is built again
more often.
Stops when every element is inside the shrunken box, when the counting scans' count
has not fallen for ``PATIENCE`` scans after the ramp, or at ``max_iters`` (``MAX_ITERS``;
``LARGE_ITERS`` for a module of more than ``LARGE`` elements, where the iterations cost
the most: BENCHMARKS.md, "Extract", has what they reproduce); the final
factors and the best scanned ones are counted by a full pass (:func:`outside_count`)
and the better is returned, never worse than the input.

Precision: the products ``B_i . A_j`` and the sums ``W + B A`` are float64 (the box
edges are a few hundredths of an ulp of a bf16 value apart from the true delta; a
float32 sum would move elements across them), and so are the normal equations and
their r x r solves (they square the condition number). The base and the box edges are
stored as float32, where they are exact (a bf16/fp16 value plus ``0.5 - gap`` of its
half spacing, gap >= 1/4096, needs at most 24 significand bits), and the factors are
float32 values.

The passes run in the optional C kernel ``_refitkernel`` (the GIL released); its numpy
fallback gives the same bits (same order of additions). The kernel's scan and
normal-equation passes first compute each ``W + B A`` in float32 with a rigorous
bound on its distance from the float64 sum, and compute again in float64 (k order)
only the elements that bound cannot place surely inside the box, or surely beyond the
active threshold: every decision and sum is the float64 one (the float32 pre-passes
run eight elements to a vector, in any order of the float32 sum: the bound holds for
all). A counting scan at the factors of the last active set (no step since) takes
that scan's set and count instead of a pass of its own. It also builds the boxes
from the stored bits (``box``), counts a re-fuse with its residual in one pass
(``stats``, :func:`fuse_stats`) and writes ``T - W`` with its norm and the noise in
another (:func:`difference`).

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

import threading
import time
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from .. import numerics as nm

__all__ = ["MARGIN", "margin_gap", "RAMP", "MAX_ITERS", "LARGE_ITERS", "LARGE", "PATIENCE",
           "SLACK", "COUNT_SLACK", "RESCAN", "DENSE_BINADES", "RefineResult", "rounding_box",
           "scratch", "WORK", "outside_count", "fuse_stats", "difference", "refine_factors"]

#: the box of the smallest matrices, as a share of the half spacings (``0.5 -
#: margin_gap``: a dyadic, so the shrunken edges of a bf16/fp16 value are exact in
#: float32)
MARGIN = 31 / 64
#: the gap's bounds: at most 1/64 of a half spacing, at least 1/4096 (far above the
#: float64 evaluation's error, about 2**-50 of the value; edges exact in float32)
_GAP_MAX, _GAP_MIN = 2.0 ** -6, 2.0 ** -12
#: iterations over which the weight exponent ramps from 0 to 2
RAMP = 30
#: at most this many iterations
MAX_ITERS = 50
#: ... and this many for a module of more than ``LARGE`` elements
LARGE_ITERS = 22
LARGE = 1 << 20
#: stop when the count has not fallen for this many iterations (after the ramp)
PATIENCE = 5
#: an element is in the active set when its slack to the box edge is below this many
#: ulps of the binade ``DENSE_BINADES`` below the median (or it is outside); a narrower
#: band is a smaller set, built again more often
SLACK = 1 / 32
#: the counting scans (the history, the best factors, the stop) come on the schedule of
#: a band this wide, or ``slack``'s if wider
COUNT_SLACK = 0.125
#: a full pass (and a new active set) at least every this many iterations
RESCAN = 5
#: the binade of ``SLACK``'s ulps, this many below the median ulp
DENSE_BINADES = 2
_CHUNK = 1 << 18  # elements per row chunk: temporaries stay a few MiB
_WEIGHT_SPAN = 2.0 ** -30  # ulps below max ulp * this weigh as much as it (conditioning)


@dataclass
class RefineResult:
    """Refined float32 factors and what the refit achieved: ``outside_before`` /
    ``outside_after`` count the elements of ``W + B @ A`` that do not round to ``T``
    (full passes); ``history``: the elements outside the shrunken box at each full
    scan (at least those that do not round to ``T``), then ``outside_after``;
    ``resid_sq``: ``||T - W - B A||_F^2`` of the factors returned, where the pass that
    counted them gave it (:func:`fuse_stats`), else None."""
    A: np.ndarray
    B: np.ndarray
    iterations: int
    outside_before: int
    outside_after: int
    seconds: float
    history: Tuple[int, ...] = ()
    resid_sq: Optional[float] = None


_SCRATCH = threading.local()
#: the scratch key of a refit's edges and exponents (pooled), which extract's ``T - W``
#: uses before them: one buffer for both
WORK = "work"


def scratch(key: str, shape: Tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised array for one module's work, its memory kept by the calling
    thread for the next module that asks for ``key`` (one module at a time per thread,
    as extract works: fresh pages cost more to fault in than the work on them). The
    array is valid until this thread asks for ``key`` again."""
    pool = _SCRATCH.__dict__
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    buf = pool.get(key)
    if buf is None or buf.size < size:
        buf = pool[key] = np.empty(size, np.uint8)
    return buf[:size].view(dtype).reshape(shape)


def margin_gap(shape: Tuple[int, int], rank: int) -> float:
    """The shrunken box's gap to the rounding boundary, as a share of the half spacing:
    ``r / min(out, in)`` rounded up to a power of two, within [1/4096, 1/64].

    >>> margin_gap((256, 512), 8), margin_gap((2048, 6144), 8), margin_gap((4096, 4096), 8)
    (0.015625, 0.00390625, 0.001953125)
    """
    q = max(int(rank), 1) / max(min(int(shape[0]), int(shape[1])), 1)
    gap = 2.0 ** np.ceil(np.log2(q))
    return float(min(max(gap, _GAP_MIN), _GAP_MAX))


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
    # a bf16/fp16 value plus 127/256 of half its spacing fits float32's 24 bits
    return np.float32 if nm.float_format(code).precision <= 11 else np.float64


def _f32(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32).astype(np.float64)


def _products(A64: np.ndarray, B64: np.ndarray, rows: slice) -> np.ndarray:
    """``B[rows] @ A`` summed from ``B[:, 0] A[0]`` term by term in k order (float64):
    the C kernel's order, so both give the same bits."""
    S = B64[rows, 0:1] * A64[0]
    for k in range(1, A64.shape[0]):
        S += B64[rows, k:k + 1] * A64[k]
    return S


def stats_in_c(W: np.ndarray, T_bits: np.ndarray, code: str) -> bool:
    """Whether the C kernel's ``stats`` pass serves these arrays (an exact float32 base,
    bf16/fp16 bits of the same shape)."""
    return _kernel is not None and code in _BOX_FORMATS and W.dtype == np.float32 and \
        np.asarray(T_bits).dtype.itemsize == 2 and np.shape(T_bits) == W.shape


def fuse_stats(W: np.ndarray, T_bits: np.ndarray, code: str, A: np.ndarray, B: np.ndarray,
               use_kernel: bool = True) -> Tuple[int, float]:
    """One pass over a module: ``(outside, resid_sq)``. ``outside``: elements where
    ``round(W + B @ A)`` (the float64 sum, one rounding to ``code``) differs from the
    stored ``T_bits``; ``resid_sq``: ``||T - W - B A||_F^2``. The products are summed in
    k order (:func:`_products`), by the C kernel where it serves, else by numpy: the same
    count; the two float sums differ at most in their last bits (another order of
    addition)."""
    n, m = W.shape
    A64, B64 = np.ascontiguousarray(A, np.float64), np.ascontiguousarray(B, np.float64)
    if use_kernel and stats_in_c(W, T_bits, code):
        out, rs, _ = _kernel.stats(W, np.ascontiguousarray(T_bits), _BOX_FORMATS[code], m,
                                   A64.shape[0], B64, A64)
        return int(out), float(rs)
    fmt = nm.float_format(code)
    out, rs = 0, 0.0
    for rows in nm.chunks(n, m, _CHUNK):
        S = _products(A64, B64, rows)
        Wr = W[rows].astype(np.float64)
        out += int(np.count_nonzero(nm.round_to_format(S + Wr, fmt) != T_bits[rows]))
        R = nm.to_float64(T_bits[rows], fmt) - Wr
        R -= S
        rs += float(np.einsum("ij,ij->", R, R))
    return out, rs


def difference(W: np.ndarray, T_bits: np.ndarray, code: str, out: np.ndarray,
               use_kernel: bool = True) -> Tuple[float, float]:
    """``out[...] = T - W`` (float64, exact) in one pass over a module, and
    ``(||T - W||_F^2, ||ulp(T) / 2||_F^2)`` (the rounding noise's bound); by the C
    kernel where it serves (the sums in another order than numpy's: their last bits)."""
    n, m = W.shape
    if use_kernel and stats_in_c(W, T_bits, code):
        _, sq, ns = _kernel.stats(W, np.ascontiguousarray(T_bits), _BOX_FORMATS[code], m, 0,
                                  np.zeros((n, 0)), np.zeros((0, m)), out)
        return float(sq), float(ns)
    fmt = nm.float_format(code)
    sq, ns = 0.0, 0.0
    for rows in nm.chunks(n, m, _CHUNK):
        T = nm.to_float64(T_bits[rows], fmt)
        R = out[rows]
        np.subtract(T, W[rows], out=R)
        sq += float(np.einsum("ij,ij->", R, R))
        h = 0.5 * nm.ulp(T, fmt)
        ns += float(np.einsum("ij,ij->", h, h))
    return sq, ns


def outside_count(W: np.ndarray, T_bits: np.ndarray, code: str, A: np.ndarray,
                  B: np.ndarray) -> int:
    """Elements where ``round(W + B @ A)`` (float64 sum, one rounding to ``code``)
    differs from the stored ``T_bits`` (the products summed in k order)."""
    A64, B64 = np.asarray(A, np.float64), np.asarray(B, np.float64)
    if stats_in_c(W, T_bits, code):
        return fuse_stats(W, T_bits, code, A64, B64)[0]
    fmt = nm.float_format(code)
    bad = 0
    for rows in nm.chunks(W.shape[0], W.shape[1], _CHUNK):
        X = _products(A64, B64, rows)
        X += W[rows]
        bad += int(np.count_nonzero(nm.round_to_format(X, fmt) != T_bits[rows]))
    return bad


try:  # the optional C kernel (lorakit/algebra/_refitkernel.c); numpy otherwise, same bits
    from . import _refitkernel as _kernel
except ImportError:  # pragma: no cover - depends on the build
    _kernel = None

_OFF, _TAB = 512, 1024  # the kernel's exponent tables: index logu + _OFF
_BOX_FORMATS = {"BF16": 0, "F16": 1}  # the kernel's rounding boxes (box)
_BLOCK = 256  # the kernel's block of elements (BLK): a scan's room has one to spare


class _Problem:
    """The fixed data of one refit: base and box edges (float32 for bf16/fp16, where
    they are exact), ulp exponents, and the two passes: :meth:`scan` over every
    element (the active set) and :meth:`accum` over the gathered active set.
    ``pooled``: the edges and exponents in the thread's :func:`scratch` memory ``WORK``,
    the active sets in its ``active0`` .. ``active4`` (one problem at a time per thread,
    as :func:`refine_factors` makes them; whatever else held those is overwritten)."""

    def __init__(self, W: np.ndarray, T_bits: np.ndarray, code: str, margin: float,
                 use_kernel: bool, pooled: bool = False):
        self.fmt = nm.float_format(code)
        edge = _edge_dtype(code)
        n, m = W.shape
        self.shape = (n, m)
        w32 = W.astype(np.float32, copy=False)
        self.W = w32 if edge is np.float32 and (w32 is W or np.array_equal(w32, W)) else W
        del w32
        e = np.dtype(edge).itemsize * n * m
        raw = scratch(WORK, (2 * e + 2 * n * m,), np.uint8) if pooled else \
            np.empty(2 * e + 2 * n * m, np.uint8)
        self.lo = raw[:e].view(edge).reshape(n, m)
        self.hi = raw[e:2 * e].view(edge).reshape(n, m)
        self.logu = raw[2 * e:].view(np.int16).reshape(n, m)
        T_bits = np.asarray(T_bits)
        fast = use_kernel and _kernel is not None and code in _BOX_FORMATS and \
            T_bits.dtype.itemsize == 2 and T_bits.shape == (n, m)
        if not fast or _kernel.box(np.ascontiguousarray(T_bits), _BOX_FORMATS[code], margin,
                                   self.lo, self.hi, self.logu):
            for rows in nm.chunks(n, m, _CHUNK):  # numpy: the same values
                T = nm.to_float64(T_bits[rows], self.fmt)
                lo, hi, u = rounding_box(T, code, margin)
                self.lo[rows], self.hi[rows] = lo, hi
                self.logu[rows] = np.frexp(u)[1]
        self.top = int(self.logu.max(initial=0))
        self.floor = self.top + int(np.log2(_WEIGHT_SPAN))
        self.kernel = _kernel if use_kernel and _kernel is not None and \
            self.W.dtype == self.lo.dtype == np.float32 else None
        self.pooled = pooled
        if self.kernel is not None:
            # room for a quarter of the elements (the SVD start's set held 8% of a 1.7B
            # gate_proj): untouched room costs no memory, a scan that runs out of room
            # runs again
            self._room(n * m // 4 + 1024)

    def median_logu(self) -> int:
        """``int(np.median(logu))`` from a histogram of the exponents, a row chunk at a
        time (no sorted copy, no full-size temporary)."""
        h = np.zeros(_TAB, np.int64)
        for rows in nm.chunks(*self.shape, _CHUNK):
            h += np.bincount((self.logu[rows].reshape(-1).astype(np.int32) + _OFF)
                             .clip(0, _TAB - 1), minlength=_TAB)
        c, n = np.cumsum(h), self.logu.size
        lo, hi = int(np.searchsorted(c, (n - 1) // 2, "right")), int(np.searchsorted(c, n // 2, "right"))
        return int((lo + hi) / 2 - _OFF) if lo != hi else lo - _OFF

    def weights(self, p: float) -> np.ndarray:
        """The weight of an element by its ulp exponent (index ``logu + 512``)."""
        e = np.maximum(np.arange(_TAB) - _OFF, self.floor) - self.top
        return np.exp2(-p * e.astype(np.float64))

    def _room(self, k: int) -> None:
        """Buffers for the kernel's active sets, room for ``k`` elements (kept across
        scans, and with ``pooled`` in the thread's :func:`scratch` memory across modules:
        a new set costs no fresh pages)."""
        kinds = (np.int64, np.float32, np.float32, np.float32, np.int16)
        self._out = tuple(scratch(f"active{q}", (k,), t) if self.pooled else np.empty(k, t)
                          for q, t in enumerate(kinds))

    def scan(self, A: np.ndarray, B: np.ndarray, thr: float) -> Tuple["_Active", int]:
        """The active set (flat indices ascending, and those elements' base, edges and
        ulp exponents) of the elements whose slack to the nearer edge of the box is
        below ``thr`` (absolute), and the count outside the box. With the kernel, the
        set is a view of buffers the next scan writes again: valid until then."""
        n, m = self.shape
        if self.kernel is not None:
            args = (self.W, self.lo, self.hi, self.logu, m, A.shape[0],
                    np.ascontiguousarray(B, np.float64), np.ascontiguousarray(A, np.float64),
                    float(thr))
            while True:
                cnt, viol, whole = self.kernel.scan(*args, *self._out)
                if whole:
                    return _Active(*(a[:cnt] for a in self._out)), int(viol)
                self._room(cnt + cnt // 4 + _BLOCK)
        parts, viol = [], 0
        for rows in nm.chunks(n, m, _CHUNK):
            X = self.W[rows].astype(np.float64)
            for k in range(A.shape[0]):
                X += B[rows, k:k + 1] * A[k]
            s = np.minimum(X - self.lo[rows], self.hi[rows] - X)
            viol += int(np.count_nonzero(s < 0))
            parts.append(np.flatnonzero(s < thr) + rows.start * m)
        idx = np.concatenate(parts)
        flat = (self.W.reshape(-1), self.lo.reshape(-1), self.hi.reshape(-1),
                self.logu.reshape(-1))
        return _Active(idx, *(np.ascontiguousarray(a[idx]) for a in flat)), viol

    def accum(self, act: "_Active", A: np.ndarray, B: np.ndarray, wtab: np.ndarray,
              side: int, full: bool) -> Tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """Per row (side 0) or column (side 1), over the active set's elements outside
        the box: ``G = sum wt f f^T`` (r x r, flattened), ``g = sum wt rr f``,
        ``loss = sum wt rr^2``; ``full=False``: the loss alone."""
        n, m = self.shape
        r = A.shape[0]
        size = m if side else n
        At, Bc = np.ascontiguousarray(A.T), np.ascontiguousarray(B)
        # the normal equations in the thread's scratch memory (fresh pages cost more to
        # fault in than to clear): valid until the next call for the same side
        G = scratch(f"G{side}", (size, r * r) if full else (0,), np.float64)
        g = scratch(f"g{side}", (size, r) if full else (0,), np.float64)
        G.fill(0.0)
        g.fill(0.0)
        loss = np.zeros(size)  # fresh: a step compares the losses of two calls
        if self.kernel is not None:
            viol = self.kernel.accum(act.idx, act.w, act.lo, act.hi, act.logu, m, r, Bc, At,
                                     wtab, side, G, g, loss)
            return G, g, loss, int(viol)
        i, j = np.divmod(act.idx, m)
        x = act.w.astype(np.float64)
        for k in range(r):
            x += Bc[i, k] * At[j, k]
        hi, lo = act.hi.astype(np.float64), act.lo.astype(np.float64)
        out = (x > hi) | (x < lo)
        sel = np.flatnonzero(out)
        xs = x[sel]
        rr = np.where(xs > hi[sel], xs - hi[sel], xs - lo[sel])
        wv = wtab[np.clip(act.logu[sel].astype(np.int64) + _OFF, 0, _TAB - 1)]
        seg = j[sel] if side else i[sel]
        F = Bc[i[sel]] if side else At[j[sel]]
        wr = wv * rr
        loss = np.bincount(seg, wr * rr, minlength=size)
        if full:
            for a in range(r):
                g[:, a] = np.bincount(seg, wr * F[:, a], minlength=size)
                for c in range(a, r):  # f_a f_c = f_c f_a exactly: the other half mirrors
                    G[:, a * r + c] = G[:, c * r + a] = \
                        np.bincount(seg, (F[:, a] * F[:, c]) * wv, minlength=size)
        return G, g, loss, int(sel.size)


@dataclass
class _Active:
    """The gathered active set: flat indices and the base, edges and ulp exponents
    of those elements (contiguous copies)."""
    idx: np.ndarray
    w: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    logu: np.ndarray


def _solve(Gp: np.ndarray, g: np.ndarray, mu: np.ndarray, use_kernel: bool = True
           ) -> np.ndarray:
    """The damped Gauss-Newton steps ``(G + mu tr(G)/r I)^-1 g``, one r x r system per
    row (column), by Cholesky (no pivoting: the damped matrix is positive definite; a
    pivot that is not positive gives a zero step, which the loss check then rejects);
    float64 (the normal equations square the condition). The C kernel's ``solve``
    where built, else the same operations in the same order over the batch in numpy:
    the same bits."""
    k = g.shape[-1]
    G = np.ascontiguousarray(Gp, np.float64).reshape(-1, k, k)
    g = np.ascontiguousarray(g, np.float64)
    mu = np.ascontiguousarray(mu, np.float64)
    d = np.empty(g.shape)
    if use_kernel and _kernel is not None:
        _kernel.solve(G, g, mu, k, d)
        return d
    tr = G[:, 0, 0].copy()
    for a in range(1, k):
        tr += G[:, a, a]
    tr = tr / k
    damp = np.where(tr > 0, mu * tr, 1.0)
    L = np.zeros_like(G)
    ok = np.ones(len(G), bool)
    with np.errstate(invalid="ignore", divide="ignore"):
        for j in range(k):
            v = G[:, j, j] + damp
            for q in range(j):
                v -= L[:, j, q] * L[:, j, q]
            ok &= v > 0
            L[:, j, j] = np.sqrt(np.where(ok, v, 1.0))
            for i in range(j + 1, k):
                w = G[:, i, j].copy()
                for q in range(j):
                    w -= L[:, i, q] * L[:, j, q]
                L[:, i, j] = w / L[:, j, j]
        y = np.empty_like(g)
        for i in range(k):
            w = g[:, i].copy()
            for q in range(i):
                w -= L[:, i, q] * y[:, q]
            y[:, i] = w / L[:, i, i]
        for i in range(k - 1, -1, -1):
            w = y[:, i].copy()
            for q in range(i + 1, k):
                w -= L[:, q, i] * d[:, q]
            d[:, i] = w / L[:, i, i]
    d[~ok] = 0.0
    return d


def _adapt(mu: np.ndarray, idx: np.ndarray, ok: np.ndarray) -> None:
    mu[idx] = np.where(ok, np.maximum(mu[idx] * 0.3, 1e-6), np.minimum(mu[idx] * 10, 1e6))


def _step(prob: _Problem, act: _Active, A: np.ndarray, B: np.ndarray, wtab: np.ndarray,
          mu: np.ndarray, side: int) -> int:
    """One Gauss-Newton step on the rows of ``B`` (side 0) or the columns of ``A``
    (side 1), in place, kept per row (column) only where the loss falls; returns the
    count outside the box over the active set before the step."""
    G, g, loss0, viol = prob.accum(act, A, B, wtab, side, True)
    sel = np.flatnonzero(loss0 > 0)
    if sel.size == 0:
        return viol
    d = _solve(G[sel], g[sel], mu[sel], prob.kernel is not None)
    if side:
        An = A.copy()
        An[:, sel] = _f32(A[:, sel] - d.T)
        loss1 = prob.accum(act, An, B, wtab, side, False)[2]
        ok = loss1[sel] < loss0[sel]
        A[:, sel[ok]] = An[:, sel[ok]]
    else:
        Bn = B.copy()
        Bn[sel] = _f32(B[sel] - d)
        loss1 = prob.accum(act, A, Bn, wtab, side, False)[2]
        ok = loss1[sel] < loss0[sel]
        B[sel[ok]] = Bn[sel[ok]]
    _adapt(mu, sel, ok)
    return viol


def _thresholds(prob: _Problem, slack: float, dense_below: int) -> Tuple[float, float]:
    """The scan's threshold: an element is active when its slack is below ``slack``
    ulps of the binade ``dense_below`` (an absolute distance, the same for every
    element: a larger value's band is narrower in its own ulps, a tiny value's wider);
    and so the smallest slack an inactive element can have (the same)."""
    s = slack * 2.0 ** (dense_below - 1)
    return s, s


def _moved(A: np.ndarray, B: np.ndarray, A0: np.ndarray, B0: np.ndarray) -> float:
    """A bound on how far any element of ``B @ A`` moved from ``B0 @ A0`` (``d``: the
    change): ``max||dB_i|| max||A0_j|| + max||B0_i|| max||dA_j|| + max||dB_i||
    max||dA_j||``."""
    na0 = float(np.sqrt((A0 * A0).sum(0)).max())
    nb0 = float(np.sqrt((B0 * B0).sum(1)).max())
    db = float(np.sqrt(((B - B0) ** 2).sum(1)).max())
    da = float(np.sqrt(((A - A0) ** 2).sum(0)).max())
    return db * na0 + nb0 * da + db * da


def refine_factors(W: np.ndarray, T_bits: np.ndarray, code: str, A: np.ndarray,
                   B: np.ndarray, *, max_iters: Optional[int] = None,
                   margin: Optional[float] = None,
                   ramp: Optional[int] = None, patience: int = PATIENCE, slack: float = SLACK,
                   rescan: int = RESCAN, outside: Optional[int] = None,
                   use_kernel: bool = True) -> RefineResult:
    """Refit rank-r factors so that ``round(W + B @ A)`` equals ``T_bits`` on as many
    elements as it can (see the module docstring).

    Args:
        W: the base weight (out, in), float64, or float32 where that is exact.
        T_bits: the tuned weight's storage bits (format ``code``, e.g. ``"BF16"``).
        A, B: starting factors (r, in) and (out, r), e.g. the truncated SVD's.
        max_iters, margin, ramp, patience, slack, rescan: the refit's knobs (module
            constants; ``max_iters`` and ``margin`` by default from the module's size:
            ``MAX_ITERS`` / ``LARGE_ITERS`` and ``0.5 - margin_gap(shape, r)``).
        outside: ``outside_count`` of the starting factors, if the caller has it.
        use_kernel: use the C kernel where built (False: the numpy path, same bits).

    Returns:
        A :class:`RefineResult` with float32 factors, never more elements outside
        than the starting ones.
    """
    t0 = time.perf_counter()
    W = np.asarray(W)
    if W.dtype != np.float32:  # an exact float32 base is used as it is (no float64 copy)
        W = W.astype(np.float64, copy=False)
    if margin is None:
        margin = 0.5 - margin_gap(W.shape, np.shape(A)[0])
    if max_iters is None:
        max_iters = LARGE_ITERS if W.size > LARGE else MAX_ITERS
    if ramp is None:
        ramp = min(RAMP, max_iters)
    prob = _Problem(W, np.asarray(T_bits), code, margin, use_kernel, pooled=True)
    A = _f32(np.asarray(A, np.float64))
    B = _f32(np.asarray(B, np.float64))
    A_in, B_in = A.copy(), B.copy()
    before = outside_count(W, T_bits, code, A, B) if outside is None else int(outside)
    mu_b, mu_a = np.full(B.shape[0], 1e-3), np.full(A.shape[1], 1e-3)
    dense = prob.median_logu() - DENSE_BINADES
    thr, min_slack = _thresholds(prob, slack, dense)
    _, min_count = _thresholds(prob, max(slack, COUNT_SLACK), dense)
    best = (np.inf, A.copy(), B.copy())
    it, since, history = 0, 0, []
    act: Optional[_Active] = None
    rebuilt = None  # the last active set built within the iterations, with its factors
    while it < max_iters and before > 0:
        if rebuilt is not None and np.array_equal(rebuilt[0], A) and \
                np.array_equal(rebuilt[1], B):
            scanned, viol = rebuilt[2:]  # no step since: that scan's set and count
        else:
            act = None  # the last active set goes before the next is built (memory: one)
            scanned, viol = prob.scan(A, B, thr)  # a full pass: the count and the set
        rebuilt = None
        history.append(viol)
        if viol < best[0]:
            best, since = (viol, A.copy(), B.copy()), 0
        elif it > ramp:
            since += 1
            if since >= patience:
                break
        if viol == 0:
            break
        act, scanned = scanned, None
        A0, B0 = A.copy(), B.copy()  # the counting scan's factors
        A1, B1 = A0, B0  # the active set's
        for _ in range(rescan):
            if it >= max_iters:
                break
            wtab = prob.weights(min(2.0, 2.0 * it / max(ramp, 1)))
            _step(prob, act, A, B, wtab, mu_b, 0)
            _step(prob, act, A, B, wtab, mu_a, 1)
            it += 1
            # the next counting scan once an element may have moved a COUNT_SLACK band
            # since the last one (its schedule, and so the counts, best factors and stop,
            # do not follow ``slack``) ...
            if _moved(A, B, A0, B0) >= min_count:
                break
            # ... and a new active set alone once an inactive element may have left the
            # box since the last set was built
            if slack < COUNT_SLACK and _moved(A, B, A1, B1) >= min_slack:
                act = rebuilt = None
                act, viol = prob.scan(A, B, thr)
                A1, B1 = A.copy(), B.copy()
                rebuilt = (A1, B1, act, viol)
    def counted(A: np.ndarray, B: np.ndarray) -> Tuple[int, Optional[float]]:
        if stats_in_c(W, T_bits, code):  # the count and the residual in one pass
            return fuse_stats(W, T_bits, code, A, B)
        return outside_count(W, T_bits, code, A, B), None

    final = (*counted(A, B), A, B) if it else (before, None, A, B)
    if np.isfinite(best[0]) and it and best[0] < history[-1]:
        seen = counted(best[1], best[2])
        if seen[0] < final[0]:
            final = (*seen, best[1], best[2])
    if final[0] > before:  # never worse than the input
        final = (before, None, A_in, B_in)
    return RefineResult(final[2].astype(np.float32), final[3].astype(np.float32), it, before,
                        final[0], time.perf_counter() - t0, tuple(history + [final[0]]),
                        final[1])
