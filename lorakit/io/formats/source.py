"""Tensor sources: one face for everything that holds named tensors.

A checkpoint directory, one ``.safetensors`` file or adapter directory (:class:`FileSource`)
or an mlx-lm model in memory (:class:`ModelSource`) satisfies :class:`TensorSource`: names,
dtype codes and shapes without touching data, one tensor's raw storage on request, the
config, the majority float dtype and the quantized modules' packing. :func:`open` is the
one door every verb reads its inputs through.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Optional

if TYPE_CHECKING:
    import numpy as np

from ...errors import FormatError, PathLike
from .checkpoint import Checkpoint, QuantParams, TensorSource
from .paths import load_json, resolve_model_path, safe_member, stat_path, user_path
from .safetensors import MX_CODES, TensorInfo, TensorSpec, mx_to_raw, read_header, read_raw

__all__ = ["TensorSource", "ModelSource", "open"]

# adapter directories hold one of these (see lorakit.io.adapters.load)
_ADAPTER_CONFIG = "adapter_config.json"
_ADAPTER_WEIGHTS = ("adapters.safetensors", "adapter_model.safetensors")


class FileSource(TensorSource):
    """The tensors of one ``.safetensors`` file (``kind="file"``), or of an adapter
    directory's weights file (``kind="adapter"``, with its adapter config)."""

    def __init__(self, file: PathLike, kind: str = "file", label: Optional[str] = None,
                 config: Optional[Dict[str, Any]] = None) -> None:
        file = Path(file)
        self.file = file
        self.kind = kind
        self.path = file.parent if kind == "adapter" else file
        self.label = label if label is not None else file.name
        self.config = config or {}
        self.tensors: Dict[str, TensorInfo] = read_header(file).tensors

    def read(self, name: str, rows: Optional[slice] = None) -> np.ndarray:
        return read_raw(self.tensors[name], rows)


class ModelSource(TensorSource):
    """The parameters of an mlx-lm model in memory (``kind="model"``), under the
    names ``model.parameters()`` flattens to; quantized layers report their packing."""

    kind = "model"

    def __init__(self, model: Any, label: str = "model",
                 config: Optional[Dict[str, Any]] = None) -> None:
        from mlx.utils import tree_flatten  # lazy: mlx is heavy and optional at import

        self.model = model
        self.label = label
        self.path = Path("<in-memory model>")
        self.arrays: Dict[str, Any] = dict(tree_flatten(model.parameters()))
        self.tensors: Dict[str, TensorSpec] = {
            n: TensorSpec(n, MX_CODES[a.dtype], tuple(a.shape)) for n, a in self.arrays.items()}
        args = getattr(model, "args", None)
        cfg = dict(config) if config else (
            dict(vars(args)) if args is not None and hasattr(args, "__dict__") else {})
        cfg.setdefault("model_type", getattr(model, "model_type", cfg.get("model_type", "unknown")))
        self.config = cfg
        self._modules: Optional[Dict[str, Any]] = None

    @property
    def modules(self) -> Dict[str, Any]:
        """Module path -> module, from ``model.named_modules()`` (computed once)."""
        if self._modules is None:
            self._modules = dict(self.model.named_modules())
        return self._modules

    def read(self, name: str, rows: Optional[slice] = None) -> np.ndarray:
        a = self.arrays[name]
        if rows is not None:
            a = a[rows]
        import numpy as np  # lazy: header-only paths start without numpy

        return np.array(mx_to_raw(a)[0])

    def quant_params(self, module: str) -> Optional[QuantParams]:
        if f"{module}.scales" not in self.tensors:
            return None
        m = self.modules.get(module)
        if m is None or not hasattr(m, "bits"):
            return None
        return QuantParams(int(m.group_size), int(m.bits), str(getattr(m, "mode", "affine")))


def _adapter_source(p: Path) -> FileSource:
    for name in _ADAPTER_WEIGHTS:
        if (p / name).exists() or (p / name).is_symlink():
            # the files fuse reads, checked as fuse checks them: no link out of the folder
            weights = safe_member(p, name, source=p, what="adapter weights")
            cfg_path = safe_member(p, _ADAPTER_CONFIG, source=p, what="adapter config")
            cfg = load_json(cfg_path, "adapter config")
            return FileSource(weights, "adapter", p.name, cfg if isinstance(cfg, dict) else {})
    raise FormatError("no adapter weights found", file=p,
                      expected=" or ".join(_ADAPTER_WEIGHTS))


def open(x: Any, label: Optional[str] = None, *,  # noqa: A001  (lorakit.open)
         checkpoint: bool = False) -> TensorSource:
    """A :class:`TensorSource` for a checkpoint directory or hub repo id, an adapter
    directory, a ``.safetensors`` file, a source, or an mlx-lm model in memory;
    ``checkpoint=True`` accepts only a checkpoint.

    >>> import lorakit
    >>> src = lorakit.open("data/tiny-qwen3")
    >>> src.model_type, src.tensors["model.norm.weight"].dtype
    ('qwen3', 'BF16')
    """
    src: TensorSource
    if isinstance(x, TensorSource):
        src = x
    elif isinstance(x, (str, Path)):
        p = user_path(x, "model path")
        if stat_path(p, "model path") is None and not p.is_symlink():
            p = resolve_model_path(x)
        if checkpoint:
            src = Checkpoint(p)
        elif p.is_file() and p.suffix == ".safetensors":
            src = FileSource(p)
        elif p.is_dir() and (p / _ADAPTER_CONFIG).exists() and not (p / "config.json").exists():
            src = _adapter_source(p)
        else:
            src = Checkpoint(p)
    elif hasattr(x, "parameters") and hasattr(x, "named_modules"):
        src = ModelSource(x)
    else:
        raise FormatError("cannot open this object", found=type(x).__name__,
                          expected="a path, a hub repo id, a source or an mlx-lm model (nn.Module)")
    if checkpoint and not isinstance(src, Checkpoint):
        raise FormatError("not a checkpoint", file=getattr(src, "path", None), found=src.kind,
                          expected="a model directory with config.json, or a hub repo id")
    if label:
        src.label = label
    return src
