"""The model card (``README.md``) a fused checkpoint carries, as ``mlx_lm fuse`` writes it
(the base's card kept, ``library_name: mlx``, ``base_model``, through ``huggingface_hub``'s
``ModelCard``), with lorakit's provenance below: the adapter's sha256, the rounding order
and the dtype policy.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

from ... import __version__

__all__ = ["CARD_NAME", "write_model_card"]

#: the file name mlx-lm and the hub use for a model card
CARD_NAME = "README.md"

def write_model_card(directory: Path, base_card: Optional[Path], hub_id: Optional[str],
                     title: str, settings: Mapping[str, Any], rounding_words: str = "") -> Path:
    """Write ``directory/README.md`` for a fused checkpoint, keeping ``base_card``'s
    metadata as mlx-lm does; ``title`` is never the output path (same bytes anywhere)."""
    from huggingface_hub import (  # lazy: only a fuse writes a card
        ModelCard,
        ModelCardData,
    )

    card = None
    if base_card is not None:
        try:
            card = ModelCard.load(base_card)
        except Exception:  # a base README that is not a card: start from the template
            card = None
    if card is None:
        card = ModelCard.from_template(ModelCardData(language="en"))
    card.data.library_name = "mlx"
    card.data.pipeline_tag = "text-generation"
    tags = list(card.data.tags or [])
    for t in ("mlx", "lorakit"):
        if t not in tags:
            tags.append(t)
    card.data.tags = tags
    if hub_id is not None:
        card.data.base_model = hub_id
    card.text = _text(title, hub_id, settings, rounding_words)
    out = directory / CARD_NAME
    card.save(out)
    return out


def _text(title: str, hub_id: Optional[str], s: Mapping[str, Any], words: str) -> str:
    rounding = str(s.get("rounding", ""))
    lines = [
        f"# {title}", "",
        f"Fused with lorakit {__version__}"
        + (f" from [{hub_id}](https://huggingface.co/{hub_id})" if hub_id else "") + ".", "",
        f"- adapter: {s.get('adapter_format', '?')} format, sha256 `{s.get('adapter_sha256', '?')}`",
        f"- rounding: `{rounding}` ({words or rounding})",
        f"- dtype policy: `{s.get('dtype_policy', '?')}`"
        + (" (quantized weights written dequantized)" if s.get("dequantize") else ""),
        "- every file written is listed with its size and sha256 in `lorakit.json`", "",
        "## Use with mlx", "",
        "```python",
        "from mlx_lm import load, generate",
        "",
        'model, tokenizer = load("path/to/this/directory")',
        'print(generate(model, tokenizer, prompt="hello", verbose=True))',
        "```", "",
    ]
    return "\n".join(lines)
