"""Finite results only: a fuse or a dtype conversion never writes Inf where the input
was finite; it names the tensor and the first element instead (checks read the
exponent bits of the raw storage: no float conversion, no whole-tensor temporaries).

>>> import numpy as np
>>> cast_raw(np.array([1.0, 65504.0], np.float32), "F32", "F16").tolist()
[1.0, 65504.0]
>>> cast_raw(np.array([1.0, 1e5], np.float32), "F32", "F16", "w")
Traceback (most recent call last):
lorakit.errors.FuseError: tensor does not fit F16: converting it would write Inf ...
"""
from __future__ import annotations

from typing import Callable, Tuple

import numpy as np

from .. import numerics as nm
from ..errors import FuseError
from ..io.adapters.base import Replacement
from ..io.formats.safetensors import NUMPY_STORAGE, mx_to_raw

__all__ = []

_PIECE = 1 << 18  # elements scanned per step of the any-non-finite check

_EXP_MASK = {"BF16": (np.uint16, 0x7F80), "F16": (np.uint16, 0x7C00),
             "F32": (np.uint32, 0x7F800000), "F64": (np.uint64, 0x7FF0000000000000)}


def nonfinite(raw: np.ndarray, code: str) -> np.ndarray:
    """Mask of inf/NaN elements, from the exponent bits alone (no float conversion)."""
    st, m = _EXP_MASK[code]
    b = raw.view(st)
    return (b & st(m)) == st(m)


def any_nonfinite(raw: np.ndarray, code: str) -> bool:
    """Whether any element is inf/NaN: a masked max, in pieces, with no bool temporaries."""
    st, m = _EXP_MASK[code]
    flat = raw.reshape(-1).view(st)
    buf = np.empty(min(flat.size, _PIECE), st)
    for i in range(0, flat.size, buf.size):
        part = flat[i:i + buf.size]
        t = buf[: part.size]
        np.bitwise_and(part, st(m), out=t)
        if t.size and t.max() == m:
            return True
    return False


def _new_nonfinite(out: np.ndarray, code_out: str, src: np.ndarray, code_in: str):
    """(count, first index) of elements non-finite in ``out`` but finite in ``src``;
    None when there are none (the common case costs one masked scan)."""
    if not any_nonfinite(out, code_out):
        return None
    new = nonfinite(out, code_out) & ~nonfinite(src, code_in)
    if not new.any():
        return None
    return int(new.sum()), tuple(int(v) for v in np.argwhere(new)[0])


def check_result(out: np.ndarray, code_out: str, w: np.ndarray, code_in: str, name: str) -> None:
    """Refuse a fused result with Inf/NaN where the weight was finite (``w``: raw
    storage, or an ``mx.array`` as the MLX orders take it)."""
    if not isinstance(w, np.ndarray) and any_nonfinite(out, code_out):
        w = mx_to_raw(w)[0]
    bad = _new_nonfinite(out, code_out, w, code_in)
    if bad is not None:
        raise FuseError("fused weight is not finite: the sum overflows the output dtype "
                        "or the adapter is too large", tensor=name,
                        expected=f"finite {code_out} values",
                        found=f"{bad[0]} non-finite elements, first at {list(bad[1])}",
                        hint="check the adapter's scale, or write float32 (--dtype float32)")


def cast_raw(raw: np.ndarray, code_in: str, code_out: str, name: str = "") -> np.ndarray:
    """Convert raw float storage between formats with one correct rounding.

    A finite value that does not fit the output format (``--dtype float16`` over a
    bf16 weight of 1e5) is refused by name rather than written as Inf.
    """
    if code_in == code_out:
        return raw
    x = nm.to_float64(raw, nm.float_format(code_in))
    out = nm.round_to_format(x, nm.float_format(code_out)).view(NUMPY_STORAGE[code_out])
    bad = _new_nonfinite(out, code_out, raw, code_in)
    if bad is not None:
        raise FuseError(f"tensor does not fit {code_out}: converting it would write Inf",
                        tensor=name or None, expected=f"finite {code_out} values",
                        found=f"{bad[0]} elements out of {code_out}'s range, "
                              f"first at {list(bad[1])} ({float(x[bad[1]])!r})",
                        hint="keep the checkpoint's dtype (--dtype preserve) or write "
                             "float32")
    return out


def replaced_raw(r: Replacement, base: Callable[[], Tuple[np.ndarray, str]]
                 ) -> Tuple[np.ndarray, str]:
    """What Replacement ``r`` puts in its tensor's place, (raw, dtype code): the adapter's
    own copy (PEFT's modules_to_save), or for trainable tokens the base (``base()``: raw,
    code) with those rows replaced by their values rounded once to its dtype, as PEFT's
    ``index_copy``."""
    if not r.rows:
        return r.raw, r.code
    raw, code = base()
    out = np.array(raw)
    out[list(r.rows)] = cast_raw(r.raw, r.code, code).reshape(len(r.rows), -1)
    return out, code
