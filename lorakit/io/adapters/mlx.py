"""mlx-lm adapters (``adapters.safetensors`` + ``adapter_config.json``), read as mlx-lm runs them.

mlx-lm puts LoRA layers on the last ``num_layers`` blocks (``<= 0``: all), on the modules
``lora_parameters.keys`` names (or every Linear / Embedding / SwitchLinear when absent),
at rank ``lora_parameters.rank``, and refuses a file holding any other tensor. lorakit
refuses the same files, every offending tensor listed: :func:`load_mlx` the blocks out
of range, :func:`check_layer_scope` the modules outside ``keys`` once the base is known.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Dict, FrozenSet, List, Optional, Tuple

import numpy as np

from ...errors import AdapterError
from .base import (
    CONFIG,
    EMBEDDING_HINTS,
    MLX_WEIGHTS,
    Adapter,
    AdapterTensors,
    LoraTarget,
    bad_config,
    check_magnitude,
    number,
    problems,
    whole,
)

__all__ = []

#: ``<prefix>.<layer index>.<path inside the block>``: the first numbered segment is
#: the block index in ``model.layers`` (``model.layers.3.mlp.switch_mlp.up_proj``).
_IN_LAYER = re.compile(r"^(.+?)\.(\d+)\.(.+)$")
_LEAVES = ("lora_a", "lora_b", "m")


@dataclass(frozen=True)
class MlxScope:
    """Which modules mlx-lm puts LoRA layers on: ``num_layers`` (``<= 0``: every block) and
    ``lora_parameters.keys`` (None: every Linear/Embedding/SwitchLinear)."""

    num_layers: int
    keys: Optional[FrozenSet[str]]

    def first_layer(self, n_layers: int) -> int:
        """Index of the first adapted block of a model with ``n_layers`` blocks."""
        return max(n_layers - self.num_layers, 0) if self.num_layers > 0 else 0

    def refusal(self, module: str, n_layers: Optional[int], keys: bool = True
                ) -> Optional[str]:
        """Why mlx-lm puts no LoRA layer on ``module`` (None: it does, or may) in a model of
        ``n_layers`` blocks; ``keys=False`` checks only the block index.

        >>> MlxScope(2, frozenset({"self_attn.q_proj"})).refusal(
        ...     "model.layers.1.self_attn.q_proj", 8)
        'layer 1 is not among the last 2 layers (num_layers=2 in adapter_config.json; adapted: layers 6..7)'
        """
        if self.keys is not None and module in self.keys:
            return None  # a whole path in keys: mlx-lm adapts it wherever it is
        m = _IN_LAYER.match(module)
        if not keys and (m is None or (self.keys is not None and m.group(3) not in self.keys)):
            return None
        if m is None:
            return ("outside model.layers, and lora_parameters.keys does not name it "
                    "in full" if self.keys is not None else
                    "outside model.layers (without lora_parameters.keys mlx-lm adapts "
                    "only modules inside the last num_layers blocks)")
        if self.keys is not None and m.group(3) not in self.keys:
            return f"{m.group(3)!r} is not in lora_parameters.keys"
        if n_layers is not None and int(m.group(2)) >= n_layers:
            return f"layer {m.group(2)} is past the model's last layer {n_layers - 1}"
        if n_layers is not None and int(m.group(2)) < self.first_layer(n_layers):
            return (f"layer {m.group(2)} is not among the last {self.num_layers} layers "
                    f"(num_layers={self.num_layers} in adapter_config.json; adapted: layers "
                    f"{self.first_layer(n_layers)}..{n_layers - 1})")
        return None


@dataclass(frozen=True)
class _Plan:
    """One module's tensors, checked from the header, before any data is read."""

    module: str
    kind: str
    names: Tuple[str, ...]
    has_m: bool


def mlx_settings(cfg: Dict[str, Any], cfg_path: Path) -> Tuple[str, float, int, MlxScope]:
    """(fine_tune_type, scale, rank, scope) from an mlx-lm adapter config, each checked."""
    bad = partial(bad_config, cfg_path)
    # mlx-lm before fine_tune_type (0.19) marked DoRA with "use_dora": true
    ftype = cfg.get("fine_tune_type") or ("dora" if cfg.get("use_dora") is True else "lora")
    if ftype not in ("lora", "dora"):
        raise bad("fine_tune_type", "unsupported fine_tune_type", "lora or dora",
                  ftype, "a 'full' fine-tune holds whole weights, not an adapter", None)
    params = cfg.get("lora_parameters")
    if not isinstance(params, dict):
        raise bad("lora_parameters", "adapter config has no lora_parameters",
                  '"lora_parameters": {"rank": ..., "scale": ...}', params)
    scale = number(params.get("scale"))
    if scale is None:
        hint = " (mlx-lm uses 'scale', not 'alpha')" if "alpha" in params else ""
        raise bad("lora_parameters.scale",
                  "lora_parameters.scale missing or not a number" + hint,
                  "a finite number", params.get("scale"))
    rank = whole(params.get("rank"))
    if rank is None:
        raise bad("lora_parameters.rank",
                  "lora_parameters.rank missing or not a positive integer",
                  "a positive integer (the rank mlx-lm builds each LoRA layer with)",
                  params.get("rank"))
    # mlx-lm reads num_layers; its releases before 0.19 wrote the same as lora_layers
    key = "num_layers" if "num_layers" in cfg or "lora_layers" not in cfg else "lora_layers"
    n = cfg.get(key)
    if type(n) is not int:
        raise bad(key, f"{key} missing or not an integer",
                  "an integer: how many of the last layers carry LoRA (-1: all)", n)
    keys = params.get("keys")
    if keys is not None and not (isinstance(keys, list)
                                 and all(isinstance(k, str) and k for k in keys)):
        raise bad("lora_parameters.keys",
                  "lora_parameters.keys must be a list of module paths",
                  '["self_attn.q_proj", ...] or absent', keys)
    dropout = params.get("dropout", 0.0)
    p = number(dropout)
    if p is None or not 0 <= p < 1:
        raise bad("lora_parameters.dropout",
                  "lora_parameters.dropout is not a probability", "a number in [0, 1)",
                  dropout)
    return ftype, float(scale), rank, MlxScope(n, frozenset(keys) if keys is not None else None)


def _group(names: List[str]) -> Tuple[Dict[str, Dict[str, str]], List[str]]:
    """Tensor names by module and leaf, and a problem line per name that is not LoRA."""
    groups: Dict[str, Dict[str, str]] = {}
    errors: List[str] = []
    for name in names:
        module, _, leaf = name.rpartition(".")
        if leaf not in _LEAVES or not module:
            errors.append(f"  {name}: not a LoRA tensor (expected <module>.lora_a/.lora_b/.m, "
                          f"found .{leaf})")
            continue
        groups.setdefault(module, {})[leaf] = name
    return groups, errors


def _scope_errors(groups: Dict[str, Dict[str, str]], scope: MlxScope,
                  n_layers: Optional[int]) -> List[str]:
    """A line per tensor mlx-lm would refuse as "not an adapter parameter in the model";
    ``n_layers`` None: the smallest model holding every block named (block indices only)."""
    keys = n_layers is not None
    if n_layers is None:
        idx = [int(m.group(2)) for m in map(_IN_LAYER.match, groups) if m]
        n_layers = max(idx) + 1 if idx else None
    out = []
    for module, leaves in groups.items():
        why = scope.refusal(module, n_layers, keys)
        if why:
            out += [f"  {n}: not an adapter parameter in the model: {why}"
                    for n in leaves.values()]
    return out


def _plan(module: str, leaves: Dict[str, str], ts: AdapterTensors, ftype: str,
          rank: int) -> Tuple[Optional[_Plan], Optional[str]]:
    """Check one module's tensors from the header: (plan, None) or (None, problem line)."""
    if "lora_a" not in leaves or "lora_b" not in leaves:
        return None, (f"  {module}: has {sorted(leaves)} but needs both lora_a and lora_b "
                      f"(expected lora_a and lora_b, found {', '.join(sorted(leaves))})")
    for n in leaves.values():
        ts.check_float(n)
    a, b = ts.infos[leaves["lora_a"]].shape, ts.infos[leaves["lora_b"]].shape
    found = f"lora_a {list(a)}, lora_b {list(b)}"
    if len(a) == 3 and len(b) == 3:  # SwitchLinear: a (E, r, in), b (E, out, r)
        kind, ok, r, out = "switch", a[0] == b[0] and a[1] == b[2], a[1], tuple(b[:2])
        want = "lora_a (experts, r, in) and lora_b (experts, out, r)"
    elif len(a) == 2 and len(b) == 2:
        # Linear: a (in, r), b (r, out); Embedding: a (vocab, r), b (r, dims).
        kind = "embedding" if module.rsplit(".", 1)[-1] in EMBEDDING_HINTS else "linear"
        ok, r = a[1] == b[0], a[1]
        out = (b[1],) if kind == "linear" else (a[0],)
        want = "lora_a (in, r) and lora_b (r, out) with the same r"
    else:
        kind, ok, r, out = "", False, 0, ()
        found = f"lora_a {len(a)}-D, lora_b {len(b)}-D"
        want = "both 2-D (Linear/Embedding) or both 3-D (SwitchLinear)"
    if not ok:
        return None, (f"  {module}: rank mismatch between lora_a and lora_b: "
                      f"expected {want}, found {found}")
    if r != rank:
        return None, (f"  {module}: rank {r} in the tensors but {rank} in "
                      f"adapter_config.json (lora_parameters.rank): expected rank {rank}, found {r}")
    m = leaves.get("m")
    if m is not None and ftype != "dora":
        return None, (f"  {m}: DoRA magnitude in an adapter whose fine_tune_type is {ftype!r} "
                      f"(expected 'dora', found {ftype!r})")
    if ftype == "dora" and m is None:
        return None, (f"  {module}: fine_tune_type is dora but {module}.m is missing "
                      f"(expected a DoRA magnitude, found none)")
    if ftype == "dora" and kind == "switch":
        return None, (f"  {module}: mlx-lm has no DoRA for SwitchLinear (MoE experts) "
                      f"(expected fine_tune_type lora, found dora)")
    if m is not None:
        bad = check_magnitude(m, ts.infos[m].shape, out)
        if bad:
            return None, bad
    return _Plan(module, kind, tuple(leaves.values()), m is not None), None


def _target(p: _Plan, ts: AdapterTensors, scale: float) -> LoraTarget:
    """Read one planned module's tensors and orient them as ``delta = scale * B @ A``."""
    a = ts.read_f32(f"{p.module}.lora_a")
    b = ts.read_f32(f"{p.module}.lora_b")
    m = ts.read_f32(f"{p.module}.m") if p.has_m else None
    if p.kind == "linear":
        A, B = a.T, b.T
    elif p.kind == "embedding":
        A, B = b, a
    else:
        A, B = a, b
    return LoraTarget(p.module, p.kind, np.ascontiguousarray(A), np.ascontiguousarray(B),
                      scale, m, p.names)


def load_mlx(path: Path, cfg: Dict[str, Any], file: Optional[Path] = None) -> Adapter:
    """Read an mlx-lm adapter directory whose config is ``cfg``, every tensor checked from
    the header before any is read."""
    cfg_path = path / CONFIG
    file = file or path / MLX_WEIGHTS
    ftype, scale, rank, scope = mlx_settings(cfg, cfg_path)
    ts = AdapterTensors(file)
    groups, errors = _group(ts.names)
    errors += _scope_errors(groups, scope, None)
    plans: List[_Plan] = []
    for module, leaves in groups.items():
        plan, err = _plan(module, leaves, ts, ftype, rank)
        if err:
            errors.append(err)
        elif plan:
            plans.append(plan)
    if errors:
        raise problems(file, errors, "<module>.lora_a (in, r) and .lora_b (r, out) per module"
                       + (", and .m (out,)" if ftype == "dora" else "")
                       + " for the modules mlx-lm adapts (num_layers, lora_parameters.keys of "
                       "adapter_config.json)",
                       hint="mlx-lm's load_adapters refuses this file too (\"contains "
                       "incompatible tensors\")" if any("adapter parameter" in e
                                                        for e in errors) else None)
    if not plans:
        raise AdapterError("adapter holds no LoRA tensors", file=file,
                           expected="<module>.lora_a / .lora_b tensors", found="none")
    targets = [_target(p, ts, scale) for p in plans]
    return Adapter(path, "mlx-lm", targets, cfg, file, ftype)


def check_layer_scope(adapter: Adapter, n_layers: int, *, source: Optional[str] = None,
                      conflict: Optional[str] = None) -> None:
    """Refuse an mlx-lm adapter with tensors for blocks mlx-lm leaves alone in a model of
    ``n_layers`` blocks (``source``: where that came from; ``conflict``: how the model's
    config disagrees with its tensors)."""
    if adapter.format != "mlx-lm":
        return
    _, _, _, scope = mlx_settings(adapter.config, adapter.path / CONFIG)
    groups = {t.module: {n.rpartition(".")[2]: n for n in t.names} for t in adapter.targets}
    errors = _scope_errors(groups, scope, n_layers)
    if errors:
        raise problems(adapter.weights_file, errors,
                       f"tensors only for the last {scope.num_layers} of the model's "
                       f"{n_layers} layers (num_layers={scope.num_layers} in "
                       f"{adapter.path / CONFIG}; the model's layers: "
                       f"{source or 'from its config.json'})", "tensor(s) mlx-lm would refuse",
                       hint=(f"the model's config disagrees with its own tensors ({conflict}): "
                             "is config.json from another model?" if conflict else
                             "mlx-lm's load_adapters refuses this adapter on this model "
                             "(\"contains incompatible tensors\"); was it trained on another "
                             "model?"))
