"""Where a fused checkpoint goes after lorakit writes it, as ``mlx_lm fuse`` sends it:
a GGUF file through mlx-lm's own writer (``--export-gguf``), the hub through
``huggingface_hub`` (``--upload-repo``). Both are checked before the fuse starts, so
a refusal costs nothing.

>>> check_gguf_export({"model_type": "qwen3"}, False, "ggml-model-f16.gguf")
Traceback (most recent call last):
lorakit.errors.FormatError: GGUF export does not support this architecture ...
"""
from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path
from typing import Any, Mapping

from ..errors import FormatError, LorakitError

__all__ = ["check_gguf_export", "export_gguf", "check_upload", "upload"]

#: architectures mlx-lm's GGUF writer converts (mlx_lm/fuse.py)
GGUF_MODEL_TYPES = ("llama", "mixtral", "mistral")
#: mlx_lm fuse's default GGUF file name
GGUF_DEFAULT = "ggml-model-f16.gguf"


def check_gguf_export(config: Mapping[str, Any], dequantize: bool, gguf_path: str) -> None:
    """Refuse, before any work, an export mlx-lm's GGUF writer cannot do."""
    model_type = config.get("model_type")
    if model_type not in GGUF_MODEL_TYPES:
        raise FormatError("GGUF export does not support this architecture",
                          tensor="config.json: model_type",
                          expected=f"one of {', '.join(GGUF_MODEL_TYPES)} (what mlx-lm's "
                                   "GGUF writer converts)",
                          found=repr(model_type),
                          hint="fuse without --export-gguf, then convert with llama.cpp's "
                               "convert_hf_to_gguf.py")
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
    but for its provenance) with mlx-lm's GGUF writer; returns the file."""
    from mlx.utils import tree_flatten  # lazy: MLX only for an export
    from mlx_lm.gguf import convert_to_gguf  # lazy: mlx-lm's writer, only for an export
    from mlx_lm.utils import load_model  # lazy: as above

    config = json.loads((directory / "config.json").read_text())
    # the model's own parameter order, as mlx_lm fuse hands them over (same bytes)
    model, _ = load_model(directory, lazy=True)
    weights = dict(tree_flatten(model.parameters()))
    out = directory / gguf_path
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # its prints name the temporary
            convert_to_gguf(directory, weights, config, str(out))
    except Exception as e:  # mlx-lm's writer raises plain errors; name what failed
        raise FormatError("GGUF export failed in mlx-lm's writer", file=out,
                          expected="a checkpoint mlx-lm can convert",
                          found=f"{type(e).__name__}: {str(e)[:200]}") from None
    return out


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
        raise LorakitError("--upload-repo is not a hub repo id", file=repo,
                           expected="owner/name", found=repr(repo))


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
