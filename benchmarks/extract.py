"""Extract a LoRA from a fused checkpoint and fuse it again: accuracy, time, peak RSS.

Two cases: the embedded model (data/tiny-qwen3 fused with data/adapters/lora) and a
random checkpoint of Qwen3-1.7B's shape (``lorakit.synth``: preset qwen3-1.7b, a
rank-8 adapter on the last 16 layers x 7 projections, fused by ``lorakit.fuse``), all
in a temporary directory that is removed at the end. For each case:

* ``lorakit.extract(base, fused, rank=8)`` runs in a fresh process (``fuse.launch``:
  forked from a small launcher): wall time, CPU time and peak RSS of that process alone;
  the behaviour line on the embedded model only (``behaviour=False`` at the 1.7B shape);
* per module, ``||D_r - delta||_F`` (the extracted delta against the adapter's own
  float64 delta) over ``||e||_F`` (the fused checkpoint's rounding error,
  ``e = (T - W) - delta``) and over ``noise`` (Frobenius norm of half an ulp of every
  fused element, the bound on ``||e||_F``); the bound proven is ratio <= 2;
* the extracted adapter fused again (``lorakit.fuse``, nearest rounding) against the
  fused checkpoint: elements that differ, and by how many ulps of the value; the
  report's ``reproduced`` column must count the same elements;
* at the 1.7B shape, the extract again with OpenBLAS's own thread count (two here) in
  each of the two modules in flight (``blas_default``: wall and CPU);
* the SVD's variants on two modules of the 1.7B shape (a k_proj, 1024 x 2048, and a
  gate_proj, 6144 x 2048), interleaved over rounds: LAPACK's exact SVD in float64 (the
  k_proj only), the randomized SVD in float64 and in float32 (the extract's, its cast
  included).

The process runs OpenBLAS single-threaded, as ``lorakit extract`` does.

Usage::

    .venv/bin/python benchmarks/extract.py --json benchmarks/results/extract.json
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as the CLI; before numpy loads

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from fuse import launch  # noqa: E402

import lorakit  # noqa: E402
from lorakit import numerics as nm  # noqa: E402
from lorakit.algebra import lowrank  # noqa: E402
from lorakit.io.adapters.base import Adapter, LoraTarget  # noqa: E402
from lorakit.io.formats.checkpoint import Checkpoint  # noqa: E402

CHILD = """
import json, sys, time, numpy as np, lorakit
base, fused, out, behaviour = sys.argv[1:5]
t = time.perf_counter()
rep = lorakit.extract(base, fused, rank=8, behaviour=behaviour == "1", progress=False)
wall = time.perf_counter() - t
np.savez(out + ".npz", **{f"A:{x.module}": x.A for x in rep.adapter.targets},
         **{f"B:{x.module}": x.B for x in rep.adapter.targets})
json.dump({"extract_s": wall, "summary": rep.to_dict()["summary"], "rows": rep.rows,
           "behaviour": rep.behaviour}, open(out + ".json", "w"), default=str)
"""


def _run_extract(base: Path, fused: Path, out: Path, behaviour: bool,
                 blas: str = "1") -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OPENBLAS_NUM_THREADS=blas)
    r = launch([sys.executable, "-c", CHILD, str(base), str(fused), str(out),
                "1" if behaviour else "0"], env=env)
    if r["rc"] != 0:
        raise SystemExit("extract failed")
    res = json.loads(Path(str(out) + ".json").read_text())
    res.update(process_wall_s=r["wall_s"], peak_rss_bytes=r["peak_rss_bytes"],
               user_s=r["user_s"], system_s=r["system_s"])
    return res


def _f64(ck: Checkpoint, name: str) -> np.ndarray:
    return nm.to_float64(ck.read(name), ck.tensors[name].dtype)


def svd_variants(b: Checkpoint, f: Checkpoint, adapted, rounds: int = 3) -> dict:
    """Seconds of each SVD variant on an adapted k_proj and gate_proj, interleaved."""
    out = {}
    for kind in ("self_attn.k_proj.weight", "mlp.gate_proj.weight"):
        name = max(n for n in adapted if n.endswith(kind))
        D = _f64(f, name) - _f64(b, name)
        variants = {
            "randomized float32": lambda: lowrank._randomized(
                D.astype(np.float32), 8 + lowrank.OVERSAMPLE, np.random.default_rng(0)),
            "randomized float64": lambda: lowrank._randomized(
                D, 8 + lowrank.OVERSAMPLE, np.random.default_rng(0)),
        }
        if min(D.shape) <= 1024:
            variants["exact float64"] = lambda: np.linalg.svd(D, full_matrices=False)
        secs = {k: [] for k in variants}
        for _ in range(rounds):
            for k, fn in variants.items():
                t = time.perf_counter()
                fn()
                secs[k].append(time.perf_counter() - t)
        out[name] = {"shape": list(D.shape),
                     "median_s": {k: statistics.median(v) for k, v in secs.items()}}
    return out


def measure(base: Path, adapter: Path, work: Path, behaviour: bool) -> dict:
    fused = work / "fused"
    t = time.perf_counter()
    lorakit.fuse(base, adapter, fused, progress=False)
    fuse_s = time.perf_counter() - t
    res = _run_extract(base, fused, work / "extracted", behaviour)
    npz = np.load(str(work / "extracted") + ".npz")
    modules = [k[2:] for k in npz.files if k.startswith("A:")]
    targets = [LoraTarget(m, "linear", npz[f"A:{m}"], npz[f"B:{m}"], 1.0) for m in modules]
    ext = Adapter(fused, "mlx-lm", targets, {}, fused, _sha256="benchmark")
    want = {t.module: t for t in lorakit.load_adapter(adapter).targets}
    b, f = Checkpoint(base), Checkpoint(fused)
    ratios_e, ratios_noise = [], []
    for tg in targets:
        name = tg.module + ".weight"
        W, F = _f64(b, name), _f64(f, name)
        w = want[tg.module]
        delta = w.scale * (w.B.astype(np.float64) @ w.A.astype(np.float64))
        e = (F - W) - delta
        half = 0.5 * nm.ulp(F, f.tensors[name].dtype)
        err = float(np.linalg.norm(tg.B.astype(np.float64) @ tg.A.astype(np.float64) - delta))
        ratios_e.append(err / float(np.linalg.norm(e)))
        ratios_noise.append(err / float(np.linalg.norm(half)))
    again = work / "again"
    lorakit.fuse(base, ext, again, progress=False)
    g = Checkpoint(again)
    adapted = {t.module + ".weight" for t in targets}
    counts = {"elements": 0, "adapted_elements": 0, "differ": 0, "differ_1ulp": 0,
              "differ_gt1ulp": 0, "max_ulps_of_value": 0.0, "other_tensors_identical": True}
    for name in f.tensors:
        x, y = f.read(name), g.read(name)
        counts["elements"] += int(x.size)
        if name not in adapted:
            counts["other_tensors_identical"] &= x.tobytes() == y.tobytes()
            continue
        fx, fy = _f64(f, name), _f64(g, name)
        ulps = np.abs(fx - fy) / nm.ulp(np.maximum(np.abs(fx), np.abs(fy)), f.tensors[name].dtype)
        counts["adapted_elements"] += int(x.size)
        counts["differ"] += int(np.count_nonzero(ulps))
        counts["differ_1ulp"] += int(np.count_nonzero((ulps > 0) & (ulps <= 1)))
        counts["differ_gt1ulp"] += int(np.count_nonzero(ulps > 1))
        counts["max_ulps_of_value"] = max(counts["max_ulps_of_value"], float(ulps.max()))
    low = [r for r in res["rows"] if r["method"] != "full"]
    counts["differ_reported"] = sum(int(np.prod(r["shape"])) - round(r["reproduced"] *
                                    int(np.prod(r["shape"]))) for r in low)
    counts["differ_fraction"] = counts["differ"] / counts["adapted_elements"]
    out = {"fuse_s": fuse_s, "modules": len(targets),
           "extract": {k: res[k] for k in ("extract_s", "process_wall_s", "peak_rss_bytes",
                                           "user_s", "system_s", "summary", "behaviour")},
           "recovery": {"bound": "||D_r - delta||_F <= 2 ||e||_F <= 2 noise",
                        "max_err_over_e": max(ratios_e),
                        "median_err_over_e": float(np.median(ratios_e)),
                        "max_err_over_noise": max(ratios_noise),
                        "all_within_bound": max(ratios_e) <= 2.0},
           "refuse": counts, "checkpoint_bytes": sum(i.nbytes for i in b.tensors.values())}
    if len(targets) > 100:  # the 1.7B shape: BLAS's own threads; the SVD's variants
        blas = _run_extract(base, fused, work / "blas", False, str(os.cpu_count()))
        out["blas_default"] = {"threads": os.cpu_count(), **{k: blas[k] for k in (
            "extract_s", "user_s", "system_s", "peak_rss_bytes")}}
        out["svd_variants"] = svd_variants(b, f, adapted)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--skip-large", action="store_true", help="only the embedded model")
    ap.add_argument("--preset", default="qwen3-1.7b", help="lorakit.synth preset of the large case")
    args = ap.parse_args()
    from lorakit.synth import synth_adapter, synth_checkpoint

    results = {"command": "python benchmarks/extract.py" +
               (" --skip-large" if args.skip_large else "") +
               (f" --preset {args.preset}" if args.preset != "qwen3-1.7b" else "") +
               (f" --json {args.json}" if args.json else ""),
               "loadavg_at_start": os.getloadavg(), "cases": {}}
    with tempfile.TemporaryDirectory(prefix="lorakit-extract-") as tmp:
        tiny = Path(tmp) / "tiny"
        tiny.mkdir()
        results["cases"]["tiny-qwen3"] = measure(ROOT / "data/tiny-qwen3",
                                                 ROOT / "data/adapters/lora", tiny, True)
        print(json.dumps(results["cases"]["tiny-qwen3"]["refuse"]), flush=True)
        if not args.skip_large:
            big = Path(tmp) / "big"
            big.mkdir()
            ck = synth_checkpoint(big / "base", args.preset, progress=False)
            ad = synth_adapter(big / "lora", ck, rank=8)
            results["cases"][args.preset] = measure(ck, ad, big, False)
    results["loadavg_at_end"] = os.getloadavg()
    text = json.dumps(results, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
