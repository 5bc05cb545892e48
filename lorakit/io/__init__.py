"""Files in, files out: everything lorakit reads or writes goes through here.

``formats/`` reads safetensors (headers checked by the reference parser, tensors raw, one
at a time), checkpoints and every input through one door, ``lorakit.io.open`` (a directory,
a hub id resolved by mlx-lm's resolver, an adapter, a file or a model in memory);
``adapters/`` reads and writes one ``Adapter`` in the mlx-lm and PEFT formats;
``outputs/`` writes outputs safely (a hidden sibling renamed into place). ``open`` is left
out of ``__all__`` so a star import does not shadow the builtin.
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
