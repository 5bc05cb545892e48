"""mlx-lm's fuse orders (``mlx-lm``, ``scale-after``) in one C pass, checked against MLX.

``mlx_lm fuse`` computes ``weight + ((scale * B) @ A).astype(weight.dtype)`` through
MLX. On MLX's CPU backend the product is ``cblas_sgemm``, and the mlx wheels for
Linux link the reference BLAS: each element is ``D = 0; D = D + Bs[i,k] * A[k,j]`` for k
in order, float32, no FMA. That loop is slow at rank 8 (57 ms of a 6144 x 2048
gate_proj's 68 ms here); the C kernel (``fuse_mlx_order`` in ``_fusekernel.c``) does
the same operations, the cast and the add in one pass (9 ms).

Its bits are used only where they are MLX's: the default device is the CPU, and on
every tensor a few rows (the first, the last, and those of the largest ``|Bs|``) are computed by
MLX as well and compared bit for bit. One difference (another BLAS, with FMA or
another order) turns the kernel off for the process and the tensor goes through MLX,
as everything does on a GPU. DoRA always goes through MLX. ``LORAKIT_FUSE_KERNEL=0``
turns it off with the nearest kernel. Tests compare both paths bit for bit
(tests/fusion/test_mlx_order.py).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..io.dtypes import mx_dtype
from ..io.safetensors import NUMPY_STORAGE, mx_to_raw, raw_to_mx
from .delta import check_dora_norm
from .nearest import _KERNEL_FMT, _kernel, use_kernel

__all__ = ["fuse_mlx_array", "serves", "fuse_mlx_order"]

#: rows of each tensor checked against MLX: the first, the last, those of the largest |Bs|
PROBE_ROWS = 4
_state = {"ok": True}  # False once MLX gave other bits: MLX for the rest of the process


def serves() -> bool:
    """Whether the kernel may stand in for MLX now (built, allowed, MLX on the CPU)."""
    if not (_state["ok"] and use_kernel()):
        return False
    import mlx.core as mx  # lazy: MLX only when computing

    return mx.default_device() == mx.cpu


def fuse_mlx_order(w: np.ndarray, fmt_in, A: np.ndarray, B: np.ndarray, scale: float,
                   fmt_out, rounding: str, promote: bool) -> Optional[np.ndarray]:
    """The fused weight's storage bits, or None where MLX must compute it (a value is
    not finite, or MLX's bits differ on the probed rows)."""
    s32 = np.float32(scale)
    A32 = np.ascontiguousarray(A, np.float32)
    B32 = np.ascontiguousarray(B, np.float32)
    scale_after = rounding == "scale-after"
    with np.errstate(over="ignore", invalid="ignore"):  # an inf here goes to MLX below
        bs = B32 if scale_after else B32 * s32  # MLX's ``scale * B``: one f32 multiply
    fo = fmt_out if not promote else None
    code_out = _KERNEL_FMT["float32" if promote else fmt_out.name]
    wc = np.ascontiguousarray(w).view(fmt_in.storage)
    out = np.empty(w.shape, np.uint32 if code_out == 2 else np.uint16)
    special = _kernel.fuse_mlx_order(wc, _KERNEL_FMT[fmt_in.name], w.shape[1], bs, A32,
                                     float(s32), int(scale_after), int(promote), code_out,
                                     out)
    if special:
        return None
    rows = _probe_rows(bs)
    if not np.array_equal(out[rows], _mlx_rows(wc[rows], fmt_in, A32, B32[rows], scale,
                                               fo, rounding, promote)):
        _state["ok"] = False
        return None
    return out


def fuse_mlx_array(weight, A, B, scale: float, magnitude=None, *, rounding: str = "mlx-lm",
                   promote: bool = False):
    """mlx-lm's fuse arithmetic on MLX arrays, in its exact operation order.

    ``promote=True`` skips the cast of the delta, as a fuse that forgets it does,
    so the result is float32. DoRA follows ``DoRALinear.fuse``, whose result is
    float32 whatever the weight's dtype (the caller casts it back).
    """
    import mlx.core as mx  # lazy: MLX only when computing

    if rounding == "mlx-lm":
        delta = (scale * B) @ A
    elif rounding == "scale-after":
        delta = (B @ A) * scale
    else:
        raise ValueError(f"fuse_mlx_array does {rounding!r} only through fuse_weight")
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


def _probe_rows(bs: np.ndarray) -> np.ndarray:
    """The first and last rows (a BLAS's edge tiles take other code) and those of the
    largest |Bs| (the longest sums)."""
    n = bs.shape[0]
    if n <= 3 * PROBE_ROWS:
        return np.arange(n)
    big = np.argpartition(np.abs(bs).sum(axis=1), n - PROBE_ROWS)[n - PROBE_ROWS:]
    return np.unique(np.concatenate([np.arange(PROBE_ROWS), np.arange(n - PROBE_ROWS, n),
                                     big]))


def _mlx_rows(w: np.ndarray, fmt_in, A32, B32, scale: float, fmt_out, rounding: str,
              promote: bool) -> np.ndarray:
    """The same rows through MLX itself (:func:`fuse_mlx_array`), as storage bits."""
    import mlx.core as mx  # lazy: MLX only when computing

    code = fmt_in.safetensors
    weight = raw_to_mx(np.ascontiguousarray(w).view(NUMPY_STORAGE[code]), code)
    res = fuse_mlx_array(weight, mx.array(A32),
                         mx.array(B32), scale, rounding=rounding, promote=promote)
    if fmt_out is not None:
        res = res.astype(mx_dtype(fmt_out.safetensors))
    raw, _ = mx_to_raw(res)
    return np.asarray(raw).view(np.uint32 if res.dtype == mx.float32 else np.uint16)
