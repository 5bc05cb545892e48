"""Models whose dtype MLX's CPU refuses for an op: run them in float32.

MLX's CPU ``GatherMM`` (mlx-lm's ``SwitchLinear``) supports float32 only:
:func:`moe_float32_on_cpu` wraps each expert block to compute in float32 on CPU and
hand its output back in the input's dtype. :func:`float32_if_refused` tries one short
forward pass and, if MLX refuses it, casts the model's float parameters to float32 in
place; the caller's report says so (:data:`F32_NOTE`).
"""
from __future__ import annotations

from typing import Any, Dict, List

__all__ = ["NOTE", "moe_float32_on_cpu", "float32_if_refused"]

MOE_BLOCKS = ("SwitchGLU", "SwitchMLP")
NOTE = ("MoE expert layers ({n}) ran in float32 on CPU: MLX's CPU GatherMM supports "
        "float32 only; the rest of the model kept its dtypes")


#: the words of MLX's error for a CPU kernel that has no bf16 / f16 version
REFUSED_WORDS = "only supports float32"
F32_NOTE = ("computed in float32 on CPU: MLX's CPU backend refused this model's {dtype} "
            "forward pass ({error}); its weights were cast to float32 for this measurement")


def cpu_notes(summary: Dict[str, Any], moe: Dict[str, int], f32: Dict[str, str]) -> None:
    """A report summary's ``note`` (who ran MoE blocks in float32, label -> blocks) and
    ``float32`` (who was cast whole, label -> :data:`F32_NOTE`) lines, where any did."""
    moe, f32 = {k: n for k, n in moe.items() if n}, {k: n for k, n in f32.items() if n}
    if moe:
        summary["note"] = NOTE.format(n=", ".join(f"{k}: {n} blocks" for k, n in moe.items()))
    if f32:
        summary["float32"] = f"{', '.join(f32)}: {next(iter(f32.values()))}"


def refuses_dtype(err: BaseException) -> bool:
    """Whether ``err`` is MLX's "this CPU kernel only supports float32" error."""
    return isinstance(err, (RuntimeError, ValueError)) and REFUSED_WORDS in str(err)


def _float_dtype(model: Any) -> str:
    import mlx.core as mx  # lazy: MLX only when a model is loaded
    from mlx.utils import tree_flatten  # lazy: MLX only when a model is loaded

    kinds = {str(v.dtype).replace("mlx.core.", "") for _, v in tree_flatten(model.parameters())
             if mx.issubdtype(v.dtype, mx.floating) and v.dtype != mx.float32}
    return "/".join(sorted(kinds)) or "float32"


def run_or_float32(model: Any, fn: Any) -> Any:
    """``(fn(), note)``; if MLX's CPU refuses an op's dtype, ``model`` is cast to float32 in
    place and ``fn`` run again (``note``: :data:`F32_NOTE` filled in, else "")."""
    import mlx.core as mx  # lazy: MLX only when a model is loaded

    try:
        out = fn()
        mx.eval(out)
        return out, ""
    except (RuntimeError, ValueError) as e:
        if not refuses_dtype(e):
            raise
        note = F32_NOTE.format(dtype=_float_dtype(model), error=str(e).strip().splitlines()[0])
    model.set_dtype(mx.float32)
    out = fn()
    mx.eval(out)
    return out, note


def float32_if_refused(model: Any, vocab: int = 2) -> str:
    """On MLX's CPU, one short forward pass of ``model``; where MLX refuses an op in its
    dtype, it is cast to float32 in place. The report's note ("" when it ran as it is)."""
    import mlx.core as mx  # lazy: MLX only when a model is loaded

    if mx.default_device().type != mx.cpu:  # MLX's GPU kernels take every float dtype
        return ""
    x = mx.array([[0, min(1, max(vocab - 1, 0))]])
    return run_or_float32(model, lambda: model(x))[1]


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
    """Make ``model``'s MoE blocks compute in float32 on MLX's CPU; the blocks changed."""
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
