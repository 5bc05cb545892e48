"""Shape-faithful random checkpoints and adapters: time a model's shape without downloading it.

:func:`synth_checkpoint` writes the tensor names, shapes, dtype, shards, config.json and
a byte-level BPE tokenizer of a real model (a preset, or any config.json mlx-lm knows),
filled with N(0, 0.02^2) weights (norms 1, biases 0) one tensor at a time; the tensor list
comes from mlx-lm's own model class, instantiated lazily (``hf`` or ``mlx`` layout, HF
names checked by mlx-lm's ``sanitize``). :func:`synth_adapter` writes a LoRA/DoRA adapter
for it in mlx-lm or PEFT format. ``mlx_lm.load`` opens both.

>>> from lorakit.synth import synth_adapter, synth_checkpoint
>>> small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=600)
>>> ck = synth_checkpoint("out/qwen3-small", "qwen3-1.7b", overrides=small, progress=False)
>>> synth_adapter("out/lora", ck, rank=8, layers=2).name
'lora'
"""
from __future__ import annotations

from .adapter import synth_adapter
from .checkpoint import synth_checkpoint
from .planning import parse_size, plan_checkpoint, resolve_config
from .presets import DEFAULT_KEYS, PRESETS, presets
from .tokenizer import write_tokenizer

__all__ = (
    ["PRESETS", "DEFAULT_KEYS", "presets", "synth_checkpoint", "synth_adapter", "write_tokenizer"]
    + ["plan_checkpoint", "resolve_config", "parse_size"]
)
