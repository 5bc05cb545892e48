"""Dtype names, in one table: safetensors codes (``"BF16"``), the names configs and users
write (``"bfloat16"``, ``"torch.bfloat16"``), MLX dtypes, and the majority float dtype.

>>> code_of("torch.bfloat16"), code_of("float32"), code_of("int8")
('BF16', 'F32', None)
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Dict, Iterable, Optional

from .safetensors import FLOAT_CODES

__all__ = ["QUANT_SUFFIXES", "code_of", "config_dtype", "mx_dtype", "storage_code"]

#: float dtype names (as config.json, torch and ``--dtype`` spell them) -> safetensors code
NAME_CODES: Dict[str, str] = {"bfloat16": "BF16", "float16": "F16", "float32": "F32",
                              "float64": "F64"}

#: short spellings ``--dtype`` also takes
NAME_ALIASES: Dict[str, str] = {"bf16": "bfloat16", "fp16": "float16", "f32": "float32"}

#: the tensors beside a packed quantized ``.weight``
QUANT_SUFFIXES = (".scales", ".biases")


def code_of(name: Any) -> Optional[str]:
    """The safetensors code of a float dtype name (``torch.`` prefix allowed), or None."""
    if not isinstance(name, str):
        return None
    name = name.replace("torch.", "")
    return NAME_CODES.get(NAME_ALIASES.get(name, name))


def config_dtype(config: Any) -> Optional[str]:
    """The float dtype config.json declares (``torch_dtype`` or transformers 5's ``dtype``).

    >>> config_dtype({"torch_dtype": "bfloat16"}), config_dtype({})
    ('BF16', None)
    """
    if not isinstance(config, dict):
        return None
    for key in ("torch_dtype", "dtype"):
        code = code_of(config.get(key))
        if code is not None:
            return code
    return None


def mx_dtype(code: str) -> Any:
    """The MLX dtype of a float code (``"BF16"`` -> ``mx.bfloat16``)."""
    import mlx.core as mx  # lazy: mlx is heavy and only needed when computing

    return {"BF16": mx.bfloat16, "F16": mx.float16, "F32": mx.float32}[code]


def storage_code(arr: Any, fallback: str) -> str:
    """The float code of a numpy array of raw storage (bf16 travels as uint16 bits:
    an uint16 array is read as BF16); ``fallback`` for anything else."""
    kind = str(getattr(arr, "dtype", ""))
    return {"uint16": "BF16", "float16": "F16", "float32": "F32"}.get(kind, fallback)


def majority_dtype(metas: Iterable[Any]) -> str:
    """The float dtype holding most elements, quantization scales/biases aside; for a
    fully quantized set, the scales' dtype; ``"F32"`` when there are no floats.
    ``metas`` are anything with ``.name``, ``.dtype`` and ``.numel``.
    """
    metas = list(metas)
    c: Counter = Counter()
    for t in metas:
        if t.dtype in FLOAT_CODES and not t.name.endswith(QUANT_SUFFIXES):
            c[t.dtype] += t.numel
    if not c:
        for t in metas:
            if t.name.endswith(".scales") and t.dtype in FLOAT_CODES:
                c[t.dtype] += t.numel
    return c.most_common(1)[0][0] if c else "F32"
