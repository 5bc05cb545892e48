"""PEFT LoRA adapters (``adapter_model.safetensors``, ``adapter_config.json``), as PEFT runs them.

PEFT adapts a module when ``target_modules`` matches its full name (a full-match regex,
or list entries equal to it or to a ``.``-suffix), it is not excluded
(``exclude_modules``, ``modules_to_save``) and its layer lies in ``layers_to_transform``;
rank and alpha come from the first matching ``rank_pattern`` / ``alpha_pattern`` key.
lorakit refuses tensors for modules PEFT would not adapt, every one listed, and ranks
that disagree with the config.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from ...errors import AdapterError
from ...numerics import to_float64
from .base import (
    CONFIG,
    PEFT_PREFIX,
    PEFT_WEIGHTS,
    Adapter,
    AdapterTensors,
    LoraTarget,
    Replacement,
    bad_config,
    check_magnitude,
    number,
    problems,
    whole,
)
from .layout import param_wrappers

__all__ = ["residual_init"]

_LEAVES = {
    "lora_A.weight": "A", "lora_B.weight": "B",
    "lora_embedding_A": "EA", "lora_embedding_B": "EB",
    "lora_magnitude_vector": "M", "lora_magnitude_vector.weight": "M",
    # PEFT saves the base embedding beside an embedding LoRA and loads it over the
    # base model's (e.g. after resizing the vocabulary): it is the weight to fuse into
    "base_layer.weight": "W",
}
_EMPTY = "false / absent"
_READ, _IGNORED, _REFUSED = "read", "ignored", "refused"
#: Every field PEFT 0.21.2's LoraConfig (and PeftConfig) writes -- the newest PEFT source
#: adds none -- as field -> (default, how lorakit handles it, its meaning or the refusal).
#: A refused field passes at its default (or empty); a field not listed passes only empty.
FIELDS: Dict[str, Tuple[Any, str, str]] = {
    "peft_type": ("LORA", _READ, "must be LORA"),
    "task_type": (None, _IGNORED, "the model class the adapter was trained with"),
    "auto_mapping": (None, _IGNORED, "the model class the adapter was trained with"),
    "peft_version": (None, _IGNORED, "the PEFT version that saved it"),
    "base_model_name_or_path": (None, _IGNORED, "where the base came from"),
    "revision": (None, _IGNORED, "where the base came from"),
    "inference_mode": (False, _IGNORED, "training state"),
    "r": (8, _READ, "the rank"),
    "lora_alpha": (8, _READ, "scale = lora_alpha / r"),
    "use_rslora": (False, _READ, "scale = lora_alpha / sqrt(r)"),
    "rank_pattern": ({}, _READ, "per-module r"),
    "alpha_pattern": ({}, _READ, "per-module lora_alpha"),
    "target_modules": (None, _READ, "the adapted modules"),
    "exclude_modules": (None, _READ, "modules never adapted"),
    "layers_to_transform": (None, _READ, "the adapted layers"),
    "layers_pattern": (None, _READ, "where layer indices are read"),
    "modules_to_save": (None, _READ, "trained copies that replace the base's"),
    "fan_in_fan_out": (False, _READ, "weights stored (in, out): the delta transposed"),
    "use_dora": (False, _READ, "DoRA: the magnitude rescales the merged rows"),
    "lora_dropout": (0.0, _IGNORED, "training only"),
    "init_lora_weights": (True, _READ, "residual inits (pissa, loftq...) refused unless converted"),
    "loftq_config": ({}, _READ, "LoftQ replaced the base by a quantized residual: refused"),
    "eva_config": (None, _IGNORED, "settings of init_lora_weights' initialisation"),
    "corda_config": (None, _IGNORED, "settings of init_lora_weights' initialisation"),
    "astra_config": (None, _IGNORED, "settings of init_lora_weights' initialisation"),
    "lora_ga_config": (None, _IGNORED, "settings of init_lora_weights' initialisation"),
    "velora_config": (None, _IGNORED, "VeLoRA changes backward only; PEFT merges it as LoRA"),
    "megatron_core": ("megatron.core", _IGNORED, "the module megatron_config names"),
    "qalora_group_size": (16, _IGNORED, "used only with use_qalora"),
    "runtime_config": (None, _IGNORED, "runtime settings"),
    "trainable_token_indices": (None, _READ, "embedding rows replaced by the stored values"),
    "ensure_weight_tying": (False, _IGNORED, "ties tied layers' adapters; tensors read as saved"),
    "bias": ("none", _REFUSED, "trained biases: lorakit fuses weights only; merge it "
             "with PEFT's merge_and_unload"),
    "lora_bias": (False, _REFUSED, "LoRA bias: merge it with PEFT's merge_and_unload"),
    "use_qalora": (False, _REFUSED, "QA-LoRA: its A works on pooled inputs of a GPTQ "
                   "model; merge it with PEFT"),
    "use_bdlora": (None, _REFUSED, "BD-LoRA: block-diagonal factors; merge it with PEFT"),
    "layer_replication": (None, _REFUSED, "layer_replication"),
    "alora_invocation_tokens": (None, _REFUSED, "activated LoRA (alora_invocation_tokens): "
                                "it applies after its invocation tokens only, no merge "
                                "keeps that"),
    "target_parameters": (None, _READ, "LoRA on 3-D parameters (MoE experts)"),
    "megatron_config": (None, _REFUSED, "Megatron tensor-parallel layers (megatron_config): "
                        "save the adapter of the gathered model with PEFT"),
    "monteclora_config": (None, _REFUSED, "MonteCLoRA: sampled factors; merge it with PEFT"),
    "arrow_config": (None, _REFUSED, "Arrow routing among adapters: no single merge"),
    "kasa_config": (None, _REFUSED, "KaSA: it truncates the base's singular values and "
                    "adds lora_diag; merge it with PEFT"),
}
#: init_lora_weights values that leave the base as it was (PEFT's LoraLayer.update_layer)
_KEEPS_BASE = (True, False, "gaussian", "eva", "orthogonal", "mica", "nora")
#: init_lora_weights prefixes that change the base weights when the adapter is made
_CHANGES_BASE = ("pissa", "olora", "corda", "lora_ga", "loftq", "astra")
_ALL_LINEAR = "all-linear"
TOKENS_SUFFIX = ".token_adapter.trainable_tokens_delta"  # trainable tokens: the rows' new values

Names = Union[str, List[str], None]  # a regex, a list of names, or absent


@dataclass
class PeftSettings:
    """The parts of a PEFT LoRA config that decide what is adapted and how much."""

    r: int
    alpha: float
    rslora: bool = False
    dora: bool = False
    fan_in_fan_out: bool = False
    rank_pattern: Dict[str, int] = field(default_factory=dict)
    alpha_pattern: Dict[str, float] = field(default_factory=dict)
    target_modules: Names = None
    exclude_modules: Names = None
    layers_to_transform: Optional[List[int]] = None
    layers_pattern: Optional[List[str]] = None
    modules_to_save: List[str] = field(default_factory=list)
    target_parameters: List[str] = field(default_factory=list)

    def refusal(self, key: str) -> Optional[str]:
        """Why PEFT puts no LoRA layer on module ``key`` (None: it does).

        >>> PeftSettings(4, 8, target_modules=["q_proj"]).refusal("model.layers.0.mlp.up_proj")
        "not matched by target_modules ['q_proj'] in adapter_config.json"
        """
        ex = self.exclude_modules
        if ex and (re.fullmatch(ex, key) if isinstance(ex, str) else
                   key in ex or any(key.endswith("." + e) for e in ex)):
            return f"excluded by exclude_modules {ex!r} in {CONFIG}"
        if any(re.match(rf"(^|.*\.){m}($|\..*)", key) for m in self.modules_to_save):
            return (f"a modules_to_save module in {CONFIG} (PEFT never puts LoRA "
                    "on those)")
        tm = self.target_modules
        if tm is None:  # PEFT fills in its per-architecture default: not known here
            return None
        if isinstance(tm, str):
            hit = (not key.endswith("lm_head")) if tm.lower() == _ALL_LINEAR else \
                re.fullmatch(tm, key) is not None
            return None if hit else f"not matched by target_modules {tm!r} in {CONFIG}"
        if key in tm:
            return None  # named in full: no layer filter
        if not any(key.endswith("." + t) for t in tm):
            return f"not matched by target_modules {tm!r} in {CONFIG}"
        if self.layers_to_transform:
            layer = _layer_index(key, self.layers_pattern)
            if layer is None:
                return ("no layer index in its name, and layers_to_transform "
                        f"{self.layers_to_transform} is set in {CONFIG}")
            if layer not in self.layers_to_transform:
                return (f"layer {layer} is not in layers_to_transform "
                        f"{self.layers_to_transform} in {CONFIG}")
        return None

    def rank_alpha(self, key: str) -> Tuple[int, float]:
        """(r, lora_alpha) for module ``key``, after rank_pattern / alpha_pattern."""
        rk = _pattern_key(self.rank_pattern, key)
        ak = _pattern_key(self.alpha_pattern, key)
        return (self.rank_pattern[rk] if rk is not None else self.r,
                self.alpha_pattern[ak] if ak is not None else self.alpha)


def _layer_index(key: str, patterns: Optional[List[str]]) -> Optional[int]:
    """PEFT's layer index of ``key``: the first number after ``.<pattern>.``."""
    for p in patterns or [r"[^.]*"]:
        m = re.match(rf".*?\.{p}\.(\d+)\.", key)
        if m:
            return int(m.group(1))
    return None


def _pattern_key(patterns: Dict[str, Any], key: str) -> Optional[str]:
    """PEFT's ``get_pattern_key``: the first pattern matching ``(.*\\.)?(pattern)$``."""
    return next((p for p in patterns if re.match(rf"(.*\.)?({p})$", key)), None)


def _names(cfg: Dict[str, Any], key: str, cfg_path: Path) -> Names:
    """A config entry that is a regex string or a list of module names (or absent)."""
    v = cfg.get(key)
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, list) and all(isinstance(x, str) and x for x in v):
        return list(v)
    raise bad_config(cfg_path, key, f"{key} must be a regex or a list of module names",
                     '"<regex>" or ["q_proj", ...]', v)


def _check_regexes(cfg_path: Path, key: str, patterns: Sequence[str]) -> None:
    for p in patterns:
        try:
            re.compile(p)
        except re.error as e:
            raise AdapterError(f"{key} holds an invalid regular expression", file=cfg_path,
                               tensor=key, expected="a valid Python regex",
                               found=f"{p!r}: {e}"[:120]) from None


def _positive(cfg_path: Path, key: str, val: Any, integer: bool) -> Any:
    v = number(val)
    if v is None or v <= 0 or (integer and whole(val) is None):
        low = v is None or v <= 0
        raise bad_config(cfg_path, key, f"PEFT config needs a positive {key}" if low else
                         f"PEFT config's {key} must be a whole number",
                         "a positive number" if low else "a positive integer (a rank)", val)
    return val


def _patterns(cfg: Dict[str, Any], key: str, cfg_path: Path, integer: bool) -> Dict[str, Any]:
    pat = cfg.get(key) or {}
    ok = isinstance(pat, dict) and all(number(v) is not None and v > 0 for v in pat.values())
    if not ok or (integer and any(whole(v) is None for v in pat.values())):
        want = "integer" if ok else "number"
        raise bad_config(cfg_path, key, f"{key} values must be whole numbers (ranks)" if ok
                         else f"{key} must map module names to positive numbers",
                         f'{{"<module>": <positive {want}>, ...}}', pat)
    _check_regexes(cfg_path, key, list(pat))
    return dict(pat)


def peft_settings(cfg: Dict[str, Any], cfg_path: Path) -> PeftSettings:
    """The checked :class:`PeftSettings` of a PEFT adapter config (one error per problem)."""
    ptype = cfg.get("peft_type", "LORA")
    if str(ptype).upper() != "LORA":
        raise bad_config(cfg_path, "peft_type", "unsupported PEFT method", "LORA", ptype, n=None)
    check_fields(cfg, cfg_path)
    s = PeftSettings(_positive(cfg_path, "r", cfg.get("r"), True),
                     float(_positive(cfg_path, "lora_alpha", cfg.get("lora_alpha"), False)),
                     bool(cfg.get("use_rslora", False)), bool(cfg.get("use_dora", False)),
                     bool(cfg.get("fan_in_fan_out", False)))
    s.rank_pattern = _patterns(cfg, "rank_pattern", cfg_path, True)
    s.alpha_pattern = _patterns(cfg, "alpha_pattern", cfg_path, False)
    if s.dora and s.fan_in_fan_out:
        raise AdapterError("unsupported PEFT feature: DoRA with fan_in_fan_out", file=cfg_path,
                           tensor="use_dora", expected="not both", found="both true")
    layers = cfg.get("layers_to_transform")
    if type(layers) is int:
        layers = [layers]
    if layers is not None and not (isinstance(layers, list)
                                   and all(type(i) is int for i in layers)):
        raise bad_config(cfg_path, "layers_to_transform",
                         "layers_to_transform must be a layer index or a list of them",
                         "an integer or a list of integers", layers)
    s.layers_to_transform = layers
    lp = _names(cfg, "layers_pattern", cfg_path)
    s.layers_pattern = [lp] if isinstance(lp, str) else lp
    s.target_modules = _names(cfg, "target_modules", cfg_path)
    s.exclude_modules = _names(cfg, "exclude_modules", cfg_path)
    saved = cfg.get("modules_to_save") or []
    if isinstance(saved, str):
        saved = [saved]
    if not isinstance(saved, list) or not all(isinstance(m, str) and m for m in saved):
        raise bad_config(cfg_path, "modules_to_save", "modules_to_save must be a list of module "
                         "names", '["lm_head", ...]', saved)
    s.modules_to_save = saved
    tp = cfg.get("target_parameters") or []
    if not isinstance(tp, list) or not all(isinstance(x, str) and x for x in tp):
        raise bad_config(cfg_path, "target_parameters", "target_parameters must be a list of "
                         "parameter names", '["mlp.experts.gate_up_proj", ...]', tp)
    s.target_parameters = tp
    for key, val in (("target_modules", s.target_modules), ("exclude_modules", s.exclude_modules),
                     ("layers_pattern", s.layers_pattern), ("modules_to_save", saved)):
        if val and not (key == "target_modules" and val == _ALL_LINEAR):
            _check_regexes(cfg_path, key, [val] if isinstance(val, str) else val)
    return s


def _saved_module(key: str, saved: List[str]) -> Optional[Tuple[str, str]]:
    """(module, leaf) when ``key`` is a modules_to_save tensor (a configured name is a
    plain suffix of the module path, as in PEFT), else None."""
    key = re.sub(r"\.modules_to_save\.[^.]+\.", ".", key)
    module, _, leaf = key.rpartition(".")
    if leaf not in ("weight", "bias") or not module or re.search(
            r"\.(lora_[AB]|lora_embedding_[AB]|lora_magnitude_vector|base_layer)(\.|$)", key):
        return None
    if any(module.endswith(m) for m in saved):
        return module, leaf
    return None


@dataclass
class _Sorted:
    """An adapter file's tensor names sorted by role, before any data is read."""

    groups: Dict[str, Dict[str, str]] = field(default_factory=dict)  # module -> tag -> name
    saved: List[Tuple[str, str, str]] = field(default_factory=list)  # (name, module, leaf)
    errors: List[str] = field(default_factory=list)


def _sort_names(names: List[str], s: PeftSettings) -> _Sorted:
    """Group LoRA tensors by module, pick out modules_to_save copies, list the rest."""
    out = _Sorted()
    for name in names:
        key = name[len(PEFT_PREFIX):] if name.startswith(PEFT_PREFIX) else name
        rep = (key[: -len(TOKENS_SUFFIX)], "weight") if key.endswith(TOKENS_SUFFIX) else \
            _saved_module(key, s.modules_to_save)
        if rep is not None:
            out.saved.append((name,) + rep)
            continue
        # Some PEFT versions keep the adapter name in keys (".lora_A.default.weight").
        key = re.sub(r"\.(lora_[AB])\.(?!weight$)[^.]+\.weight$", r".\1.weight", key)
        key = re.sub(r"\.(lora_embedding_[AB]|lora_magnitude_vector)\.(?!weight$)[^.]+$",
                     r".\1", key)
        for leaf, tag in _LEAVES.items():
            if key.endswith("." + leaf):
                g = out.groups.setdefault(key[: -len(leaf) - 1], {})
                if tag in g:  # e.g. ".lora_A.default.weight" beside ".lora_A.other.weight"
                    out.errors.append(f"  {name}: a second tensor for the same factor as "
                                      f"{g[tag]} (expected one adapter per file, found two)")
                g[tag] = name
                break
        else:
            what = ("a modules_to_save copy of a module that adapter_config.json's "
                    "modules_to_save does not list" if "modules_to_save" in key else
                    "not a LoRA tensor")
            out.errors.append(f"  {name}: {what} (expected .lora_A.weight / .lora_B.weight / "
                              f".lora_embedding_A / .lora_embedding_B / .lora_magnitude_vector)")
    return out


@dataclass(frozen=True)
class _Plan:
    """One module's LoRA tensors, checked from the header."""

    module: str
    kind: str  # linear / embedding
    a: str
    b: str
    m: Optional[str]
    w: Optional[str]
    scale: float
    names: Tuple[str, ...]
    experts: int = 0  # a target_parameters LoRA's


def _plan(module: str, g: Dict[str, str], ts: AdapterTensors, s: PeftSettings
          ) -> Tuple[Optional[_Plan], Optional[str]]:
    """Check one module's tensors from the header: (plan, None) or (None, problem line)."""
    emb = "EA" in g or "EB" in g
    ka, kb = ("EA", "EB") if emb else ("A", "B")
    if ka not in g or kb not in g:
        return None, (f"  {module}: needs both {'lora_embedding_A/B' if emb else 'lora_A/B'} "
                      f"(found only {', '.join(g.values())})")
    na, nb = g[ka], g[kb]
    for n in (na, nb):
        ts.check_float(n)
    a, b = ts.infos[na].shape, ts.infos[nb].shape
    if len(a) != 2 or len(b) != 2 or a[0] != b[1]:
        return None, (f"  {module}: rank mismatch: expected {na} (r, in) and {nb} "
                      f"(out, r), found {list(a)} and {list(b)}")
    want_r, alpha = s.rank_alpha(module)
    if a[0] != want_r:
        return None, (f"  {module}: rank {a[0]} in the tensors but {want_r} in "
                      f"adapter_config.json (r / rank_pattern): expected rank {want_r}, found {a[0]}")
    m = g.get("M")
    if m is not None:
        ts.check_float(m)
        rows = (a[1],) if (emb or s.fan_in_fan_out) else (b[0],)
        bad = check_magnitude(m, ts.infos[m].shape, rows)
        if bad:
            return None, bad
    elif s.dora:
        return None, (f"  {module}: use_dora is set but lora_magnitude_vector is missing "
                      f"(expected a DoRA magnitude, found none)")
    scale = float(alpha) / (math.sqrt(want_r) if s.rslora else want_r)
    return _Plan(module, "embedding" if emb else "linear", na, nb, m, g.get("W"), scale,
                 tuple(g.values())), None


def _param_paths(groups: Dict[str, Dict[str, str]], s: PeftSettings) -> Dict[str, str]:
    """Group module -> the ``target_parameters`` path its LoRA adapts (PEFT nests one
    ParamWrapper per parameter of a module: :func:`~.layout.param_wrappers`)."""
    out: Dict[str, str] = {}
    for owner in {re.sub(r"(\.base_layer)+$", "", m) for m in groups}:
        paths = {f"{owner}.{name}" for mod, _, name in (t.rpartition(".") for t in
                 s.target_parameters) if mod in ("", owner) or owner.endswith("." + mod)}
        wrap = {w: p for p, w in param_wrappers(sorted(paths)).items()}
        if set(wrap) <= set(groups) and len(wrap) == sum(  # every parameter has its LoRA
                re.sub(r"(\.base_layer)+$", "", m) == owner for m in groups):
            out.update(wrap)
    return out


def _param_plan(path: str, g: Dict[str, str], ts: AdapterTensors, s: PeftSettings
                ) -> Tuple[Optional[_Plan], Optional[str]]:
    """Check one ``target_parameters`` LoRA from the header: A (experts*r, in), B
    (out, r*experts), at least two experts."""
    if set(g) != {"A", "B"}:
        return None, f"  {path}: needs lora_A and lora_B only (found {', '.join(g.values())})"
    r, alpha = s.rank_alpha(path)
    a, b = ts.infos[g["A"]].shape, ts.infos[g["B"]].shape
    n = a[0] // r if len(a) == 2 else 0
    if len(b) != 2 or n < 2 or a[0] != n * r or b[1] != n * r:
        return None, (f"  {path}: expected {g['A']} (experts*r, in) and {g['B']} "
                      f"(out, r*experts) with r {r} and two or more experts, found "
                      f"{list(a)} and {list(b)}")
    for name in g.values():
        ts.check_float(name)
    scale = float(alpha) / (math.sqrt(r) if s.rslora else r)
    return _Plan(path, "param", g["A"], g["B"], None, None, scale, tuple(g.values()), n), None


def _target(p: _Plan, ts: AdapterTensors, fan_in_fan_out: bool) -> LoraTarget:
    """Read one planned module and orient it as ``delta = scale * B @ A``."""
    a, b = ts.read_f32(p.a), ts.read_f32(p.b)
    if p.kind == "param":  # PEFT: A rows expert-major, B columns rank-major (r, experts)
        A = np.ascontiguousarray(a.reshape(p.experts, -1, a.shape[1]))
        B = np.ascontiguousarray(b.reshape(b.shape[0], -1, p.experts).transpose(2, 0, 1))
        # ParamWrapper.merge rounds the f32 delta to the weight's dtype, then adds
        return LoraTarget(p.module, "switch", A, B, p.scale, names=p.names, round_delta=True)
    mag = ts.read_f32(p.m).reshape(-1) if p.m else None
    if p.kind == "embedding" or fan_in_fan_out:
        # PEFT embedding: delta = (lora_embedding_B @ lora_embedding_A).T * scaling
        A, B = b.T, a.T
    else:
        A, B = a, b
    base_w = ts.read_raw(p.w) if p.w else None
    return LoraTarget(p.module, p.kind, np.ascontiguousarray(A), np.ascontiguousarray(B),
                      p.scale, mag, p.names, base_w)


def _token_rows(cfg: Dict[str, Any], module: str) -> Any:
    """PEFT's trainable_token_indices for ``module``: a list is the input embedding's (the
    one tensor saved), a dict maps layer names (matched as suffixes) to rows."""
    rows = cfg.get("trainable_token_indices")
    if isinstance(rows, dict):
        return next((v for k, v in rows.items() if module == k or module.endswith("." + k)),
                    None)
    return rows


def _replacement(name: str, module: str, leaf: str, ts: AdapterTensors, cfg: Dict[str, Any]
                 ) -> Tuple[Optional[Replacement], Optional[str]]:
    """Read one modules_to_save copy or trainable-tokens tensor: (replacement, None) or
    (None, problem line)."""
    dt, shape = ts.infos[name].dtype, ts.infos[name].shape
    rows = _token_rows(cfg, module) if name.endswith(TOKENS_SUFFIX) else None
    if name.endswith(TOKENS_SUFFIX) and not (
            isinstance(rows, list) and all(type(i) is int and i >= 0 for i in rows)
            and len(shape) == 2 and len(set(rows)) == len(rows) == shape[0]):
        return None, (f"  {name}: trainable tokens need one distinct row index per stored row "
                      f"in trainable_token_indices (expected {shape[0]} indices for {module}, "
                      f"found {str(rows)[:80]})")
    if dt not in ("F16", "BF16", "F32"):
        return None, (f"  {name}: a modules_to_save tensor must be float "
                      f"(expected F16/BF16/F32, found {dt})")
    raw, _ = ts.read_raw(name)
    if not np.isfinite(to_float64(raw, dt)).all():
        return None, (f"  {name}: modules_to_save tensor holds NaN or Inf "
                      f"(expected finite values, found non-finite)")
    return Replacement(module, leaf, raw, dt, name, tuple(rows) if rows else None), None


def load_peft(path: Path, cfg: Dict[str, Any], file: Optional[Path] = None,
              residual_ok: bool = False) -> Adapter:
    """Read a PEFT LoRA adapter directory whose config is ``cfg``, every tensor checked
    from the header before any is read; all problems in one error."""
    cfg_path = path / CONFIG
    file = file or path / PEFT_WEIGHTS
    s = peft_settings(cfg, cfg_path)
    check_init(cfg, cfg_path, residual_ok)
    ts = AdapterTensors(file)
    found = _sort_names(ts.names, s)
    errors = found.errors
    plans: List[_Plan] = []
    params = _param_paths(found.groups, s) if s.target_parameters else {}
    for module, g in found.groups.items():
        if module in params:
            plan, err = _param_plan(params[module], g, ts, s)
            errors += [err] if err else []
            plans += [plan] if plan else []
            continue
        why = s.refusal(module)
        if why:
            errors += [f"  {n}: PEFT puts no LoRA layer on {module}: {why}" for n in g.values()]
            continue
        plan, err = _plan(module, g, ts, s)
        if err:
            errors.append(err)
        elif plan:
            plans.append(plan)
    if not errors:
        both = sorted({m for _, m, _ in found.saved} & {p.module for p in plans})
        if both:
            errors.append(f"  {', '.join(both)}: both LoRA factors and a modules_to_save copy "
                          f"(expected one or the other, found both)")
    if not _empty(cfg.get("trainable_token_indices")) and not any(
            n.endswith(TOKENS_SUFFIX) for n, _, _ in found.saved):
        errors.append(f"  trainable_token_indices is set in {CONFIG} but no {TOKENS_SUFFIX[1:]} "
                      "tensor is in the file (expected the trained rows, found none)")
    replacements: List[Replacement] = []
    if not errors:
        for name, module, leaf in found.saved:
            rep, err = _replacement(name, module, leaf, ts, cfg)
            errors += [err] if err else []
            replacements += [rep] if rep else []
    if errors:
        raise problems(file, errors, "base_model.model.<module>.lora_A.weight (r, in) and "
                       ".lora_B.weight (out, r) for each module PEFT adapts "
                       f"(target_modules, layers_to_transform, exclude_modules in {cfg_path})")
    if not plans and not replacements:
        raise AdapterError("adapter holds no LoRA tensors", file=file,
                           expected="base_model.model.<module>.lora_A.weight / .lora_B.weight",
                           found="none")
    targets = [_target(p, ts, s.fan_in_fan_out) for p in plans]
    if str(cfg.get("init_lora_weights")).lower() == "mica":  # PEFT's MiCA merge rounds
        for t in targets:  # the delta to the weight's dtype before adding it
            t.round_delta = True
    return Adapter(path, "peft", targets, cfg, file, "dora" if s.dora else "lora",
                   replacements=replacements)


def check_targets_exist(adapter: Adapter, modules: Sequence[str], source: Path) -> None:
    """Refuse a PEFT adapter whose ``target_modules`` match none of ``modules`` (the
    model's module names), as PEFT does ("Target modules ... not found in the base model")."""
    if adapter.format != "peft" or adapter.targets:
        return  # a target that binds is a match
    s = peft_settings(adapter.config, adapter.path / CONFIG)
    if s.target_modules is None:
        return
    if not any(s.refusal(m) is None for m in modules):
        raise bad_config(adapter.path / CONFIG, "target_modules", "target_modules match no "
                         "module of the model", f"module names of the model at {source}",
                         s.target_modules, "PEFT refuses this adapter on this model too", 120)


def _empty(v: Any) -> bool:
    return v is None or v is False or (isinstance(v, (str, list, dict)) and not v)


def check_fields(cfg: Dict[str, Any], cfg_path: Path) -> None:
    """Refuse, by name, a set field that :data:`FIELDS` refuses or that PEFT has not."""
    for key, val in cfg.items():
        default, how, text = FIELDS.get(key, (None, "unknown", ""))
        if how in (_READ, _IGNORED) or _empty(val) or val == default:
            continue
        what, _, todo = text.partition(": ")
        want = repr(default).replace("'", '"') if default else _EMPTY
        if how == "unknown":
            what, want = "", f"a field of PEFT's LoraConfig, or {key} empty"
            todo = ("lorakit reads every field of PEFT 0.21's LoraConfig and refuses a field "
                    "whose meaning it does not know; if a newer PEFT wrote it, merge with that "
                    "PEFT's merge_and_unload")
        raise bad_config(cfg_path, key, f"unsupported PEFT feature: {what}" if what else
                         "unknown PEFT config field", want, val, todo or None)


def residual_init(cfg: Dict[str, Any]) -> Optional[Tuple[str, Any]]:
    """``(field, value)`` when a PEFT config says its adapter was made on a changed base
    (PiSSA, OLoRA, CorDA, LoRA-GA, LoftQ), else None."""
    init = cfg.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_CHANGES_BASE):
        return "init_lora_weights", init
    if not _empty(cfg.get("loftq_config")):
        return "loftq_config", cfg["loftq_config"]
    return None


def check_init(cfg: Dict[str, Any], cfg_path: Path, residual_ok: bool) -> None:
    """Refuse an unknown ``init_lora_weights`` and (unless ``residual_ok``) a
    residual-base adapter, naming the field, its value and the fix."""
    init = cfg.get("init_lora_weights", True)
    low = init.lower() if isinstance(init, str) else init
    if low not in _KEEPS_BASE and not (isinstance(low, str) and low.startswith(_CHANGES_BASE)):
        raise bad_config(cfg_path, "init_lora_weights", "unknown init_lora_weights",
                         f"one of {list(_KEEPS_BASE)} or {list(_CHANGES_BASE)}", init)
    res = residual_init(cfg)
    if res is not None and not residual_ok:
        key, val = res
        raise bad_config(
            cfg_path, key, f"residual-base adapter: {key}={val!r} changed the base weights when "
            "PEFT made this adapter (W_res = W - scale * B0 @ A0); fused into the original base "
            "it is wrong", "a plain LoRA (init_lora_weights true)", val,
            "re-save it with PEFT's save_pretrained(..., "
            "path_initial_model_for_weight_conversion=<the adapter saved before training>), "
            "or give lorakit that initial adapter: --initial-adapter DIR (API: "
            "initial_adapter=)" + ("; LoftQ's base is its quantized residual: merge with "
                                   "PEFT" if key == "loftq_config" or
                                   str(val).lower() == "loftq" else ""))


def converted_config(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """The config PEFT's ``save_pretrained(path_initial_model_for_weight_conversion=...)``
    writes: init true, r and rank_pattern doubled, lora_alpha doubled (times sqrt(2) with
    rsLoRA), alpha_pattern doubled."""
    out = dict(cfg, init_lora_weights=True, r=2 * cfg["r"])
    out["lora_alpha"] = cfg["lora_alpha"] * (2 ** 0.5 if cfg.get("use_rslora") else 2)
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            out[key] = {k: 2 * v for k, v in cfg[key].items()}
    return out


def convert_residual(trained: Adapter, initial: Adapter) -> Adapter:
    """A residual-base adapter as the plain LoRA PEFT's conversion makes of it: per module
    ``A' = cat(A, A0)``, ``B' = cat(B, -B0)`` (rank 2r) at :func:`converted_config`'s scale."""
    if trained.format != "peft" or initial.format != "peft":
        raise AdapterError("an initial adapter converts PEFT adapters only",
                           file=trained.path if trained.format != "peft" else initial.path,
                           expected="PEFT adapters (adapter_model.safetensors)",
                           found="mlx-lm format")
    cfg = converted_config(trained.config)
    s = peft_settings(cfg, trained.path / CONFIG)
    init = {t.module: t for t in initial.targets}
    errors: List[str] = []
    targets: List[LoraTarget] = []
    for t in trained.targets:
        t0 = init.pop(t.module, None)
        if t.kind != "linear" or t.is_dora:
            errors.append(f"  {t.module}: a {'DoRA' if t.is_dora else t.kind} module (expected "
                          "LoRA on linear layers: PEFT's conversion keeps lora_A/lora_B only)")
        elif t0 is None or t0.A.shape != t.A.shape or t0.B.shape != t.B.shape or \
                t0.scale != t.scale:
            found = "absent" if t0 is None else \
                f"A {list(t0.A.shape)}, B {list(t0.B.shape)}, scale {t0.scale:g}"
            errors.append(f"  {t.module}: initial adapter does not match (expected A "
                          f"{list(t.A.shape)}, B {list(t.B.shape)}, scale {t.scale:g}, "
                          f"found {found})")
        else:
            r, alpha = s.rank_alpha(t.module)
            scale = float(alpha) / (math.sqrt(r) if s.rslora else r)
            A, B = np.concatenate([t.A, t0.A], axis=0), np.concatenate([t.B, -t0.B], axis=1)
            targets.append(LoraTarget(t.module, t.kind, A, B, scale, None, t.names + t0.names))
    errors += [f"  {m}: in the initial adapter only (expected the same modules as the "
               "trained one)" for m in init]
    if errors:
        raise problems(initial.weights_file, errors, "the adapter the trained one started "
                       "from: the same modules, ranks and scales")
    return replace(trained, targets=targets, config=cfg, _sha256=None)
