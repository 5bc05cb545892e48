"""The files around the tensors: which ones a fused folder carries, and from where.

The base's files (tokenizer, chat template, generation config, ...) are copied, except
where the adapter folder ships its own: the tokenizer and chat template it was trained
with. A shipped tokenizer replaces the base's whole tokenizer set (its template too); a
chat template shipped alone replaces only the template. ``config.json`` and the model
card are written anew by the fuse, so they are not in the plan.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence

from ...errors import FuseError
from .model_card import CARD_NAME

__all__ = ["TOKENIZER_FILES", "plan_sidecars", "check_tokenizer_fits"]

TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "vocab.txt") + TEMPLATE_FILES


def plan_sidecars(base_files: Sequence[Path], adapter_dir: Optional[Path]) -> Dict[str, Path]:
    """File name -> the file a fused folder copies it from (the base's or the adapter's)."""
    files = {p.name: p for p in base_files if p.name not in ("config.json", CARD_NAME)}
    ad = Path(adapter_dir) if adapter_dir is not None else None
    shipped = sorted(n for n in TOKENIZER_FILES if ad is not None and (ad / n).is_file())
    if shipped:
        drop = TEMPLATE_FILES if set(shipped) <= set(TEMPLATE_FILES) else TOKENIZER_FILES
        files = {n: p for n, p in files.items() if n not in drop}
        files.update((n, ad / n) for n in shipped)
    return dict(sorted(files.items()))


def tokenizer_origin(plan: Mapping[str, Path], adapter_dir: Optional[Path]) -> Dict[str, str]:
    """Each tokenizer / chat template file of the plan -> ``adapter`` or ``base``."""
    ad = Path(adapter_dir) if adapter_dir is not None else None
    return {n: "adapter" if ad is not None and p.parent == ad else "base"
            for n, p in plan.items() if n in TOKENIZER_FILES}


def _tokens(plan: Mapping[str, Path]) -> int:
    """How many ids the tokenizer files in ``plan`` use (largest id + 1; 0 if none)."""
    ids = [-1]
    if "tokenizer.json" in plan:
        t = json.loads(plan["tokenizer.json"].read_text())
        vocab = t.get("model", {}).get("vocab") or {}
        ids += [len(vocab) - 1] if isinstance(vocab, list) else list(vocab.values())
        ids += [a["id"] for a in t.get("added_tokens", [])]
    for name in ("added_tokens.json", "vocab.json"):
        if name in plan:
            ids += list(json.loads(plan[name].read_text()).values())
    return max(ids) + 1


def check_tokenizer_fits(plan: Mapping[str, Path], adapter_dir: Optional[Path],
                         config: Mapping[str, Any]) -> None:
    """Refuse an adapter's tokenizer that has more ids than the model's embedding rows."""
    own = {n: p for n, p in plan.items()
           if tokenizer_origin(plan, adapter_dir).get(n) == "adapter"}
    rows = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    n = _tokens(own) if own else 0
    if rows and n > int(rows):
        where = own.get("tokenizer.json") or next(iter(own.values()))
        raise FuseError("the adapter's tokenizer does not fit the model's embedding", file=where,
                        expected=f"at most {rows} token ids (vocab_size: the embedding's rows)",
                        found=f"{n} token ids",
                        hint="fuse into the base the adapter was trained on (its embedding "
                        "resized to the tokenizer), or take the tokenizer out of the adapter "
                        "folder to keep the base's")
