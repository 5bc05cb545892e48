"""mlx-lm's fuse orders (``mlx-lm``, ``scale-after``) in one C pass, checked against MLX.

``mlx_lm fuse`` computes ``weight + ((scale * B) @ A).astype(weight.dtype)`` through
MLX. On MLX's CPU backend the product is ``cblas_sgemm``, and the mlx wheels for
Linux link the reference BLAS: each element is ``D = 0; D = D + Bs[i,k] * A[k,j]`` for k
in order, float32, no FMA, a slow loop at rank 8. The C kernel (``fuse_mlx_order`` in
``_fusekernel.c``) does the same operations, the cast and the add in one pass
(BENCHMARKS.md, "Every verb at real scale": the mode's row).

Its bits are used only where they are MLX's: the default device is the CPU, and on
every tensor a few rows (the first, the last, and those of the largest ``|Bs|``) are
computed by MLX as well and compared bit for bit. One difference (another BLAS, with FMA or
another order) turns the kernel off for the process and the tensor goes through MLX,
as everything does on a GPU. DoRA always goes through MLX. ``LORAKIT_FUSE_KERNEL=0``
turns it off with the nearest kernel. Tests compare both paths bit for bit
(tests/fusion/test_mlx_order.py).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from .. import numerics as nm
from ..io.dtypes import mx_dtype
from ..io.safetensors import mx_to_raw, raw_to_mx
from .delta import check_dora_norm
from .nearest import _KERNEL_FMT, _kernel, use_kernel

__all__ = ["fuse_mlx", "fuse_mlx_array", "serves", "fuse_mlx_order"]

#: rows of each tensor checked against MLX: the first, the last, those of the largest |Bs|
PROBE_ROWS = 4
_state = {"ok": True}  # False once MLX gave other bits: MLX for the rest of the process


def serves() -> bool:
    """Whether the kernel may stand in for MLX now (built, allowed, MLX on the CPU)."""
    if not (_state["ok"] and use_kernel()):
        return False
    import mlx.core as mx  # lazy: MLX only when computing

    return mx.default_device() == mx.cpu


def fuse_mlx(w, code_in: str, A: np.ndarray, B: np.ndarray, scale: float,
             magnitude: Optional[np.ndarray], code_out: str, rounding: str,
             promote: bool) -> np.ndarray:
    """One weight fused in mlx-lm's order: raw storage of ``code_out`` (the convention
    of lorakit.io.safetensors.read_raw). ``w`` is raw storage, or an ``mx.array``."""
    if magnitude is None and isinstance(w, np.ndarray) and serves():
        out = fuse_mlx_order(w, code_in, A, B, scale, code_out, rounding, promote)
        if out is not None:
            return out
    return _through_mlx(w, code_in, A, B, scale, magnitude, code_out, rounding, promote)


def fuse_mlx_order(w: np.ndarray, code_in: str, A: np.ndarray, B: np.ndarray, scale: float,
                   code_out: str, rounding: str, promote: bool) -> Optional[np.ndarray]:
    """The C pass: the fused weight's storage bits, or None where MLX must compute it
    (a value is not finite, or MLX's bits differ on the probed rows)."""
    fin, fout = nm.float_format(code_in), nm.float_format(code_out)
    s32 = np.float32(scale)
    A32 = np.ascontiguousarray(A, np.float32)
    B32 = np.ascontiguousarray(B, np.float32)
    scale_after = rounding == "scale-after"
    with np.errstate(over="ignore", invalid="ignore"):  # an inf here goes to MLX below
        bs = B32 if scale_after else B32 * s32  # MLX's ``scale * B``: one f32 multiply
    w = np.ascontiguousarray(w)
    out = np.empty(w.shape, fout.storage)
    special = _kernel.fuse_mlx_order(w.view(fin.storage), _KERNEL_FMT[fin.name], w.shape[1],
                                     bs, A32, float(s32), int(scale_after), int(promote),
                                     _KERNEL_FMT[fout.name], out)
    if special:
        return None
    rows = _probe_rows(bs)
    if not np.array_equal(out[rows], _mlx_rows(w[rows], code_in, A32, B32[rows], scale,
                                               code_out, rounding, promote)):
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


def _mlx_rows(w: np.ndarray, code_in: str, A32, B32, scale: float, code_out: str,
              rounding: str, promote: bool) -> np.ndarray:
    """The probed rows through MLX itself, as storage bits."""
    raw = _through_mlx(w, code_in, A32, B32, scale, None, code_out, rounding, promote)
    return np.asarray(raw).view(nm.float_format(code_out).storage)


def _through_mlx(w, code_in: str, A, B, scale: float, magnitude, code_out: str,
                 rounding: str, promote: bool) -> np.ndarray:
    import mlx.core as mx  # lazy: MLX only when computing

    weight = raw_to_mx(w, code_in) if isinstance(w, np.ndarray) else w  # or already MLX's
    out = fuse_mlx_array(weight, mx.array(A), mx.array(B), scale,
                         None if magnitude is None else mx.array(magnitude),
                         rounding=rounding, promote=promote)
    if not promote or out.dtype != mx.float32:
        out = out.astype(mx_dtype(code_out))
    raw, _ = mx_to_raw(out)
    return raw
