"""Writing a synthetic checkpoint: shards of random tensors, config.json and a tokenizer."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple, Union

import numpy as np

from .. import numerics as nm
from ..errors import FormatError, PathLike
from ..io.formats.safetensors import TensorSpec
from ..io.outputs.directory import SYNTH_MARK, OutputDirectory, check_output_path
from ..io.outputs.safetensors_write import SafetensorsWriter
from ..progress import progress_bar
from .planning import parse_size, plan_checkpoint, resolve_config
from .sampler import _fill_kind, _Sampler
from .tokenizer import write_tokenizer

__all__ = ["synth_checkpoint"]

_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def synth_checkpoint(path: PathLike, preset_or_config: Union[str, PathLike, Mapping[str, Any]],
                     *, layout: str = "mlx", dtype: str = "bfloat16",
                     shard_size: Union[int, str] = "2GB", seed: int = 0, std: float = 0.02,
                     overrides: Optional[Mapping[str, Any]] = None, force: bool = False,
                     progress: bool = True) -> Path:
    """Write a random checkpoint with a real model's tensor names, shapes and files;
    returns the output directory.

    ``preset_or_config``: a name from :data:`PRESETS`, a config.json (or its directory)
    or a dict, with ``overrides`` applied. ``layout``: ``"mlx"`` (MoE experts stacked
    under ``switch_mlp``, always an index) or ``"hf"`` (one tensor per expert, an index
    only for several shards). ``shard_size``: bytes or ``"2GB"`` (mlx-lm's rule). The
    same ``seed`` writes the same bytes. ``force`` replaces only a lorakit output.
    """
    if dtype not in _DTYPES:
        raise FormatError("unsupported dtype", expected=" / ".join(_DTYPES), found=repr(dtype))
    limit = parse_size(shard_size)
    name, config = resolve_config(preset_or_config, overrides)
    plan = plan_checkpoint(config, layout)
    code = _DTYPES[dtype]
    out = check_output_path(path, protected=[], force=force, allow_empty=True)
    with OutputDirectory(out, force=force, allow_empty=True, mark=SYNTH_MARK) as od:
        _write_checkpoint(od.tmp, plan, code, limit, seed, std, layout, progress, name)
        config["torch_dtype"] = dtype
        write_tokenizer(od.tmp, config)  # may move bos/eos ids: before config.json
        _write_config(od.tmp, config, layout)
        od.commit("synth-checkpoint", {"model": name, "layout": layout, "dtype": dtype,
                                       "seed": seed, "std": std})
    return out


def _write_checkpoint(tmp: Path, plan: List[Tuple[str, Tuple[int, ...]]], code: str, limit: int,
                      seed: int, std: float, layout: str, progress: bool, name: str) -> None:
    planned = [TensorSpec(n, code, s) for n, s in plan]
    shards: List[List[TensorSpec]] = []
    size = 0
    for p in planned:  # a new shard where the next tensor would pass the limit
        if not shards or size + p.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += p.nbytes
    files = ([f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
             if len(shards) > 1 else ["model.safetensors"])
    sampler = _Sampler(code, std, seed)
    meta = {"format": "mlx" if layout == "mlx" else "pt", "lorakit_synth": f"{name} seed={seed}"}
    total = sum(p.nbytes for p in planned)
    weight_map: Dict[str, str] = {}
    with progress_bar(progress, total, "synth") as bar:
        for file, shard in zip(files, shards):
            with SafetensorsWriter(tmp / file, shard, meta) as w:
                for p in shard:
                    numel = p.nbytes // nm.float_format(code).itemsize
                    chunks = sampler.chunks(p.name, numel, _fill_kind(p.name, p.shape))
                    w.write_chunks(p.name, _counted(chunks, bar))
                    weight_map[p.name] = file
    if len(files) > 1 or layout == "mlx":  # mlx-lm writes an index even for one shard
        meta_index: Dict[str, Any] = {"total_size": total}
        if layout == "mlx":
            meta_index["total_parameters"] = total // nm.float_format(code).itemsize
        index = {"metadata": meta_index, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))


def _counted(chunks: Iterator[np.ndarray], bar) -> Iterator[np.ndarray]:
    for c in chunks:
        yield c
        bar.update(c.nbytes)


def _write_config(tmp: Path, config: Dict[str, Any], layout: str) -> None:
    if layout == "mlx":  # mlx-lm's save_config: keys sorted, indent 4
        (tmp / "config.json").write_text(json.dumps(dict(sorted(config.items())), indent=4))
        return
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
    gen["transformers_version"] = config.get("transformers_version", "4.51.0")
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
