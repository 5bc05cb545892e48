"""The names of a fuse's choices, with no numerical imports (the CLI builds its flags
from them before any array library loads).

>>> ROUNDINGS[0], DTYPE_POLICIES[0]
('nearest', 'preserve')
"""
from __future__ import annotations

#: rounding orders: correctly rounded (default), PEFT's merge_and_unload, mlx-lm's
#: fuse, and mlx-lm's order with the scale applied after the product
ROUNDINGS = ("nearest", "round-once", "mlx-lm", "scale-after")
#: what dtype the fused tensors are written in
DTYPE_POLICIES = ("preserve", "promote", "bfloat16", "float16", "float32")
