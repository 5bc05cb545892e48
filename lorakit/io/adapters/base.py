"""What an adapter is to lorakit, whatever its format: the shared types and helpers.

An adapter is a list of :class:`LoraTarget`, one per adapted module, holding ``A``
(…, r, in), ``B`` (…, out, r), a float ``scale`` and an optional DoRA ``magnitude``, so
that the change of the module's stored weight is ``delta = scale * (B @ A)`` for every
layer type and format (mlx-lm's ``lora_b.T @ lora_a.T``, PEFT's ``lora_B @ lora_A``, the
embedding and fan_in_fan_out forms transposed to fit). mlx-lm's own fuse computes
``(scale * B) @ A``, which lets :mod:`lorakit.fusion` reproduce its rounding exactly.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

import numpy as np

from ...errors import AdapterError
from ...numerics import float_format, to_float32
from ..formats.safetensors import TensorInfo, read_header, read_raw

__all__ = ["MLX_WEIGHTS", "PEFT_WEIGHTS", "EMBEDDING_HINTS", "LoraTarget", "Replacement", "Adapter"]

MLX_WEIGHTS = "adapters.safetensors"
PEFT_WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."
EMBEDDING_HINTS = ("embed_tokens", "wte", "word_embeddings", "embed_in", "tok_embeddings",
                   "embeddings")
FLOAT_ADAPTER_CODES = ("F32", "F16", "BF16", "F64")


@dataclass
class LoraTarget:
    """The low-rank change to one module's weight: ``delta = scale * (B @ A)``.

    ``kind`` is linear, embedding or switch (stacked MoE experts); ``scale`` may be one per
    rank column (an exact :func:`lorakit.combine`); ``magnitude`` is DoRA's row norms;
    ``base_weight`` a base weight PEFT saved with the adapter, fused in its place.
    """

    module: str
    kind: str
    A: np.ndarray
    B: np.ndarray
    scale: float
    magnitude: Optional[np.ndarray] = None
    names: Tuple[str, ...] = ()
    base_weight: Optional[Tuple[np.ndarray, str]] = None  # (raw, dtype code), PEFT only
    #: PEFT merges this delta rounded to the weight's dtype before adding it (an
    #: adapter PEFT built in memory in the model's dtype: add_weighted_adapter's cat)
    round_delta: bool = False

    @property
    def rank(self) -> int:
        return int(self.A.shape[-2])

    @property
    def shape(self) -> Tuple[int, ...]:
        """Shape of the weight this target changes (for switch: experts, out, in)."""
        return tuple(self.B.shape[:-1]) + (int(self.A.shape[-1]),)

    @property
    def is_dora(self) -> bool:
        return self.magnitude is not None

    def __repr__(self) -> str:
        d = ", DoRA" if self.is_dora else ""
        sc = np.asarray(self.scale)  # a combination's exact sum: one scale per rank column
        scale = f"{float(sc):g}" if sc.ndim == 0 else f"{sc.size} column scales"
        return f"LoraTarget({self.module!r}, {self.kind}, r={self.rank}, scale={scale}{d})"


@dataclass
class Replacement:
    """A whole tensor the adapter carries in place of the base's: PEFT's
    ``modules_to_save`` (``module`` + ``leaf``, raw storage ``raw`` of dtype ``code``, file
    tensor ``name``), which ``merge_and_unload()`` puts into the merged model as it is; with
    ``rows`` (PEFT's ``trainable_token_indices``), only those rows' new values."""

    module: str
    leaf: str
    raw: np.ndarray
    code: str
    name: str
    rows: Optional[Tuple[int, ...]] = None

    def __repr__(self) -> str:
        rows = f", rows {list(self.rows)}" if self.rows else ""
        return f"Replacement({self.module}.{self.leaf}, {self.code}{list(self.raw.shape)}{rows})"


@dataclass
class Adapter:
    """An adapter read from disk, in lorakit's one description: one :class:`LoraTarget` per
    adapted module in file order, the raw adapter_config.json, the weights file, and
    ``replacements`` (PEFT ``modules_to_save``)."""

    path: Path
    format: str
    targets: List[LoraTarget]
    config: Dict[str, Any]
    weights_file: Path
    fine_tune_type: str = "lora"
    replacements: List[Replacement] = field(default_factory=list)
    _sha256: Optional[str] = field(default=None, repr=False)

    @property
    def sha256(self) -> str:
        """Hash of the weights file and config, recorded in fused outputs."""
        if self._sha256 is None:
            h = hashlib.sha256()
            for p in (self.path / CONFIG, self.weights_file):
                with open(p, "rb") as f:
                    for chunk in iter(lambda: f.read(1 << 20), b""):
                        h.update(chunk)
            self._sha256 = h.hexdigest()
        return self._sha256

    @property
    def is_dora(self) -> bool:
        return any(t.is_dora for t in self.targets)

    def __len__(self) -> int:
        return len(self.targets)

    def __repr__(self) -> str:
        kinds = sorted({t.kind for t in self.targets})
        ranks = sorted({t.rank for t in self.targets})
        return (f"Adapter({str(self.path)!r}, {self.format}, {self.fine_tune_type}, "
                f"{len(self.targets)} targets, rank {'/'.join(map(str, ranks))}, "
                f"{'/'.join(kinds)})")


class AdapterTensors:
    """An adapter's weights file, read lazily: the header at once, a tensor's data only
    when asked for (a refused or unused tensor is never read)."""

    def __init__(self, file: Path) -> None:
        self.file = file
        self.infos: Dict[str, TensorInfo] = read_header(file).tensors  # file order

    @property
    def names(self) -> List[str]:
        return list(self.infos)

    def check_float(self, name: str) -> None:
        """Raise unless tensor ``name`` is stored as a float (checked from the header)."""
        dtype = self.infos[name].dtype
        if dtype not in FLOAT_ADAPTER_CODES:
            raise AdapterError("adapter tensor is not floating point", file=self.file,
                               tensor=name, expected="F32, F16 or BF16", found=dtype)

    def read_f32(self, name: str) -> np.ndarray:
        """Tensor ``name`` as float32, checked to be finite."""
        self.check_float(name)
        info = self.infos[name]
        raw = read_raw(info)
        x = raw.astype(np.float32) if info.dtype == "F64" else \
            to_float32(raw, float_format(info.dtype))
        check_finite(self.file, name, x)
        return x

    def read_raw(self, name: str) -> Tuple[np.ndarray, str]:
        """Tensor ``name``'s storage as saved, with its dtype code."""
        info = self.infos[name]
        return read_raw(info), info.dtype


def number(x: Any) -> Optional[float]:
    """``x`` as a finite float, or None (bools, strings, huge ints, NaN, Inf)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    try:
        v = float(x)
    except OverflowError:  # an integer beyond float range
        return None
    return v if math.isfinite(v) else None


def whole(x: Any) -> Optional[int]:
    """``x`` as a positive int if it is a JSON integer (not a bool, not 8.0), else None."""
    return x if type(x) is int and x > 0 else None


def check_magnitude(name: str, m_shape: Tuple[int, ...], want: Tuple[int, ...]) -> Optional[str]:
    """A problem line if a DoRA magnitude of shape ``m_shape`` does not have one entry
    per output row (``want``: the output rows' shape)."""
    n = 1
    for d in m_shape:
        n *= d
    if tuple(m_shape) != tuple(want) and not (len(m_shape) == 1 and (n,) == tuple(want)):
        return (f"  {name}: DoRA magnitude has the wrong shape: expected {list(want)} "
                f"(one per output row), found {list(m_shape)}")
    return None


def check_finite(file: Path, name: str, x: np.ndarray) -> None:
    """Raise if ``x`` holds NaN or Inf."""
    if not np.isfinite(x).all():
        bad = int((~np.isfinite(x)).sum())
        raise AdapterError("adapter tensor holds NaN or Inf", file=file, tensor=name,
                           expected="finite values", found=f"{bad} non-finite of {x.size}")


def bad_config(cfg_path: Path, key: str, message: str, expected: str, found: Any,
               hint: Optional[str] = None, n: Optional[int] = 80) -> AdapterError:
    """The error for config entry ``key``: ``found`` is the value, its repr cut to ``n``."""
    return AdapterError(message, file=cfg_path, tensor=key, expected=expected,
                        found=repr(found)[:n], hint=hint)


def problems(file: Path, errors: Iterable[str], expected: str,
             headline: str = "problem(s) in the adapter's tensors",
             hint: Optional[str] = None) -> AdapterError:
    """One error listing every problem line found in an adapter."""
    errors = list(errors)
    return AdapterError(f"{len(errors)} {headline}:\n" + "\n".join(errors), file=file,
                        expected=expected, found=f"{len(errors)} problem(s), listed above",
                        hint=hint)
