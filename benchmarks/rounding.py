"""Accuracy of each rounding mode against an exact reference, and its speed.

A 2048 x 6144 bf16 weight (Qwen3-1.7B's MLP shape) and a rank-8 f32 delta whose
size is set in bf16 ulps of the weight. For each mode: the fraction of elements
that differ from the correctly rounded result, the largest error in ulps of the
reference, and the time per element of ``fuse_weight``.

    python benchmarks/rounding.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from lorakit import numerics as nm
from lorakit.fusion.core import ROUNDINGS, fuse_weight
from lorakit.inspect.diff import ulp_tensors

BF16 = nm.float_format("BF16")


def case(rng: np.random.Generator, delta_ulps: float, rows: int = 2048, cols: int = 6144,
         rank: int = 8):
    w = nm.round_to_format(rng.normal(0, 0.02, (rows, cols)), BF16)
    A = rng.normal(0, 1, (rank, cols)).astype(np.float32)
    B = rng.normal(0, 1, (rows, rank)).astype(np.float32)
    scale = float(delta_ulps * 0.02 * 2.0 ** -8 / np.sqrt(rank))
    return w, A, B, scale


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    results = []
    for delta_ulps in (0.5, 2.0, 20.0):
        w, A, B, scale = case(rng, delta_ulps)
        correct, _ = fuse_weight(w, "BF16", A, B, scale, rounding="nearest")
        ref = nm.to_float64(w, BF16) + scale * (B.astype(np.float64) @ A.astype(np.float64))
        for mode in ROUNDINGS:
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                out, _ = fuse_weight(w, "BF16", A, B, scale, rounding=mode)
                times.append(time.perf_counter() - t)
            err = nm.ulp_error_vs_reference(out, ref, BF16)
            # the same difference at the weight's scale (lorakit.inspect.ulp_count)
            vs = ulp_tensors(correct, out, "bf16").diffs[0]
            results.append({
                "delta_ulps": delta_ulps, "mode": mode,
                "differ_from_correct": float((out != correct).mean()),
                "over_half_ulp": float((err > 0.5).mean()),
                "max_ulp_error": float(err.max()),
                "ns_per_element": statistics.median(times) / w.size * 1e9,
                "vs_correct": {"max_ulp": vs.max_ulp, "rel_err": vs.rel_rms or 0.0,
                               "max_ulp_typical": vs.max_ulp_typical or 0,
                               "near_zero": vs.near_zero or 0,
                               "zero_one_side": vs.to_zero or 0,
                               "sign_changes": vs.sign_changes or 0},
            })
    print("| delta (bf16 ulps, RMS) | mode | elements != correctly rounded | > 0.5 ulp | "
          "max error (ulp) | ns/element |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['delta_ulps']} | {r['mode']} | {r['differ_from_correct']:.3e} | "
              f"{r['over_half_ulp']:.3e} | {r['max_ulp_error']:.3g} | "
              f"{r['ns_per_element']:.1f} |")
    print("\nagainst the correctly rounded result, at the weight's scale:")
    print("| delta | mode | max ulp | max ulp at typical magnitudes | rms(diff)/rms(W) |")
    print("|---|---|---|---|---|")
    for r in results:
        v = r["vs_correct"]
        print(f"| {r['delta_ulps']} | {r['mode']} | {v['max_ulp']} | {v['max_ulp_typical']} | "
              f"{v['rel_err']:.2e} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python benchmarks/rounding.py --repeats 1 --json "
                       "benchmarks/results/rounding.json", "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
