"""Fuse a Qwen3-1.7B-shaped checkpoint: ``mlx_lm fuse`` vs ``lorakit fuse``, side by side.

Builds (or reuses, in ``bench-out/``) a random bf16 checkpoint with Qwen3-1.7B's
shapes in 2 shards and a rank-8 f32 LoRA adapter on the last 16 layers x 7
projections (``lorakit synth``), then runs, as whole processes, several rounds of:

* ``mlx_lm fuse``
* ``lorakit fuse --rounding mlx-lm`` (bit-identical to mlx_lm fuse)
* ``lorakit fuse`` (default rounding: nearest, correctly rounded)
* ``cp -r`` of the checkpoint (the floor: the same bytes, no arithmetic)

The order rotates every round, so no tool always runs on a warmer cache. Each
process's wall time, peak RSS (``os.wait4``'s ``ru_maxrss``, taken by a small launcher)
and CPU time (user + system, less sensitive than wall time to other jobs on a shared
machine) are recorded; the medians are reported with ratios against mlx_lm. The first round's outputs are
compared tensor by tensor: lorakit's mlx-lm mode must equal mlx_lm fuse byte for
byte, under the same names. ``sync`` runs before each process so one tool's
unwritten pages do not slow the next.

Usage::

    .venv/bin/python benchmarks/fuse.py [--runs 3] [--out bench-out] [--profile]

Prints a markdown table and writes ``bench-out/fuse.json``.
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
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


from lorakit.io.formats.checkpoint import Checkpoint  # noqa: E402
from lorakit.synth import synth_adapter, synth_checkpoint  # noqa: E402

PY = sys.executable
_BLOCK = 64 << 20


def prepare(out: Path) -> Tuple[Path, Path]:
    """The checkpoint and adapter, built once and reused (seed 0: same bytes every time)."""
    ck, ad = out / "qwen3-1.7b", out / "qwen3-1.7b-lora-r8"
    try:
        ok = len(Checkpoint(ck).shards) == 2
    except Exception:
        ok = False
    if not ok:
        print(f"building {ck} ...", flush=True)
        synth_checkpoint(ck, "qwen3-1.7b", shard_size="2GB", force=True)
    if not (ad / "adapters.safetensors").exists():
        synth_adapter(ad, ck, rank=8, layers=16, force=True)
    return ck, ad


def commands(ck: Path, ad: Path, dst: Path) -> Dict[str, List[str]]:
    common = ["--model", str(ck), "--adapter-path", str(ad), "--save-path"]
    return {
        "mlx_lm fuse": [PY, "-m", "mlx_lm", "fuse", *common, str(dst / "mlx_lm")],
        "lorakit fuse --rounding mlx-lm": [PY, "-m", "lorakit", "fuse", *common,
                                           str(dst / "lorakit-mlx-lm"), "--rounding", "mlx-lm",
                                           "-q"],
        "lorakit fuse (nearest)": [PY, "-m", "lorakit", "fuse", *common,
                                   str(dst / "lorakit-nearest"), "-q"],
        "cp -r": ["cp", "-r", str(ck), str(dst / "cp")],
    }


#: the launcher each measured command runs under: a small process that forks and execs
#: it and reports the child's ``os.wait4`` figures. Linux keeps the larger of a child's
#: peak RSS and that of the process image it replaced at ``exec``, so a command forked
#: straight from this (large) process would report at least this process's RSS
#: (``cp -r`` "used" 270 MB that way); forked from the launcher, the floor is the
#: launcher's ~7 MB.
_LAUNCHER = r"""
import os, sys, time
t0 = time.perf_counter()
pid = os.fork()
if pid == 0:
    try:
        os.execvp(sys.argv[2], sys.argv[2:])
    finally:
        os._exit(127)
_, status, u = os.wait4(pid, 0)
wall = time.perf_counter() - t0
with open(sys.argv[1], "w") as f:
    f.write(f"{wall!r} {u.ru_maxrss} {u.ru_utime!r} {u.ru_stime!r} {u.ru_minflt}")
sys.exit(os.waitstatus_to_exitcode(status))
"""


def launch(cmd: List[str], stdout=None, env: Optional[Dict[str, str]] = None,
           cwd: Optional[Path] = None) -> Dict[str, float]:
    """Run ``cmd`` as a whole process forked from a small launcher (``_LAUNCHER``: the peak
    RSS is the command's own, not this process's); its exit code, wall seconds, peak RSS
    in bytes, user and system CPU seconds and minor page faults."""
    with tempfile.TemporaryDirectory(prefix="lorakit-bench-") as tmp:
        figures = Path(tmp) / "rusage"
        rc = subprocess.call([PY, "-S", "-c", _LAUNCHER, str(figures), *cmd], stdout=stdout,
                             stderr=subprocess.STDOUT if stdout is not None else None, env=env,
                             cwd=cwd)
        wall, maxrss, user, system, minflt = figures.read_text().split()
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KB on Linux
    return {"rc": rc, "wall_s": float(wall), "peak_rss_bytes": int(maxrss) * scale,
            "user_s": float(user), "system_s": float(system), "minflt": int(minflt)}


def run_one(cmd: List[str], log: Path) -> Tuple[float, float, float, int]:
    """(wall seconds, peak RSS in bytes, CPU seconds (user + system), minor page faults)
    of one whole process (:func:`launch`); ``sync`` first."""
    os.sync()
    with open(log, "ab") as f:
        f.write(("$ " + " ".join(cmd) + "\n").encode())
        f.flush()
        r = launch(cmd, stdout=f)
    if r["rc"] != 0:
        raise SystemExit(f"command failed ({r['rc']}), see {log}: {' '.join(cmd)}")
    return r["wall_s"], r["peak_rss_bytes"], r["user_s"] + r["system_s"], r["minflt"]


def _same_bytes(a, b) -> bool:
    with open(a.file, "rb") as fa, open(b.file, "rb") as fb:
        fa.seek(a.begin)
        fb.seek(b.begin)
        left = a.nbytes
        while left:
            n = min(_BLOCK, left)
            if fa.read(n) != fb.read(n):
                return False
            left -= n
    return True


def compare(a_dir: Path, b_dir: Path) -> Dict[str, object]:
    """Tensor-by-tensor raw comparison of two checkpoints."""
    a, b = Checkpoint(a_dir), Checkpoint(b_dir)
    only_a = sorted(set(a.tensors) - set(b.tensors))
    only_b = sorted(set(b.tensors) - set(a.tensors))
    differ = []
    for name in sorted(set(a.tensors) & set(b.tensors)):
        ta, tb = a.tensors[name], b.tensors[name]
        if ta.dtype != tb.dtype or ta.shape != tb.shape or not _same_bytes(ta, tb):
            differ.append(name)
    return {"identical": not (only_a or only_b or differ), "tensors": len(a.tensors),
            "only_in_first": only_a[:5], "only_in_second": only_b[:5],
            "differing": len(differ), "first_differing": differ[:5],
            "dtypes_first": dict(sorted(_dtypes(a).items())),
            "dtypes_second": dict(sorted(_dtypes(b).items()))}


def _dtypes(ck: Checkpoint) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for t in ck.tensors.values():
        out[t.dtype] = out.get(t.dtype, 0) + 1
    return out


def profile(ck: Path, ad: Path, dst: Path, out: Path) -> str:
    """Where ``lorakit fuse`` spends its time, all threads included.

    Uses py-spy (``py-spy`` on PATH or ``$PY_SPY``; ``pip install py-spy``) sampling
    every thread; falls back to cProfile, which sees only the main thread (the
    fusion work runs in worker threads, so it then shows as lock waits).
    """
    spy = os.environ.get("PY_SPY") or shutil.which("py-spy")
    lines = []
    for tag, extra in (("mlx-lm", ["--rounding", "mlx-lm"]), ("nearest", [])):
        target = dst / f"profile-{tag}"
        shutil.rmtree(target, ignore_errors=True)
        fuse_cmd = ["-m", "lorakit", "fuse", "--model", str(ck), "--adapter-path", str(ad),
                    "--save-path", str(target), "-q", *extra]
        os.sync()
        if spy:
            raw = out / f"lorakit-fuse-{tag}.pyspy.txt"
            subprocess.run([spy, "record", "-r", "50", "-f", "raw", "-o", str(raw), "--", PY,
                            *fuse_cmd], check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
            lines.append(f"lorakit fuse ({tag}), py-spy, share of samples "
                         f"(all threads) by innermost lorakit/numpy/mlx frame:")
            lines += _spy_summary(raw)
        else:
            import pstats

            prof = out / f"lorakit-fuse-{tag}.prof"
            subprocess.run([PY, "-m", "cProfile", "-o", str(prof), *fuse_cmd], check=True,
                           stdout=subprocess.DEVNULL)
            st = pstats.Stats(str(prof))
            rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:12]  # by own time
            lines.append(f"lorakit fuse ({tag}), cProfile (main thread only), by own time:")
            for (file, line, fn), (_, _, tt, ct, _) in rows:
                lines.append(f"  {tt:7.2f} s own  {ct:7.2f} s cum  {Path(file).name}:{line} {fn}")
        shutil.rmtree(target, ignore_errors=True)
    return "\n".join(lines)


def _spy_summary(raw: Path, top: int = 10) -> List[str]:
    """Aggregate py-spy raw stacks by the innermost frame of interest."""
    from collections import Counter

    c: Counter = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        total += int(n)
        frames = stack.split(";")
        pick = frames[-1]
        for f in reversed(frames):
            if "lorakit" in f or "shutil" in f:
                pick = f
                break
        c[pick.split(" (")[0] + " (" + pick.rsplit("/", 1)[-1] if "/" in pick else pick] += int(n)
    return [f"  {n / total:6.1%}  {k}" for k, n in c.most_common(top)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench-out"), help="cache and output folder")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="also cProfile lorakit fuse")
    ap.add_argument("--json", default=None,
                    help="also write the results here (e.g. benchmarks/results/fuse.json)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ck, ad = prepare(out)
    load_start = os.getloadavg()
    dst = out / "fuse-runs"
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir()
    log = out / "fuse.log"
    log.write_text("")
    cmds = commands(ck, ad, dst)
    names = list(cmds)
    results: Dict[str, List[Tuple[float, float, float, int]]] = {n: [] for n in names}
    checks: Dict[str, object] = {}
    for r in range(args.runs):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            wall, rss, cpu, faults = run_one(cmds[name], log)
            results[name].append((wall, rss, cpu, faults))
            print(f"run {r + 1}: {name:<32} {wall:7.2f} s  {rss / 1e9:6.3f} GB  "
                  f"cpu {cpu:6.2f} s  {faults} minor faults", flush=True)
        if r == 0:
            checks["lorakit mlx-lm vs mlx_lm fuse"] = compare(dst / "lorakit-mlx-lm",
                                                              dst / "mlx_lm")
            checks["lorakit nearest vs mlx_lm fuse"] = compare(dst / "lorakit-nearest",
                                                               dst / "mlx_lm")
            checks["nearest vs mlx-lm rounding, elements"] = _count_elements(
                dst / "lorakit-nearest", dst / "lorakit-mlx-lm", ck, ad)
        for p in dst.iterdir():
            shutil.rmtree(p)
    def med(name: str, i: int) -> float:
        return statistics.median(x[i] for x in results[name])

    rows = []
    for name in names:
        rows.append({"command": name, "wall_s": [x[0] for x in results[name]],
                     "rss_bytes": [x[1] for x in results[name]],
                     "cpu_s": [x[2] for x in results[name]],
                     "minor_faults": [x[3] for x in results[name]],
                     "median_wall_s": med(name, 0), "median_rss_bytes": med(name, 1),
                     "median_cpu_s": med(name, 2),
                     "wall_vs_mlx_lm": med(name, 0) / med("mlx_lm fuse", 0),
                     "wall_vs_cp": med(name, 0) / med("cp -r", 0),
                     "rss_vs_mlx_lm": med(name, 1) / med("mlx_lm fuse", 1),
                     "cpu_vs_mlx_lm": med(name, 2) / med("mlx_lm fuse", 2)})
    table = ["| command | median wall (s) | runs (s) | wall vs mlx_lm | wall vs cp -r "
             "| median peak RSS (GB) | RSS vs mlx_lm | median CPU user+sys (s) | CPU vs mlx_lm |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        table.append(f"| `{row['command']}` | {row['median_wall_s']:.1f} | "
                     f"{', '.join(f'{w:.1f}' for w in row['wall_s'])} | "
                     f"{row['wall_vs_mlx_lm']:.2f}x | {row['wall_vs_cp']:.2f}x | "
                     f"{row['median_rss_bytes'] / 1e9:.2f} | "
                     f"{row['rss_vs_mlx_lm']:.2f}x | {row['median_cpu_s']:.1f} | "
                     f"{row['cpu_vs_mlx_lm']:.2f}x |")
    print("\n" + "\n".join(table) + "\n")
    for k, v in checks.items():
        print(f"{k}: {json.dumps(v)}")
    report = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                          "loadavg_at_start": load_start, "loadavg_at_end": os.getloadavg()},
              "checkpoint": str(ck), "adapter": str(ad), "runs": args.runs, "rows": rows,
              "checks": checks, "markdown": "\n".join(table)}
    if args.profile:
        report["profile"] = profile(ck, ad, dst, out)
        print("\n" + report["profile"])
    (out / "fuse.json").write_text(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"load average at start {load_start}, at end {os.getloadavg()}")
    shutil.rmtree(dst, ignore_errors=True)
    ident = checks["lorakit mlx-lm vs mlx_lm fuse"]["identical"]  # type: ignore[index]
    print(f"\nbit-identical (lorakit --rounding mlx-lm vs mlx_lm fuse): {ident}")
    return 0 if ident else 1


def _count_elements(a_dir: Path, b_dir: Path, base_dir: Path, adapter: Path) -> Dict[str, float]:
    """How many fused elements two roundings disagree on, and how many the fuse changed."""
    from lorakit.io.adapters.load import load_adapter
    from lorakit.io.adapters.naming import bind

    a, b, base = Checkpoint(a_dir), Checkpoint(b_dir), Checkpoint(base_dir)
    fused = sorted({x.tensor for x in bind(load_adapter(adapter), base)})
    diff = total = changed = 0
    for name in fused:
        ra, rb, r0 = a.read(name), b.read(name), base.read(name)
        total += ra.size
        diff += int((ra != rb).sum())
        changed += int((rb != r0).sum())
    return {"fused_tensors": len(fused), "fused_elements": total, "differing": diff,
            "fraction_differing": diff / total if total else 0.0,
            "fraction_changed_by_fuse": changed / total if total else 0.0}


if __name__ == "__main__":
    raise SystemExit(main())
