"""Where each adapter target lands in a checkpoint.

A target lands on the same path plus ``.weight``, with a ``model.`` / ``language_model.``
prefix added or removed, or across the two MoE layouts (mlx-lm's stacked ``switch_mlp``
and the per-expert ``experts.{e}``, mixtral's ``w1``/``w2``/``w3``). Every target must
land somewhere with agreeing shapes; all problems come in one
:class:`~lorakit.errors.AdapterError`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

from ...errors import AdapterError
from ..formats.checkpoint import QuantParams
from ..formats.source import TensorSource
from .base import EMBEDDING_HINTS, Adapter, LoraTarget, Replacement
from .layout import MIXTRAL, fused_experts, switch_parts
from .load import check_runtime_scope

__all__ = ["Binding", "strip_prefix", "logical_shape", "bind", "bindings_by_tensor",
           "bind_replacements"]

#: transformers families whose fused experts are (experts, in, out) (``is_transposed``)
TRANSPOSED_EXPERTS = ("gpt_oss", "aria", "ergo", "openai_privacy_filter")
#: wrappers a module path may carry in one layout and not in another (longest first)
MODULE_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")


@dataclass(frozen=True)
class Binding:
    """One target (or one expert of it, ``target_expert``) landing on checkpoint weight
    ``tensor`` (or its slice ``weight_expert``); ``module`` is ``tensor`` without
    ``.weight``, ``shape`` the whole weight's dequantized shape, ``quant`` its packing."""

    target: LoraTarget
    tensor: str
    module: str
    shape: Tuple[int, ...]
    target_expert: Optional[int] = None
    weight_expert: Optional[int] = None
    quant: Optional[QuantParams] = None


def strip_prefix(module: str) -> str:
    """``module`` without its wrapper prefix (the first of :data:`MODULE_PREFIXES` it has).

    >>> strip_prefix("model.layers.0.mlp.up_proj"), strip_prefix("lm_head")
    ('layers.0.mlp.up_proj', 'lm_head')
    """
    for p in MODULE_PREFIXES:
        if module.startswith(p):
            return module[len(p):]
    return module


def _variants(module: str) -> Iterator[str]:
    yield module
    stripped = strip_prefix(module)
    if stripped != module:
        yield stripped
    for p in MODULE_PREFIXES:
        yield p + stripped


def logical_shape(ck: TensorSource, module: str) -> Tuple[int, ...]:
    """Shape of ``module.weight`` as a float matrix (unpacking quantized weights)."""
    info = ck.tensors[f"{module}.weight"]
    q = ck.quant_params(module)
    if q is None:
        return info.shape
    return tuple(info.shape[:-1]) + (info.shape[-1] * 32 // q.bits,)


def _find(ck: TensorSource, module: str, leaf: str = "weight") -> Optional[str]:
    """The checkpoint's spelling of ``module`` (prefixes added or removed) that holds
    ``module.leaf``, or None."""
    for v in _variants(module):
        if f"{v}.{leaf}" in ck.tensors:
            return v
    return None


def _unfit(adapter: Adapter, headline: str, errors: List[str], expected: str,
           parts: str) -> AdapterError:
    """One error listing every part of ``adapter`` (``parts``) that does not fit."""
    return AdapterError(headline + ":\n" + "\n".join(errors), file=adapter.weights_file,
                        expected=expected,
                        found=f"{len(errors)} {parts} that do not fit, listed above",
                        hint="check that the adapter was trained on this base model")


def _per_expert_modules(ck: TensorSource, module: str) -> Optional[List[str]]:
    """Per-expert modules for a stacked target, in expert order, if the checkpoint has them."""
    if ".switch_mlp." not in module:
        return None
    head, tail = module.split(".switch_mlp.", 1)
    candidates = [f"{head}.experts.{{e}}.{tail}"]
    if tail in MIXTRAL:
        candidates.append(f"{head}.experts.{{e}}.{MIXTRAL[tail]}")
    for pattern in candidates:
        mods: List[str] = []
        while (found := _find(ck, pattern.format(e=len(mods)))) is not None:
            mods.append(found)
        if mods:
            return mods
    return None


def _stacked_slice(ck: TensorSource, module: str) -> Optional[Tuple[str, int]]:
    """(stacked module, expert) for a per-expert target in a stacked checkpoint."""
    m = re.match(r"(.*)\.experts\.(\d+)\.(\w+)$", module)
    if not m:
        return None
    head, e, leaf = m.group(1), int(m.group(2)), m.group(3)
    leaf = {v: k for k, v in MIXTRAL.items()}.get(leaf, leaf)
    found = _find(ck, f"{head}.switch_mlp.{leaf}")
    return (found, e) if found else None


def bind(adapter: Adapter, ck: TensorSource) -> List[Binding]:
    """Land every target of ``adapter`` on ``ck``'s tensors, or raise one error listing
    every target that lands nowhere or whose shape disagrees; then check the adapter's own
    runtime rules (:func:`~lorakit.io.adapters.load.check_runtime_scope`) against ``ck``."""
    out: List[Binding] = []
    errors: List[str] = []
    tied = bool(ck.config.get("tie_word_embeddings", False))

    def shape_error(t: LoraTarget, tensor: str, want, found) -> None:
        errors.append(f"  {'/'.join(t.names) or t.module} -> {tensor}: adapter changes a "
                      f"weight of shape {list(want)} but the checkpoint's is {list(found)}")

    # experts land on transformers' fused 3-D parameters where the checkpoint has them,
    # else on switch_mlp's (or the per-expert tensors)
    targets = [p for t in fused_experts(adapter.targets, ck.tensors.__contains__)
               for p in ([t] if t.module in ck.tensors else switch_parts(t))]
    for t in targets:
        if t.module in ck.tensors:  # transformers' fused 3-D expert parameter
            shape = ck.tensors[t.module].shape
            if ck.model_type in TRANSPOSED_EXPERTS:
                errors.append(f"  {t.module}: {ck.model_type} stores its experts (experts, in, "
                              "out), where PEFT adds the delta transposed; merge it with PEFT")
            elif tuple(shape) != tuple(t.shape):
                shape_error(t, t.module, t.shape, shape)
            else:
                out.append(Binding(t, t.module, t.module, tuple(shape)))
            continue
        mod = _find(ck, t.module)
        if mod is not None:
            shape = logical_shape(ck, mod)
            if (t.kind != "switch" and len(shape) == 3) or tuple(shape) != tuple(t.shape):
                shape_error(t, f"{mod}.weight", t.shape, shape)
                continue
            out.append(Binding(t, f"{mod}.weight", mod, shape, quant=ck.quant_params(mod)))
            continue
        if t.kind == "switch":
            mods = _per_expert_modules(ck, t.module)
            if mods:
                if len(mods) != t.A.shape[0]:
                    errors.append(f"  {t.module}: adapter has {t.A.shape[0]} experts, "
                                  f"checkpoint has {len(mods)}")
                    continue
                for e, m in enumerate(mods):
                    shape = logical_shape(ck, m)
                    if tuple(shape) != tuple(t.shape[1:]):
                        shape_error(t, f"{m}.weight", t.shape[1:], shape)
                        break
                    out.append(Binding(t, f"{m}.weight", m, shape, target_expert=e,
                                       quant=ck.quant_params(m)))
                continue
        else:
            sl = _stacked_slice(ck, t.module)
            if sl is not None:
                m, e = sl
                shape = logical_shape(ck, m)
                if len(shape) != 3 or e >= shape[0] or tuple(shape[1:]) != tuple(t.shape):
                    shape_error(t, f"{m}.weight[{e}]", t.shape, shape)
                    continue
                out.append(Binding(t, f"{m}.weight", m, shape, weight_expert=e,
                                   quant=ck.quant_params(m)))
                continue
        hint = ""
        if t.module.endswith("lm_head") and tied:
            hint = (" (the head is tied to the embedding in this model: adapt "
                    "embed_tokens instead, which changes both)")
        errors.append(f"  {'/'.join(t.names) or t.module}: no tensor "
                      f"{t.module}.weight in the checkpoint{hint}")
    errors += _reached_twice(out)
    if errors:
        raise _unfit(adapter, f"adapter does not fit the checkpoint: {len(errors)} of "
                     f"{len(adapter.targets)} targets unmatched or mismatched", errors,
                     f"targets of a {ck.model_type} model at {ck.path}", "target(s)")
    check_runtime_scope(adapter, ck)
    return out


def _reached_twice(bindings: List[Binding]) -> List[str]:
    """One line per checkpoint weight (or expert of a stack) that two targets reach (the
    same module spelled twice: which one a fuse should apply is not defined)."""
    seen: Dict[Tuple[str, Optional[int]], Binding] = {}
    lines = []
    for b in bindings:
        key = (b.tensor, b.weight_expert)
        if key in seen:
            first = seen[key].target
            where = b.tensor + (f"[{b.weight_expert}]" if b.weight_expert is not None else "")
            lines.append(f"  {'/'.join(first.names) or first.module} and "
                         f"{'/'.join(b.target.names) or b.target.module}: both reach {where} "
                         f"(the same module spelled twice)")
        else:
            seen[key] = b
    return lines


def bindings_by_tensor(bindings: List[Binding]) -> Dict[str, List[Binding]]:
    """Group bindings per checkpoint weight (several when experts land in one stack)."""
    g: Dict[str, List[Binding]] = {}
    for b in bindings:
        g.setdefault(b.tensor, []).append(b)
    return g


def bind_replacements(adapter: Adapter, ck: TensorSource, dequantize: bool = False
                      ) -> Dict[str, Replacement]:
    """Checkpoint tensor name -> the adapter's whole replacement for it (PEFT
    ``modules_to_save``), or one error listing every copy that does not fit (no such
    tensor, another shape, a quantized module unless ``dequantize``)."""
    out: Dict[str, Replacement] = {}
    errors: List[str] = []
    tied = bool(ck.config.get("tie_word_embeddings", False))
    for r in adapter.replacements:
        mod = _find(ck, r.module, r.leaf)
        if mod is None and tied and r.module.endswith("lm_head") and any(
                o.module.endswith(EMBEDDING_HINTS) and o.rows is None and o.code == r.code
                and np.array_equal(o.raw, r.raw) for o in adapter.replacements):
            continue  # the tied head's copy is the embedding's (mergekit's extract writes both)
        if mod is None:
            hint = (" (the head is tied to the embedding in this model, and the copy is not "
                    "the embedding's copy)"
                    if r.module.endswith("lm_head") and tied else "")
            errors.append(f"  {r.name}: no tensor {r.module}.{r.leaf} in the checkpoint{hint}")
            continue
        tensor = f"{mod}.{r.leaf}"
        q = ck.quant_params(mod)
        if q is not None and r.leaf == "weight" and not dequantize:
            errors.append(f"  {r.name} -> {tensor}: the checkpoint's weight is quantized "
                          f"(expected a float weight, found {q.bits}-bit codes; fuse with "
                          f"--dequantize to write it in float)")
            continue
        shape = logical_shape(ck, mod) if r.leaf == "weight" else ck.tensors[tensor].shape
        want = (len(r.rows),) + tuple(shape[1:]) if r.rows else tuple(shape)
        if want != tuple(r.raw.shape) or (r.rows and max(r.rows) >= shape[0]):
            errors.append(f"  {r.name} -> {tensor}: expected shape {list(want)}"
                          f"{f' (rows below {shape[0]})' if r.rows else ''}, found "
                          f"{list(r.raw.shape)}{f' (rows {list(r.rows)})' if r.rows else ''}")
            continue
        out[tensor] = r
        head = _find(ck, "lm_head") if tied and r.rows and r.module.endswith(EMBEDDING_HINTS) \
            else None
        if head is not None:  # a tied head stored beside the embedding follows it, as in PEFT
            out.setdefault(f"{head}.weight", r)
    if errors:
        raise _unfit(adapter, f"modules_to_save copies do not fit the checkpoint: "
                     f"{len(errors)} of {len(adapter.replacements)}", errors,
                     f"copies of tensors of the model at {ck.path}", "copy(ies)")
    return out
