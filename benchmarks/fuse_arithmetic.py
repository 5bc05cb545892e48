"""The default (nearest) fuse's arithmetic alone, in memory, one thread: a bf16 6144 x 2048
weight (Qwen3-1.7B's MLP shape) plus a rank-8 f32 delta, median of repeats, as time per
element and what it comes to for the 1.7B benchmark's 805,306,368 fused elements: the part
of a fuse no file-system trick removes (BENCHMARKS.md, Clone and patch).

  PYTHONPATH=$PWD .venv/bin/python benchmarks/fuse_arithmetic.py --out benchmarks/results/fuse_arithmetic.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # one thread: before numpy loads BLAS
import numpy as np  # noqa: E402

from lorakit import numerics as nm  # noqa: E402
from lorakit.fusion.nearest import _fuse_nearest  # noqa: E402

ELEMENTS_1P7B = 805_306_368  # 16 layers x 7 projections of Qwen3-1.7B


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out")
    a = p.parse_args(argv)
    fmt = nm.float_format("BF16")
    rng = np.random.default_rng(0)
    rows, cols = 6144, 2048
    w = nm.round_to_format(rng.normal(0, 0.02, (rows, cols)), fmt)
    A = rng.normal(0, 0.02, (8, cols)).astype(np.float32)
    B = rng.normal(0, 0.02, (rows, 8)).astype(np.float32)
    _fuse_nearest(w, fmt, A, B, 20.0, None, fmt)  # warm-up
    times = []
    for _ in range(a.repeats):
        t = time.perf_counter()
        _fuse_nearest(w, fmt, A, B, 20.0, None, fmt)
        times.append(time.perf_counter() - t)
    ns = statistics.median(times) / (rows * cols) * 1e9
    out = {"command": "python benchmarks/fuse_arithmetic.py " + " ".join(argv or sys.argv[1:]),
           "shape": [rows, cols], "rank": 8, "times_s": times, "ns_per_element": ns,
           "seconds_1p7b_one_core": ns * ELEMENTS_1P7B / 1e9,
           "seconds_1p7b_two_cores": ns * ELEMENTS_1P7B / 2e9,
           "loadavg": os.getloadavg(), "cpus": os.cpu_count(), "platform": platform.platform()}
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
