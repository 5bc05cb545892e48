"""How one in-memory adapter is laid out in each format: pure helpers for the writer.

PEFT's ``lora_alpha`` for a scale (:func:`alpha_for`, exact in float64 or none), mlx-lm's
stacked MoE experts split per expert and back (:func:`expert_modules`, :func:`restack`),
and mlx-lm's ``num_layers`` / ``lora_parameters.keys`` for a set of modules.

>>> alpha_for(20.0, 8), alpha_for(0.1, 3)
(160, None)
"""
from __future__ import annotations

import math
import re
from dataclasses import replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from ...errors import AdapterError
from .base import LoraTarget

__all__ = ["expert_modules"]

#: Mixtral names its experts' projections w1/w2/w3 (mlx-lm: gate/down/up_proj).
MIXTRAL = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
_MIXTRAL_BACK = {v: k for k, v in MIXTRAL.items()}
_EXPERT = re.compile(r"^(.*)\.experts\.(\d+)\.([^.]+)$")
_IN_LAYER = re.compile(r"^(.+?)\.(\d+)\.(.+)$")


def alpha_for(scale: float, rank: int) -> Union[int, float, None]:
    """A ``lora_alpha`` with ``alpha / rank == scale`` exactly in float64 (an int when
    whole, as PEFT writes it; ``scale * rank`` first, then its neighbours 4 ulps either
    way), or None."""
    if not (math.isfinite(scale) and scale > 0):
        return None
    cands = [float(scale) * rank]
    lo = hi = cands[0]
    for _ in range(4):
        lo, hi = math.nextafter(lo, -math.inf), math.nextafter(hi, math.inf)
        cands += [lo, hi]
    for a in cands:
        if a > 0 and math.isfinite(a) and a / rank == scale:
            return int(a) if a.is_integer() and abs(a) < 2 ** 53 else a
    return None


def expert_modules(switch_module: str, experts: int) -> List[str]:
    """The per-expert module paths of an mlx-lm stacked-expert module."""
    if ".switch_mlp." not in switch_module:
        raise AdapterError("a stacked-experts target outside a switch_mlp module",
                           tensor=switch_module, expected="<block>.switch_mlp.<proj>",
                           found=switch_module)
    head, proj = switch_module.rsplit(".switch_mlp.", 1)
    if head.endswith("block_sparse_moe"):
        proj = MIXTRAL.get(proj, proj)
    return [f"{head}.experts.{e}.{proj}" for e in range(experts)]


def switch_parts(t: LoraTarget) -> List[LoraTarget]:
    """A PEFT ``target_parameters`` target (``<block>.experts.<param>``, 3-D) as mlx-lm's
    ``switch_mlp`` modules: ``gate_up_proj`` (rows ``[gate; up]``, as transformers
    concatenates them) split into ``gate_proj`` and ``up_proj`` with the same A (exact);
    any other target as it is.

    >>> import numpy as np
    >>> t = LoraTarget("m.experts.gate_up_proj", "switch", np.ones((2, 1, 3)), np.ones((2, 4, 1)), 1.0)
    >>> [(p.module, p.shape) for p in switch_parts(t)]
    [('m.switch_mlp.gate_proj', (2, 2, 3)), ('m.switch_mlp.up_proj', (2, 2, 3))]
    """
    m = re.match(r"(.*)\.experts\.([A-Za-z_]\w*)$", t.module)
    if t.kind != "switch" or m is None:
        return [t]
    head, proj = m.groups()
    if proj != "gate_up_proj":
        return [replace(t, module=f"{head}.switch_mlp.{proj}")]
    h = t.B.shape[1] // 2
    return [replace(t, module=f"{head}.switch_mlp.{n}", B=t.B[:, rows])
            for n, rows in (("gate_proj", slice(0, h)), ("up_proj", slice(h, None)))]


def fused_experts(targets: Sequence[LoraTarget], fused: Callable[[str], bool]
                  ) -> List[LoraTarget]:
    """The inverse of :func:`switch_parts` where ``fused(name)`` says transformers' fused
    parameter is wanted: mlx-lm's ``<block>.mlp.switch_mlp.down_proj`` as
    ``experts.down_proj``, ``gate_proj`` and ``up_proj`` as one ``experts.gate_up_proj``
    of rank ``r_gate + r_up`` (A stacked, B block-diagonal: the same delta, exactly; a
    projection left out has zero factors). Targets of two scales stay as they are."""
    out: List[LoraTarget] = []
    pairs: Dict[str, Dict[str, LoraTarget]] = {}
    for t in targets:
        m = re.match(r"(.*\.mlp)\.switch_mlp\.(gate|up|down)_proj$", t.module)
        name = f"{m[1]}.experts.{'down' if m[2] == 'down' else 'gate_up'}_proj" if m else ""
        if t.kind != "switch" or not m or not fused(name):
            out.append(t)
        elif m[2] == "down":
            out.append(replace(t, module=name))
        else:
            pairs.setdefault(name, {})[m[2]] = t
    for name, g in pairs.items():
        one = next(iter(g.values()))
        zero = replace(one, A=np.zeros_like(one.A[:, :1]), B=np.zeros_like(one.B[:, :, :1]))
        gate, up = g.get("gate", zero), g.get("up", zero)
        if np.ndim(gate.scale) or np.ndim(up.scale) or gate.scale != up.scale:
            out += g.values()
            continue
        o, r = gate.B.shape[1], gate.rank
        B = np.zeros((gate.B.shape[0], o + up.B.shape[1], r + up.rank), gate.B.dtype)
        B[:, :o, :r], B[:, o:, r:] = gate.B, up.B
        A = np.concatenate([gate.A, up.A], axis=1)
        out.append(replace(gate, module=name, A=A, B=B, names=gate.names + up.names))
    return out


def param_wrappers(paths: Sequence[str]) -> Dict[str, str]:
    """PEFT ``target_parameters`` path -> the module path PEFT saves its LoRA under: one
    ParamWrapper per parameter of a module, nested in the order transformers declares
    them (gate/up before down), the first innermost.

    >>> param_wrappers(["m.experts.down_proj", "m.experts.gate_up_proj"])
    {'m.experts.gate_up_proj': 'm.experts.base_layer', 'm.experts.down_proj': 'm.experts'}
    """
    owners: Dict[str, List[str]] = {}
    for p in paths:
        owners.setdefault(p.rpartition(".")[0], []).append(p.rpartition(".")[2])
    out = {}
    for owner, names in owners.items():
        names.sort(key=lambda n: ("down" in n or n == "w2", n))
        for i, n in enumerate(names):
            out[f"{owner}.{n}"] = owner + ".base_layer" * (len(names) - 1 - i)
    return out


def switch_name(expert_module: str) -> Optional[Tuple[str, int]]:
    """(stacked mlx-lm module, expert index) of a per-expert module path, else None."""
    m = _EXPERT.match(expert_module)
    if m is None:
        return None
    head, e, proj = m.group(1), int(m.group(2)), m.group(3)
    if head.endswith("block_sparse_moe"):
        proj = _MIXTRAL_BACK.get(proj, proj)
    return f"{head}.switch_mlp.{proj}", e


def restack(modules: Sequence[str]) -> Dict[str, List[Tuple[int, str]]]:
    """Per-expert modules grouped under their stacked name: only groups that hold every
    expert 0..E-1 (a partial group stays per-expert: mlx-lm cannot hold it)."""
    groups: Dict[str, List[Tuple[int, str]]] = {}
    for m in modules:
        s = switch_name(m)
        if s is not None:
            groups.setdefault(s[0], []).append((s[1], m))
    out = {}
    for name, members in groups.items():
        members.sort()
        if [e for e, _ in members] == list(range(len(members))):
            out[name] = members
    return out


def mlx_scope(modules: Sequence[str], num_layers: Optional[int]) -> Tuple[int, List[str]]:
    """(num_layers, keys) under which mlx-lm puts a LoRA layer on each of ``modules``: the
    key of ``<prefix>.<i>.<rel>`` is ``rel``, elsewhere the whole path; ``num_layers`` None:
    from the highest block adapted down to the lowest."""
    keys: List[str] = []
    layers: List[int] = []
    for m in modules:
        g = _IN_LAYER.match(m)
        key = g.group(3) if g else m
        if g:
            layers.append(int(g.group(2)))
        if key not in keys:
            keys.append(key)
    if num_layers is None:
        num_layers = (max(layers) + 1 - min(layers)) if layers else -1
    return num_layers, sorted(keys)


def layer_gaps(modules: Sequence[str], num_layers: int) -> List[str]:
    """Modules mlx-lm would put a LoRA layer on (blocks of the scope, keys) that
    ``modules`` lacks, within the blocks the adapter itself names."""
    have = set(modules)
    idx: Dict[str, int] = {}
    rels = set()
    for m in modules:
        g = _IN_LAYER.match(m)
        if g:
            idx[g.group(1)] = max(idx.get(g.group(1), -1), int(g.group(2)))
            rels.add(g.group(3))
    out = []
    for prefix, top in idx.items():
        lo = top + 1 - num_layers if num_layers > 0 else 0
        for i in range(max(lo, 0), top + 1):
            out += [f"{prefix}.{i}.{r}" for r in sorted(rels) if f"{prefix}.{i}.{r}" not in have]
    return out
