"""What the scale figures of a diff cost (relative error, near zero, max ulp at typical
magnitudes: lorakit/inspect/ulp_count.py, the C kernel's ``scale``).

Two bf16 safetensors files of 8 tensors of 2048 x 4096 (128 MiB each, values ~N(0,
0.05)): identical, or 6 tensors with 25% of elements one ulp apart. ``compare_sources``
is timed with the scale figures on and off (off: no float format gets them), rounds
interleaved, the minimum of each kept (files in the page cache: compute-bound, the
worst case for an extra pass).

    python benchmarks/ulp_scale_speed.py [--rounds 5] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from lorakit.inspect import ulp_count as ulp_accumulate
from lorakit.inspect import ulp_scale
from lorakit.inspect.diff import compare_sources


def _write(path: Path, tensors: dict) -> None:
    header, blobs, off = {}, [], 0
    for name, bits in tensors.items():
        b = bits.tobytes()
        header[name] = {"dtype": "BF16", "shape": list(bits.shape),
                        "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(len(h).to_bytes(8, "little") + h + b"".join(blobs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    a, b = {}, {}
    for i in range(8):
        w = rng.standard_normal((2048, 4096), dtype=np.float32) * 0.05
        bits = (w.view(np.uint32) >> 16).astype(np.uint16)
        a[f"w{i}"] = bits
        if i < 6:
            d = bits.copy()
            d[rng.random(bits.shape) < 0.25] += 1
            b[f"w{i}"] = d
        else:
            b[f"w{i}"] = bits
    with tempfile.TemporaryDirectory() as tmp:
        fa, fb = Path(tmp) / "a.safetensors", Path(tmp) / "b.safetensors"
        _write(fa, a)
        _write(fb, b)
        floats = set(ulp_scale._FLOAT)
        times = {k: [] for k in ("differing, on", "differing, off", "identical, on",
                                 "identical, off")}
        for _ in range(args.rounds):
            for on in (True, False):
                ulp_scale._FLOAT = floats if on else set()
                for case, other in (("differing", fb), ("identical", fa)):
                    t = time.perf_counter()
                    compare_sources(fa, other)
                    times[f"{case}, {'on' if on else 'off'}"].append(time.perf_counter() - t)
        ulp_scale._FLOAT = floats
    best = {k: min(v) for k, v in times.items()}
    out = {"command": "python benchmarks/ulp_scale_speed.py --json "
                      "benchmarks/results/ulp_scale_speed.json",
           "bytes_per_side": int(sum(x.nbytes for x in a.values())),
           "kernel_scale": ulp_accumulate.scale_kernel() is not None,
           "seconds_min": best, "seconds_all": times,
           "ratio_differing": best["differing, on"] / best["differing, off"],
           "ratio_identical": best["identical, on"] / best["identical, off"]}
    for k, v in best.items():
        print(f"{k:16s} {v * 1e3:7.1f} ms  ({out['bytes_per_side'] / v / 1e9:.2f} GB/s per side)")
    print(f"scale figures cost: x{out['ratio_differing']:.2f} on differing files, "
          f"x{out['ratio_identical']:.2f} on identical ones")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
