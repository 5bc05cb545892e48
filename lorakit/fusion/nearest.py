"""The ``nearest`` rounding: W + scale * (B @ A) correctly rounded (see core.py).

The sum in float64, one rounding to the output format, then the few elements whose
f64 value might round the wrong way (near a tie, or cancelled terms) redone in exact
rationals (tests/fusion/test_nearest.py checks them against exact rationals).
"""
from __future__ import annotations

from fractions import Fraction
from typing import Any, Optional, Tuple

import numpy as np

from .. import numerics as nm
from .delta import dora_factor

__all__ = []


_PIECE = 1 << 16  # elements per piece: the f64 working set stays in the L2 cache
_U64 = np.uint64


def _near_ties(xs: np.ndarray, flat: Optional[np.ndarray], cols: int, fmt_out,
               cancel: Optional[Tuple[np.ndarray, np.ndarray]] = None,
               error: Optional[Any] = None) -> np.ndarray:
    """Flat indices (into a piece ``cols`` wide) of f64 values ``xs`` (1-D, at the flat
    indices ``flat``; None: every element in order) that may round the wrong way in
    ``fmt_out``: those within 2**-20 ulp of a tie; given ``cancel`` (per-row and
    per-column factors of the magnitude ``|x|`` must pass for an f64 error under 2**-21
    ulp), the cancelled ones below it whose distance to a tie is within ``error(flat
    indices)``; given ``error``, also results rounding to zero within their error bound
    (the zero's sign)."""
    at = (lambda pos: pos) if flat is None else (lambda pos: flat[pos])
    drop = 53 - fmt_out.precision  # f64 fraction bits below the output's last bit
    half = _U64(1 << (drop - 1))
    tol = _U64(1 << (drop - 20))
    bits = xs.view(np.uint64)
    t = bits & _U64((1 << drop) - 1)
    t -= half
    t += tol  # unsigned wrap: values below the tie land near 2**64, above it near 0
    near = t <= _U64(2) * tol
    ax = np.abs(xs)
    small = ax < 2.0 ** fmt_out.emin  # subnormal outputs: fixed spacing, check directly
    if small.any():
        idx = np.flatnonzero(small)
        y = ax[idx] * 2.0 ** (fmt_out.precision - 1 - fmt_out.emin)  # exact scaling
        frac = y - np.floor(y)
        near[idx] = np.abs(frac - 0.5) < 2.0 ** -20
        if error is not None:  # a result that rounds to zero has the exact value's
            z = idx[y <= 0.5]  # sign: certain only where |x| exceeds its error bound
            if z.size:
                e = error(at(z))
                near[z[(ax[z] <= e) & (e > 0)]] = True
    if cancel is not None:  # the f64 error may be a sizeable part of an ulp here
        rc, cm = cancel
        # every element under its own bound is under the largest bound (a product of
        # non-negative factors rounds monotonically): one compare with a scalar over
        # the piece, then the exact per-element bound on the few below it
        top = rc.max(initial=0.0) * cm.max(initial=0.0)
        pre = np.flatnonzero(ax < top)
        i, j = np.divmod(at(pre), cols)
        cand = pre[rc[i] * cm[j] > ax[pre]]
        if cand.size:
            if error is None:
                near[cand] = True
            else:
                near[cand[_tie_distance(ax[cand], fmt_out) <= error(at(cand))]] = True
    return at(np.flatnonzero(near))


def _tie_distance(ax: np.ndarray, fmt_out) -> np.ndarray:
    """A lower bound of the distance from each |x| (f64) to the nearest rounding tie
    of ``fmt_out``: min(|r - ulp/2|, r + ulp/4) with r = |x| mod ulp (the second term
    covers the tie just below the binade, whose spacing is half as large). r is exact
    (scaling by powers of two, floor, one subtraction); the last subtraction may
    round, so the result is shrunk by 2**-50 to stay a lower bound."""
    _, e = np.frexp(ax)  # ax = m * 2**e, 0.5 <= m < 1 (and e = 0 for 0: use the
    e[ax == 0] = fmt_out.emin + 1  # subnormal spacing there, the finest of the format)
    ulp = np.ldexp(1.0, np.maximum(e - 1, fmt_out.emin) - (fmt_out.precision - 1))
    r = ax - np.floor(ax / ulp) * ulp
    return np.minimum(np.abs(r - 0.5 * ulp), r + 0.25 * ulp) * (1 - 2.0 ** -50)


def _redo_exact(idx: np.ndarray, w_rows: np.ndarray, fmt_in, Bs: np.ndarray, A: np.ndarray,
                scale: float, out_bits: np.ndarray, fmt_out) -> None:
    """Round W + sum_k scale_k Bs[i,k] A[k,j] exactly (rationals) at the flat indices
    ``idx`` of ``out_bits`` (in place; ``Bs`` is B itself, unscaled): the elements whose
    f64 sum lies within rounding noise of a tie, or whose terms cancel (a handful per
    million, often none)."""
    if idx.size == 0:
        return
    cols = out_bits.shape[1]
    # a combination of adapters has one scale per rank column (fusion/algebra.py)
    sk = [Fraction(float(c)) for c in np.broadcast_to(np.asarray(scale, np.float64),
                                                        (A.shape[0],))]
    flat_out = out_bits.reshape(-1)
    for f in idx:
        i, j = divmod(int(f), cols)
        w = float(nm.to_float64(w_rows[i:i + 1, j:j + 1], fmt_in)[0, 0])
        exact = Fraction(w) + sum(
            sk[k] * Fraction(float(Bs[i, k])) * Fraction(float(A[k, j]))
            for k in range(A.shape[0]))
        x = float(exact)  # correctly rounded to f64
        if Fraction(x) != exact:
            # x may sit exactly on a tie that the exact value does not: step off it
            # towards the exact value so the one rounding below goes the right way
            x = float(np.nextafter(x, np.inf if exact > x else -np.inf))
        flat_out[f] = nm.round_to_format(np.array([x]), fmt_out)[0]


def _round_via_f32(x: np.ndarray, bufs: Tuple[np.ndarray, ...], fmt_out, out: np.ndarray,
                   top: float) -> np.ndarray:
    """Round the float64 piece ``x`` into ``out`` (bfloat16 or float16 bits) through
    float32: twice rounded, it is once rounded except where float32 lands on a tie of
    the output (the output's ties are float32 values and rounding is monotone).
    Returns the flat indices float32 cannot settle, to be rounded again from float64: within
    one float32 ulp of a tie (which holds every near tie), at most ``top`` (possible
    cancellation) or the smallest normal (zeros too), NaN, or past the largest finite
    value: a few per hundred thousand, where ``_near_ties`` looks. ``bufs``: float32,
    uint32, uint32, bool and bool work arrays of ``x``'s size at least."""
    u32 = np.uint32
    n = x.size
    y, t, d, flag, more = (b[:n] for b in bufs)
    of = out.reshape(-1)
    with np.errstate(over="ignore", invalid="ignore"):  # overflows are redone below
        np.copyto(y, x.reshape(-1), casting="same_kind")  # one correct rounding
        if fmt_out.name == "float16":  # numpy's float32 -> float16: nearest, ties even
            np.copyto(of.view(np.float16), y, casting="same_kind")
    u = y.view(u32)
    if fmt_out.name == "bfloat16":  # nearest, ties to even, on the bits
        np.right_shift(u, u32(16), out=t)
        np.bitwise_and(t, u32(1), out=t)
        np.add(t, u, out=t)
        np.add(t, u32(0x7FFF), out=t)
        np.right_shift(t, u32(16), out=of, casting="unsafe")
    drop = 24 - fmt_out.precision  # float32 fraction bits below the output's last bit
    np.bitwise_and(u, u32((1 << drop) - 1), out=t)
    np.subtract(t, u32((1 << (drop - 1)) - 1), out=t)  # a tie and its neighbours: 0, 1, 2
    np.less_equal(t, u32(2), out=flag)
    floor = max(top, 2.0 ** fmt_out.emin)
    if not floor < fmt_out.max_value:  # cancellation possible anywhere (or NaN):
        return np.arange(n)  # float64 settles it all
    lo = np.float32(floor)  # below float32's largest: no overflow
    if lo < floor:
        lo = np.nextafter(lo, np.float32(np.inf))
    lo_bits = int(lo.view(u32))
    hi_bits = int(np.float32(fmt_out.max_value).view(u32))
    if lo_bits >= hi_bits:
        return np.arange(n)
    np.bitwise_and(u, u32(0x7FFF_FFFF), out=d)
    np.subtract(d, u32(lo_bits + 1), out=d)  # |y| <= lo wraps past hi: one compare
    np.greater(d, u32(hi_bits - lo_bits - 1), out=more)
    np.bitwise_or(flag, more, out=flag)
    return np.flatnonzero(flag)


def _fuse_nearest(w: np.ndarray, fmt_in, A: np.ndarray, B: np.ndarray, scale: float,
                  magnitude: Optional[np.ndarray], fmt_out) -> np.ndarray:
    rows, cols = w.shape
    out = np.empty((rows, cols), dtype=fmt_out.storage)
    A64 = A.astype(np.float64)
    B64 = B.astype(np.float64)
    Bs = B64 * scale
    # pieces of whole rows (DoRA normalises rows); larger for DoRA, whose row norm
    # pass is cheap next to the per-piece overhead
    step = max(1, (_PIECE * (16 if magnitude is not None else 1)) // max(cols, 1))
    # Cancellation. The f64 result x of W + sum_k Bs[i,k] A[k,j] (any summation order,
    # FMA or not, Bs itself rounded) is within e = g (|W| + S) of the exact value
    # (Higham: g = gamma_n = n u / (1 - n u), n = rank + 3, u = 2**-53), where
    # S = sum_k |Bs[i,k]| |A[k,j]| <= (row L1 norm of Bs) * (column max of |A|).
    # As |W| <= |x| + (1 + g) S, e stays below 2**-21 ulp (K = 2**(21 + precision),
    # ulp >= |x| / 2**precision) wherever S * (2 + g) g K / (1 - g K) < |x|; the
    # other elements are redone exactly (_redo_exact).
    n = A64.shape[0] + 3
    g = n * 2.0 ** -53 / (1 - n * 2.0 ** -53)
    k = 2.0 ** (21 + fmt_out.precision)
    row_c = np.abs(Bs).sum(axis=1) * ((2 + g) * g * k / (1 - g * k))
    col_max = np.abs(A64).max(axis=0) if A64.size else np.zeros(A64.shape[1])
    # bfloat16 and float16 results round through float32 (_round_via_f32); what float32
    # cannot settle is gathered for the whole matrix
    via32 = magnitude is None and fmt_out.name in ("bfloat16", "float16")
    bufs = tuple(np.empty(min(step, rows) * cols, d) for d in
                 (np.float32, np.uint32, np.uint32, np.bool_, np.bool_)) if via32 else ()
    buf = np.empty((min(step, rows), cols), np.float64)
    top = row_c.max(initial=0.0) * col_max.max(initial=0.0)

    def error(flat: np.ndarray) -> np.ndarray:
        """The f64 error bound g (|W| + sum_k |Bs[i,k] A[k,j]|) of the elements at these
        flat indices, doubled (its own f64 evaluation rounds too)."""
        i, j = np.divmod(flat, cols)
        s = np.einsum("mk,km->m", np.abs(Bs[i]), np.abs(A64[:, j]))
        return 2 * g * (np.abs(nm.to_float64(w[i, j], fmt_in)) + s)

    flats, values = [], []
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        x = buf[: r1 - r0]
        np.matmul(Bs[r0:r1], A64, out=x)
        # exact either way; a float32 view of W spares a float64 copy of it
        np.add(x, (nm.to_float32 if fmt_in.precision <= 24 else nm.to_float64)(
            w[r0:r1], fmt_in), out=x)
        if magnitude is not None:
            norm = np.sqrt(np.einsum("ij,ij->i", x, x))
            x *= dora_factor(magnitude[r0:r1], norm, slice(r0, r1))[:, None]
            nm.round_to_format(x, fmt_out, out=out[r0:r1])
        elif via32:
            flat = _round_via_f32(x, bufs, fmt_out, out[r0:r1], top)
            flats.append(flat + r0 * cols)
            values.append(x.reshape(-1)[flat])
        else:
            nm.round_to_format(x, fmt_out, out=out[r0:r1])
            flats.append(_near_ties(x.reshape(-1), None, cols, fmt_out,
                                    (row_c[r0:r1], col_max),
                                    lambda f, r0=r0: error(f + r0 * cols)) + r0 * cols)
    if via32 and flats:
        flat, xs = np.concatenate(flats), np.concatenate(values)
        out.reshape(-1)[flat] = nm.round_to_format(xs, fmt_out)
        flats = [_near_ties(xs, flat, cols, fmt_out, (row_c, col_max), error)]
    if flats:
        _redo_exact(np.concatenate(flats), w, fmt_in, B64, A64, scale, out, fmt_out)
    return out
