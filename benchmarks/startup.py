"""CLI start-up: what ``lorakit inspect CKPT`` of a Qwen3-1.7B-shaped checkpoint costs over
``lorakit --help`` (the goal: < 0.05 s), with ``python -c pass`` and an argument error
beside them.

Every command runs as a whole process, ``--runs`` rounds, the order rotated each round
(interleaved, so a burst of load on the shared machine hits every command alike); the
medians are reported, and each command's median minus ``lorakit --help``'s and minus
Python's. Two tables: without lorakit's bytecode (its ``__pycache__`` folders removed,
``PYTHONDONTWRITEBYTECODE=1``: each lorakit module compiled from source in every process,
as in a fresh checkout run with that variable set), then with it cached (as an installed
package has it: the warm-up writes it). ``inspect`` reads headers only, so the checkpoint (written
once by ``lorakit synth`` into ``--out`` unless ``--path`` names one) stays on disk for
later runs. From the repository root::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/startup.py [--runs 30] [--path CKPT] \\
        [--out bench-out/startup] [--json benchmarks/results/startup.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
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
            "lorakit inspect CKPT": [*lk, "inspect", path],
            "lorakit fuse --no-such-flag (argument error)": [*lk, "fuse", "--no-such-flag"]}


def run_once(cmd: List[str], env: Dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT, env=env)
    return time.perf_counter() - t0


def measure(cmds: Dict[str, List[str]], env: Dict[str, str], runs: int) -> List[dict]:
    names = list(cmds)
    times: Dict[str, List[float]] = {n: [] for n in names}
    for n in names:  # one warm-up each: bytecode written (where allowed), page cache filled
        run_once(cmds[n], env)
    for r in range(runs):
        for n in names[r % len(names):] + names[:r % len(names)]:
            times[n].append(run_once(cmds[n], env))
    med = {n: statistics.median(times[n]) for n in names}
    return [{"command": n, "argv": cmds[n][1:], "median_s": med[n],
             "over_python_s": med[n] - med["python -c pass"],
             "over_help_s": med[n] - med["lorakit --help"], "min_s": min(times[n]),
             "runs_s": times[n]} for n in names]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--path", default=None, help="checkpoint to inspect (default: a "
                    "Qwen3-1.7B-shaped one written by lorakit synth into --out)")
    ap.add_argument("--out", default="bench-out/startup")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    path = args.path
    if path is None:
        path = str(Path(args.out) / "qwen3-1.7b")
        if not Path(path).exists():
            from lorakit.synth import synth_checkpoint

            synth_checkpoint(path, "qwen3-1.7b", progress=False)
    base_env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    load_before = os.getloadavg()
    tables = {}
    for d in (ROOT / "lorakit").rglob("__pycache__"):  # lorakit's own; Python's stay
        shutil.rmtree(d)
    for label, env in (("no bytecode", dict(base_env, PYTHONDONTWRITEBYTECODE="1")),
                       ("bytecode cached", base_env)):
        tables[label] = measure(commands(path), env, args.runs)
    load = (load_before, os.getloadavg())
    md = ["| modules | command | median (s) | min (s) | minus `lorakit --help` (s) | "
          "minus `python -c pass` (s) |", "|---|---|---:|---:|---:|---:|"]
    for label, rows in tables.items():
        for row in rows:
            md.append(f"| {label} | `{row['command']}` | {row['median_s']:.3f} | "
                      f"{row['min_s']:.3f} | {row['over_help_s']:+.3f} | "
                      f"{row['over_python_s']:+.3f} |")
    print("\n".join(md))
    print(f"\nCKPT = {path}; load average (1, 5, 15 min) before {load[0]}, after {load[1]}; "
          f"{args.runs} interleaved rounds")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(
            {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                         "loadavg_before": load[0], "loadavg_after": load[1]},
             "python": sys.version.split()[0], "runs": args.runs, "checkpoint": path,
             "tables": tables, "markdown": "\n".join(md)}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
