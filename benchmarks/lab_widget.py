"""AdapterLab's slider-to-redraw time in a real JupyterLab (headless Chromium): runs
tests/browser/test_lab_redraw.py (notebook 09, one heatmap click, ten slider moves of
0.1, each timed in the page from the key press to the redraw of the current-text pane)
``--repeats`` times and keeps every run's times, the median of each run's ten moves, and
the machine's load.

  python benchmarks/lab_widget.py --repeats 1 --out benchmarks/results/lab_widget.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMES = ROOT / "test-artifacts" / "adapter-lab-redraw.json"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out")
    a = p.parse_args(argv)
    runs = []
    for _ in range(a.repeats):
        TIMES.unlink(missing_ok=True)
        load = os.getloadavg()[0]
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m",
                        "browser", "tests/browser/test_lab_redraw.py"], cwd=ROOT, check=True)
        runs.append({**json.loads(TIMES.read_text()), "load_before": load,
                     "load_after": os.getloadavg()[0]})
    out = {"command": "python benchmarks/lab_widget.py " + " ".join(argv or sys.argv[1:]),
           "model": "data/tiny-qwen3", "adapter": "data/adapters/lora",
           "median_s": statistics.median(r["median_s"] for r in runs), "runs": runs,
           "cpus": os.cpu_count(), "platform": platform.platform(),
           "python": platform.python_version()}
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
