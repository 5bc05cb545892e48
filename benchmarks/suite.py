"""The test suite's own time on this machine (issue 25): the fast tier, the whole suite,
and the whole suite on a fresh clone as CI runs it.

Each run is a whole process forked from a small launcher (``benchmarks/fuse.py``'s
``launch``: wall, CPU user + system, from ``os.wait4``), its output kept in a log; the
last line pytest prints gives the counts and pytest's own seconds. Rows:

* ``bash tools/test-fast.sh``: the fast tier (``-m "not slow"``), ``--fast-runs`` times;
* ``bash tools/test.sh``: every test, ``--full-runs`` times (in this checkout, its
  ``.venv`` as it is);
* ``CI=true bash .ci/run`` on a fresh ``git clone`` of this checkout's HEAD in a
  temporary directory (``--fresh-clone``): what CI runs, its setup (a new ``.venv``,
  packages from the registry) included; removed afterwards.

Targets (issue 25): the fast tier <= 45 s, the whole suite <= 8 minutes; medians over
the runs. A run whose tests do not all pass fails the benchmark.

Usage::

    .venv/bin/python benchmarks/suite.py --fast-runs 3 --full-runs 1 --fresh-clone \\
        --json benchmarks/results/suite.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from fuse import launch  # noqa: E402

#: row -> (the largest median wall in seconds that meets the target, its words)
TARGETS = {
    "bash tools/test-fast.sh": (45.0, "<= 45 s"),
    "bash tools/test.sh": (480.0, "<= 8 min"),
    "CI=true bash .ci/run (fresh clone)": (480.0, "<= 8 min"),
}
_SUMMARY = re.compile(r"^=*\s*(?P<line>\d+ (passed|failed)\b.*? in (?P<secs>[\d.]+)s\b.*?)\s*=*$")


def _counts(log: Path) -> Dict[str, object]:
    """pytest's last summary line in ``log``: its counts and its own seconds."""
    found = [m for m in map(_SUMMARY.match, log.read_text(errors="replace").splitlines()) if m]
    if not found:
        raise SystemExit(f"no pytest summary line in {log}")
    line = found[-1]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)",
                                                line.group("line"))}
    return {"summary": line.group("line"), "pytest_s": float(line.group("secs")), **counts}


def _run(cmd: List[str], cwd: Path, log: Path, env: Optional[Dict[str, str]] = None
         ) -> Dict[str, object]:
    with open(log, "wb") as f:
        r = launch(cmd, stdout=f, env=env, cwd=cwd)
    c = _counts(log)
    if r["rc"] != 0 or c.get("failed") or c.get("error") or c.get("errors"):
        raise SystemExit(f"{' '.join(cmd)} failed (exit {r['rc']}): {c['summary']}; see {log}")
    return {"wall_s": r["wall_s"], "cpu_s": r["user_s"] + r["system_s"], **c}


def _row(name: str, runs: List[Dict[str, object]]) -> Dict[str, object]:
    limit, words = TARGETS[name]
    med = statistics.median(float(r["wall_s"]) for r in runs)
    return {"suite": name, "runs": runs, "median_wall_s": med,
            "passed": runs[-1].get("passed", 0), "skipped": runs[-1].get("skipped", 0),
            "target": words, "met": med <= limit}


def markdown(d: Dict[str, object]) -> str:
    lines = ["| suite | median wall (s) | runs (s) | pytest's own (s) | passed | skipped "
             "| target | met |", "|---|---:|---|---|---:|---:|---|---|"]
    for r in d["rows"]:
        runs = ", ".join(f"{x['wall_s']:.1f}" for x in r["runs"])
        own = ", ".join(f"{x['pytest_s']:.1f}" for x in r["runs"])
        lines.append(f"| `{r['suite']}` | {r['median_wall_s']:.1f} | {runs} | {own} | "
                     f"{r['passed']} | {r['skipped']} | {r['target']} | "
                     f"{'met' if r['met'] else 'not met'} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fast-runs", type=int, default=3)
    ap.add_argument("--full-runs", type=int, default=1)
    ap.add_argument("--fresh-clone", action="store_true",
                    help="also time CI=true bash .ci/run on a fresh clone of HEAD")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    head = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                   text=True).strip()
    rows, load = [], [list(os.getloadavg())]
    with tempfile.TemporaryDirectory(prefix="lorakit-suite-") as tmp:
        logs = Path(tmp)
        for name, cmd, n in (("bash tools/test-fast.sh", ["bash", "tools/test-fast.sh"],
                              a.fast_runs),
                             ("bash tools/test.sh", ["bash", "tools/test.sh"], a.full_runs)):
            runs = []
            for k in range(n):
                runs.append(_run(cmd, ROOT, logs / f"{cmd[1].split('/')[-1]}.{k}.log"))
                print(f"{name}: {runs[-1]['wall_s']:.1f} s, {runs[-1]['summary']}", flush=True)
            if runs:
                rows.append(_row(name, runs))
        if a.fresh_clone:
            clone = logs / "clone"
            subprocess.check_call(["git", "clone", "-q", str(ROOT), str(clone)])
            env = dict(os.environ, CI="true")
            r = _run(["bash", ".ci/run"], clone, logs / "ci.log", env=env)
            print(f"fresh clone: {r['wall_s']:.1f} s, {r['summary']}", flush=True)
            rows.append(_row("CI=true bash .ci/run (fresh clone)", [r]))
    load.append(list(os.getloadavg()))
    d = {"what": "the test suite's wall time on this machine (benchmarks/suite.py)",
         "commit": head, "cpus": os.cpu_count(), "platform": platform.platform(),
         "python": platform.python_version(), "loadavg": load,
         "workers": os.environ.get("LORAKIT_TEST_WORKERS", "auto"), "rows": rows}
    d["markdown"] = markdown(d)
    print(d["markdown"])
    if a.json:
        a.json.write_text(json.dumps(d, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
