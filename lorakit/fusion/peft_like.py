"""``--like peft``: PEFT 0.21.2's ``add_weighted_adapter`` (torch 2.13, CPU) step for step.

What PEFT builds, for adapters loaded with ``PeftModel.from_pretrained`` (float32
factors) on a model whose weights are ``base_code`` (BF16, F16 or F32):

* ``linear``, ``ties``, ``magnitude_prune``: the A and the B factors merged separately
  in float32 (:func:`lorakit.fusion.peft_methods.merge` with ``exact=False``), weights
  ``sign(w s) sqrt(|w s|)`` (A) and ``sqrt(|w s|)`` (B) cast to float32; the new
  adapter's factors replace the layer's tensors, so they stay float32; scaling 1.
* ``cat``: ``lora_A * weight * scaling`` (two float32 products) stacked with the B
  factors, *copied into* the new layer's tensors, which PEFT created in the model's
  dtype: both factors are rounded to bf16/fp16. Merging such factors on the CPU, PEFT
  computes the delta in float32 and rounds it to the model's dtype before adding it
  (``round_delta``): two roundings.
* ``svd``: the float32 deltas summed and truncated by torch's float32 SVD; lorakit
  takes the SVD of the same float32 sum in float64, so its factors differ from
  PEFT's by float32 rounding noise (the merged weights by at most 1 ulp, on few
  elements: measured in tests/test_algebra_peft.py).
* ``dare_*`` draw torch's random masks: refused (lorakit's own ``dare_*`` take a seed).

The merge that follows is ``merge_and_unload`` (``rounding="round-once"``).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np

from ..errors import LorakitError
from ..io.adapter import LoraTarget
from ..numerics import round_to_format, to_float32
from .core import peft_delta
from .peft_methods import merge

LIKE_PEFT = ("linear", "cat", "ties", "magnitude_prune", "svd")
_FMT = {"BF16": "bfloat16", "F16": "float16"}


def check_like_peft(method: str) -> None:
    if method not in LIKE_PEFT:
        raise LorakitError(f"--like peft does not reproduce {method}", tensor="--like",
                           expected=" / ".join(LIKE_PEFT),
                           found=method, hint="dare_* draw torch's random masks; lorakit's "
                           "own dare_* take --seed" if method.startswith("dare") else None)


def _in_model_dtype(x: np.ndarray, base_code: str) -> np.ndarray:
    if base_code not in _FMT:
        return x.astype(np.float32)
    return to_float32(round_to_format(x.astype(np.float32), _FMT[base_code]), _FMT[base_code])


def like_peft_target(method: str, module: str, parts: List[Tuple[int, LoraTarget]],
                     w: Sequence[float], density: Optional[float], base_code: str,
                     rank: Optional[int] = None) -> LoraTarget:
    """The target PEFT's ``add_weighted_adapter(..., combination_type=method)`` makes."""
    t0 = parts[0][1]
    emb = t0.kind == "embedding"
    ws = [float(w[i]) * float(t.scale) for i, t in parts]
    if method == "cat":
        As, Bs = [], []
        for (i, t) in parts:
            # PEFT's lora_A (lorakit's A; for an embedding lora_embedding_A = lorakit's B.T)
            a = t.B if emb else t.A
            a = (a.astype(np.float32) * np.float32(w[i])).astype(np.float32)
            a = (a * np.float32(t.scale)).astype(np.float32)
            (Bs if emb else As).append(a)
            (As if emb else Bs).append(t.A if emb else t.B)
        A = _in_model_dtype(np.concatenate(As, axis=-2), base_code)
        B = _in_model_dtype(np.concatenate(Bs, axis=-1), base_code)
        return LoraTarget(module, t0.kind, A, B, 1.0, None, t0.names,
                          round_delta=base_code in _FMT)
    if method == "svd":
        total = None
        for (i, t), x in zip(parts, ws):
            d = peft_delta(t.B.astype(np.float32), t.A.astype(np.float32), np.float32(t.scale))
            d = (d * np.float32(w[i])).astype(np.float32)
            total = d if total is None else (total + d).astype(np.float32)
        U, S, Vh = np.linalg.svd(total.astype(np.float64), full_matrices=False)
        R = min(rank or max(t.rank for _, t in parts), S.shape[-1])
        B = (U[:, :R].astype(np.float32) * S[:R].astype(np.float32)).astype(np.float32)
        return LoraTarget(module, t0.kind, Vh[:R].astype(np.float32), B, 1.0, None, t0.names)
    wa = [float(np.sqrt(abs(x))) * (1 if x >= 0 else -1) for x in ws]
    wb = [float(np.sqrt(abs(x))) for x in ws]
    As, Bs = [t.A for _, t in parts], [t.B for _, t in parts]
    if emb:
        A = merge(method, As, wb, density=density, exact=False)
        B = merge(method, Bs, wa, density=density, exact=False)
    else:
        A = merge(method, As, wa, density=density, exact=False)
        B = merge(method, Bs, wb, density=density, exact=False)
    return LoraTarget(module, t0.kind, A, B, 1.0, None, t0.names)
