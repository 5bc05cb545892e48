"""Where a synthetic adapter goes: the adapted modules of a checkpoint, in both namings."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import numpy as np

from ..errors import AdapterError, FormatError
from ..io.adapters.naming import logical_shape
from ..io.formats.weights import weight_f64
from .presets import _KEY_ALIASES, _MIXTRAL

__all__ = []


@dataclass
class _Site:
    """One adapted module: where it is in both namings and its weight's shape."""

    module: str  # mlx-lm module path (stacked experts under switch_mlp)
    rel: str  # path inside the block, as mlx-lm's lora "keys" name it
    layer: int
    shape: Tuple[int, ...]  # (out, in), or (experts, out, in)
    expert_modules: Tuple[str, ...] = ()  # HF per-expert module paths (switch only)
    weights: Tuple[str, ...] = ()  # the checkpoint tensors holding the weight

    @property
    def switch(self) -> bool:
        return len(self.shape) == 3


def _layer_prefix(names: Sequence[str]) -> Tuple[str, int]:
    """("model.", number of layers) from tensor names like model.layers.3.xxx."""
    found: Dict[str, int] = {}
    for n in names:
        m = re.match(r"^(.*?)layers\.(\d+)\.", n)
        if m:
            found[m.group(1)] = max(found.get(m.group(1), -1), int(m.group(2)))
    if not found:
        raise FormatError("no transformer layers (…layers.N…) among the checkpoint's tensors")
    prefix = max(found, key=lambda p: found[p])
    return prefix, found[prefix] + 1


def _expert_rel(rel: str, e: int) -> str:
    head, proj = rel.split(".switch_mlp.", 1)
    if head.endswith("block_sparse_moe"):
        proj = _MIXTRAL.get(proj, proj)
    return f"{head}.experts.{e}.{proj}"


def _find_sites(ck, layers: Sequence[int], keys: Sequence[str], prefix: str) -> List[_Site]:
    sites: List[_Site] = []
    errors: List[str] = []
    for i in layers:
        base = f"{prefix}layers.{i}."
        for key in keys:
            site = None
            for rel in _KEY_ALIASES.get(key, (key,)):
                mod = base + rel
                if f"{mod}.weight" in ck.tensors:
                    shape = tuple(logical_shape(ck, mod))
                    experts: Tuple[str, ...] = ()
                    if len(shape) == 3:
                        experts = tuple(base + _expert_rel(rel, e) for e in range(shape[0]))
                    site = _Site(mod, rel, i, shape, experts, (f"{mod}.weight",))
                    break
                if ".switch_mlp." in rel and f"{base}{_expert_rel(rel, 0)}.weight" in ck.tensors:
                    experts = []
                    while f"{base}{_expert_rel(rel, len(experts))}.weight" in ck.tensors:
                        experts.append(base + _expert_rel(rel, len(experts)))
                    shape = (len(experts),) + tuple(logical_shape(ck, experts[0]))
                    site = _Site(mod, rel, i, shape, tuple(experts),
                                 tuple(f"{m}.weight" for m in experts))
                    break
            if site is None:
                tried = ", ".join(base + r for r in _KEY_ALIASES.get(key, (key,)))
                errors.append(f"  layer {i}: key {key!r} matches no weight (tried {tried})")
            else:
                sites.append(site)
    if errors:
        raise AdapterError(f"{len(errors)} adapter target(s) not in the checkpoint:\n"
                           + "\n".join(errors[:20]) + ("\n  ..." if len(errors) > 20 else ""),
                           file=ck.path, expected="keys among q, k, v, o, gate, up, down or "
                           "module paths inside a block (self_attn.q_proj)")
    return sites


def _row_norms(ck, site: _Site) -> np.ndarray:
    """Row norms of the base weight in f32 ((experts,) out), as DoRA's magnitude starts."""
    norms = []
    for t in site.weights:
        w = weight_f64(ck, t).astype(np.float32)  # dequantized when packed
        norms.append(np.sqrt(np.einsum("...ij,...ij->...i", w, w, dtype=np.float64))
                     .astype(np.float32))
    res = np.stack(norms) if len(norms) > 1 else norms[0]
    return res[None] if site.switch and res.ndim == 1 else res
