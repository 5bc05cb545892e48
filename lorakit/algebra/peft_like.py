"""``--like peft``: PEFT 0.21.2's ``add_weighted_adapter`` (torch 2.13, CPU) step for step,
and PEFT's task-arithmetic merges (``merge_utils.py``) in numpy.

The factor methods merge A and B separately in float32 (weights ``sign(w s) sqrt(|w s|)``
on A, ``sqrt(|w s|)`` on B); ``cat`` rounds its factors to the model's dtype; ``svd``
truncates the float32 sum (in float64, so its factors differ from PEFT's by float32
noise); ``dare_*`` (torch's random masks) is refused. The new adapter's rank, alpha and
rsLoRA scaling are PEFT's (:func:`peft_plan`). :func:`merge`'s ``exact=True`` evaluates
in float64 and rounds once (lorakit's default); ``exact=False`` follows torch's float32
steps, which ``--like peft`` needs.

>>> import numpy as np
>>> xs = [np.array([1.0, -2.0, 3.0], np.float32), np.array([-1.0, 1.0, 1.0], np.float32)]
>>> merge("ties", xs, [1.0, 1.0], density=1.0).tolist()
[1.0, -2.0, 2.0]
"""
from __future__ import annotations

import dataclasses
import math
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ..errors import AdapterError, ArgumentError
from ..fusion.core import peft_delta, torch_row_norm
from ..io.adapters.base import Adapter, LoraTarget
from ..io.adapters.naming import bind
from ..io.formats import source
from ..io.formats.weights import weight_f64
from ..numerics import round_to_format, to_float32

__all__ = []

LIKE_PEFT = ("linear", "cat", "ties", "magnitude_prune", "svd", "ties_svd")
_FMT = {"BF16": "bfloat16", "F16": "float16"}
FACTOR_METHODS = ("linear", "ties", "magnitude_prune", "dare_linear", "dare_ties")
RANDOM = ("dare_linear", "dare_ties")


def config_rank(ad: Adapter) -> int:
    """The rank PEFT allocates for ``ad``: ``r``, or the largest of ``r`` and the
    ``rank_pattern`` values (an mlx-lm adapter: its largest module rank, as converted)."""
    cfg = ad.config or {}
    if "r" in cfg and "peft_type" in cfg:
        return max([int(cfg["r"]), *(int(v) for v in (cfg.get("rank_pattern") or {}).values())])
    return max((t.rank for t in ad.targets), default=0)


def peft_plan(ads: Sequence[Adapter], method: str, rank: Optional[int]) -> Tuple[int, float]:
    """(new rank, new scaling) of PEFT's ``add_weighted_adapter`` new adapter; PEFT's
    refusal of unequal ranks for the factor methods as a :class:`LorakitError`."""
    ranks = [config_rank(a) for a in ads]
    if method in FACTOR_METHODS:
        if len(set(ranks)) != 1:
            raise AdapterError(f"PEFT's {method} needs adapters of one rank (PEFT raises "
                               "ValueError: All adapters must have the same r value)",
                               file=ads[[r != ranks[0] for r in ranks].index(True)].path,
                               tensor="r", expected=f"r = {ranks[0]} (the first adapter's)",
                               found=f"ranks {ranks}", hint="use method cat or svd")
        new = ranks[0]
    elif method == "cat":
        new = sum(ranks)
    else:
        new = rank or max(ranks)
    rs = bool((ads[0].config or {}).get("use_rslora", False))
    return new, (new / math.sqrt(new) if rs and new else 1.0)


def _in_model_dtype(x: np.ndarray, base_code: str) -> np.ndarray:
    if base_code not in _FMT:
        return x.astype(np.float32)
    return to_float32(round_to_format(x.astype(np.float32), _FMT[base_code]), _FMT[base_code])


def torch_quantile(x32: np.ndarray, q: float) -> np.float32:
    """``torch.quantile(x, q)`` (linear interpolation, float32 steps) of a 1-D array."""
    s = np.sort(x32.astype(np.float32))
    pos = np.float32(q) * np.float32(s.size - 1)
    lo, hi = int(np.floor(pos)), int(np.ceil(pos))
    wt = np.float32(pos - np.float32(lo))
    a, b = s[lo], s[hi]
    if abs(wt) < 0.5:
        return np.float32(a + wt * np.float32(b - a))
    return np.float32(b - np.float32(b - a) * np.float32(1 - wt))


def _svd_target(module: str, parts: List[Tuple[int, LoraTarget]], w: Sequence[float],
                rank: int, scale: float, clamp: Optional[float], ties: Optional[dict] = None
                ) -> LoraTarget:
    t0 = parts[0][1]
    ds = [peft_delta(t.B.astype(np.float32), t.A.astype(np.float32), np.float32(t.scale))
          for _, t in parts]
    if ties is not None:  # ties_svd: PEFT's ties over the full deltas
        total = merge("ties", ds, [w[i] for i, _ in parts], exact=False, **ties)
    else:  # task_arithmetic: stacked, times the f32 weights, summed in order
        total = None
        for (i, _), d in zip(parts, ds):
            d = (d * np.float32(w[i])).astype(np.float32)
            total = d if total is None else (total + d).astype(np.float32)
    assert total is not None
    U, S, Vh = np.linalg.svd(total.astype(np.float64), full_matrices=False)
    R = min(rank, S.shape[-1])
    B = (U[:, :R].astype(np.float32) * S[:R].astype(np.float32)).astype(np.float32)
    A = Vh[:R].astype(np.float32)
    if clamp is not None:
        hi = torch_quantile(np.concatenate([B.reshape(-1), A.reshape(-1)]), clamp)
        B, A = np.clip(B, -hi, hi), np.clip(A, -hi, hi)
    return LoraTarget(module, t0.kind, A, B, scale, None, t0.names)


def like_peft_target(method: str, module: str, parts: List[Tuple[int, LoraTarget]],
                     w: Sequence[float], opts, rank: int, scale: float, fan_in_fan_out: bool
                     ) -> LoraTarget:
    """The target PEFT's ``add_weighted_adapter(..., combination_type=method)`` makes
    (``opts``: the :class:`~lorakit.algebra.combine.CombineOptions`; ``rank``, ``scale``:
    the new adapter's, from :func:`peft_plan`), with the base weight a PEFT adapter saved
    (an embedding's, ``save_embedding_layers``): PEFT loads each into the model, so the
    last adapter's copy is the one merged into."""
    t0 = parts[0][1]
    # PEFT's lora_A is lorakit's B.T for an embedding and a fan_in_fan_out (Conv1D) layer
    swap = t0.kind == "embedding" or fan_in_fan_out
    ws = [float(w[i]) * float(t.scale) for i, t in parts]
    if method == "cat":
        As, Bs = [], []
        for (i, t) in parts:
            a = t.B if swap else t.A
            a = (a.astype(np.float32) * np.float32(w[i])).astype(np.float32)
            a = (a * np.float32(t.scale)).astype(np.float32)
            (Bs if swap else As).append(a)
            (As if swap else Bs).append(t.A if swap else t.B)
        A = _in_model_dtype(np.concatenate(As, axis=-2), opts.base_dtype)
        B = _in_model_dtype(np.concatenate(Bs, axis=-1), opts.base_dtype)
        t = LoraTarget(module, t0.kind, A, B, scale, None, t0.names,
                       round_delta=opts.base_dtype in _FMT)
    elif method in ("svd", "ties_svd"):
        ties = dict(density=opts.density, sign_method=opts.majority_sign_method)
        t = _svd_target(module, parts, w, rank or max(t.rank for _, t in parts), scale,
                        opts.svd_clamp, None if method == "svd" else ties)
    else:
        ranks = sorted({t.rank for _, t in parts})
        if len(ranks) > 1:  # torch.stack of factors of different shapes (rank_pattern)
            raise AdapterError(f"PEFT's {method} stacks the factors, which differ in rank here "
                               "(PEFT raises RuntimeError: stack expects each tensor to be "
                               "equal size)", tensor=module, expected="one rank per module",
                               found=f"ranks {ranks}", hint="use method cat or svd")
        wa = [float(np.sqrt(abs(x))) * (1 if x >= 0 else -1) for x in ws]
        wb = [float(np.sqrt(abs(x))) for x in ws]

        def peft(x: np.ndarray) -> np.ndarray:  # lorakit's orientation <-> PEFT's, both ways
            return np.ascontiguousarray(np.swapaxes(x, -1, -2)) if swap else x

        kw = dict(density=opts.density, exact=False, sign_method=opts.majority_sign_method)
        # merged in PEFT's orientation: the flattening order decides ties in pruning
        pa = merge(method, [peft(t.B if swap else t.A) for _, t in parts], wa, **kw)
        pb = merge(method, [peft(t.A if swap else t.B) for _, t in parts], wb, **kw)
        A, B = (peft(pb), peft(pa)) if swap else (pa, pb)
        t = LoraTarget(module, t0.kind, A, B, scale, None, t0.names)
    saved = [p.base_weight for _, p in parts if p.base_weight is not None]
    return dataclasses.replace(t, base_weight=saved[-1]) if saved else t


def peft_dora_magnitudes(targets: List[LoraTarget], ads: Sequence[Adapter], base,
                         base_code: str) -> List[LoraTarget]:
    """The targets with the magnitude PEFT gives a new DoRA adapter: the row norms of
    the base weight (torch's f32 row norm, rounded to the model's dtype)."""
    if base is None:
        raise ArgumentError.bad("base", None, "base=CHECKPOINT (lorakit combine --base, or "
                                "fuse's --model)", hint="PEFT's combination of DoRA adapters "
                                "is a DoRA adapter whose magnitude is the base weight's row norms")
    if any(t.round_delta for t in targets):
        raise AdapterError("--like peft does not reproduce cat of DoRA adapters on a "
                           f"{base_code} model", file=ads[0].path, tensor="method",
                           expected="linear, ties, magnitude_prune or svd (or an F32 model)",
                           found="cat", hint="PEFT's DoRA merge of bf16/fp16 cat factors "
                           "runs in the model's dtype")
    src = source.open(base)
    where = {b.target.module: b for b in bind(
        Adapter(ads[0].path, "mlx-lm", list(targets), {}, ads[0].weights_file), src)}
    out = []
    for t in targets:
        b = where[t.module]
        if t.kind != "linear" or len(b.shape) != 2:
            raise AdapterError("--like peft reproduces DoRA combinations of linear layers "
                               "only", tensor=t.module, expected="a linear weight",
                               found=f"{t.kind} {list(b.shape)}")
        W = weight_f64(src, b.tensor).astype(np.float32)
        out.append(dataclasses.replace(t, magnitude=_in_model_dtype(torch_row_norm(W),
                                                                    base_code)))
    return out


def magnitude_mask(x: np.ndarray, density: float, like_torch: bool = False) -> np.ndarray:
    """True for the ``int(density * x.size)`` largest ``|x|``. Equal magnitudes across
    the cut: the first in order, or (``like_torch``) the ones torch's CPU ``topk``
    keeps (:func:`_torch_topk_set`)."""
    mask = np.zeros(x.size, bool)
    if density >= 1:
        mask[:] = True
        return mask.reshape(x.shape)
    k = int(density * x.size)
    if k > 0:
        v = np.abs(x.reshape(-1))
        order = np.argsort(-v.astype(np.float64), kind="stable")
        cut = v[order[k - 1]]
        # a tie across the cut decides which elements stay (not when they are zeros)
        if like_torch and cut != 0 and k < v.size and v[order[k]] == cut:
            mask[_torch_topk_set(v.astype(np.float32), k)] = True
        else:
            mask[order[:k]] = True
    return mask.reshape(x.shape)


def _torch_topk_set(v: np.ndarray, k: int) -> List[int]:
    """The indices torch 2.x's CPU ``topk(v, k)`` returns (as a set), ``v`` 1-D without
    NaN: ``std::nth_element`` (libstdc++'s introselect) over (value, index) pairs with
    ``a > b`` as the order; ``std::partial_sort`` (a heap) when ``64 k <= n``."""
    q = [(float(a), i) for i, a in enumerate(v.tolist())]
    n = len(q)

    def gt(a, b):
        return a[0] > b[0]

    def sift(first: int, hole: int, length: int, val) -> None:  # __adjust_heap
        top, child = hole, hole
        while child < (length - 1) // 2:
            child = 2 * (child + 1)
            if gt(q[first + child], q[first + child - 1]):
                child -= 1
            q[first + hole] = q[first + child]
            hole = child
        if (length & 1) == 0 and child == (length - 2) // 2:
            child = 2 * (child + 1)
            q[first + hole] = q[first + child - 1]
            hole = child - 1
        parent = (hole - 1) // 2
        while hole > top and gt(q[first + parent], val):
            q[first + hole] = q[first + parent]
            hole = parent
            parent = (hole - 1) // 2
        q[first + hole] = val

    def heap_select(first: int, middle: int, last: int) -> None:
        length = middle - first
        if length > 1:
            for parent in range((length - 2) // 2, -1, -1):
                sift(first, parent, length, q[first + parent])
        for i in range(middle, last):
            if gt(q[i], q[first]):
                val, q[i] = q[i], q[first]
                sift(first, 0, length, val)

    if 64 * k <= n:
        heap_select(0, k, n)
        return [i for _, i in q[:k]]
    first, last, nth = 0, n, k - 1
    depth = 2 * (n.bit_length() - 1)
    while last - first > 3:
        if depth == 0:
            heap_select(first, nth + 1, last)
            q[first], q[nth] = q[nth], q[first]
            break
        depth -= 1
        a, b, c = first + 1, first + (last - first) // 2, last - 1  # median to first
        if gt(q[a], q[b]):
            m = b if gt(q[b], q[c]) else (c if gt(q[a], q[c]) else a)
        else:
            m = a if gt(q[a], q[c]) else (c if gt(q[b], q[c]) else b)
        q[first], q[m] = q[m], q[first]
        lo, hi, piv = first + 1, last, q[first]  # __unguarded_partition
        while True:
            while gt(q[lo], piv):
                lo += 1
            hi -= 1
            while gt(piv, q[hi]):
                hi -= 1
            if not lo < hi:
                break
            q[lo], q[hi] = q[hi], q[lo]
            lo += 1
        if lo <= nth:
            first = lo
        else:
            last = lo
    else:
        for i in range(first + 1, last):  # insertion sort of the last few
            val = q[i]
            j = i
            while j > first and gt(val, q[j - 1]):
                q[j] = q[j - 1]
                j -= 1
            q[j] = val
    return [i for _, i in q[:k]]


def _weighted_sum(xs: Sequence[np.ndarray], ws: Sequence[float], exact: bool,
                  masks: Optional[Sequence[np.ndarray]] = None) -> np.ndarray:
    if exact:
        acc = np.zeros(xs[0].shape, np.float64)
        for i, (x, w) in enumerate(zip(xs, ws)):
            t = x.astype(np.float64) * w
            acc += t if masks is None else np.where(masks[i], t, 0.0)
        return acc
    acc = None
    for i, (x, w) in enumerate(zip(xs, ws)):
        t = (x.astype(np.float32) * np.float32(w)).astype(np.float32)
        if masks is not None:
            t = np.where(masks[i], t, np.float32(0))
        acc = t if acc is None else (acc + t).astype(np.float32)
    return acc


def merge(method: str, xs: Sequence[np.ndarray], ws: Sequence[float], *,
          density: Optional[float] = None, rng: Optional[np.random.Generator] = None,
          exact: bool = True, sign_method: str = "total") -> np.ndarray:
    """PEFT's ``method`` over task tensors ``xs`` with weights ``ws``: float32 result.

    ``linear``: ``sum_i w_i x_i``; ``magnitude_prune``: each keeps its ``int(density *
    size)`` largest magnitudes first; ``ties``: pruned, then a sign elected per element
    (``"total"``: of the unweighted sum, ``"frequency"``: of the summed signs; ``>= 0``
    is +) and the agreeing weighted values averaged; ``dare_*``: a random mask keeps each
    element with probability ``density`` (rescaled), drawn from ``rng`` (numpy's, never
    torch's mask)."""
    if method not in FACTOR_METHODS:
        raise ArgumentError.bad("method", method, " / ".join(FACTOR_METHODS))
    xs = [np.asarray(x) for x in xs]
    if sign_method not in ("total", "frequency"):
        raise ArgumentError.bad("majority_sign_method", sign_method, "total / frequency")
    if method != "linear":
        if density is None or not 0 <= density <= 1:
            raise ArgumentError.bad("density", density, f"0 <= density <= 1 ({method} needs "
                                    "one: --density D)")
    if method in ("magnitude_prune", "ties"):
        xs = [np.where(magnitude_mask(x, density, like_torch=not exact), x,
                       np.float32(0)).astype(np.float32) for x in xs]
    elif method in RANDOM:
        if rng is None:
            raise ArgumentError.bad("seed", None, f"a seed: {method} is random (--seed S)")
        if density < 1:
            kept = []
            for x in xs:
                m = rng.random(x.shape) < density
                if exact:
                    kept.append(np.where(m, x.astype(np.float64) / density, 0.0))
                else:
                    kept.append((np.where(m, x, np.float32(0)) / np.float32(density)
                                 ).astype(np.float32))
            xs = kept
    if method in ("linear", "magnitude_prune", "dare_linear"):
        return np.asarray(_weighted_sum(xs, ws, exact), np.float64).astype(np.float32)
    # ties / dare_ties: the elected sign, then the mean of the agreeing weighted values
    signs = [np.sign(x) for x in xs]
    if sign_method == "frequency":
        total = np.sum(signs, axis=0)
    else:
        total = _weighted_sum(xs, [1.0] * len(xs), exact)
    major = np.where(total >= 0, 1, -1)
    masks: List[np.ndarray] = [s == major for s in signs]
    summed = _weighted_sum(xs, ws, exact, masks)
    count = np.maximum(np.sum(masks, axis=0), 1)
    if exact:
        return (summed / count).astype(np.float32)
    return (summed / count.astype(np.float32)).astype(np.float32)
