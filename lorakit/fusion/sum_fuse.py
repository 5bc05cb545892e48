"""The fuse of an exact combination with DoRA adapters among its parts
(:class:`lorakit.fusion.delta.SumTarget`): ``W + sum_i w_i (T_i(W) - W)`` in float64
(:func:`lorakit.fusion.delta.intended`), rounded once to the output format, ties to even.

A DoRA part's row norm is a square root, so there is no exact-rational fallback as in
:mod:`lorakit.fusion.nearest`: the float64 value is rounded once, within 0.5 ulp of it
(``tests/algebra/test_combine_dora.py``). Only ``rounding='nearest'`` applies.
"""
from __future__ import annotations

from typing import Tuple

import numpy as np

from .. import numerics as nm
from ..errors import FuseError
from ..io.formats.safetensors import NUMPY_STORAGE
from .delta import Piece, intended
from .finite import check_result

__all__ = []

_ROWS_ELEMENTS = 1 << 20  # float64 elements per block of rows


def fuse_sum(w: np.ndarray, code_in: str, code_out: str, p: Piece, rounding: str,
             name: str = "") -> Tuple[np.ndarray, str]:
    """(raw storage, dtype code) of ``round_once(intended(W, p))`` for a 2-D slice ``w``
    (raw storage of ``code_in``), computed a block of rows at a time."""
    if rounding != "nearest":
        raise FuseError("an exact combination with DoRA adapters is fused correctly "
                        "rounded only", tensor=name or None, expected="rounding='nearest'",
                        found=repr(rounding),
                        hint="the other orders are those of one adapter's runtime; fuse "
                        "DoRA adapters one at a time to use them")
    if code_in not in ("BF16", "F16", "F32") or code_out not in ("BF16", "F16", "F32"):
        raise FuseError("cannot fuse into a non-float weight", tensor=name or None,
                        expected="a BF16, F16 or F32 weight", found=f"{code_in} -> {code_out}")
    if w.shape != p.shape:
        raise FuseError("shapes do not fit together", tensor=name or None,
                        expected=f"weight (out, in) = {p.shape}", found=f"{list(w.shape)}")
    fmt_in, fmt_out = nm.float_format(code_in), nm.float_format(code_out)
    rows, cols = w.shape
    out = np.empty((rows, cols), dtype=fmt_out.storage)
    step = max(1, _ROWS_ELEMENTS // max(cols, 1))
    try:
        for r0 in range(0, rows, step):
            sl = slice(r0, min(rows, r0 + step))
            nm.round_to_format(intended(nm.to_float64(w[sl], fmt_in), p, sl), fmt_out,
                               out=out[sl])
    except FuseError as e:  # DoRA's zero-norm row: name the weight
        raise e.where(tensor=name or None) from None
    out = out.view(NUMPY_STORAGE[code_out])
    check_result(out, code_out, w, code_in, name)
    return out, code_out
