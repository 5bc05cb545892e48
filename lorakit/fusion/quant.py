"""Quantized bases: dequantize -> fuse -> re-quantize with MLX's own kernels.

mlx-lm stores a quantized weight as ``.weight`` (packed uint32), ``.scales`` and (affine)
``.biases``. Per adapted module a ``quant_policy`` picks one :class:`Choice`:
``requant`` (``mx.quantize`` at the same bits and group size, as ``mlx_lm fuse``),
``same-grid`` (the base's scales and biases, only the codes re-rounded), ``bits:N``,
``float``, ``learned`` (mlx-lm's own GPTQ on the embedded training text) or ``auto``
(:func:`resolve_auto`). The survival stats measure how much of the intended delta the
new codes still carry: at 4 bits a small adapter can vanish entirely.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .. import numerics as nm
from ..errors import FuseError
from ..io.adapters.naming import Binding
from ..io.formats import source
from ..io.formats.checkpoint import Checkpoint, QuantParams
from ..io.formats.corpus import CALIBRATION_CORPUS, encode_text, read_corpus
from ..io.formats.dtypes import mx_dtype, storage_code
from ..io.formats.safetensors import mx_to_raw, raw_to_mx
from .core import fuse_bindings
from .delta import intended, lowrank, tensor_pieces
from .options import Choice, FuseOptions, parse_method, parse_policy

__all__ = ["dequantize_raw", "survival_overall"]

SUPPORTED_MODES = ("affine", "mxfp4", "mxfp8", "nvfp4")


@dataclass
class RequantStat:
    """How much of one delta survived re-quantization."""

    tensor: str
    survived: float  # projection of the realised change on the intended delta, 1.0 = all
    codes_changed: float  # fraction of quantized codes that changed
    codes: int = 0  # quantized codes compared (elements of the weight)
    delta_sq: float = 0.0  # <delta, delta>: the weight of this tensor in the overall share
    policy: str = "requant"  # the quantization policy that wrote the module


def dequantize_raw(ck: Checkpoint, module: str, out_code: Optional[str]) -> np.ndarray:
    """Dequantize ``module`` of ``ck`` to raw float storage (in the scales' dtype,
    or ``out_code``)."""
    import mlx.core as mx  # lazy: MLX only when computing

    q = ck.quant_params(module)
    if q is None:
        raise FuseError("weight is not quantized", file=ck.path, tensor=f"{module}.weight")
    if q.mode not in SUPPORTED_MODES:
        raise FuseError("unsupported quantization mode", file=ck.path / "config.json",
                        tensor=f"{module}.weight", expected=" / ".join(SUPPORTED_MODES),
                        found=repr(q.mode))
    w, s = ck.read_mx(f"{module}.weight"), ck.read_mx(f"{module}.scales")
    b = ck.read_mx(f"{module}.biases") if f"{module}.biases" in ck.tensors else None
    try:
        x = mx.dequantize(w, s, b, group_size=q.group_size, bits=q.bits, mode=q.mode)
        mx.eval(x)
    except (ValueError, RuntimeError) as e:
        raise FuseError(f"cannot dequantize: {e}", file=ck.path, tensor=f"{module}.weight",
                        expected=f"{q.bits}-bit {q.mode}, group size {q.group_size}") from None
    if out_code is not None:
        x = x.astype(mx_dtype(out_code))
    return mx_to_raw(x)[0]


def quantize_raw(raw: np.ndarray, code: str, q: QuantParams) -> Dict[str, np.ndarray]:
    """Quantize float storage with ``mx.quantize`` -> raw weight / scales / biases."""
    import mlx.core as mx  # lazy: MLX only when computing

    x = raw_to_mx(raw, code)
    parts = mx.quantize(x, group_size=q.group_size, bits=q.bits, mode=q.mode)
    names = ("weight", "scales", "biases")
    return {n: mx_to_raw(p)[0] for n, p in zip(names, parts) if p is not None}


def unpack_codes(packed: np.ndarray, bits: int) -> np.ndarray:
    """mlx's packed uint32 words -> one integer code per element (LSB-first bit stream)."""
    u8 = np.ascontiguousarray(packed).astype("<u4").view(np.uint8)
    stream = np.unpackbits(u8.reshape(u8.shape[0] if u8.ndim > 1 else 1, -1),
                           axis=-1, bitorder="little")
    n = stream.shape[-1] // bits
    b = stream[..., : n * bits].reshape(stream.shape[0], n, bits).astype(np.uint16)
    return (b << np.arange(bits, dtype=np.uint16)).sum(-1)


def requant_survival(base_raw: np.ndarray, code: str, parts: Dict[str, np.ndarray],
                     fused_code: str, q: QuantParams, binds: List[Binding],
                     name: str, base_codes: Optional[np.ndarray] = None) -> RequantStat:
    """Fraction of the intended delta that survives re-quantization: ``<W_q' - W_q,
    delta> / <delta, delta>`` (DoRA's rescaling included; 1.0 all of it, 0.0 none)."""
    import mlx.core as mx  # lazy: mlx is heavy and optional at import

    w = mx.array(parts["weight"])
    s = raw_to_mx(parts["scales"], storage_code(parts["scales"], fused_code))
    b = (raw_to_mx(parts["biases"], storage_code(parts["biases"], fused_code))
         if "biases" in parts else None)
    new = np.array(mx.dequantize(w, s, b, group_size=q.group_size, bits=q.bits, mode=q.mode)
                   .astype(mx.float32))
    old = nm.to_float32(base_raw, nm.float_format(code))
    return survival_of(old, new, binds, name, base_codes, parts["weight"], q.bits)


def intended_change(old: np.ndarray, binds: List[Binding]) -> np.ndarray:
    """The change the adapter asks for on float32 weights ``old`` (float64)."""
    delta = np.zeros_like(old, dtype=np.float64)
    for p in tensor_pieces(binds):
        sl = delta if p.slot is None else delta[p.slot]
        if p.magnitude is None:
            sl += lowrank(p)
        else:
            W = (old if p.slot is None else old[p.slot]).astype(np.float64)
            sl += intended(W, p) - W
    return delta


def survival_of(old: np.ndarray, new: np.ndarray, binds: List[Binding], name: str,
                base_codes: Optional[np.ndarray] = None, new_codes: Optional[np.ndarray] = None,
                bits: int = 0) -> RequantStat:
    """:class:`RequantStat` of realised float weights ``new`` against base ``old``."""
    delta = intended_change(old, binds)
    real = new.astype(np.float64) - old
    dd = float((delta * delta).sum())
    survived = float((real * delta).sum() / dd) if dd > 0 else 1.0
    changed, ncodes = float("nan"), 0
    if base_codes is not None and new_codes is not None:
        ne = unpack_codes(base_codes, bits) != unpack_codes(new_codes, bits)
        changed, ncodes = float(ne.mean()), int(ne.size)
    return RequantStat(name, survived, changed, ncodes, dd)


def survival_overall(stats: List[RequantStat]) -> Dict[str, float]:
    """Survival over all re-quantized tensors: ``codes_changed`` and ``survived`` (the
    projection over the whole model, each tensor weighted by its delta's squared norm).

    >>> survival_overall([RequantStat("a", 1.0, 0.5, 10, 3.0), RequantStat("b", 0.0, 1.0, 30, 1.0)])
    {'codes_changed': 0.875, 'survived': 0.75, 'codes': 40, 'tensors': 2}
    """
    codes = sum(s.codes for s in stats)
    dd = sum(s.delta_sq for s in stats)
    changed = (sum(s.codes_changed * s.codes for s in stats if s.codes) / codes) if codes \
        else float("nan")
    survived = (sum(s.survived * s.delta_sq for s in stats) / dd) if dd > 0 else float("nan")
    return {"codes_changed": changed, "survived": survived, "codes": codes,
            "tensors": len(stats)}


def survival_rows(stats: List[RequantStat]) -> List[Tuple[str, str, str]]:
    """One ``(tensor, codes changed, delta survived)`` text row per re-quantized tensor."""
    return [(s.tensor, f"{s.codes_changed:.1%} of {s.codes:,}" if s.codes else
             "n/a (new grid or float)", f"{s.survived:.1%}") for s in stats]


def survival_text(stats: List[RequantStat], indent: str = "") -> List[str]:
    """:func:`survival_rows` as aligned text lines under a header."""
    per = [("tensor", "codes changed", "delta survived")] + survival_rows(stats)
    w0, w1 = (max(len(r[i]) for r in per) for i in (0, 1))
    return [f"{indent}{a:<{w0}}  {b:>{w1}}  {c:>14}" for a, b, c in per]



KEEP = 0.9  # auto: a module "keeps the adapter" when >= 90% of its intended delta survives
AUTO_LADDER = ("bits:5", "bits:6", "bits:8", "float")  # auto's upgrades, cheapest first


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """One integer code per element -> mlx's packed uint32 words (inverse of unpack_codes)."""
    rows, n = codes.shape
    bitsarr = ((codes[..., None].astype(np.uint32) >> np.arange(bits, dtype=np.uint32)) & 1)
    stream = bitsarr.astype(np.uint8).reshape(rows, n * bits)
    return np.packbits(stream, axis=-1, bitorder="little").view("<u4").astype(np.uint32)


def _float32(raw: np.ndarray, code: str) -> np.ndarray:
    return nm.to_float32(raw, nm.float_format(code))


def module_parts(ck: Checkpoint, module: str, binds: List[Binding], rounding: str,
                 dtype_policy: str, choice: Choice) -> Tuple[Dict[str, np.ndarray], RequantStat]:
    """The tensors (weight[, scales, biases]) one adapted quantized module is written as."""
    q = ck.quant_params(module)
    assert q is not None
    code = ck.tensors[f"{module}.scales"].dtype
    name = f"{module}.weight"
    base = dequantize_raw(ck, module, None)
    fused, fcode = fuse_bindings(base, code, binds, rounding, dtype_policy, name)
    base_codes = ck.read(name)
    if choice.kind in ("bits", "same-grid") and q.mode != "affine":
        raise FuseError(f"quant policy {choice.label} needs affine quantization", file=ck.path,
                        tensor=name, expected="mode affine", found=q.mode)
    qn = QuantParams(q.group_size, choice.bits, q.mode) if choice.kind == "bits" else q
    if choice.kind in ("requant", "bits"):  # the fused weight on its own grid, or new bits
        parts = quantize_raw(fused, fcode, qn)
    elif choice.kind == "float":
        parts = {"weight": fused}
    elif choice.kind == "learned":
        parts = choice.parts
    elif choice.kind == "same-grid":  # the base's scales and biases, the codes re-rounded
        import mlx.core as mx  # lazy: MLX only when computing

        s = ck.read(f"{module}.scales")
        old = _float32(base, code).astype(np.float64)
        step = np.repeat(_float32(s, code).astype(np.float64), q.group_size, axis=-1)
        change = _float32(fused, fcode).astype(np.float64) - old
        codes = unpack_codes(base_codes, q.bits).reshape(old.shape).astype(np.int64)
        new = np.clip(np.rint(codes + change / step), 0, (1 << q.bits) - 1)
        new = np.where(change == 0, codes, new)  # nothing asked, nothing moves
        packed = pack_codes(new.reshape(-1, old.shape[-1]), q.bits).reshape(base_codes.shape)
        parts = {"weight": packed, "scales": s}
        if f"{module}.biases" in ck.tensors:
            parts["biases"] = ck.read(f"{module}.biases")
        if fcode != code:  # an explicit dtype policy casts scales and biases too (nearest)
            parts.update({k: mx_to_raw(mx.array(_float32(v, code)).astype(mx_dtype(fcode)))[0]
                          for k, v in parts.items() if k != "weight"})
    else:
        raise FuseError("quant policy is not a per-module choice", tensor=name,
                        found=choice.label)
    if choice.kind == "float":
        stat = survival_of(_float32(base, code), _float32(fused, fcode), binds, name)
    else:  # codes changed: on the base's own grid only
        codes = base_codes if qn is q else None
        stat = requant_survival(base, code, parts, fcode, qn, binds, name, codes)
    stat.policy = choice.label
    return parts, stat


def module_bytes(ck: Checkpoint, module: str, choice: Choice) -> int:
    """Bytes one module takes on disk under ``choice``."""
    q = ck.quant_params(module)
    s = ck.tensors[f"{module}.scales"]
    w = ck.tensors[f"{module}.weight"]
    n_in = w.shape[-1] * 32 // q.bits
    rows = int(np.prod(w.shape[:-1]))
    fbytes = nm.float_format(s.dtype).bits // 8
    if choice.kind == "float":
        return rows * n_in * fbytes
    bits = choice.bits if choice.kind == "bits" else q.bits
    nparts = 2 if f"{module}.biases" in ck.tensors else 1
    return rows * n_in * bits // 8 + nparts * rows * (n_in // q.group_size) * fbytes


def resolve(ck: Checkpoint, by_tensor: Dict[str, List[Binding]], opts: FuseOptions,
            progress: Any = False) -> Dict[str, Choice]:
    """Module -> Choice for every adapted quantized module ({} for ``requant``)."""
    c, policy, budget = opts.choice, opts.quant_policy, opts.quant_budget
    rounding, dtype_policy = opts.rounding, opts.dtype
    if c.kind == "requant":
        return {}
    if not ck.quantization or opts.dequantize:
        raise FuseError("a quant policy applies to a quantized base, re-quantized",
                        file=ck.path, expected="a quantized base without --dequantize",
                        found="float base" if not ck.quantization else "--dequantize")
    mods = [n[: -len(".weight")] for n in by_tensor
            if n.endswith(".weight") and ck.quant_params(n[: -len(".weight")]) is not None]
    if c.kind == "learned":
        parts = learned_parts(ck, by_tensor, mods, rounding, dtype_policy, policy,
                              progress=progress)
        return {m: Choice("learned", parts=parts[m]) for m in mods}
    if c.kind != "auto":
        return {m: c for m in mods}
    return resolve_auto(ck, by_tensor, mods, rounding, dtype_policy,
                        1.15 if budget is None else budget)


def resolve_auto(ck: Checkpoint, by_tensor: Dict[str, List[Binding]], mods: List[str],
                 rounding: str, dtype_policy: str, budget: float) -> Dict[str, Choice]:
    """The auto rule: each module starts as the better of ``same-grid`` / ``requant``;
    those keeping less than :data:`KEEP` go, worst first, to the cheapest step of
    :data:`AUTO_LADDER` reaching KEEP (else the best), while the total bytes stay within
    ``budget`` x the quantized base's."""
    limit = budget * ck.nbytes
    total = float(ck.nbytes)
    out: Dict[str, Choice] = {}
    surv: Dict[str, float] = {}
    for m in mods:
        binds = by_tensor[f"{m}.weight"]
        best = None
        for c in (Choice("same-grid"), Choice("requant")):
            try:
                _, st = module_parts(ck, m, binds, rounding, dtype_policy, c)
            except FuseError:
                continue
            if best is None or st.survived > best[1]:
                best = (c, st.survived)
        out[m], surv[m] = best
    for m in sorted(mods, key=lambda k: surv[k]):
        if surv[m] >= KEEP:
            continue
        binds = by_tensor[f"{m}.weight"]
        here = module_bytes(ck, m, out[m])
        pick = None
        for label in AUTO_LADDER:
            c = parse_policy(label)
            extra = module_bytes(ck, m, c) - here
            if total + extra > limit:
                break
            _, st = module_parts(ck, m, binds, rounding, dtype_policy, c)
            if pick is None or st.survived > pick[2]:
                pick = (c, extra, st.survived)
            if st.survived >= KEEP:
                break
        if pick is not None and pick[2] > surv[m]:
            out[m] = pick[0]
            total += pick[1]
    return out


def plan_leaf(ck: Checkpoint, module: str, name: str, choice: Optional[Choice], out_code: str,
              info, by_tensor) -> Optional[List[Tuple[str, Tuple[int, ...]]]]:
    """The (dtype, shape) one stored tensor of an adapted module is written with under a
    float or bits:N choice ([]: dropped); None where the usual requant plan holds."""
    if choice is None or choice.kind not in ("float", "bits") or \
            f"{module}.weight" not in by_tensor:
        return None
    q = ck.quant_params(module)
    leaf, shape = name.rsplit(".", 1)[1], tuple(info.shape)
    n_in = ck.tensors[f"{module}.weight"].shape[-1] * 32 // q.bits
    lead = shape[:-1]
    if choice.kind == "float":
        return [(out_code, lead + (n_in,))] if leaf == "weight" else []
    if leaf == "weight":
        return [("U32", lead + (n_in * choice.bits // 32,))]
    return [(out_code if info.dtype in ("BF16", "F16", "F32") else info.dtype, shape)]


def policy_summary(policy: str, stats: List[RequantStat]) -> List[Tuple[str, str]]:
    """FuseResult's row ``quant policy  auto: bits:5 9, requant 19`` (none for requant)."""
    if policy == "requant":
        return []
    counts: Dict[str, int] = {}
    for st in stats:
        counts[st.policy] = counts.get(st.policy, 0) + 1
    return [("quant policy",
             f"{policy}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))]


def per_layer_config(config: dict, ck: Checkpoint, choices: Optional[Dict[str, Choice]]) -> dict:
    """Record each choice in mlx-lm's per-layer ``quantization`` (and its HF twin)."""
    for m, ch in (choices or {}).items():
        q = ck.quant_params(m)  # float: False; new bits: their entry; else the top level holds
        entry = False if ch.kind == "float" else None
        if ch.kind == "bits" and ch.bits != q.bits:
            entry = {"group_size": q.group_size, "bits": ch.bits, "mode": q.mode}
        for key in ("quantization", "quantization_config"):
            if entry is not None and isinstance(config.get(key), dict):
                config[key][m] = entry
    return config


def check_float_base(quantized: Any, float_base: Any) -> Any:
    """``--float-base``: the float original of a quantized base, checked to be one (the
    same config but for quantization, the same module names) -> the path to fuse into."""
    q, f = source.open(quantized, checkpoint=True), source.open(float_base, checkpoint=True)
    if not q.quantization:
        raise FuseError("--float-base is for a quantized base", file=q.path,
                        expected="a quantized model", found="float weights")
    if f.quantization:
        raise FuseError("--float-base must be a float checkpoint", file=f.path,
                        expected="float weights", found="a quantized model")
    drop = ("quantization", "quantization_config", "torch_dtype")
    qc = {k: v for k, v in q.config.items() if k not in drop}
    fc = {k: v for k, v in f.config.items() if k not in drop}
    want = sorted(n for n in q.tensors if not n.endswith((".scales", ".biases")))
    if qc != fc or sorted(f.tensors) != want:
        diff = sorted(k for k in set(qc) | set(fc) if qc.get(k) != fc.get(k))
        raise FuseError("--float-base is not the float original of the quantized base",
                        file=f.path, expected=f"config and tensor names of {q.path.name}",
                        found=f"differs in {diff[:4] or 'tensor names'}")
    return f.path



SEQUENCE_LENGTH = 256
SAMPLES = 16


def calibration_tokens(tokenizer, corpus: Optional[Path] = None,
                       sequence_length: int = SEQUENCE_LENGTH, samples: int = SAMPLES):
    """The first ``samples`` consecutive windows of ``sequence_length`` tokens of the
    calibration text (UTF-8; ``.jsonl``: each line's ``text`` joined with newlines)."""
    import mlx.core as mx  # lazy: MLX only when computing

    path = Path(corpus) if corpus is not None else CALIBRATION_CORPUS
    ids = np.asarray(encode_text(tokenizer, read_corpus(path)[0]), dtype=np.int32)
    n = min(samples, len(ids) // sequence_length)
    if n == 0:
        raise FuseError("the calibration text is shorter than one window", file=path,
                        expected=f"at least {sequence_length} tokens", found=f"{len(ids)}")
    return mx.array(ids[: n * sequence_length].reshape(n, sequence_length))


def learned_parts(ck: Checkpoint, by_tensor: Dict[str, List[Binding]], mods: List[str],
                  rounding: str, dtype_policy: str, policy: str = "learned",
                  corpus: Optional[Path] = None, progress: Any = True
                  ) -> Dict[str, Dict[str, np.ndarray]]:
    """Module -> raw ``weight`` / ``scales`` / ``biases`` mlx-lm's GPTQ picks for each fused
    module of ``mods`` at the base's bits (mlx-lm's bars only with ``progress=True``)."""
    import mlx.core as mx  # lazy: MLX only when computing
    import mlx.nn as nn  # lazy: MLX only when computing
    from mlx.utils import tree_unflatten  # lazy: MLX only when computing
    from mlx_lm import load  # lazy: mlx-lm only for the learned policy
    from mlx_lm.quant import gptq  # lazy: mlx-lm only for the learned policy

    parse_method(policy)
    q = {ck.quant_params(m) for m in mods}
    if len(q) != 1 or next(iter(q)).mode != "affine" or next(iter(q)).bits not in (2, 4, 8):
        raise FuseError("quant policy learned (GPTQ) needs one affine grid of 2, 4 or 8 bits",
                        file=ck.path, expected="affine, bits 2/4/8, one group size",
                        found=str(sorted(map(str, q))))
    qp = next(iter(q))
    model, tokenizer = load(str(ck.path))
    mods_now = dict(model.named_modules())
    swapped = []
    for m in mods:
        name = f"{m}.weight"
        code = ck.tensors[f"{m}.scales"].dtype
        fused, fcode = fuse_bindings(dequantize_raw(ck, m, None), code, by_tensor[name],
                                     rounding, dtype_policy, name)
        old = mods_now.get(m)
        if not isinstance(old, nn.QuantizedLinear):
            raise FuseError("quant policy learned handles quantized linear layers only",
                            file=ck.path, tensor=name, expected="QuantizedLinear",
                            found=type(old).__name__)
        w = raw_to_mx(fused.reshape(-1, fused.shape[-1]), fcode)
        lin = nn.Linear(w.shape[1], w.shape[0], bias="bias" in old)
        lin.weight = w
        if "bias" in old:
            lin.bias = old.bias
        swapped.append((m, lin))
    model.update_modules(tree_unflatten(swapped))
    data = calibration_tokens(tokenizer, corpus)
    mx.random.seed(0)
    bars = gptq.tqdm
    if progress is not True:  # mlx-lm's bars follow lorakit's progress= (on, or off)
        gptq.tqdm = partial(bars, disable=True)
    try:
        model, _ = gptq.gptq_quantize(model, data, qp.bits, qp.group_size, qp.bits,
                                      qp.group_size)
    finally:
        gptq.tqdm = bars
    done = dict(model.named_modules())
    out = {}
    for m in mods:
        layer = done[m]
        shape = ck.tensors[f"{m}.weight"].shape
        parts = {"weight": mx_to_raw(layer.weight)[0].reshape(shape)}
        for leaf in ("scales", "biases"):  # in the fused weight's dtype, as requant
            parts[leaf] = mx_to_raw(getattr(layer, leaf))[0].reshape(
                ck.tensors[f"{m}.{leaf}"].shape)
        out[m] = parts
    return out
