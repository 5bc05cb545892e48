"""Quantized bases: dequantize -> fuse -> re-quantize with MLX's own kernels.

mlx-lm stores a quantized weight as ``.weight`` (packed uint32), ``.scales`` and
(affine mode) ``.biases``. lorakit dequantizes with ``mx.dequantize``, fuses in the
scales' dtype, and re-quantizes with ``mx.quantize`` using the same bits, group size
and mode, exactly as ``mlx_lm fuse`` does, then measures how much of the intended
delta the new codes still carry: at 4 bits a small adapter can vanish entirely.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np

from .. import numerics as nm
from ..errors import FuseError
from ..io.checkpoint import Checkpoint, QuantParams
from ..io.dtypes import mx_dtype, storage_code
from ..io.naming import Binding
from ..io.safetensors import mx_to_raw, raw_to_mx
from .core import fuse_bindings
from .delta import intended, lowrank, tensor_pieces

SUPPORTED_MODES = ("affine", "mxfp4", "mxfp8", "nvfp4")


@dataclass
class RequantStat:
    """How much of one delta survived re-quantization."""

    tensor: str
    survived: float  # projection of the realised change on the intended delta, 1.0 = all
    codes_changed: float  # fraction of quantized codes that changed
    codes: int = 0  # quantized codes compared (elements of the weight)
    delta_sq: float = 0.0  # <delta, delta>: the weight of this tensor in the overall share
    policy: str = "requant"  # the quantization policy that wrote the module


def _mx_parts(ck: Checkpoint, module: str):
    w = ck.read_mx(f"{module}.weight")
    s = ck.read_mx(f"{module}.scales")
    b = ck.read_mx(f"{module}.biases") if f"{module}.biases" in ck.tensors else None
    return w, s, b


def dequantize_raw(ck: Checkpoint, module: str, out_code: Optional[str]) -> np.ndarray:
    """Dequantize ``module`` of ``ck`` to raw float storage (in the scales' dtype,
    or ``out_code``)."""
    import mlx.core as mx  # lazy: MLX only when computing

    q = ck.quant_params(module)
    if q is None:
        raise FuseError("weight is not quantized", file=ck.path, tensor=f"{module}.weight")
    if q.mode not in SUPPORTED_MODES:
        raise FuseError("unsupported quantization mode", file=ck.path / "config.json",
                        tensor=f"{module}.weight", expected=" / ".join(SUPPORTED_MODES),
                        found=repr(q.mode))
    w, s, b = _mx_parts(ck, module)
    try:
        x = mx.dequantize(w, s, b, group_size=q.group_size, bits=q.bits, mode=q.mode)
        mx.eval(x)
    except (ValueError, RuntimeError) as e:
        raise FuseError(f"cannot dequantize: {e}", file=ck.path, tensor=f"{module}.weight",
                        expected=f"{q.bits}-bit {q.mode}, group size {q.group_size}") from None
    if out_code is not None:
        x = x.astype(mx_dtype(out_code))
    return mx_to_raw(x)[0]


def quantize_raw(raw: np.ndarray, code: str, q: QuantParams) -> Dict[str, np.ndarray]:
    """Quantize float storage with ``mx.quantize`` -> raw weight / scales / biases."""
    import mlx.core as mx  # lazy: MLX only when computing

    x = raw_to_mx(raw, code)
    parts = mx.quantize(x, group_size=q.group_size, bits=q.bits, mode=q.mode)
    names = ("weight", "scales", "biases")
    return {n: mx_to_raw(p)[0] for n, p in zip(names, parts) if p is not None}


def unpack_codes(packed: np.ndarray, bits: int) -> np.ndarray:
    """mlx's packed uint32 words -> one integer code per element (LSB-first bit stream)."""
    u8 = np.ascontiguousarray(packed).astype("<u4").view(np.uint8)
    stream = np.unpackbits(u8.reshape(u8.shape[0] if u8.ndim > 1 else 1, -1),
                           axis=-1, bitorder="little")
    n = stream.shape[-1] // bits
    b = stream[..., : n * bits].reshape(stream.shape[0], n, bits).astype(np.uint16)
    return (b << np.arange(bits, dtype=np.uint16)).sum(-1)


def requant_survival(base_raw: np.ndarray, code: str, parts: Dict[str, np.ndarray],
                     fused_code: str, q: QuantParams, binds: List[Binding],
                     name: str, base_codes: Optional[np.ndarray] = None) -> RequantStat:
    """Fraction of the intended delta that survives re-quantization.

    ``survived = <W_q' - W_q, delta> / <delta, delta>``: the projection of the change
    the re-quantized weight really makes onto the change the adapter asked for
    (:func:`lorakit.fusion.delta.intended` minus the base: DoRA's rescaling included).
    1.0 means all of it, 0.0 means the fused model is the base.
    """
    import mlx.core as mx  # lazy: mlx is heavy and optional at import

    w = mx.array(parts["weight"])
    s = raw_to_mx(parts["scales"], storage_code(parts["scales"], fused_code))
    b = (raw_to_mx(parts["biases"], storage_code(parts["biases"], fused_code))
         if "biases" in parts else None)
    new = np.array(mx.dequantize(w, s, b, group_size=q.group_size, bits=q.bits, mode=q.mode)
                   .astype(mx.float32))
    old = nm.to_float32(base_raw, nm.float_format(code))
    return survival_of(old, new, binds, name, base_codes, parts["weight"], q.bits)


def intended_change(old: np.ndarray, binds: List[Binding]) -> np.ndarray:
    """The change the adapter asks for on float32 weights ``old`` (float64)."""
    delta = np.zeros_like(old, dtype=np.float64)
    for p in tensor_pieces(binds):
        sl = delta if p.slot is None else delta[p.slot]
        if p.magnitude is None:
            sl += lowrank(p)
        else:
            W = (old if p.slot is None else old[p.slot]).astype(np.float64)
            sl += intended(W, p) - W
    return delta


def survival_of(old: np.ndarray, new: np.ndarray, binds: List[Binding], name: str,
                base_codes: Optional[np.ndarray] = None, new_codes: Optional[np.ndarray] = None,
                bits: int = 0) -> RequantStat:
    """:class:`RequantStat` of realised float weights ``new`` against base ``old``."""
    delta = intended_change(old, binds)
    real = new.astype(np.float64) - old
    dd = float((delta * delta).sum())
    survived = float((real * delta).sum() / dd) if dd > 0 else 1.0
    changed, ncodes = float("nan"), 0
    if base_codes is not None and new_codes is not None:
        ne = unpack_codes(base_codes, bits) != unpack_codes(new_codes, bits)
        changed, ncodes = float(ne.mean()), int(ne.size)
    return RequantStat(name, survived, changed, ncodes, dd)


def survival_overall(stats: List[RequantStat]) -> Dict[str, float]:
    """Survival over all re-quantized tensors: ``codes_changed`` (changed codes over all
    codes compared) and ``survived`` (``sum <real, delta> / sum <delta, delta>``: the
    projection over the whole model, each tensor weighted by its delta's squared norm).

    >>> survival_overall([RequantStat("a", 1.0, 0.5, 10, 3.0), RequantStat("b", 0.0, 1.0, 30, 1.0)])
    {'codes_changed': 0.875, 'survived': 0.75, 'codes': 40, 'tensors': 2}
    """
    codes = sum(s.codes for s in stats)
    dd = sum(s.delta_sq for s in stats)
    changed = (sum(s.codes_changed * s.codes for s in stats if s.codes) / codes) if codes \
        else float("nan")
    survived = (sum(s.survived * s.delta_sq for s in stats) / dd) if dd > 0 else float("nan")
    return {"codes_changed": changed, "survived": survived, "codes": codes,
            "tensors": len(stats)}


def survival_rows(stats: List[RequantStat]) -> List[Tuple[str, str, str]]:
    """One ``(tensor, codes changed, delta survived)`` text row per re-quantized tensor."""
    return [(s.tensor, f"{s.codes_changed:.1%} of {s.codes:,}" if s.codes else
             "n/a (new grid or float)", f"{s.survived:.1%}") for s in stats]


def survival_text(stats: List[RequantStat], indent: str = "") -> List[str]:
    """:func:`survival_rows` as aligned text lines under a header."""
    per = [("tensor", "codes changed", "delta survived")] + survival_rows(stats)
    w0, w1 = (max(len(r[i]) for r in per) for i in (0, 1))
    return [f"{indent}{a:<{w0}}  {b:>{w1}}  {c:>14}" for a, b, c in per]
