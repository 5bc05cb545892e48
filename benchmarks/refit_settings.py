"""The extract refit's box gap and iteration cap, measured by the size of the matrix.

``lorakit.algebra.refine`` shrinks each element's rounding box by a gap of
``margin_gap(shape, r)`` of its half spacing (``r / min(out, in)`` as a power of two,
1/4096 to 1/64) and caps the iterations at ``LARGE_ITERS`` for a module of more than
``LARGE`` elements (``MAX_ITERS`` below). This measures both choices:

* **gap sweep**: ``refine_factors`` with gaps 1/32 to 1/1024 (the default iteration cap)
  on matrices of four sizes: every adapted module of tiny-qwen3 (data/tiny-qwen3 fused
  with data/adapters/lora by ``lorakit.fuse``, summed: min(out, in) 128-256), layer 20's
  k_proj (1024 x 2048) and q_proj (2048 x 2048) and layer 27's gate_proj (6144 x 2048)
  of the Qwen3-1.7B-shaped fuse of ``benchmarks/fuse.py``, and a 4096 x 4096 matrix made
  from that checkpoint's bf16 gate and up rows with a rank-8 float32 delta whose factors
  have the rms of q_proj's start (seed 0), fused by one rounding of the float64 sum.
  For each: the elements a re-fuse would change after the refit (``outside_after``).
* **settings**: the earlier fixed settings (gap 1/64, 50 iterations) against the
  defaults, per module in alternating order, one process: refit CPU seconds and the
  elements outside after, on the 1.7B modules above plus layer 20's down_proj and
  o_proj, and on tiny-qwen3 (all modules, summed).
* **ramp**: at the large modules' cap (``LARGE_ITERS``), the weight's exponent ramping
  over all the iterations (the default) against a ramp that ends ``RAMP_EARLY``
  iterations before the last, on the gate_proj and down_proj above: elements outside.

The start is extract's own (the randomized or exact SVD, ``split_factors``).

Usage::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/refit_settings.py --out /tmp/speed-bench \\
        --json benchmarks/results/refit_settings.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from fuse import prepare  # noqa: E402
from refit_band import _start as _module  # noqa: E402  (base, tuned, name) -> extract's start

import lorakit  # noqa: E402
from lorakit import numerics as nm  # noqa: E402
from lorakit.algebra import refine  # noqa: E402
from lorakit.algebra.lowrank import EXACT_MAX, matrix_svd, split_factors  # noqa: E402
from lorakit.io.weights import weight_f64  # noqa: E402

DATA = ROOT / "data"
GAPS = [2.0 ** -k for k in range(5, 11)]
SWEEP = {"k_proj": "model.layers.20.self_attn.k_proj", "q_proj": "model.layers.20.self_attn.q_proj",
         "gate_proj": "model.layers.27.mlp.gate_proj"}
SETTINGS = ["model.layers.27.mlp.gate_proj", "model.layers.20.mlp.down_proj",
            "model.layers.20.self_attn.q_proj", "model.layers.20.self_attn.k_proj",
            "model.layers.20.self_attn.o_proj"]
EARLIER = {"margin": 0.5 - 2.0 ** -6, "max_iters": 50}
RAMP_EARLY = 5  # the ramp compared with the default: ending this many iterations early


def _problem(W32: np.ndarray, T: np.ndarray, bits: np.ndarray, code: str):
    U, S, Vt, _ = matrix_svd(T - W32, 8, None, exact_max=EXACT_MAX, seed=0)
    A, B = split_factors(U, S, Vt, 8)
    return W32, bits, code, A, B




def _tiny(work: Path):
    base = DATA / "tiny-qwen3"
    fused = work / "tiny-fused"
    lorakit.fuse(base, DATA / "adapters" / "lora", fused, progress=False)
    b, t = lorakit.open(base), lorakit.open(fused)
    out = []
    for name in t.tensors:
        if name in b.tensors and len(t.tensors[name].shape) == 2 and "embed" not in name:
            if np.any(weight_f64(t, name) != weight_f64(b, name)):
                out.append(_module(b, t, name))
    return out


def _square(b, like, n: int = 4096):
    """A 4096 x 4096 bf16 base from the 1.7B's gate and up rows, a rank-8 float32 delta
    whose factors have the rms of ``like``'s start (a 1.7B module's split SVD factors;
    seed 0), fused by one rounding of the float64 sum."""
    gate = weight_f64(b, "model.layers.27.mlp.gate_proj.weight")[:n]
    up = weight_f64(b, "model.layers.27.mlp.up_proj.weight")[:n]
    W = np.concatenate([gate, up], axis=1)[:, :n]
    rng = np.random.default_rng(0)
    sb, sa = (float(np.sqrt(np.mean(np.square(f, dtype=np.float64))))
              for f in (like[4], like[3]))
    B0 = (rng.normal(size=(n, 8)) * sb).astype(np.float32).astype(np.float64)
    A0 = (rng.normal(size=(8, n)) * sa).astype(np.float32).astype(np.float64)
    bits = nm.round_to_format(W + B0 @ A0, "BF16")
    return _problem(W.astype(np.float32), nm.to_float64(bits, "BF16"), bits, "BF16")


def _refit(problems, **kw):
    c0 = time.process_time()
    out = sum(refine.refine_factors(*p, **kw).outside_after for p in problems)
    return out, time.process_time() - c0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    base, adapter = prepare(a.out)
    fused = a.out / "fused"
    if not (fused / "config.json").exists():
        lorakit.fuse(base, adapter, fused, progress=False)
    b, t = lorakit.open(base), lorakit.open(fused)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = _tiny(Path(tmp))
    groups = {"tiny-qwen3": tiny}
    groups.update({k: [_module(b, t, v + ".weight")] for k, v in SWEEP.items()})
    groups["4096 x 4096"] = [_square(b, groups["q_proj"][0])]
    sweep = []
    for label, probs in groups.items():
        row = {"matrices": label, "shapes": sorted({tuple(p[0].shape) for p in probs}),
               "elements": int(sum(p[0].size for p in probs)),
               "default_gap": refine.margin_gap(probs[0][0].shape, 8), "outside": {}}
        for gap in GAPS:
            row["outside"][f"{gap:g}"] = _refit(probs, margin=0.5 - gap)[0]
        row["best_gap"] = float(min(row["outside"], key=lambda g: row["outside"][g]))
        print(label, row["outside"], flush=True)
        sweep.append(row)
    settings = []
    cases = [("tiny-qwen3", tiny)] + [(m, [_module(b, t, m + ".weight")]) for m in SETTINGS]
    for k, (label, probs) in enumerate(cases):
        row = {"module": label, "elements": int(sum(p[0].size for p in probs))}
        order = ["earlier", "default"] if k % 2 == 0 else ["default", "earlier"]
        for which in order:
            out, cpu = _refit(probs, **(EARLIER if which == "earlier" else {}))
            row[which] = {"outside_after": out, "cpu_s": cpu}
        print(label, row, flush=True)
        settings.append(row)
    # the weight's ramp at the large modules' cap: over all the iterations (the default)
    # or ending RAMP_EARLY before the last
    ramps = []
    for label, probs in cases[1:3]:
        row = {"module": label, "max_iters": refine.LARGE_ITERS}
        for which, ramp in (("to_last", refine.LARGE_ITERS),
                            ("early", refine.LARGE_ITERS - RAMP_EARLY)):
            row[which] = {"ramp": ramp, "outside_after": _refit(probs, ramp=ramp)[0]}
        print(label, row, flush=True)
        ramps.append(row)
    big = [r for r in settings if r["module"] != "tiny-qwen3"]
    total = {w: {"cpu_s": sum(r[w]["cpu_s"] for r in big),
                 "outside_after": sum(r[w]["outside_after"] for r in big)}
             for w in ("earlier", "default")}
    d = {"command": "python benchmarks/refit_settings.py --out DIR --json "
                    "benchmarks/results/refit_settings.json",
         "what": __doc__.split("\n\n")[0], "cpus": os.cpu_count(),
         "loadavg": list(os.getloadavg()), "earlier": EARLIER,
         "defaults": {"max_iters": refine.MAX_ITERS, "large_iters": refine.LARGE_ITERS,
                      "large": refine.LARGE},
         "sweep": sweep, "settings": settings, "total_1_7b": total, "ramp": ramps}
    text = json.dumps(d, indent=2) + "\n"
    if a.json:
        a.json.write_text(text)
    print(json.dumps(total, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
