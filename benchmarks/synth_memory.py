"""Peak memory of writing a synthetic checkpoint (default: Llama-3.1-8B's shape, 16 GB of bf16).

Runs ``lorakit synth checkpoint`` as a whole process under ``os.wait4`` and reports
its wall time, peak RSS (``ru_maxrss``) and what it wrote, then deletes the
checkpoint (``--keep`` to keep it). The target: peak RSS well under 2 GB, because
tensors are generated and written a few MB at a time.

Usage::

    .venv/bin/python benchmarks/synth_memory.py [--preset llama-3.1-8b] [--out bench-out]

Prints a markdown row and writes ``bench-out/synth_memory-<preset>.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--out", default=str(ROOT / "bench-out"))
    ap.add_argument("--shard-size", default="5GB")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target = out / f"synth-{args.preset}"
    shutil.rmtree(target, ignore_errors=True)
    free = shutil.disk_usage(out).free
    cmd = [sys.executable, "-m", "lorakit", "synth", "checkpoint", str(target),
           "--preset", args.preset, "--shard-size", args.shard_size, "-q"]
    os.sync()
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    summary = p.stdout.read().decode() if p.stdout else ""
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        print(summary)
        shutil.rmtree(target, ignore_errors=True)
        return code
    files = sorted(target.iterdir())
    size = sum(f.stat().st_size for f in files if f.suffix == ".safetensors")
    result = {"command": " ".join(cmd[1:]), "preset": args.preset, "wall_s": wall,
              "peak_rss_bytes": usage.ru_maxrss * 1024, "user_s": usage.ru_utime,
              "system_s": usage.ru_stime, "bytes_written": size,
              "shards": sum(1 for f in files if f.suffix == ".safetensors"),
              "disk_free_before": free, "summary": summary.strip()}
    if not args.keep:
        shutil.rmtree(target)
    print(summary.strip())
    print("\n| preset | checkpoint size | shards | wall (s) | CPU user+sys (s) | peak RSS |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| {args.preset} | {size / 1e9:.2f} GB | {result['shards']} | {wall:.1f} | "
          f"{usage.ru_utime + usage.ru_stime:.1f} | {usage.ru_maxrss / 1024:.0f} MB |")
    (out / f"synth_memory-{args.preset}.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
