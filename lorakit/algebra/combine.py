"""Adapter algebra: :func:`combine` (N adapters and weights into one) and :func:`convert`.

The combination's intended change on a module is ``D = sum_i w_i s_i B_i A_i`` (``s_i``
each adapter's own scale). ``exact`` holds ``D`` as concatenated factors with one scale
per rank column (fused, rounded once; saved folded, as ``cat``); ``cat`` folds the
scales into ``B`` (exact where they differ by powers of two, else ``fold_rel_err``);
``svd`` truncates ``D`` to a rank; the PEFT methods (``linear``, ``ties``, ``dare_*``,
...) merge A and B separately (:mod:`lorakit.algebra.peft_like`). A DoRA module becomes
a :class:`~lorakit.fusion.delta.SumTarget`: fused only, never saved as an adapter.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from ..errors import AdapterError, ArgumentError, LorakitError, PathLike
from ..fusion.delta import SumTarget, intended, tensor_pieces
from ..io.adapters.base import Adapter, LoraTarget
from ..io.adapters.layout import expert_modules
from ..io.adapters.load import load_adapter
from ..io.adapters.naming import bind
from ..io.adapters.write import save_adapter
from ..io.formats import source
from ..io.formats.weights import weight_f64
from ..io.outputs.gguf import write_lora_gguf
from ..report import Report
from .lowrank import factor_svd
from .peft_like import (
    LIKE_PEFT,
    RANDOM,
    like_peft_target,
    merge,
    peft_dora_magnitudes,
    peft_plan,
)

METHODS = ("exact", "cat", "linear", "svd", "ties", "ties_svd", "magnitude_prune",
           "dare_linear", "dare_ties")

__all__ = ["combine", "CombineOptions", "convert"]

_DORA = "a DoRA change depends on the base weight's row norms"
_FUSE_SUM = "lorakit fuse --adapter-path A --adapter-path B --weights ..."


class Combination(Report):
    """The result of :func:`combine`: the combined :class:`Adapter` (``.adapter``), one
    row per module (rank, and the fold or truncation error), and ``save()``."""
    column_help = {
        "module": "the adapted module",
        "kind": "linear, embedding or switch (MoE experts)",
        "rank_in": "the input adapters' ranks at this module (r1+r2+...)",
        "rank": "rank of the combined adapter (W-dependent: a DoRA sum, fused only)",
        "fold_rel_err": "relative error of folding per-column scales into B (0: exact)",
        "trunc_rel_err": "relative error of the SVD truncation to --rank",
    }

    adapter: Adapter
    method: str

    def save(self, path: PathLike, *, format: str = "mlx-lm", force: bool = False) -> Path:
        """Write the combination as an adapter (``exact`` is saved folded, as ``cat``)."""
        if any(isinstance(t, SumTarget) for t in self.adapter.targets):
            raise AdapterError("a combination with DoRA adapters cannot be saved as an adapter",
                               file=path, hint=f"{_DORA} and is not low rank, so no adapter "
                               "holds the sum", found="DoRA parts in "
                               f"{self.summary.get('dora_modules')} module(s)",
                               expected=f"LoRA adapters only, or fuse the combination ({_FUSE_SUM})")
        ad = self.adapter
        if self.method == "exact":
            ad = replace(ad, targets=[_folded(t)[0] for t in ad.targets])
        prov = {"method": self.method, "weights": self.summary.get("weights"),
                "sources": self.summary.get("adapters"), "like": self.summary.get("like")}
        # PEFT's cat factors are bf16/fp16 values: F32 holds them exactly
        return save_adapter(ad, path, format=format, force=force, dtype="F32",
                            provenance=prov, verb="combine")


def _load(a: Union[PathLike, Adapter]) -> Adapter:
    return a if isinstance(a, Adapter) else load_adapter(a)


def _check_inputs(ads: List[Adapter], weights: Sequence[float], method: str = "exact",
                  like: Optional[str] = None) -> None:
    if not ads:
        raise ArgumentError.bad("adapters", [], "at least one adapter (--adapter-path A "
                                "[--adapter-path B ...])")
    if len(weights) != len(ads):
        raise ArgumentError.bad("weights", list(weights), f"{len(ads)} weights, one per adapter")
    for ad in ads:
        if ad.is_dora and method not in ("exact", "svd") and like is None:
            raise AdapterError(f"DoRA adapters cannot be combined by {method}", file=ad.path,
                               expected="LoRA adapters, or method exact (fused only) "
                               "or svd (with base=)",
                               found="DoRA (magnitude vectors)",
                               hint=f"{_DORA} and is not low rank; {_FUSE_SUM} fuses the exact sum")
        if ad.replacements or (like is None and any(t.base_weight is not None
                                                    for t in ad.targets)):
            raise AdapterError("adapters with whole tensors (modules_to_save) cannot be "
                               "combined by weights", file=ad.path,
                               expected="LoRA factors only", found="modules_to_save copies")


def _groups(ads: List[Adapter]) -> Dict[str, List[Tuple[int, LoraTarget]]]:
    """module -> [(adapter index, target)], modules in first-seen order."""
    out: Dict[str, List[Tuple[int, LoraTarget]]] = {}
    for i, ad in enumerate(ads):
        for t in ad.targets:
            g = out.setdefault(t.module, [])
            if g and (g[0][1].kind != t.kind or g[0][1].shape != t.shape):
                raise AdapterError("adapters disagree on a module's shape", file=ad.path,
                                   tensor=t.module, expected=f"{g[0][1].kind} {g[0][1].shape}",
                                   found=f"{t.kind} {t.shape}")
            g.append((i, t))
    for module, parts in out.items():  # one weight, two spellings: never drop one silently
        if parts[0][1].kind == "switch":
            n = parts[0][1].A.shape[0]
            both = [m for m in expert_modules(module, n) if m in out]
            if both:
                raise AdapterError("adapters name the same MoE experts two ways (stacked "
                                   "and per expert)", tensor=module,
                                   expected="one spelling for every adapter",
                                   found=f"{module} and {both[0]}",
                                   hint="convert them to one format first (lorakit convert)")
    return out


def _cat_target(module: str, parts: List[Tuple[int, LoraTarget]], w: Sequence[float]
                ) -> LoraTarget:
    t0 = parts[0][1]
    A = np.concatenate([t.A for _, t in parts], axis=-2)
    B = np.concatenate([t.B for _, t in parts], axis=-1)
    cols = np.concatenate([np.full(t.rank, float(w[i]) * float(t.scale)) for i, t in parts])
    scale = float(cols[0]) if np.all(cols == cols[0]) else cols  # one scale when it is one
    return LoraTarget(module, t0.kind, A, B, scale, None,
                      tuple(n for _, t in parts for n in t.names))


def _folded(t: LoraTarget) -> Tuple[LoraTarget, float]:
    """The target with its column scales folded into B (scale: the first column's), and
    its largest relative fold error (0.0: exact)."""
    c = np.atleast_1d(np.asarray(t.scale, np.float64))
    if c.size == 1 and c[0] > 0:
        return t, 0.0
    s0 = abs(float(c[0])) or 1.0  # positive: a sign moves into B exactly
    want = t.B.astype(np.float64) * np.broadcast_to(c / s0, (t.rank,))
    B = want.astype(np.float32)
    den = np.abs(want)
    err = float(np.max(np.abs(B - want) / np.where(den > 0, den, 1))) if B.size else 0.0
    return LoraTarget(t.module, t.kind, t.A, B, s0, None, t.names), err


def _delta(t: LoraTarget, w: float) -> np.ndarray:
    """``w * scale * B @ A`` in float64 ((experts,) out, in)."""
    return (w * float(t.scale)) * (t.B.astype(np.float64) @ t.A.astype(np.float64))


def _svd(D: np.ndarray, rank: int, factors: Optional[Tuple[np.ndarray, np.ndarray]] = None
         ) -> Tuple[np.ndarray, np.ndarray, float]:
    """(A, B) float32 of D's rank-R truncation and its relative Frobenius error with
    those factors; given ``factors`` (Bs, A) with ``D = Bs @ A``, by :func:`factor_svd`."""
    U, S, Vh = np.linalg.svd(D, full_matrices=False) if factors is None else \
        factor_svd(factors[1], factors[0])
    R = min(rank, S.shape[-1])
    B = (U[..., :, :R] * S[..., None, :R]).astype(np.float32)
    A = Vh[..., :R, :].astype(np.float32)
    approx = B.astype(np.float64) @ A.astype(np.float64)
    nrm = np.linalg.norm(D)
    return A, B, float(np.linalg.norm(D - approx) / nrm) if nrm > 0 else 0.0


def _factor_merge(method: str, parts: List[Tuple[int, LoraTarget]], w: Sequence[float],
                  density: Optional[float], rng: Optional[np.random.Generator],
                  sign_method: str = "total") -> Tuple[np.ndarray, np.ndarray]:
    """PEFT's merge of the A and of the B factors (lorakit orientation)."""
    ranks = {t.rank for _, t in parts}
    if len(ranks) > 1:
        raise AdapterError(f"{method} combines factors and needs equal ranks",
                           tensor=parts[0][1].module, expected="one rank",
                           found=f"ranks {sorted(ranks)}",
                           hint="use method exact, cat or svd")
    ws = [float(w[i]) * float(t.scale) for i, t in parts]
    wa = [np.sqrt(abs(x)) * (1 if x >= 0 else -1) for x in ws]
    wb = [np.sqrt(abs(x)) for x in ws]
    if parts[0][1].kind == "embedding":  # PEFT's lora_embedding_A is lorakit's B.T
        wa, wb = wb, wa
    kw = dict(density=density, rng=rng, sign_method=sign_method)
    return (merge(method, [t.A for _, t in parts], wa, **kw),
            merge(method, [t.B for _, t in parts], wb, **kw))


@dataclass(frozen=True)
class CombineOptions:
    """How :func:`combine` combines, checked once (its keywords and the CLI's flags):
    ``method``: one of :data:`METHODS`; ``rank``: of ``svd``/``ties_svd`` (default the
    largest input rank); ``density`` (ties, magnitude_prune, dare_*) and ``seed``
    (dare_*); ``like="peft"``: PEFT's ``add_weighted_adapter`` bit for bit, its factors
    built in ``base_dtype``; ``majority_sign_method``: ``"total"`` or ``"frequency"``;
    ``svd_clamp``: PEFT's quantile clamp (``like="peft"`` svd only).
    """

    method: str = "exact"
    rank: Optional[int] = None
    density: Optional[float] = None
    seed: Optional[int] = None
    like: Optional[str] = None
    base_dtype: str = "BF16"
    majority_sign_method: str = "total"
    svd_clamp: Optional[float] = None

    def __post_init__(self) -> None:
        m, like = self.method, self.like
        for name, allowed in (("method", METHODS), ("like", (None, "peft")),
                              ("base_dtype", ("BF16", "F16", "F32")),
                              ("majority_sign_method", ("total", "frequency"))):
            if getattr(self, name) not in allowed:
                raise ArgumentError.bad(name, getattr(self, name), " / ".join(map(str, allowed)))
        if like == "peft" and m not in LIKE_PEFT:
            raise ArgumentError.bad("method", m, " / ".join(LIKE_PEFT) + ": --like peft does "
                                    f"not reproduce {m}",
                                    hint="dare_* draw torch's random masks; lorakit's own "
                                    "dare_* take a seed" if m.startswith("dare") else None)
        r, d, q = self.rank, self.density, self.svd_clamp
        if r is not None and (not isinstance(r, int) or isinstance(r, bool) or r < 1):
            raise ArgumentError.bad("rank", r, "an int >= 1, or None (the largest input rank)")
        if d is not None and not (isinstance(d, (int, float)) and 0 <= d <= 1):
            raise ArgumentError.bad("density", d, "a fraction, 0 <= density <= 1")
        if q is not None and (like != "peft" or not (isinstance(q, (int, float))
                                                     and 0 <= q <= 1)):
            raise ArgumentError.bad("svd_clamp", q, "a quantile 0 <= q <= 1, with like='peft'")
        if m in RANDOM and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ArgumentError.bad("seed", self.seed, f"an int: {m} is random (the same seed "
                                    "gives the same result)")


def combine(adapters: Sequence[Union[PathLike, Adapter]], weights: Optional[Sequence[float]] = None,
            *, options: Optional[CombineOptions] = None, base: Any = None,
            save_path: Optional[PathLike] = None, format: str = "mlx-lm",
            force: bool = False, **settings: Any) -> Combination:
    """Combine adapters (directories or Adapters) with weights (default 1.0 each,
    negative allowed) into one adapter. ``**settings`` (:class:`CombineOptions` fields)
    replace the values of ``options``; ``base``: the checkpoint ``svd`` evaluates DoRA
    parts on (and ``like="peft"`` DoRA magnitudes); ``save_path``: also write it there.

    >>> c = combine(["data/adapters/lora", "data/adapters/lora"], [0.5, 0.5])
    >>> c.adapter.targets[0].rank, c.summary["method"]
    (16, 'exact')
    """
    opts = replace(options or CombineOptions(), **settings)
    method, rank, density, seed, like = opts.method, opts.rank, opts.density, opts.seed, opts.like
    base_dtype, sign_method, svd_clamp = opts.base_dtype, opts.majority_sign_method, opts.svd_clamp
    ads = [_load(a) for a in adapters]
    w = [1.0] * len(ads) if weights is None else [float(x) for x in weights]
    _check_inputs(ads, w, method, like)
    if like == "peft":
        if len(ads) == 1:
            method = "linear"  # PEFT combines a single adapter linearly whatever is asked
        new_rank, new_scale = peft_plan(ads, method, rank)
    rng = np.random.default_rng(seed) if method in RANDOM else None
    targets: List[LoraTarget] = []
    rows: List[Dict[str, Any]] = []
    for module, parts in _groups(ads).items():
        t0 = parts[0][1]
        row: Dict[str, Any] = {"module": module, "kind": t0.kind,
                               "adapters": len(parts), "rank_in": "+".join(
                                   str(t.rank) for _, t in parts)}
        if like == "peft":
            fan = bool(ads[parts[0][0]].config.get("fan_in_fan_out"))
            t = like_peft_target(method, module, parts, w, opts, new_rank, new_scale, fan)
        elif method in ("exact", "svd") and any(t.is_dora for _, t in parts):
            c = _cat_target(module, parts, w)
            mag = next(t.magnitude for _, t in parts if t.is_dora)
            pw = tuple((w[i], p) for i, p in parts)
            t = SumTarget(module, c.kind, c.A, c.B, c.scale, mag, c.names, parts=pw)
            row["dora"] = True
        elif method in ("exact", "cat"):
            t = _cat_target(module, parts, w)
            if method == "cat":
                t, row["fold_rel_err"] = _folded(t)
        elif method in ("svd", "ties_svd"):
            R = rank or max(t.rank for _, t in parts)
            deltas = [_delta(t, w[i]) for i, t in parts]
            if method == "svd":
                D = np.sum(deltas, axis=0)
                c = _cat_target(module, parts, w)
                low = (c.B.astype(np.float64) * np.asarray(c.scale), c.A.astype(np.float64))
            else:
                # PEFT's ties(task_tensors=s_i B_i A_i, weights=w_i): prune and elect
                # the sign on the unweighted deltas, then weight
                D = merge("ties", [_delta(t, 1.0) for _, t in parts], [w[i] for i, _ in parts],
                          density=density, sign_method=sign_method).astype(np.float64)
                low = None
            A, B, err = _svd(D, R, low)
            t = LoraTarget(module, t0.kind, A, B, 1.0, None, t0.names)
            row["trunc_rel_err"] = err
        else:
            A, B = _factor_merge(method, parts, w, density, rng, sign_method)
            t = LoraTarget(module, t0.kind, A, B, 1.0, None, t0.names)
        row["rank"] = "W-dependent" if isinstance(t, SumTarget) else t.rank
        targets.append(t)
        rows.append(row)
    h = hashlib.sha256(repr((method, w, rank, density, seed, like, base_dtype)
                            + ((sign_method,) if sign_method != "total" else ())
                            + ((svd_clamp,) if svd_clamp is not None else ())
                            ).encode())
    if method == "svd" and base is not None:  # DoRA parts were evaluated on it
        h.update(str(getattr(base, "path", base)).encode())
    for ad in ads:
        h.update(ad.sha256.encode())
    fmt = ads[0].format if all(a.format == ads[0].format for a in ads) else "peft"
    out = Adapter(ads[0].path, fmt, targets, {}, ads[0].weights_file, "lora",
                  _sha256=h.hexdigest())
    summary: Dict[str, Any] = {"method": method, "adapters": [str(a.path) for a in ads],
                               "weights": w, "modules": len(targets)}
    if like:
        summary["like"] = f"{like} (factors as PEFT builds them on a {base_dtype} model)"
    if like == "peft" and ads[0].is_dora:
        targets[:] = peft_dora_magnitudes(targets, ads, base, base_dtype)  # out holds it
    if method == "svd" and any(r.get("dora") for r in rows):
        _svd_dora(targets, rows, ads, base, rank)
    dora = sum(bool(r.pop("dora", False)) for r in rows)
    if dora and method == "exact":
        summary["dora_modules"] = dora
        summary["dora"] = ("W-dependent (DoRA) sums: fused exactly (lorakit fuse), not "
                           "savable as an adapter")
    if method == "cat" and not like:
        errs = [r["fold_rel_err"] for r in rows]
        summary["exactly_stored"] = f"{sum(e == 0 for e in errs)} of {len(errs)} modules"
        summary["worst_fold_rel_err"] = max(errs, default=0.0)
    if method in ("svd", "ties_svd") and not like:
        summary["worst_trunc_rel_err"] = max((r["trunc_rel_err"] for r in rows), default=0.0)
    if method in ("ties", "ties_svd", "magnitude_prune", "dare_linear", "dare_ties"):
        summary["density"] = density
    if method in RANDOM:
        summary["seed"] = seed
    cols = ["module", "kind", "rank_in", "rank"] + [k for k in ("fold_rel_err", "trunc_rel_err")
                                                    if rows and k in rows[0]]
    rep = Combination(f"combine ({method}) of {len(ads)} adapter(s)", rows, cols, summary)
    rep.adapter, rep.method = out, method
    if save_path is not None:
        rep.summary["saved"] = str(rep.save(save_path, format=format, force=force))
    return rep


def _svd_dora(targets: List[LoraTarget], rows: List[Dict[str, Any]], ads: List[Adapter],
              base: Any, rank: Optional[int]) -> None:
    """Replace each DoRA :class:`SumTarget` by the rank-R truncation of ``T(W) - W``
    (float64, W read from ``base``), in place, with its error in the row."""
    if base is None:
        raise ArgumentError.bad("base", None, "base=CHECKPOINT (lorakit combine --base, or "
                                "fuse's --model): svd of DoRA adapters needs the base weights",
                                hint=_DORA)
    src = source.open(base)
    idx = [k for k, r in enumerate(rows) if r.get("dora")]
    sums = Adapter(ads[0].path, "mlx-lm", [targets[k] for k in idx], {}, ads[0].weights_file)
    where = {b.target.module: b for b in bind(sums, src)}
    for k in idx:
        t, b = targets[k], where[targets[k].module]
        if t.kind == "switch" or len(b.shape) != 2:
            raise AdapterError("svd of DoRA adapters needs 2-D weights", tensor=t.module,
                               expected="a linear or embedding weight",
                               found=f"{t.kind} {list(b.shape)}")
        W = weight_f64(src, b.tensor)
        (p,) = tensor_pieces([b])
        R = rank or max(pt.rank for _, pt in t.parts)  # type: ignore[attr-defined]
        A, B, err = _svd(intended(W, p) - W, R)
        targets[k] = LoraTarget(t.module, t.kind, A, B, 1.0, None, t.names)
        rows[k].update(rank=int(A.shape[-2]), trunc_rel_err=err)


def convert(adapter: Union[PathLike, Adapter], save_path: PathLike, *, to: str = "peft",
            force: bool = False, num_layers: Optional[int] = None,
            base: Optional[PathLike] = None, outtype: str = "f32",
            experts: str = "modules") -> Path:
    """Write ``adapter`` in format ``to`` (``"peft"`` or ``"mlx-lm"``), its factors in
    their own dtype, bit for bit; or, with ``to="gguf-lora"``, as llama.cpp's LoRA GGUF
    file ``save_path`` (``base``: the model directory whose config.json names the
    architecture, default the adapter's recorded model; ``outtype``: f32 or f16).
    ``experts`` (PEFT): MoE experts as per-expert ``"modules"`` (transformers 4) or
    ``"parameters"``, ``target_parameters`` on transformers 5's fused experts."""
    ad = _load(adapter)
    if to == "gguf-lora":
        return _to_gguf_lora(ad, Path(save_path), base, outtype, force)
    return save_adapter(ad, save_path, format=to, force=force, num_layers=num_layers,
                        verb="convert", provenance={"to": to}, experts=experts)


def _to_gguf_lora(ad: Adapter, out: Path, base: Optional[PathLike], outtype: str,
                  force: bool) -> Path:
    recorded = ad.config.get("model") or ad.config.get("base_model_name_or_path")
    where = Path(base) if base is not None else (Path(recorded) if recorded else None)
    if where is None or not (where / "config.json").is_file():
        raise LorakitError("GGUF-LoRA export needs the base model's config.json",
                           file=where / "config.json" if where else ad.path / "adapter_config.json",
                           expected="a local model directory (--base)",
                           found="no such file" if where else "no recorded base model",
                           hint="pass --base MODEL_DIR")
    config = json.loads((where / "config.json").read_text(encoding="utf-8"))
    if out.resolve() == ad.path.resolve() or ad.path.resolve() in out.resolve().parents:
        raise ArgumentError.bad("save_path", str(out), f"a path outside the adapter "
                                f"directory {ad.path}")
    return write_lora_gguf(ad, config, out, outtype=outtype, force=force)
