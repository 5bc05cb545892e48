"""Float formats and the exact float math lorakit stands on.

Values travel through lorakit as their *storage bits* (``uint16`` for bfloat16 and
float16, ``uint32`` for float32: numpy has no bfloat16). This package decodes bits,
rounds values into a format as IEEE 754 says (one rounding, ties to even, subnormals,
overflow to inf) and measures distances in ulps, vectorised over any shape.

>>> bits = round_to_format(np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8]), "bfloat16")
>>> [hex(b) for b in bits.tolist()]
['0x3f80', '0x3f80', '0x3f82']
>>> to_float64(bits, "bf16").tolist()
[1.0, 1.0, 1.015625]
>>> ulp_distance(bits[:1], bits[2:], "bfloat16").tolist()
[2]
"""
from __future__ import annotations

import numpy as np  # noqa: F401  (the doctest examples above use np)

from .formats import FORMATS, NAN_MISMATCH, FloatFormat, chunks, float_format
from .ulps import nan_mismatch, ulp, ulp_distance, ulp_error_vs_reference, ulp_histogram
from .values import (
    fma_f32,
    from_storage,
    isnan_bits,
    round_to_format,
    to_float32,
    to_float64,
    to_storage,
)

__all__ = (
    ["FloatFormat", "FORMATS", "NAN_MISMATCH", "float_format", "chunks"]
    + ["to_float32", "to_float64", "from_storage", "to_storage", "round_to_format", "isnan_bits"]
    + ["ulp", "ulp_distance", "nan_mismatch", "ulp_error_vs_reference", "ulp_histogram", "fma_f32"]
)

# doctest.testmod(lorakit.numerics) runs the examples of the functions the submodules
# define, as it did when this was one module
__test__ = {name: globals()[name] for name in __all__ if callable(globals()[name])}
