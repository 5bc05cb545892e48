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

#: module (under lorakit.io) -> the public names it defines
_EXPORTS = {"formats.source": ("open", "TensorSource"), "formats.checkpoint": ("Checkpoint",),
            "adapters.base": ("Adapter", "LoraTarget"), "adapters.load": ("load_adapter",),
            "adapters.write": ("save_adapter",), "adapters.naming": ("bind",),
            "formats.safetensors": ("read_header",),
            "outputs.safetensors_write": ("SafetensorsWriter",),
            "outputs.directory": ("OutputDirectory",)}
_NAMES = {n: (f"{__name__}.{m}", n) for m, names in _EXPORTS.items() for n in names}
__all__ = [n for n in _NAMES if n != "open"]
__getattr__, __dir__ = lazy_exports(__name__, _NAMES)
