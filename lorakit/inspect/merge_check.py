"""Did the merge work? A fused checkpoint measured against the exact intended result.

For each adapted weight, ``T`` is the exact intended result in float64
(``W + scale * B @ A``, DoRA-normalised when the adapter has magnitudes:
:func:`lorakit.fusion.delta.intended`, the one definition). The check measures,
element by element, ``|F - T|`` against what rounding to the stored dtype can
explain (:mod:`lorakit.inspect.merge_bounds`: half an ulp for a correctly rounded
fuse, the double rounding of the mlx-lm and PEFT orders, the quantization step of each
group for a re-quantized weight). ``distance`` is the largest ratio: at most 1 for a
correct merge made in any of those orders, whatever the tool.

Status per tensor and overall:

``ok``
    every element within the bound; the verdict is ``ok``, or ``rounding-limited`` /
    ``partially lost to quantization`` / ``lost to quantization`` when even a correct
    fuse keeps under 80% (20%) of the delta (right, but the fused model behaves more
    like the base), ``replaced`` for a PEFT ``modules_to_save`` copy.
``promoted``
    numerically right but stored in a wider dtype than the base without the fuse being
    asked to convert (the f32 promotion of a missing cast: bytes doubled).
``wrong``
    with the cause where it can be named (:mod:`lorakit.inspect.merge_causes`):
    ``not applied``, ``applied twice``, ``wrong scale`` (the factor and what it looks
    like), ``another adapter``, ``transposed``, ``DoRA magnitude missing``,
    ``different base``, ``changed otherwise``, ``dtype changed``, ``missing``,
    ``extra tensor``, ``changed without adapter`` (a tensor the adapter does not touch
    is not bit for bit the base, or its documented conversion), ``replacement
    differs``.

:meth:`MergeCheck.exit_code` is the CLI's status: 0 ok, 1 a wrong merge, 3 right but
promoted (2 stays bad input).

>>> import lorakit
>>> _ = lorakit.fuse("data/tiny-qwen3", "data/adapters/lora", "fused")
>>> merge_check("fused", "data/tiny-qwen3", "data/adapters/lora").status
'ok'
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np

from .. import numerics as nm
from ..fusion.delta import Piece, intended, tensor_pieces
from ..io.adapter import Adapter, load_adapter
from ..io.naming import bind, bind_replacements, bindings_by_tensor
from ..io.safetensors import raw_to_mx
from ..io.source import TensorSource, open_source
from ..io.weights import weight_f64
from . import plots
from .merge_bounds import float_bound, quant_bound
from .merge_behaviour import add_behaviour, behaviour_tokens
from .merge_causes import CauseStats, candidates, diagnose, scaled
from .merge_untouched import (extra_rows, replacement_row, requested_conversion, row,
                              untouched_rows, wider)
from .report import Report

__all__ = ["MergeCheck", "merge_check", "intended_pieces", "VERDICTS_OK", "EXIT_CODES"]

#: verdicts of a right merge
VERDICTS_OK = ("ok", "rounding-limited", "partially lost to quantization", "lost to quantization",
               "replaced")
#: overall status -> CLI exit code
EXIT_CODES = {"ok": 0, "wrong": 1, "promoted": 3}
_LIMITED = 0.8  # a correct fuse keeping less than this of the delta is "limited"


class _Weights:
    """Reads one weight of a source in pieces, as float64 or raw bits (``transposed``:
    a 2-D weight stored as (in, out), read back as (out, in))."""

    def __init__(self, src: TensorSource, tensor: str, transposed: bool = False) -> None:
        self.src, self.tensor, self.transposed = src, tensor, transposed
        self.q = src.quant_params(tensor[: -len(".weight")])
        self._full: Optional[np.ndarray] = None

    def f64(self, expert: Optional[int], rows: slice) -> np.ndarray:
        if self.q is not None or self.transposed:  # dequantize / transpose once
            if self._full is None:
                self._full = weight_f64(self.src, self.tensor)
                if self.transposed:
                    self._full = np.ascontiguousarray(self._full.T)
            x = self._full if expert is None else self._full[expert]
            return x[rows]
        if expert is not None:
            return weight_f64(self.src, self.tensor, slice(expert, expert + 1))[0][rows]
        return weight_f64(self.src, self.tensor, rows)

    def raw(self, expert: Optional[int], rows: slice) -> np.ndarray:
        if expert is not None:
            return self.src.read(self.tensor, slice(expert, expert + 1))[0][rows]
        return self.src.read(self.tensor, rows)


def _pieces(fused: TensorSource, base: TensorSource, tensor: str, binds: list, *,
            raw: bool = True, transposed: bool = False
            ) -> Iterator[Tuple[np.ndarray, np.ndarray, np.ndarray, Piece, Optional[slice]]]:
    wb, wf = _Weights(base, tensor), _Weights(fused, tensor, transposed)
    for p in tensor_pieces(binds):
        plan = [slice(None)] if p.slot is not None else list(nm.chunks(*p.shape))
        for rows in plan:
            W = wb.f64(p.slot, rows)
            T = intended(W, p, rows)
            F = wf.raw(p.slot, rows) if raw else wf.f64(p.slot, rows)
            yield F, W, T, p, (None if p.slot is not None else rows)


def intended_pieces(fused: TensorSource, base: TensorSource, tensor: str, binds: list, *,
                    raw: bool = True) -> Iterator[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(fused piece, base piece W, exact target T) over the changed blocks of a weight.

    The fused piece is raw bits (``raw=True``) or float64 (dequantized if packed); W
    and T are float64. T is ``W + scale * B @ A``, or DoRA's
    ``m * (W + scale * B @ A) / ||W + scale * B @ A||_row``. Pieces are row chunks
    of about a million elements (one expert at a time for stacked experts).
    """
    for F, W, T, _, _ in _pieces(fused, base, tensor, binds, raw=raw):
        yield F, W, T


class _Bound:
    """The per-element bound of one adapted tensor, and a correct fuse's change Q."""

    def __init__(self, sf: TensorSource, tensor: str, base_code: str, fused_code: str) -> None:
        self.module = tensor[: -len(".weight")]
        self.q = sf.quant_params(self.module)
        self.fmt_work = nm.float_format(base_code)
        self.fmt_out = nm.float_format(fused_code)

    def reference(self, T: np.ndarray) -> Tuple[np.ndarray, Any, Any]:
        """A correct fuse of T: rounded once to the fused dtype, or re-quantized in the
        scales' dtype with the fused weight's packing (float64, with scales / biases)."""
        if self.q is None:
            return nm.to_float64(nm.round_to_format(T, self.fmt_out), self.fmt_out), None, None
        import mlx.core as mx  # lazy: MLX only when computing

        fmt = self.fmt_out
        xm = raw_to_mx(nm.round_to_format(T, fmt), fmt.safetensors)
        parts = mx.quantize(xm, group_size=self.q.group_size, bits=self.q.bits, mode=self.q.mode)
        w, s = parts[0], parts[1]
        b = parts[2] if len(parts) > 2 else None
        back = mx.dequantize(w, s, b, group_size=self.q.group_size, bits=self.q.bits,
                             mode=self.q.mode)

        def f64(a):
            return np.array(a.astype(mx.float32)).astype(np.float64)

        return f64(back), f64(s), (None if b is None else f64(b))

    def __call__(self, F: np.ndarray, W: np.ndarray, T: np.ndarray, p: Piece,
                 rows: Optional[slice], ref: Optional[Tuple] = None) -> np.ndarray:
        fmt_out = self.fmt_out if self.q is None else self.fmt_work
        pre = float_bound(T, W, p, rows, self.fmt_work, fmt_out)
        if self.q is None:
            return pre
        Q, s, b = ref if ref is not None else self.reference(T)
        return quant_bound(T, F, Q, pre, self.q, s, b, self.fmt_out)


@dataclass(repr=False)
class MergeCheck(Report):
    """Per adapted tensor: distance (largest |F - T| over the rounding bound; <= 1 is
    right), max_ulp, beyond (share of elements past the bound), survived, expected, fit,
    corr, changed, delta_ulps, status, verdict and detail (the cause).

    ``status`` overall: ``ok``, ``wrong`` or ``promoted``; ``ok`` is True for ``ok``;
    :meth:`exit_code` maps it to 0 / 1 / 3. ``behaviour``: fused vs unfused on a corpus
    (``mean_kl``, ``top1_agreement``...) when asked for, else None; never the verdict."""

    column_help = {
        "tensor": "the adapted (or changed) tensor's name",
        "dtype": "stored dtype of the fused tensor",
        "distance": "largest |fused - exact| over what rounding to the dtype can explain "
                    "(<= 1 is right)",
        "max_ulp": "largest |fused - exact| in units in the last place of the dtype",
        "beyond": "share of elements past the rounding bound",
        "survived": "share of the adapter's delta found in the fused tensor (1 = all)",
        "expected": "share of the delta a correct fuse keeps after rounding (1 = all)",
        "fit": "the factor k that best explains fused - base as k x delta (1 = right scale)",
        "corr": "correlation of fused - base with the adapter's delta (1 = same direction)",
        "status": "ok, promoted (right but wider dtype) or wrong",
        "verdict": "what happened, in words (e.g. ok, wrong scale, transposed)",
        "detail": "the numbers behind the verdict",
    }
    behaviour: Optional[Dict[str, Any]] = None

    def to_dict(self) -> Dict[str, Any]:
        d = super().to_dict()
        if self.behaviour is not None:
            d["behaviour"] = dict(self.behaviour)
        return d

    @property
    def status(self) -> str:
        st = {r["status"] for r in self.rows}
        return "wrong" if "wrong" in st else "promoted" if "promoted" in st else "ok"

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def exit_code(self) -> int:
        return EXIT_CODES[self.status]

    def verdicts(self) -> Dict[str, str]:
        return {r["tensor"]: r["verdict"] for r in self.rows}

    def causes(self) -> Dict[str, str]:
        """tensor -> verdict for the tensors that are not right."""
        return {r["tensor"]: r["verdict"] for r in self.rows if r["status"] != "ok"}

    def plot(self, ax=None):
        """Each adapted tensor's distance from the exact result, in units of its
        rounding bound (1 = the most rounding can explain)."""
        rows = [r for r in self.rows if r.get("distance") is not None]
        return plots.grouped_bars([r["tensor"].replace(".weight", "") for r in rows],
                                  {"distance": [min(r["distance"], 1e3) for r in rows],
                                   "bound": [1.0] * len(rows)},
                                  title=self.title, ylabel="max |F - T| / rounding bound", ax=ax)

    figure = plot


def _measure(sf, sb, tensor, binds, bound: _Bound, transposed: bool) -> Dict[str, Any]:
    """One pass over an adapted tensor: distance, ulps, survival, correlation."""
    s = dict(dist=0.0, beyond=0, n=0, ulp=0.0, RD=0.0, RR=0.0, DD=0.0, QD=0.0, changed=0,
             uu=0.0)
    for F, W, T, p, rows in _pieces(sf, sb, tensor, binds, raw=False, transposed=transposed):
        ref = bound.reference(T)
        tol = bound(F, W, T, p, rows, ref)
        err = np.abs(F - T)
        ratio = err / tol
        s["dist"] = max(s["dist"], float(ratio.max(initial=0.0)))
        s["beyond"] += int(np.count_nonzero(ratio > 1))
        if bound.q is None:
            s["ulp"] = max(s["ulp"], float((err / nm.ulp(T, bound.fmt_out)).max(initial=0.0)))
        R, D, Q = F - W, T - W, ref[0] - W
        s["RD"] += float(np.vdot(R, D))
        s["RR"] += float(np.vdot(R, R))
        s["DD"] += float(np.vdot(D, D))
        s["QD"] += float(np.vdot(Q, D))
        s["n"] += R.size
        s["changed"] += int(np.count_nonzero(R))
        u = nm.ulp(W, bound.fmt_out if bound.q is None else bound.fmt_work)
        s["uu"] += float(np.vdot(u, u))
    dd = s["DD"]
    return dict(distance=s["dist"], max_ulp=s["ulp"] if bound.q is None else None,
                beyond=s["beyond"] / max(1, s["n"]),
                survived=s["RD"] / dd if dd > 0 else 1.0,
                expected=s["QD"] / dd if dd > 0 else 1.0,
                corr=s["RD"] / math.sqrt(s["RR"] * dd) if s["RR"] > 0 and dd > 0 else 0.0,
                changed=s["changed"] / max(1, s["n"]),
                delta_ulps=math.sqrt(dd / s["uu"]) if s["uu"] > 0 else None)


def _cause(sf, sb, tensor, binds, bound: _Bound, transposed: bool) -> Tuple[str, str, Dict]:
    """A second pass over a failing tensor: which mistake it looks like."""
    st: Optional[CauseStats] = None
    fmt = bound.fmt_work

    def rnd(x: np.ndarray) -> np.ndarray:  # what a first fuse stored
        if bound.q is not None:
            return bound.reference(x)[0]
        return nm.to_float64(nm.round_to_format(x, fmt), fmt)

    dora = any(p.magnitude is not None for p in tensor_pieces(binds))
    fg = gg = 0.0  # DoRA: <F - T, G>, <G, G> with G the derivative of T in the scale
    for F, W, T, p, rows in _pieces(sf, sb, tensor, binds, raw=False, transposed=transposed):
        if dora:
            G = (intended(W, scaled(p, 1 + 1e-3), rows) - T) / 1e-3
            fg += float(np.vdot(F - T, G))
            gg += float(np.vdot(G, G))
        cands = candidates(p, rnd)
        if st is None:
            st = CauseStats.start(cands, p.A.shape[0])
        ref = bound.reference(T)
        tol = bound(F, W, T, p, rows, ref)
        st.add(F, W, T, tol, cands, rows,
               lambda Th, q: bound(F, W, Th, q, rows, ref if bound.q is not None else None))
    assert st is not None

    def scaled_rms(k: float) -> Tuple[float, float]:
        """DoRA at k times the scale: Newton steps on k (a pass each), then the RMS
        distance (bound units) at the k found."""
        for _ in range(4):
            sq, n, fg, gg = 0.0, 0, 0.0, 0.0
            for F, W, T, p, rows in _pieces(sf, sb, tensor, binds, raw=False,
                                            transposed=transposed):
                q = scaled(p, k)
                Tk = intended(W, q, rows)
                ref = bound.reference(Tk) if bound.q is not None else None
                sq += float(np.sum(np.square((F - Tk) / bound(F, W, Tk, q, rows, ref))))
                n += F.size
                G = (intended(W, scaled(p, k * (1 + 1e-3)), rows) - Tk) / (k * 1e-3)
                fg += float(np.vdot(F - Tk, G))
                gg += float(np.vdot(G, G))
            rms = math.sqrt(sq / max(1, n))
            if rms <= 1.0 or gg == 0:
                return rms, k
            k += fg / gg
        return rms, k

    if not dora:
        return diagnose(st)
    return diagnose(st, scaled_rms, 1 + fg / gg if gg > 0 else 1.0)


def _adapted_row(sf, sb, tensor, binds, conversion: Optional[str]) -> Dict[str, Any]:
    module = tensor[: -len(".weight")]
    qb = sb.quant_params(module)
    base_code = sb.tensors[tensor].dtype if qb is None else sb.tensors[f"{module}.scales"].dtype
    meta = sf.tensors.get(tensor)
    if meta is None:
        return row(tensor, base_code, "wrong", "missing", detail="not in the fused checkpoint")
    qf = sf.quant_params(module)
    fused_code = meta.dtype if qf is None else sf.tensors[f"{module}.scales"].dtype
    dtype = base_code if fused_code == base_code else f"{base_code}->{fused_code}"
    want, have = tuple(sb.tensors[tensor].shape), tuple(meta.shape)
    transposed = False
    if qf is None and qb is None and have != want:
        if len(have) == 2 and have == want[::-1]:
            transposed = True
        else:
            return row(tensor, dtype, "wrong", "shape mismatch",
                       detail=f"expected {list(want)}, found {list(have)}")
    bound = _Bound(sf, tensor, base_code, fused_code)
    m = _measure(sf, sb, tensor, binds, bound, transposed)
    r = row(tensor, dtype, "ok", "ok", **m)
    if m["distance"] <= 1.0:
        if transposed:
            r.update(status="wrong", verdict="transposed",
                     detail=f"stored as {list(have)} (in, out) instead of {list(want)}")
        elif fused_code != base_code and fused_code != conversion:
            if wider(fused_code, base_code):
                r.update(status="promoted", verdict="promoted",
                         detail=f"right, but stored as {fused_code}: the other tensors "
                         f"stayed {base_code}")
            else:
                r.update(status="wrong", verdict="dtype changed",
                         detail=f"stored as {fused_code}, the other tensors stayed {base_code}")
        elif m["expected"] < _LIMITED:
            quantized = qf is not None
            gone = m["expected"] < 0.2
            r["verdict"] = ("lost to quantization" if gone else "partially lost to quantization") \
                if quantized else "rounding-limited"
            r["detail"] = f"even a correct fuse keeps {m['expected']:.2f} of the delta"
        return r
    verdict, detail, nums = _cause(sf, sb, tensor, binds, bound, transposed)
    r.update(status="wrong", verdict=verdict, detail=detail, fit=nums["fit"],
             base_like=bool(nums.get("base_like")))
    return r


def merge_check(fused: Any, base: Any, adapter: Any, *, check_untouched: bool = True,
                progress: Any = True, behaviour: Any = False) -> MergeCheck:
    """Check that a fused checkpoint is its base with its adapter merged, tensor by tensor.

    Args:
        fused: the fused checkpoint (directory, Checkpoint or in-memory model).
        base: the base it was fused from.
        adapter: the adapter directory (or a loaded Adapter).
        check_untouched: also verify that every tensor the adapter does not change is
            bit-identical in the fused checkpoint (reads both checkpoints fully).
        progress: a progress bar over that comparison (tqdm.auto; none when stderr is
            not a terminal), a callable ``progress(done_bytes, total_bytes)``, or False.
        behaviour: True (1024 tokens) or a token count: also run the fused model against
            the base with the adapter attached unfused on the embedded corpus (mean KL,
            top-1 agreement: ``.behaviour`` and a summary line); never changes the verdict.

    Returns:
        A :class:`MergeCheck` (``.status``, ``.ok``, ``.exit_code()``, ``.verdicts()``,
        ``.causes()``, rows with the numbers).
    """
    n_kl = behaviour_tokens(behaviour)
    sf, sb = open_source(fused), open_source(base)
    ad = adapter if isinstance(adapter, Adapter) else load_adapter(adapter)
    by_tensor = bindings_by_tensor(bind(ad, sb))
    adapted = {t[: -len(".weight")] for t in by_tensor}
    replaced = bind_replacements(ad, sb, dequantize=True)
    conversion = requested_conversion(sf, sb, adapted | {n.rsplit(".", 1)[0] for n in replaced})
    rows: List[Dict[str, Any]] = [_adapted_row(sf, sb, t, b, conversion)
                                  for t, b in by_tensor.items()]
    rows += [replacement_row(sf, sb, t, r) for t, r in replaced.items()]
    untouched_changed = None
    if check_untouched:
        names = [n for n in sb.tensors
                 if n.rsplit(".", 1)[0] not in adapted and n not in replaced and not
                 (sb.quant_params(n.rsplit(".", 1)[0]) is not None and
                  sf.quant_params(n.rsplit(".", 1)[0]) is None)]
        extra, untouched_changed = untouched_rows(sf, sb, names, progress)
        rows += extra
        if untouched_changed > len(names) // 2:  # most of the base differs
            for r in rows:
                if r["verdict"] == "changed otherwise":
                    r.update(verdict="different base",
                             detail=r["detail"] + "; most untouched tensors differ too")
    if sum(bool(r.get("base_like")) for r in rows) * 2 > len(by_tensor):
        for r in rows:  # the delta sits on another weight in most adapted tensors
            if r.get("base_like"):
                r.update(verdict="different base", detail=r["detail"] + ": another base")
    for r in rows:
        r.pop("base_like", None)
    rows += extra_rows(sf, sb)
    rep = MergeCheck(title=f"merge check of {sf.label}", rows=rows,
                     columns=["tensor", "dtype", "distance", "max_ulp", "beyond", "survived",
                              "expected", "fit", "corr", "status", "verdict", "detail"],
                     flagged=[i for i, r in enumerate(rows) if r["status"] != "ok"])
    counts: Dict[str, int] = {}
    for r in rows:
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    dists = [r["distance"] for r in rows if r["distance"] is not None]
    rep.summary = {
        "fused": str(sf.path or sf.label), "base": str(sb.path or sb.label),
        "adapter": str(ad.path), "adapted tensors": len(by_tensor),
        **({"replaced tensors": len(replaced)} if replaced else {}),
        "status": {"ok": "ok", "wrong": "wrong merge",
                   "promoted": "right but promoted"}[rep.status],
        "exit code": rep.exit_code(),
        "verdicts": ", ".join(f"{k}: {v}" for k, v in sorted(counts.items(),
                                                            key=lambda kv: (-kv[1], kv[0]))),
        "largest distance": max(dists) if dists else None,
        "distance unit": "max |F - T| / what rounding to the stored dtype can explain "
                         "(<= 1 is right)",
        **({"converted to": conversion} if conversion else {}),
    }
    if untouched_changed is not None:
        rep.summary["untouched tensors changed"] = untouched_changed
    if n_kl is not None:
        add_behaviour(rep, sf, sb, ad, n_kl, progress=True if progress is True else None)
    return rep
