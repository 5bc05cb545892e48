"""The nearest fuse of one weight: the C kernel against the numpy path, in process.

One 6144 x 2048 bf16 weight (Qwen3-1.7B's mlp.down_proj transposed shape; the
gate/up projections have it too) with a random rank-8 f32 LoRA, fused with
``lorakit.fusion.nearest._fuse_nearest`` (the default rounding), best of ``--repeat``:
the numpy path, the kernel with one thread, the kernel with two. Both paths must give
the same bits (checked). Usage::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/fuse_kernel.py --json benchmarks/results/fuse_kernel.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from lorakit import numerics as nm  # noqa: E402
from lorakit.fusion import nearest as nr  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not nr.kernel_available():
        raise SystemExit("the C fuse kernel is not built (or LORAKIT_FUSE_KERNEL=0)")
    rng = np.random.default_rng(0)
    rows, cols, rank = 6144, 2048, 8
    f = nm.float_format("bfloat16")
    w = nm.round_to_format(rng.standard_normal((rows, cols)) * 0.02, f)
    A = (rng.standard_normal((rank, cols)) * 0.01).astype(np.float32)
    B = (rng.standard_normal((rows, rank)) * 0.01).astype(np.float32)
    results, outs = {}, {}
    for name, on, threads in (("numpy path", False, 1), ("C kernel, 1 thread", True, 1),
                              ("C kernel, 2 threads", True, 2)):
        nr.USE_KERNEL, nr.THREADS = on, threads
        best = float("inf")
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            outs[name] = nr._fuse_nearest(w, f, A, B, 20.0, None, f)
            best = min(best, time.perf_counter() - t0)
        results[name] = {"seconds_best": best, "ns_per_element": best / w.size * 1e9}
        print(f"{name:<22} {best * 1e3:8.1f} ms  {best / w.size * 1e9:5.2f} ns/element",
              flush=True)
    same = all(np.array_equal(outs["numpy path"], o) for o in outs.values())
    print(f"same bits: {same}; load average {os.getloadavg()}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"shape": [rows, cols], "rank": rank, "repeat": args.repeat, "results": results,
             "same_bits": same, "loadavg": os.getloadavg(), "cpus": os.cpu_count(),
             "speedup_1_thread": results["numpy path"]["seconds_best"]
             / results["C kernel, 1 thread"]["seconds_best"]}, indent=2))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
