"""The fused checkpoint's README.md: the model card `mlx_lm fuse` writes (same metadata,
through huggingface_hub's ModelCard), with lorakit's provenance as its text."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import lorakit
from lorakit.io.provenance import foreign_entries

from helpers import REPO as ROOT

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
    assert "(base)" not in text and "# out" in text


@pytest.mark.parametrize("junk", ["not a card at all", "---\n: [\n---\nbroken yaml\n"])
def test_a_base_readme_that_is_no_card_gets_the_template(tmp_path: Path, junk: str) -> None:
    base = tmp_path / "base"
    shutil.copytree(BASE, base)
    (base / "README.md").write_text(junk)
    r = lorakit.fuse(base, ADAPTER, tmp_path / "out", progress=False)
    assert "library_name: mlx" in _front_matter((r.output / "README.md").read_text())
