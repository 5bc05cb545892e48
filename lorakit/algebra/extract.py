"""``lorakit.extract`` (a LoRA from tuned minus base) and ``lorakit.algebra.resize``.

extract streams the tensors of two checkpoints: bit-identical ones are untouched, a
changed 2-D linear weight gives the truncated SVD of ``D = T - W`` (float64, at ``rank``
or per module at ``energy``), any other changed tensor is saved in full
(``modules_to_save``). Each row reports the kept energy, the residual of the float32
factors against the tuned weight's rounding noise, and the share a re-fuse gives back.
resize truncates an adapter from its factors alone (QR of B and A^T, SVD of the core),
with the exact Eckart-Young error; DoRA keeps its magnitudes.

>>> r = extract("data/tiny-qwen3", "data/tiny-qwen3", rank=4, progress=False)
>>> r.summary["low-rank modules"], r.summary["untouched tensors"]
(0, 46)
>>> r = resize("data/adapters/lora", rank=4)
>>> r.summary["ranks"], r.rows[0]["rank_before"], r.rows[0]["rank"]
([4], 8, 4)
"""
from __future__ import annotations

import fnmatch
import hashlib
import math
import numbers
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Deque, Dict, List, Optional, Tuple, Union

import numpy as np

from .. import numerics as nm
from ..errors import ArgumentError, FormatError, FuseError
from ..fusion.core import fuse_weight
from ..fusion.delta import intended, target_pieces
from ..io.adapters.base import EMBEDDING_HINTS, Adapter, LoraTarget, Replacement
from ..io.adapters.load import load_adapter
from ..io.adapters.naming import bind
from ..io.adapters.write import save_adapter
from ..io.formats import source
from ..io.formats.source import TensorSource
from ..io.formats.weights import weight_f64
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

__all__ = ["ExtractOptions", "ExtractReport", "extract", "resize"]


FLOAT_CODES = ("BF16", "F16", "F32", "F64")
FORMATS = ("peft", "mlx-lm")
#: the dtype policy that re-fuses into each tuned dtype (lorakit.fusion.core.fuse_weight)
_POLICY = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


@dataclass(frozen=True)
class ExtractOptions:
    """An extract's settings, checked once (the CLI builds it from its flags): ``rank``
    or ``energy`` (exactly one), ``modules`` (names or patterns; default all),
    ``format`` (peft or mlx-lm), ``exact_max`` (largest ``min(out, in)`` given the exact
    SVD), ``seed``, ``threads`` (modules in flight, default ``min(2, cores)``; the result
    does not depend on it), ``behaviour`` (True: 1024 tokens, a token count, or False).

    >>> ExtractOptions(rank=8).target
    'rank 8'
    """

    rank: Optional[int] = None
    energy: Optional[float] = None
    modules: Optional[Tuple[str, ...]] = None
    format: str = "peft"
    exact_max: int = EXACT_MAX
    seed: int = 0
    threads: Optional[int] = None
    behaviour: Union[bool, int] = True

    def __post_init__(self) -> None:
        check_target(self.rank, self.energy)
        if isinstance(self.modules, str):
            object.__setattr__(self, "modules", (self.modules,))
        elif self.modules is not None:
            object.__setattr__(self, "modules", tuple(self.modules))
        if self.format not in FORMATS:
            raise ArgumentError.bad("format", self.format, " or ".join(FORMATS))
        for name, low in (("exact_max", 0), ("seed", 0), ("threads", 1)):
            v = getattr(self, name)
            if not (v is None and name == "threads") and (
                    isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < low):
                raise ArgumentError.bad(name, v, f"an int >= {low}")
        b = self.behaviour
        if not isinstance(b, bool) and (not isinstance(b, numbers.Integral) or b < 2):
            raise ArgumentError.bad("behaviour", b, "True, False or a token count >= 2")

    @property
    def target(self) -> str:
        return f"rank {self.rank}" if self.rank is not None else f"energy {self.energy}"

    @classmethod
    def of(cls, options: Optional["ExtractOptions"], settings: Dict[str, Any]
           ) -> "ExtractOptions":
        """``options`` with ``settings`` (keywords of :func:`extract`) applied."""
        names = {f.name for f in fields(cls)}
        for key in settings:
            if key not in names:
                raise ArgumentError.bad(key, settings[key], "one of " + ", ".join(sorted(names)))
        return cls(**settings) if options is None else replace(options, **settings)


@dataclass(repr=False)
class ExtractReport(Report):
    """One row per module (``column_help``); ``adapter``: the extracted Adapter;
    ``singular_values[module]``: each rank's spectrum; ``behaviour``: KL and top-1 of
    the tuned model against base + adapter (filled by :func:`lorakit.extract`) or None."""
    column_help = {
        "module": "the module the LoRA factors belong to",
        "shape": "the weight's shape (out, in)",
        "rank": "rank kept (chosen by --rank or --energy)",
        "method": "exact SVD, randomized SVD, or full (saved whole as modules_to_save)",
        "fro": "||tuned - base||_F, the change's size",
        "residual": "||tuned - base - B A||_F: what the saved factors leave out",
        "rel_error": "residual / fro",
        "energy": "share of ||tuned - base||_F^2 kept",
        "noise": "||0.5 ulp of the tuned weight||_F: the rounding noise a fused checkpoint carries",
        "within": "residual <= noise: the rank explains the change up to rounding",
        "reproduced": "share of elements a re-fuse (nearest) gives back bit for bit",
        "note": "why a tensor was skipped or saved whole",
    }

    adapter: Optional[Adapter] = None
    saved: Optional[Path] = None
    singular_values: Optional[Dict[str, np.ndarray]] = None
    behaviour: Optional[Dict[str, Any]] = None

    def to_dict(self) -> Dict[str, Any]:
        d = super().to_dict()
        if self.behaviour is not None:
            d["behaviour"] = dict(self.behaviour)
        return d

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


def _f64(raw: np.ndarray, code: str) -> np.ndarray:
    """Storage of a float format as float64, exactly."""
    return np.asarray(raw, np.float64) if code == "F64" else \
        nm.to_float64(raw, nm.float_format(code))


def _full_diff(b: TensorSource, t: TensorSource, name: str) -> Dict[str, float]:
    """Changed elements, ``||T - W||_F`` and whether the bytes are the same, a slice
    of rows at a time (an embedding is large; identical slices cost a compare)."""
    shape = b.tensors[name].shape
    changed, sq, same = 0, 0.0, True
    steps = nm.chunks(int(shape[0]), math.prod(shape[1:])) if len(shape) else [None]
    for rows in steps:
        rb, rt = b.read(name, rows), t.read(name, rows)
        if np.array_equal(rb, rt):
            continue
        same = False
        d = _f64(rt, t.tensors[name].dtype) - _f64(rb, b.tensors[name].dtype)
        changed += int(np.count_nonzero(d))
        sq += float(np.sum(d * d))
    return {"changed": changed, "fro": math.sqrt(sq), "same": same}


def _check_pair(b: TensorSource, t: TensorSource) -> None:
    for src in (b, t):
        cfg = src.config or {}
        if cfg.get("quantization") or cfg.get("quantization_config"):
            raise FormatError(f"extract reads float checkpoints only: {src.path} is quantized",
                              file=src.path,
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


def _lowrank_row(name: str, raw_b: np.ndarray, code_b: str, raw_t: np.ndarray, code_t: str,
                 opts: ExtractOptions):
    """One low-rank module: the truncated SVD of ``D = T - W`` (float64, built a row chunk
    at a time with the noise of ``T``), the residual of the float32 factors, the re-fuse."""
    shape = raw_b.shape
    D = np.empty(shape, np.float64)
    total = noise_sq = 0.0
    for rows in nm.chunks(*shape):
        T = _f64(raw_t[rows], code_t)
        half = 0.5 * (np.spacing(np.abs(T)) if code_t == "F64" else nm.ulp(T, code_t))
        noise_sq += float(np.einsum("ij,ij->", half, half))
        d = D[rows]
        np.subtract(T, _f64(raw_b[rows], code_b), out=d)
        total += float(np.einsum("ij,ij->", d, d))
    U, S, Vt, method = matrix_svd(D, opts.rank, opts.energy, exact_max=opts.exact_max,
                                  seed=opts.seed, total=total)
    k = max(choose_rank(S, total, opts.rank, opts.energy), 1)
    A, B = split_factors(U, S, Vt, k)
    del U, Vt
    A64, B64, sq = A.astype(np.float64), B.astype(np.float64), 0.0
    for rows in nm.chunks(*shape):
        R = D[rows] - B64[rows] @ A64
        sq += float(np.einsum("ij,ij->", R, R))
    del D
    energy = min(float(np.sum(S[:k] ** 2)) / total, 1.0) if total else 1.0
    reproduced = _reproduced(raw_b, code_b, raw_t, code_t, A, B)
    row = _row(name[: -len(".weight")], shape, k, method, math.sqrt(total), math.sqrt(sq),
               energy, math.sqrt(noise_sq), reproduced, "")
    return row, A, B, S


def _row(*values: Any) -> Dict[str, Any]:
    """One row of an extract report, in ``column_help`` order, from (module, shape, rank,
    method, fro, residual, energy, noise, reproduced, note)."""
    module, shape, rank, method, fro, residual, energy, noise, reproduced, note = values
    within = "-" if noise == "-" else "yes" if residual <= noise else "no"
    rel = residual / fro if fro else 0.0
    values = (module, list(shape), rank, method, fro, residual, rel, energy, noise, within)
    return dict(zip(ExtractReport.column_help, values + (reproduced, note)))


def _reproduced(raw_b: np.ndarray, code_b: str, raw_t: np.ndarray, code_t: str,
                A: np.ndarray, B: np.ndarray) -> Any:
    """The share of elements where ``nearest(W + B A)`` in the tuned dtype has the tuned
    bits; ``"-"`` where lorakit cannot fuse into that dtype (float64)."""
    if code_b not in _POLICY or code_t not in _POLICY:
        return "-"
    try:
        out, _ = fuse_weight(raw_b, code_b, A, B, 1.0, dtype_policy=_POLICY[code_t])
    except FuseError:  # a non-finite result: nothing to compare
        return "-"
    u = f"u{out.itemsize}"
    return int(np.count_nonzero(out.view(u) == raw_t.view(u))) / max(out.size, 1)


def extract(base: Any, tuned: Any, options: Optional[ExtractOptions] = None, *,
            save_path: Any = None, force: bool = False, progress: Progress = True,
            **settings: Any) -> ExtractReport:
    """Extract a LoRA adapter from a tuned checkpoint and its base (a truncated SVD per
    module; :func:`lorakit.extract` adds the behaviour line).

    ``options``: an :class:`ExtractOptions`, whose fields keywords (``rank=8``, ...) also
    set or override. ``save_path``: also write the adapter there (float32 factors, scale
    1; ``force`` replaces an earlier lorakit output). ``progress``: True, False or
    ``progress(done_bytes, total_bytes)``. ``.adapter`` of the report is the result.
    """
    opts = ExtractOptions.of(options, settings)
    b, t = source.open(base), source.open(tuned)
    _check_pair(b, t)
    targets: List[LoraTarget] = []
    replacements: List[Replacement] = []
    rows: List[Dict[str, Any]] = []
    spectra: Dict[str, np.ndarray] = {}
    untouched = skipped = 0
    total = sum(i.nbytes for i in b.tensors.values())
    threads = opts.threads or min(2, os.cpu_count() or 1)

    def lowrank(name: str):
        raw_b, raw_t = b.read(name), t.read(name)
        if np.array_equal(raw_b, raw_t):
            return None
        return name, _lowrank_row(name, raw_b, b.tensors[name].dtype, raw_t,
                                  t.tensors[name].dtype, opts)

    # one slot per tensor in checkpoint order: a low-rank module's slot is its future
    slots: List[Tuple[str, Any]] = []
    pending: Deque[Any] = deque()
    with progress_bar(progress, total, "extract") as bar, \
            ThreadPoolExecutor(threads, thread_name_prefix="lorakit-extract") as pool:
        def settle(fut) -> None:
            fut.result()  # an error surfaces here, in checkpoint order
            bar.update(fut.nbytes)

        for name, info in b.tensors.items():
            module, _, leaf = name.rpartition(".")
            last = module.rsplit(".", 1)[-1]
            if opts.modules and not any(module == p or module.endswith("." + p)
                                        or fnmatch.fnmatchcase(module, p) for p in opts.modules):
                skipped += 1
                bar.update(info.nbytes)
            elif (leaf == "weight" and len(info.shape) == 2 and last not in EMBEDDING_HINTS
                  and last != "lm_head"):
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
            name, (row, A, B, S) = res
            rows.append(row)
            spectra[row["module"]] = S
            targets.append(LoraTarget(row["module"], "linear", A, B, 1.0, names=(name,)))
        else:
            name, module, leaf, info, diff = item
            replacements.append(Replacement(module, leaf, t.read(name),
                                            t.tensors[name].dtype, name))
            note = f"saved in full: {diff['changed']} elements differ"
            rows.append(_row(name, info.shape, "-", "full", diff["fro"], 0.0, 1.0, "-", 1.0, note))
    h = _factors_hash(hashlib.sha256(), targets)
    for r in replacements:
        h.update(r.name.encode() + r.raw.tobytes())
    tp = Path(getattr(t, "path", "tuned"))
    cfg = {"extracted_from": {"base": str(b.path), "tuned": str(t.path)}}
    adapter = Adapter(tp, opts.format, targets, cfg, tp, "lora", replacements)
    adapter._sha256 = h.hexdigest()
    low = [r for r in rows if r["method"] != "full"]
    counted = [r for r in low if r["reproduced"] != "-"]
    n = sum(math.prod(r["shape"]) for r in counted)
    same = sum(round(r["reproduced"] * math.prod(r["shape"])) for r in counted)
    summary: Dict[str, Any] = {
        "base": str(b.path), "tuned": str(t.path), "target": opts.target,
        "low-rank modules": len(low), "saved in full": len(replacements),
        "untouched tensors": untouched, "skipped (--modules)": skipped,
        "ranks": sorted({r["rank"] for r in low}),
        "max rel_error": max((r["rel_error"] for r in low), default=0.0),
        "within rounding noise": f"{sum(r['within'] == 'yes' for r in low)} of {len(low)}",
        "svd": f"exact f64 SVD where min(out, in) <= {opts.exact_max}, else randomized f32 "
               f"(oversampling {OVERSAMPLE}, {POWER_ITERS} power iterations)",
        # what fusing the adapter again gives back bit for bit (where lorakit can fuse)
        "re-fuse reproduces": f"{same:,} of {n:,} adapted elements ({same / n:.4%})" if n else "-",
    }
    flagged = [i for i, r in enumerate(rows) if r["within"] == "no"]
    rep = ExtractReport(f"extract: {t.label or t.path} - {b.label or b.path}", rows,
                        columns=list(ExtractReport.column_help),
                        summary=summary, flagged=flagged, adapter=adapter,
                        singular_values=spectra)
    if save_path is not None:
        prov = {"base": str(b.path), "tuned": str(t.path), "target": opts.target}
        rep.saved = save_adapter(adapter, save_path, format=opts.format, force=force,
                                 dtype="F32", verb="extract", provenance=prov)
        rep.summary["saved to"] = str(rep.saved)
    return rep


def _factors_hash(h, targets: List[LoraTarget]):
    for t in targets:
        h.update(t.module.encode() + t.A.tobytes() + t.B.tobytes())
    return h


@dataclass(repr=False)
class ResizeReport(Report):
    """One row per module (``column_help``); ``adapter``: the resized Adapter;
    ``singular_values[module]``: each module's spectra (one per MoE expert)."""
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
    """Resize an adapter (a directory or an Adapter) to ``rank`` or, per module, the
    fewest singular values holding ``energy`` of ``||delta||_F^2`` (exactly one), with
    the exact error per module; a module at or below ``rank`` keeps its delta exactly.
    ``base``: DoRA rows then also report ``dora_error``. ``save_path``/``format``/
    ``force``: as :func:`extract`. ``.adapter`` of the report is the result.
    """
    check_target(rank, energy)
    if format not in FORMATS:
        raise ArgumentError.bad("format", format, " or ".join(FORMATS))
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
    out._sha256 = _factors_hash(hashlib.sha256(str(ad.path).encode()), targets).hexdigest()
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
        prov = {"source": str(ad.path), "target": summary["target"]}
        rep.saved = save_adapter(out, save_path, format=format, force=force, dtype="F32",
                                 verb="resize", provenance=prov)
        rep.summary["saved to"] = str(rep.saved)
    return rep
