"""Where a fused checkpoint goes after lorakit writes it: a GGUF file llama.cpp loads
(``--export-gguf``, :mod:`lorakit.io.outputs.gguf`) or the hub (``--upload-repo``). Both
are checked before the fuse starts, so a refusal costs nothing.

>>> check_gguf_export({"model_type": "gemma"}, False, "ggml-model-f16.gguf")
Traceback (most recent call last):
lorakit.errors.FormatError: llama.cpp GGUF export does not support this architecture ...
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from ...errors import ArgumentError, FormatError, LorakitError
from .gguf import check_gguf_model, write_model_gguf

__all__ = ["check_gguf_export", "export_gguf", "check_upload", "upload"]

#: mlx_lm fuse's default GGUF file name
GGUF_DEFAULT = "ggml-model-f16.gguf"


def check_gguf_export(config: Mapping[str, Any], dequantize: bool, gguf_path: str) -> None:
    """Refuse, before any work, an export the GGUF writer cannot do."""
    check_gguf_model(config)
    if (config.get("quantization") or config.get("quantization_config")) and not dequantize:
        raise FormatError("GGUF export needs float weights", tensor="config.json: quantization",
                          expected="a float base, or --dequantize",
                          found="a quantized base", hint="add --dequantize")
    if not gguf_path or os.sep in gguf_path or (os.altsep and os.altsep in gguf_path) \
            or gguf_path in (".", ".."):
        raise FormatError("--gguf-path is a file name inside the output directory",
                          file=gguf_path, expected="a plain file name such as "
                          f"{GGUF_DEFAULT}", found="a path with directories")


def export_gguf(directory: Path, gguf_path: str) -> Path:
    """Write ``directory/gguf_path`` from the fused checkpoint in ``directory`` (complete
    but for its provenance) as a GGUF llama.cpp loads, each weight in the checkpoint's
    dtype, norms F32; returns the file."""
    return write_model_gguf(Path(directory), Path(directory) / gguf_path)


def check_upload(repo: str) -> None:
    """Refuse at once an upload that cannot happen (offline, or a malformed repo id)."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        raise LorakitError("cannot upload: the hub is switched off (HF_HUB_OFFLINE is set)",
                           file=repo, expected="a reachable Hugging Face hub",
                           found=f"HF_HUB_OFFLINE={os.environ['HF_HUB_OFFLINE']}",
                           hint="unset HF_HUB_OFFLINE, or upload the output later with "
                                "`huggingface-cli upload`")
    parts = repo.split("/")
    if len(parts) != 2 or not all(parts):
        raise ArgumentError.bad("--upload-repo", repo, "a hub repo id, owner/name")


def upload(directory: Path, repo: str) -> str:
    """Upload the finished output ``directory`` to the hub repo ``repo`` (created if
    needed), as ``mlx_lm fuse --upload-repo`` does; returns the repo's URL."""
    from huggingface_hub import HfApi  # lazy: only an upload talks to the hub

    api = HfApi()
    try:
        api.create_repo(repo_id=repo, exist_ok=True)
        api.upload_folder(folder_path=str(directory), repo_id=repo, repo_type="model")
    except Exception as e:  # offline, no token, no rights: the hub client's many errors
        raise LorakitError("upload to the hub failed; the fused output is complete on disk",
                           file=directory, expected=f"write access to {repo} on the hub",
                           found=f"{type(e).__name__}: {str(e)[:200]}",
                           hint="log in with `huggingface-cli login` and retry, or upload "
                                "the directory later") from None
    return f"https://huggingface.co/{repo}"
