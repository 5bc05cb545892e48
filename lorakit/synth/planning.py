"""Planning a checkpoint: sizes, configs, and every tensor's name and shape (from mlx-lm)."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from ..errors import FormatError, PathLike
from .presets import _MIXTRAL, PRESETS

__all__ = ["parse_size", "resolve_config", "plan_checkpoint"]


def parse_size(size: Union[int, str]) -> int:
    """Bytes from ``2000000000``, ``"2GB"`` (10**9), ``"2GiB"`` (2**30), ``"500MB"``...

    >>> parse_size("2GB"), parse_size("1GiB"), parse_size(4096)
    (2000000000, 1073741824, 4096)
    """
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise FormatError("shard size must be positive", found=str(size))
        return size
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?)B?\s*", str(size), re.IGNORECASE)
    if not m:
        raise FormatError("cannot read a size", expected="bytes, or a number with KB/MB/GB/GiB",
                          found=repr(size))
    unit = "KMGT".find(m.group(2).upper()) + 1 if m.group(2) else 0
    base = 1024 if m.group(3) else 1000
    n = int(float(m.group(1)) * base ** unit)
    if n <= 0:
        raise FormatError("shard size must be positive", found=repr(size))
    return n


def resolve_config(preset_or_config: Union[str, PathLike, Mapping[str, Any]],
                   overrides: Optional[Mapping[str, Any]] = None) -> Tuple[str, Dict[str, Any]]:
    """(name, config) from a preset name, a config.json (or its directory), or a dict.

    ``overrides`` replace config fields, e.g. ``{"num_hidden_layers": 2}`` for a
    small model of a real family.
    """
    src = preset_or_config
    if isinstance(src, Mapping):
        name, config = str(src.get("model_type", "config")), json.loads(json.dumps(dict(src)))
    elif isinstance(src, str) and src.lower() in PRESETS:
        name, config = src.lower(), json.loads(json.dumps(PRESETS[src.lower()]))
    else:
        p = Path(src)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise FormatError("unknown preset and no such config.json", file=p,
                              expected="a preset (" + ", ".join(PRESETS) + ") or a config.json",
                              found=repr(str(src)))
        try:
            config = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise FormatError(f"cannot read config.json: {e}", file=p) from None
        if not isinstance(config, dict):
            raise FormatError("config.json is not a JSON object", file=p)
        name = p.parent.name or str(config.get("model_type", "config"))
    config.update(dict(overrides or {}))
    if "model_type" not in config:
        raise FormatError("config has no model_type", expected='"model_type": "qwen3", ...')
    return name, config


def _model(config: Dict[str, Any]):
    """mlx-lm's model for ``config``, with lazy (never evaluated) parameters."""
    from mlx_lm.utils import _get_classes  # lazy: mlx-lm is heavy

    try:
        model_cls, args_cls = _get_classes(config)
        return model_cls(args_cls.from_dict(config))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise FormatError(f"mlx-lm cannot build a {config.get('model_type')!r} model from this "
                          f"config: {type(e).__name__}: {e}",
                          hint="check the config fields (or the model_type) mlx-lm expects"
                          ) from None


def _hf_names(model, params: List[Tuple[str, Tuple[int, ...]]],
              model_type: str) -> List[Tuple[str, Tuple[int, ...]]]:
    """The tensors transformers saves for this model: stacked experts split per expert."""
    out: List[Tuple[str, Tuple[int, ...]]] = []
    for name, shape in params:
        if ".switch_mlp." not in name:
            out.append((name, shape))
            continue
        head, tail = name.split(".switch_mlp.", 1)
        proj, leaf = tail.rsplit(".", 1)
        if head.endswith("block_sparse_moe"):  # mixtral names its experts w1/w2/w3
            proj = _MIXTRAL.get(proj, proj)
        for e in range(shape[0]):
            out.append((f"{head}.experts.{e}.{proj}.{leaf}", tuple(shape[1:])))
    _check_round_trip(model, params, out, model_type)
    return out


def _check_round_trip(model, params, hf, model_type: str) -> None:
    """mlx-lm's sanitize must turn the HF names back into the model's parameters."""
    import mlx.core as mx  # lazy: MLX only when computing

    if not hasattr(model, "sanitize"):
        if hf != params:
            raise FormatError(f"the hf layout is not known for model_type {model_type!r}",
                              hint="use layout='mlx'")
        return
    lazy = {n: mx.zeros(s, dtype=mx.bfloat16) for n, s in hf}  # never evaluated
    try:
        back = {k: tuple(v.shape) for k, v in model.sanitize(lazy).items()}
    except Exception as e:  # sanitize of an unknown family: say so plainly
        raise FormatError(f"the hf layout is not known for model_type {model_type!r} "
                          f"({type(e).__name__}: {e})", hint="use layout='mlx'") from None
    if back != dict(params):
        diff = sorted(set(back) ^ {n for n, _ in params})[:3]
        raise FormatError(f"the hf layout is not known for model_type {model_type!r}",
                          found=f"names that do not load back: {diff}", hint="use layout='mlx'")


def plan_checkpoint(config: Mapping[str, Any], layout: str = "mlx"
                    ) -> List[Tuple[str, Tuple[int, ...]]]:
    """Every tensor (name, shape) of a checkpoint of ``config``, in save order.

    >>> plan_checkpoint(PRESETS["qwen3-1.7b"])[0]
    ('model.embed_tokens.weight', (151936, 2048))
    """
    from mlx.utils import tree_flatten  # lazy: MLX only when computing

    if layout not in ("mlx", "hf"):
        raise FormatError("unknown layout", expected="mlx or hf", found=repr(layout))
    model = _model(dict(config))
    params = [(k, tuple(v.shape)) for k, v in tree_flatten(model.parameters())]
    if layout == "hf":
        return _hf_names(model, params, str(config.get("model_type")))
    return params

