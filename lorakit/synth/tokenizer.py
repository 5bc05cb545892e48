"""A byte-level BPE tokenizer covering a config's whole vocabulary, specials at real ids."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ..errors import FormatError

__all__ = ["write_tokenizer"]

# Special tokens per family, at their real ids: (id, text) in order; the first
# named "eos" in the config ends generation.
_SPECIALS = {
    "qwen": [(151643, "<|endoftext|>"), (151644, "<|im_start|>"), (151645, "<|im_end|>")],
    "llama": [(128000, "<|begin_of_text|>"), (128001, "<|end_of_text|>"),
              (128006, "<|start_header_id|>"), (128007, "<|end_header_id|>"),
              (128008, "<|eom_id|>"), (128009, "<|eot_id|>")],
}
_CHAT_TEMPLATES = {
    "qwen": ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "llama": ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
              "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
              "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
              "{% endif %}"),
}


def _byte_chars() -> List[str]:
    """GPT-2's byte-to-character map: byte b is token b's text in a byte-level BPE."""
    kept = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)}
    moved = iter(range(256, 512))  # the other bytes, in order, past 255
    return [chr(b if b in kept else next(moved)) for b in range(256)]


def _family(model_type: str) -> Optional[str]:
    return next((f for f in _SPECIALS if model_type.startswith(f)), None)


def _special_tokens(config: Dict[str, Any], vocab: int) -> List[Tuple[int, str]]:
    """Special tokens (id, text) for the config's family, at real ids when they fit the
    vocabulary, else at its top; the config's bos/eos ids are made to match."""
    fam = _family(str(config.get("model_type", "")))
    if fam is not None:
        specials = list(_SPECIALS[fam])
    else:
        specials = [(config.get("bos_token_id"), "<s>"), (config.get("eos_token_id"), "</s>")]
        specials = [(i if isinstance(i, int) else -1, t) for i, t in specials]
    ids = [i for i, _ in specials]
    if any(not 256 <= i < vocab for i in ids) or len(set(ids)) < len(ids):
        moved = {i: vocab - len(specials) + k for k, (i, _) in enumerate(specials)}
        specials = [(vocab - len(specials) + k, t) for k, (_, t) in enumerate(specials)]

        def remap(v: Any) -> Any:
            if isinstance(v, list):
                return [moved.get(x, specials[-1][0]) for x in v]
            return moved.get(v, specials[-1][0]) if v is not None else None
        for key in ("bos_token_id", "eos_token_id"):
            if key in config:
                config[key] = remap(config[key])
        if fam is None:
            config["bos_token_id"], config["eos_token_id"] = specials[0][0], specials[1][0]
    return specials


def _word(i: int) -> str:
    s = ""
    i += 1
    while i:
        i, r = divmod(i - 1, 26)
        s = chr(97 + r) + s
    return s


def write_tokenizer(path: Path, config: Dict[str, Any]) -> None:
    """A byte-level BPE tokenizer covering exactly ``config['vocab_size']`` ids; moves
    ``config``'s bos/eos ids where the family's specials do not fit the vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers  # lazy: heavy

    vocab_size = int(config.get("vocab_size", 0))
    fam = _family(str(config.get("model_type", "")))
    specials = _special_tokens(config, vocab_size)
    if vocab_size < 256 + len(specials):
        raise FormatError("vocab_size too small for a byte-level tokenizer",
                          tensor="vocab_size", expected=f">= {256 + len(specials)}",
                          found=str(vocab_size))
    by_id = {i: t for i, t in specials}
    chars = _byte_chars()
    vocab: Dict[str, int] = {}
    word = 0
    for i in range(vocab_size):
        if i < 256:
            vocab[chars[i]] = i
        elif i in by_id:
            vocab[by_id[i]] = i
        else:
            vocab["\u0120" + _word(word)] = i  # "Ġ" + letters: a word after a space
            word += 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for _, t in specials])
    tok.save(str(path / "tokenizer.json"))

    def text_of(key: str) -> Optional[str]:
        v = config.get(key)
        v = v[0] if isinstance(v, list) and v else v
        return by_id.get(v) if isinstance(v, int) else None
    eos = text_of("eos_token_id") or specials[-1][1]
    bos = text_of("bos_token_id") if fam != "qwen" else None
    tcfg: Dict[str, Any] = {
        "added_tokens_decoder": {str(i): {"content": t, "lstrip": False, "normalized": False,
                                          "rstrip": False, "single_word": False,
                                          "special": True} for i, t in specials},
        "bos_token": bos, "clean_up_tokenization_spaces": False, "eos_token": eos,
        "model_max_length": int(config.get("max_position_embeddings") or 4096),
        "pad_token": specials[0][1], "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    if fam in _CHAT_TEMPLATES:
        tcfg["chat_template"] = _CHAT_TEMPLATES[fam]
    (path / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2))
    smap = {"eos_token": eos, "pad_token": specials[0][1]}
    if bos:
        smap["bos_token"] = bos
    (path / "special_tokens_map.json").write_text(json.dumps(smap, indent=2))
