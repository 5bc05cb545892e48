"""Writing an :class:`~lorakit.io.adapters.base.Adapter` as mlx-lm or PEFT saves one.

:func:`save_adapter` is the one adapter writer (convert, combine, extract, resize,
``synth_adapter``): built in a hidden sibling and published whole, with provenance;
``lorakit.load_adapter`` reads back every bit. What a format cannot hold is refused
with the reason, never approximated: per-module scales in mlx-lm (a power-of-two ratio
is folded into ``lora_b`` exactly; lower ranks are zero-padded), a scale no float64
``lora_alpha`` gives as ``alpha / r``, factors the requested dtype cannot hold exactly.
"""
from __future__ import annotations

import copy
import json
import math
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ...errors import AdapterError, ArgumentError, PathLike
from ...numerics import round_to_format, to_float32
from ..formats.safetensors import TensorSpec, read_header
from ..outputs.directory import TMP_MARK, OutputDirectory, check_output_path
from ..outputs.safetensors_write import SafetensorsWriter
from .base import CONFIG, MLX_WEIGHTS, PEFT_PREFIX, PEFT_WEIGHTS, Adapter, LoraTarget
from .layout import (
    alpha_for,
    expert_modules,
    fused_experts,
    layer_gaps,
    mlx_scope,
    param_wrappers,
    restack,
    switch_name,
    switch_parts,
)
from .peft import FIELDS, TOKENS_SUFFIX

__all__ = ["save_adapter"]

FORMATS = ("mlx-lm", "peft")
#: how a PEFT adapter holds MoE experts (``experts=``)
EXPERTS = ("modules", "parameters")
_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def save_adapter(adapter: Adapter, path: PathLike, *, format: str = "mlx-lm",
                 force: bool = False, provenance: Optional[Mapping[str, Any]] = None,
                 dtype: Optional[str] = None, num_layers: Optional[int] = None,
                 protected: Sequence[PathLike] = (), verb: str = "save-adapter",
                 config: Optional[Mapping[str, Any]] = None, mark: str = TMP_MARK,
                 experts: str = "modules") -> Path:
    """Write ``adapter`` to directory ``path`` (created whole or not at all) as mlx-lm or
    PEFT. ``dtype`` defaults to the source file's, else F32; a factor it cannot hold exactly
    is refused. ``config`` is laid over the written adapter_config.json. ``experts``
    (PEFT): MoE experts as per-expert ``modules`` (transformers 4) or as
    ``target_parameters`` on the fused 3-D ``parameters`` (transformers 5).

    >>> from lorakit import load_adapter
    >>> ad = load_adapter("data/adapters/lora")
    >>> back = load_adapter(save_adapter(ad, "out/lora-peft", format="peft"))
    >>> back.format, len(back.targets), back.targets[0].scale == ad.targets[0].scale
    ('peft', 28, True)
    """
    if format not in FORMATS:
        raise AdapterError("unknown adapter format", expected="mlx-lm or peft", found=repr(format))
    if experts not in EXPERTS:
        raise ArgumentError.bad("experts", experts, " | ".join(EXPERTS))
    if not adapter.targets and not adapter.replacements:
        raise AdapterError("adapter has nothing to save", file=adapter.path,
                           expected="at least one LoRA target", found="none")
    code = _dtype_code(adapter, dtype)
    prot = [Path(p) for p in protected]
    if Path(adapter.path).exists():
        prot.append(Path(adapter.path))
    out = check_output_path(path, protected=prot, force=force, allow_empty=True,
                            overlap_message="adapter output would overlap an input directory")
    if format == "mlx-lm":
        tensors, cfg, weights = _mlx_layout(adapter, code, num_layers)
    else:
        tensors, cfg, weights = _peft_layout(adapter, code, experts)
    cfg.update(dict(config or {}))
    with OutputDirectory(out, force=force, allow_empty=True, mark=mark) as od:
        _write(od.tmp / weights, tensors, None if format == "mlx-lm" else {"format": "pt"})
        (od.tmp / CONFIG).write_text(json.dumps(cfg, indent=2))
        info = {"format": format, "dtype": code, "source": str(adapter.path),
                "source_format": adapter.format, "targets": len(adapter.targets)}
        if format == "peft":
            info["llama_cpp_convert"] = llama_cpp_notes(cfg)
        info.update(dict(provenance or {}))
        od.commit(verb, info)
    return out


def _dtype_code(adapter: Adapter, dtype: Optional[str]) -> str:
    if dtype is None:
        try:
            codes = Counter(i.dtype for i in read_header(adapter.weights_file).tensors.values()
                            if i.dtype in _DTYPES)
        except Exception:  # built in memory: no file, or not a safetensors file
            codes = Counter()
        return codes.most_common(1)[0][0] if codes else "F32"
    code = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}.get(str(dtype), str(dtype))
    if code not in _DTYPES:
        raise AdapterError("unknown adapter dtype", expected="F32, BF16 or F16", found=repr(dtype))
    return code


def _enc(name: str, x: np.ndarray, code: str) -> Tuple[str, np.ndarray, str]:
    """(name, ``x`` as storage of dtype ``code``, code), refused unless every value is held
    exactly."""
    x = np.ascontiguousarray(x)
    if code == "F32":
        y = back = x.astype(np.float32)
    else:
        y = round_to_format(x.astype(np.float64), _DTYPES[code])
        back = to_float32(y, _DTYPES[code])
    if not np.array_equal(back.astype(np.float64), x.astype(np.float64)):
        raise AdapterError("adapter tensor cannot be stored exactly in the requested dtype",
                           tensor=name, expected=f"values {code} holds exactly",
                           found="values that would be rounded",
                           hint="save with dtype='F32' (lorakit never rounds an adapter silently)")
    return name, y, code


def _write(file: Path, tensors: List[Tuple[str, np.ndarray, str]],
           meta: Optional[Dict[str, str]]) -> None:
    tensors = sorted(tensors, key=lambda t: t[0])  # both reference writers sort by name
    plan = [TensorSpec(n, code, tuple(a.shape)) for n, a, code in tensors]
    with SafetensorsWriter(file, plan, meta) as w:
        for n, a, _ in tensors:
            w.write(n, np.ascontiguousarray(a))


def _mlx_targets(adapter: Adapter) -> List[LoraTarget]:
    """Targets with per-expert modules stacked back into mlx-lm's switch modules."""
    return _stacked([p for t in adapter.targets for p in switch_parts(t)])


def _stacked(targets: List[LoraTarget]) -> List[LoraTarget]:
    """``targets`` with per-expert modules stacked into mlx-lm's switch modules."""
    linear = [t for t in targets if t.kind == "linear"]
    groups = restack([t.module for t in linear])
    by_module = {t.module: t for t in targets}
    done: set = set()
    out: List[LoraTarget] = []
    for t in targets:
        if t.module in done:
            continue
        stack = next(((s, ms) for s, ms in groups.items() if t.module in dict(ms).values()), None)
        if stack is None:
            out.append(t)
            continue
        name, members = stack
        ts = [by_module[m] for _, m in members]
        done.update(m for _, m in members)
        if len({x.rank for x in ts}) > 1 or len({x.scale for x in ts}) > 1 or \
                any(x.is_dora for x in ts):
            out += ts  # mlx-lm has one rank per stack and no DoRA on experts: refused below
            continue
        out.append(LoraTarget(name, "switch", np.stack([x.A for x in ts]),
                              np.stack([x.B for x in ts]), ts[0].scale, None,
                              tuple(n for x in ts for n in x.names)))
    return out


def _padded(t: LoraTarget, rank: int) -> LoraTarget:
    lead = t.A.shape[:-2]
    A = np.concatenate([t.A, np.zeros(lead + (rank - t.rank, t.A.shape[-1]), np.float32)], -2)
    B = np.concatenate([t.B, np.zeros(lead + (t.B.shape[-2], rank - t.rank), np.float32)], -1)
    return LoraTarget(t.module, t.kind, A, B, t.scale, t.magnitude, t.names, t.base_weight)


def _mlx_scale(targets: List[LoraTarget], file: Path) -> Tuple[float, Dict[str, float]]:
    """The adapter's one scale, and a power-of-two factor to fold into each target's B."""
    scale = Counter(t.scale for t in targets).most_common(1)[0][0]
    fold: Dict[str, float] = {}
    for t in targets:
        if t.scale == scale:
            continue
        ratio = t.scale / scale
        mant = math.frexp(abs(ratio))[0] if ratio else 0.0
        if mant != 0.5 or ratio * scale != t.scale:
            raise AdapterError("mlx-lm holds one scale per adapter; this adapter's targets "
                               "differ by a factor that is not a power of two", file=file,
                               tensor=t.module, expected=f"scale {scale!r} (or a power of two "
                               f"times it)", found=f"scale {t.scale!r}",
                               hint="save with format='peft' (alpha_pattern holds per-module "
                               "scales)")
        fold[t.module] = ratio
    return scale, fold


def _mlx_layout(adapter: Adapter, code: str, num_layers: Optional[int]
                ) -> Tuple[List[Tuple[str, np.ndarray, str]], Dict[str, Any], str]:
    file = adapter.path
    if adapter.replacements or any(t.base_weight is not None for t in adapter.targets):
        what = adapter.replacements[0].name if adapter.replacements else next(
            t.module for t in adapter.targets if t.base_weight is not None)
        raise AdapterError("mlx-lm adapters cannot carry whole tensors (modules_to_save, "
                           "a saved base embedding)", file=file, tensor=what,
                           expected="LoRA factors only", found="a whole tensor",
                           hint="save with format='peft'")
    targets = _mlx_targets(adapter)
    rank = max(t.rank for t in targets)
    # mlx-lm has one rank: a lower-rank target is padded with zero rows of A and zero
    # columns of B, which add exact zeros to every product (the delta is unchanged)
    targets = [t if t.rank == rank else _padded(t, rank) for t in targets]
    bad = next((t for t in targets if t.kind == "switch" and t.is_dora), None) or next(
        (t for t in targets if t.is_dora and ".experts." in t.module), None)
    if bad is not None:
        raise AdapterError("mlx-lm has no DoRA for MoE experts (SwitchLinear)", file=file,
                           tensor=bad.module, expected="LoRA on experts", found="DoRA",
                           hint="save with format='peft'")
    scale, fold = _mlx_scale(targets, file)
    dora = any(t.is_dora for t in targets)
    if dora and not all(t.is_dora for t in targets):
        t = next(t for t in targets if not t.is_dora)
        raise AdapterError("mlx-lm's fine_tune_type is one for the whole adapter: DoRA and "
                           "plain LoRA targets are mixed", file=file, tensor=t.module,
                           expected="all DoRA or all LoRA", found="both",
                           hint="save with format='peft'")
    src = adapter.config if adapter.format == "mlx-lm" else {}
    if num_layers is None and type(src.get("num_layers")) is int:
        num_layers = src["num_layers"]
    n, keys = mlx_scope([t.module for t in targets], num_layers)
    if dora:
        gaps = layer_gaps([t.module for t in targets], n)
        if gaps:
            raise AdapterError("mlx-lm would put DoRA layers without saved magnitudes on "
                               "modules this adapter leaves alone (they would change the "
                               "model)", file=file, tensor=gaps[0],
                               expected="every key in every adapted block",
                               found=f"{len(gaps)} module(s) missing",
                               hint="save with format='peft'")
    tensors: List[Tuple[str, np.ndarray, str]] = []
    for t in targets:
        B = t.B * np.float32(fold[t.module]) if t.module in fold else t.B
        if t.kind == "linear":
            a, b = t.A.T, B.T
        elif t.kind == "embedding":
            a, b = B, t.A
        else:
            a, b = t.A, B
        tensors += [_enc(f"{t.module}.lora_a", a, code), _enc(f"{t.module}.lora_b", b, code)]
        if t.magnitude is not None:
            tensors.append(_enc(f"{t.module}.m", t.magnitude, code))
    cfg = {k: v for k, v in src.items() if k not in ("lora_parameters",)}
    params = dict(src.get("lora_parameters") or {})
    params.update({"rank": int(rank), "scale": scale,
                   "dropout": params.get("dropout", 0.0)})
    params["keys"] = keys if not (src and set(params.get("keys") or ()) == set(keys)) \
        else params["keys"]
    cfg.update({"fine_tune_type": "dora" if dora else "lora", "num_layers": n,
                "lora_parameters": params})
    cfg.setdefault("model", _base_name(adapter))
    return tensors, cfg, MLX_WEIGHTS


def _peft_targets(adapter: Adapter, experts: str) -> List[LoraTarget]:
    """Targets with mlx-lm's stacked experts split into PEFT's per-expert modules, or
    (``experts="parameters"``) every expert stack as transformers' fused parameters."""
    out: List[LoraTarget] = []
    targets = adapter.targets
    if experts == "parameters":
        targets = fused_experts(_stacked(targets), lambda name: True)
        left = next((t for t in targets if ".switch_mlp." in t.module
                     or switch_name(t.module)), None)  # a stack or expert not fused
        if left is not None:
            raise AdapterError("experts that transformers does not hold as fused "
                               "parameters, or of two scales", file=adapter.path,
                               tensor=left.module, expected="<block>.mlp experts of one "
                               "scale", found=left.module, hint="write experts='modules'")
    for t in targets:
        if t.kind != "switch" or ".switch_mlp." not in t.module:
            out.append(t)  # a PEFT target_parameters target stays one
            continue
        names = expert_modules(t.module, t.A.shape[0])
        out += [LoraTarget(m, "linear", t.A[e], t.B[e], t.scale,
                           None if t.magnitude is None else t.magnitude[e], t.names)
                for e, m in enumerate(names)]
    return out


def _peft_layout(adapter: Adapter, code: str, experts: str
                 ) -> Tuple[List[Tuple[str, np.ndarray, str]], Dict[str, Any], str]:
    targets = _peft_targets(adapter, experts)
    tensors: List[Tuple[str, np.ndarray, str]] = []
    alphas: Dict[str, Any] = {}
    wrappers = param_wrappers([t.module for t in targets if t.kind == "switch"])
    for t in targets:
        p = PEFT_PREFIX + wrappers.get(t.module, t.module)
        if t.scale < 0:  # PEFT needs lora_alpha > 0: the sign moves into B (exactly)
            t = LoraTarget(t.module, t.kind, t.A, -t.B, -t.scale, t.magnitude, t.names,
                           t.base_weight)
        if t.kind == "embedding":
            tensors += [_enc(f"{p}.lora_embedding_A", t.B.T, code),
                        _enc(f"{p}.lora_embedding_B", t.A.T, code)]
        elif t.kind == "switch":  # target_parameters: A (E*r, in), B (out, r*E)
            n, r = t.A.shape[:2]
            tensors += [_enc(f"{p}.lora_A.weight", t.A.reshape(n * r, -1), code),
                        _enc(f"{p}.lora_B.weight",
                             t.B.transpose(1, 2, 0).reshape(t.B.shape[1], r * n), code)]
        else:
            tensors += [_enc(f"{p}.lora_A.weight", t.A, code),
                        _enc(f"{p}.lora_B.weight", t.B, code)]
        if t.magnitude is not None:
            tensors.append(_enc(f"{p}.lora_magnitude_vector", t.magnitude, code))
        if t.base_weight is not None:
            raw, wcode = t.base_weight
            tensors.append((f"{p}.base_layer.weight", raw, wcode))
        a = alpha_for(t.scale, t.rank)
        if a is None:
            raise AdapterError("no PEFT lora_alpha gives this scale as alpha / r exactly",
                               file=adapter.path, tensor=t.module,
                               expected=f"alpha with alpha / {t.rank} == {t.scale!r} in "
                               "float64", found="none within 4 ulps of scale * r",
                               hint="save with format='mlx-lm' (it stores the scale itself)")
        alphas[t.module] = a
    for r in adapter.replacements:  # trainable tokens: the rows, their indices in the config
        key = r.module + TOKENS_SUFFIX if r.rows else f"{r.module}.{r.leaf}"
        tensors.append((PEFT_PREFIX + key, r.raw, r.code))
    if len({t.is_dora for t in targets}) > 1:
        t = next(t for t in targets if not t.is_dora)
        raise AdapterError("PEFT's use_dora is one for the whole adapter: DoRA and plain "
                           "LoRA targets are mixed", file=adapter.path, tensor=t.module,
                           expected="all DoRA or all LoRA", found="both")
    cfg = peft_config(targets, alphas, [r.module for r in adapter.replacements if not r.rows],
                      _base_name(adapter))
    tokens = {r.module: list(r.rows) for r in adapter.replacements if r.rows}
    cfg["trainable_token_indices"] = tokens or None
    return tensors, cfg, PEFT_WEIGHTS


#: FIELDS that PEFT 0.21's save_pretrained leaves out of a LoRA config
_UNWRITTEN = {"arrow_config", "ensure_weight_tying", "kasa_config", "lora_ga_config",
              "monteclora_config", "peft_version", "qalora_group_size", "runtime_config",
              "use_bdlora", "velora_config"}


def peft_config(targets: Sequence[LoraTarget], alphas: Mapping[str, Any],
                modules_to_save: Sequence[str], base: Optional[str]) -> Dict[str, Any]:
    """A PEFT 0.21 ``adapter_config.json`` adapting exactly ``targets`` (by full module
    path), with the most common (r, alpha) as defaults and the rest in rank_pattern /
    alpha_pattern."""
    pairs = Counter((t.rank, alphas[t.module]) for t in targets)
    r, alpha = pairs.most_common(1)[0][0] if pairs else (8, 8)
    rank_pattern = {t.module: t.rank for t in targets if t.rank != r}
    alpha_pattern = {t.module: alphas[t.module] for t in targets if alphas[t.module] != alpha}
    cfg = {k: copy.deepcopy(v[0]) for k, v in sorted(FIELDS.items()) if k not in _UNWRITTEN}
    cfg.update(alpha_pattern=alpha_pattern, base_model_name_or_path=base, inference_mode=True,
               lora_alpha=alpha, modules_to_save=sorted(set(modules_to_save)) or None, r=r,
               rank_pattern=rank_pattern,
               target_modules=sorted(t.module for t in targets if t.kind != "switch"),
               target_parameters=sorted(t.module for t in targets if t.kind == "switch") or None,
               task_type="CAUSAL_LM", use_dora=any(t.is_dora for t in targets))
    return cfg


def llama_cpp_notes(cfg: Mapping[str, Any]) -> List[str]:
    """What llama.cpp's ``convert_lora_to_gguf.py`` cannot take from a PEFT config as
    written (empty: it reads the adapter as PEFT does). It reads ``lora_alpha`` alone
    (scale alpha / r of each tensor's own rank) and refuses DoRA magnitudes and whole
    tensors other than norms."""
    notes = {"alpha_pattern": "alpha_pattern is ignored (lora_alpha is used for every module)",
             "use_rslora": "use_rslora is ignored (alpha / r is used)",
             "use_dora": "DoRA magnitudes are refused",
             "modules_to_save": "modules_to_save tensors are refused (norms excepted)"}
    return [text for key, text in notes.items() if cfg.get(key)]


def _base_name(adapter: Adapter) -> Optional[str]:
    c = adapter.config or {}
    v = c.get("base_model_name_or_path") if adapter.format == "peft" else c.get("model")
    return v if isinstance(v, str) else None
