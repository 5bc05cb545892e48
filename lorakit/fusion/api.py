"""``lorakit.fuse``: one verb for a checkpoint on disk and a model in memory.

A path (or hub repo id) goes through the streaming fuse
(:func:`lorakit.fusion.stream.fuse`: a new checkpoint written beside, the base never
touched); an mlx-lm model in memory is fused in place
(:func:`lorakit.fusion.model.fuse_model`). Both round through the same core.

>>> import lorakit, tempfile, os
>>> out = os.path.join(tempfile.mkdtemp(), "fused")
>>> r = lorakit.fuse("data/tiny-qwen3", "data/adapters/lora", out, progress=False)
>>> r.rounding, r.dtype_policy
('nearest', 'preserve')
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional, Union

from ..io.adapter import Adapter
from .model import fuse_model
from .quant_policy import check_float_base
from .stream import FuseResult, fuse as fuse_checkpoint

PathLike = Union[str, Path]

__all__ = ["fuse"]


def fuse(model: Any, adapter_path: Union[None, PathLike, Adapter] = None,
         save_path: Optional[PathLike] = None, *, rounding: str = "nearest",
         dtype: str = "preserve", dequantize: bool = False, force: bool = False,
         export_gguf: Optional[str] = None,
         progress: Union[bool, Callable[[int, int], None]] = True,
         quant_policy: str = "requant", quant_budget: Optional[float] = None,
         float_base: Optional[PathLike] = None) -> Any:
    """Fuse an adapter: ``W' = W + scale * B @ A`` for every adapted weight, rounded as
    ``rounding`` says and written in the weight's own dtype unless ``dtype`` says otherwise.

    Args:
        model: base checkpoint directory or hub repo id, written to ``save_path``; or an
            mlx-lm model in memory, fused in place (with its LoRA layers when
            ``adapter_path`` is None).
        adapter_path: adapter directory (mlx-lm or PEFT format) or a loaded adapter.
        save_path: output directory (checkpoints only).
        rounding: ``nearest`` (default), ``round-once`` (PEFT), ``mlx-lm`` (bit-identical to
            ``mlx_lm fuse``) or ``scale-after``.
        dtype: ``preserve`` (default), ``promote``, ``bfloat16``, ``float16``, ``float32``.
        dequantize: for quantized bases, write float weights instead of re-quantizing.
        force / export_gguf / progress: as :func:`lorakit.fusion.stream.fuse`
            (checkpoints only).
        quant_policy: for a quantized base, how adapted modules are stored: ``requant``
            (default, as ``mlx_lm fuse``), ``same-grid``, ``bits:N``, ``float``, ``auto``
            (:mod:`lorakit.fusion.quant_policy`); ``quant_budget`` caps auto's bytes
            relative to the quantized base (default 1.15).
        float_base: fuse a QLoRA adapter trained on the quantized ``model`` into this
            float original of it instead (float weights written).

    Returns:
        A :class:`~lorakit.fusion.stream.FuseResult` for a checkpoint; the model itself
        for a model in memory.
    """
    if hasattr(model, "parameters") and hasattr(model, "named_modules"):
        if save_path is not None:
            raise TypeError("a model in memory is fused in place; save it with "
                            "mlx_lm's save functions, or pass a checkpoint path to write one")
        return fuse_model(model, adapter_path, rounding=rounding, dtype=dtype,
                          dequantize=dequantize)
    if adapter_path is None or save_path is None:
        raise TypeError("fuse(model_path, adapter_path, save_path): a checkpoint fuse needs "
                        "an adapter and an output directory")
    if float_base is not None:
        model = check_float_base(model, float_base)
    result: FuseResult = fuse_checkpoint(model, adapter_path, save_path, rounding=rounding,
                                         dtype=dtype, dequantize=dequantize, force=force,
                                         export_gguf=export_gguf, progress=progress,
                                         quant_policy=quant_policy, quant_budget=quant_budget)
    return result
