"""The C kernels' worth: each verb a kernel serves, with kernels on and off (``LORAKIT_KERNELS=0``).

On a random bf16 Qwen3-1.7B-shaped checkpoint (``lorakit synth``; ``--layers N`` keeps the
same per-tensor shapes with N layers, the adapter on all of them up to 16) and a rank-8
LoRA on the last 16 layers x 7 projections, runs as whole processes, interleaved over
rounds (the kernels-on and -off runs of one verb back to back, their order alternating):

* ``lorakit fuse`` (nearest, the default): its kernel ``_fusekernel.c`` was removed after
  this script measured it under 3x (BENCHMARKS.md, "C kernels"); the row stays as a check
* ``lorakit check`` of that fuse: ``lorakit/inspect/_checkkernel.c``
* ``lorakit diff`` of the base against that fuse: ``lorakit/inspect/_ulpkernel.c``

Each figure is the median wall time over the rounds (``os.wait4`` through
``benchmarks/fuse.py``'s ``launch``; ``sync`` before each); a kernel stays where its verb is >= 3x faster.

Usage::

    .venv/bin/python benchmarks/kernels.py [--runs 3] [--layers 28] [--out bench-out]
        [--json benchmarks/results/kernels.json]
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
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from fuse import PY, launch, run_one  # noqa: E402

from lorakit.synth import synth_adapter, synth_checkpoint  # noqa: E402

#: the line a kernel must pass: its verb this many times faster with it
NEEDED = 3.0


def prepare(out: Path, layers: int):
    ck, ad = out / f"qwen3-1.7b-{layers}l", out / f"qwen3-1.7b-{layers}l-lora-r8"
    if not (ck / "config.json").exists():
        synth_checkpoint(ck, "qwen3-1.7b", shard_size="2GB", force=True,
                         overrides={"num_hidden_layers": layers})
    if not (ad / "adapters.safetensors").exists():
        synth_adapter(ad, ck, rank=8, layers=min(16, layers), force=True)
    return ck, ad


def verbs(ck: Path, ad: Path, out: Path) -> Dict[str, List[str]]:
    fused = out / "fused"  # the kernels-on fuse (same bits either way): checked and diffed
    return {
        "lorakit fuse": [PY, "-m", "lorakit", "fuse", "--model", str(ck), "--adapter-path",
                         str(ad), "--save-path", str(out / "fused-{k}"), "-q"],
        "lorakit check": [PY, "-m", "lorakit", "check", "--save-path", str(fused), "--model",
                          str(ck), "--adapter-path", str(ad)],
        "lorakit diff": [PY, "-m", "lorakit", "diff", str(ck), str(fused)],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--layers", type=int, default=28, help="28 is Qwen3-1.7B's")
    ap.add_argument("--out", type=Path, default=ROOT / "bench-out")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    ck, ad = prepare(args.out, args.layers)
    work = args.out / "kernels"
    work.mkdir(parents=True, exist_ok=True)
    cmds = verbs(ck, ad, work)
    on_env = {k: v for k, v in os.environ.items() if k != "LORAKIT_KERNELS"}
    envs = {"on": on_env, "off": dict(on_env, LORAKIT_KERNELS="0")}
    times: Dict[str, Dict[str, List[float]]] = {v: {"on": [], "off": []} for v in cmds}
    fuse0 = [a.replace("fused-{k}", "fused") for a in cmds["lorakit fuse"]]
    shutil.rmtree(work / "fused", ignore_errors=True)
    run_one(fuse0, work / "prep.log")  # the fuse that check and diff read
    for r in range(args.runs):
        for verb, cmd in cmds.items():
            for k in (("on", "off") if r % 2 == 0 else ("off", "on")):
                c = [a.replace("{k}", k) for a in cmd]
                shutil.rmtree(work / f"fused-{k}", ignore_errors=True)
                old = dict(os.environ)
                os.environ.clear()
                os.environ.update(envs[k])
                try:
                    os.sync()
                    with open(work / f"{verb.split()[1]}-{k}.log", "ab") as log:
                        res = launch(c, stdout=log)
                finally:
                    os.environ.clear()
                    os.environ.update(old)
                if res["rc"] not in ((0, 1) if verb == "lorakit diff" else (0,)):  # 1: differ
                    raise SystemExit(f"{' '.join(c)} failed ({res['rc']})")
                times[verb][k].append(res["wall_s"])
                print(f"round {r + 1} {verb} kernels {k}: {res['wall_s']:.2f} s", flush=True)
    rows = []
    for verb, t in times.items():
        on, off = statistics.median(t["on"]), statistics.median(t["off"])
        rows.append({"verb": verb, "kernels_on_s": on, "kernels_off_s": off,
                     "speedup": off / on, "keeps_kernel": off / on >= NEEDED,
                     "runs_on_s": t["on"], "runs_off_s": t["off"]})
    print("| verb | kernels on (s) | LORAKIT_KERNELS=0 (s) | speedup | kernel stays (>= 3x) |")
    print("|---|---:|---:|---:|---|")
    for row in rows:
        print(f"| `{row['verb']}` | {row['kernels_on_s']:.2f} | {row['kernels_off_s']:.2f} | "
              f"{row['speedup']:.2f}x | {'yes' if row['keeps_kernel'] else 'no'} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "layers": args.layers, "runs": args.runs, "rows": rows,
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                        "load_average": os.getloadavg()}}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
