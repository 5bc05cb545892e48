"""lorakit: fuse, inspect, compare and time LoRA adapters for MLX, correct to the last bit.

The top level holds the verbs; everything else lives in the subpackages
(``lorakit.io``, ``lorakit.fusion``, ``lorakit.inspect``, ``lorakit.timing``,
``lorakit.widgets``). Importing lorakit imports neither Jupyter, ipywidgets nor
matplotlib; the verbs load what they need when called.

>>> import lorakit
>>> result = lorakit.fuse("data/tiny-qwen3", "data/adapters/lora", "fused")
>>> result.tensors_fused, result.rounding
(28, 'nearest')
"""
from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "fuse": "lorakit.fusion.stream",
    "FuseResult": "lorakit.fusion.stream",
    "fuse_model": "lorakit.fusion.model",
    "attach_adapter": "lorakit.fusion.model",
    "load_adapter": "lorakit.io.adapter",
    "Adapter": "lorakit.io.adapter",
    "Checkpoint": "lorakit.io.checkpoint",
    "open_checkpoint": "lorakit.io.checkpoint",
    "dtype_map": "lorakit.inspect.dtype_map",
    "delta_norms": "lorakit.inspect.deltas",
    "ulp_compare": "lorakit.inspect.ulp",
    "parity": "lorakit.inspect.parity",
    "merge_check": "lorakit.inspect.merge_check",
    "compare_generations": "lorakit.inspect.generation",
    "compare_adapters": "lorakit.inspect.adapters",
    "time_decode": "lorakit.timing.decode",
    "synth_checkpoint": "lorakit.synth",
    "synth_adapter": "lorakit.synth",
    "LorakitError": "lorakit.errors",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'lorakit' has no attribute {name!r}")
    value = getattr(import_module(mod), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return __all__
