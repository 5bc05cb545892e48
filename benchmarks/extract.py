"""Extract a LoRA from a fused checkpoint and fuse it again: accuracy, time, peak RSS.

Two cases: the embedded model (data/tiny-qwen3 fused with data/adapters/lora) and a
random checkpoint of Qwen3-1.7B's shape (``lorakit.synth``: preset qwen3-1.7b, a
rank-8 adapter on the last 16 layers x 7 projections, fused by ``lorakit.fuse``), all
in a temporary directory that is removed at the end. For each case:

* ``lorakit.extract(base, fused, rank=8)`` runs in a fresh process (``fuse.launch``: forked
  from a small launcher): wall time, CPU time and peak RSS (``ru_maxrss``) of that process
  alone;
* per module, ``||D_r - delta||_F`` (the extracted delta against the adapter's own
  float64 delta) over ``||e||_F`` (the fused checkpoint's rounding error,
  ``e = (T - W) - delta``) and over ``noise`` (Frobenius norm of half an ulp of every
  fused element, the bound on ``||e||_F``); the bound proven is ratio <= 2;
* the extracted adapter fused again (``lorakit.fuse``, nearest rounding) against the
  fused checkpoint: elements that differ, and by how many ulps of the value. The
  extract refits the SVD factors by default (``lorakit.algebra.refine``); the report's
  ``outside_svd`` column counts the elements a re-fuse of the plain SVD factors would
  change (before the refit), ``outside`` those of the saved ones (checked here against
  the real re-fuse).

* the plain SVD extraction ``mergekit-extract-lora`` does (its
  ``_low_rank_decomposition``: ``torch.linalg.svd`` of ``finetuned.float() -
  base.float()``, ``B = U_r sqrt(S_r)``, ``A = sqrt(S_r) Vh_r``), reproduced in numpy
  float32 on the same checkpoint: its time, ``||D - B A||_F`` against lorakit's
  residual, and the elements a re-fuse of its factors changes (``outside_count``, the
  count the report's ``outside`` column uses and a real re-fuse matches).

``--preset`` picks the synthetic shape (``lorakit.synth``'s presets, e.g. qwen3-8b) and
``--device`` MLX's default device in the extract's process (cpu or gpu; the refit and
the SVD run in numpy and the C kernel either way).

Usage::

    .venv/bin/python benchmarks/extract.py --json benchmarks/results/extract.json
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

from fuse import launch  # noqa: E402

import lorakit  # noqa: E402
from lorakit import numerics as nm  # noqa: E402
from lorakit.io.adapters.base import Adapter, LoraTarget  # noqa: E402
from lorakit.io.checkpoint import Checkpoint  # noqa: E402

CHILD = """
import json, sys, time, numpy as np, lorakit
base, fused, out, device, threads = sys.argv[1:6]
import mlx.core as mx
mx.set_default_device(mx.gpu if device == "gpu" else mx.cpu)
t = time.perf_counter()
rep = lorakit.extract(base, fused, rank=8, threads=int(threads) or None, progress=False)
wall = time.perf_counter() - t
np.savez(out + ".npz", **{f"A:{x.module}": x.A for x in rep.adapter.targets},
         **{f"B:{x.module}": x.B for x in rep.adapter.targets})
json.dump({"extract_s": wall, "refit_s": rep.refit_seconds, "summary": rep.to_dict()["summary"],
           "rows": rep.rows}, open(out + ".json", "w"), default=str)
"""


def _run_extract(base: Path, fused: Path, out: Path, device: str, threads: int = 0) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = launch([sys.executable, "-c", CHILD, str(base), str(fused), str(out), device,
                str(threads)], env=env)
    if r["rc"] != 0:
        raise SystemExit("extract failed")
    res = json.loads(Path(str(out) + ".json").read_text())
    res.update(process_wall_s=r["wall_s"], peak_rss_bytes=r["peak_rss_bytes"],
               user_s=r["user_s"], system_s=r["system_s"])
    return res


def _f64(ck: Checkpoint, name: str) -> np.ndarray:
    return nm.to_float64(ck.read(name), ck.tensors[name].dtype)


def plain_svd(b: Checkpoint, f: Checkpoint, names, rank: int, limit=None) -> dict:
    """mergekit-extract-lora's method on the same checkpoint (numpy float32 SVD)."""
    from lorakit.algebra.refine import outside_count

    secs = sq = 0.0
    differ = elements = 0
    for name in list(names)[:limit]:
        t = time.perf_counter()
        D = nm.to_float64(f.read(name), f.tensors[name].dtype).astype(np.float32) - \
            nm.to_float64(b.read(name), b.tensors[name].dtype).astype(np.float32)
        U, S, Vh = np.linalg.svd(D, full_matrices=False)
        root = np.sqrt(S[:rank])
        B, A = U[:, :rank] * root, root[:, None] * Vh[:rank]
        secs += time.perf_counter() - t
        R = D.astype(np.float64) - B.astype(np.float64) @ A.astype(np.float64)
        sq += float(np.einsum("ij,ij->", R, R))
        differ += outside_count(_f64(b, name), f.read(name), f.tensors[name].dtype, A, B)
        elements += D.size
    return {"method": "mergekit-extract-lora's _low_rank_decomposition (full float32 SVD "
                      "of finetuned - base, sqrt(S) on each side), in numpy",
            "modules": len(list(names)[:limit]), "svd_s": secs, "residual": sq ** 0.5,
            "adapted_elements": elements, "differ": differ,
            "differ_fraction": differ / elements if elements else 0.0}


def measure(base: Path, adapter: Path, work: Path, device: str = "cpu",
            baseline_modules=None, threads: int = 0) -> dict:
    fused = work / "fused"
    t = time.perf_counter()
    lorakit.fuse(base, adapter, fused, progress=False)
    fuse_s = time.perf_counter() - t
    res = _run_extract(base, fused, work / "extracted", device, threads)
    res["threads"] = threads or None
    npz = np.load(str(work / "extracted") + ".npz")
    modules = [k[2:] for k in npz.files if k.startswith("A:")]
    targets = [LoraTarget(m, "linear", npz[f"A:{m}"], npz[f"B:{m}"], 1.0) for m in modules]
    ext = Adapter(fused, "mlx-lm", targets, {}, fused, _sha256="benchmark")
    want = {t.module: t for t in lorakit.load_adapter(adapter).targets}
    b, f = Checkpoint(base), Checkpoint(fused)
    ratios_e, ratios_noise, e_norms = [], [], []
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
        e_norms.append(float(np.linalg.norm(e)))
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
    counts["differ_svd_factors"] = sum(r["outside_svd"] for r in low)  # before the refit
    counts["differ_reported"] = sum(r["outside"] for r in low)  # the report's own count
    counts["refit_iterations_max"] = max(r["iters"] for r in low)
    counts["refit_iterations_median"] = float(np.median([r["iters"] for r in low]))
    counts["differ_svd_fraction"] = counts["differ_svd_factors"] / counts["adapted_elements"]
    counts["differ_fraction"] = counts["differ"] / counts["adapted_elements"]
    counts["differ_gt1ulp_fraction"] = counts["differ_gt1ulp"] / counts["adapted_elements"]
    plain = plain_svd(b, f, [t.module + ".weight" for t in targets], 8, baseline_modules)
    done = {r["module"] for r in low[:plain["modules"]]}
    plain["lorakit_residual"] = float(np.sqrt(sum(r["residual"] ** 2 for r in low
                                                  if r["module"] in done)))
    if plain["modules"] == len(targets):
        plain["extract_over_svd"] = res["extract_s"] / plain["svd_s"]
    return {"fuse_s": fuse_s, "plain_svd": plain, "extract": {k: res[k] for k in
                                          ("extract_s", "refit_s", "process_wall_s", "peak_rss_bytes", "threads",
                                           "user_s", "system_s", "summary")},
            "modules": len(targets),
            "recovery": {"bound": "||D_r - delta||_F <= 2 ||e||_F <= 2 noise",
                         "max_err_over_e": max(ratios_e), "median_err_over_e":
                         float(np.median(ratios_e)), "max_err_over_noise": max(ratios_noise),
                         "all_within_bound": max(ratios_e) <= 2.0},
            "refuse": counts,
            "checkpoint_bytes": sum(i.nbytes for i in b.tensors.values())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--skip-large", action="store_true", help="only the embedded model")
    ap.add_argument("--preset", default="qwen3-1.7b", help="lorakit.synth preset of the large case")
    ap.add_argument("--device", default="cpu", choices=["cpu", "gpu"],
                    help="MLX's default device in the extract's process")
    ap.add_argument("--threads", type=int, default=0,
                    help="extract's threads= (modules at once; default extract's own)")
    ap.add_argument("--baseline-modules", type=int, default=None,
                    help="time the plain SVD on the first N modules only (default all)")
    args = ap.parse_args()
    from lorakit.synth import synth_adapter, synth_checkpoint

    results = {"command": "python benchmarks/extract.py" +
               (" --skip-large" if args.skip_large else "") +
               (f" --preset {args.preset}" if args.preset != "qwen3-1.7b" else "") +
               (f" --device {args.device}" if args.device != "cpu" else "") +
               (f" --threads {args.threads}" if args.threads else "") +
               (f" --json {args.json}" if args.json else ""), "cases": {}}
    with tempfile.TemporaryDirectory(prefix="lorakit-extract-") as tmp:
        tiny = Path(tmp) / "tiny"
        tiny.mkdir()
        results["cases"]["tiny-qwen3"] = measure(ROOT / "data/tiny-qwen3",
                                                 ROOT / "data/adapters/lora", tiny,
                                                 args.device, threads=args.threads)
        print(json.dumps(results["cases"]["tiny-qwen3"]["refuse"]), flush=True)
        if not args.skip_large:
            big = Path(tmp) / "big"
            big.mkdir()
            ck = synth_checkpoint(big / "base", args.preset, progress=False)
            ad = synth_adapter(big / "lora", ck, rank=8)
            results["cases"][args.preset] = measure(ck, ad, big, args.device,
                                                    args.baseline_modules, args.threads)
    text = json.dumps(results, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
