"""A weight's values as float64, from any tensor source (dequantizing packed weights).

Split from :mod:`lorakit.io.formats.source` so that opening a source and reading its headers
loads no numpy (``lorakit inspect`` of a checkpoint starts fast).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ... import numerics as nm
from ...errors import FormatError
from .safetensors import FLOAT_CODES, raw_to_mx
from .source import TensorSource

__all__ = ["weight_f64"]


def weight_f64(src: TensorSource, name: str, rows: Optional[slice] = None) -> np.ndarray:
    """A weight's values as float64, dequantizing packed weights with ``mx.dequantize``.

    ``rows`` slices the leading axis (for quantized weights the whole tensor is
    dequantized first; they are small).
    """
    module = name[: -len(".weight")] if name.endswith(".weight") else name
    q = src.quant_params(module) if name.endswith(".weight") else None
    if q is None:
        code = src.tensors[name].dtype
        raw = src.read(name, rows)
        if code == "F64":
            return np.asarray(raw, np.float64)
        if code not in FLOAT_CODES:
            raise FormatError("not a float tensor", tensor=name, found=code,
                              expected="BF16, F16, F32 or F64 (or a quantized weight)")
        return nm.to_float64(raw, nm.float_format(code))
    import mlx.core as mx  # lazy: mlx is heavy and optional at import

    parts = []
    for leaf in ("weight", "scales", "biases"):
        n = f"{module}.{leaf}"
        parts.append(raw_to_mx(src.read(n), src.tensors[n].dtype) if n in src.tensors else None)
    w, s, b = parts
    x = mx.dequantize(w, s, b, group_size=q.group_size, bits=q.bits, mode=q.mode)
    out = np.array(x.astype(mx.float32)).astype(np.float64)
    return out if rows is None else out[rows]
