"""The intended change, in one place: what an adapter asks a weight to become.

Every adapter target, whatever its format or scale convention (resolved on reading),
comes down to :class:`Piece` s: one change ``scale * B @ A`` on one 2-D slice of one
weight (one per expert for stacked MoE), with DoRA's row magnitudes when it has them.
:func:`intended` computes its exact result in float64: ``W + scale * B @ A``, or DoRA's
``m * (W + scale * B @ A) / ||W + scale * B @ A||_row``. The fuse rounds it in each
mode's own order; checks, comparisons and survival stats read their pieces here.

>>> import numpy as np
>>> from lorakit.io.adapters.base import LoraTarget
>>> t = LoraTarget("m.q_proj", "linear", np.ones((1, 3), np.float32),
...                np.full((2, 1), 2, np.float32), 0.5)
>>> (p,) = target_pieces(t)
>>> intended(np.zeros((2, 3)), p).tolist()
[[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np

from .. import numerics as nm
from ..errors import FuseError
from ..io.adapters.base import LoraTarget
from ..io.adapters.naming import Binding
from ..io.formats.source import TensorSource
from ..io.formats.weights import weight_f64

__all__ = ["Piece", "SumTarget", "target_pieces", "tensor_pieces", "intended", "intended_pieces", "intended_blocks", "WeightReader"]


@dataclass(repr=False)
class SumTarget(LoraTarget):
    """An exact weighted sum of adapters' targets on one module, DoRA among them
    (:func:`lorakit.combine`, ``exact``): ``W + sum_i w_i (T_i(W) - W)`` over ``parts``
    ``(w_i, target_i)``. ``A``, ``B``, ``scale`` and ``magnitude`` hold the concatenated
    factors and the first DoRA magnitude only for code that reads shapes and ``is_dora``.
    """

    parts: Tuple[Tuple[float, LoraTarget], ...] = ()


@dataclass(frozen=True)
class Piece:
    """One low-rank change to one 2-D slice of a weight: ``expert`` of a stacked target
    (else None), ``slot``: the slice of a stacked 3-D weight it changes (None for 2-D),
    A (r, in), B (out, r), DoRA ``magnitude`` or None."""

    target: LoraTarget
    expert: Optional[int]
    slot: Optional[int]
    A: np.ndarray
    B: np.ndarray
    magnitude: Optional[np.ndarray]

    @property
    def scale(self) -> float:
        """A float, or one per rank column (r,) for an exact combination of adapters
        (``scale * B`` broadcasts over B's columns either way)."""
        return self.target.scale

    @property
    def kind(self) -> str:
        return self.target.kind

    @property
    def shape(self) -> tuple:
        """(out, in) of the slice it changes."""
        return (int(self.B.shape[0]), int(self.A.shape[1]))


def _piece(t: LoraTarget, expert: Optional[int], slot: Optional[int]) -> Piece:
    if expert is None:
        return Piece(t, None, slot, t.A, t.B, t.magnitude)
    return Piece(t, expert, slot, t.A[expert], t.B[expert],
                 None if t.magnitude is None else t.magnitude[expert])


def target_pieces(t: LoraTarget) -> List[Piece]:
    """The 2-D pieces of one target: one per expert for a stacked (switch) target
    (``slot`` = that expert), else one."""
    if t.kind == "switch":
        return [_piece(t, e, e) for e in range(t.A.shape[0])]
    return [_piece(t, None, None)]


def tensor_pieces(binds: Sequence[Binding]) -> List[Piece]:
    """The pieces landing on one checkpoint weight (``binds`` all share its tensor);
    on a 3-D (stacked experts) weight each piece's ``slot`` is the slice it changes."""
    if not binds:
        return []
    if len(binds[0].shape) == 3:
        whole = [b for b in binds if b.weight_expert is None]
        if whole:  # a stacked target on a stacked weight
            t = whole[0].target
            return [_piece(t, e, e) for e in range(t.A.shape[0])]
        return [_piece(b.target, b.target_expert, b.weight_expert) for b in binds]
    return [_piece(b.target, b.target_expert, None) for b in binds]


def lowrank(p: Piece, rows: Optional[slice] = None) -> np.ndarray:
    """``scale * B @ A`` (rows of it) in float64, as ``(scale * B) @ A``."""
    B = p.B if rows is None else p.B[rows]
    return (p.scale * B.astype(np.float64)) @ p.A.astype(np.float64)


def intended(W: np.ndarray, p: Piece, rows: Optional[slice] = None) -> np.ndarray:
    """The exact intended weight (float64) of a piece on the float64 base slice ``W``
    (its ``rows`` when given): ``W + scale * B @ A``, DoRA-normalised by rows where the
    piece has magnitudes; for a :class:`SumTarget`: ``(1 - sum_i w_i) W + sum_i w_i T_i``."""
    parts = getattr(p.target, "parts", None)
    if parts:
        T = (1.0 - math.fsum(w for w, _ in parts)) * W
        for w, t in parts:
            T += w * intended(W, _piece(t, p.expert, p.slot), rows)
        return T
    T = W + lowrank(p, rows)
    if p.magnitude is not None:
        m = p.magnitude if rows is None else p.magnitude[rows]
        norm = np.sqrt(np.einsum("ij,ij->i", T, T))
        T *= dora_factor(m, norm, rows)[:, None]
    return T


def dora_factor(magnitude: np.ndarray, norm: np.ndarray, rows: Optional[slice] = None
                ) -> np.ndarray:
    """DoRA's per-row factor ``magnitude / ||W + delta||`` in the norm's dtype, after
    :func:`check_dora_norm`.

    >>> dora_factor(np.array([2.0]), np.array([4.0])).tolist()
    [0.5]
    """
    check_dora_norm(norm, rows)
    return magnitude.astype(norm.dtype) / norm


def check_dora_norm(norm: np.ndarray, rows: Optional[slice] = None) -> None:
    """One clear error where a row of ``W + delta`` is all zeros: its direction is
    undefined (the unfused layer divides by zero too). ``rows``: where ``norm`` starts.

    >>> check_dora_norm(np.array([1.0, 0.0]))
    Traceback (most recent call last):
    lorakit.errors.FuseError: DoRA row has zero norm: W + delta is all zeros in 1 row(s), ...
    """
    zero = norm == 0
    if zero.any():
        first = int(np.argmax(zero)) + ((rows.start or 0) if rows is not None else 0)
        raise FuseError(f"DoRA row has zero norm: W + delta is all zeros in "
                        f"{int(zero.sum())} row(s), so DoRA's direction is undefined",
                        expected="rows of W + delta with a non-zero norm",
                        found=f"zero norm in row {first}",
                        hint="the adapter cancels the weight exactly; DoRA cannot be "
                             "applied there (nor run unfused)")



class WeightReader:
    """Reads one weight of a source in pieces, as float64 or raw bits (``transposed``:
    a 2-D weight stored as (in, out), read back as (out, in))."""

    def __init__(self, src: TensorSource, tensor: str, transposed: bool = False) -> None:
        self.src, self.tensor, self.transposed = src, tensor, transposed
        self.q = src.quant_params(tensor[: -len(".weight")])
        self._full: Optional[np.ndarray] = None

    def f64(self, expert: Optional[int], rows: slice) -> np.ndarray:
        if self.q is not None or self.transposed:  # dequantize / transpose once
            if self._full is None:
                self._full = weight_f64(self.src, self.tensor)
                if self.transposed:
                    self._full = np.ascontiguousarray(self._full.T)
            x = self._full if expert is None else self._full[expert]
            return x[rows]
        if expert is not None:
            return weight_f64(self.src, self.tensor, slice(expert, expert + 1))[0][rows]
        return weight_f64(self.src, self.tensor, rows)

    def raw(self, expert: Optional[int], rows: slice) -> np.ndarray:
        if expert is not None:
            return self.src.read(self.tensor, slice(expert, expert + 1))[0][rows]
        return self.src.read(self.tensor, rows)


def intended_blocks(fused: TensorSource, base: TensorSource, tensor: str, binds: list, *,
            raw: bool = True, transposed: bool = False
            ) -> Iterator[Tuple[np.ndarray, np.ndarray, np.ndarray, Piece, Optional[slice]]]:
    """(fused piece F, base piece W, exact target T, its Piece, its rows) over the
    changed blocks of a weight: :func:`intended_pieces` with the piece and rows, for the
    merge check's per-element bounds."""
    wb, wf = WeightReader(base, tensor), WeightReader(fused, tensor, transposed)
    for p in tensor_pieces(binds):
        plan = [slice(None)] if p.slot is not None else list(nm.chunks(*p.shape))
        for rows in plan:
            W = wb.f64(p.slot, rows)
            T = intended(W, p, rows)
            F = wf.raw(p.slot, rows) if raw else wf.f64(p.slot, rows)
            yield F, W, T, p, (None if p.slot is not None else rows)


def intended_pieces(fused: TensorSource, base: TensorSource, tensor: str, binds: list, *,
                    raw: bool = True) -> Iterator[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(fused piece, base piece W, exact target T) over the changed blocks of a weight,
    row chunks of about a million elements: F raw bits (``raw=True``) or float64."""
    for F, W, T, _, _ in intended_blocks(fused, base, tensor, binds, raw=raw):
        yield F, W, T
