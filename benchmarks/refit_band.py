"""The extract refit's active band (``lorakit.algebra.refine.SLACK``) side by side.

On five modules of the Qwen3-1.7B-shaped fuse of ``benchmarks/fuse.py`` (the bf16
checkpoint and rank-8 adapter it builds once under ``--out``, fused here by
``lorakit.fuse`` if ``--out``/fused is absent): the start is extract's own (the
randomized SVD and its factors), then ``refine_factors`` with the narrow default band
(``SLACK``) and with the ``COUNT_SLACK`` band (0.125 ulp, the earlier default),
alternating which runs first per module, in one process. For each: the process CPU
seconds of the refit, the elements a re-fuse would change before and after, the
iterations, and the share of the module's elements in the first active set; and, on
that first active set, the time of one accumulation pass per element (the loss alone
and the normal equations, median of 5).

Usage::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/refit_band.py --out /tmp/speed-bench \\
        --json benchmarks/results/refit_band.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from fuse import prepare  # noqa: E402

import lorakit  # noqa: E402
from lorakit.algebra import refine  # noqa: E402
from lorakit.algebra.lowrank import EXACT_MAX, matrix_svd, split_factors  # noqa: E402
from lorakit.io.weights import weight_f64  # noqa: E402

MODULES = ["model.layers.27.mlp.gate_proj", "model.layers.20.mlp.down_proj",
           "model.layers.20.self_attn.q_proj", "model.layers.20.self_attn.k_proj",
           "model.layers.20.self_attn.o_proj"]


def _start(b, t, name: str):
    W = weight_f64(b, name).astype(np.float32)  # a bf16 base: exact in float32
    bits, code = t.read(name), t.tensors[name].dtype
    U, S, Vt, _ = matrix_svd(weight_f64(t, name) - W, 8, None, exact_max=EXACT_MAX, seed=0)
    A, B = split_factors(U, S, Vt, 8)
    return W, bits, code, A, B


def _active(W, bits, code, A, B, slack: float):
    """The first active set of a refit with ``slack``: its share of the elements and
    the per-element seconds of one accumulation pass over it (loss alone, full)."""
    prob = refine._Problem(W, bits, code, refine.MARGIN, True)
    dense = int(np.median(prob.logu)) - refine.DENSE_BINADES
    thr, _ = refine._thresholds(prob, slack, dense)
    A64, B64 = A.astype(np.float64), B.astype(np.float64)
    act, _ = prob.scan(A64, B64, thr)
    idx = act.idx
    wtab = prob.weights(1.0)
    per = {}
    for full in (False, True):
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            prob.accum(act, A64, B64, wtab, 0, full)
            ts.append(time.perf_counter() - t0)
        per["normal_equations" if full else "loss"] = statistics.median(ts) / max(len(idx), 1)
    return len(idx) / W.size, per


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
    bands = {"narrow": refine.SLACK, "count": refine.COUNT_SLACK}
    rows = []
    for k, module in enumerate(MODULES):
        name = module + ".weight"
        W, bits, code, A, B = _start(b, t, name)
        row = {"module": module, "shape": list(W.shape), "elements": int(W.size)}
        order = list(bands) if k % 2 == 0 else list(bands)[::-1]
        for band in order:
            slack = bands[band]
            share, per = _active(W, bits, code, A, B, slack)
            c0 = time.process_time()
            # the settings this comparison was measured at (gap 1/64, 50 iterations;
            # the defaults now follow the module's size: benchmarks/refit_settings.py)
            res = refine.refine_factors(W, bits, code, A, B, slack=slack, margin=refine.MARGIN,
                                        max_iters=refine.MAX_ITERS)
            cpu = time.process_time() - c0
            row[band] = {"slack": slack, "cpu_s": cpu, "outside_before": res.outside_before,
                         "outside_after": res.outside_after, "iterations": res.iterations,
                         "active_share": share, "pass_s_per_element": per}
            print(module, band, f"cpu {cpu:.2f} s", res.outside_after,
                  f"active {100 * share:.1f}%", flush=True)
        rows.append(row)
    total = {band: {"cpu_s": sum(r[band]["cpu_s"] for r in rows),
                    "outside_after": sum(r[band]["outside_after"] for r in rows)}
             for band in bands}
    d = {"command": "python benchmarks/refit_band.py --out DIR --json "
                    "benchmarks/results/refit_band.json",
         "what": __doc__.split("\n\n")[0], "cpus": os.cpu_count(),
         "loadavg": list(os.getloadavg()), "rows": rows, "total": total}
    text = json.dumps(d, indent=2) + "\n"
    if a.json:
        a.json.write_text(text)
    print(json.dumps(total, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
