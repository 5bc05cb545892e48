"""``--quant-policy learned``: re-quantize the fused weights with mlx-lm's own GPTQ.

``learned`` (alias ``learned:gptq``): every adapted module is fused by lorakit in the
dequantized base (:func:`lorakit.fusion.core.fuse_bindings`, correctly rounded), then
quantized back at the base's bits and group size by ``mlx_lm.quant.gptq.gptq_quantize``
(mlx-lm's code, not a rewrite): the quantized base is loaded with ``mlx_lm.load``, the
adapted modules are swapped for float ``nn.Linear`` layers holding the fused weights,
and GPTQ collects each one's input Hessian on calibration text (by default the embedded
*training* text ``data/corpora/fortunes/train.jsonl``, so the validation text KL is
scored on stays held out) and picks codes that minimise the layer's output error.
Modules that are not adapted stay quantized as in the base (GPTQ skips them, their
bytes are copied). The result has the base's layout, so ``mlx_lm.load`` reads it.

``learned:awq`` and ``learned:dwq`` are refused with the reason (:data:`REFUSED`).
"""
from __future__ import annotations

from pathlib import Path
from functools import partial
from typing import Any, Dict, List, Optional

import numpy as np

from ..errors import FuseError
from ..io.checkpoint import Checkpoint
from ..io.corpus import CALIBRATION_CORPUS, encode_text, read_corpus
from ..io.naming import Binding
from ..io.safetensors import mx_to_raw, raw_to_mx
from .core import fuse_bindings
from .quant import dequantize_raw

METHODS = ("gptq",)
SEQUENCE_LENGTH = 256
SAMPLES = 16
REFUSED = {
    "awq": "mlx_lm.quant.awq.awq_quantize (it has a qwen3 config) folds per-channel scales "
           "into the preceding norms and projections, so it rewrites untouched layers too "
           "and needs the whole float model; not wired to a fuse nor measured in this "
           "version. Use learned (GPTQ).",
    "dwq": "mlx_lm.quant.dwq.dwq_quantize trains every quantized layer's scales and biases "
           "by backprop against a teacher; tried here with the unfused adapter as teacher on "
           "the GPTQ fuse of data/tiny-qwen3-4bit: one training step of 4 x 128 tokens took "
           "~38 s and one validation batch ~28 s on this 2-core CPU, and DWQ needs hundreds "
           "of steps (it also retunes the untouched layers). Use learned (GPTQ).",
}


def parse_method(policy: str) -> str:
    """``learned`` / ``learned:gptq`` -> ``"gptq"``; AWQ / DWQ refused with the reason."""
    p = str(policy).strip().lower()
    method = p.split(":", 1)[1] if ":" in p else "gptq"
    if method in REFUSED:
        raise FuseError(f"quant policy 'learned:{method}' is not available here",
                        expected="learned | learned:gptq", found=REFUSED[method])
    if method not in METHODS:
        raise FuseError("unknown learned quantization method", expected="learned:gptq",
                        found=repr(policy))
    return method


def calibration_tokens(tokenizer, corpus: Optional[Path] = None,
                       sequence_length: int = SEQUENCE_LENGTH, samples: int = SAMPLES):
    """The first ``samples`` consecutive windows of ``sequence_length`` tokens of the
    calibration text (UTF-8; ``.jsonl``: each line's ``text`` joined with newlines)."""
    import mlx.core as mx  # lazy: MLX only when computing

    path = Path(corpus) if corpus is not None else CALIBRATION_CORPUS
    ids = np.asarray(encode_text(tokenizer, read_corpus(path)[0]), dtype=np.int32)
    n = min(samples, len(ids) // sequence_length)
    if n == 0:
        raise FuseError("the calibration text is shorter than one window", file=path,
                        expected=f"at least {sequence_length} tokens", found=f"{len(ids)}")
    return mx.array(ids[: n * sequence_length].reshape(n, sequence_length))


def learned_parts(ck: Checkpoint, by_tensor: Dict[str, List[Binding]], mods: List[str],
                  rounding: str, dtype_policy: str, policy: str = "learned",
                  corpus: Optional[Path] = None, progress: Any = True
                  ) -> Dict[str, Dict[str, np.ndarray]]:
    """Module -> raw ``weight`` / ``scales`` / ``biases`` chosen by mlx-lm's GPTQ for
    the fused weight of every adapted module in ``mods`` (the base's bits/group size).
    ``progress=True`` shows mlx-lm's own tqdm bars (Hessians, quantizing); otherwise
    they are silenced."""
    import mlx.core as mx  # lazy: MLX only when computing
    import mlx.nn as nn  # lazy: MLX only when computing
    from mlx.utils import tree_unflatten  # lazy: MLX only when computing
    from mlx_lm import load  # lazy: mlx-lm only for the learned policy
    from mlx_lm.quant import gptq  # lazy: mlx-lm only for the learned policy

    parse_method(policy)
    q = {ck.quant_params(m) for m in mods}
    if len(q) != 1 or next(iter(q)).mode != "affine" or next(iter(q)).bits not in (2, 4, 8):
        raise FuseError("quant policy learned (GPTQ) needs one affine grid of 2, 4 or 8 bits",
                        file=ck.path, expected="affine, bits 2/4/8, one group size",
                        found=str(sorted(map(str, q))))
    qp = next(iter(q))
    model, tokenizer = load(str(ck.path))
    mods_now = dict(model.named_modules())
    swapped = []
    for m in mods:
        name = f"{m}.weight"
        code = ck.tensors[f"{m}.scales"].dtype
        fused, fcode = fuse_bindings(dequantize_raw(ck, m, None), code, by_tensor[name],
                                     rounding, dtype_policy, name)
        old = mods_now.get(m)
        if not isinstance(old, nn.QuantizedLinear):
            raise FuseError("quant policy learned handles quantized linear layers only",
                            file=ck.path, tensor=name, expected="QuantizedLinear",
                            found=type(old).__name__)
        w = raw_to_mx(fused.reshape(-1, fused.shape[-1]), fcode)
        lin = nn.Linear(w.shape[1], w.shape[0], bias="bias" in old)
        lin.weight = w
        if "bias" in old:
            lin.bias = old.bias
        swapped.append((m, lin))
    model.update_modules(tree_unflatten(swapped))
    data = calibration_tokens(tokenizer, corpus)
    mx.random.seed(0)
    bars = gptq.tqdm
    if progress is not True:  # mlx-lm's bars follow lorakit's progress= (on, or off)
        gptq.tqdm = partial(bars, disable=True)
    try:
        model, _ = gptq.gptq_quantize(model, data, qp.bits, qp.group_size, qp.bits,
                                      qp.group_size)
    finally:
        gptq.tqdm = bars
    done = dict(model.named_modules())
    out = {}
    for m in mods:
        layer = done[m]
        shape = ck.tensors[f"{m}.weight"].shape
        parts = {"weight": mx_to_raw(layer.weight)[0].reshape(shape)}
        for leaf in ("scales", "biases"):  # in the fused weight's dtype, as requant
            parts[leaf] = mx_to_raw(getattr(layer, leaf))[0].reshape(
                ck.tensors[f"{m}.{leaf}"].shape)
        out[m] = parts
    return out
