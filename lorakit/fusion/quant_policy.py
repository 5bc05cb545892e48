"""Quantization policies for a fuse into a quantized base (``quant_policy=``).

Per adapted module, one :class:`Choice`:

- ``requant``: dequantize, fuse, re-quantize with ``mx.quantize`` (as ``mlx_lm fuse``);
- ``same-grid``: keep each group's scale and bias, re-round only the codes
  (``code' = clip(round(code + (W' - W) / scale))``: unchanged wherever the adapter
  adds nothing);
- ``bits:N``: re-quantize the fused weight at N bits (affine, the base's group size),
  recorded as mlx-lm's per-layer ``config["quantization"][module]``;
- ``float``: keep the fused weight in the scales' float dtype
  (``config["quantization"][module] = false``);
- ``learned`` (``learned:gptq``): fuse, then mlx-lm's GPTQ picks the codes at the
  base's bits on calibration text (:mod:`lorakit.fusion.quant_learned`; AWQ and DWQ are
  refused with the reason there);
- ``auto``: per module the cheapest choice that keeps the adapter, under a byte budget
  (the rule in :func:`resolve_auto`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .. import numerics as nm
from ..errors import FuseError
from ..io.checkpoint import Checkpoint, QuantParams, open_checkpoint
from ..io.dtypes import mx_dtype
from ..io.naming import Binding
from ..io.safetensors import mx_to_raw
from .core import fuse_bindings
from .quant_learned import learned_parts, parse_method
from .quant import (RequantStat, dequantize_raw, quantize_raw, requant_survival, survival_of,
                    unpack_codes)

POLICIES = ("requant", "same-grid", "bits:N", "float", "learned[:gptq]", "auto")
KEEP = 0.9  # auto: a module "keeps the adapter" when >= 90% of its intended delta survives
AUTO_LADDER = ("bits:5", "bits:6", "bits:8", "float")  # auto's upgrades, cheapest first


@dataclass(frozen=True)
class Choice:
    """What one adapted module becomes."""

    kind: str  # requant | same-grid | bits | float | learned
    bits: int = 0
    parts: Any = field(default=None, compare=False, hash=False, repr=False)  # learned's

    @property
    def label(self) -> str:
        return f"bits:{self.bits}" if self.kind == "bits" else self.kind


REQUANT = Choice("requant")


def parse_policy(policy: str) -> Choice:
    """``"bits:8"`` -> Choice("bits", 8); ``auto`` and ``learned`` parse to their kind."""
    p = str(policy).strip().lower()
    if p.startswith("bits:"):
        try:
            n = int(p[5:])
        except ValueError:
            n = -1
        if n not in (2, 3, 4, 5, 6, 8):
            raise FuseError("unsupported bits in quant policy", expected="bits:2..6 or bits:8",
                            found=repr(policy))
        return Choice("bits", n)
    if p in ("requant", "same-grid", "float", "auto"):
        return Choice(p)
    if p == "learned" or p.startswith("learned:"):
        parse_method(p)
        return Choice("learned")
    raise FuseError("unknown quant policy", expected=" | ".join(POLICIES), found=repr(policy))


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """One integer code per element -> mlx's packed uint32 words (inverse of unpack_codes)."""
    rows, n = codes.shape
    bitsarr = ((codes[..., None].astype(np.uint32) >> np.arange(bits, dtype=np.uint32)) & 1)
    stream = bitsarr.astype(np.uint8).reshape(rows, n * bits)
    return np.packbits(stream, axis=-1, bitorder="little").view("<u4").astype(np.uint32)


def _float32(raw: np.ndarray, code: str) -> np.ndarray:
    return nm.to_float32(raw, nm.float_format(code))


def _from_float32(x: np.ndarray, code: str) -> np.ndarray:
    """float32 values -> raw storage of ``code`` (round to nearest, through MLX)."""
    import mlx.core as mx  # lazy: MLX only when computing

    return mx_to_raw(mx.array(x.astype(np.float32)).astype(mx_dtype(code)))[0]


def _check_affine(ck: Checkpoint, module: str, q: QuantParams, what: str) -> None:
    if q.mode != "affine":
        raise FuseError(f"quant policy {what} needs affine quantization", file=ck.path,
                        tensor=f"{module}.weight", expected="mode affine", found=q.mode)


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
    if choice.kind == "requant":
        parts = quantize_raw(fused, fcode, q)
        stat = requant_survival(base, code, parts, fcode, q, binds, name, base_codes)
    elif choice.kind == "float":
        parts = {"weight": fused}
        stat = survival_of(_float32(base, code), _float32(fused, fcode), binds, name)
    elif choice.kind == "bits":
        _check_affine(ck, module, q, choice.label)
        qn = QuantParams(q.group_size, choice.bits, q.mode)
        parts = quantize_raw(fused, fcode, qn)
        stat = requant_survival(base, code, parts, fcode, qn, binds, name)
    elif choice.kind == "learned":
        parts = choice.parts
        stat = requant_survival(base, code, parts, fcode, q, binds, name, base_codes)
    elif choice.kind == "same-grid":
        _check_affine(ck, module, q, choice.label)
        parts, stat = _same_grid(ck, module, q, base, code, fused, fcode, binds, base_codes)
    else:
        raise FuseError("quant policy is not a per-module choice", tensor=name,
                        found=choice.label)
    stat.policy = choice.label
    return parts, stat


def _same_grid(ck: Checkpoint, module: str, q: QuantParams, base: np.ndarray, code: str,
               fused: np.ndarray, fcode: str, binds: List[Binding], base_codes: np.ndarray):
    s = ck.read(f"{module}.scales")
    sf = _float32(s, code).astype(np.float64)
    old = _float32(base, code).astype(np.float64)
    step = np.repeat(sf, q.group_size, axis=-1)
    change = _float32(fused, fcode).astype(np.float64) - old
    codes = unpack_codes(base_codes, q.bits).reshape(old.shape).astype(np.int64)
    new = np.clip(np.rint(codes + change / step), 0, (1 << q.bits) - 1)
    new = np.where(change == 0, codes, new)  # nothing asked, nothing moves
    packed = pack_codes(new.reshape(-1, old.shape[-1]), q.bits).reshape(base_codes.shape)
    parts = {"weight": packed, "scales": s}
    if f"{module}.biases" in ck.tensors:
        parts["biases"] = ck.read(f"{module}.biases")
    if fcode != code:  # an explicit dtype policy casts scales and biases too
        parts.update({k: _from_float32(_float32(v, code), fcode)
                      for k, v in parts.items() if k != "weight"})
    stat = requant_survival(base, code, parts, fcode, q, binds, f"{module}.weight", base_codes)
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


def config_entry(choice: Choice, q: QuantParams):
    """mlx-lm's per-layer quantization entry for ``choice`` (None: the top level holds)."""
    if choice.kind == "float":
        return False
    if choice.kind == "bits" and choice.bits != q.bits:
        return {"group_size": q.group_size, "bits": choice.bits, "mode": q.mode}
    return None


def resolve(ck: Checkpoint, by_tensor: Dict[str, List[Binding]], policy: str, rounding: str,
            dtype_policy: str, budget: Optional[float] = None,
            dequantize: bool = False, progress: Any = False) -> Dict[str, Choice]:
    """Module -> Choice for every adapted quantized module ({} for ``requant``)."""
    c = parse_policy(policy)
    if c.kind == "requant":
        return {}
    if not ck.quantization or dequantize:
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
    """The auto rule. Each module starts at the base's bits, as whichever of
    ``same-grid`` / ``requant`` keeps more of its delta (same bytes). Modules that keep
    less than :data:`KEEP` are upgraded, worst survival first, to the cheapest step of
    :data:`AUTO_LADDER` that reaches KEEP (else the best step), while the checkpoint's
    total bytes stay within ``budget`` x the quantized base's; a module that does not
    fit keeps its base-bits choice."""
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
        entry = config_entry(ch, ck.quant_params(m))
        for key in ("quantization", "quantization_config"):
            if entry is not None and isinstance(config.get(key), dict):
                config[key][m] = entry
    return config


def check_float_base(quantized: Any, float_base: Any) -> Any:
    """``--float-base``: the float original of a quantized base, checked to be one (the
    same config but for quantization, the same module names) -> the path to fuse into."""
    q, f = open_checkpoint(quantized), open_checkpoint(float_base)
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
