"""Mixture-of-experts layers on MLX's CPU: run them in float32.

MLX's CPU ``GatherMM`` (the kernel behind mlx-lm's ``SwitchLinear`` and
``LoRASwitchLinear``) supports float32 only today; a bf16 MoE checkpoint fails on
its first forward pass with ``[GatherMM::eval] Currently only supports float32``.
:func:`moe_float32_on_cpu` wraps each expert block (``SwitchGLU`` / ``SwitchMLP``)
of a loaded model so that on CPU it computes in float32 (its weights cast once) and
hands its output back in the input's dtype; everything else keeps its dtype.
Generation (``compare_generations``) and decode timing call it and say so in their
reports. On a GPU, or for quantized experts (``gather_qmm``), it changes nothing.
"""
from __future__ import annotations

from typing import Any, List

__all__ = ["NOTE", "moe_float32_on_cpu"]

MOE_BLOCKS = ("SwitchGLU", "SwitchMLP")
NOTE = ("MoE expert layers ({n}) ran in float32 on CPU: MLX's CPU GatherMM supports "
        "float32 only; the rest of the model kept its dtypes")


def _needs_f32(block: Any) -> bool:
    import mlx.core as mx  # lazy: MLX only when a model is loaded
    from mlx.utils import tree_flatten  # lazy: MLX only when a model is loaded

    if type(block).__name__ not in MOE_BLOCKS:
        return False
    if any(type(m).__name__.startswith("Quantized") for _, m in block.named_modules()):
        return False  # gather_qmm: not the float32-only kernel
    return any(v.dtype in (mx.bfloat16, mx.float16)
               for _, v in tree_flatten(block.parameters()))


def moe_float32_on_cpu(model: Any) -> List[str]:
    """Make ``model``'s MoE expert blocks compute in float32 when MLX's default device
    is the CPU (in place). Returns the paths of the blocks changed (empty: nothing to
    do)."""
    import mlx.core as mx  # lazy: MLX only when a model is loaded

    if mx.default_device().type != mx.cpu:
        return []
    changed: List[str] = []
    for path, m in model.named_modules():
        if _needs_f32(m):
            m.set_dtype(mx.float32)
            _wrap(m)
            changed.append(path)
    return changed


def _wrap(block: Any) -> None:
    """Give this one block a class whose call casts in and out (the instance's class
    changes; a dunder call cannot be overridden on an instance)."""
    import mlx.core as mx  # lazy: MLX only when a model is loaded

    cls = type(block)
    if getattr(cls, "_lorakit_f32", False):
        return

    def __call__(self, x, *args, **kwargs):
        return cls.__call__(self, x.astype(mx.float32), *args, **kwargs).astype(x.dtype)

    block.__class__ = type(cls.__name__, (cls,), {"__call__": __call__, "_lorakit_f32": True})
