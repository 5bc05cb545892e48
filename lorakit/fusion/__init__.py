"""The arithmetic of a fuse: ``lorakit.fuse`` (``fuse.py``) and what it stands on.

``attach_adapter``  put an adapter on a loaded mlx-lm model, unfused
``FuseOptions``     a fuse's settings, validated once (``options.py``)
``FuseResult``      what a fuse did (``fuse.py``)
"""
from __future__ import annotations

from ..lazy import lazy_exports

__all__ = ["attach_adapter", "FuseOptions", "FuseResult"]

__getattr__, __dir__ = lazy_exports(__name__, {
    "attach_adapter": ("lorakit.fusion.model", "attach_adapter"),
    "FuseOptions": ("lorakit.fusion.options", "FuseOptions"),
    "FuseResult": ("lorakit.fusion.fuse", "FuseResult"),
})
