"""Every verb at real scale (issue 25): the Qwen3-1.7B shape, side by side, one run.

On the checkpoint and adapter of ``benchmarks/fuse.py`` (a random bf16 Qwen3-1.7B-shaped
checkpoint in 2 shards, a rank-8 LoRA on the last 16 layers x 7 projections, built once
by ``lorakit synth``), runs as whole processes, interleaved over rounds:

* ``cp -r`` of the checkpoint (the floor: the same bytes, no arithmetic)
* ``lorakit fuse`` (default rounding)
* ``mlx_lm fuse``
* ``lorakit fuse --rounding mlx-lm`` (must stay bit-identical to ``mlx_lm fuse``)
* ``lorakit check`` of that round's ``lorakit fuse`` (must say ok, exit 0)

The order of the four producers rotates every round; ``lorakit check`` always runs right
after the fuse it checks. ``sync`` runs before each process; each one's wall time, CPU
time (user + system) and peak RSS come from ``os.wait4`` (``benchmarks/fuse.py``'s
``run_one``). Medians over the rounds. Then ``lorakit extract --rank 8 --no-behaviour``
of the last fuse against the base (no 1.7B model to score: the checkpoint is random),
``--extract-runs`` times (1 by default; the row holds the medians), ``--skip-extract``
leaves it out.

Usage::

    .venv/bin/python benchmarks/scale.py [--runs 3] [--out bench-out] [--skip-extract]
        [--extract-runs 3]
        [--json benchmarks/results/scale.json]

Prints the issue's table (verb, wall, the ratio its target names, target, met) and
writes the JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from fuse import PY, compare, prepare, run_one  # noqa: E402

#: verb -> (what its ratio is taken against, the largest ratio that meets the target)
TARGETS = {
    "lorakit fuse": ("cp -r", 1.5),
    "lorakit fuse --rounding mlx-lm": ("mlx_lm fuse", 0.25),
    "lorakit check": ("lorakit fuse", 1.5),
}
#: extract: an absolute target (issue 40): wall <= 20 s, peak RSS < 1 GB
EXTRACT_WALL_S, EXTRACT_RSS_BYTES = 20.0, 1e9


def producers(ck: Path, ad: Path, dst: Path) -> Dict[str, List[str]]:
    common = ["--model", str(ck), "--adapter-path", str(ad), "--save-path"]
    return {
        "cp -r": ["cp", "-r", str(ck), str(dst / "cp")],
        "lorakit fuse": [PY, "-m", "lorakit", "fuse", *common, str(dst / "lorakit"), "-q"],
        "mlx_lm fuse": [PY, "-m", "mlx_lm", "fuse", *common, str(dst / "mlx_lm")],
        "lorakit fuse --rounding mlx-lm": [PY, "-m", "lorakit", "fuse", *common,
                                           str(dst / "lorakit-mlx-lm"), "--rounding",
                                           "mlx-lm", "-q"],
    }


def check_cmd(ck: Path, ad: Path, dst: Path) -> List[str]:
    return [PY, "-m", "lorakit", "check", "--save-path", str(dst / "lorakit"), "--model",
            str(ck), "--adapter-path", str(ad)]


def extract_cmd(ck: Path, dst: Path) -> List[str]:
    return [PY, "-m", "lorakit", "extract", "--base", str(ck), "--tuned", str(dst / "lorakit"),
            "--rank", "8", "--no-behaviour", "--save-path", str(dst / "extracted"), "-q"]


def rows_of(results: Dict[str, List[Tuple[float, float, float, int]]],
            extract: Optional[List[Tuple[float, float, float, int]]]) -> List[Dict[str, object]]:
    """One row per verb: medians, the ratio its target names, the target, met."""
    def med(name: str, i: int) -> float:
        return statistics.median(x[i] for x in results[name])

    rows: List[Dict[str, object]] = []
    for name in results:
        r: Dict[str, object] = {"verb": name, "wall_s": [x[0] for x in results[name]],
                                "cpu_s": [x[2] for x in results[name]],
                                "rss_bytes": [x[1] for x in results[name]],
                                "median_wall_s": med(name, 0), "median_cpu_s": med(name, 2),
                                "median_rss_bytes": med(name, 1)}
        if name in TARGETS:
            against, limit = TARGETS[name]
            ratio = med(name, 0) / med(against, 0)
            r.update(against=against, ratio=ratio, target=f"<= {limit}x {against}",
                     met=ratio <= limit)
        rows.append(r)
    if extract:  # one or more runs: the medians
        wall = statistics.median(x[0] for x in extract)
        rss = statistics.median(x[1] for x in extract)
        cpu = statistics.median(x[2] for x in extract)
        rows.append({"verb": "lorakit extract --rank 8", "wall_s": [x[0] for x in extract],
                     "cpu_s": [x[2] for x in extract], "rss_bytes": [x[1] for x in extract],
                     "median_wall_s": wall, "median_cpu_s": cpu,
                     "median_rss_bytes": rss, "against": None, "ratio": None,
                     "target": f"<= {EXTRACT_WALL_S:.0f} s, peak RSS < 1 GB",
                     "met": wall <= EXTRACT_WALL_S and rss < EXTRACT_RSS_BYTES})
    return rows


def ratio_cell(r: Dict[str, object]) -> str:
    return "" if r.get("ratio") is None else f"{r['ratio']:.2f}x {r['against']}"


def met_cell(r: Dict[str, object]) -> str:
    return "" if "met" not in r else ("met" if r["met"] else "not met")


def markdown(rows: List[Dict[str, object]]) -> str:
    out = ["| verb | median wall (s) | runs (s) | median CPU (s) | median peak RSS (GB) "
           "| ratio | target | met |", "|---|---:|---|---:|---:|---:|---|---|"]
    for r in rows:
        out.append(f"| `{r['verb']}` | {r['median_wall_s']:.1f} | "
                   f"{', '.join(f'{w:.1f}' for w in r['wall_s'])} | "  # type: ignore[union-attr]
                   f"{r['median_cpu_s']:.1f} | {r['median_rss_bytes'] / 1e9:.2f} | "  # type: ignore[operator]
                   f"{ratio_cell(r)} | {r.get('target', '')} | {met_cell(r)} |")
    return "\n".join(out)


def run_extract(ck: Path, dst: Path, log: Path, runs: int
                ) -> List[Tuple[float, float, float, int]]:
    """``lorakit extract`` ``runs`` times in a row, each a whole process."""
    out = []
    for k in range(runs):
        shutil.rmtree(dst / "extracted", ignore_errors=True)
        x = run_one(extract_cmd(ck, dst), log)
        print(f"extract {k + 1}: {x[0]:7.2f} s  cpu {x[2]:6.2f} s  {x[1] / 1e9:6.3f} GB",
              flush=True)
        out.append(x)
    return out


def extract_only(ck: Path, dst: Path, fuse: List[str], log: Path,
                 json_path: Optional[str], runs: int) -> int:
    """Time ``lorakit extract`` of a fresh fuse; add its row to an earlier run's JSON."""
    run_one(fuse, log)
    load_start = os.getloadavg()
    extract = run_extract(ck, dst, log, runs)
    row = rows_of({}, extract)[0]
    row["loadavg"] = [load_start, os.getloadavg()]
    if json_path:
        p = Path(json_path)
        report = json.loads(p.read_text()) if p.exists() else {"rows": []}
        report["rows"] = [r for r in report["rows"] if r["verb"] != row["verb"]] + [row]
        report["extract_skipped"] = False
        report["markdown"] = markdown(report["rows"])
        p.write_text(json.dumps(report, indent=2))
        print("\n" + report["markdown"] + "\n")
    shutil.rmtree(dst, ignore_errors=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench-out"), help="cache and output folder")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--skip-extract", action="store_true", help="leave lorakit extract out")
    ap.add_argument("--extract-only", action="store_true",
                    help="fuse once (untimed), time lorakit extract alone and add its row to "
                         "the --json of an earlier run (its other rows are kept)")
    ap.add_argument("--extract-runs", type=int, default=1,
                    help="runs of lorakit extract, one after another (the row: their medians)")
    ap.add_argument("--json", default=None,
                    help="also write the results here (benchmarks/results/scale.json)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ck, ad = prepare(out)
    load_start = os.getloadavg()
    dst = out / "scale-runs"
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir()
    log = out / "scale.log"
    log.write_text("")
    cmds = producers(ck, ad, dst)
    if args.extract_only:
        return extract_only(ck, dst, cmds["lorakit fuse"], log, args.json, args.extract_runs)
    names = list(cmds)
    results: Dict[str, List[Tuple[float, float, float, int]]] = {
        n: [] for n in [*names, "lorakit check"]}
    checks: Dict[str, object] = {}
    for r in range(args.runs):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            todo = [(name, cmds[name])]
            if name == "lorakit fuse":
                todo.append(("lorakit check", check_cmd(ck, ad, dst)))
            for verb, cmd in todo:
                res = run_one(cmd, log)  # exits non-zero (check: not ok) -> SystemExit
                results[verb].append(res)
                print(f"run {r + 1}: {verb:<32} {res[0]:7.2f} s  cpu {res[2]:6.2f} s  "
                      f"{res[1] / 1e9:6.3f} GB", flush=True)
        if r == 0:
            checks["lorakit mlx-lm vs mlx_lm fuse"] = compare(dst / "lorakit-mlx-lm",
                                                              dst / "mlx_lm")
        if r < args.runs - 1:
            for p in dst.iterdir():
                shutil.rmtree(p)
    extract = None
    if not args.skip_extract:
        extract = run_extract(ck, dst, log, args.extract_runs)
    rows = rows_of(results, extract)
    table = markdown(rows)
    print("\n" + table + "\n")
    ident = checks["lorakit mlx-lm vs mlx_lm fuse"]["identical"]  # type: ignore[index]
    print(f"bit-identical (lorakit --rounding mlx-lm vs mlx_lm fuse): {ident}")
    report = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                          "loadavg_at_start": load_start, "loadavg_at_end": os.getloadavg()},
              "checkpoint": str(ck), "adapter": str(ad), "runs": args.runs,
              "extract_skipped": args.skip_extract, "rows": rows, "checks": checks,
              "markdown": table}
    (out / "scale.json").write_text(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"load average at start {load_start}, at end {os.getloadavg()}")
    shutil.rmtree(dst, ignore_errors=True)
    return 0 if ident else 1


if __name__ == "__main__":
    raise SystemExit(main())
