"""The extract's SVD start on the products' two backends: numpy (float64, the default)
against MLX on its default device (float32; float64 where the device has it, the CPU).

``lorakit.algebra.lowrank.matrix_svd`` starts each large module with a randomized SVD
of ``D = T - W`` (Halko et al.: a sketch of ``r + 16`` columns, 2 power iterations): five
products of ``D`` with thin matrices, a QR of each thin result and one small SVD. This
runs the same algorithm, the same Gaussian sketch, with the products of each variant:

* ``numpy float64``: lorakit's own ``matrix_svd`` (BLAS ``dgemm``);
* ``numpy float32``: ``D`` and the sketch rounded to float32 (``sgemm``);
* ``mlx float32``: ``mx.matmul`` on the default device (the GPU where there is one);
* ``mlx float64``: ``mx.matmul`` in float64 on the CPU stream (MLX's GPUs have none);

the thin QRs and the small SVD in numpy float64 for all (they are a few percent of the
time). Per variant: the median wall of ``--repeats`` rounds (variants interleaved, one
warm-up each), and what the start is worth to the extract on that module: the elements
a re-fuse of its rank-8 float32 factors changes (``outside_svd``), its residual over the
rounding noise (the extract keeps only factors within it), and the elements left after
the refit from it (``outside_after``). On layer 27's gate_proj of the Qwen3-1.7B-shaped
fuse of ``benchmarks/fuse.py`` (6144 x 2048, bf16).

Usage::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/svd_start.py --out /tmp/speed-bench \\
        --json benchmarks/results/svd_start.json
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from fuse import prepare  # noqa: E402

import lorakit  # noqa: E402
from lorakit import numerics as nm  # noqa: E402
from lorakit.algebra import lowrank, refine  # noqa: E402
from lorakit.algebra.lowrank import split_factors  # noqa: E402

MODULE = "model.layers.27.mlp.gate_proj.weight"
RANK = 8


def _randomized(dmul, dtmul, sketch):
    """lowrank._randomized with the products ``D @ y`` (``dmul``) and ``D.T @ y``
    (``dtmul``; ``Q.T @ D`` as ``(D.T @ Q).T``) of the variant, numpy arrays in and out,
    and the QRs and the small SVD in numpy float64."""
    def qr(x):
        return np.linalg.qr(np.asarray(x, np.float64))[0]

    Q = qr(dmul(sketch))
    for _ in range(lowrank.POWER_ITERS):
        Z = qr(dtmul(Q))
        Q = qr(dmul(Z))
    Ub, S, Vt = np.linalg.svd(np.asarray(dtmul(Q), np.float64).T, full_matrices=False)
    return Q @ Ub, S, Vt


def _variants(D64: np.ndarray, width: int):
    import mlx.core as mx

    sketch = np.random.default_rng(0).standard_normal((D64.shape[1], width))
    D32 = D64.astype(np.float32)

    def numpy64():
        U, S, Vt, method = lowrank.matrix_svd(D64, RANK, seed=0)
        assert method == "randomized"
        return U, S, Vt

    def numpy32():
        D32T = np.ascontiguousarray(D32.T)
        return _randomized(lambda y: D32 @ np.asarray(y, np.float32),
                           lambda y: D32T @ np.asarray(y, np.float32),
                           sketch.astype(np.float32))

    def on_mlx(dtype, stream):
        src = D32 if dtype == mx.float32 else D64
        Dm, DmT = mx.array(src, dtype=dtype), mx.array(np.ascontiguousarray(src.T), dtype=dtype)
        mx.eval(Dm, DmT)

        def product(M):
            def run(y):
                with mx.stream(stream):
                    out = mx.matmul(M, mx.array(np.asarray(y), dtype=dtype))
                    mx.eval(out)
                return np.array(out)
            return run

        return lambda: _randomized(product(Dm), product(DmT), sketch)

    return {
        "numpy float64": (numpy64, "cpu (BLAS)"),
        "numpy float32": (numpy32, "cpu (BLAS)"),
        "mlx float32": (on_mlx(mx.float32, mx.default_device()), str(mx.default_device())),
        "mlx float64": (on_mlx(mx.float64, mx.cpu), str(mx.Device(mx.cpu))),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    import mlx.core as mx

    base, adapter = prepare(a.out)
    fused = a.out / "fused"
    if not (fused / "config.json").exists():
        lorakit.fuse(base, adapter, fused, progress=False)
    b, t = lorakit.open(base), lorakit.open(fused)
    fmt = nm.float_format("BF16")
    W = nm.to_float32(b.read(MODULE), fmt)
    bits = np.ascontiguousarray(t.read(MODULE))
    D = np.empty(W.shape)
    _, noise_sq = refine.difference(W, bits, "BF16", D)
    noise = math.sqrt(noise_sq)
    variants = _variants(D, RANK + lowrank.OVERSAMPLE)
    starts, runs = {}, {k: [] for k in variants}
    for name, (fn, _) in variants.items():  # one warm-up each, which gives the start
        starts[name] = fn()
    for _ in range(a.repeats):  # interleaved rounds
        for name, (fn, _) in variants.items():
            t0 = time.perf_counter()
            fn()
            runs[name].append(time.perf_counter() - t0)
    rows = []
    for name, (_, device) in variants.items():
        U, S, Vt = starts[name]
        A, B = split_factors(U, S, Vt, RANK)
        out, rsq = refine.fuse_stats(W, bits, "BF16", A, B)
        res = refine.refine_factors(W, bits, "BF16", A, B, outside=out)
        rows.append({"variant": name, "device": device, "runs_s": runs[name],
                     "median_s": statistics.median(runs[name]), "outside_svd": int(out),
                     "residual_over_noise": math.sqrt(rsq) / noise,
                     "outside_after": int(res.outside_after)})
        print(rows[-1], flush=True)
    ref = next(r for r in rows if r["variant"] == "numpy float64")
    for r in rows:
        r["time_vs_numpy_float64"] = r["median_s"] / ref["median_s"]
    doc = {"command": "PYTHONPATH=$PWD .venv/bin/python benchmarks/svd_start.py --out /tmp/speed-bench "
                      "--json benchmarks/results/svd_start.json",
           "module": MODULE[: -len(".weight")], "shape": list(W.shape), "rank": RANK,
           "sketch_width": RANK + lowrank.OVERSAMPLE, "power_iters": lowrank.POWER_ITERS,
           "repeats": a.repeats, "mlx": mx.__version__, "default_device": str(mx.default_device()),
           "machine": f"{platform.machine()}, {platform.system()}", "rows": rows}
    text = json.dumps(doc, indent=2)
    print(text)
    if a.json:
        a.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
