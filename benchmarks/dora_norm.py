"""How far MLX's row norm of a bfloat16 matrix (what mlx-lm's ``DoRALinear.fuse`` divides
by) is from the exact norm of the same values, in half-ulps of bfloat16 at the norm, and
against the allowance ``lorakit check``'s DoRA bound gives it (``float_bound`` in
``inspect/check.py``: one half-ulp, plus 2**-9 of the norm for a rounded sum of squares).
Random rows N(0, 0.02) of real projections' widths.

  python benchmarks/dora_norm.py --out benchmarks/results/dora_norm.json
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--out")
    a = p.parse_args(argv)
    import mlx.core as mx

    rng = np.random.default_rng(1)
    rows = []
    for cols in (1024, 2048, 4096, 8192, 14336):
        xb = mx.array(rng.normal(0, 0.02, (a.rows, cols)).astype(np.float32)).astype(mx.bfloat16)
        x = np.array(xb.astype(mx.float32)).astype(np.float64)
        exact = np.sqrt((x * x).sum(axis=1))
        got = np.array(mx.linalg.norm(xb, axis=1).astype(mx.float32)).astype(np.float64)
        half_ulp = 2.0 ** (np.floor(np.log2(exact)) - 8)
        err = np.abs(got - exact) / half_ulp
        # the bound's allowance: the root rounded (one half-ulp) after a sum of squares
        # rounded to bfloat16 (2**-9 of the norm)
        allowed = 1 + exact * 2.0 ** -9 / half_ulp
        rows.append({"columns": cols, "rows": a.rows, "max_half_ulps": float(err.max()),
                     "share_over_one": float(np.mean(err > 1)),
                     "max_over_allowance": float((err / allowed).max())})
    out = {"command": "python benchmarks/dora_norm.py " + " ".join(argv or sys.argv[1:]),
           "mlx": mx.__version__, "device": str(mx.default_device()),
           "platform": platform.platform(), "rows": rows}
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
