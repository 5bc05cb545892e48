"""Shape-faithful random checkpoints and adapters: time a model's shape without downloading it.

:func:`synth_checkpoint` writes a checkpoint with the tensor names, shapes, dtype,
shards, config.json and tokenizer files of a real model (a named preset, or any
config.json mlx-lm knows), filled with random weights; :func:`synth_adapter`
writes a LoRA/DoRA adapter for it, in the mlx-lm or PEFT format, as those tools
save them. ``mlx_lm.load`` opens both and ``mlx_lm generate`` runs them, so a fuse
or a decode can be timed on a Qwen3-1.7B or an 8B shape on any machine.

How they are made:

* The tensor list comes from mlx-lm's own model class, instantiated lazily (MLX
  never evaluates the parameters, so planning an 8B model costs no memory). The
  ``hf`` layout names tensors as transformers saves them (one tensor per MoE
  expert); the ``mlx`` layout as mlx-lm saves them (experts stacked under
  ``switch_mlp``). The HF names are checked by running mlx-lm's ``sanitize`` on
  them, so they load back to exactly the model's parameters.
* Tensors are generated and written one at a time, in pieces of a few MB, through
  :class:`~lorakit.io.formats.safetensors.SafetensorsWriter`: peak memory is a few hundred
  MB whatever the model's size.
* Matrices are drawn from N(0, std^2) (std 0.02, the usual initialiser), norm
  weights are 1 and biases 0, so activations stay finite through any depth. For
  speed a table of 65,536 normal draws, rounded once to the target dtype, is
  indexed with random 16-bit numbers (about 2 ns per element): each element is an
  exact sample of the rounded normal up to the table's own sampling noise.
* The tokenizer is byte-level BPE: 256 byte tokens, the family's special tokens at
  their real ids (Qwen's ``<|im_end|>`` = 151645, ...), and filler word tokens up
  to ``vocab_size``, so every id the model can emit decodes to text.

Modules: ``presets`` (named shapes, adapter keys), ``planning`` (sizes, configs,
the tensor list), ``sampler`` (random values), ``tokenizer``, ``checkpoint`` (the
checkpoint writer), ``sites`` (where an adapter goes) and ``adapter`` (the mlx-lm
and PEFT adapter writers). Outputs go through :mod:`lorakit.io.outputs.directory`: built
hidden, published whole, with a ``lorakit.json`` provenance; ``force`` replaces
only an empty directory or a previous lorakit output.

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

__all__ = ["PRESETS", "synth_checkpoint", "synth_adapter", "plan_checkpoint", "resolve_config",
           "parse_size", "DEFAULT_KEYS", "presets", "write_tokenizer"]
