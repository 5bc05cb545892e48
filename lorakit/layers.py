"""Where a tensor sits in a model: layer, kind (q, k, v, o, gate, up, down, norms,
embed, head, experts), expert and part, read from its name alone; and the layer x
kind grid that tables and heatmaps share.

>>> split_name("model.layers.2.mlp.down_proj.weight")
(2, 'down', None, 'weight')
>>> names = ["m.layers.10.q_proj", "m.norm", "m.layers.2.v_proj", "m.layers.2.q_proj",
...          "m.embed_tokens", "lm_head"]
>>> [names[i] for i in model_order(names)]
['m.embed_tokens', 'm.layers.2.q_proj', 'm.layers.2.v_proj', 'm.layers.10.q_proj', 'm.norm', 'lm_head']
>>> kind_label("norm_attn")
'post-attn norm'
"""
from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["split_name", "kind_label", "model_order", "layer_kind_cells"]

# Last module-path component -> short kind. Unknown names keep their own component.
_KIND = {f"{k}_proj": k for k in ("q", "k", "v", "o", "qkv", "gate", "up", "down", "gate_up")}
_ALIASES = {
    "qkv": ("query_key_value", "c_attn"),
    "o": ("dense", "out_proj"),
    "gate": ("w1",),
    "up": ("w3", "fc1"),
    "down": ("w2", "fc2"),
    "norm_in": ("input_layernorm",),
    "norm_attn": ("post_attention_layernorm",),
    "norm_pre_ff": ("pre_feedforward_layernorm",),
    "norm_post_ff": ("post_feedforward_layernorm",),
    "embed": ("embed_tokens", "wte", "word_embeddings", "tok_embeddings"),
    "head": ("lm_head", "output"),
}
_KIND.update((leaf, kind) for kind, leaves in _ALIASES.items() for leaf in leaves)
#: What each kind is, for a reader: column headers and hover text.
KIND_LABELS = {
    "embed": "embedding", "q": "q proj", "k": "k proj", "v": "v proj", "qkv": "qkv proj",
    "o": "out proj", "q_norm": "q norm", "k_norm": "k norm", "norm_in": "input norm",
    "norm_attn": "post-attn norm", "router": "router", "gate": "gate proj",
    "up": "up proj", "gate_up": "gate+up proj", "down": "down proj",
    "experts.gate": "expert gate", "experts.up": "expert up", "experts.down": "expert down",
    "norm_pre_ff": "pre-MLP norm", "norm_post_ff": "post-MLP norm", "norm": "final norm",
    "head": "LM head",
}
#: Column order of the kinds in tables and heatmaps (others follow, sorted).
KIND_ORDER = list(KIND_LABELS)
LORA_PARTS = ("lora_a", "lora_b", "m", "lora_A", "lora_B", "lora_magnitude_vector")
_LEAVES = ("weight", "bias", "scales", "biases") + LORA_PARTS
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)(?:\.|$)")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def split_name(name: str) -> Tuple[Optional[int], str, Optional[int], str]:
    """(layer, kind, expert, part) of a tensor or module name.

    >>> split_name("model.layers.3.self_attn.q_proj.weight")
    (3, 'q', None, 'weight')
    >>> split_name("model.layers.0.mlp.experts.5.down_proj.scales")
    (0, 'experts.down', 5, 'scales')
    >>> split_name("model.embed_tokens.weight")
    (None, 'embed', None, 'weight')
    """
    parts = name.split(".")
    part = ""
    # PEFT keys end in ".lora_A.weight"; keep "lora_A" as the part, not "weight".
    if len(parts) >= 2 and parts[-2] in ("lora_A", "lora_B") and parts[-1] == "weight":
        part = parts[-2]
        parts = parts[:-2]
    elif parts[-1] in _LEAVES and len(parts) > 1:
        part = parts[-1]
        parts = parts[:-1]
    if parts and parts[-1] == "linear" and len(parts) > 1:  # mlx-lm LoRALinear wrapper
        parts = parts[:-1]
    module = ".".join(parts)
    m = _LAYER.search(module)
    layer = int(m.group(1)) if m else None
    e = _EXPERT.search(module + ".")
    expert = int(e.group(1)) if e else None
    leaf = parts[-1] if parts else name
    kind = _KIND.get(leaf, leaf)
    if leaf == "gate" and len(parts) > 1 and parts[-2] in ("mlp", "block_sparse_moe", "moe"):
        kind = "router"
    if expert is not None or "switch_mlp" in parts:
        kind = "experts." + kind
    return layer, kind, expert, part


def kind_label(kind: str) -> str:
    """A reader's name for a kind (``norm_attn`` -> ``post-attn norm``), else the kind."""
    return KIND_LABELS.get(kind, kind)


def _natural(s: str) -> Tuple[Any, ...]:
    # digit runs compare as numbers; re.split alternates text and digits, so equal
    # positions always hold the same type
    return tuple(int(p) if i % 2 else p for i, p in enumerate(re.split(r"(\d+)", s)))


def model_order(names: List[str]) -> List[int]:
    """Indices of ``names`` in model order: the embedding, the blocks by layer number (2
    before 10) and within a block by :data:`KIND_ORDER`, expert and part, then the rest."""
    rank = {k: i for i, k in enumerate(KIND_ORDER)}

    def key(i: int) -> Tuple[Any, ...]:
        layer, kind, expert, part = split_name(names[i])
        group = 1 if layer is not None else 0 if kind == "embed" else 2
        return (group, layer or 0, rank.get(kind, len(rank)), kind,
                -1 if expert is None else expert, part, _natural(names[i]))

    return sorted(range(len(names)), key=key)


def _order_kinds(kinds) -> List[str]:
    known = [k for k in KIND_ORDER if k in kinds]
    return known + sorted(k for k in kinds if k not in KIND_ORDER)


def layer_kind_cells(rows) -> Tuple[List[str], List[str], Dict[Tuple[str, str], List[Dict[str, Any]]]]:
    """Report rows grouped by (layer label, kind): the row labels (``"-"`` first for
    layer-less tensors), the kinds in display order and the rows of each cell."""
    cells: Dict[Tuple[str, str], List[Dict[str, Any]]] = {}
    layers: set = set()
    has_global = False
    for r in rows:
        layer = r["layer"]
        has_global |= layer is None
        if layer is not None:
            layers.add(layer)
        cells.setdefault(("-" if layer is None else str(layer), r["kind"]), []).append(r)
    labels = (["-"] if has_global else []) + [str(i) for i in sorted(layers)]
    return labels, _order_kinds({k for _, k in cells}), cells
