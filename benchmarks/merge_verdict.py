"""Detection limits of ``lorakit check`` on the embedded data (issue 13).

For each embedded adapter (LoRA and DoRA on the bf16 tiny-qwen3, LoRA on its 4-bit
twin), wrong merges of growing subtlety are made and checked:

* the adapter fused at ``scale * (1 + d)``, in lorakit's ``nearest`` order and in
  mlx-lm's, for d from 0.1% to 20%: how many adapted tensors are flagged;
* another adapter of the same shapes sharing ``c`` of the intended delta
  (``B' = c B + sqrt(1 - c^2) N``, N seeded noise of B's spread);
* a correct (nearest) fuse with one bf16 ulp added to a random share of every adapted
  tensor's elements;

and the correct merges of all four rounding modes, whose largest distance must stay
at most 1 (no false alarm). Writes JSON (``--json``) and prints a summary.

    python benchmarks/merge_verdict.py --json benchmarks/results/merge_verdict.json
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import lorakit  # noqa: E402
from lorakit.inspect.check import check  # noqa: E402
from lorakit.io.formats.checkpoint import Checkpoint  # noqa: E402
from lorakit.io.formats.safetensors import TensorSpec
from lorakit.io.outputs.safetensors_write import SafetensorsWriter  # noqa: E402

DATA = REPO / "data"
CASES = {"lora (bf16)": (DATA / "tiny-qwen3", DATA / "adapters" / "lora"),
         "dora (bf16)": (DATA / "tiny-qwen3", DATA / "adapters" / "dora"),
         "lora (4-bit base)": (DATA / "tiny-qwen3-4bit", DATA / "adapters" / "lora-4bit")}
SCALE_STEPS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2)
SHARES = (0.9999, 0.999, 0.99, 0.95, 0.8)
ULP_SHARES = (1e-5, 1e-4, 1e-3, 1e-2)


def variant(src: Path, dst: Path, scale: float = 1.0, corr: float = 1.0) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg["lora_parameters"]["scale"] *= scale
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    if corr != 1.0:
        f = dst / "adapters.safetensors"
        t = load_file(str(f))
        rng = np.random.default_rng(7)
        for k, v in t.items():
            if k.endswith("lora_b"):
                noise = rng.standard_normal(v.shape).astype(np.float32) * v.std()
                t[k] = (corr * v + math.sqrt(1 - corr * corr) * noise).astype(np.float32)
        save_file(t, str(f))
    return dst


def flagged(fused: Path, base: Path, adapter: Path) -> dict:
    rep = check(fused, base, adapter, check_untouched=False, progress=False)
    wrong = [r for r in rep.rows if r["status"] != "ok"]
    return {"status": rep.status, "tensors flagged": len(wrong), "tensors": len(rep.rows),
            "largest distance": rep.summary["largest distance"],
            "causes": sorted({r["verdict"] for r in wrong})}


def ulp_flips(good: Path, dst: Path, share: float, adapted: set) -> Path:
    shutil.copytree(good, dst)
    for f in dst.glob("model*.safetensors*"):
        f.unlink()
    ck = Checkpoint(good)
    rng = np.random.default_rng(11)
    plan = [TensorSpec(n, m.dtype, tuple(m.shape)) for n, m in ck.tensors.items()]
    with SafetensorsWriter(dst / "model.safetensors", plan) as w:
        for p in plan:
            raw = np.asarray(ck.read(p.name))
            if p.name in adapted:
                raw = raw + (rng.random(raw.shape) < share).astype(raw.dtype)
            w.write(p.name, raw)
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    out: dict = {"command": "python benchmarks/merge_verdict.py " +
                 (f"--json {args.json}" if args.json else ""), "cases": {}}
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for i, (name, (base, ad)) in enumerate(CASES.items()):
            res: dict = {"correct": {}, "scale": {}, "another adapter": {}, "ulp flips": {}}
            for mode in ("nearest", "round-once", "mlx-lm", "scale-after"):
                f = lorakit.fuse(base, ad, root / f"{i}-ok-{mode}", rounding=mode,
                                 progress=False).output
                res["correct"][mode] = flagged(f, base, ad)
            for d in SCALE_STEPS:
                for sign in (1, -1):
                    k = 1 + sign * d
                    v = variant(ad, root / f"{i}-ad-{k}", scale=k)
                    for mode in ("nearest", "mlx-lm"):
                        f = lorakit.fuse(base, v, root / f"{i}-f-{k}-{mode}", rounding=mode,
                                         progress=False).output
                        res["scale"][f"x{k:g} {mode}"] = flagged(f, base, ad)
            for c in SHARES:
                v = variant(ad, root / f"{i}-other-{c}", corr=c)
                f = lorakit.fuse(base, v, root / f"{i}-fo-{c}", progress=False).output
                res["another adapter"][f"corr {c:g}"] = flagged(f, base, ad)
            if "4-bit" not in name:
                good = lorakit.fuse(base, ad, root / f"{i}-good", progress=False).output
                rep = check(good, base, ad, check_untouched=False, progress=False)
                adapted = {r["tensor"] for r in rep.rows}
                for s in ULP_SHARES:
                    f = ulp_flips(good, root / f"{i}-ulp-{s}", s, adapted)
                    res["ulp flips"][f"{s:g} of elements +1 ulp"] = flagged(f, base, ad)
            out["cases"][name] = res
    out["seconds"] = round(time.time() - t0, 1)
    for name, res in out["cases"].items():
        print(f"== {name}")
        for group, rows in res.items():
            for k, v in rows.items():
                print(f"  {group:16s} {k:28s} {v['status']:8s} "
                      f"{v['tensors flagged']:3d}/{v['tensors']}  dist {v['largest distance']:.3g}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
