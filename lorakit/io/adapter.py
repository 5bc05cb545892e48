"""LoRA / DoRA adapters in the mlx-lm and PEFT formats, as one description.

Whatever the format, an adapter becomes a list of :class:`LoraTarget`, one per
adapted module, each holding ``A`` (…, r, in), ``B`` (…, out, r), a float
``scale`` and an optional DoRA ``magnitude``, so that the intended change of the
module's weight (as stored in the checkpoint) is::

    delta = scale * (B @ A)

The orientation is chosen so that this holds for every layer type:

========================  ==========================  ==========================
layer / format            B                           A
========================  ==========================  ==========================
mlx-lm Linear             lora_b.T        (out, r)     lora_a.T        (r, in)
mlx-lm Embedding          lora_a          (vocab, r)   lora_b          (r, dims)
mlx-lm SwitchLinear       lora_b   (experts, out, r)   lora_a   (experts, r, in)
PEFT Linear               lora_B.weight   (out, r)     lora_A.weight   (r, in)
PEFT fan_in_fan_out       lora_A.weight.T (in, r)      lora_B.weight.T (r, out)
PEFT Embedding            lora_embedding_A.T           lora_embedding_B.T
========================  ==========================  ==========================

mlx-lm's own fuse computes ``(scale * B) @ A`` in every case, which lets
:mod:`lorakit.fusion` reproduce its rounding exactly from this one form.
"""
from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np

from ..errors import AdapterError
from ..numerics import to_float64
from .checkpoint import _load_json, safe_member
from .safetensors import read_header, read_raw

PathLike = Union[str, Path]

MLX_WEIGHTS = "adapters.safetensors"
PEFT_WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."
EMBEDDING_HINTS = ("embed_tokens", "wte", "word_embeddings", "embed_in", "tok_embeddings",
                   "embeddings")


@dataclass
class LoraTarget:
    """The low-rank change to one module's weight: ``delta = scale * (B @ A)``.

    Attributes:
        module: module path in the model, without format prefixes
            (``model.layers.3.self_attn.q_proj``).
        kind: ``"linear"``, ``"embedding"`` or ``"switch"`` (stacked MoE experts).
        A: float32 (…, r, in). B: float32 (…, out, r).
        scale: the multiplier applied to ``B @ A``.
        magnitude: DoRA's learned row norms (out,), or None for plain LoRA.
        names: the adapter tensor names this target came from (for messages).
        base_weight: a copy of the base weight saved with the adapter (PEFT does this
            for embedding LoRA); it replaces the checkpoint's weight when fusing.
    """

    module: str
    kind: str
    A: np.ndarray
    B: np.ndarray
    scale: float
    magnitude: Optional[np.ndarray] = None
    names: Tuple[str, ...] = ()
    base_weight: Optional[Tuple[np.ndarray, str]] = None  # (raw, dtype code), PEFT only

    @property
    def rank(self) -> int:
        return int(self.A.shape[-2])

    @property
    def shape(self) -> Tuple[int, ...]:
        """Shape of the weight this target changes (for switch: experts, out, in)."""
        return tuple(self.B.shape[:-1]) + (int(self.A.shape[-1]),)

    @property
    def is_dora(self) -> bool:
        return self.magnitude is not None

    def __repr__(self) -> str:
        d = ", DoRA" if self.is_dora else ""
        return f"LoraTarget({self.module!r}, {self.kind}, r={self.rank}, scale={self.scale:g}{d})"


@dataclass
class Replacement:
    """A whole tensor the adapter carries in place of the base's: PEFT's
    ``modules_to_save`` (a trained copy of e.g. ``lm_head`` or a norm), which
    ``merge_and_unload()`` puts into the merged model as it is.

    Attributes:
        module: module path (``lm_head``, ``model.norm``).
        leaf: ``weight`` or ``bias``.
        raw: the tensor's storage as saved (float bits), ``code`` its dtype.
        name: the tensor's name in the adapter file (for messages).
    """

    module: str
    leaf: str
    raw: np.ndarray
    code: str
    name: str

    def __repr__(self) -> str:
        return f"Replacement({self.module}.{self.leaf}, {self.code}{list(self.raw.shape)})"


@dataclass
class Adapter:
    """An adapter read from disk, in lorakit's one description.

    Attributes:
        path: the adapter directory.
        format: ``"mlx-lm"`` or ``"peft"``.
        targets: one :class:`LoraTarget` per adapted module, in file order.
        config: the raw adapter_config.json.
        weights_file: the safetensors file the tensors came from.
        replacements: whole tensors that replace the base's (PEFT ``modules_to_save``).
    """

    path: Path
    format: str
    targets: List[LoraTarget]
    config: Dict[str, Any]
    weights_file: Path
    fine_tune_type: str = "lora"
    replacements: List[Replacement] = field(default_factory=list)
    _sha256: Optional[str] = field(default=None, repr=False)

    @property
    def sha256(self) -> str:
        """Hash of the weights file and config, recorded in fused outputs."""
        if self._sha256 is None:
            h = hashlib.sha256()
            for p in (self.path / CONFIG, self.weights_file):
                with open(p, "rb") as f:
                    for chunk in iter(lambda: f.read(1 << 20), b""):
                        h.update(chunk)
            self._sha256 = h.hexdigest()
        return self._sha256

    @property
    def is_dora(self) -> bool:
        return any(t.is_dora for t in self.targets)

    def __len__(self) -> int:
        return len(self.targets)

    def __repr__(self) -> str:
        kinds = sorted({t.kind for t in self.targets})
        ranks = sorted({t.rank for t in self.targets})
        return (f"Adapter({str(self.path)!r}, {self.format}, {self.fine_tune_type}, "
                f"{len(self.targets)} targets, rank {'/'.join(map(str, ranks))}, "
                f"{'/'.join(kinds)})")


def _f32(raw: np.ndarray, dtype: str, file: Path, name: str) -> np.ndarray:
    from ..numerics import float_format, to_float32

    if dtype not in ("F32", "F16", "BF16", "F64"):
        raise AdapterError("adapter tensor is not floating point", file=file, tensor=name,
                           expected="F32, F16 or BF16", found=dtype)
    if dtype == "F64":
        return raw.astype(np.float32)
    return to_float32(raw, float_format(dtype))


def _read_all(file: Path) -> Dict[str, Tuple[np.ndarray, str]]:
    h = read_header(file)
    return {n: (read_raw(i), i.dtype) for n, i in h.tensors.items()}


def _number(x: Any) -> Optional[float]:
    """``x`` as a finite float, or None (bools, strings, huge ints, NaN, Inf)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    try:
        v = float(x)
    except OverflowError:  # an integer beyond float range
        return None
    return v if math.isfinite(v) else None


def _check_magnitude(name: str, m: np.ndarray, B: np.ndarray) -> Optional[str]:
    """A problem line if DoRA magnitude ``m`` does not have one entry per output row."""
    want = tuple(B.shape[:-1])
    if tuple(m.shape) != want and not (m.ndim == 1 and (m.size,) == want):
        return (f"  {name}: DoRA magnitude has the wrong shape: expected {list(want)} "
                f"(one per output row), found {list(m.shape)}")
    return None


def _check_finite(file: Path, name: str, x: np.ndarray) -> None:
    if not np.isfinite(x).all():
        bad = int((~np.isfinite(x)).sum())
        raise AdapterError("adapter tensor holds NaN or Inf", file=file, tensor=name,
                           expected="finite values", found=f"{bad} non-finite of {x.size}")


def load_adapter(path: PathLike) -> Adapter:
    """Read an adapter directory in mlx-lm or PEFT format.

    The format is told by the files present: ``adapters.safetensors`` (mlx-lm) or
    ``adapter_model.safetensors`` (PEFT). Every tensor is checked (known suffix,
    matching ranks, finite values); all problems are reported in one error.

    >>> ad = load_adapter("data/adapters/lora")
    >>> ad.format, len(ad.targets)
    ('mlx-lm', 28)
    """
    path = Path(path)
    if path.is_file() and path.suffix == ".safetensors":
        path = path.parent
    if not path.is_dir():
        raise AdapterError("adapter path is not a directory", file=path,
                           expected="a directory with adapter_config.json",
                           found="a file" if path.exists() else "no such directory")
    cfg_path = safe_member(path, CONFIG, source=path, what="adapter config")
    for name in (MLX_WEIGHTS, PEFT_WEIGHTS):
        safe_member(path, name, source=path, what="adapter weights")  # no links out
    cfg = _load_json(cfg_path, "adapter config")
    if not isinstance(cfg, dict):
        raise AdapterError("adapter config is not a JSON object", file=cfg_path,
                           expected="a JSON object", found=type(cfg).__name__)
    if (path / MLX_WEIGHTS).exists() and "peft_type" not in cfg:
        return _load_mlx(path, cfg)
    if (path / PEFT_WEIGHTS).exists():
        return _load_peft(path, cfg)
    if (path / MLX_WEIGHTS).exists():
        return _load_mlx(path, cfg)
    raise AdapterError("no adapter weights found", file=path,
                       expected=f"{MLX_WEIGHTS} (mlx-lm) or {PEFT_WEIGHTS} (PEFT)",
                       found=", ".join(sorted(p.name for p in path.iterdir())) or "empty directory",
                       hint="adapter_model.bin is a pickle (loading one can run code) and is "
                       "not read: save the adapter with PEFT's "
                       "save_pretrained(safe_serialization=True)"
                       if (path / "adapter_model.bin").exists() else None)


# -- mlx-lm ---------------------------------------------------------------------------
def _load_mlx(path: Path, cfg: Dict[str, Any]) -> Adapter:
    cfg_path = path / CONFIG
    file = path / MLX_WEIGHTS
    # mlx-lm before fine_tune_type (0.19) marked DoRA with "use_dora": true
    ftype = cfg.get("fine_tune_type") or ("dora" if cfg.get("use_dora") is True else "lora")
    if ftype not in ("lora", "dora"):
        raise AdapterError("unsupported fine_tune_type", file=cfg_path, tensor="fine_tune_type",
                           expected="lora or dora", found=repr(ftype),
                           hint="a 'full' fine-tune holds whole weights, not an adapter")
    params = cfg.get("lora_parameters")
    if not isinstance(params, dict):
        raise AdapterError("adapter config has no lora_parameters", file=cfg_path,
                           tensor="lora_parameters",
                           expected='"lora_parameters": {"rank": ..., "scale": ...}',
                           found=repr(params)[:80])
    scale = _number(params.get("scale"))
    if scale is None:
        hint = " (mlx-lm uses 'scale', not 'alpha')" if "alpha" in params else ""
        raise AdapterError("lora_parameters.scale missing or not a number" + hint,
                           file=cfg_path, tensor="lora_parameters.scale",
                           expected="a finite number", found=repr(params.get("scale"))[:80])
    tensors = _read_all(file)
    groups: Dict[str, Dict[str, Tuple[np.ndarray, str]]] = {}
    errors: List[str] = []
    for name, val in tensors.items():
        module, _, leaf = name.rpartition(".")
        if leaf not in ("lora_a", "lora_b", "m") or not module:
            errors.append(f"  {name}: not a LoRA tensor (expected <module>.lora_a/.lora_b/.m, "
                          f"found .{leaf})")
            continue
        groups.setdefault(module, {})[leaf] = val
    targets: List[LoraTarget] = []
    for module, g in groups.items():
        if "lora_a" not in g or "lora_b" not in g:
            errors.append(f"  {module}: has {sorted(g)} but needs both lora_a and lora_b "
                          f"(expected lora_a and lora_b, found {', '.join(sorted(g))})")
            continue
        a = _f32(*g["lora_a"], file, module + ".lora_a")
        b = _f32(*g["lora_b"], file, module + ".lora_b")
        m = _f32(*g["m"], file, module + ".m") if "m" in g else None
        for leaf, x in (("lora_a", a), ("lora_b", b), ("m", m)):
            if x is not None:
                _check_finite(file, f"{module}.{leaf}", x)
        if a.ndim == 3 and b.ndim == 3:  # SwitchLinear: a (E, r, in), b (E, out, r)
            kind, A, B = "switch", a, b
            ok = a.shape[0] == b.shape[0] and a.shape[1] == b.shape[2]
            found = f"lora_a {list(a.shape)}, lora_b {list(b.shape)}"
            want = "lora_a (experts, r, in) and lora_b (experts, out, r)"
        elif a.ndim == 2 and b.ndim == 2:
            # Linear: a (in, r), b (r, out); Embedding: a (vocab, r), b (r, dims).
            kind = "embedding" if module.rsplit(".", 1)[-1] in EMBEDDING_HINTS else "linear"
            if kind == "linear":
                A, B = a.T, b.T
            else:
                A, B = b, a
            ok = a.shape[1] == b.shape[0]
            found = f"lora_a {list(a.shape)}, lora_b {list(b.shape)}"
            want = "lora_a (in, r) and lora_b (r, out) with the same r"
        else:
            ok, kind, A, B = False, "", a, b
            found = f"lora_a {a.ndim}-D, lora_b {b.ndim}-D"
            want = "both 2-D (Linear/Embedding) or both 3-D (SwitchLinear)"
        if not ok:
            errors.append(f"  {module}: rank mismatch between lora_a and lora_b: "
                          f"expected {want}, found {found}")
            continue
        if m is not None and ftype != "dora":
            errors.append(f"  {module}.m: DoRA magnitude in an adapter whose fine_tune_type "
                          f"is {ftype!r} (expected 'dora', found {ftype!r})")
            continue
        if ftype == "dora" and m is None:
            errors.append(f"  {module}: fine_tune_type is dora but {module}.m is missing "
                          f"(expected a DoRA magnitude, found none)")
            continue
        if m is not None:
            bad_m = _check_magnitude(f"{module}.m", m, B)
            if bad_m:
                errors.append(bad_m)
                continue
        targets.append(LoraTarget(module, kind, np.ascontiguousarray(A),
                                  np.ascontiguousarray(B), float(scale), m,
                                  tuple(f"{module}.{k}" for k in g)))
    if errors:
        raise AdapterError(f"{len(errors)} problem(s) in the adapter's tensors:\n"
                           + "\n".join(errors), file=file,
                           expected="<module>.lora_a (in, r) and .lora_b (r, out) per module"
                           + (", and .m (out,)" if ftype == "dora" else ""),
                           found=f"{len(errors)} problem(s), listed above")
    if not targets:
        raise AdapterError("adapter holds no LoRA tensors", file=file,
                           expected="<module>.lora_a / .lora_b tensors", found="none")
    return Adapter(path, "mlx-lm", targets, cfg, file, ftype)


# -- PEFT --------------------------------------------------------------------------------
_PEFT_LEAVES = {
    "lora_A.weight": "A", "lora_B.weight": "B",
    "lora_embedding_A": "EA", "lora_embedding_B": "EB",
    "lora_magnitude_vector": "M", "lora_magnitude_vector.weight": "M",
    # PEFT saves the base embedding beside an embedding LoRA and loads it over the
    # base model's (e.g. after resizing the vocabulary): it is the weight to fuse into
    "base_layer.weight": "W",
}
_PEFT_UNSUPPORTED = {
    "use_qalora": "QA-LoRA", "lora_bias": "LoRA bias", "use_bdlora": "BD-LoRA",
    # duplicated layers change the model's structure: no fuse into the base's tensors
    "layer_replication": "layer_replication",
    # activated LoRA applies only after its invocation tokens: merging changes outputs
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    # LoRA on raw nn.Parameters (MoE expert tensors) is stored in another layout
    "target_parameters": "LoRA on parameters (target_parameters)",
}


def _pattern_value(patterns: Dict[str, Any], module: str) -> Optional[Any]:
    """PEFT's rank_pattern / alpha_pattern lookup: a key matches a module path
    that equals it or ends with '.' + key, or that the key matches as a regex."""
    for key, val in patterns.items():
        if module == key or module.endswith("." + key):
            return val
        try:
            if re.fullmatch(rf"(.*\.)?{key}", module):
                return val
        except re.error:
            continue
    return None


def _layer_index(module: str) -> Optional[int]:
    m = re.search(r"\.(?:layers|h|blocks|layer)\.(\d+)\.", module + ".")
    return int(m.group(1)) if m else None


def _load_peft(path: Path, cfg: Dict[str, Any]) -> Adapter:
    cfg_path = path / CONFIG
    file = path / PEFT_WEIGHTS
    ptype = cfg.get("peft_type", "LORA")
    if str(ptype).upper() != "LORA":
        raise AdapterError("unsupported PEFT method", file=cfg_path, tensor="peft_type",
                           expected="LORA", found=repr(ptype))
    for key, what in _PEFT_UNSUPPORTED.items():
        if cfg.get(key):
            raise AdapterError(f"unsupported PEFT feature: {what}", file=cfg_path, tensor=key,
                               expected="false / absent", found=repr(cfg.get(key)))
    if cfg.get("bias", "none") not in ("none", None):
        raise AdapterError("unsupported PEFT feature: trained biases", file=cfg_path,
                           tensor="bias", expected='"none"', found=repr(cfg.get("bias")))
    r = cfg.get("r")
    alpha = cfg.get("lora_alpha")
    for key, val in (("r", r), ("lora_alpha", alpha)):
        v = _number(val)
        if v is None or v <= 0:
            raise AdapterError(f"PEFT config needs a positive {key}", file=cfg_path, tensor=key,
                               expected="a positive number", found=repr(val)[:80])
    rslora = bool(cfg.get("use_rslora", False))
    dora = bool(cfg.get("use_dora", False))
    fifo = bool(cfg.get("fan_in_fan_out", False))
    rank_pattern = cfg.get("rank_pattern") or {}
    alpha_pattern = cfg.get("alpha_pattern") or {}
    for key, pat in (("rank_pattern", rank_pattern), ("alpha_pattern", alpha_pattern)):
        bad = (not isinstance(pat, dict) or
               next((v for v in pat.values() if _number(v) is None or _number(v) <= 0),
                    None) is not None)
        if bad:
            raise AdapterError(f"{key} must map module names to positive numbers",
                               file=cfg_path, tensor=key,
                               expected='{"<module>": <positive number>, ...}',
                               found=repr(pat)[:80])
    if dora and fifo:
        raise AdapterError("unsupported PEFT feature: DoRA with fan_in_fan_out", file=cfg_path,
                           tensor="use_dora", expected="not both", found="both true")
    layers = cfg.get("layers_to_transform")
    if type(layers) is int:
        layers = [layers]
    if layers is not None and not (isinstance(layers, list)
                                   and all(type(i) is int for i in layers)):
        raise AdapterError("layers_to_transform must be a layer index or a list of them",
                           file=cfg_path, tensor="layers_to_transform",
                           expected="an integer or a list of integers", found=repr(layers)[:80])
    saved = cfg.get("modules_to_save") or []
    if isinstance(saved, str):
        saved = [saved]
    if not isinstance(saved, list) or not all(isinstance(m, str) and m for m in saved):
        raise AdapterError("modules_to_save must be a list of module names", file=cfg_path,
                           tensor="modules_to_save", expected='["lm_head", ...]',
                           found=repr(saved)[:80])
    tensors = _read_all(file)
    groups: Dict[str, Dict[str, Tuple[str, np.ndarray, str]]] = {}
    replacements: List[Replacement] = []
    errors: List[str] = []
    for name, (raw, dt) in tensors.items():
        key = name[len(PEFT_PREFIX):] if name.startswith(PEFT_PREFIX) else name
        rep = _saved_module(key, saved)
        if rep is not None:
            module, leaf = rep
            if dt not in ("F16", "BF16", "F32"):
                errors.append(f"  {name}: a modules_to_save tensor must be float "
                              f"(expected F16/BF16/F32, found {dt})")
                continue
            if not np.isfinite(to_float64(raw, dt)).all():
                errors.append(f"  {name}: modules_to_save tensor holds NaN or Inf "
                              f"(expected finite values, found non-finite)")
                continue
            replacements.append(Replacement(module, leaf, raw, dt, name))
            continue
        # Some PEFT versions keep the adapter name in keys (".lora_A.default.weight").
        key = re.sub(r"\.(lora_[AB])\.(?!weight$)[^.]+\.weight$", r".\1.weight", key)
        key = re.sub(r"\.(lora_embedding_[AB]|lora_magnitude_vector)\.(?!weight$)[^.]+$",
                     r".\1", key)
        for leaf, tag in _PEFT_LEAVES.items():
            if key.endswith("." + leaf):
                groups.setdefault(key[: -len(leaf) - 1], {})[tag] = (name, raw, dt)
                break
        else:
            what = ("a modules_to_save copy of a module that adapter_config.json's "
                    "modules_to_save does not list" if "modules_to_save" in key else
                    "not a LoRA tensor")
            errors.append(f"  {name}: {what} (expected .lora_A.weight / .lora_B.weight / "
                          f".lora_embedding_A / .lora_embedding_B / .lora_magnitude_vector)")
    targets: List[LoraTarget] = []
    for module, g in groups.items():
        emb = "EA" in g or "EB" in g
        ka, kb = ("EA", "EB") if emb else ("A", "B")
        if ka not in g or kb not in g:
            errors.append(f"  {module}: needs both {'lora_embedding_A/B' if emb else 'lora_A/B'} "
                          f"(found only {', '.join(v[0] for v in g.values())})")
            continue
        na, a_raw, a_dt = g[ka]
        nb, b_raw, b_dt = g[kb]
        a = _f32(a_raw, a_dt, file, na)
        b = _f32(b_raw, b_dt, file, nb)
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            errors.append(f"  {module}: rank mismatch: expected {na} (r, in) and {nb} "
                          f"(out, r), found {list(a.shape)} and {list(b.shape)}")
            continue
        _check_finite(file, na, a)
        _check_finite(file, nb, b)
        rank = a.shape[0]
        want_r = _pattern_value(rank_pattern, module) or r
        if float(want_r) != rank:
            errors.append(f"  {module}: rank {rank} in the tensors but {want_r} in the config "
                          f"(r / rank_pattern): expected rank {want_r}, found {rank}")
            continue
        if layers is not None:
            li = _layer_index(module)
            if li is not None and li not in layers:
                errors.append(f"  {module}: layer {li} is outside layers_to_transform "
                              f"(expected one of {layers}, found {li})")
                continue
        a_alpha = _pattern_value(alpha_pattern, module) or alpha
        scale = float(a_alpha) / (math.sqrt(rank) if rslora else rank)
        mag = None
        if "M" in g:
            nm, m_raw, m_dt = g["M"]
            mag = _f32(m_raw, m_dt, file, nm)
            bad_m = _check_magnitude(nm, mag, a.T if (emb or fifo) else b)
            if bad_m:
                errors.append(bad_m)
                continue
            mag = mag.reshape(-1)
            _check_finite(file, nm, mag)
        elif dora:
            errors.append(f"  {module}: use_dora is set but lora_magnitude_vector is missing "
                          f"(expected a DoRA magnitude, found none)")
            continue
        if emb:
            # PEFT: delta = (lora_embedding_B @ lora_embedding_A).T * scaling
            kind, A, B = "embedding", b.T, a.T
        elif fifo:
            kind, A, B = "linear", b.T, a.T
        else:
            kind, A, B = "linear", a, b
        names = tuple(v[0] for v in g.values())
        base_w = (g["W"][1], g["W"][2]) if "W" in g else None
        targets.append(LoraTarget(module, kind, np.ascontiguousarray(A), np.ascontiguousarray(B),
                                  scale, mag, names, base_w))
    both = sorted({r.module for r in replacements} & {t.module for t in targets})
    if both:
        errors.append(f"  {', '.join(both)}: both LoRA factors and a modules_to_save copy "
                      f"(expected one or the other, found both)")
    if errors:
        raise AdapterError(f"{len(errors)} problem(s) in the adapter's tensors:\n"
                           + "\n".join(errors), file=file,
                           expected="base_model.model.<module>.lora_A.weight (r, in) and "
                           ".lora_B.weight (out, r) per module",
                           found=f"{len(errors)} problem(s), listed above")
    if not targets and not replacements:
        raise AdapterError("adapter holds no LoRA tensors", file=file,
                           expected="base_model.model.<module>.lora_A.weight / .lora_B.weight",
                           found="none")
    return Adapter(path, "peft", targets, cfg, file, "dora" if dora else "lora",
                   replacements=replacements)


def _saved_module(key: str, saved: List[str]) -> Optional[Tuple[str, str]]:
    """(module, leaf) when ``key`` is a modules_to_save tensor, else None.

    PEFT saves the trained copy of a ``modules_to_save`` module under the module's
    own name (``lm_head.weight``; older versions kept ``.modules_to_save.<adapter>``
    in it) and matches the configured names as PEFT does: a plain suffix of the module
    path (``"norm"`` matches ``model.norm`` and every ``*_layernorm``)."""
    key = re.sub(r"\.modules_to_save\.[^.]+\.", ".", key)
    module, _, leaf = key.rpartition(".")
    if leaf not in ("weight", "bias") or not module or re.search(
            r"\.(lora_[AB]|lora_embedding_[AB]|lora_magnitude_vector|base_layer)(\.|$)", key):
        return None
    if any(module.endswith(m) for m in saved):
        return module, leaf
    return None
