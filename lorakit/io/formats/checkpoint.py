"""Base checkpoints in the HF and mlx-lm layouts, read lazily.

A checkpoint is a directory with ``config.json`` and one ``model.safetensors`` or shards
listed in ``model.safetensors.index.json``; opening one reads only the headers. Shard
names are untrusted: a plain file inside the directory, or a hub snapshot's link into
the cache's ``blobs``; any other link out is refused.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Tuple

if TYPE_CHECKING:
    import numpy as np

from ...errors import FormatError, PathLike
from .dtypes import majority_dtype
from .paths import check_model_dir, is_hub_blob, load_json, safe_member, user_path
from .safetensors import FLOAT_CODES, TensorInfo, _file_kind, raw_to_mx, read_header, read_raw

__all__ = ["INDEX_NAME", "QuantParams", "Checkpoint", "TensorSource"]

INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class QuantParams:
    """How one quantized weight was packed (mlx ``quantize`` arguments)."""

    group_size: int
    bits: int
    mode: str = "affine"


#: modes whose scales are shared exponents (uint8) and that have no biases.
_FP_MODES = ("mxfp4", "nvfp4", "mxfp8")


def _check_packing(w: TensorInfo, s: TensorInfo, gs: int, bits: int, mode: str,
                   biases: Optional[TensorInfo], where: str) -> None:
    """Raise unless weight ``w`` and scales ``s`` are what ``bits`` / ``gs`` / ``mode`` pack:
    ``cols * 32 == bits * scale_cols * gs``."""
    cols, groups = w.shape[-1], s.shape[-1]
    if cols * 32 != bits * groups * gs:
        in_dims = groups * gs
        found_bits = f"{cols * 32 / in_dims:g}" if in_dims else "?"
        raise FormatError(
            "quantization config disagrees with the packed weight", file=w.file, tensor=w.name,
            expected=f"bits={bits}, group_size={gs} (config.json quantization, {where}): "
            f"weight U32[..., {in_dims * bits // 32 if in_dims * bits % 32 == 0 else '?'}] "
            f"for scales [..., {groups}]",
            found=f"weight U32{list(w.shape)}: {found_bits}-bit codes at group_size={gs}",
            hint=f"fix config.json's quantization (or add a per-module entry "
            f"\"{w.name[:-len('.weight')]}\": {{\"group_size\": ..., \"bits\": ...}})")
    affine = mode == "affine"
    if (s.dtype not in FLOAT_CODES or biases is None) if affine else \
            mode in _FP_MODES and (s.dtype != "U8" or biases is not None):
        raise FormatError(
            "quantization config disagrees with the packed weight", file=s.file, tensor=s.name,
            expected="affine mode: float scales and a .biases tensor beside them" if affine
            else f"{mode} mode: uint8 scales and no biases",
            found=f"scales {s.dtype}, {'no biases' if biases is None else 'biases present'}",
            hint="set config.json's quantization mode to the one the weights were packed "
            "with (mxfp4 / nvfp4 / mxfp8 keep uint8 scales and no biases)" if affine else None)


class TensorSource:
    """What every tensor source offers (:func:`lorakit.io.formats.source.open` gives one):
    ``kind`` (checkpoint, adapter, file, model), a ``label`` for tables, ``path``,
    ``config`` (``{}`` when none), ``tensors`` (name -> dtype code and shape, in file
    order, read without touching data), ``read(name, rows=None)`` (raw numpy storage, bf16
    as uint16 bits), ``file_info`` (where a tensor's bytes lie on disk, None in memory),
    ``quant_params`` (a quantized module's packing, else None) and ``dtype`` (the
    majority float dtype, :func:`~lorakit.io.formats.dtypes.majority_dtype`)."""

    kind: str = "file"
    label: str = ""
    path: Path
    config: Dict[str, Any]
    tensors: Dict[str, Any]

    def read(self, name: str, rows: Optional[slice] = None) -> np.ndarray:
        raise NotImplementedError

    def file_info(self, name: str) -> Optional[TensorInfo]:
        t = self.tensors.get(name)
        return t if isinstance(t, TensorInfo) else None

    def quant_params(self, module: str) -> Optional[QuantParams]:
        return None

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type", "unknown"))

    @property
    def dtype(self) -> str:
        return majority_dtype(self.tensors.values())

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __repr__(self) -> str:
        return f"<{self.kind} {self.label}: {len(self.tensors)} tensors>"


class Checkpoint(TensorSource):
    """A base checkpoint directory, opened lazily (a :class:`TensorSource` of ``kind ==
    "checkpoint"``).

    >>> ck = Checkpoint("data/tiny-qwen3"); ck.dtype, len(ck.tensors)
    ('BF16', 46)
    """

    kind = "checkpoint"

    def __init__(self, path: PathLike) -> None:
        self.path = user_path(path, "model path")
        check_model_dir(self.path)
        self.label = self.path.name
        cfg_path = safe_member(self.path, "config.json", source=self.path, what="config.json")
        self.config: Dict[str, Any] = load_json(cfg_path, "config.json")
        if not isinstance(self.config, dict):
            raise FormatError("config.json is not a JSON object", file=cfg_path,
                              expected="a JSON object", found=type(self.config).__name__)
        index_path = self.path / INDEX_NAME
        weight_map: Optional[Dict[str, str]] = None
        if index_path.exists() or index_path.is_symlink():
            index_path = safe_member(self.path, INDEX_NAME, source=self.path, what="index")
            idx = load_json(index_path, "index")
            if not isinstance(idx, dict) or not isinstance(idx.get("weight_map"), dict):
                raise FormatError("index has no weight_map object", file=index_path,
                                  tensor="weight_map", expected='{"weight_map": {...}}',
                                  found=(type(idx.get("weight_map")).__name__
                                         if isinstance(idx, dict) else type(idx).__name__))
            weight_map = idx["weight_map"]
            for name, n in weight_map.items():  # check before any name is used
                safe_member(self.path, n, source=index_path, what="shard", tensor=name)
            shard_names = list(dict.fromkeys(weight_map.values()))
        else:
            shard_names = sorted(p.name for p in self.path.glob("*.safetensors"))
            if "model.safetensors" in shard_names:
                shard_names = ["model.safetensors"]
        if not shard_names:
            raise FormatError("no safetensors weights in the model directory", file=self.path,
                              expected="model.safetensors or model.safetensors.index.json",
                              found=", ".join(sorted(p.name for p in self.path.iterdir()))[:200]
                              or "an empty directory")
        self.shards: List[str] = shard_names
        self.headers = {}
        self.tensors: Dict[str, TensorInfo] = {}
        for n in shard_names:
            f = safe_member(self.path, n, source=index_path if weight_map else self.path,
                            what="shard")
            if f.exists() and not f.is_file():
                raise FormatError("shard is not a regular file", file=f,
                                  expected="a regular safetensors file",
                                  found=_file_kind(f.stat().st_mode))
            if not f.is_file():
                raise FormatError("shard named in the index is missing", file=f,
                                  tensor=next((k for k, v in (weight_map or {}).items() if v == n), None),
                                  expected="an existing safetensors file", found="no such file")
            h = read_header(f)
            self.headers[n] = h
            for name, info in h.tensors.items():
                if name in self.tensors:
                    raise FormatError("tensor appears in two shards", file=f, tensor=name,
                                      expected="each tensor in one shard",
                                      found=f"also in {self.tensors[name].file.name}")
                self.tensors[name] = info
        if weight_map is not None:
            for name, shard in weight_map.items():
                info = self.tensors.get(name)
                if info is None or info.file.name != shard:
                    raise FormatError("index names a tensor its shard does not hold",
                                      file=index_path, tensor=name,
                                      expected=f"tensor in {shard}",
                                      found=("in " + info.file.name) if info else "absent")

    @property
    def quantization(self) -> Optional[Dict[str, Any]]:
        q = self._quant_config()
        if isinstance(q, dict) and "bits" in q and "group_size" in q:
            return q
        return None

    def _quant_config(self) -> Dict[str, Any]:
        """config.json's ``quantization`` (mlx-lm) or ``quantization_config`` dict, or {}."""
        q = self.config.get("quantization") or self.config.get("quantization_config")
        return q if isinstance(q, dict) else {}

    def quant_params(self, module: str) -> Optional[QuantParams]:
        """Packing of quantized ``module`` (None if not quantized), from config.json's
        ``quantization`` (a per-module entry first, as mlx-lm reads it), refused unless the
        packed tensors agree."""
        if f"{module}.scales" not in self.tensors:
            return None
        s = self.tensors[f"{module}.scales"]
        if f"{module}.weight" not in self.tensors:
            raise FormatError("quantization scales without a weight", file=s.file,
                              tensor=s.name, expected=f"{module}.weight beside it",
                              found="no such tensor")
        w = self.tensors[f"{module}.weight"]
        if w.dtype != "U32" or not w.shape or not s.shape or w.shape[:-1] != s.shape[:-1]:
            raise FormatError("quantized weight has an unexpected layout", file=w.file,
                              tensor=w.name, expected="packed U32 weight (..., in*bits/32) "
                              "with scales (..., in/group_size)",
                              found=f"weight {w.dtype}{list(w.shape)}, "
                              f"scales {s.dtype}{list(s.shape)}")
        q = self._quant_config()
        override = q.get(module)
        if override is False:  # mlx-lm leaves this module in float
            raise FormatError("config.json says this module is not quantized, but it has "
                              "quantization scales", file=w.file, tensor=w.name,
                              expected=f"a float {module}.weight (quantization[{module!r}] is "
                              "false)", found=f"packed weight U32{list(w.shape)} with scales")
        src = override if isinstance(override, dict) else q
        mode = str(src.get("mode", "affine"))
        gs, bits = src.get("group_size"), src.get("bits")
        if not all(type(x) is int and x > 0 for x in (gs, bits)):
            raise FormatError("cannot tell how a quantized weight was packed",
                              file=w.file, tensor=w.name,
                              expected="quantization {group_size, bits} (positive integers) "
                              "in config.json", found=json.dumps(src)[:120])
        _check_packing(w, s, gs, bits, mode, self.tensors.get(f"{module}.biases"),
                       "override" if override is not None else "top level")
        return QuantParams(int(gs), int(bits), mode)

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise FormatError("no such tensor in the checkpoint", file=self.path,
                              tensor=name) from None

    def read(self, name: str, rows: Optional[slice] = None) -> np.ndarray:
        """Raw numpy storage of one tensor (bf16 as uint16 bits)."""
        return read_raw(self.info(name), rows)

    def read_mx(self, name: str):
        """One tensor as an ``mx.array`` in its stored dtype."""
        info = self.info(name)
        return raw_to_mx(read_raw(info), info.dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def by_shard(self) -> Iterator[Tuple[str, List[TensorInfo]]]:
        for n in self.shards:
            yield n, list(self.headers[n].tensors.values())

    def extra_files(self) -> List[Path]:
        """Files beside the weights that a fused copy should carry (tokenizer etc.);
        a link out of the folder is never followed (see :meth:`links_outside`)."""
        return [p for p, target in self._sidecars() if target is None]

    def links_outside(self) -> List[Tuple[Path, Path]]:
        """The sidecar files (tokenizer etc.) that are links out of the model folder, with
        what they point at: a fused copy does not carry them (lorakit never copies what a
        link outside points at; a hub cache's blob links are inside by rule)."""
        return [(p, target) for p, target in self._sidecars() if target is not None]

    def _sidecars(self) -> List[Tuple[Path, Optional[Path]]]:
        out: List[Tuple[Path, Optional[Path]]] = []
        skip_ext = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack")
        for p in sorted(self.path.iterdir()):
            if p.name == INDEX_NAME or p.name.endswith(skip_ext) or p.name.startswith("."):
                continue
            if p.is_file():
                target = p.resolve() if p.is_symlink() else None
                if target is not None and (target.parent == self.path.resolve()
                                           or is_hub_blob(p, target)):
                    target = None
                out.append((p, target))
        return out

    def __repr__(self) -> str:
        q = self.quantization
        qs = f", {q['bits']}-bit" if q else ""
        return (f"Checkpoint({str(self.path)!r}, {self.model_type}, {len(self.tensors)} tensors, "
                f"{self.dtype}{qs}, {len(self.shards)} shard{'s' if len(self.shards) != 1 else ''})")

