"""Did the merge work? A fused checkpoint measured against the exact intended result.

For each adapted weight, ``T`` is the exact intended result in float64
(:func:`lorakit.fusion.delta.intended`). The check measures ``|F - T|`` element by
element against what rounding to the stored dtype can explain (:func:`float_bound`,
:func:`quant_bound`); ``distance`` is the largest ratio, at most 1 for a correct merge in
any order a correct tool fuses in. A wrong merge gets a cause where one can be named
(:mod:`lorakit.inspect.check_causes`); untouched tensors must be bit for bit the base or
its requested conversion. The folder's other files are compared with what they should be
(:mod:`lorakit.inspect.files`). :meth:`CheckReport.exit_code`: 0 ok, 1 wrong, 3 promoted,
4 right tensors in a folder whose files are not.

>>> import lorakit
>>> _ = lorakit.fuse("data/tiny-qwen3", "data/adapters/lora", "fused")
>>> check("fused", "data/tiny-qwen3", "data/adapters/lora").status
'ok'
"""
from __future__ import annotations

import math
import os
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np

from .. import kernels
from .. import numerics as nm
from ..errors import ArgumentError, FormatError
from ..fusion.core import cast_raw
from ..fusion.delta import Piece, WeightReader, intended, intended_blocks, tensor_pieces
from ..fusion.finite import replaced_raw
from ..io.adapters.base import Adapter
from ..io.adapters.load import load_adapter
from ..io.adapters.naming import bind, bind_replacements, bindings_by_tensor
from ..io.adapters.peft import residual_init
from ..io.formats import source
from ..io.formats.safetensors import ITEMSIZE, raw_to_mx
from ..io.formats.source import TensorSource
from ..layers import split_name
from ..report import Report
from . import plots
from .behaviour import compare_outputs
from .check_causes import CauseStats, candidates, diagnose, scaled
from .diff import compare_sources
from .files import FILES_EXIT, FilesReport, check_files

__all__ = ["CheckReport", "check"]


#: overall status -> CLI exit code
EXIT_CODES = {"ok": 0, "wrong": 1, "promoted": 3}
_LIMITED = 0.8  # a correct fuse keeping less than this of the delta is "limited"


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

    def __call__(self, F, W, T, p: Piece, rows: Optional[slice], ref=None) -> np.ndarray:
        fmt_out = self.fmt_out if self.q is None else self.fmt_work
        pre = float_bound(T, W, p, rows, self.fmt_work, fmt_out)
        if self.q is None:
            return pre
        Q, s, b = ref if ref is not None else self.reference(T)
        return quant_bound(T, F, Q, pre, self.q, s, b, self.fmt_out)


@dataclass(repr=False)
class CheckReport(Report):
    """A row per adapted tensor. ``status`` overall: ``ok``, ``wrong`` or ``promoted``
    (:meth:`exit_code`: 0 / 1 / 3); ``behaviour``: fused vs unfused KL when asked for."""

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
    #: the folder's other files (tokenizer, chat template, EOS ids, ...): one row a finding
    files: Optional[FilesReport] = None

    def to_dict(self) -> Dict[str, Any]:
        d = super().to_dict()
        if self.behaviour is not None:
            d["behaviour"] = dict(self.behaviour)
        if self.files is not None:
            d["files"] = self.files.to_dict()
        return d

    def __str__(self) -> str:
        return super().__str__() + (f"\n\n{self.files}" if self.files and self.files.rows else "")

    def _repr_html_(self) -> str:  # the files section shown when it has findings
        return super()._repr_html_() + (self.files._repr_html_() if self.files and
                                        self.files.rows else "")

    @property
    def status(self) -> str:
        st = {r["status"] for r in self.rows}
        return "wrong" if "wrong" in st else "promoted" if "promoted" in st else "ok"

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def exit_code(self) -> int:
        """The tensors' code (0 / 1 / 3); 4 when they pass and a file does not."""
        code = EXIT_CODES[self.status]
        return FILES_EXIT if code == 0 and self.files is not None and self.files.rows else code

    def verdicts(self) -> Dict[str, str]:
        return {r["tensor"]: r["verdict"] for r in self.rows}

    def causes(self) -> Dict[str, str]:
        """tensor -> verdict for the tensors that are not right."""
        return {r["tensor"]: r["verdict"] for r in self.rows if r["status"] != "ok"}

    def plot(self, ax=None):
        """Each adapted tensor's distance from the exact result, in rounding bounds."""
        rows = [r for r in self.rows if r.get("distance") is not None]
        return plots.grouped_bars([r["tensor"].replace(".weight", "") for r in rows],
                                  {"distance": [min(r["distance"], 1e3) for r in rows],
                                   "bound": [1.0] * len(rows)},
                                  title=self.title, ylabel="max |F - T| / rounding bound", ax=ax)

    figure = plot


def _measure(sf, sb, tensor, binds, bound: _Bound, transposed: bool) -> Dict[str, Any]:
    """One pass over an adapted tensor: distance, ulps, survival, correlation."""
    if bound.q is None and not transposed and all(map(_plain, tensor_pieces(binds))):
        return _measure_lora(sf, sb, tensor, binds, bound)
    s = dict(dist=0.0, beyond=0, n=0, ulp=0.0, RD=0.0, RR=0.0, DD=0.0, QD=0.0, changed=0,
             uu=0.0)
    for F, W, T, p, rows in intended_blocks(sf, sb, tensor, binds, raw=False, transposed=transposed):
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
    return _numbers(s, bound.q is None)


def _numbers(s: Dict[str, Any], float_out: bool) -> Dict[str, Any]:
    """A tensor's row numbers from its totals and sums."""
    dd = s["DD"]
    return dict(distance=s["dist"], max_ulp=s["ulp"] if float_out else None,
                beyond=s["beyond"] / max(1, s["n"]),
                survived=s["RD"] / dd if dd > 0 else 1.0,
                expected=s["QD"] / dd if dd > 0 else 1.0,
                corr=s["RD"] / math.sqrt(s["RR"] * dd) if s["RR"] > 0 and dd > 0 else 0.0,
                changed=s["changed"] / max(1, s["n"]),
                delta_ulps=math.sqrt(dd / s["uu"]) if s["uu"] > 0 else None)


# ---------------------------------------------------------------------------
# A plain LoRA's measure in one pass per block: the C kernel, or its numpy twin

_KFMT = {"BF16": 0, "F16": 1, "F32": 2}
_SUMS = ("RD", "RR", "DD", "QD", "uu")


def _plain(p: Piece) -> bool:
    """A plain LoRA piece (no DoRA magnitudes, not an exact sum of adapters)."""
    return p.magnitude is None and not getattr(p.target, "parts", None)


_LANES = 8  # the kernel's LANES


def _seq_sum(x: np.ndarray, carry: float) -> float:
    """``carry`` plus the elements of ``x`` in the C kernel's order: per row, lane ``q``
    sums the columns ``j = q (mod 8)`` from -0.0, then the lanes, then the rows in order."""
    if x.size == 0:
        return carry
    row = np.full(x.shape[0], -0.0)
    for q in range(min(_LANES, x.shape[1])):
        row += np.cumsum(x[:, q::_LANES], axis=1)[:, -1]
    return float(np.cumsum(np.concatenate(([carry], row)))[-1])


def _lora_numpy(W, F, Bs, A, c32: float, fw, fo, carry: Tuple[float, ...]):
    """One block of a plain LoRA's measure: (dist, max_ulp, beyond, changed, sums), the
    bound :func:`float_bound`'s with ``D`` and ``S`` summed in rank order from -0.0 (the
    kernel's order, so that both give the same bits)."""
    D = np.full(F.shape, -0.0)
    S = np.full(F.shape, -0.0)
    for k in range(A.shape[0]):
        P = Bs[:, k, None] * A[k]
        D += P
        S += np.abs(P, out=P)
    e32 = c32 * S
    X = W + D
    aX, aD = np.abs(X), np.abs(D)
    e = _half_ulp(_up(aD + e32, fw), fw) + _half_ulp(_up(aX + e32, fw), fw)
    e += e32
    e += _U32 * aX
    if fo.safetensors != fw.safetensors:
        e += _half_ulp(_up(aX + e, fo), fo)
    err = np.abs(F - X)
    ratio = err / e
    R, Dm = F - W, X - W
    Q = nm.to_float64(nm.round_to_format(X, fo), fo) - W
    u = nm.ulp(W, fo)
    sums = tuple(_seq_sum(x, c) for x, c in zip((R * Dm, R * R, Dm * Dm, Q * Dm, u * u), carry))
    return (float(ratio.max(initial=0.0)), float((err / nm.ulp(X, fo)).max(initial=0.0)),
            int(np.count_nonzero(ratio > 1)), int(np.count_nonzero(R)), sums)


def _measure_lora(sf, sb, tensor, binds, bound: _Bound) -> Dict[str, Any]:
    """:func:`_measure` of a plain LoRA on a float fused weight, block by block from the
    storage bits: the C kernel where it is built, else :func:`_lora_numpy` (the same bits)."""
    fw, fo = bound.fmt_work, bound.fmt_out
    wb, wf = WeightReader(sb, tensor), WeightReader(sf, tensor)
    kernel = kernels.load("lorakit.inspect._checkkernel")
    kfmt = (_KFMT[fo.safetensors], _KFMT[fw.safetensors])
    s: Dict[str, Any] = dict(dist=0.0, ulp=0.0, beyond=0, changed=0, n=0)
    sums: Tuple[float, ...] = (0.0,) * len(_SUMS)
    for p in tensor_pieces(binds):
        A = np.ascontiguousarray(p.A, np.float64)
        Bs = np.ascontiguousarray(p.B.astype(np.float64) * np.asarray(p.scale, np.float64))
        c32 = (p.A.shape[0] + 2) * _U32
        plan = [slice(None)] if p.slot is not None else list(nm.chunks(*p.shape))
        for rows in plan:
            F = wf.raw(p.slot, rows)
            W = wb.f64(p.slot, rows) if wb.q is not None else wb.raw(p.slot, rows)
            Br = np.ascontiguousarray(Bs[rows])
            out = None
            if kernel is not None and F.ndim == 2 and F.dtype.isnative and W.dtype.isnative:
                fin = 3 if wb.q is not None else _KFMT[fw.safetensors]
                Wk = np.ascontiguousarray(W, np.float64 if fin == 3 else None)
                F_ = np.ascontiguousarray(F)
                special, *res = kernel.check_lora(Wk, fin, F_, *kfmt, F.shape[1], Br, A, c32, sums)
                if not special:
                    out = res
            if out is None:
                W64 = W if wb.q is not None else nm.to_float64(W, fw)
                out = _lora_numpy(W64, nm.to_float64(F, fo), Br, A, c32, fw, fo, sums)
            bd, bu, bb, bc, sums = out
            s["dist"] = max(s["dist"], bd)
            s["ulp"] = max(s["ulp"], bu)
            s["beyond"] += bb
            s["changed"] += bc
            s["n"] += F.size
    s.update(zip(_SUMS, sums))
    return _numbers(s, True)


def _cause(sf, sb, tensor, binds, bound: _Bound, transposed: bool) -> Tuple[str, str, Dict]:
    """A second pass over a failing tensor: which mistake it looks like."""
    st: Optional[CauseStats] = None
    fmt = bound.fmt_work

    def rnd(x: np.ndarray) -> np.ndarray:  # what a first fuse stored
        if bound.q is not None:
            return bound.reference(x)[0]
        return nm.to_float64(nm.round_to_format(x, fmt), fmt)

    dora = any(p.magnitude is not None for p in tensor_pieces(binds))
    blocks = partial(intended_blocks, sf, sb, tensor, binds, raw=False, transposed=transposed)
    fg = gg = 0.0  # DoRA: <F - T, G>, <G, G> with G the derivative of T in the scale
    for F, W, T, p, rows in blocks():
        if dora:
            G = (intended(W, scaled(p, 1 + 1e-3), rows) - T) / 1e-3
            fg += float(np.vdot(F - T, G))
            gg += float(np.vdot(G, G))
        cands = candidates(p, rnd)
        if st is None:
            st = CauseStats.start(cands, p.A.shape[0])
        ref = bound.reference(T)
        tol = bound(F, W, T, p, rows, ref)
        ref_q = ref if bound.q is not None else None
        st.add(F, W, T, tol, cands, rows, lambda Th, q: bound(F, W, Th, q, rows, ref_q))
    assert st is not None

    def scaled_rms(k: float) -> Tuple[float, float]:
        """DoRA at k times the scale: Newton steps on k (a pass each), then the RMS
        distance (bound units) at the k found."""
        for _ in range(4):
            sq, n, fg, gg = 0.0, 0, 0.0, 0.0
            for F, W, T, p, rows in blocks():
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
            detail = f"expected {list(want)}, found {list(have)}"
            return row(tensor, dtype, "wrong", "shape mismatch", detail=detail)
    for code, src in ((base_code, sb), (fused_code, sf)):
        if code not in FUSE_CODES:  # a merge is checked in a fuse's formats
            raise FormatError("cannot check a merge of this dtype", file=src.path,
                              tensor=tensor, expected="a BF16, F16 or F32 weight",
                              found=code, hint="lorakit fuse and mlx_lm fuse write "
                              "these three; store float64 weights as float32 first")
    bound = _Bound(sf, tensor, base_code, fused_code)
    m = _measure(sf, sb, tensor, binds, bound, transposed)
    r = row(tensor, dtype, "ok", "ok", **m)
    if m["distance"] <= 1.0:
        if transposed:
            detail = f"stored as {list(have)} (in, out) instead of {list(want)}"
            r.update(status="wrong", verdict="transposed", detail=detail)
        elif fused_code != base_code and fused_code != conversion:
            if wider(fused_code, base_code):
                detail = f"right, but stored as {fused_code}: the other tensors stayed {base_code}"
                r.update(status="promoted", verdict="promoted", detail=detail)
            else:
                detail = f"stored as {fused_code}, the other tensors stayed {base_code}"
                r.update(status="wrong", verdict="dtype changed", detail=detail)
        elif m["expected"] < _LIMITED:
            gone = "lost" if m["expected"] < 0.2 else "partially lost"
            r["verdict"] = f"{gone} to quantization" if qf is not None else "rounding-limited"
            r["detail"] = f"even a correct fuse keeps {m['expected']:.2f} of the delta"
        return r
    verdict, detail, nums = _cause(sf, sb, tensor, binds, bound, transposed)
    r.update(status="wrong", verdict=verdict, detail=detail, fit=nums["fit"])
    r["base_like"] = bool(nums.get("base_like"))
    return r


#: adapted tensors measured at once (numpy releases the GIL in the big array work)
WORKERS = max(1, min(2, os.cpu_count() or 1))


def per_expert(by_tensor: Dict[str, list]) -> List[Tuple[str, list, str]]:
    """(tensor, bindings, row name): a stacked (3-D) weight one expert at a time, named
    ``tensor[e]``, so that a wrong merge names the experts it is wrong in."""
    out = []
    for t, binds in by_tensor.items():
        if len(binds[0].shape) != 3:
            out.append((t, binds, t))
            continue
        for b in binds:
            out += [(t, [b], f"{t}[{b.weight_expert}]")] if b.weight_expert is not None else [
                (t, [replace(b, target_expert=e, weight_expert=e)], f"{t}[{e}]")
                for e in range(b.target.A.shape[0])]
    return out


def _adapted_rows(sf, sb, items, conversion: Optional[str]) -> List[Dict[str, Any]]:
    """The adapted tensors' rows (:func:`per_expert` items), in order, up to
    :data:`WORKERS` tensors in flight (quantized weights, MLX's quantize in the
    reference, one at a time)."""

    def one(tb):
        return dict(_adapted_row(sf, sb, tb[0], tb[1], conversion), tensor=tb[2])

    def quantized(t: str) -> bool:
        module = t[: -len(".weight")]
        return sb.quant_params(module) is not None or sf.quant_params(module) is not None

    if WORKERS < 2 or len(items) < 2 or any(quantized(t) for t, *_ in items):
        return [one(tb) for tb in items]
    with ThreadPoolExecutor(WORKERS, thread_name_prefix="lorakit-check") as pool:
        return list(pool.map(one, items))


def check(fused: Any, base: Any, adapter: Any, *, check_untouched: bool = True,
                progress: Any = True, behaviour: Any = False,
                initial_adapter: Any = None) -> CheckReport:
    """Check that ``fused`` (directory, Checkpoint or model) is ``base`` with ``adapter``
    merged, tensor by tensor; a :class:`CheckReport`.

    ``check_untouched``: also verify every tensor the adapter does not change (reads both
    checkpoints fully; ``progress``: tqdm, a callable ``(done, total)`` or False).
    ``behaviour``: True (1024 tokens) or a token count adds fused vs unfused KL on the
    embedded corpus (``.behaviour``); it never changes the verdict. ``initial_adapter``:
    for a PEFT adapter made on a changed base (PiSSA, OLoRA, ...), the adapter saved
    before training, as :func:`lorakit.fuse` takes it; without it such an adapter fails
    with the cause ``residual-base adapter``."""
    n_kl = behaviour_tokens(behaviour)
    sf, sb = source.open(fused), source.open(base)
    ad = adapter
    if not isinstance(ad, Adapter):
        ad = load_adapter(adapter, initial_adapter, residual_ok=True)
    by_tensor = bindings_by_tensor(bind(ad, sb))
    adapted = {t[: -len(".weight")] if t.endswith(".weight") else t for t in by_tensor}
    replaced = bind_replacements(ad, sb, dequantize=True)
    conversion = requested_conversion(sf, sb, adapted | {n.rsplit(".", 1)[0] for n in replaced})
    items = per_expert(by_tensor)
    rows: List[Dict[str, Any]] = _adapted_rows(sf, sb, items, conversion)
    rows += [replacement_row(sf, sb, t, r) for t, r in replaced.items()]
    untouched_changed = None
    if check_untouched:
        names = [n for n in sb.tensors if n.rsplit(".", 1)[0] not in adapted and n not in adapted
                 and n not in replaced and not _skipped(sb, sf, n)]
        extra, untouched_changed = untouched_rows(sf, sb, names, progress)
        rows += extra
        if untouched_changed > len(names) // 2:  # most of the base differs
            for r in rows:
                if r["verdict"] == "changed otherwise":
                    r.update(verdict="different base",
                             detail=r["detail"] + "; most untouched tensors differ too")
    if sum(bool(r.get("base_like")) for r in rows) * 2 > len(items):
        for r in rows:  # the delta sits on another weight in most adapted tensors
            if r.get("base_like"):
                r.update(verdict="different base", detail=r["detail"] + ": another base")
    for r in rows:
        r.pop("base_like", None)
    rows += extra_rows(sf, sb) + residual_rows(ad)
    rep = CheckReport(title=f"merge check of {sf.label}", rows=rows,
                     columns="tensor dtype distance max_ulp beyond survived expected fit corr status "
                     "verdict detail".split(),
                     flagged=[i for i, r in enumerate(rows) if r["status"] != "ok"])
    folder = sf.path is not None and sf.path.is_dir() and hasattr(sb, "extra_files")
    if folder:  # a folder fused from a checkpoint folder: its other files too
        quantized = any(n.endswith(".scales") for n in sf.tensors)
        rep.files = check_files(sf.path, sb, getattr(ad, "path", None), quantized)
    counts = Counter(r["verdict"] for r in rows)
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
    f = rep.files
    rep.summary["files"] = ("not compared: the fused model or its base is not a folder"
                            if f is None else f"{len(f.rows)} findings (below)" if f.rows else
                            f"as they should be ({f.summary['compared']} compared, "
                            f"tokenizer from {f.summary['tokenizer from']}"
                            + (f"; {f.summary['re-saved']}" if "re-saved" in f.summary else "")
                            + ")")
    if n_kl is not None:
        add_behaviour(rep, sf, sb, ad, n_kl, progress=True if progress is True else None)
    return rep


# ---------------------------------------------------------------------------
# What rounding can explain: per element, how far a correct fuse may land from T


_U32 = 2.0 ** -24


def _half_ulp(mag: np.ndarray, fmt: Any) -> np.ndarray:
    return 0.5 * nm.ulp(mag, fmt)


def _up(mag: np.ndarray, fmt: Any) -> np.ndarray:
    """A magnitude one spacing above ``mag`` (a value near it may round up a binade)."""
    return mag + nm.ulp(mag, fmt)


#: .last: (A, B, rows, |B| @ |A|, B @ A) of one chunk, per thread, reused by the candidates
_CACHE = threading.local()


def _products(p: Piece, rows: Optional[slice]):
    """``(|B| @ |A|, B @ A)`` of the piece's rows, a scale per rank column folded into B."""
    key = (rows.start, rows.stop) if rows is not None else None
    per_column = np.ndim(p.scale) > 0
    last = getattr(_CACHE, "last", None)
    if not per_column and last and last[0] is p.A and last[1] is p.B and last[2] == key:
        return last[3], last[4]
    B = (p.B if rows is None else p.B[rows]).astype(np.float64)
    if per_column:
        B = B * np.asarray(p.scale, np.float64)[None, :]
    A = p.A.astype(np.float64)
    out = (np.abs(B) @ np.abs(A), B @ A)
    if not per_column:
        _CACHE.last = (p.A, p.B, key, *out)
    return out


def float_bound(T, W, p: Piece, rows: Optional[slice], fmt_work, fmt_out) -> np.ndarray:
    """Per element, the largest ``|F - T|`` a correct fuse of piece ``p`` can leave
    (``T``, ``W``: the float64 target and base rows), in any of the orders: rounded once
    (``nearest``), PEFT's ``round_out(fl32(W + d32))``, or mlx-lm's
    ``round_w(W + round_w(d32))``. With ``D = T - W`` and ``u = ulp_w / 2``::

        bound = u(D) + u(T) + e32 + 2**-24 |T|        (+ ulp_out(T) / 2 if out != w)
        e32   = (r + 2) 2**-24 |scale| (|B| @ |A|)    (an f32 dot product of length r)

    magnitudes taken one spacing up (a value may round into the next binade). DoRA
    scales the element term by ``m / ||X||``, adds the row norm's own error ``rel |T|``,
    and divides both by ``1 - rel`` (the stored norm may be that much smaller)."""
    S1, BA = _products(p, rows)
    scale = p.scale if np.ndim(p.scale) == 0 else 1.0  # else folded into the products
    S = abs(scale) * S1
    e32 = (p.A.shape[0] + 2) * _U32 * S
    D = scale * BA
    X = W + D  # before DoRA's normalisation (T itself for LoRA)
    aX, aD = np.abs(X), np.abs(D)
    e = (_half_ulp(_up(aD + e32, fmt_work), fmt_work) + _half_ulp(_up(aX + e32, fmt_work), fmt_work)
         + e32 + _U32 * aX)
    aT = np.abs(T)
    same = fmt_out.safetensors == fmt_work.safetensors
    if p.magnitude is None:
        out = e if same else e + _half_ulp(_up(aT + e, fmt_out), fmt_out)
        return out
    norm = np.sqrt(np.einsum("ij,ij->i", X, X))
    m = np.abs((p.magnitude if rows is None else p.magnitude[rows]).astype(np.float64))
    s = np.divide(m, norm, out=np.zeros_like(m), where=norm > 0)
    e_row = np.sqrt(np.einsum("ij,ij->i", e, e))
    # mlx-lm takes the norm of the rounded X in X's own dtype: one more rounding of it, and
    # MLX may round the sum of squares to that dtype before the root (2**-(p+1) relative)
    e_row = e_row * 1.01 + _half_ulp(_up(norm + e_row * 1.01, fmt_work), fmt_work)
    rel = np.divide(e_row, norm, out=np.zeros_like(e_row), where=norm > 0) \
        + (X.shape[1] + 16) * _U32 + 2.0 ** -(fmt_work.precision + 1)
    # the stored norm n' is within rel of ||X||: the factor m / n' is s / (1 - rel) at most,
    # on the element's own error as on T (a cancelling element's error is not within rel |T|)
    rel = rel[:, None]
    y = (s[:, None] * e + aT * rel) / np.maximum(1.0 - rel, 0.0)
    return y + _half_ulp(_up(aT + y, fmt_out), fmt_out)


def quant_bound(T, F, Q, pre, q, scales, biases, fmt_scales) -> np.ndarray:
    """Per element, the largest ``|F - T|`` a correct re-quantized fuse can leave: ``pre``
    (:func:`float_bound`) plus each group's quantization error (affine: one step and the
    storage rounding of scale and bias; else twice a correct re-quantization's, ``Q``)."""
    g = q.group_size
    rows, cols = T.shape
    grp = np.abs(Q - T).reshape(rows, cols // g, g).max(axis=2)  # a correct fuse's worst
    if q.mode == "affine":
        step = np.abs(scales)
        h = 0.5 * nm.ulp(step, fmt_scales)  # storage rounding of the scale (and bias)
        if biases is not None:
            h = h + 0.5 * nm.ulp(np.abs(biases), fmt_scales) / 2 ** q.bits
        err = 1.05 * step + (2 ** q.bits) * h
    else:  # no closed form here: twice what a correct re-quantization shows per group
        err = 2 * grp
    err = np.repeat(err, g, axis=1)[:, :cols]
    err += _half_ulp(_up(np.abs(F), fmt_scales), fmt_scales)  # the dequantized value
    return pre + err


# ---------------------------------------------------------------------------
# Tensors the adapter does not touch, whole-tensor replacements, one-sided tensors


#: the float formats a fuse reads and writes (``--dtype`` converts between them)
FUSE_CODES = ("BF16", "F16", "F32")


_NUMBERS = "distance max_ulp beyond survived expected fit corr changed delta_ulps".split()


def row(tensor: str, dtype: str, status: str, verdict: str, **values: Any) -> Dict[str, Any]:
    """A table row with every column, the numbers None unless given."""
    layer, kind, _, _ = split_name(tensor)
    r = dict(tensor=tensor, layer=layer, kind=kind, dtype=dtype, **dict.fromkeys(_NUMBERS))
    r.update(status=status, verdict=verdict, detail="")
    r.update(values)
    return r


def wider(code_out: str, code_in: str) -> bool:
    return ITEMSIZE.get(code_out, 0) > ITEMSIZE.get(code_in, 0)


def _skipped(sb: TensorSource, sf: TensorSource, name: str) -> bool:
    module = name.rsplit(".", 1)[0]
    return sb.quant_params(module) is not None and sf.quant_params(module) is None


def requested_conversion(sf: TensorSource, sb: TensorSource, adapted: set) -> Optional[str]:
    """The dtype every untouched float tensor of ``sf`` has, when all of them moved from
    the base's dtype to that one (a fuse asked for another dtype); else None. Headers only."""
    codes = set()
    for n, meta in sb.tensors.items():
        module = n.rsplit(".", 1)[0]
        if module in adapted or meta.dtype not in FUSE_CODES or n not in sf.tensors or \
                sb.quant_params(module) is not None:
            continue
        codes.add((meta.dtype == sf.tensors[n].dtype, sf.tensors[n].dtype))
    if len(codes) == 1:
        same, code = next(iter(codes))
        return None if same else code
    return None


def untouched_rows(sf: TensorSource, sb: TensorSource, names: List[str],
                   progress: Any) -> Tuple[List[Dict[str, Any]], int]:
    """Rows for the untouched tensors that are not bit for bit the base (or exactly its
    conversion), and how many of them there are. Converted ones get a ``converted`` row."""
    same, converted = [], []
    for n in names:
        f = sf.tensors.get(n)
        if f is not None and f.dtype != sb.tensors[n].dtype and f.dtype in FUSE_CODES and \
                sb.tensors[n].dtype in FUSE_CODES:
            converted.append(n)
        else:
            same.append(n)
    rows: List[Dict[str, Any]] = []
    changed = 0
    for d in compare_sources(sb, sf, names=same, progress=progress):
        if d.status != "equal":
            changed += 1
            dt = d.dtype_a if d.dtype_a == d.dtype_b else f"{d.dtype_a}->{d.dtype_b}"
            missing = d.status == "only in A"
            verdict = "missing" if missing else "changed without adapter"
            detail = "" if missing else "a tensor the adapter does not touch differs from the base"
            changed = d.differing / max(1, d.elements) if d.elements else None
            rows.append(row(d.name, dt, "wrong", verdict, changed=changed, detail=detail))
    for n in converted:
        a, b = sb.tensors[n].dtype, sf.tensors[n].dtype
        want = cast_raw(np.asarray(sb.read(n)), a, b)
        got = np.asarray(sf.read(n))
        if tuple(got.shape) == tuple(want.shape) and np.array_equal(
                got.reshape(-1).view(np.uint8), np.ascontiguousarray(want).reshape(-1).view(np.uint8)):
            continue
        changed += 1
        detail = f"not the base converted to {b} with one rounding"
        rows.append(row(n, f"{a}->{b}", "wrong", "changed without adapter", detail=detail))
    return rows, changed


def extra_rows(sf: TensorSource, sb: TensorSource) -> List[Dict[str, Any]]:
    """Tensors the fused checkpoint has and the base does not."""
    out = []
    for n, meta in sf.tensors.items():
        if n in sb.tensors:
            continue
        module = n.rsplit(".", 1)[0]
        if n.endswith((".scales", ".biases")) and sf.quant_params(module) is not None and \
                f"{module}.weight" in sb.tensors:
            continue  # a quantized fuse of a float base: packing parts are expected
        detail = "in the fused checkpoint, not in the base"
        out.append(row(n, meta.dtype, "wrong", "extra tensor", detail=detail))
    return out


def residual_rows(ad: Adapter) -> List[Dict[str, Any]]:
    """A wrong row for an adapter whose config says PEFT changed the base when it made
    it (PiSSA, OLoRA, CorDA, LoRA-GA, LoftQ): fused into the original base its delta is
    not the trained change, whatever the tensors show (they are measured against the
    same base)."""
    res = residual_init(ad.config) if ad.format == "peft" else None
    if res is None:
        return []
    key, val = res
    return [row("adapter_config.json", "-", "wrong", "residual-base adapter",
                detail=f"{key}={val!r}: PEFT made this adapter on a changed base (W - scale "
                "* B0 @ A0); the merge is wrong unless it was fused into that base. Convert "
                "it: --initial-adapter DIR (the adapter saved before training), or PEFT's "
                "save_pretrained(path_initial_model_for_weight_conversion=...)")]


def replacement_row(sf: TensorSource, sb: TensorSource, tensor: str, r: Any) -> Dict[str, Any]:
    """A PEFT modules_to_save copy: the fused tensor must be it, rounded once, bit for bit;
    trainable tokens: the base with those rows replaced (each other row untouched)."""
    base_code = sb.tensors[tensor].dtype
    out = row(tensor, base_code, "ok", "replaced")
    meta = sf.tensors.get(tensor)
    module = tensor.rsplit(".", 1)[0]
    if meta is None:
        out.update(status="wrong", verdict="missing")
        return out
    if meta.dtype != base_code:
        out["dtype"] = f"{base_code}->{meta.dtype}"
    if sf.quant_params(module) is not None or meta.dtype not in FUSE_CODES or tuple(
            meta.shape) != tuple(sb.tensors[tensor].shape if r.rows else r.raw.shape):
        out.update(status="wrong", verdict="replacement not written")
        return out
    base = np.asarray(sb.read(tensor))  # trainable tokens: the base, those rows replaced
    want = cast_raw(*replaced_raw(r, lambda: (base, base_code)), meta.dtype)
    got = np.asarray(sf.read(tensor)).reshape(want.shape).view(want.dtype)
    out["changed"] = float(np.count_nonzero(got != base.view(got.dtype))) / max(1, got.size) \
        if base.dtype.itemsize == got.dtype.itemsize else None
    if r.rows and not np.array_equal(got, want):
        bad = np.flatnonzero((got != want).reshape(len(got), -1).any(axis=1)).tolist()
        miss, other = [i for i in bad if i in r.rows], [i for i in bad if i not in r.rows]
        out.update(status="wrong", verdict="token rows differ", detail="; ".join(
            [f"rows {miss[:8]} are not the trained values"] * bool(miss) +
            [f"rows {other[:8]} outside trainable_token_indices changed"] * bool(other)))
    elif not np.array_equal(got, want):
        out.update(status="wrong", verdict="replacement differs")
    return out


# ---------------------------------------------------------------------------
# The behaviour line (--kl): the fused model against base + adapter unfused; never the verdict


#: corpus tokens scored when ``behaviour=True`` / ``--kl`` has no ``--tokens``
DEFAULT_TOKENS = 1024
#: window length (shorter when fewer tokens are asked for)
CONTEXT = 256
#: the numbers kept from the behaviour report
KEYS = ("mean_kl mean_kl_interval median_kl p99_kl max_kl top1_agreement "
        "top1_agreement_interval top1_agreement_strict ppl_ref ppl_test tokens").split()


def behaviour_tokens(behaviour: Union[bool, int, None]) -> Optional[int]:
    """No behaviour line (None), :data:`DEFAULT_TOKENS` for True, or that many tokens."""
    if behaviour is None or behaviour is False:
        return None
    if behaviour is True:
        return DEFAULT_TOKENS
    n = int(behaviour)
    if n < 2:
        raise ArgumentError.bad("behaviour", behaviour, "True, False or a corpus token count >= 2")
    return n


def _path(src: Any, role: str) -> str:
    path = getattr(src, "path", None)
    if path is None:
        raise ArgumentError.bad(role, str(getattr(src, "label", src)), "a checkpoint directory:"
                                " the behaviour line needs it on disk",
                                hint="call compare_outputs with loaded models instead")
    return str(path)


def fused_vs_unfused(fused: Any, base: Any, adapter: Any, tokens: int, *,
                     corpus: Any = None, progress: Any = None) -> Dict[str, Any]:
    """:data:`KEYS` of ``fused`` against ``base`` + ``adapter`` (unfused): sources or paths."""
    ad = str(getattr(adapter, "path", adapter))
    rep = compare_outputs((_path(base, "base") if not isinstance(base, str) else base, ad),
                          _path(fused, "fused checkpoint") if not isinstance(fused, str) else fused,
                          corpus, tokens=tokens, context=min(CONTEXT, tokens),
                          detail=0, progress=progress)
    return behaviour_stats(rep)


def behaviour_stats(rep: Any) -> Dict[str, Any]:
    """:data:`KEYS` of a :func:`compare_outputs` report, with its float32 fallback."""
    return {**{k: rep.stats[k] for k in KEYS}, "float32": list(rep.float32),
            **({"note": rep.summary["note"]} if rep.float32 else {})}


def behaviour_line(stats: Dict[str, Any]) -> str:
    """``mean KL 3.8e-05 [95% 3.1e-05, 4.6e-05], top-1 100% [100, 100] (argmax alone
    99.12%; 1020 tokens)``: bootstrap intervals over windows in brackets; the argmax
    figure only where exact logit ties make the two rules differ."""
    top = stats["top1_agreement"]
    strict = stats.get("top1_agreement_strict", top)
    alone = f"argmax alone {100 * strict:.4g}%; " if strict != top else ""
    f32 = "; computed in float32 (MLX's CPU refused the model's dtype)"
    f32 = f32 if stats.get("float32") else ""
    (kl_lo, kl_hi), (t_lo, t_hi) = stats["mean_kl_interval"], stats["top1_agreement_interval"]
    return (f"mean KL {stats['mean_kl']:.2g} [95% {kl_lo:.2g}, {kl_hi:.2g}], "
            f"top-1 {100 * top:.4g}% [{100 * t_lo:.4g}, {100 * t_hi:.4g}] "
            f"({alone}{stats['tokens']} tokens{f32})")


def add_behaviour(rep: Any, fused: Any, base: Any, adapter: Any, tokens: int, *,
                  progress: Any = None) -> Any:
    """Add the behaviour line and numbers to a merge check report (in place)."""
    stats = fused_vs_unfused(fused, base, adapter, tokens, progress=progress)
    rep.summary["fused vs unfused"] = behaviour_line(stats)
    rep.behaviour = stats
    return rep
