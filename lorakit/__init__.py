"""lorakit: fuse, inspect, compare and time LoRA adapters for MLX, correct to the last bit.

The top level is nine verbs and the error type; importing it loads neither numpy, MLX,
ipywidgets nor matplotlib (each verb loads what it needs when called).

===================  ====================================================================
``fuse``             fuse an adapter into a checkpoint on disk (or a model in memory)
``check``            did the merge work? a fused checkpoint against base + adapter
``diff``             two checkpoints tensor by tensor, to the ulp
``open``             a checkpoint, adapter, ``.safetensors`` file or model as a tensor source
``load_adapter``     an adapter (mlx-lm or PEFT format) as lorakit's one description
``combine``          N adapters with weights as one adapter (exact, cat, svd, PEFT's)
``extract``          a LoRA from two checkpoints (tuned minus base), truncated SVD
``time_decode``      decode speed and memory of base, fused and unfused variants
``compare_outputs``  behaviour on a corpus: per-token KL, top-1 agreement, perplexity
===================  ====================================================================

More verbs live in the packages (``lorakit.inspect``, ``lorakit.algebra``,
``lorakit.fusion``, ``lorakit.synth``, ``lorakit.widgets``).

>>> import lorakit
>>> sorted(lorakit.__all__)[:3]
['LorakitError', '__version__', 'check']
>>> result = lorakit.fuse("data/tiny-qwen3", "data/adapters/lora", "fused")
>>> result.tensors_fused, result.rounding
(28, 'nearest')
"""
from __future__ import annotations

from .lazy import lazy_exports

__version__ = "0.1.0"

#: verb -> (module, attribute)
VERBS = {
    "fuse": ("lorakit.fusion.fuse", "fuse"),
    "check": ("lorakit.inspect.check", "check"),
    "diff": ("lorakit.inspect.diff", "diff"),
    "open": ("lorakit.io.formats.source", "open"),
    "load_adapter": ("lorakit.io.adapters.load", "load_adapter"),
    "combine": ("lorakit.algebra.combine", "combine"),
    "extract": ("lorakit.inspect.extraction", "extract"),
    "time_decode": ("lorakit.timing.decode", "time_decode"),
    "compare_outputs": ("lorakit.inspect.behaviour", "compare_outputs"),
    "LorakitError": ("lorakit.errors", "LorakitError"),
}

_PACKAGES = ("numerics", "io", "fusion", "algebra", "inspect", "timing", "synth", "widgets",
             "cli", "report", "errors", "progress")

# ``open`` is a verb here but stays out of ``__all__``: ``from lorakit import *`` must
# not shadow the builtin.
__all__ = sorted(n for n in VERBS if n != "open") + ["__version__"]

__getattr__, _dir = lazy_exports(__name__, VERBS, _PACKAGES)


def __dir__() -> list:
    return _dir() + ["__version__"]
