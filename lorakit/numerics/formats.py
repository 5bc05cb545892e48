"""Float formats (bfloat16, float16, float32, float64): sizes, limits and storage types."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional

import numpy as np

from ..errors import FormatError

__all__ = ["NAN_MISMATCH", "FloatFormat", "FORMATS", "float_format", "chunks"]

# Elements per internal piece: a few 512 KiB scratch buffers stay in L2/L3,
# which makes the dozen elementwise passes below ~3x faster than whole-array ops.
_PIECE = 1 << 16

_U64 = np.uint64
_F64_ABS = _U64(0x7FFF_FFFF_FFFF_FFFF)
_F64_EXP = _U64(0x7FF0_0000_0000_0000)
_F64_MANT = _U64(0x000F_FFFF_FFFF_FFFF)
_F64_INF = _U64(0x7FF0_0000_0000_0000)

#: Distance :func:`ulp_distance` reports where exactly one side is NaN. It is the
#: largest int64, so ``d > 0``, ``d.max()`` and ``d >= k`` all flag the mismatch
#: instead of hiding it (a ``-1`` would vanish from every such test).
NAN_MISMATCH: int = int(np.iinfo(np.int64).max)


@dataclass(frozen=True)
class FloatFormat:
    """One binary floating-point storage format: its canonical name, safetensors code,
    storage ``bits``, ``precision`` p (implicit bit included: 8, 11, 24), ``emin`` (the
    smallest normal is 2**emin), ``emax`` (the largest binade's exponent), the unsigned
    numpy ``storage`` dtype and ``itemsize``."""

    name: str
    safetensors: str
    bits: int
    precision: int
    emin: int
    emax: int
    storage: np.dtype
    itemsize: int

    @property
    def mantissa_bits(self) -> int:
        """Stored fraction bits (p - 1)."""
        return self.precision - 1

    @property
    def exponent_bits(self) -> int:
        return self.bits - self.precision

    @property
    def sign_mask(self) -> int:
        return 1 << (self.bits - 1)

    @property
    def abs_mask(self) -> int:
        return (1 << (self.bits - 1)) - 1

    @property
    def inf_bits(self) -> int:
        """Bits of +inf; one past the largest finite pattern."""
        return ((1 << self.exponent_bits) - 1) << self.mantissa_bits

    @property
    def max_bits(self) -> int:
        """Bits of the largest finite value."""
        return self.inf_bits - 1

    @property
    def quiet_nan_bits(self) -> int:
        """Bits of the canonical positive quiet NaN lorakit writes."""
        return self.inf_bits | (1 << (self.mantissa_bits - 1))

    @property
    def max_value(self) -> float:
        return (2.0 - 2.0 ** (1 - self.precision)) * 2.0**self.emax

    @property
    def min_normal(self) -> float:
        return 2.0**self.emin

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.emin - self.precision + 1)

    @property
    def numpy_dtype(self) -> Optional[np.dtype]:
        """numpy's own float dtype for this format, or None (bfloat16)."""
        return {"float16": np.dtype(np.float16), "float32": np.dtype(np.float32)}.get(self.name)


def _make(name: str, code: str, bits: int, p: int, emax: int) -> FloatFormat:
    storage = np.dtype(np.uint16 if bits == 16 else np.uint32)
    return FloatFormat(name, code, bits, p, 1 - emax, emax, storage, bits // 8)


FORMATS: dict[str, FloatFormat] = {
    "bfloat16": _make("bfloat16", "BF16", 16, 8, 127),
    "float16": _make("float16", "F16", 16, 11, 15),
    "float32": _make("float32", "F32", 32, 24, 127),
}

_ALIASES = {alias: name for name, more in (("bfloat16", "bf16"), ("float16", "f16 fp16 half"),
                                          ("float32", "f32 fp32 single"))
            for alias in (name, *more.split())}


def float_format(spec: Any) -> FloatFormat:
    """Look up a format by name, safetensors code, numpy dtype or mlx/torch dtype.

    >>> float_format("BF16").name, float_format(np.float16).precision
    ('bfloat16', 11)
    """
    if isinstance(spec, FloatFormat):
        return spec
    if isinstance(spec, str):
        key = spec
    else:
        try:
            key = np.dtype(spec).name  # numpy dtypes and scalar types
        except TypeError:
            key = str(spec)  # mlx.core.bfloat16, torch.bfloat16, ...
    key = key.strip().lower().rsplit(".", 1)[-1]
    if key in _ALIASES:
        return FORMATS[_ALIASES[key]]
    raise FormatError(
        f"unsupported float format {spec!r}",
        expected="bfloat16/BF16, float16/F16 or float32/F32",
        found=repr(spec),
    )


def _is_native(dtype: np.dtype, fmt: FloatFormat) -> bool:
    """True for a float dtype that stores exactly `fmt` (ml_dtypes.bfloat16 included)."""
    # Compare names: np.dtype(...) == None is True for float64, a trap with numpy_dtype.
    return dtype.name == fmt.name



def chunks(n_rows: int, row_elems: int, target_elems: int = 1 << 20) -> Iterator[slice]:
    """Row slices covering ``range(n_rows)``, each about `target_elems` elements (at
    least one row).

    >>> list(chunks(5, 3, target_elems=6))
    [slice(0, 2, None), slice(2, 4, None), slice(4, 5, None)]
    """
    step = max(1, target_elems // max(1, row_elems))
    for start in range(0, n_rows, step):
        yield slice(start, min(start + step, n_rows))
