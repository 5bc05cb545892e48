"""Adapter algebra: adapters made from adapters and from weights.

``lorakit.combine`` (``combine.py``; PEFT's methods step for step in ``peft_like.py``)
and the truncated SVDs of ``lorakit.extract`` (``extract.py``; its behaviour line is
added in ``lorakit/inspect/extraction.py``) live here, and so do these:

``convert``  an adapter written in the other format (mlx-lm <-> PEFT), exactly;
             or as llama.cpp's LoRA GGUF (``to="gguf-lora"``)
``resize``   an adapter at a lower rank, from its factors alone
"""
from __future__ import annotations

from ..lazy import lazy_exports

__all__ = ["convert", "resize"]

__getattr__, __dir__ = lazy_exports(__name__, {
    "convert": ("lorakit.algebra.combine", "convert"),
    "resize": ("lorakit.algebra.extract", "resize"),
})
