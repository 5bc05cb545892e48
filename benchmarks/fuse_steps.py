"""Each fuse optimisation's effect: ``lorakit fuse`` at several commits, side by side
with ``cp -r`` and ``mlx_lm fuse``, in the same run.

Every commit is exported (``git archive``) into a temporary folder and run from there
(``PYTHONPATH``), as a whole process, on the checkpoint and adapter that
``benchmarks/fuse.py`` builds. The order rotates every round (interleaved); ``sync``
before each process; medians of wall time, CPU (user + system) and peak RSS. Usage::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/fuse_steps.py --runs 2 \\
        --out bench-out --json benchmarks/results/fuse_steps.json \\
        --step before=170fa46 --step writes=ff0e8a9 --step mlx-load=83c237d

Each step runs in both roundings (``mlx-lm`` and the default ``nearest``) unless
``--rounding`` names one.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from fuse import prepare  # noqa: E402

PY = sys.executable


def export(commit: str, where: Path) -> Path:
    """The commit's tree (git holds the C extensions' sources only: see
    :func:`build_extensions`)."""
    where.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    return where


def build_extensions(tree: Path) -> List[str]:
    """Build the tree's C extensions (``lorakit/**/_*kernel.c``) in place, as pip does
    where a compiler is found; their module names. Run from an empty folder: setuptools then ignores pyproject.toml."""
    built = []
    for src in sorted(tree.glob("lorakit/**/_*kernel.c")):
        mod = ".".join(src.relative_to(tree).with_suffix("").parts)
        code = ("from setuptools import setup, Extension; setup(script_args=['build_ext', "
                f"'--build-lib', {str(tree)!r}], ext_modules=[Extension({mod!r}, "
                f"[{str(src)!r}], include_dirs=[{str(tree / 'lorakit')!r}], "
                "extra_compile_args=['-O3', '-ffp-contract=off'])])")
        with tempfile.TemporaryDirectory(prefix="lorakit-build-") as cwd:
            subprocess.run([PY, "-c", code], cwd=cwd, check=True, capture_output=True)
        built.append(mod)
    return built


def run_one(cmd: List[str], env: Dict[str, str]) -> Tuple[float, float, float]:
    """(wall seconds, CPU seconds, peak RSS bytes) of one whole process."""
    os.sync()
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{p.stderr.read().decode()[-2000:]}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench-out"))
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--step", action="append", default=[], metavar="NAME=COMMIT")
    ap.add_argument("--rounding", choices=("mlx-lm", "nearest"), action="append")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = Path(args.out)
    ck, ad = prepare(out)
    dst = out / "fuse-steps"
    roundings = args.rounding or ["mlx-lm", "nearest"]
    with tempfile.TemporaryDirectory(prefix="lorakit-steps-") as tmp:
        cmds: Dict[str, Tuple[List[str], Dict[str, str]]] = {
            "cp -r": (["cp", "-r", str(ck), "{dst}"], dict(os.environ)),
            "mlx_lm fuse": ([PY, "-m", "mlx_lm", "fuse", "--model", str(ck), "--adapter-path",
                             str(ad), "--save-path", "{dst}"], dict(os.environ))}
        for step in args.step:
            name, commit = step.split("=", 1)
            tree = export(commit, Path(tmp) / name)
            print(f"{name} ({commit}): built {', '.join(build_extensions(tree)) or 'no C kernel'}",
                  flush=True)
            env = dict(os.environ, PYTHONPATH=str(tree))
            for r in roundings:
                cmds[f"{name} ({commit}), {r}"] = (
                    [PY, "-m", "lorakit", "fuse", "--model", str(ck), "--adapter-path", str(ad),
                     "--save-path", "{dst}", "--rounding", r, "-q"], env)
        names = list(cmds)
        res: Dict[str, List[Tuple[float, float, float]]] = {n: [] for n in names}
        load_start = os.getloadavg()
        for k in range(args.runs):
            for n in names[k % len(names):] + names[:k % len(names)]:
                shutil.rmtree(dst, ignore_errors=True)
                cmd, env = cmds[n]
                res[n].append(run_one([c.replace("{dst}", str(dst)) for c in cmd], env))
                print(f"run {k + 1}: {n:<40} {res[n][-1][0]:7.2f} s  cpu {res[n][-1][1]:6.2f} s  "
                      f"{res[n][-1][2] / 1e9:5.2f} GB", flush=True)
        shutil.rmtree(dst, ignore_errors=True)
    med = {n: [statistics.median(x[i] for x in res[n]) for i in range(3)] for n in names}
    table = ["| step | median wall (s) | CPU (s) | peak RSS (GB) | wall vs mlx_lm fuse | "
             "RSS vs mlx_lm fuse | wall vs cp -r |", "|---|---:|---:|---:|---:|---:|---:|"]
    for n in names:
        w, c, m = med[n]
        table.append(f"| `{n}` | {w:.1f} | {c:.1f} | {m / 1e9:.2f} | "
                     f"{w / med['mlx_lm fuse'][0]:.2f}x | {m / med['mlx_lm fuse'][2]:.2f}x | "
                     f"{w / med['cp -r'][0]:.2f}x |")
    print("\n".join(table))
    load_end = os.getloadavg()
    print(f"load average at start {load_start}, at end {load_end}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"runs": args.runs, "loadavg_at_start": load_start, "loadavg_at_end": load_end,
             "results": {n: {"wall_s": [x[0] for x in res[n]], "cpu_s": [x[1] for x in res[n]],
                             "rss_bytes": [x[2] for x in res[n]]} for n in names},
             "markdown": "\n".join(table)}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
