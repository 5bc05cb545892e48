"""A fuse's settings, validated once, with no numerical imports (the CLI builds its
flags from these names before any array library loads): :class:`FuseOptions`, what
:func:`lorakit.fuse` turns its keywords into and every step of a fuse reads.

>>> ROUNDINGS[0], DTYPE_POLICIES[0]
('nearest', 'preserve')
>>> FuseOptions(quant_policy="bits:8").choice
Choice(kind='bits', bits=8)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from ..errors import ArgumentError

__all__ = ["LAYOUTS", "LAYOUT_HELP", "ROUNDINGS", "ROUNDING_HELP", "DTYPE_POLICIES", "FuseOptions"]

#: rounding orders: correctly rounded (default), PEFT's merge_and_unload, mlx-lm's
#: fuse, and mlx-lm's order with the scale applied after the product
ROUNDINGS = ("nearest", "round-once", "mlx-lm", "scale-after")
#: what ``--rounding mlx-lm`` gives for a DoRA adapter (the help, docs and model card)
DORA_PARITY = ("same values as mlx_lm fuse; dtype kept (mlx_lm fuse writes DoRA weights "
               "float32; --dtype promote writes its exact bytes)")
#: each rounding order in words (the model card a fuse writes, the CLI's help)
ROUNDING_HELP = {
    "nearest": "correctly rounded: W + scale * B @ A computed exactly, rounded once",
    "round-once": "PEFT merge_and_unload's order (float32 product, one rounding)",
    "mlx-lm": "mlx_lm fuse's order: LoRA bit-identical to `mlx_lm fuse`; DoRA: " + DORA_PARITY,
    "scale-after": "mlx-lm's order with the scale applied after the product",
}
#: the orders computed in MLX itself (their base weights are read with ``mx.load``)
MLX_ROUNDINGS = ("mlx-lm", "scale-after")
#: what dtype the fused tensors are written in
DTYPE_POLICIES = ("preserve", "promote", "bfloat16", "float16", "float32")
#: how a fused MoE checkpoint lays out its experts (``layout=``; lorakit/io/outputs/hf_layout.py)
LAYOUTS = ("mlx-lm", "transformers")
#: each layout in words (the CLI's help)
LAYOUT_HELP = {
    "mlx-lm": "mlx-lm's stacked switch_mlp experts (mlx-lm reads it)",
    "transformers": "one tensor per expert, as on the hub (transformers and mlx-lm read it; "
                    "MoE families qwen3_moe, qwen2_moe, olmoe, mixtral, phimoe)",
}
#: how adapted modules of a quantized base are stored (``quant_policy=``)
POLICIES = ("requant", "same-grid", "bits:N", "float", "learned[:gptq]", "auto")


@dataclass(frozen=True)
class Choice:
    """What one adapted module becomes."""

    kind: str  # requant | same-grid | bits | float | learned
    bits: int = 0
    parts: Any = field(default=None, compare=False, hash=False, repr=False)  # learned's

    @property
    def label(self) -> str:
        return f"bits:{self.bits}" if self.kind == "bits" else self.kind


REQUANT = Choice("requant")


def parse_policy(policy: str) -> Choice:
    """``"bits:8"`` -> Choice("bits", 8); ``auto`` and ``learned`` parse to their kind."""
    p = str(policy).strip().lower()
    if p.startswith("bits:"):
        try:
            n = int(p[5:])
        except ValueError:
            n = -1
        if n not in (2, 3, 4, 5, 6, 8):
            raise ArgumentError.bad("quant_policy", policy, "bits:2..6 or bits:8")
        return Choice("bits", n)
    if p in ("requant", "same-grid", "float", "auto"):
        return Choice(p)
    if p == "learned" or p.startswith("learned:"):
        parse_method(p)
        return Choice("learned")
    raise ArgumentError.bad("quant_policy", policy, " | ".join(POLICIES))


METHODS = ("gptq",)
#: why the other learned methods are refused (the DWQ trial's times: BENCHMARKS.md)
REFUSED = {
    "awq": "mlx_lm.quant.awq.awq_quantize folds per-channel scales into the preceding "
           "norms and projections, so it rewrites untouched layers too and needs the whole "
           "float model. Use learned (GPTQ).",
    "dwq": "mlx_lm.quant.dwq.dwq_quantize trains every quantized layer's scales and biases "
           "by backprop against a teacher for hundreds of steps (minutes each on a CPU, "
           "retuning the untouched layers too). Use learned (GPTQ).",
}


def parse_method(policy: str) -> str:
    """``learned`` / ``learned:gptq`` -> ``"gptq"``; AWQ / DWQ refused with the reason."""
    p = str(policy).strip().lower()
    method = p.split(":", 1)[1] if ":" in p else "gptq"
    if method not in METHODS:
        raise ArgumentError.bad("quant_policy", policy, "learned | learned:gptq",
                                hint=f"learned:{method} is not available here: "
                                + REFUSED[method] if method in REFUSED else None)
    return method


@dataclass(frozen=True)
class FuseOptions:
    """How a fuse rounds and stores, checked once: ``rounding`` (:data:`ROUNDINGS`),
    ``dtype`` (:data:`DTYPE_POLICIES`), ``dequantize`` (a quantized base written as
    float), ``quant_policy`` (requant, same-grid, bits:N, float, auto, learned) with
    ``auto``'s ``quant_budget`` (bytes relative to the base, default 1.15), ``layout``
    (:data:`LAYOUTS`: MoE experts stacked as mlx-lm keeps them, or one per expert)."""

    rounding: str = "nearest"
    dtype: str = "preserve"
    dequantize: bool = False
    quant_policy: str = "requant"
    quant_budget: Optional[float] = None
    layout: str = "mlx-lm"
    choice: Choice = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, allowed in (("rounding", ROUNDINGS), ("dtype", DTYPE_POLICIES),
                              ("layout", LAYOUTS)):
            if getattr(self, name) not in allowed:
                raise ArgumentError.bad(name, getattr(self, name), " | ".join(allowed))
        object.__setattr__(self, "dequantize", bool(self.dequantize))
        object.__setattr__(self, "choice", parse_policy(self.quant_policy))
        b = self.quant_budget
        if b is not None and not (isinstance(b, (int, float)) and b > 0 and b == b):
            raise ArgumentError.bad("quant_budget", b, "a positive number, e.g. 1.15")

    def settings(self) -> dict:
        """The settings a fused checkpoint records (``lorakit.json``, the model card)."""
        return {"rounding": self.rounding, "dtype_policy": self.dtype,
                "dequantize": self.dequantize,
                **({"layout": self.layout} if self.layout != "mlx-lm" else {})}
