"""CLI start-up: ``lorakit --help``, ``lorakit inspect PATH`` and an argument error,
each against ``python -c pass`` (the interpreter's own start) in the same run.

Every command runs as a whole process, ``--runs`` rounds, the order rotated each round
(interleaved, so a burst of load on the shared machine hits every command alike);
the medians are reported, and each command's median minus Python's (the goal: within
0.1 s). Run from the repository root::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/startup.py [--runs 30] [--path CKPT] \\
        [--json benchmarks/results/startup.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def commands(path: str) -> Dict[str, List[str]]:
    lk = [PY, "-m", "lorakit"]
    return {"python -c pass": [PY, "-c", "pass"],
            "lorakit --help": [*lk, "--help"],
            f"lorakit inspect {path}": [*lk, "inspect", path],
            "lorakit fuse --no-such-flag (argument error)": [*lk, "fuse", "--no-such-flag"]}


def run_once(cmd: List[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--path", default="data/tiny-qwen3", help="checkpoint to inspect")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    cmds = commands(args.path)
    names = list(cmds)
    times: Dict[str, List[float]] = {n: [] for n in names}
    for n in names:  # one warm-up each: .pyc files written, page cache filled
        run_once(cmds[n])
    load_before = os.getloadavg()
    for r in range(args.runs):
        for n in names[r % len(names):] + names[:r % len(names)]:
            times[n].append(run_once(cmds[n]))
    base = statistics.median(times[names[0]])
    rows = [{"command": n, "argv": cmds[n][1:], "median_s": statistics.median(times[n]),
             "over_python_s": statistics.median(times[n]) - base,
             "min_s": min(times[n]), "runs_s": times[n]} for n in names]
    table = ["| command | median (s) | min (s) | median minus `python -c pass` (s) |",
             "|---|---:|---:|---:|"]
    for row in rows:
        table.append(f"| `{row['command']}` | {row['median_s']:.3f} | {row['min_s']:.3f} | "
                     f"{row['over_python_s']:+.3f} |")
    print("\n".join(table))
    load = (load_before, os.getloadavg())
    print(f"\nload average (1, 5, 15 min) before {load[0]}, after {load[1]}; "
          f"{args.runs} interleaved rounds")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(
            {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                         "loadavg_before": load[0], "loadavg_after": load[1]},
             "python": sys.version.split()[0], "runs": args.runs, "rows": rows,
             "markdown": "\n".join(table)}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
