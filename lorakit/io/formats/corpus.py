"""Text corpora for scoring and calibration: a UTF-8 file, or ``.jsonl`` with one
``{"text": ...}`` per line (the texts joined with newlines), tokenized in one piece."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, List, Optional, Tuple

from ...errors import LorakitError, PathLike

__all__ = ["DEFAULT_CORPUS", "CALIBRATION_CORPUS", "read_corpus", "encode_text"]

_CORPORA = Path(__file__).resolve().parents[3] / "data" / "corpora" / "fortunes"
#: the embedded validation text (held out from the embedded adapters' training text)
DEFAULT_CORPUS = _CORPORA / "valid.jsonl"
#: the embedded training text: calibration that stays apart from the scored text
CALIBRATION_CORPUS = _CORPORA / "train.jsonl"


def encode_text(tokenizer: Any, text: str) -> List[int]:
    """``tokenizer.encode(text)``, without transformers' warning that the corpus is longer
    than the model's context (it is scored in windows; ``verbose`` changes no token)."""
    try:
        return list(tokenizer.encode(text, verbose=False))
    except TypeError:  # a tokenizer without transformers' ``verbose``
        return list(tokenizer.encode(text))


def read_corpus(corpus: Optional[PathLike] = None) -> Tuple[str, str, str]:
    """(text, name, sha256 of the file's bytes) of a corpus file: UTF-8 text, or for a
    ``.jsonl`` file each line's ``text`` field joined with ``"\\n"``. ``None``: the
    embedded validation text."""
    path = Path(corpus) if corpus is not None else DEFAULT_CORPUS
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise LorakitError("cannot read the corpus", file=path, expected="a readable text file",
                           found=e.strerror or type(e).__name__) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LorakitError("the corpus is not UTF-8", file=path, expected="UTF-8 text",
                           found=f"byte {raw[e.start]:#04x} at offset {e.start}") from None
    if path.suffix == ".jsonl":
        parts = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise LorakitError("a corpus line is not JSON", file=path, tensor=f"line {n}",
                                   expected='{"text": ...}', found=str(e)) from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise LorakitError("a corpus line has no text field", file=path,
                                   tensor=f"line {n}", expected='{"text": "..."}',
                                   found=line[:60])
            parts.append(obj["text"])
        text = "\n".join(parts)
    name = "data/corpora/fortunes/valid.jsonl (embedded)" if corpus is None else str(path)
    return text, name, hashlib.sha256(raw).hexdigest()
