"""What rounding can explain: per element, how far a correct fuse may land from the
exact intended weight.

``T`` is the exact intended result in float64 (:func:`lorakit.fusion.delta.intended`).
A correct fuse stores ``F`` with ``|F - T| <= bound``, element by element, where the
bound covers every order a correct tool fuses in (``lorakit.fusion.core``'s four
modes, ``mlx_lm fuse``, PEFT's ``merge_and_unload``):

``nearest``
    ``F = round_out(T)``: ``|F - T| <= ulp_out(T) / 2``.
``round-once`` (PEFT)
    ``F = round_out(fl32(W + d32))``: the f32 delta's own error ``e32`` plus one f32
    addition, then one rounding.
``mlx-lm`` / ``scale-after`` (and PEFT's embedding order)
    ``F = round_w(W + round_w(d32))``: the f32 delta rounded to the weight's format
    ``w`` first, then the sum rounded again.

so for LoRA, with ``D = T - W`` and ``u(x) = ulp_w(x) / 2`` the half-spacing of the
working format (the base weight's dtype)::

    bound = u(D) + u(T) + e32 + 2**-24 |T|        (+ ulp_out(T) / 2 if out != w)
    e32   = (r + 2) 2**-24 |scale| (|B| @ |A|)    (an f32 dot product of length r)

The magnitudes are taken one bound above ``|T|`` and ``|D|`` (a value may round up
into the next binade). DoRA rescales rows by ``s = m / ||X||`` with ``X = W + D``
(mlx-lm normalises the already rounded ``X``, and its norm comes back in ``X``'s dtype),
so the element term is scaled by ``s`` and the row norm's own error adds
``|T| ((||e||_row + ulp_w(||X||_row) / 2) / ||X||_row + (n + 16) 2**-24)``.

A re-quantized (affine) weight adds the quantization of each group: one step
``|scale_g|`` (``mx.quantize`` fits the scale so that the group's larger edge is a code
and clips at the other end, which costs up to a whole step, not half; 5% slack for a
group whose range moved by the fuse's rounding), the storage rounding of the scale
(``2**bits`` codes times its half-ulp) and of the bias, and the rounding of the
dequantized value. Other quantization modes use twice the
largest error a correct re-quantization of the same group shows.

A wrong merge whose distance stays inside this bound everywhere cannot be told from a
correct one: that is the detection limit (measured in ``tests/test_merge_verdicts.py``).
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .. import numerics as nm
from ..fusion.delta import Piece

__all__ = ["float_bound", "quant_bound"]

_U32 = 2.0 ** -24


def _half_ulp(mag: np.ndarray, fmt: Any) -> np.ndarray:
    return 0.5 * nm.ulp(mag, fmt)


def _up(mag: np.ndarray, fmt: Any) -> np.ndarray:
    """A magnitude one spacing above ``mag`` (a value near it may round up a binade)."""
    return mag + nm.ulp(mag, fmt)


_LAST: list = []  # (A, B, rows, |B| @ |A|, B @ A): the pieces of one chunk, reused by the
# candidates of a failing tensor, which differ from the piece only by their scale


def _products(p: Piece, rows: Optional[slice]):
    """``(|B| @ |A|, B @ A)`` of the piece's rows, with a scale per rank column (an
    exact combination, fusion/algebra.py) folded into B's columns; then the caller's
    scale is 1."""
    key = (rows.start, rows.stop) if rows is not None else None
    per_column = np.ndim(p.scale) > 0
    if not per_column and _LAST and _LAST[0] is p.A and _LAST[1] is p.B and _LAST[2] == key:
        return _LAST[3], _LAST[4]
    B = (p.B if rows is None else p.B[rows]).astype(np.float64)
    if per_column:
        B = B * np.asarray(p.scale, np.float64)[None, :]
    A = p.A.astype(np.float64)
    out = (np.abs(B) @ np.abs(A), B @ A)
    if not per_column:
        _LAST[:] = [p.A, p.B, key, *out]
    return out


def float_bound(T: np.ndarray, W: np.ndarray, p: Piece, rows: Optional[slice],
                fmt_work: Any, fmt_out: Any) -> np.ndarray:
    """Per element, the largest ``|F - T|`` a correct fuse of piece ``p`` can leave
    (see the module docstring). ``T`` and ``W`` are the float64 target and base rows."""
    S1, BA = _products(p, rows)
    scale = p.scale if np.ndim(p.scale) == 0 else 1.0  # else folded into the products
    S = abs(scale) * S1
    e32 = (p.A.shape[0] + 2) * _U32 * S
    D = scale * BA
    X = W + D  # before DoRA's normalisation (T itself for LoRA)
    aX, aD = np.abs(X), np.abs(D)
    e = (_half_ulp(_up(aD + e32, fmt_work), fmt_work) + _half_ulp(_up(aX + e32, fmt_work), fmt_work)
         + e32 + _U32 * aX)
    aT = np.abs(T)
    same = fmt_out.safetensors == fmt_work.safetensors
    if p.magnitude is None:
        out = e if same else e + _half_ulp(_up(aT + e, fmt_out), fmt_out)
        return out
    norm = np.sqrt(np.einsum("ij,ij->i", X, X))
    m = np.abs((p.magnitude if rows is None else p.magnitude[rows]).astype(np.float64))
    s = np.divide(m, norm, out=np.zeros_like(m), where=norm > 0)
    e_row = np.sqrt(np.einsum("ij,ij->i", e, e))
    # mlx-lm takes the norm of the rounded X in X's own dtype: one more rounding of it
    e_row = e_row * 1.01 + _half_ulp(_up(norm + e_row * 1.01, fmt_work), fmt_work)
    rel = np.divide(e_row, norm, out=np.zeros_like(e_row), where=norm > 0) \
        + (X.shape[1] + 16) * _U32
    y = s[:, None] * e + aT * rel[:, None]
    return y + _half_ulp(_up(aT + y, fmt_out), fmt_out)


def quant_bound(T: np.ndarray, F: np.ndarray, Q: np.ndarray, pre: np.ndarray, q: Any,
                scales: np.ndarray, biases: Optional[np.ndarray], fmt_scales: Any) -> np.ndarray:
    """Per element, the largest ``|F - T|`` a correct re-quantized fuse can leave.

    ``pre`` is the float bound of the value before quantization (:func:`float_bound`),
    ``Q`` a correct re-quantization of ``T`` (dequantized, float64), ``scales`` /
    ``biases`` its groups' parameters as float64 (rows, in / group_size).
    """
    g = q.group_size
    rows, cols = T.shape
    grp = np.abs(Q - T).reshape(rows, cols // g, g).max(axis=2)  # a correct fuse's worst
    if q.mode == "affine":
        step = np.abs(scales)
        h = 0.5 * nm.ulp(step, fmt_scales)  # storage rounding of the scale (and bias)
        if biases is not None:
            h = h + 0.5 * nm.ulp(np.abs(biases), fmt_scales) / 2 ** q.bits
        err = 1.05 * step + (2 ** q.bits) * h
    else:  # no closed form here: twice what a correct re-quantization shows per group
        err = 2 * grp
    err = np.repeat(err, g, axis=1)[:, :cols]
    err += _half_ulp(_up(np.abs(F), fmt_scales), fmt_scales)  # the dequantized value
    return pre + err
