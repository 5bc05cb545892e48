"""Decode timing: :func:`time_decode` runs each variant in its own process and returns a
:class:`DecodeTiming` table. Importing this package loads nothing heavy."""
from __future__ import annotations

from typing import Any

__all__ = ["time_decode", "DecodeTiming", "VariantTiming", "VARIANTS"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import decode, table

        return getattr(decode if name == "time_decode" else table, name)
    raise AttributeError(f"module 'lorakit.timing' has no attribute {name!r}")
