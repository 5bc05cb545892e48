"""``lorakit.extract``: a LoRA adapter from two checkpoints (tuned minus base).

For every tensor the two checkpoints hold, streamed one at a time:

* bit-identical tensors are untouched (compared as raw bytes, a slice at a time);
* a changed 2-D linear weight gives ``D = T - W`` in float64 and its truncated SVD
  (:mod:`lorakit.algebra.lowrank`: exact when ``min(out, in) <= 512``, else randomized
  with 16 oversampling columns and 2 power iterations), kept at ``rank`` or at the
  fewest singular values holding ``energy`` of ``||D||_F^2`` (per-module ranks);
* any other changed tensor (embeddings, the head, norms, biases) is saved in full, as
  PEFT's ``modules_to_save`` (lorakit's :class:`~lorakit.io.adapters.base.Replacement`).

Each low-rank row reports ``residual = ||D - scale B A||_F`` of the stored float32
factors and ``noise``, the Frobenius norm of half an ulp of every element of the tuned
weight: what rounding ``W + delta`` to the tuned checkpoint's dtype may add. When the
tuned checkpoint is a correctly rounded fuse of a rank-r adapter, extracting at rank r
gives ``residual <= ||e||_F <= noise`` (``e`` the rounding error: the delta itself is
a rank-r candidate), and the extracted delta is within ``2 ||e||_F`` of the adapter's
(triangle inequality); ``within`` says whether ``residual <= noise``.

Fusing that truncation again does not give ``T`` back everywhere: the SVD keeps the
part of ``e`` in the delta's row and column spaces. With ``refine`` (default for a
fixed rank on a bf16/fp16 tuned checkpoint) each module whose residual is within the
noise is refitted (:mod:`lorakit.algebra.refine`) so that ``round(W + B A)`` of the
stored float32 factors equals ``T`` on as many elements as it can; ``outside_svd`` and
``outside`` count the elements a re-fuse (``nearest``) would change, before and after.

>>> r = extract("data/tiny-qwen3", "data/tiny-qwen3", rank=4, progress=False)
>>> r.summary["low-rank modules"], r.summary["untouched tensors"]
(0, 46)

``lorakit.algebra.resize``: an adapter at a lower rank, from its factors alone.

Each module's delta ``scale * B @ A`` (B (out, r), A (r, in)) is factored by QR of
``B`` and ``A^T`` and the SVD of the r x r core (:func:`lorakit.algebra.lowrank.factor_svd`);
the full delta is never formed. Its best rank-k approximation keeps the k largest
singular values, and the error is exact from the discarded ones:
``||delta - delta_k||_F = sqrt(sum_{i>k} s_i^2)`` (Eckart-Young). Stacked MoE
targets keep one rank for all experts (the largest any expert needs).

DoRA: the low-rank part is resized and the magnitudes are kept. The error in the
rows is the low-rank part's; with ``base=`` each DoRA row also gets ``dora_error``,
``||T_k - T||_F`` of the DoRA-normalised weights (``m * (W + delta) / ||W + delta||``
by rows), which renormalising makes smaller or larger than the low-rank error.

>>> r = resize("data/adapters/lora", rank=4)
>>> r.summary["ranks"], r.rows[0]["rank_before"], r.rows[0]["rank"]
([4], 8, 4)
"""
from __future__ import annotations

import fnmatch
import hashlib
import math
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np
from threadpoolctl import threadpool_limits

from .. import numerics as nm
from ..errors import FormatError
from ..fusion.delta import intended, target_pieces
from ..io import source
from ..io.adapters.base import EMBEDDING_HINTS, Adapter, LoraTarget, Replacement
from ..io.adapters.load import load_adapter
from ..io.adapters.write import save_adapter
from ..io.naming import bind
from ..io.source import TensorSource
from ..io.weights import weight_f64
from ..progress import Progress, progress_bar
from ..report import Report
from .lowrank import (
    EXACT_MAX,
    OVERSAMPLE,
    POWER_ITERS,
    check_target,
    choose_rank,
    factor_svd,
    matrix_svd,
    split_factors,
)
from .refine import WORK, difference, fuse_stats, outside_count, refine_factors, scratch, stats_in_c

__all__ = ['ExtractReport', 'extract', 'svd_note', 'ResizeReport', 'resize']


FLOAT_CODES = ("BF16", "F16", "F32", "F64")
REFINE_CODES = ("BF16", "F16")  # float32 factors can hit every rounding box of these


def svd_note(exact_max: int = EXACT_MAX) -> str:
    return (f"exact f64 SVD where min(out, in) <= {exact_max}, else randomized "
            f"(oversampling {OVERSAMPLE}, {POWER_ITERS} power iterations)")


@dataclass(repr=False)
class ExtractReport(Report):
    """Rows: module, shape, rank, method, fro (``||D||_F``), residual, rel_error,
    noise, within (``residual <= noise``), outside_svd / outside (elements a re-fuse
    changes, before / after the refit), iters (of the refit), note. ``adapter``: the extracted
    :class:`~lorakit.io.adapters.base.Adapter` (fuse it, compare it, save it);
    ``singular_values[module]``: the spectrum each rank was chosen from;
    ``refit_seconds``: time spent in the refit (all modules)."""
    column_help = {
        "module": "the module the LoRA factors belong to",
        "shape": "the weight's shape (out, in)",
        "rank": "rank kept (chosen by --rank or --energy)",
        "method": "exact SVD, randomized SVD, or full (saved whole as modules_to_save)",
        "fro": "||tuned - base||_F, the change's size",
        "residual": "||tuned - base - D_r||_F: what rank r leaves out",
        "rel_error": "residual / fro",
        "noise": "||0.5 ulp of the tuned weight||_F: the rounding noise a fused checkpoint carries",
        "within": "residual <= noise: the rank explains the change up to rounding",
        "outside_svd": "elements where fusing the SVD factors again differs from tuned",
        "outside": "the same for the factors saved (after the refit, if any)",
        "iters": "refit iterations (0: not refitted)",
        "note": "why a tensor was skipped or saved whole",
    }

    adapter: Optional[Adapter] = None
    saved: Optional[Path] = None
    singular_values: Optional[Dict[str, np.ndarray]] = None
    refit_seconds: float = 0.0

    def plot(self, ax=None):
        """Relative truncation error per low-rank module (log scale)."""
        import matplotlib.pyplot as plt  # lazy: matplotlib is optional

        rows = [r for r in self.rows if r["method"] != "full"]
        if ax is None:
            _, ax = plt.subplots(figsize=(8, 3))
        ax.semilogy(range(len(rows)), [max(r["rel_error"], 1e-18) for r in rows], "o")
        ax.set_xlabel("module")
        ax.set_ylabel("||D - BA|| / ||D||")
        ax.set_title(self.title)
        return ax.figure


def _quantized(src: TensorSource) -> bool:
    cfg = src.config or {}
    return bool(cfg.get("quantization") or cfg.get("quantization_config"))


def _selected(module: str, patterns: Optional[Sequence[str]]) -> bool:
    if not patterns:
        return True
    return any(module == p or module.endswith("." + p) or fnmatch.fnmatchcase(module, p)
               for p in patterns)


def _lowrank_candidate(name: str, shape: Sequence[int]) -> bool:
    module, _, leaf = name.rpartition(".")
    last = module.rsplit(".", 1)[-1]
    return (leaf == "weight" and len(shape) == 2 and last not in EMBEDDING_HINTS
            and last != "lm_head")


def _row_chunks(shape: Sequence[int]) -> List[Optional[slice]]:
    if len(shape) == 0:
        return [None]
    return list(nm.chunks(int(shape[0]), int(np.prod(shape[1:], dtype=np.int64))))


def _full_diff(b: TensorSource, t: TensorSource, name: str) -> Dict[str, float]:
    """Changed elements, ``||T - W||_F`` and whether the bytes are the same, a slice
    of rows at a time (bytes first: identical slices cost a compare)."""
    shape = b.tensors[name].shape
    changed, sq, same = 0, 0.0, True
    for rows in _row_chunks(shape):
        rb, rt = b.read(name, rows), t.read(name, rows)
        if np.array_equal(rb, rt):
            continue
        same = False
        d = weight_f64(t, name, rows) - weight_f64(b, name, rows)
        changed += int(np.count_nonzero(d))
        sq += float(np.sum(d * d))
    return {"changed": changed, "fro": math.sqrt(sq), "same": same}


def _check_pair(b: TensorSource, t: TensorSource) -> None:
    for src in (b, t):
        if _quantized(src):
            raise FormatError("extract reads float checkpoints only", file=src.path,
                              expected="a float (bf16/fp16/f32) checkpoint",
                              found="a quantized checkpoint (quantization in config.json)",
                              hint="extract from the float checkpoints, or fuse into a float "
                                   "one first (lorakit fuse --dequantize)")
    errors = []
    for name, info in b.tensors.items():
        if name not in t.tensors:
            errors.append(f"  {name}: in the base, not in the tuned checkpoint")
        elif tuple(t.tensors[name].shape) != tuple(info.shape):
            errors.append(f"  {name}: base shape {list(info.shape)}, tuned "
                          f"{list(t.tensors[name].shape)}")
        elif t.tensors[name].dtype not in FLOAT_CODES or info.dtype not in FLOAT_CODES:
            errors.append(f"  {name}: not float ({info.dtype} / {t.tensors[name].dtype})")
    errors += [f"  {n}: in the tuned checkpoint, not in the base" for n in t.tensors
               if n not in b.tensors]
    if errors:
        raise FormatError(f"{len(errors)} tensor(s) do not pair up:\n" + "\n".join(errors[:40]),
                          file=t.path, expected=f"the tensors of the base at {b.path}",
                          found=f"{len(errors)} mismatch(es), listed above")


def _lowrank_row(name: str, W: np.ndarray, t: TensorSource, t_bits: np.ndarray, code: str,
                 rank: Optional[int], energy: Optional[float], exact_max: int, seed: int,
                 refine: bool):
    """One low-rank module: the SVD of ``T - W``, its counts, and the refit.

    Memory (two modules are in flight by default): each full-size array lives only as
    long as it must. ``W`` (:func:`_base_rows`, from the storage the caller compared) is
    float32 where that is exact (a bf16/fp16/f32 base), else float64. For bf16/fp16
    tuned bits and a float32 ``W``, one pass of the refit kernel's ``stats`` over the
    stored bits writes ``D = T - W`` (float64, exact, in the thread's scratch memory
    that the refit's box then reuses) with its norm and the noise (:func:`difference`),
    and one gives each re-fuse count with its residual (:func:`fuse_stats`): ``T`` is
    never held in float64. Otherwise ``T`` (float64) gives the rounding noise (its half
    ulps a row chunk at a time, never a full-size array) and then becomes ``D = T - W``
    in place; later rows of ``T`` are decoded again from the stored bits (exact). The
    values, and so every result, are those of float64 ``W`` and ``T``."""
    shape = W.shape
    if stats_in_c(W, t_bits, code):
        D = scratch(WORK, shape, np.float64)
        total, sq = difference(W, t_bits, code, D)
        noise = math.sqrt(sq)

        def measured(A: np.ndarray, B: np.ndarray) -> Tuple[int, float]:
            out, rsq = fuse_stats(W, t_bits, code, A, B)
            return out, math.sqrt(rsq)

        def residual_of(A: np.ndarray, B: np.ndarray) -> float:
            return measured(A, B)[1]
    else:
        T = weight_f64(t, name)
        sq = 0.0  # ||0.5 ulp(T)||_F^2, a row chunk at a time (no full-size temporary)
        for rows in nm.chunks(*shape):
            half = 0.5 * nm.ulp(T[rows], code)
            sq += float(np.einsum("ij,ij->", half, half))
        noise = math.sqrt(sq)
        del half
        tuned = _rows_of(T, t_bits, code)
        if tuned is None:  # T cannot be decoded again from the stored bits: keep a copy
            kept = T.copy()
            tuned = lambda rows: kept[rows]  # noqa: E731
        D = np.subtract(T, W, out=T)
        del T
        total = float(np.einsum("ij,ij->", D, D))

        def residual_of(A: np.ndarray, B: np.ndarray) -> float:
            return _residual(W, tuned, A, B)

        def measured(A: np.ndarray, B: np.ndarray) -> Tuple[int, float]:
            return outside_count(W, t_bits, code, A, B), residual_of(A, B)
    U, S, Vt, method = matrix_svd(D, rank, energy, exact_max=exact_max, seed=seed)
    del D
    k = max(choose_rank(S, total, rank, energy), 1)
    A, B = split_factors(U, S, Vt, k)
    del U, Vt
    before, residual = measured(A, B)
    after, iters, secs = before, 0, 0.0
    if refine and code in REFINE_CODES and residual <= noise and before:
        res = refine_factors(W, t_bits, code, A, B, outside=before)
        iters, secs = res.iterations, res.seconds
        # the refit's last count gave the residual too where the kernel served
        refined = math.sqrt(res.resid_sq) if res.resid_sq is not None else \
            residual_of(res.A, res.B)
        if res.outside_after < before and refined <= noise:
            A, B, after, residual = res.A, res.B, res.outside_after, refined
    return _row(name, shape, k, method, total, residual, noise, before, after, iters), A, B, \
        S, secs


def _row(name: str, shape, k: int, method: str, total: float, residual: float, noise: float,
         before: int, after: int, iters: int) -> Dict[str, Any]:
    fro = math.sqrt(total)
    return {"module": name[: -len(".weight")], "shape": list(shape), "rank": k,
            "method": method, "fro": fro, "residual": residual,
            "rel_error": residual / fro if fro else 0.0, "noise": noise,
            "within": "yes" if residual <= noise else "no", "outside_svd": before,
            "outside": after, "iters": iters, "note": ""}


def _base_rows(b: TensorSource, name: str, raw: np.ndarray) -> np.ndarray:
    """The base weight: float32 when its values are all exact in float32 (bf16, fp16 and
    f32 storage: decoded from its storage ``raw``, already read, a row chunk at a time,
    no full float64 copy), else float64."""
    info = b.tensors[name]
    if info.dtype not in ("BF16", "F16", "F32") or len(info.shape) != 2:
        return weight_f64(b, name)
    if b.quant_params(name[: -len(".weight")] if name.endswith(".weight") else name):
        return weight_f64(b, name).astype(np.float32)  # dequantized: exact float32 values
    fmt = nm.float_format(info.dtype)
    W = scratch("W", tuple(info.shape), np.float32)
    for rows in nm.chunks(*W.shape):
        W[rows] = nm.to_float32(raw[rows], fmt)
    return W


def _rows_of(T: np.ndarray, t_bits: np.ndarray, code: str):
    """``rows -> T[rows]`` as float64, decoded again from the stored bits (exact, as
    :func:`weight_f64` decodes them) where they are a float format; else None."""
    if code == "F64" and t_bits.shape == T.shape:
        return lambda rows: np.asarray(t_bits[rows], np.float64)
    if code in FLOAT_CODES and t_bits.shape == T.shape:  # as weight_f64 decodes them
        fmt = nm.float_format(code)
        return lambda rows: nm.to_float64(t_bits[rows], fmt)
    return None


def _residual(W: np.ndarray, tuned, A: np.ndarray, B: np.ndarray) -> float:
    """``||T - W - B A||_F`` (float64, a slice of rows at a time; ``tuned(rows)``: the
    rows of ``T``; ``W`` float64 or an exact float32)."""
    A64, B64, sq = A.astype(np.float64), B.astype(np.float64), 0.0
    for rows in nm.chunks(W.shape[0], W.shape[1]):
        R = tuned(rows) - W[rows]
        R -= B64[rows] @ A64
        sq += float(np.einsum("ij,ij->", R, R))
    return math.sqrt(sq)


def extract(base: Any, tuned: Any, *, rank: Optional[int] = None,
            energy: Optional[float] = None, modules: Optional[Sequence[str]] = None,
            save_path: Any = None, format: str = "peft", force: bool = False,
            exact_max: int = EXACT_MAX, seed: int = 0, refine: Optional[bool] = None,
            threads: Optional[int] = None, progress: Progress = True) -> ExtractReport:
    """Extract a LoRA adapter from a tuned checkpoint (fused, or fully fine-tuned) and
    its base.

    Args:
        base, tuned: checkpoint directories (or tensor sources) of the same model.
        rank: keep this rank in every module; or
        energy: per module, the fewest singular values holding this fraction of
            ``||T - W||_F^2`` (per-module ranks).
        modules: only modules matching these names or patterns (``q_proj``,
            ``self_attn.o_proj``, ``model.layers.1*``); default all.
        save_path: also write the adapter there (``lorakit.io.adapters.write``, float32
            factors, scale 1).
        format: ``"peft"`` (default: per-module ranks and full copies fit) or ``"mlx-lm"``.
        force: replace a previous lorakit output at ``save_path``.
        exact_max: largest ``min(out, in)`` that gets the exact SVD.
        seed: seed of the randomized SVD's sketch.
        refine: refit each low-rank module so that fusing the saved adapter again
            (``nearest``) reproduces the tuned checkpoint on as many elements as it
            can (:mod:`lorakit.algebra.refine`); default: on with ``rank``, off with
            ``energy``. Only for bf16/fp16 tuned weights whose residual is within
            the rounding noise (a rank-r fuse); kept only where it lowers the count
            and the residual stays within the noise.
        threads: low-rank modules worked on at once (the SVD and the refit release
            the GIL); default ``min(2, cpu_count)``. Each module in flight holds its
            own float64 copies (about 40 bytes per element with the refit), so memory
            grows with it. The result does not depend on it: every module is computed
            alone, with its own seed, and the rows keep the checkpoint's order.
        progress: True (a bar), False, or ``progress(done_bytes, total_bytes)``.

    Returns:
        An :class:`ExtractReport`; ``.adapter`` is the extracted adapter.
    """
    check_target(rank, energy)
    refine = rank is not None if refine is None else bool(refine)
    b, t = source.open(base), source.open(tuned)
    _check_pair(b, t)
    targets: List[LoraTarget] = []
    replacements: List[Replacement] = []
    rows: List[Dict[str, Any]] = []
    spectra: Dict[str, np.ndarray] = {}
    untouched = skipped = 0
    refine_s = 0.0
    total = sum(i.nbytes for i in b.tensors.values())
    threads = max(1, threads if threads is not None else min(2, os.cpu_count() or 1))

    def lowrank(name: str):
        raw_b, raw_t = b.read(name), t.read(name)
        if np.array_equal(raw_b, raw_t):
            return None
        W = _base_rows(b, name, raw_b)
        del raw_b
        return name, _lowrank_row(name, W, t, raw_t, t.tensors[name].dtype, rank, energy,
                                  exact_max, seed, refine)

    # one slot per tensor in checkpoint order: a low-rank module's slot is its future
    slots: List[Tuple[str, Any]] = []
    pending: Deque[Any] = deque()
    # the modules in flight share the cores: BLAS (the SVDs, the r x r solves) gets its
    # share each, not a pool per module whose threads wait on one another
    blas = max(1, (os.cpu_count() or 1) // threads)
    with progress_bar(progress, total, "extract") as bar, \
            threadpool_limits(limits=blas, user_api="blas"), \
            ThreadPoolExecutor(threads, thread_name_prefix="lorakit-extract") as pool:
        def settle(fut) -> None:
            fut.result()  # an error surfaces here, in checkpoint order
            bar.update(fut.nbytes)

        for name, info in b.tensors.items():
            module, _, leaf = name.rpartition(".")
            if not _selected(module, modules):
                skipped += 1
                bar.update(info.nbytes)
            elif _lowrank_candidate(name, info.shape):
                fut = pool.submit(lowrank, name)
                fut.nbytes = info.nbytes
                slots.append(("lowrank", fut))
                pending.append(fut)
                while len(pending) > threads:
                    settle(pending.popleft())
            else:
                diff = _full_diff(b, t, name)
                if diff["same"]:
                    untouched += 1
                else:
                    slots.append(("full", (name, module, leaf, info, diff)))
                bar.update(info.nbytes)
        while pending:
            settle(pending.popleft())
    for kind, item in slots:
        if kind == "lowrank":
            res = item.result()
            if res is None:
                untouched += 1
                continue
            name, (row, A, B, S, secs) = res
            refine_s += secs
            rows.append(row)
            spectra[row["module"]] = S
            targets.append(LoraTarget(row["module"], "linear", A, B, 1.0,
                                      names=(name,)))
        else:
            name, module, leaf, info, diff = item
            replacements.append(Replacement(module, leaf, t.read(name),
                                            t.tensors[name].dtype, name))
            rows.append({"module": name, "shape": list(info.shape), "rank": "-",
                         "method": "full", "fro": diff["fro"], "residual": 0.0,
                         "rel_error": 0.0, "noise": "-", "within": "-",
                         "outside_svd": "-", "outside": "-", "iters": "-", "note": f"saved in full: {diff['changed']} elements differ"})
    h = hashlib.sha256()
    for tg in targets:
        h.update(tg.module.encode() + tg.A.tobytes() + tg.B.tobytes())
    for r in replacements:
        h.update(r.name.encode() + r.raw.tobytes())
    adapter = Adapter(Path(getattr(t, "path", "tuned")), format, targets,
                      {"extracted_from": {"base": str(b.path), "tuned": str(t.path)}},
                      Path(getattr(t, "path", "tuned")), "lora", replacements,
                      _sha256=h.hexdigest())
    low = [r for r in rows if r["method"] != "full"]
    summary: Dict[str, Any] = {
        "base": str(b.path), "tuned": str(t.path),
        "target": f"rank {rank}" if rank is not None else f"energy {energy}",
        "low-rank modules": len(low), "saved in full": len(replacements),
        "untouched tensors": untouched, "skipped (--modules)": skipped,
        "ranks": sorted({r["rank"] for r in low}),
        "max rel_error": max((r["rel_error"] for r in low), default=0.0),
        "within rounding noise": f"{sum(r['within'] == 'yes' for r in low)} of {len(low)}",
        "svd": svd_note(exact_max),
        "refit": ("on (Gauss-Newton on the rank-r factors, box shrunk by r / min(out, in) "
                  "of a half spacing, 1/4096 to 1/64)" if refine else "off"),
        "refit iterations": max((r["iters"] for r in low), default=0),
        "re-fuse differs": _refuse_note(low),
    }
    flagged = [i for i, r in enumerate(rows) if r["within"] == "no"]
    rep = ExtractReport(f"extract: {t.label or t.path} - {b.label or b.path}", rows,
                        columns=["module", "shape", "rank", "method", "fro", "residual",
                                 "rel_error", "noise", "within", "outside_svd", "outside",
                                 "iters", "note"],
                        summary=summary, flagged=flagged, adapter=adapter,
                        singular_values=spectra, refit_seconds=refine_s)
    if save_path is not None:
        rep.saved = save_result(adapter, save_path, format=format, force=force,
                                provenance={"base": str(b.path), "tuned": str(t.path),
                                            "target": summary["target"]})
        rep.summary["saved to"] = str(rep.saved)
    return rep


def _refuse_note(low: List[Dict[str, Any]]) -> str:
    """``"SVD a -> saved b of n adapted elements (share)"``: how many elements fusing
    the adapter again would change, before and after the refit."""
    n = sum(int(np.prod(r["shape"])) for r in low)
    a = sum(r["outside_svd"] for r in low)
    c = sum(r["outside"] for r in low)
    return (f"SVD {a:,} -> saved {c:,} of {n:,} adapted elements ({c / n:.4%})" if n
            else "no low-rank modules")


def save_result(adapter: Adapter, path: Any, *, format: str, force: bool,
                verb: str = "extract", provenance: Optional[Dict[str, Any]] = None) -> Path:
    """Write a computed adapter with lorakit's adapter writer, factors in float32 (the
    precision they were computed to)."""
    return save_adapter(adapter, path, format=format, force=force, dtype="F32", verb=verb,
                        provenance=provenance)


# ---------------------------------------------------------------------------
# An adapter at a lower rank, from its factors alone


@dataclass(repr=False)
class ResizeReport(Report):
    """Rows: module, expert count, rank_before, rank, fro (``||delta||_F``), error
    (``||delta - delta_k||_F``, exact), rel_error, energy kept, dora_error (DoRA with a
    base). ``adapter``: the resized :class:`~lorakit.io.adapters.base.Adapter`;
    ``singular_values[module]``: each module's spectrum (per expert for MoE)."""
    column_help = {
        "module": "the adapted module",
        "experts": "number of stacked MoE experts (1 for a plain module)",
        "rank_before": "the adapter's rank",
        "rank": "rank kept",
        "fro": "||delta||_F of the adapter's low-rank delta",
        "error": "||delta - delta_k||_F, exact from the discarded singular values",
        "rel_error": "error / fro",
        "energy": "share of ||delta||_F^2 kept",
        "dora_error": "DoRA only, with base=: the error after DoRA's row normalisation",
    }

    adapter: Optional[Adapter] = None
    saved: Optional[Path] = None
    singular_values: Optional[Dict[str, List[np.ndarray]]] = None


def _resize_target(t: LoraTarget, rank: Optional[int], energy: Optional[float]):
    svds = [factor_svd(p.A, p.B, p.scale) for p in target_pieces(t)]
    k = max(choose_rank(S, float(np.sum(S ** 2)), rank, energy) for _, S, _ in svds)
    k = max(k, 1)
    parts = [split_factors(U, S, Vt, k, t.scale) for U, S, Vt in svds]
    if t.kind == "switch":
        A = np.stack([a for a, _ in parts])
        B = np.stack([b for _, b in parts])
    else:
        (A, B), = parts
    fro = math.sqrt(sum(float(np.sum(S ** 2)) for _, S, _ in svds))
    err = math.sqrt(sum(float(np.sum(S[k:] ** 2)) for _, S, _ in svds))
    return replace(t, A=A, B=B), k, fro, err, [S for _, S, _ in svds]


def _dora_error(old: LoraTarget, new: LoraTarget, binds: Dict[str, Any], src) -> float:
    """``||T_new - T_old||_F`` of the DoRA-normalised weights on the base."""
    b = binds[old.module]
    W = weight_f64(src, b.tensor)
    sq = 0.0
    for po, pn in zip(target_pieces(old), target_pieces(new)):
        Ws = W if po.slot is None or W.ndim == 2 else W[po.slot]
        d = intended(Ws, pn) - intended(Ws, po)
        sq += float(np.einsum("ij,ij->", d, d))
    return math.sqrt(sq)


def resize(adapter: Any, *, rank: Optional[int] = None, energy: Optional[float] = None,
           base: Any = None, save_path: Any = None, format: str = "peft",
           force: bool = False) -> ResizeReport:
    """Resize an adapter to rank ``rank`` (or, per module, the fewest singular values
    holding ``energy`` of ``||delta||_F^2``), with the exact error per module.

    Args:
        adapter: an adapter directory (mlx-lm or PEFT) or a loaded Adapter.
        rank / energy: exactly one; a module already at or below ``rank`` keeps its
            delta exactly (re-factored).
        base: optional base checkpoint: DoRA rows then also report ``dora_error``.
        save_path / format / force: also write the result (as :func:`lorakit.extract`).

    Returns:
        A :class:`ResizeReport`; ``.adapter`` is the resized adapter.
    """
    check_target(rank, energy)
    ad = adapter if isinstance(adapter, Adapter) else load_adapter(adapter)
    src = source.open(base) if base is not None else None
    binds = {b.target.module: b for b in bind(ad, src)} if src is not None and ad.is_dora \
        else {}
    targets: List[LoraTarget] = []
    rows: List[Dict[str, Any]] = []
    spectra: Dict[str, List[np.ndarray]] = {}
    for t in ad.targets:
        new, k, fro, err, Ss = _resize_target(t, rank, energy)
        targets.append(new)
        spectra[t.module] = Ss
        row: Dict[str, Any] = {
            "module": t.module, "experts": len(Ss) if t.kind == "switch" else "-",
            "rank_before": t.rank, "rank": k, "fro": fro, "error": err,
            "rel_error": err / fro if fro else 0.0,
            "energy": 1 - (err / fro) ** 2 if fro else 1.0, "dora_error": "-"}
        if t.is_dora and binds:
            row["dora_error"] = _dora_error(t, new, binds, src)
        rows.append(row)
    out = replace(ad, targets=targets, _sha256=None)
    out.config = dict(ad.config, resized={"rank": rank, "energy": energy})
    h = hashlib.sha256(str(ad.path).encode())
    for t in targets:
        h.update(t.module.encode() + t.A.tobytes() + t.B.tobytes())
    out._sha256 = h.hexdigest()
    summary: Dict[str, Any] = {
        "adapter": str(ad.path), "target": f"rank {rank}" if rank is not None
        else f"energy {energy}", "modules": len(rows),
        "ranks": sorted({r["rank"] for r in rows}),
        "max rel_error": max((r["rel_error"] for r in rows), default=0.0),
        "dora": "low-rank part resized, magnitudes kept" if ad.is_dora else "no",
        "method": "QR of B and A^T, SVD of the r x r core (full delta never formed)",
    }
    rep = ResizeReport(f"resize: {ad.path.name}", rows, summary=summary, adapter=out,
                       singular_values=spectra)
    if save_path is not None:
        rep.saved = save_result(out, save_path, format=format, force=force, verb="resize",
                                provenance={"source": str(ad.path),
                                            "target": summary["target"]})
        rep.summary["saved to"] = str(rep.saved)
    return rep
