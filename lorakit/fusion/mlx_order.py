"""mlx-lm's fuse orders (``mlx-lm``, ``scale-after``), computed by MLX itself.

``mlx_lm fuse`` (``LoRALinear.fuse``) computes ``weight + ((scale * B) @ A).astype(weight.dtype)``
through MLX; :func:`fuse_mlx_array` runs the same operations in the same order and dtypes, so
the bits are MLX's on whatever device and BLAS it uses (tests/fusion/test_mlx_order.py
compares them with mlx-lm's own fuse).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..errors import ArgumentError
from ..io.formats.dtypes import mx_dtype
from ..io.formats.safetensors import mx_to_raw, raw_to_mx
from .delta import check_dora_norm

__all__ = []


def fuse_mlx(w, code_in: str, A: np.ndarray, B: np.ndarray, scale: float,
             magnitude: Optional[np.ndarray], code_out: str, rounding: str,
             promote: bool) -> np.ndarray:
    """One weight fused in mlx-lm's order: raw storage of ``code_out`` (the convention
    of lorakit.io.formats.safetensors.read_raw). ``w`` is raw storage, or an ``mx.array``."""
    import mlx.core as mx  # lazy: MLX only when computing

    weight = raw_to_mx(w, code_in) if isinstance(w, np.ndarray) else w  # or already MLX's
    m = None if magnitude is None else mx.array(magnitude)
    out = fuse_mlx_array(weight, mx.array(A), mx.array(B), scale, m, rounding=rounding,
                         promote=promote)
    if not promote or out.dtype != mx.float32:
        out = out.astype(mx_dtype(code_out))
    raw, _ = mx_to_raw(out)
    return raw


def fuse_mlx_array(weight, A, B, scale: float, magnitude=None, *, rounding: str = "mlx-lm",
                   promote: bool = False):
    """mlx-lm's fuse arithmetic on MLX arrays, in its exact operation order.
    ``promote=True`` skips the delta's cast (a float32 result); DoRA follows
    ``DoRALinear.fuse``, float32 whatever the weight's dtype (the caller casts back)."""
    import mlx.core as mx  # lazy: MLX only when computing

    if rounding == "mlx-lm":
        delta = (scale * B) @ A
    elif rounding == "scale-after":
        delta = (B @ A) * scale
    else:
        raise ArgumentError.bad("rounding", rounding, "mlx-lm or scale-after (others go "
                                "through fuse_weight)")
    if promote and magnitude is None:
        return weight + delta
    fused = weight + delta.astype(weight.dtype)
    if magnitude is not None:
        norm = mx.linalg.norm(fused, axis=-1)
        if bool(mx.any(norm == 0)):  # the one clear error, not a row of NaN
            check_dora_norm(np.array(norm.astype(mx.float32)))
        norm_scale = magnitude / norm
        fused = norm_scale[..., None] * fused
    return fused
