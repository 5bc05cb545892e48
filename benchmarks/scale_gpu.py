"""The verbs around the fuse at the Qwen3-8B shape on a GPU (MLX CUDA or Metal).

Writes a random bf16 checkpoint of Qwen3-8B's shape and a rank-8 LoRA on the last 16
layers x 7 projections (``lorakit synth``), then times, each as a whole process
(wall, CPU user+sys and peak RSS from ``os.wait4``), in this order:

* ``cp -r`` of the checkpoint (the floor for anything that reads and writes it);
* ``lorakit fuse`` (nearest, the default);
* ``lorakit check`` of that fuse;
* ``lorakit extract --rank 8 --no-behaviour`` of the fused checkpoint against the base,
  and the share of adapted elements a re-fuse of the extracted adapter gives back bit
  for bit (the report's own count);
* ``lorakit compare-outputs`` of the fused model against base + adapter (unfused) on
  the embedded corpus.

``sync`` and a drop of nothing else before each; one run each (the figures are for
scale, the CPU ratios live in ``benchmarks/scale.py``). The JSON goes to ``--json``.

  python benchmarks/scale_gpu.py --preset qwen3-8b --work /tmp/scale-gpu --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List


def timed(cmd: List[str], log: Path) -> Dict[str, Any]:
    """Run ``cmd`` as one process: wall, CPU, peak RSS, exit status, output tail."""
    subprocess.run(["sync"], check=False)
    t0 = time.perf_counter()
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
        _, status, ru = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    tail = log.read_text(errors="replace")[-3000:]
    return {"cmd": " ".join(cmd), "wall_s": round(wall, 3),
            "cpu_s": round(ru.ru_utime + ru.ru_stime, 3),
            "peak_rss_gb": round(ru.ru_maxrss / 1024 ** 2, 3),
            "status": os.waitstatus_to_exitcode(status), "tail": tail}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-8b")
    p.add_argument("--work", default="/tmp/scale-gpu")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--json")
    p.add_argument("--threads", type=int, default=None,
                   help="extract's --threads (low-rank modules at once)")
    p.add_argument("--skip", nargs="*", default=[],
                   help="steps to leave out: cp fuse check extract compare")
    a = p.parse_args(argv)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    lk = [sys.executable, "-m", "lorakit"]
    base, adapter = work / "base", work / "adapter"
    fused, copy, extracted = work / "fused", work / "copy", work / "extracted"
    out: Dict[str, Any] = {"preset": a.preset, "python": platform.python_version(),
                           "host": platform.node(), "steps": {}}
    try:
        import mlx.core as mx
        out["mlx"] = mx.__version__
        out["device"] = str(mx.default_device())
    except Exception as exc:  # the report says what ran, even without MLX
        out["mlx"] = f"unavailable: {exc}"
    t0 = time.perf_counter()
    if not (base / "config.json").exists():
        subprocess.run(lk + ["synth", "checkpoint", "--preset", a.preset, "-q", str(base)],
                       check=True)
    if not (adapter / "adapter_config.json").exists():
        subprocess.run(lk + ["synth", "adapter", "--model", str(base), "--rank", "8",
                             str(adapter)], check=True)
    out["synth_s"] = round(time.perf_counter() - t0, 1)
    out["checkpoint_bytes"] = sum(f.stat().st_size for f in base.glob("*.safetensors"))
    steps = out["steps"]

    def step(name: str, cmd: List[str]) -> None:
        if name in a.skip:
            return
        steps[name] = timed(cmd, work / f"{name}.log")
        print(name, {k: v for k, v in steps[name].items() if k != "tail"}, flush=True)

    if "cp" not in a.skip:
        shutil.rmtree(copy, ignore_errors=True)
    step("cp", ["cp", "-r", str(base), str(copy)])
    shutil.rmtree(copy, ignore_errors=True)
    if "fuse" not in a.skip:
        shutil.rmtree(fused, ignore_errors=True)
    step("fuse", lk + ["fuse", "--model", str(base), "--adapter-path", str(adapter),
                       "--save-path", str(fused), "-q"])
    step("check", lk + ["check", "--model", str(base), "--adapter-path", str(adapter),
                        "--save-path", str(fused), "--json"])
    if "extract" not in a.skip:
        shutil.rmtree(extracted, ignore_errors=True)
    step("extract", lk + ["extract", "--base", str(base), "--tuned", str(fused),
                          "--rank", "8", "--no-behaviour", "--save-path", str(extracted), "--json",
                          "-q"]
         + (["--threads", str(a.threads)] if a.threads else []))
    step("compare", lk + ["compare-outputs", str(fused), str(base), "--test-adapter",
                          str(adapter), "--tokens", str(a.tokens), "--json", "-q"])
    for name in ("check", "extract", "compare"):
        if name in steps and steps[name]["status"] in (0, 1, 3):
            try:
                text = (work / f"{name}.log").read_text()
                steps[name]["report"] = json.loads(text[text.index("{"):])
            except (ValueError, OSError) as exc:
                steps[name]["report_error"] = str(exc)
    if "fuse" in steps and "cp" in steps:
        steps["fuse"]["vs_cp"] = round(steps["fuse"]["wall_s"] / steps["cp"]["wall_s"], 3)
    if "fuse" in steps:
        for name in ("check", "extract"):
            if name in steps:
                steps[name]["vs_fuse"] = round(steps[name]["wall_s"] / steps["fuse"]["wall_s"], 3)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
