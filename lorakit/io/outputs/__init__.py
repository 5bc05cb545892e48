"""Outputs written safely: the output directory's life, the streaming writer, provenance, model cards, GGUF, exports."""
