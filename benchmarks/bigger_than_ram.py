"""Peak memory of ``lorakit fuse`` does not grow with the checkpoint's size.

For each size, writes a synthetic Qwen3-8B-shaped bf16 checkpoint (``lorakit.synth``,
the number of layers chosen to reach the size) and a rank-8 adapter on q, v and down
of every layer, then runs ``python -m lorakit fuse`` as a whole process under
``os.wait4`` and records wall time and peak RSS (``ru_maxrss``). The largest size is
then fused again with the process's address space capped (``RLIMIT_AS``) below the
checkpoint's size: RSS can never exceed the address space, so a fuse that completes
under the cap has fused a checkpoint larger than the memory it was allowed.

Every output is checked: ``Checkpoint`` opens it and, for a few fused tensors, the
first rows equal the fusion core's result on the same rows of the base.

A checkpoint larger than the machine's RAM works the same way; to see it for
real (needs 2x its size on disk): ``--sizes 30GB``.

    python benchmarks/bigger_than_ram.py [--sizes 3GB,9GB] [--cap 2GB] [--workdir bench-out/btr]

Inputs and outputs are deleted as it goes (``--keep`` keeps the inputs).
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Optional

ROOT = Path(__file__).resolve().parents[1]

import numpy as np  # noqa: E402

from lorakit.fusion.core import fuse_weight  # noqa: E402
from lorakit.io.adapters.load import load_adapter  # noqa: E402
from lorakit.io.adapters.naming import bind  # noqa: E402
from lorakit.io.formats.checkpoint import Checkpoint  # noqa: E402
from lorakit.synth import PRESETS, parse_size, plan_checkpoint, synth_adapter, synth_checkpoint  # noqa: E402

PRESET = "qwen3-8b"
KEYS = ("q", "v", "down")


def layers_for(size: int) -> int:
    """How many qwen3-8b layers make a bf16 checkpoint of about ``size`` bytes."""
    def nbytes(layers: int) -> int:
        cfg = dict(PRESETS[PRESET], num_hidden_layers=layers)
        return sum(int(np.prod(shape)) * 2 for _, shape in plan_checkpoint(cfg, "mlx"))
    fixed = nbytes(0)
    per_layer = nbytes(1) - fixed
    return max(1, round((size - fixed) / per_layer))


def measured(base: Path, adapter: Path, out: Path, cap: Optional[int] = None) -> Dict:
    """One ``python -m lorakit fuse`` process (address space capped at ``cap``): wall
    time, exit status and peak RSS, read with ``os.wait4`` from a fresh helper process
    so that ``ru_maxrss`` is this fuse's alone."""
    code = (
        "import json, os, resource, subprocess, sys, time\n"
        "cap = int(sys.argv[4]) if len(sys.argv) > 4 else 0\n"
        "def limit():\n"
        "    if cap: resource.setrlimit(resource.RLIMIT_AS, (cap, cap))\n"
        "cmd = [sys.executable, '-m', 'lorakit', 'fuse', '--model', sys.argv[1],\n"
        "       '--adapter-path', sys.argv[2], '--save-path', sys.argv[3], '-q', '--json']\n"
        "t0 = time.perf_counter()\n"
        "p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,\n"
        "                     preexec_fn=limit)\n"
        "_, status, ru = os.wait4(p.pid, 0)\n"
        "wall = time.perf_counter() - t0\n"
        "out, err = p.stdout.read(), p.stderr.read()\n"
        "print(json.dumps({'wall_s': wall, 'rc': os.waitstatus_to_exitcode(status),\n"
        "                  'peak_rss': ru.ru_maxrss * 1024, 'stderr': err.decode()[-2000:],\n"
        "                  'stdout': out.decode()}))\n")
    args = [sys.executable, "-c", code, str(base), str(adapter), str(out)]
    if cap:
        args.append(str(cap))
    r = subprocess.run(args, capture_output=True, text=True, cwd=ROOT)
    if r.returncode:
        raise SystemExit(r.stderr)
    return json.loads(r.stdout)


def verify(base: Path, adapter: Path, out: Path, rows: int = 8) -> int:
    """Open the output and compare the first rows of a few fused tensors with the core."""
    ck, fused = Checkpoint(base), Checkpoint(out)
    assert sorted(ck.tensors) == sorted(fused.tensors)
    ad = load_adapter(adapter)
    checked = 0
    bindings = bind(ad, ck)
    for b in bindings[:: max(1, len(bindings) // 6)]:
        t = b.target
        raw = ck.read(b.tensor, slice(0, rows))
        want, code = fuse_weight(raw, ck.tensors[b.tensor].dtype, t.A, t.B[:rows], t.scale)
        got = fused.read(b.tensor, slice(0, rows))
        assert code == fused.tensors[b.tensor].dtype and np.array_equal(got, want), b.tensor
        checked += 1
    return checked


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="3GB,9GB", help="checkpoint sizes, comma separated")
    ap.add_argument("--cap", default="2GB", help="address-space cap for the capped run")
    ap.add_argument("--workdir", default=str(ROOT / "bench-out" / "bigger_than_ram"))
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic inputs")
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    cap = parse_size(args.cap)
    results = []
    for i, size in enumerate(sizes):
        layers = layers_for(size)
        base, adapter, out = work / f"base-{layers}L", work / f"adapter-{layers}L", work / "out"
        if not base.exists():
            t0 = time.perf_counter()
            synth_checkpoint(base, PRESET, overrides={"num_hidden_layers": layers},
                             shard_size="5GB", progress=False)
            print(f"wrote {base.name} in {time.perf_counter() - t0:.0f} s", flush=True)
        if not adapter.exists():
            synth_adapter(adapter, base, rank=8, layers=layers, keys=KEYS)
        nbytes = Checkpoint(base).nbytes
        runs = [("free", None)] + ([("capped", cap)] if i == len(sizes) - 1 else [])
        for label, limit in runs:
            shutil.rmtree(out, ignore_errors=True)
            r = measured(base, adapter, out, limit)
            ok = r["rc"] == 0
            row = {"checkpoint_bytes": nbytes, "layers": layers, "run": label,
                   "cap_bytes": limit, "wall_s": round(r["wall_s"], 2),
                   "peak_rss_bytes": r["peak_rss"], "ok": ok}
            if ok:
                row["tensors_fused"] = json.loads(r["stdout"])["tensors_fused"]
                row["verified_tensors"] = verify(base, adapter, out)
            else:
                row["stderr"] = r["stderr"]
            results.append(row)
            cap_s = f", cap {limit / 1e9:.1f} GB" if limit else ""
            print(f"{nbytes / 1e9:6.2f} GB checkpoint ({layers} layers{cap_s}): "
                  f"{'ok' if ok else 'FAILED'}, {row['wall_s']:.1f} s, "
                  f"peak RSS {row['peak_rss_bytes'] / 1e9:.2f} GB "
                  f"({row['peak_rss_bytes'] / nbytes:.1%} of the checkpoint)", flush=True)
            shutil.rmtree(out, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
            shutil.rmtree(adapter, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
