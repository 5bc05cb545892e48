"""The transformers (per-expert) layout of a fused MoE checkpoint.

mlx-lm stacks a MoE layer's experts (``...mlp.switch_mlp.up_proj.weight``, ``[E, out, in]``);
transformers reads only per-expert names and, given the stack, silently runs on random
experts. :func:`to_transformers` rewrites written shards into the per-expert layout, the
exact inverse of each family's ``sanitize()`` (bit-identical), which mlx-lm reads too.

>>> FAMILIES["qwen3_moe"].name("model.layers.1.mlp.switch_mlp.down_proj.weight", 0)
'model.layers.1.mlp.experts.0.down_proj.weight'
"""
from __future__ import annotations

import json
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Tuple

from ...errors import FuseError
from ..formats.safetensors import TensorSpec, read_header, read_raw
from .safetensors_write import SafetensorsWriter

__all__ = ["check_layout", "is_stacked", "layout_note", "to_transformers"]

_STACKED = re.compile(r"^(?P<pre>.*\.)(?P<block>mlp|block_sparse_moe)\.switch_mlp\."
                      r"(?P<proj>gate_proj|up_proj|down_proj)\.(?P<leaf>weight|bias)$")


@dataclass(frozen=True)
class Family:
    """One model family's per-expert names, as its mlx-lm ``sanitize()`` reads them."""

    block: str  # the MoE module's name: mlp | block_sparse_moe
    experts_key: str  # the config key holding the number of experts
    proj: Mapping[str, str] = field(default_factory=lambda: {
        "gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"})

    def name(self, stacked: str, e: int) -> str:
        """The per-expert tensor name of expert ``e`` of a stacked tensor."""
        m = _STACKED.match(stacked)
        if m is None or m["block"] != self.block:
            raise FuseError("not a stacked expert tensor of this family", tensor=stacked,
                            expected=f"...{self.block}.switch_mlp.<proj>.weight", found=stacked)
        return f"{m['pre']}{self.block}.experts.{e}.{self.proj[m['proj']]}.{m['leaf']}"


_MIXTRAL = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
#: the MoE families mlx-lm and transformers both have, each read from its mlx-lm
#: ``sanitize()`` (mlx_lm/models/<family>.py), which this layout inverts exactly
FAMILIES: Dict[str, Family] = {
    "qwen3_moe": Family("mlp", "num_experts"),
    "qwen2_moe": Family("mlp", "num_experts"),
    "olmoe": Family("mlp", "num_experts"),
    "mixtral": Family("block_sparse_moe", "num_local_experts", _MIXTRAL),
    "phimoe": Family("block_sparse_moe", "num_local_experts", _MIXTRAL),
}

#: which layout a fuse wrote, and who reads it (the fuse report's "layout" line)
LAYOUT_NOTES = {
    "mlx-lm": "mlx-lm's stacked switch_mlp experts: read by mlx-lm; transformers would "
              "load it with the experts missing (use layout='transformers' for it)",
    "transformers": "transformers' per-expert tensors (experts.N): read by transformers "
                    "and by mlx-lm (its sanitize() stacks them on load)",
}


def is_stacked(name: str) -> bool:
    """True for a tensor of mlx-lm's stacked expert layout."""
    return _STACKED.match(name) is not None


def _model_type(config: Mapping) -> str:
    return str(config.get("model_type", ""))


def check_layout(layout: str, config: Mapping, names: List[str], path: Path,
                 quantized: bool) -> None:
    """Refuse, before any work, a transformers layout lorakit cannot write exactly."""
    stacked = [n for n in names if is_stacked(n)]
    if layout != "transformers" or not stacked:
        return
    mt = _model_type(config)
    fam = FAMILIES.get(mt)
    if fam is None:
        raise FuseError("no transformers layout is known for this MoE family",
                        file=path / "config.json", tensor=stacked[0],
                        expected="model_type one of " + ", ".join(FAMILIES),
                        found=f"model_type {mt!r}")
    if quantized:
        raise FuseError("the transformers layout needs float weights (transformers does not "
                        "read MLX's quantized experts)", file=path, tensor=stacked[0],
                        expected="--dequantize (or a float base)", found="quantized experts")
    n = config.get(fam.experts_key)
    if not isinstance(n, int) or n < 1:
        raise FuseError("the number of experts is missing from the config",
                        file=path / "config.json", expected=f"{fam.experts_key}: an integer",
                        found=repr(n))
    bad = [s for s in stacked if _STACKED.match(s)["block"] != fam.block]
    if bad:
        raise FuseError(f"a stacked expert tensor outside {mt}'s MoE block",
                        file=path, tensor=bad[0], expected=f"...{fam.block}.switch_mlp...",
                        found=bad[0])


def layout_note(layout: str, names: List[str]) -> str:
    """The fuse report's line: which layout was written and who reads it ("" for a model
    without experts, whose one layout both read)."""
    if not any(is_stacked(n) or ".experts." in n for n in names):
        return ""
    return LAYOUT_NOTES[layout]


def to_transformers(folder: Path, config: Mapping, index_name: str
                    ) -> Tuple[List[str], Counter, int]:
    """Rewrite the shards of a written checkpoint in ``folder`` (a fuse's temporary
    output, never a user's file) from mlx-lm's stacked layout to the per-expert one.

    Each stacked ``[E, ...]`` tensor becomes E tensors of shape ``[...]``, expert ``e``
    holding row ``e``'s bytes; every other tensor is copied as bytes; the index's weight
    map is rewritten. Returns the tensor names written, their dtypes and the bytes.
    """
    fam = FAMILIES[_model_type(config)]
    n_experts = config[fam.experts_key]
    names: List[str] = []
    dtypes: Counter = Counter()
    weight_map: Dict[str, str] = {}
    total = 0
    shards = sorted(p for p in folder.iterdir() if p.suffix == ".safetensors")
    for shard in shards:
        h = read_header(shard)
        plan: List[TensorSpec] = []
        for info in h.tensors.values():
            if is_stacked(info.name):
                if len(info.shape) < 2 or info.shape[0] != n_experts:
                    raise FuseError("a stacked expert tensor does not have one row per expert",
                                    file=shard, tensor=info.name,
                                    expected=f"[{n_experts}, ...] ({fam.experts_key})",
                                    found=str(list(info.shape)))
                plan += [TensorSpec(fam.name(info.name, e), info.dtype, tuple(info.shape[1:]))
                         for e in range(n_experts)]
            else:
                plan.append(TensorSpec(info.name, info.dtype, tuple(info.shape)))
        tmp = shard.with_name(shard.name + ".layout")
        with SafetensorsWriter(tmp, plan, dict(h.metadata)) as w:
            for info in h.tensors.values():
                if is_stacked(info.name):
                    for e in range(n_experts):
                        raw = read_raw(info, slice(e, e + 1))
                        w.write(fam.name(info.name, e), raw.reshape(raw.shape[1:]))
                else:
                    w.copy(info.name, info)
        os.replace(tmp, shard)
        for spec in plan:
            names.append(spec.name)
            dtypes[spec.dtype] += 1
            weight_map[spec.name] = shard.name
        total += shard.stat().st_size
    index = folder / index_name
    if index.exists():
        with open(index, "w") as f:
            json.dump({"metadata": {"total_size": total},
                       "weight_map": dict(sorted(weight_map.items()))}, f, indent=4)
    return names, dtypes, total

