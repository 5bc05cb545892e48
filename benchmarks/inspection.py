"""Inspection speed on a Qwen3-1.7B-shaped checkpoint: dtype map, and diff vs `cat`.

Writes a random checkpoint with Qwen3-1.7B's tensor names and shapes (bf16,
``lorakit.synth``), a rank-8 adapter on the last 16 layers x 7 projections, and
checkpoints to compare it with; then times

* ``dtype_map`` (headers only; target < 50 ms);
* the whole command ``lorakit diff --json A B`` against ``cat A/*.safetensors
  B/*.safetensors > /dev/null`` (target <= 3x), with the diff's peak RSS (target < 1 GB),
  for three pairs: an identical copy, base vs fused (112 of 310 tensors differ on most
  elements), and lorakit's fuse vs mlx-lm's order (the same tensors differ on a few
  percent).

Each repeat runs ``cat`` and then the diff on each ulp path (``--paths``: the C kernel and
the numpy path, side by side) with the files in the page cache (``cat`` and the diff read
the same warm files), or, with ``--cold``, with the two checkpoints' files evicted from the
cache before every run (both read the disk). Reported: the median over repeats of each
diff's time over the ``cat`` just before it, and best over best; CPU and peak RSS from
``wait4``. The one-tensor table times ``lorakit.diff`` in this process.

    python benchmarks/inspection.py [--out bench-out/inspect] [--repeat 3]
                                    [--paths kernel,numpy] [--cold] [--skip-tensors]
                                    [--json benchmarks/results/inspection.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple


def shards(path: Path) -> List[str]:
    return sorted(str(p) for p in path.glob("*.safetensors"))


def evict(*dirs: Path) -> None:
    """Drop these checkpoints' files from the page cache (only theirs, nobody else's)."""
    for d in dirs:
        for f in shards(d):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def time_cat(a: Path, b: Path) -> Tuple[float, float]:
    """(wall seconds, CPU user+sys seconds) of ``cat A B > /dev/null``."""
    t = time.perf_counter()
    proc = subprocess.Popen(["cat", *shards(a), *shards(b)], stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status):
        raise SystemExit("cat failed")
    return time.perf_counter() - t, usage.ru_utime + usage.ru_stime


def time_diff(a: Path, b: Path, path: str = "kernel") -> Tuple[float, float, int, dict]:
    """(wall seconds, CPU user+sys seconds, peak RSS bytes, the report's summary) of the
    whole command ``lorakit diff --json A B``. ``path``: ``kernel`` (the C ulp kernel) or
    ``numpy``."""
    env = dict(os.environ, LORAKIT_KERNELS="0" if path == "numpy" else "1")
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "lorakit", "diff", "--json", str(a), str(b)],
                            stdout=subprocess.PIPE, env=env)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    if os.waitstatus_to_exitcode(status) not in (0, 1):
        raise SystemExit(f"diff failed with status {os.waitstatus_to_exitcode(status)}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024, \
        json.loads(out)["diff"]["summary"]


def prepare(out: Path) -> Dict[str, Path]:
    import lorakit
    from lorakit.synth import synth_adapter, synth_checkpoint

    out.mkdir(parents=True, exist_ok=True)
    p = {"base": out / "qwen3-1.7b", "copy": out / "qwen3-1.7b-copy", "lora": out / "lora",
         "fused": out / "fused-nearest", "fused_mlx": out / "fused-mlx-lm"}
    if not p["base"].exists():
        synth_checkpoint(p["base"], "qwen3-1.7b", progress=False)
    if not p["copy"].exists():
        shutil.copytree(p["base"], p["copy"])
    if not p["lora"].exists():
        synth_adapter(p["lora"], p["base"], rank=8, layers=16)
    if not p["fused"].exists():
        lorakit.fuse(p["base"], p["lora"], p["fused"], progress=False)
    if not p["fused_mlx"].exists():
        lorakit.fuse(p["base"], p["lora"], p["fused_mlx"], rounding="mlx-lm", progress=False)
    return p


def bench_tensor_pairs(out: Path, pairs, tensor: str, repeat: int = 10) -> List[dict]:
    """One adapted tensor per pair, copied to its own small files: small enough to stay
    in the page cache, so the ratio to ``cat`` shows compute cost, not disk luck."""
    from lorakit.inspect.diff import diff
    from lorakit.io.formats.checkpoint import Checkpoint
    from lorakit.io.formats.safetensors import TensorSpec
    from lorakit.io.outputs.safetensors_write import SafetensorsWriter

    rows = []
    for label, a, b in pairs:
        files = []
        for side, src in (("a", a), ("b", b)):
            ck = Checkpoint(src)
            info = ck.info(tensor)
            d = out / "tensor-pairs" / label.replace(" ", "-") / side
            d.mkdir(parents=True, exist_ok=True)
            with SafetensorsWriter(d / "model.safetensors",
                                   [TensorSpec(tensor, info.dtype, info.shape)]) as w:
                w.copy(tensor, info)
            (d / "config.json").write_text("{}")
            files.append(d)
        row = {"pair": label, "tensor": tensor}
        cats = [time_cat(files[0], files[1])[0] for _ in range(repeat)]
        row["cat_s"] = min(cats)
        for threads in (1, None):
            times = []
            for _ in range(repeat):
                t = time.perf_counter()
                rep = diff(files[0], files[1], threads=threads)
                times.append(time.perf_counter() - t)
            key = "diff_1t_s" if threads == 1 else "diff_s"
            row[key] = min(times)
        row["elements"] = rep.summary["elements compared"]
        row["differing"] = rep.summary["elements differing"]
        rows.append(row)
    return rows


def bench_dtype_map(path: Path, repeat: int = 30) -> dict:
    from lorakit.inspect.dtypes import dtype_map

    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        dm = dtype_map(path)
        times.append(time.perf_counter() - t)
    return {"tensors": len(dm.rows), "best_ms": min(times) * 1e3,
            "median_ms": statistics.median(times) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench-out/inspect", help="working directory (~14 GB)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cold", action="store_true",
                    help="evict the two checkpoints' files from the page cache before each "
                    "timed run (cat and diff then read from disk)")
    ap.add_argument("--skip-tensors", action="store_true", help="skip the one-tensor table")
    ap.add_argument("--paths", default="kernel,numpy",
                    help="ulp paths to time side by side: kernel (C), numpy, or both")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    p = prepare(Path(args.out))
    results: Dict[str, object] = {"dtype_map": bench_dtype_map(p["base"]),
                                  "cpus": os.cpu_count(), "load_avg_before": os.getloadavg()}
    pairs = [("identical copy", p["base"], p["copy"]),
             ("base vs fused", p["base"], p["fused"]),
             ("lorakit vs mlx-lm fuse", p["fused"], p["fused_mlx"])]
    from lorakit.inspect.ulp_count import scale_kernel

    paths = [x for x in args.paths.split(",") if x]
    if "kernel" in paths and scale_kernel() is None:
        raise SystemExit("the C ulp kernel is not built here: --paths numpy")
    rows = []
    for label, a, b in pairs:
        # side by side in one loop: cat, then each path, repeat; ratios per repeat
        cats: List[float] = []
        runs: Dict[str, Dict[str, list]] = {x: {"s": [], "cpu": [], "rss": [], "ratio": []}
                                            for x in paths}
        for _ in range(args.repeat):
            if args.cold:
                evict(a, b)
            c = time_cat(a, b)[0]
            cats.append(c)
            for x in paths:
                if args.cold:
                    evict(a, b)
                w, cpu, r, summary = time_diff(a, b, x)
                for k, v in (("s", w), ("cpu", cpu), ("rss", r), ("ratio", w / c)):
                    runs[x][k].append(v)
        size = sum(os.path.getsize(f) for f in shards(a) + shards(b))
        row = {"pair": label, "bytes_read": size, "cat_s": min(cats),
               "cat_median_s": statistics.median(cats),
               "elements": summary["elements compared"],
               "differing": summary["elements differing"],
               "tensors_differing": summary["tensors differing"], "all_cat_s": cats}
        for x in paths:
            rr = runs[x]
            row[x] = {"diff_s": min(rr["s"]), "diff_median_s": statistics.median(rr["s"]),
                      "ratio_best": min(rr["s"]) / min(cats),
                      "ratio_median": statistics.median(rr["ratio"]),
                      "cpu_median_s": statistics.median(rr["cpu"]),
                      "peak_rss_mb": max(rr["rss"]) / 2 ** 20, "all_s": rr["s"],
                      "all_ratios": rr["ratio"]}
        rows.append(row)
    results["diff"] = rows
    results["load_avg_after"] = os.getloadavg()
    tensor = "model.layers.27.mlp.up_proj.weight"
    results["tensor_pairs"] = [] if args.skip_tensors else \
        bench_tensor_pairs(Path(args.out), pairs, tensor)
    dm = results["dtype_map"]
    print(f"{os.cpu_count()} CPUs, load average {results['load_avg_before'][0]:.1f} before the "
          f"diffs, {results['load_avg_after'][0]:.1f} after")
    print(f"dtype_map, {dm['tensors']} tensors: best {dm['best_ms']:.2f} ms, "
          f"median {dm['median_ms']:.2f} ms")
    print()
    print("`lorakit diff --json A B`, the whole process, against `cat` of both run just before "
          "it; ratios: the median over repeats of diff / that cat, and best / best.")
    print()
    head = "| pair | GB read | elements differing | cat median (s) |"
    line = "|---|---:|---|---:|"
    for x in paths:
        head += (f" {x}: diff median (s) | {x}: x cat, median / best | {x}: CPU median (s) |")
        line += "---:|---:|---:|"
    print(head + " peak RSS (MB) |")
    print(line + "---:|")
    for r in rows:
        cells = (f"| {r['pair']} | {r['bytes_read'] / 1e9:.2f} | {r['differing']:,} of "
                 f"{r['elements']:,} | {r['cat_median_s']:.2f} |")
        for x in paths:
            q = r[x]
            cells += (f" {q['diff_median_s']:.2f} | **{q['ratio_median']:.2f}x** / "
                      f"{q['ratio_best']:.2f}x | {q['cpu_median_s']:.2f} |")
        print(cells + f" {max(r[x]['peak_rss_mb'] for x in paths):.0f} |")
    if not results["tensor_pairs"]:
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
        return
    print()
    print(f"One tensor, {tensor} (25 MB per side), files in the page cache, best of 10:")
    print()
    print("| pair | elements differing | cat (ms) | diff, 1 thread (ms) | diff (ms) | "
          "diff / cat | ns per element |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in results["tensor_pairs"]:
        print(f"| {r['pair']} | {r['differing']:,} of {r['elements']:,} | "
              f"{r['cat_s'] * 1e3:.1f} | {r['diff_1t_s'] * 1e3:.1f} | "
              f"{r['diff_s'] * 1e3:.1f} | {r['diff_s'] / r['cat_s']:.2f}x | "
              f"{r['diff_s'] / r['elements'] * 1e9:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
