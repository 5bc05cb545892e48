"""What :func:`~lorakit.timing.decode.time_decode` and its worker process share, with
nothing heavy imported: the mark that prefixes the worker's JSON lines on stdout (so
that what a library prints cannot be taken for one) and the files that make a tokenizer."""
from __future__ import annotations

MARK = "@@lorakit-timing "
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
