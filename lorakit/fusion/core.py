"""The one per-tensor fusion core: W' = W + scale * (B @ A), rounded as asked.

Every path that fuses (checkpoint fuse, in-memory model fuse, the inspection
references) calls :func:`fuse_weight`. Roundings: ``nearest`` (default: the exact sum
rounded once, ties to even, with an exact rational fallback near ties:
:mod:`lorakit.fusion.nearest`), ``round-once`` (PEFT's ``merge_and_unload``, bit for
bit), ``mlx-lm`` and ``scale-after`` (MLX's own order: :mod:`lorakit.fusion.mlx_order`).
Dtype policies: ``preserve`` (default), ``promote`` (float32), or an explicit
``bfloat16`` / ``float16`` / ``float32``.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np

from .. import numerics as nm
from ..errors import ArgumentError, FuseError
from ..io.adapters.naming import Binding
from ..io.formats.dtypes import code_of
from ..io.formats.safetensors import NUMPY_STORAGE
from . import mlx_order
from .delta import dora_factor, tensor_pieces
from .finite import cast_raw, check_result
from .nearest import _fuse_nearest
from .options import DTYPE_POLICIES, MLX_ROUNDINGS, ROUNDINGS
from .sum_fuse import fuse_sum

__all__ = ["peft_delta", "torch_row_norm", "fuse_weight"]


def output_code(base_code: str, dtype_policy: str) -> str:
    """The safetensors dtype code a fused weight is written in.

    >>> output_code("BF16", "preserve"), output_code("BF16", "promote")
    ('BF16', 'F32')
    """
    if dtype_policy == "preserve":
        return base_code
    if dtype_policy == "promote":
        return "F64" if base_code == "F64" else "F32"
    code = code_of(dtype_policy)
    if code in ("BF16", "F16", "F32"):
        return code
    raise ArgumentError.bad("dtype", dtype_policy, " | ".join(DTYPE_POLICIES))


_PIECE = 1 << 16  # elements per piece of the round-once path


def _fuse_round_once(w: np.ndarray, fmt_in, A: np.ndarray, B: np.ndarray, scale: float,
                     magnitude: Optional[np.ndarray], fmt_out, kind: str = "linear") -> np.ndarray:
    """PEFT 0.21 ``merge_and_unload`` on torch's CPU, bit for bit: ``round(f32(W) +
    delta)``; an embedding's delta is cast to the weight's dtype first (two roundings);
    DoRA rescales by ``m / ||f32(W) + delta||_row`` with torch's 8-lane f32 row norm."""
    rows, cols = w.shape
    out = np.empty((rows, cols), dtype=fmt_out.storage)
    A32 = np.ascontiguousarray(A, dtype=np.float32)
    B32 = np.ascontiguousarray(B, dtype=np.float32)
    s32 = np.float32(scale)
    step = max(1, _PIECE // max(cols, 1))
    for r0 in range(0, rows, step):
        sl = slice(r0, min(rows, r0 + step))
        delta = peft_delta(B32[sl], A32, s32)
        x = nm.to_float32(w[sl], fmt_in)
        if kind == "embedding":
            delta = nm.to_float32(nm.round_to_format(delta, fmt_in), fmt_in)
        x += delta
        if magnitude is not None:
            norm = torch_row_norm(x)
            x *= dora_factor(magnitude[sl], norm, sl)[:, None]
        nm.round_to_format(x, fmt_out, out=out[sl])
    return out


def peft_delta(B32: np.ndarray, A32: np.ndarray, s32: np.float32) -> np.ndarray:
    """PEFT's f32 delta ``(lora_B @ lora_A) * scaling`` as torch's CPU matmul computes it
    (bit for bit, tests/fixtures/peft): per element one fma chain over the rank in
    ascending order; ranks above 192 in blocks (r/2 wide up to 384, then 192) added
    left to right; the scaling cast to f32 before the multiply."""
    r = A32.shape[0]
    if r <= 192:
        blocks = [(0, r)]
    else:
        kb = r // 2 if r <= 384 else 192
        blocks = [(k, min(r, k + kb)) for k in range(0, r, kb)]
    total = None
    for k0, k1 in blocks:
        acc = np.zeros((B32.shape[0], A32.shape[1]), np.float32)
        for k in range(k0, k1):
            acc = nm.fma_f32(B32[:, k:k + 1], A32[k:k + 1, :], acc)
        total = acc if total is None else total + acc
    assert total is not None
    total *= s32
    return total


def torch_row_norm(x: np.ndarray, lanes: int = 8) -> np.ndarray:
    """Row L2 norms of f32 ``x`` as torch's CPU ``linalg.norm(x, dim=1)`` computes them:
    ``lanes`` f32 accumulators (``acc += v*v``, no fma), folded left to right, f32 sqrt.
    A remainder of fewer than ``lanes`` columns is added sequentially to the fold."""
    n = x.shape[1]
    full = n - n % lanes
    acc = np.zeros((x.shape[0], lanes), np.float32)
    for d in range(0, full, lanes):
        v = x[:, d:d + lanes]
        acc += v * v
    total = acc[:, 0].copy()
    for j in range(1, lanes):
        total += acc[:, j]
    for d in range(full, n):
        total += x[:, d] * x[:, d]
    return np.sqrt(total)


def fuse_weight(w: np.ndarray, code_in: str, A: np.ndarray, B: np.ndarray, scale: float, *,
                magnitude: Optional[np.ndarray] = None, rounding: str = "nearest",
                dtype_policy: str = "preserve", name: str = "",
                kind: str = "linear") -> Tuple[np.ndarray, str]:
    """Fuse one low-rank change into one weight: ``w`` raw storage (out, in) of dtype
    ``code_in`` (for the MLX orders also an ``mx.array``), A (r, in), B (out, r),
    DoRA ``magnitude`` or None; ``kind`` matters to ``round-once`` only (PEFT rounds an
    embedding's delta first). Returns (the fused raw storage, its dtype code).

    >>> import numpy as np
    >>> w = np.zeros((2, 3), np.float32)
    >>> A = np.ones((1, 3), np.float32); B = np.ones((2, 1), np.float32)
    >>> fuse_weight(w, "F32", A, B, 0.5)[0].tolist()
    [[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]
    """
    code_out = output_code(code_in, dtype_policy)
    if w.ndim != 2 or A.ndim != 2 or B.ndim != 2 or B.shape[1] != A.shape[0] \
            or w.shape != (B.shape[0], A.shape[1]):
        raise FuseError("shapes do not fit together", tensor=name,
                        expected=f"weight (out, in) = ({B.shape[0]}, {A.shape[-1]})",
                        found=f"weight {list(w.shape)}, A {list(A.shape)}, B {list(B.shape)}")
    if code_in not in ("BF16", "F16", "F32") or code_out == "F64":
        raise FuseError("cannot fuse into a float64 weight" if "F64" in (code_in, code_out)
                        else "cannot fuse into a non-float weight", tensor=name,
                        expected="a BF16, F16 or F32 weight", found=f"{code_in} -> {code_out}",
                        hint="store float64 weights as float32 first" if code_in == "F64" else None)
    if np.ndim(scale) and rounding != "nearest":  # an exact combination of adapters
        raise FuseError("an exact combination of adapters is fused correctly rounded only",
                        tensor=name, expected="rounding='nearest'", found=f"{rounding!r}",
                        hint="combine with method='cat' to fuse one stored adapter in "
                        "another order")
    fmt_in = nm.float_format(code_in)
    try:
        if rounding in MLX_ROUNDINGS:
            out = mlx_order.fuse_mlx(w, code_in, A, B, scale, magnitude, code_out, rounding,
                                     dtype_policy == "promote")
        elif rounding == "nearest":
            out = _fuse_nearest(w, fmt_in, A, B, scale, magnitude, nm.float_format(code_out))
        elif rounding == "round-once":
            out = _fuse_round_once(w, fmt_in, A, B, scale, magnitude,
                                   nm.float_format(code_out), kind)
        else:  # FuseOptions refuses it first; a direct caller gets the same message
            raise ArgumentError.bad("rounding", rounding, " | ".join(ROUNDINGS))
    except FuseError as e:  # e.g. DoRA's zero-norm row: name the weight
        raise e.where(tensor=name or None) from None
    # the same storage convention as lorakit.io.formats.safetensors.read_raw: float16/float32
    # arrays for F16/F32, uint16 bits for BF16
    out = out.view(NUMPY_STORAGE[code_out])
    check_result(out, code_out, w, code_in, name)
    return out, code_out


def fuse_bindings(raw: np.ndarray, code: str, binds: List[Binding], rounding: str,
                  dtype_policy: str, name: str) -> Tuple[np.ndarray, str]:
    """Fuse every binding landing on one float weight (several for stacked experts):
    each piece of the intended change (:func:`lorakit.fusion.delta.tensor_pieces`) on
    its slice, the other slices converted as the dtype policy says."""
    pieces = tensor_pieces(binds)
    how = {"rounding": rounding, "dtype_policy": dtype_policy}

    def one(r: np.ndarray, p, nm: str, kind: str = "linear") -> Tuple[np.ndarray, str]:
        if getattr(p.target, "parts", None):  # an exact combination with DoRA parts (sum_fuse)
            return fuse_sum(r, code, output_code(code, dtype_policy), p, rounding, nm)
        return fuse_weight(r, code, p.A, p.B, p.scale, magnitude=p.magnitude, name=nm, kind=kind,
                           **how)

    if raw.ndim == 3:
        out_code = output_code(code, dtype_policy)
        by_slot = {p.slot: p for p in pieces}
        return np.stack([one(raw[e], by_slot[e], f"{name}[{e}]", _kind(by_slot[e]))[0]
                         if e in by_slot
                         else cast_raw(raw[e], code, out_code)
                         for e in range(raw.shape[0])]), out_code
    (p,) = pieces
    return one(raw, p, name, _kind(p))


def _kind(p) -> str:
    """round-once rounds an embedding's delta first; so does PEFT for round_delta targets."""
    return "embedding" if p.target.round_delta else p.kind
