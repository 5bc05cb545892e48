"""MLX's CPU matmul throughput at a Qwen3-1.7B projection's shape (128 tokens x 2048 ->
6144), and what one forward pass of that model would cost from it: why the KL overhead
benchmark (benchmarks/kl.py) is measured at the 1.7B shape on the GPU only.

  python benchmarks/cpu_matmul.py --out benchmarks/results/cpu_matmul.json
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

#: multiply-adds per token of Qwen3-1.7B's forward pass (28 layers of q/k/v/o +
#: gate/up/down at hidden 2048, intermediate 6144, 16 q / 8 kv heads of 128, and the
#: 151,936 x 2048 output projection)
MACS_PER_TOKEN = 28 * (2048 * (2048 + 1024 + 1024) + 2048 * 2048 + 3 * 2048 * 6144) + 151936 * 2048


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out")
    a = p.parse_args(argv)
    import mlx.core as mx

    mx.set_default_device(mx.cpu)
    rows = []
    for name in ("float32", "bfloat16"):
        dt = getattr(mx, name)
        w = mx.random.normal((6144, 2048)).astype(dt)
        x = mx.random.normal((128, 2048)).astype(dt)
        mx.eval(w, x, x @ w.T)  # warm-up
        times = []
        for _ in range(a.repeats):
            t = time.perf_counter()
            mx.eval(x @ w.T)
            times.append(time.perf_counter() - t)
        s = statistics.median(times)
        gflops = 2 * 128 * 2048 * 6144 / s / 1e9
        rows.append({"dtype": name, "median_s": s, "times_s": times, "gflops": gflops,
                     "forward_128_tokens_s": 2 * MACS_PER_TOKEN * 128 / (gflops * 1e9)})
    out = {"command": "python " + " ".join(["benchmarks/cpu_matmul.py"] + (argv or sys.argv[1:])),
           "platform": platform.platform(), "cpus": os.cpu_count(), "mlx": mx.__version__,
           "loadavg": os.getloadavg(), "rows": rows}
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
