"""The fused checkpoint's README.md: the model card `mlx_lm fuse` writes (same metadata,
through huggingface_hub's ModelCard), with lorakit's provenance as its text."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import REPO as ROOT

import lorakit
from lorakit.io.outputs.provenance import foreign_entries

BASE = ROOT / "data" / "tiny-qwen3"
ADAPTER = ROOT / "data" / "adapters" / "lora"


def _front_matter(text: str) -> str:
    assert text.startswith("---\n"), text[:80]
    return text.split("---\n")[1]


def test_card_has_mlx_lm_metadata_and_lorakit_provenance(tmp_path: Path) -> None:
    from huggingface_hub import ModelCard
    from mlx_lm.utils import create_model_card

    r = lorakit.fuse(BASE, ADAPTER, tmp_path / "out", rounding="mlx-lm", progress=False)
    card = ModelCard.load(r.output / "README.md")
    (tmp_path / "ref").mkdir()
    create_model_card(tmp_path / "ref", None)  # what mlx_lm fuse writes for a local base
    ref = ModelCard.load(tmp_path / "ref" / "README.md")
    for key in ("library_name", "pipeline_tag", "language"):
        assert getattr(card.data, key) == getattr(ref.data, key), key
    assert set(ref.data.tags) <= set(card.data.tags) and "lorakit" in card.data.tags
    text = card.text
    assert lorakit.load_adapter(ADAPTER).sha256 in text
    assert "rounding: `mlx-lm`" in text and "dtype policy: `preserve`" in text
    # the card is one of the files lorakit.json vouches for (so --force may replace it)
    assert foreign_entries(r.output) == []


def test_base_card_metadata_is_kept(tmp_path: Path) -> None:
    base = tmp_path / "base"
    shutil.copytree(BASE, base)
    (base / "README.md").write_text("---\nlicense: apache-2.0\ntags:\n- bible\n---\n# Base\n\n"
                                    "The base's own text.\n")
    r = lorakit.fuse(base, ADAPTER, tmp_path / "out", progress=False)
    text = (r.output / "README.md").read_text()
    meta = _front_matter(text)
    assert "license: apache-2.0" in meta and "- bible" in meta and "- mlx" in meta
    assert "The base's own text." not in text  # the text is the fuse's, as in mlx-lm
    assert "# base + lora" in text


@pytest.mark.parametrize("junk", ["not a card at all", "---\n: [\n---\nbroken yaml\n"])
def test_a_base_readme_that_is_no_card_gets_the_template(tmp_path: Path, junk: str) -> None:
    base = tmp_path / "base"
    shutil.copytree(BASE, base)
    (base / "README.md").write_text(junk)
    r = lorakit.fuse(base, ADAPTER, tmp_path / "out", progress=False)
    assert "library_name: mlx" in _front_matter((r.output / "README.md").read_text())


# -- mlx_lm fuse's flags: defaults, --export-gguf (tests/io/test_gguf.py), --upload-repo, --trust-remote-code ---------
@pytest.mark.parametrize("why, kwargs, says", [
    ("architecture", {}, "does not support this architecture"),
    ("path", {"name": "sub/m.gguf"}, "a file name inside the output directory"),
])
def test_export_gguf_refusals_write_nothing(tmp_path: Path, why: str, kwargs: dict,
                                            says: str) -> None:
    from model_factory import make_adapter, make_model

    from lorakit.errors import FormatError

    # phi3: not an architecture the GGUF writer converts (lorakit.io.outputs.gguf.GGUF_ARCHS)
    base = make_model(tmp_path / "base", "llama" if why == "path" else "phi3")
    adapter = make_adapter(base, tmp_path / "ad", keys=("self_attn.o_proj",))
    with pytest.raises(FormatError, match=says):
        lorakit.fuse(base, adapter, tmp_path / "out", export_gguf=kwargs.get("name", "m.gguf"),
                     progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_cli_takes_mlx_lm_fuse_defaults_and_flags(tmp_path: Path) -> None:
    """`lorakit fuse` run where mlx_lm fuse would be: mlx_model/ and adapters/ found by
    default, fused_model/ written; --trust-remote-code accepted; --upload-repo refused
    at once, before any work, when the hub is switched off."""
    import subprocess
    import sys

    from helpers import cli_env

    shutil.copytree(BASE, tmp_path / "mlx_model")
    shutil.copytree(ADAPTER, tmp_path / "adapters")
    env = cli_env()
    r = subprocess.run([sys.executable, "-m", "lorakit", "fuse", "-q", "--trust-remote-code"],
                       cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "fused_model" / "README.md").is_file()
    r = subprocess.run([sys.executable, "-m", "lorakit", "fuse", "-q", "--save-path", "up",
                        "--upload-repo", "someone/fused"], cwd=tmp_path,
                       env=dict(env, HF_HUB_OFFLINE="1"), capture_output=True, text=True)
    assert r.returncode == 2 and "cannot upload: the hub is switched off" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "up").exists()
