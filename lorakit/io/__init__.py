"""Files in, files out: everything lorakit reads or writes goes through here.

- ``formats/``: safetensors headers checked by the reference parser and tensors read
  raw, one at a time; checkpoints in the HF and mlx-lm layouts; the one door every verb
  reads an input through, ``lorakit.io.open`` (a directory, a hub repo id resolved by
  mlx-lm's resolver, offline from the Hugging Face cache with ``HF_HUB_OFFLINE=1``, an
  adapter, a ``.safetensors`` file or a model in memory, as one ``TensorSource``);
  dtypes, safe paths, the corpus.
- ``adapters/``: one ``Adapter`` read from mlx-lm or PEFT files and written back, and
  where its targets land in a checkpoint (``naming.py``).
- ``outputs/``: outputs written safely: a hidden temporary sibling renamed into place,
  never half-written; the streaming safetensors writer, provenance, the model card,
  GGUF and the transformers MoE layout, exports.

``open`` is left out of ``__all__`` (a star import must not shadow the builtin) but is
``lorakit.io.open`` and ``lorakit.open``.
"""
from __future__ import annotations

from ..lazy import lazy_exports

__all__ = ["TensorSource", "Checkpoint", "Adapter", "LoraTarget", "load_adapter",
           "save_adapter", "bind", "read_header", "SafetensorsWriter", "OutputDirectory"]

__getattr__, __dir__ = lazy_exports(__name__, {
    "open": ("lorakit.io.formats.source", "open"),
    "TensorSource": ("lorakit.io.formats.source", "TensorSource"),
    "Checkpoint": ("lorakit.io.formats.checkpoint", "Checkpoint"),
    "Adapter": ("lorakit.io.adapters.base", "Adapter"),
    "LoraTarget": ("lorakit.io.adapters.base", "LoraTarget"),
    "load_adapter": ("lorakit.io.adapters.load", "load_adapter"),
    "save_adapter": ("lorakit.io.adapters.write", "save_adapter"),
    "bind": ("lorakit.io.adapters.naming", "bind"),
    "read_header": ("lorakit.io.formats.safetensors", "read_header"),
    "SafetensorsWriter": ("lorakit.io.outputs.safetensors_write", "SafetensorsWriter"),
    "OutputDirectory": ("lorakit.io.outputs.directory", "OutputDirectory"),
})
