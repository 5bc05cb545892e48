"""Adapter algebra: how far each way of fusing a weighted sum of adapters lands from the
exact float64 sum, and how lorakit's ``--like peft`` compares with the real PEFT.

1. On the embedded tiny-qwen3 (bf16) with adapters lora, lora-embed, lora and weights
   0.7, -0.3, 0.25: the number of fused elements farther than 0.5 ulp from
   ``W + sum_i w_i s_i B_i A_i`` (float64), for the exact combination (rounded once),
   the saved ``cat`` adapter fused correctly rounded and in mlx-lm's order, and PEFT's
   ``linear`` definition (its cross terms: relative Frobenius distance of the delta).
2. On the PEFT fixtures (tests/fixtures/algebra, made with PEFT 0.21.2): elements of
   lorakit's ``--like peft`` fuse that differ from PEFT's merged weights.

    python benchmarks/algebra.py --json benchmarks/results/algebra.json
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
from make_peft_fixtures import read_safetensors  # noqa: E402

import lorakit  # noqa: E402
from lorakit.algebra.combine import combine  # noqa: E402
from lorakit.io.adapters.load import load_adapter  # noqa: E402

DATA = ROOT / "data"
PATHS = [DATA / "adapters" / "lora", DATA / "adapters" / "lora-embed", DATA / "adapters" / "lora"]
WEIGHTS = [0.7, -0.3, 0.25]
FIX = ROOT / "tests" / "fixtures" / "algebra"
FIX_BASE = ROOT / "tests" / "fixtures" / "peft" / "llama_lora_bf16" / "base"


def _bf16(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _exact_sum():
    out = {}
    for p, w in zip(PATHS, WEIGHTS):
        for t in load_adapter(p).targets:
            d = float(t.scale) * (t.B.astype(np.float64) @ t.A.astype(np.float64))
            out[t.module] = out.get(t.module, 0.0) + w * d
    return out


def _off(fused: Path, want) -> dict:
    base = read_safetensors(DATA / "tiny-qwen3" / "model.safetensors")
    got = read_safetensors(fused / "model.safetensors")
    bad = n = 0
    worst = 0.0
    for name, (_, raw) in base.items():
        module = name[: -len(".weight")]
        if module not in want:
            continue
        exact = _bf16(raw) + want[module]
        g = got[name][1]
        v = _bf16(g)
        # the larger gap to a neighbour (fmax: a neighbour of +-0 by bits can be a NaN)
        spacing = np.fmax(np.abs(_bf16(g + np.uint16(1)) - v), np.abs(_bf16(g - np.uint16(1)) - v))
        bad += int((np.abs(v - exact) / spacing > 0.5).sum())
        # the largest error in ulps of the exact value (bf16: 8 significant bits)
        e = np.floor(np.log2(np.maximum(np.abs(exact), 2.0 ** -133)))
        worst = max(worst, float((np.abs(v - exact) / np.ldexp(1.0, (e - 7).astype(int))).max()))
        n += v.size
    return {"elements": n, "over_half_ulp": bad, "max_err_ulp": round(worst, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    want = _exact_sum()
    tmp = Path(tempfile.mkdtemp())
    rows = []
    for label, method, rounding in (("exact (default)", "exact", "nearest"),
                                    ("cat, saved, fused nearest", "cat", "nearest"),
                                    ("cat, saved, fused mlx-lm order", "cat", "mlx-lm")):
        t0 = time.perf_counter()
        c = combine(PATHS, WEIGHTS, method=method)
        out = tmp / label.replace(" ", "_").replace(",", "")
        lorakit.fuse(DATA / "tiny-qwen3", c.adapter, out, rounding=rounding, progress=False)
        rows.append({"fuse": label, **_off(out, want),
                     "seconds": round(time.perf_counter() - t0, 2)})
    lin = combine(PATHS[:2], WEIGHTS[:2], method="linear")
    exact2 = {}
    for p, w in zip(PATHS[:2], WEIGHTS[:2]):
        for t in load_adapter(p).targets:
            exact2[t.module] = exact2.get(t.module, 0.0) + w * float(t.scale) * (
                t.B.astype(np.float64) @ t.A.astype(np.float64))
    rel = [float(np.linalg.norm(float(t.scale) * (t.B.astype(np.float64) @ t.A.astype(np.float64))
                                - exact2[t.module]) / np.linalg.norm(exact2[t.module]))
           for t in lin.adapter.targets]
    peft = []
    for method in ("linear", "cat", "ties", "magnitude_prune", "svd"):
        c = combine([FIX / "lora-a", FIX / "lora-b"], [0.7, -0.4], method=method, density=0.5,
                    like="peft")
        out = tmp / f"like-{method}"
        lorakit.fuse(FIX_BASE, c.adapter, out, rounding="round-once", progress=False)
        got = read_safetensors(out / "model.safetensors")
        ref = read_safetensors(FIX / "merged" / f"combine-{method}.safetensors")
        peft.append({"method": method, "elements": sum(v[1].size for v in ref.values()),
                     "differ": sum(int((got[k][1] != v[1]).sum()) for k, v in ref.items())})
    res = {"combination": {"adapters": [str(p.relative_to(ROOT)) for p in PATHS],
                           "weights": WEIGHTS, "fuses": rows},
           "linear_cross_terms": {"adapters": [str(p.relative_to(ROOT)) for p in PATHS[:2]],
                                  "weights": WEIGHTS[:2],
                                  "median_rel_frobenius": float(np.median(rel)),
                                  "max_rel_frobenius": float(np.max(rel))},
           "like_peft": peft}
    print(json.dumps(res, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
