"""PEFT's task-arithmetic merges (``peft/utils/merge_utils.py``, PEFT 0.21.2), in numpy.

Each takes the task tensors of N adapters (same shape) and one weight per adapter:

* ``linear``: ``sum_i w_i x_i``;
* ``magnitude_prune``: each ``x_i`` keeps its ``int(density * size)`` largest
  magnitudes (the rest zero), then ``linear``;
* ``ties``: magnitude-prune each, elect a sign per element (``sign_method="total"``:
  the sign of the sum of the pruned, unweighted tensors; ``"frequency"``: of the sum of
  their signs; ``>= 0`` counting as +), keep the weighted values of that sign and
  average them over how many agree (at least 1);
* ``dare_linear`` / ``dare_ties``: a random mask keeps each element with probability
  ``density`` (rescaled by ``1 / density``), then ``linear`` / ``ties``. PEFT draws the
  mask with torch's generator; lorakit with numpy's, from ``seed``: the same
  distribution, never the same mask.

``exact=True`` evaluates in float64 and rounds the result once to float32 (lorakit's
default); ``exact=False`` follows torch's float32 evaluation (each product and each
partial sum rounded to float32, summed in adapter order), which ``--like peft`` needs.

>>> import numpy as np
>>> xs = [np.array([1.0, -2.0, 3.0], np.float32), np.array([-1.0, 1.0, 1.0], np.float32)]
>>> merge("ties", xs, [1.0, 1.0], density=1.0).tolist()
[1.0, -2.0, 2.0]
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from ..errors import LorakitError

FACTOR_METHODS = ("linear", "ties", "magnitude_prune", "dare_linear", "dare_ties")
RANDOM = ("dare_linear", "dare_ties")


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
    """PEFT's ``method`` over task tensors ``xs`` with weights ``ws``: float32 result."""
    if method not in FACTOR_METHODS:
        raise LorakitError("unknown merge method", expected=" / ".join(FACTOR_METHODS),
                           found=repr(method))
    xs = [np.asarray(x) for x in xs]
    if sign_method not in ("total", "frequency"):
        raise LorakitError("unknown majority sign method", tensor="majority_sign_method",
                           expected="total / frequency", found=repr(sign_method))
    if method != "linear":
        if density is None or not 0 <= density <= 1:
            raise LorakitError(f"{method} needs a density in [0, 1]", tensor="density",
                               expected="--density D, 0 <= D <= 1", found=repr(density))
    if method in ("magnitude_prune", "ties"):
        xs = [np.where(magnitude_mask(x, density, like_torch=not exact), x,
                       np.float32(0)).astype(np.float32) for x in xs]
    elif method in RANDOM:
        if rng is None:
            raise LorakitError(f"{method} is random: it needs a seed", tensor="seed",
                               expected="--seed S", found="none")
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
