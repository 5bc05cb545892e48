"""Fuse an adapter into an mlx-lm model already in memory (for notebooks).

A model loaded with its adapter has its LoRA / DoRA layers read back into targets; a
plain model plus an adapter (mlx-lm or PEFT) is bound by parameter name, as on disk.
Both go through :func:`lorakit.fusion.core.fuse_bindings`; quantized layers are
dequantized, fused and re-quantized alike (or left in float with ``dequantize=True``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from ..errors import AdapterError, ArgumentError, PathLike
from ..io.adapters.base import MLX_WEIGHTS, PEFT_WEIGHTS, Adapter, LoraTarget
from ..io.adapters.load import load_adapter
from ..io.adapters.naming import bind, bind_replacements, bindings_by_tensor
from ..io.formats.safetensors import mx_to_raw, raw_to_mx
from ..io.formats.source import ModelSource
from .core import fuse_bindings, output_code
from .finite import cast_raw, replaced_raw
from .options import FuseOptions

__all__ = ["attach_adapter", "load_unfused"]


def _lora_targets(model: Any) -> Tuple[List[LoraTarget], List[Tuple[str, Any]]]:
    """Targets read back from LoRA/DoRA layers, and the plain layers to put back."""
    targets: List[LoraTarget] = []
    plain: List[Tuple[str, Any]] = []
    for name, m in model.named_modules():
        cls = type(m).__name__
        if cls not in ("LoRALinear", "DoRALinear", "LoRASwitchLinear", "LoRAEmbedding",
                       "DoRAEmbedding"):
            continue
        a = np.array(m.lora_a.astype(mx.float32))
        b = np.array(m.lora_b.astype(mx.float32))
        mag = np.array(m.m.astype(mx.float32)) if "m" in m else None
        if cls == "LoRASwitchLinear":
            kind, A, B, inner = "switch", a, b, m.linear
        elif cls in ("LoRAEmbedding", "DoRAEmbedding"):
            kind, A, B, inner = "embedding", b, a, m.embedding
        else:
            kind, A, B, inner = "linear", a.T, b.T, m.linear
        A, B = np.ascontiguousarray(A), np.ascontiguousarray(B)
        names = (f"{name}.lora_a", f"{name}.lora_b")
        targets.append(LoraTarget(name, kind, A, B, float(m.scale), mag, names))
        plain.append((name, inner))
    return targets, plain


def fuse_model(model: Any, adapter: Union[None, PathLike, Adapter] = None,
               options: Optional[FuseOptions] = None) -> Any:
    """Fuse an adapter into an in-memory mlx-lm model, in place; returns the model.
    ``adapter``: None for a model with LoRA layers attached, else a directory or an
    :class:`Adapter`; ``options`` as for :func:`lorakit.fuse`.

    >>> import mlx_lm
    >>> model, tok = mlx_lm.load("data/tiny-qwen3", adapter_path="data/adapters/lora")
    >>> model = fuse_model(model)  # LoRA layers become plain, dtype kept
    >>> type(model.layers[0].self_attn.q_proj).__name__, model.layers[0].self_attn.q_proj.weight.dtype
    ('Linear', mlx.core.bfloat16)
    """

    opts = options if options is not None else FuseOptions()
    rounding, dtype, dequantize = opts.rounding, opts.dtype, opts.dequantize
    if adapter is None:
        targets, plain = _lora_targets(model)
        if not targets:
            raise ArgumentError.bad("adapter", None, "an adapter: the model has no LoRA layers")
        model.update_modules(tree_unflatten(plain))
        ad = Adapter(Path("<in-memory adapter>"), "mlx-lm", targets, {}, Path(""))
    else:
        ad = adapter if isinstance(adapter, Adapter) else load_adapter(adapter)
    src = ModelSource(model)
    binds = bindings_by_tensor(bind(ad, src))
    updates: List[Tuple[str, Any]] = []
    new_modules: List[Tuple[str, Any]] = []
    for tensor, bs in binds.items():
        module = tensor.rsplit(".", 1)[0]
        q = src.quant_params(module)
        if q is None:
            raw, code = mx_to_raw(src.arrays[tensor])
            fused, fcode = fuse_bindings(raw, code, bs, rounding, dtype, tensor)
            updates.append((tensor, raw_to_mx(fused, fcode)))
            continue
        mod = src.modules[module]
        w = mx.dequantize(mod.weight, mod.scales, mod.get("biases"), group_size=q.group_size,
                          bits=q.bits, mode=q.mode)
        raw, code = mx_to_raw(w)
        fused, fcode = fuse_bindings(raw, code, bs, rounding,
                                     dtype if dequantize else "preserve", tensor)
        fw = raw_to_mx(fused, fcode)
        cls = type(mod).__name__
        if cls == "QuantizedEmbedding":
            plain_mod = nn.Embedding(*fw.shape)
        elif cls == "QuantizedSwitchLinear":
            from mlx_lm.models.switch_layers import SwitchLinear  # lazy: mlx-lm is heavy

            e, o, i = fw.shape
            plain_mod = SwitchLinear(i, o, e, bias="bias" in mod)
        else:
            plain_mod = nn.Linear(fw.shape[1], fw.shape[0], bias="bias" in mod)
        plain_mod.weight = fw
        if "bias" in mod:
            plain_mod.bias = mod.bias
        if not dequantize:
            plain_mod = plain_mod.to_quantized(group_size=q.group_size, bits=q.bits, mode=q.mode)
        new_modules.append((module, plain_mod))
    for tensor, r in bind_replacements(ad, src).items():  # modules_to_save, trainable tokens
        raw, code = mx_to_raw(src.arrays[tensor])
        out = output_code(code, dtype) if code in ("BF16", "F16", "F32") else r.code
        new, new_code = replaced_raw(r, lambda: (raw, code))
        updates.append((tensor, raw_to_mx(cast_raw(new, new_code, out, tensor), out)))
    if updates:
        model.load_weights(updates, strict=False)
    if new_modules:
        model.update_modules(tree_unflatten(new_modules))
    mx.eval(model.parameters())
    return model


def attach_adapter(model: Any, adapter: Union[PathLike, Adapter]) -> Any:
    """Attach an adapter to an mlx-lm model unfused, in place (returned, in eval mode):
    every target becomes mlx-lm's own LoRA/DoRA layer with its own rank and scale, and
    PEFT ``modules_to_save`` copies replace their tensors. This runs adapters that
    ``mlx_lm.utils.load_adapters`` cannot (PEFT's format, per-module ranks and scales).

    >>> import mlx_lm
    >>> model, tok = mlx_lm.load("data/tiny-qwen3")
    >>> model = attach_adapter(model, "data/adapters/peft-lora")
    >>> type(model.layers[0].self_attn.q_proj).__name__
    'LoRALinear'
    """
    from mlx_lm.tuner.dora import DoRAEmbedding, DoRALinear  # lazy: mlx-lm is heavy
    from mlx_lm.tuner.lora import LoRAEmbedding, LoRALinear, LoRASwitchLinear  # lazy: mlx-lm

    ad = adapter if isinstance(adapter, Adapter) else load_adapter(adapter)
    src = ModelSource(model)
    binds = bind(ad, src)
    modules = dict(model.named_modules())
    layers: List[Tuple[str, Any]] = []
    weights: List[Tuple[str, Any]] = []
    for b in binds:
        t = b.target
        if b.target_expert is not None or b.weight_expert is not None:
            raise AdapterError("an unfused adapter cannot target single experts of a stacked "
                               "MoE layer (or a stacked target on per-expert layers)",
                               file=ad.weights_file, tensor=t.module,
                               expected="targets that match the model's layers one to one",
                               found=f"{t.module} -> {b.tensor}",
                               hint="fuse it instead (lorakit.fuse), which slices the experts")
        mod = modules[b.module]
        if getattr(t, "parts", None):  # an exact combination with DoRA (delta.SumTarget)
            raise AdapterError("no mlx-lm layer computes a weighted sum with DoRA parts",
                               file=ad.weights_file, tensor=t.module,
                               expected="one LoRA or DoRA adapter", found="a DoRA combination",
                               hint="fuse the combination (lorakit.fuse)")
        if np.ndim(t.scale):  # an exact combination: one scale per rank column
            raise AdapterError("an mlx-lm LoRA layer has one scale; this target has one per "
                               "rank column (an exact combination of adapters)",
                               file=ad.weights_file, tensor=t.module,
                               expected="one scale", found=f"{np.size(t.scale)} scales",
                               hint="combine with method='cat' (one stored adapter), or "
                               "fuse the exact combination (lorakit.fuse)")
        if t.base_weight is not None:  # PEFT saved the weight it was trained on
            raw, code = t.base_weight
            weights.append((b.tensor, raw_to_mx(raw, code).astype(mod.weight.dtype)))
        dora = t.magnitude is not None
        if t.kind == "switch":
            if dora:
                raise AdapterError("DoRA on a SwitchLinear (MoE) layer has no mlx-lm layer",
                                   file=ad.weights_file, tensor=t.module,
                                   expected="LoRA on SwitchLinear", found="DoRA")
            layer = LoRASwitchLinear.from_base(mod, r=t.rank, scale=t.scale)
            layer.lora_a, layer.lora_b = mx.array(t.A), mx.array(t.B)
        elif t.kind == "embedding":
            layer = (DoRAEmbedding if dora else LoRAEmbedding).from_base(mod, r=t.rank,
                                                                         scale=t.scale)
            layer.lora_a, layer.lora_b = mx.array(t.B), mx.array(t.A)
        else:
            layer = (DoRALinear if dora else LoRALinear).from_base(mod, r=t.rank, scale=t.scale)
            layer.lora_a, layer.lora_b = mx.array(t.A.T), mx.array(t.B.T)
        if dora:
            layer.m = mx.array(t.magnitude.reshape(-1))
        layers.append((b.module, layer))
    for tensor, r in bind_replacements(ad, src).items():
        dt = src.arrays[tensor].dtype
        raw, code = replaced_raw(r, lambda: mx_to_raw(src.arrays[tensor]))
        weights.append((tensor, raw_to_mx(raw, code).astype(dt)))
    if weights:  # into the modules the LoRA layers wrap, under the model's own names
        model.load_weights(weights, strict=False)
    if layers:
        model.update_modules(tree_unflatten(layers))
    model.eval()
    mx.eval(model.parameters())
    return model


def load_unfused(model: Any, adapter_path: PathLike) -> Any:
    """The unfused adapter on ``model``: mlx-lm's own ``load_adapters`` for its own
    format (the reference path), :func:`attach_adapter` for PEFT adapters."""

    path = Path(adapter_path)
    if not (path / MLX_WEIGHTS).exists() and (path / PEFT_WEIGHTS).exists():
        return attach_adapter(model, path)
    from mlx_lm.utils import load_adapters  # lazy: mlx-lm is heavy

    model = load_adapters(model, str(path))
    model.eval()
    return model
