"""lorakit.synth is a package of one idea per module, keeps its public names, and
writes its outputs through the one output lifecycle (provenance, safe --force)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import lorakit
import lorakit.synth as synth
from lorakit.errors import OutputExistsError
from lorakit.io.output import PROVENANCE
from helpers import tree_hash

PKG = Path(synth.__file__).parent
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=400)


def test_one_idea_per_module_each_short() -> None:
    mods = {p.stem: len(p.read_text().splitlines()) for p in PKG.glob("*.py")}
    assert {"presets", "planning", "sampler", "tokenizer", "checkpoint", "sites",
            "adapter"} <= set(mods)
    assert max(mods.values()) < 450, mods
    assert not (PKG.parent / "synth.py").exists()


def test_public_names_kept() -> None:
    for name in ("synth_checkpoint", "synth_adapter", "presets", "parse_size", "resolve_config",
                 "plan_checkpoint", "write_tokenizer", "PRESETS", "DEFAULT_KEYS"):
        assert hasattr(synth, name), name
    for old in ("synth_checkpoint", "synth_adapter"):  # the old top-level names still work
        with pytest.warns(DeprecationWarning, match=f"lorakit.{old} is deprecated"):
            assert getattr(lorakit, old) is getattr(synth, old)
    assert synth.presets() == list(synth.PRESETS)


@pytest.fixture(scope="module")
def ck(tmp_path_factory) -> Path:
    return synth.synth_checkpoint(tmp_path_factory.mktemp("pkg") / "ck", "qwen3-1.7b",
                                  overrides=TINY, progress=False)


def test_outputs_carry_provenance(ck: Path, tmp_path: Path) -> None:
    doc = json.loads((ck / PROVENANCE).read_text())
    assert doc["kind"] == "synth-checkpoint" and doc["settings"]["model"] == "qwen3-1.7b"
    assert sorted(doc["files"]) == sorted(p.name for p in ck.iterdir() if p.name != PROVENANCE)
    for fmt in ("mlx-lm", "peft"):
        a = synth.synth_adapter(tmp_path / fmt, ck, rank=2, layers=1, format=fmt)
        doc = json.loads((a / PROVENANCE).read_text())
        assert doc["kind"] == "synth-adapter" and doc["settings"]["format"] == fmt
        lorakit.load_adapter(a)  # the provenance file does not confuse the loader


def test_force_replaces_only_lorakit_outputs(ck: Path, tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "adapter_config.json").write_text("{}")
    (mine / "notes.txt").write_text("precious")
    before = tree_hash(mine)
    with pytest.raises(OutputExistsError, match="refusing to replace") as e:
        synth.synth_adapter(mine, ck, rank=2, layers=1, force=True)
    assert "notes.txt" in str(e.value) and tree_hash(mine) == before
    with pytest.raises(OutputExistsError, match="refusing to replace"):
        synth.synth_checkpoint(mine, "qwen3-1.7b", overrides=TINY, progress=False, force=True)
    assert tree_hash(mine) == before
    # an empty directory needs no --force (as before); a previous output needs it
    (tmp_path / "empty").mkdir()
    a = synth.synth_adapter(tmp_path / "empty", ck, rank=2, layers=1)
    with pytest.raises(OutputExistsError, match="already exists"):
        synth.synth_adapter(a, ck, rank=2, layers=1)
    first = tree_hash(a)
    synth.synth_adapter(a, ck, rank=2, layers=1, seed=1, force=True)
    assert tree_hash(a) != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "mine"]  # no temporaries
