"""lorakit: fuse, inspect, compare and time LoRA adapters for MLX, correct to the last bit.

The top level is a handful of verbs; everything else lives in the subpackages
(``lorakit.io``, ``lorakit.fusion``, ``lorakit.inspect``, ``lorakit.timing``,
``lorakit.widgets``, ``lorakit.synth``). Importing lorakit imports neither numpy, MLX,
Jupyter, ipywidgets nor matplotlib; each verb loads what it needs when called.

========================  ===============================================================
``fuse``                  fuse an adapter into a checkpoint on disk (or a model in memory)
``open``                  a checkpoint, adapter, ``.safetensors`` file or model as a tensor source
``load_adapter``          an adapter (mlx-lm or PEFT format) as lorakit's one description
``attach_adapter``        put an adapter on a loaded mlx-lm model, unfused
``combine``               N adapters with weights as one adapter (exact, cat, svd, PEFT's)
``convert``               an adapter written in the other format (mlx-lm <-> PEFT), exactly
``dtype_map``             per-layer dtypes and bytes, from headers only
``delta_norms``           norms, spectra and ranks of an adapter's deltas
``compare_adapters``      two adapters of one base, module by module
``compare``               two checkpoints tensor by tensor, to the ulp
``check``                 did the merge work? a fused checkpoint against base + adapter
``compare_generations``   greedy text of several models side by side
``compare_outputs``       behaviour on a corpus: per-token KL, top-1 agreement, perplexity
``time_decode``           decode speed and memory of base, fused and unfused variants
``extract``               a LoRA from two checkpoints (tuned minus base), truncated SVD
``resize``                an adapter at a lower rank, from its factors alone
========================  ===============================================================

>>> import lorakit
>>> sorted(lorakit.__all__)[:3]
['LorakitError', '__version__', 'attach_adapter']
>>> result = lorakit.fuse("data/tiny-qwen3", "data/adapters/lora", "fused")
>>> result.tensors_fused, result.rounding
(28, 'nearest')
"""
from __future__ import annotations

import warnings
from importlib import import_module
from typing import Any

__version__ = "0.1.0"

# name -> (module, attribute)
_EXPORTS = {
    "fuse": ("lorakit.fusion.fuse", "fuse"),
    "open": ("lorakit.io.source", "open"),
    "load_adapter": ("lorakit.io.adapters.load", "load_adapter"),
    "combine": ("lorakit.algebra.combine", "combine"),
    "convert": ("lorakit.algebra.combine", "convert"),
    "attach_adapter": ("lorakit.fusion.model", "attach_adapter"),
    "dtype_map": ("lorakit.inspect.dtype_map", "dtype_map"),
    "delta_norms": ("lorakit.inspect.deltas", "delta_norms"),
    "compare_adapters": ("lorakit.inspect.adapters", "compare_adapters"),
    "compare": ("lorakit.inspect.diff", "parity"),
    "check": ("lorakit.inspect.check", "merge_check"),
    "compare_generations": ("lorakit.inspect.generation", "compare_generations"),
    "compare_outputs": ("lorakit.inspect.behaviour", "compare_outputs"),
    "time_decode": ("lorakit.timing.decode", "time_decode"),
    "extract": ("lorakit.algebra.extract", "extract"),
    "resize": ("lorakit.algebra.resize", "resize"),
    "LorakitError": ("lorakit.errors", "LorakitError"),
}

# old name -> (module, attribute, what to use instead); they work for one more release
_DEPRECATED = {
    "FuseResult": ("lorakit.fusion.fuse", "FuseResult", "lorakit.fusion.fuse.FuseResult"),
    "fuse_model": ("lorakit.fusion.model", "fuse_model", "lorakit.fuse(model, adapter)"),
    "Adapter": ("lorakit.io.adapters.load", "Adapter", "lorakit.load_adapter(path)"),
    "Checkpoint": ("lorakit.io.checkpoint", "Checkpoint", "lorakit.open(path)"),
    "open_checkpoint": ("lorakit.io.checkpoint", "open_checkpoint", "lorakit.open(path)"),
    "ulp_compare": ("lorakit.inspect.diff", "ulp_compare", "lorakit.compare(a, b)"),
    "parity": ("lorakit.inspect.diff", "parity", "lorakit.compare(a, b)"),
    "merge_check": ("lorakit.inspect.check", "merge_check", "lorakit.check(...)"),
    "synth_checkpoint": ("lorakit.synth", "synth_checkpoint", "lorakit.synth.synth_checkpoint"),
    "synth_adapter": ("lorakit.synth", "synth_adapter", "lorakit.synth.synth_adapter"),
}

# ``open`` is a verb here but stays out of ``__all__``: ``from lorakit import *`` must
# not shadow the builtin.
__all__ = sorted(n for n in _EXPORTS if n != "open") + ["__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        mod, attr = _EXPORTS[name]
    elif name in _DEPRECATED:
        mod, attr, instead = _DEPRECATED[name]
        warnings.warn(f"lorakit.{name} is deprecated and goes in the next release; "
                      f"use {instead}", DeprecationWarning, stacklevel=2)
        return getattr(import_module(mod), attr)  # not cached: warn at every use
    else:
        raise AttributeError(f"module 'lorakit' has no attribute {name!r}")
    value = getattr(import_module(mod), attr)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(_EXPORTS) + ["__version__"]
