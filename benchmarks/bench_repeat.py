#!/usr/bin/env python
"""Run ``lorakit time-decode`` several times in a row and record what each run flagged.

The question (issue 13): on the embedded 5.7 MB model on CPU, does the decode-timing
table ever flag ``fused`` or ``mlx-lm-fused`` (same bytes as base), and does it show
``promoted``'s float32 weight bytes every time? Each run is a fresh
``python -m lorakit.cli.main bench ... --json`` process, exactly as a user runs it.

    python benchmarks/bench_repeat.py --runs 5 --out benchmarks/results/cpu-tiny-bench-5x.json \\
        -- --prompt-tokens 32 --tokens 32

Arguments after ``--`` go to ``lorakit time-decode`` unchanged.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def bench_once(model: str, adapter: str, extra: list) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "lorakit.cli.main", "time-decode", "--model", model,
           "--adapter-path", adapter, "--device", "cpu", "--json", "-q", *extra]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"bench failed ({out.returncode}): {out.stderr[-2000:]}")
    return {"seconds": round(time.perf_counter() - t0, 1), "table": json.loads(out.stdout)}


def summarise(table: dict) -> dict:
    """What a reader of the table sees: flagged variants, verdict words, f32 bytes."""
    rows = table["rows"]
    return {"flagged": [rows[i]["variant"] for i in table["flagged"]],
            "verdict": {r["variant"]: r.get("verdict", "") for r in rows},
            "decode x base": {r["variant"]: r.get("decode x base") for r in rows},
            "interval": {r["variant"]: r.get("95% interval") for r in rows},
            "promoted f32 bytes": next((v["weight_bytes"].get("F32", 0)
                                        for v in table["variants"]
                                        if v["variant"] == "promoted"), None)}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--model", default="data/tiny-qwen3")
    p.add_argument("--adapter-path", default="data/adapters/lora")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(own)
    runs = []
    for i in range(args.runs):
        r = bench_once(args.model, args.adapter_path, extra)
        s = summarise(r["table"])
        print(f"run {i + 1}: {r['seconds']} s, flagged {s['flagged']}, "
              f"promoted f32 {s['promoted f32 bytes']} B", flush=True)
        runs.append(dict(r, summary=s))
    result = {"command": "python benchmarks/bench_repeat.py " + " ".join(argv),
              "bench args": extra, "runs": runs,
              "load average": list(os.getloadavg())}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
