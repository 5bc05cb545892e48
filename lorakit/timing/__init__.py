"""Decode timing: :func:`time_decode` runs each variant in its own process and returns a
:class:`DecodeTiming` table. Importing this package loads nothing heavy."""
from __future__ import annotations

from ..lazy import lazy_exports

__all__ = ["time_decode", "DecodeTiming", "VariantTiming", "VARIANTS"]

__getattr__, __dir__ = lazy_exports(__name__, {
    n: ("lorakit.timing." + ("decode" if n == "time_decode" else "table"), n) for n in __all__})
