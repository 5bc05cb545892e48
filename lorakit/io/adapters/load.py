"""LoRA / DoRA adapters in the mlx-lm and PEFT formats, as one :class:`Adapter`.

:func:`load_adapter` tells the format from the files present; each format's reader
refuses what its own runtime would refuse, so a fuse never applies a tensor the unfused
adapter does not. :func:`check_runtime_scope` finishes the checks that need the base.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Dict, Iterable, Optional, Tuple

from ...errors import AdapterError, PathLike
from ..formats.paths import load_json, safe_member, user_path
from .base import CONFIG, MLX_WEIGHTS, PEFT_WEIGHTS, Adapter
from .mlx import check_layer_scope, load_mlx
from .peft import check_targets_exist, convert_residual, load_peft

__all__ = ["load_adapter"]


def _weights_of(path: Path, cfg: Dict[str, Any]) -> Tuple[str, Path]:
    """(format, weights file) of adapter directory ``path`` with config ``cfg``."""
    if (path / MLX_WEIGHTS).exists() and "peft_type" not in cfg:
        return "mlx-lm", path / MLX_WEIGHTS
    if (path / PEFT_WEIGHTS).exists():
        return "peft", path / PEFT_WEIGHTS
    if (path / MLX_WEIGHTS).exists():
        return "mlx-lm", path / MLX_WEIGHTS
    raise AdapterError("no adapter weights found", file=path,
                       expected=f"{MLX_WEIGHTS} (mlx-lm) or {PEFT_WEIGHTS} (PEFT)",
                       found=", ".join(sorted(p.name for p in path.iterdir())) or "empty directory",
                       hint="adapter_model.bin is a pickle (loading one can run code) and is "
                       "not read: save the adapter with PEFT's "
                       "save_pretrained(safe_serialization=True)"
                       if (path / "adapter_model.bin").exists() else None)


def _not_read(named: Path, reads: Optional[Path]) -> AdapterError:
    """The error for an adapter path naming a file other than the one that would be read."""
    return AdapterError(
        "adapter path names a file lorakit does not read", file=named,
        expected=("the adapter directory (its weights are "
                  f"{reads.name if reads else MLX_WEIGHTS + ' or ' + PEFT_WEIGHTS})"),
        found=f"the file {named.name}",
        hint="mlx-lm and PEFT take the adapter directory and read adapters.safetensors / "
        "adapter_model.safetensors from it; to use this file (e.g. a checkpoint saved "
        "during training), copy it with adapter_config.json into a new directory under "
        "that name")


def load_adapter(path: PathLike, initial_adapter: Optional[PathLike] = None, *,
                 residual_ok: bool = False) -> Adapter:
    """Read an mlx-lm or PEFT adapter directory (or the weights file it would read).

    Every tensor is checked and all problems come in one error. A residual-base PEFT
    adapter (pissa, olora, corda, lora_ga, loftq) is refused unless ``initial_adapter``
    names the adapter saved before training (then converted as PEFT does, rank 2r);
    ``residual_ok`` reads it unconverted.
    """
    if initial_adapter is not None:
        return convert_residual(load_adapter(path, residual_ok=True),
                                load_adapter(initial_adapter, residual_ok=True))
    path = user_path(path, "adapter path")
    named: Optional[Path] = None
    if path.is_file() and path.suffix == ".safetensors":
        named, path = path, path.parent
    if not path.is_dir():
        raise AdapterError("adapter path is not a directory", file=path,
                           expected="a directory with adapter_config.json",
                           found="a file" if path.exists() else "no such directory",
                           hint="give the directory that holds adapter_config.json"
                           if path.name == CONFIG else None)
    if named is not None and named.name not in (MLX_WEIGHTS, PEFT_WEIGHTS):
        raise _not_read(named, None)
    cfg_path = safe_member(path, CONFIG, source=path, what="adapter config")
    for name in (MLX_WEIGHTS, PEFT_WEIGHTS):
        safe_member(path, name, source=path, what="adapter weights")  # no links out
    cfg = load_json(cfg_path, "adapter config")
    if not isinstance(cfg, dict):
        raise AdapterError("adapter config is not a JSON object", file=cfg_path,
                           expected="a JSON object", found=type(cfg).__name__)
    fmt, file = _weights_of(path, cfg)
    if named is not None and named.name != file.name:
        raise _not_read(named, file)
    return load_mlx(path, cfg, file) if fmt == "mlx-lm" else \
        load_peft(path, cfg, file, residual_ok)


_IN_LAYER = re.compile(r"^(.+?)\.(\d+)\.")


def _layer_counts(config: Dict[str, Any], tensor_names: Iterable[str], prefix: str
                  ) -> Tuple[Optional[int], Optional[str], Optional[int]]:
    """(the model's block count, the config key that gave it or None when the tensors
    did, the block count the tensors show or None)."""
    idx = [int(m.group(2)) for m in map(_IN_LAYER.match, tensor_names)
           if m and m.group(1).rsplit(".", 1)[-1] == prefix]
    in_tensors = max(idx) + 1 if idx else None
    for where, cfg in (("", config), ("text_config.", config.get("text_config"))):
        if isinstance(cfg, dict):
            for key in ("num_hidden_layers", "n_layer", "num_layers"):
                if type(cfg.get(key)) is int and cfg[key] > 0:
                    return int(cfg[key]), where + key, in_tensors
    return in_tensors, None, in_tensors


def check_runtime_scope(adapter: Adapter, ck: Any) -> None:
    """Refuse what the adapter's own runtime refuses on base ``ck``: for mlx-lm, tensors
    outside the last ``num_layers`` blocks; for PEFT, ``target_modules`` matching nothing."""
    names = list(getattr(ck, "tensors", None) or getattr(ck, "params", None) or ())
    config = getattr(ck, "config", None) or {}
    if adapter.format == "mlx-lm":
        if not isinstance(adapter.config.get("lora_parameters"), dict):
            return  # built in memory, not read by load_adapter: no mlx-lm scope to check
        first = next((m for m in map(_IN_LAYER.match, (t.module for t in adapter.targets)) if m),
                     None)
        prefix = first.group(1).rsplit(".", 1)[-1] if first else "layers"
        n, key, in_tensors = _layer_counts(config, names, prefix)
        if n is not None:
            path = getattr(ck, "path", None)
            cfg_file = Path(path) / "config.json" if path is not None else "config.json"
            source = (f"{key}={n} in {cfg_file}" if key is not None else
                      f"blocks 0..{n - 1} among the checkpoint's tensors ({cfg_file} gives "
                      "no layer count)")
            conflict = (f"{key}={n} in {cfg_file}, but the checkpoint's tensors hold blocks "
                        f"0..{in_tensors - 1}" if key is not None and in_tensors is not None
                        and in_tensors != n else None)
            check_layer_scope(adapter, n, source=source, conflict=conflict)
    else:
        modules = {n.rsplit(".", 1)[0] for n in names if n.endswith((".weight", ".bias"))}
        check_targets_exist(adapter, sorted(modules), getattr(ck, "path", Path("?")))
