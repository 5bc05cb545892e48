"""Files in, files out: everything lorakit reads or writes goes through here.

Three ideas:

- **File formats**: safetensors headers checked by the reference parser and tensors
  read one at a time, raw (``safetensors.py``), written as a stream
  (``safetensors_write.py``); checkpoints in the HF and mlx-lm layouts
  (``checkpoint.py``); the one door every verb reads an input through,
  ``lorakit.io.open`` (``source.py``: a directory, a hub repo id resolved by mlx-lm's
  resolver, offline from the Hugging Face cache with ``HF_HUB_OFFLINE=1``, an adapter,
  a ``.safetensors`` file or a model in memory, as one ``TensorSource``); dtypes,
  GGUF, the HF tensor layout, the corpus.
- **Adapters and where their targets land**: one ``Adapter`` read from mlx-lm or PEFT
  files and written back (``adapters/``), bound to a checkpoint's tensors in one place
  (``naming.py``).
- **Outputs written safely**: a hidden temporary sibling renamed into place, never a
  half-written directory, with provenance and a model card (``output.py``,
  ``provenance.py``, ``model_card.py``, ``export.py``).

``open`` is left out of ``__all__`` (a star import must not shadow the builtin) but is
``lorakit.io.open`` and ``lorakit.open``.
"""
from __future__ import annotations

from ..lazy import lazy_exports

__all__ = ["TensorSource", "Checkpoint", "Adapter", "LoraTarget", "load_adapter",
           "save_adapter", "bind", "read_header", "SafetensorsWriter", "OutputDirectory"]

__getattr__, __dir__ = lazy_exports(__name__, {
    "open": ("lorakit.io.source", "open"),
    "TensorSource": ("lorakit.io.source", "TensorSource"),
    "Checkpoint": ("lorakit.io.checkpoint", "Checkpoint"),
    "Adapter": ("lorakit.io.adapters.base", "Adapter"),
    "LoraTarget": ("lorakit.io.adapters.base", "LoraTarget"),
    "load_adapter": ("lorakit.io.adapters.load", "load_adapter"),
    "save_adapter": ("lorakit.io.adapters.write", "save_adapter"),
    "bind": ("lorakit.io.naming", "bind"),
    "read_header": ("lorakit.io.safetensors", "read_header"),
    "SafetensorsWriter": ("lorakit.io.safetensors_write", "SafetensorsWriter"),
    "OutputDirectory": ("lorakit.io.output", "OutputDirectory"),
})
