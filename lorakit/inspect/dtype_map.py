"""Per-layer dtype maps, and the tensor sources every inspection helper reads from.

A *source* is whatever holds named tensors: a checkpoint directory, an adapter
directory, one ``.safetensors`` file, or an in-memory mlx-lm model
(``nn.Module``). :func:`open_source` gives all of them one face
(:class:`TensorSource`): names, dtype codes and shapes without reading data, and
raw storage on request. The checkpoint and model sources also answer the
questions :func:`lorakit.io.naming.bind` asks, so adapters land on either.

:func:`dtype_map` reads headers only (a checkpoint's tensors are never touched):
one row per tensor with its layer, kind (q, k, v, o, gate, up, down, norms,
embed, head, ...), dtype and bytes, flagging every float tensor whose dtype is not
the checkpoint's majority. That is where a fuse that forgot its cast lights up.

>>> import lorakit
>>> _ = lorakit.fuse("data/tiny-qwen3", "data/adapters/lora", "fused-f32", dtype="promote")
>>> dm = dtype_map("fused-f32"); dm.flagged_names()[:2]
['model.layers.3.mlp.up_proj.weight', 'model.layers.3.mlp.down_proj.weight']
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np

from .. import numerics as nm
from ..errors import FormatError
from ..io.checkpoint import QUANT_SUFFIXES, Checkpoint, QuantParams
from ..io.safetensors import FLOAT_CODES, ITEMSIZE, TensorInfo, read_header, read_raw
from .report import Report

__all__ = ["TensorMeta", "TensorSource", "open_source", "split_name", "DtypeMap", "dtype_map",
           "weight_f64"]

PathLike = Union[str, Path]

# Last module-path component -> short kind. Unknown names keep their own component.
_KIND = {
    "q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "qkv_proj": "qkv",
    "query_key_value": "qkv", "c_attn": "qkv", "dense": "o", "out_proj": "o",
    "gate_proj": "gate", "up_proj": "up", "down_proj": "down", "gate_up_proj": "gate_up",
    "w1": "gate", "w3": "up", "w2": "down", "fc1": "up", "fc2": "down",
    "q_norm": "q_norm", "k_norm": "k_norm", "input_layernorm": "norm_in",
    "post_attention_layernorm": "norm_attn", "pre_feedforward_layernorm": "norm_pre_ff",
    "post_feedforward_layernorm": "norm_post_ff", "norm": "norm",
    "embed_tokens": "embed", "wte": "embed", "word_embeddings": "embed", "tok_embeddings": "embed",
    "lm_head": "head", "output": "head",
}
#: Column order of the kinds in tables and heatmaps (others follow, sorted).
KIND_ORDER = ["embed", "q", "k", "v", "qkv", "o", "q_norm", "k_norm", "norm_in", "norm_attn",
              "router", "gate", "up", "gate_up", "down", "experts.gate", "experts.up",
              "experts.down", "norm_pre_ff", "norm_post_ff", "norm", "head"]
_LEAVES = ("weight", "bias", "scales", "biases", "lora_a", "lora_b", "m", "lora_A", "lora_B",
           "lora_magnitude_vector")
_LORA_PARTS = ("lora_a", "lora_b", "m", "lora_A", "lora_B", "lora_magnitude_vector")
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)(?:\.|$)")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def split_name(name: str) -> Tuple[Optional[int], str, Optional[int], str]:
    """(layer, kind, expert, part) of a tensor or module name.

    >>> split_name("model.layers.3.self_attn.q_proj.weight")
    (3, 'q', None, 'weight')
    >>> split_name("model.layers.0.mlp.experts.5.down_proj.scales")
    (0, 'experts.down', 5, 'scales')
    >>> split_name("model.embed_tokens.weight")
    (None, 'embed', None, 'weight')
    """
    parts = name.split(".")
    part = ""
    # PEFT keys end in ".lora_A.weight"; keep "lora_A" as the part, not "weight".
    if len(parts) >= 2 and parts[-2] in ("lora_A", "lora_B") and parts[-1] == "weight":
        part = parts[-2]
        parts = parts[:-2]
    elif parts[-1] in _LEAVES and len(parts) > 1:
        part = parts[-1]
        parts = parts[:-1]
    if parts and parts[-1] == "linear" and len(parts) > 1:  # mlx-lm LoRALinear wrapper
        parts = parts[:-1]
    module = ".".join(parts)
    m = _LAYER.search(module)
    layer = int(m.group(1)) if m else None
    e = _EXPERT.search(module + ".")
    expert = int(e.group(1)) if e else None
    leaf = parts[-1] if parts else name
    kind = _KIND.get(leaf, leaf)
    if leaf == "gate" and len(parts) > 1 and parts[-2] in ("mlp", "block_sparse_moe", "moe"):
        kind = "router"
    if expert is not None or "switch_mlp" in parts:
        kind = "experts." + kind
    return layer, kind, expert, part


# -- sources ---------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorMeta:
    """Name, safetensors dtype code and shape of one tensor held in memory."""

    name: str
    dtype: str
    shape: Tuple[int, ...]

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.dtype]


class TensorSource:
    """Named tensors from a checkpoint, an adapter, a file or an in-memory model.

    Attributes:
        kind: ``"checkpoint"``, ``"adapter"``, ``"file"`` or ``"model"``.
        label: a short name for tables.
        path: the directory or file, None for in-memory models.
        tensors: name -> metadata (``.dtype`` code, ``.shape``, ``.nbytes``), in file order.
        config: the model config (``{}`` when there is none).
    """

    kind: str = "file"
    label: str = ""
    path: Optional[Path] = None
    config: Dict[str, Any] = {}
    tensors: Dict[str, Any]

    def read(self, name: str, rows: Optional[slice] = None) -> np.ndarray:
        """Raw numpy storage of a tensor (bf16 as uint16 bits), optionally a row slice."""
        raise NotImplementedError

    def file_info(self, name: str) -> Optional[TensorInfo]:
        """Where the tensor's bytes lie on disk (None for in-memory sources)."""
        return None

    def quant_params(self, module: str) -> Optional[QuantParams]:
        return None

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type", "unknown"))

    @property
    def dtype(self) -> str:
        """Majority float dtype by element count (quantization scales/biases aside)."""
        return majority_dtype(self.tensors.values())

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __repr__(self) -> str:
        return f"<{self.kind} {self.label}: {len(self.tensors)} tensors>"


_CONFIG_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64"}


def _config_dtype(config) -> Optional[str]:
    """The float dtype config.json declares (``torch_dtype`` or transformers 5's ``dtype``)."""
    if not isinstance(config, dict):
        return None
    for key in ("torch_dtype", "dtype"):
        v = config.get(key)
        if isinstance(v, str) and v.replace("torch.", "") in _CONFIG_DTYPES:
            return _CONFIG_DTYPES[v.replace("torch.", "")]
    return None


def majority_dtype(metas) -> str:
    c: Counter = Counter()
    for t in metas:
        if t.dtype in FLOAT_CODES and not t.name.endswith(QUANT_SUFFIXES):
            c[t.dtype] += t.numel
    return c.most_common(1)[0][0] if c else "F32"


class _CheckpointSource(TensorSource):
    kind = "checkpoint"

    def __init__(self, ck: Checkpoint) -> None:
        self.ck = ck
        self.path = ck.path
        self.label = ck.path.name
        self.config = ck.config
        self.tensors = ck.tensors

    def read(self, name: str, rows: Optional[slice] = None) -> np.ndarray:
        return self.ck.read(name, rows)

    def file_info(self, name: str) -> Optional[TensorInfo]:
        return self.ck.tensors.get(name)

    def quant_params(self, module: str) -> Optional[QuantParams]:
        return self.ck.quant_params(module)

    @property
    def dtype(self) -> str:
        return self.ck.dtype


class _FileSource(TensorSource):
    def __init__(self, file: Path, kind: str, label: str, config: Optional[dict] = None) -> None:
        self.path = file.parent if kind == "adapter" else file
        self.file = file
        self.kind = kind
        self.label = label
        self.config = config or {}
        self.tensors = read_header(file).tensors

    def read(self, name: str, rows: Optional[slice] = None) -> np.ndarray:
        return read_raw(self.tensors[name], rows)

    def file_info(self, name: str) -> Optional[TensorInfo]:
        return self.tensors.get(name)


class _ModelSource(TensorSource):
    kind = "model"

    def __init__(self, model: Any, label: str = "model") -> None:
        from mlx.utils import tree_flatten

        from ..io.safetensors import MX_CODES

        self.model = model
        self.label = label
        self.arrays = dict(tree_flatten(model.parameters()))
        self.tensors = {n: TensorMeta(n, MX_CODES[a.dtype], tuple(a.shape))
                        for n, a in self.arrays.items()}
        args = getattr(model, "args", None)
        cfg = dict(vars(args)) if args is not None and hasattr(args, "__dict__") else {}
        cfg.setdefault("model_type", getattr(model, "model_type", cfg.get("model_type", "unknown")))
        self.config = cfg
        self._modules: Optional[Dict[str, Any]] = None

    def read(self, name: str, rows: Optional[slice] = None) -> np.ndarray:
        from ..io.safetensors import mx_to_raw

        a = self.arrays[name]
        if rows is not None:
            a = a[rows]
        return np.array(mx_to_raw(a)[0])

    def quant_params(self, module: str) -> Optional[QuantParams]:
        if f"{module}.scales" not in self.tensors:
            return None
        if self._modules is None:
            self._modules = dict(self.model.named_modules())
        m = self._modules.get(module)
        if m is None or not hasattr(m, "bits"):
            return None
        return QuantParams(int(m.group_size), int(m.bits), str(getattr(m, "mode", "affine")))


def open_source(x: Any, label: Optional[str] = None) -> TensorSource:
    """A :class:`TensorSource` for a path (checkpoint dir, adapter dir, .safetensors
    file), a :class:`~lorakit.io.checkpoint.Checkpoint`, or an mlx ``nn.Module``."""
    if isinstance(x, TensorSource):
        return x
    if isinstance(x, Checkpoint):
        src: TensorSource = _CheckpointSource(x)
    elif isinstance(x, (str, Path)):
        p = Path(x)
        if p.is_file() and p.suffix == ".safetensors":
            src = _FileSource(p, "file", p.name)
        elif p.is_dir() and (p / "adapter_config.json").exists() and not (p / "config.json").exists():
            from ..io.adapter import MLX_WEIGHTS, PEFT_WEIGHTS
            from ..io.checkpoint import _load_json

            f = p / MLX_WEIGHTS if (p / MLX_WEIGHTS).exists() else p / PEFT_WEIGHTS
            if not f.exists():
                raise FormatError("no adapter weights found", file=p,
                                  expected=f"{MLX_WEIGHTS} or {PEFT_WEIGHTS}")
            cfg = _load_json(p / "adapter_config.json", "adapter config")
            src = _FileSource(f, "adapter", p.name, cfg if isinstance(cfg, dict) else {})
        elif p.exists():
            src = _CheckpointSource(Checkpoint(p))
        else:
            raise FormatError("no such file or directory", file=p,
                              expected="a checkpoint or adapter directory, or a .safetensors file")
    elif hasattr(x, "parameters") and hasattr(x, "named_modules"):
        src = _ModelSource(x)
    else:
        raise FormatError("cannot inspect this object", found=type(x).__name__,
                          expected="a path, a Checkpoint or an mlx-lm model (nn.Module)")
    if label:
        src.label = label
    return src


def _mx_dtype(code: str):
    import mlx.core as mx

    return {"BF16": mx.bfloat16, "F16": mx.float16, "F32": mx.float32}[code]


def weight_f64(src: TensorSource, name: str, rows: Optional[slice] = None) -> np.ndarray:
    """A weight's values as float64, dequantizing packed weights with ``mx.dequantize``.

    ``rows`` slices the leading axis (for quantized weights the whole tensor is
    dequantized first; they are small).
    """
    module = name[: -len(".weight")] if name.endswith(".weight") else name
    q = src.quant_params(module) if name.endswith(".weight") else None
    if q is None:
        code = src.tensors[name].dtype
        raw = src.read(name, rows)
        if code == "F64":
            return np.asarray(raw, np.float64)
        if code not in FLOAT_CODES:
            raise FormatError("not a float tensor", tensor=name, found=code,
                              expected="BF16, F16, F32 or F64 (or a quantized weight)")
        return nm.to_float64(raw, nm.float_format(code))
    import mlx.core as mx

    from ..io.safetensors import raw_to_mx

    parts = []
    for leaf in ("weight", "scales", "biases"):
        n = f"{module}.{leaf}"
        parts.append(raw_to_mx(src.read(n), src.tensors[n].dtype) if n in src.tensors else None)
    w, s, b = parts
    x = mx.dequantize(w, s, b, group_size=q.group_size, bits=q.bits, mode=q.mode)
    out = np.array(x.astype(mx.float32)).astype(np.float64)
    return out if rows is None else out[rows]


# -- the dtype map ------------------------------------------------------------------------
def _order_kinds(kinds) -> List[str]:
    known = [k for k in KIND_ORDER if k in kinds]
    return known + sorted(k for k in kinds if k not in KIND_ORDER)


def layer_kind_cells(rows) -> Tuple[List[str], List[str], Dict[Tuple[str, str], List[Dict[str, Any]]]]:
    """Group report rows by (layer label, kind): the cells of a layer x kind grid.

    Returns the row labels (``"-"`` first for layer-less tensors such as the embedding,
    then layers in order), the kinds in display order, and the rows of each cell.
    """
    cells: Dict[Tuple[str, str], List[Dict[str, Any]]] = {}
    layers: set = set()
    has_global = False
    for r in rows:
        layer = r["layer"]
        has_global |= layer is None
        if layer is not None:
            layers.add(layer)
        cells.setdefault(("-" if layer is None else str(layer), r["kind"]), []).append(r)
    labels = (["-"] if has_global else []) + [str(i) for i in sorted(layers)]
    return labels, _order_kinds({k for _, k in cells}), cells


@dataclass(repr=False)
class DtypeMap(Report):
    """Per-tensor dtypes and bytes of one source.

    ``rows``: tensor, layer, kind, part, dtype, shape, bytes, flag. ``summary``:
    majority dtype, bytes by dtype, tensors flagged. :meth:`grid` gives the
    layer x kind table behind :meth:`plot`'s heatmap.
    """

    bytes_by_dtype: Dict[str, int] = field(default_factory=dict)

    def flagged_names(self) -> List[str]:
        return [self.rows[i]["tensor"] for i in self.flagged]

    def grid(self, part: str = "weight") -> Tuple[List[str], List[str], List[List[str]]]:
        """(row labels, kinds, cells): each cell the dtype of that layer's tensor of that
        kind (``"Q4"`` for a 4-bit packed weight, ``"mixed"``, or ``""`` when absent).
        Layer-less tensors (embed, head, final norm) form the row ``"-"``."""
        labels, ks, groups = layer_kind_cells(r for r in self.rows if r["part"] in (part, ""))
        cells = {key: {r.get("stored_as") or r["dtype"] for r in rs} for key, rs in groups.items()}

        def cell(lab: str, k: str) -> str:
            v = cells.get((lab, k))
            if not v:
                return ""
            return "mixed" if len(v) > 1 else next(iter(v))

        return labels, ks, [[cell(lab, k) for k in ks] for lab in labels]

    def flag_grid(self, part: str = "weight") -> List[List[bool]]:
        """Same shape as :meth:`grid`: True where a flagged tensor sits."""
        labels, ks, _ = self.grid(part)
        hit = {("-" if self.rows[i]["layer"] is None else str(self.rows[i]["layer"]),
                self.rows[i]["kind"]) for i in self.flagged}
        return [[(lab, k) in hit for k in ks] for lab in labels]

    def plot(self, ax=None, part: str = "weight"):
        """Heatmap of dtypes, layers x tensor kinds; flagged cells outlined. Returns a Figure."""
        from .plots import dtype_heatmap

        return dtype_heatmap(self, ax=ax, part=part)

    figure = plot


def dtype_map(source: Any) -> DtypeMap:
    """Dtype and bytes of every tensor, per layer and kind, from headers only.

    Args:
        source: checkpoint directory, adapter directory, ``.safetensors`` file,
            :class:`~lorakit.io.checkpoint.Checkpoint`, or an in-memory mlx-lm model.

    Returns:
        A :class:`DtypeMap`. A float tensor whose dtype differs from the majority float
        dtype is flagged. Quantized parts (packed ``.weight``, ``.scales``,
        ``.biases``) are never flagged for that; their scales and biases are flagged
        only when their dtype differs from the other scales' (as after a DoRA fuse of
        a quantized model that wrote float32 scales).

    >>> dm = dtype_map("data/tiny-qwen3")
    >>> dm.summary["expected dtype"], dm.summary["flagged"]
    ('BF16', 0)
    """
    src = open_source(source)
    metas = list(src.tensors.values())
    names = src.tensors
    # the dtype the model is meant to have: config.json's, else the majority by elements
    # (after a careless fuse the promoted f32 projections can be the majority)
    majority = _config_dtype(getattr(src, "config", None)) or src.dtype
    # a module is quantized when it has .scales next to an integer .weight
    qmods = {n[: -len(".scales")] for n in names if n.endswith(".scales")
             and names.get(n[: -len(".scales")] + ".weight") is not None
             and names[n[: -len(".scales")] + ".weight"].dtype not in FLOAT_CODES}
    scale_major = Counter(t.dtype for t in metas if t.name.endswith(QUANT_SUFFIXES)
                          and t.name.rsplit(".", 1)[0] in qmods).most_common(1)
    scale_dtype = scale_major[0][0] if scale_major else None
    rows: List[Dict[str, Any]] = []
    flagged: List[int] = []
    by_dtype: Counter = Counter()
    qbits = (src.config.get("quantization") or {}).get("bits") if isinstance(
        src.config.get("quantization"), dict) else None
    for i, t in enumerate(metas):
        layer, kind, expert, part = split_name(t.name)
        module = t.name.rsplit(".", 1)[0]
        nbytes = int(t.nbytes)
        by_dtype[t.dtype] += nbytes
        flag = ""
        stored = ""
        if module in qmods:
            if part == "weight":
                q = None
                try:
                    q = src.quant_params(module)
                except FormatError:
                    pass
                bits = q.bits if q is not None else qbits
                stored = f"Q{bits}" if bits else "Q"
            elif scale_dtype is not None and t.dtype != scale_dtype:
                flag = f"{t.dtype} scales, others {scale_dtype}"
        elif t.dtype in FLOAT_CODES and t.dtype != majority and (
                src.kind == "adapter" or part not in _LORA_PARTS):
            # LoRA factors attached to a loaded model are float32 by design: no flag
            flag = f"{t.dtype}, majority {majority}"
        row = {"tensor": t.name, "layer": layer, "kind": kind, "expert": expert, "part": part,
               "dtype": t.dtype, "stored_as": stored or t.dtype, "shape": list(t.shape),
               "bytes": nbytes, "flag": flag}
        if flag:
            flagged.append(i)
        rows.append(row)
    total = sum(by_dtype.values())
    summary: Dict[str, Any] = {
        "source": str(src.path) if src.path is not None else src.label,
        "kind": src.kind,
        "tensors": len(rows),
        "bytes": total,
        "expected dtype": majority,
        "bytes by dtype": ", ".join(f"{k} {v / 1e6:.1f} MB ({v / total:.1%})" if total else k
                                    for k, v in by_dtype.most_common()),
        "flagged": len(flagged),
    }
    if qmods:
        summary["quantized modules"] = len(qmods)
    if flagged:
        fb = sum(rows[i]["bytes"] for i in flagged)
        summary["flagged bytes"] = fb
    rep = DtypeMap(title=f"dtype map of {src.label}", rows=rows,
                   columns=["tensor", "layer", "kind", "dtype", "shape", "bytes", "flag"],
                   summary=summary, flagged=flagged, bytes_by_dtype=dict(by_dtype))
    return rep
