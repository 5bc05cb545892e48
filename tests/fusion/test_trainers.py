"""Adapters as other trainers write them (``tests/fixtures/peft/trainers/``: mergekit's real
``extract-lora``; LLaMA-Factory's and axolotl's LoraConfig fields, saved by real PEFT):
each fused bit for bit as PEFT's ``merge_and_unload`` (``--rounding round-once``) and
checked, or refused by name."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import run_cli

import lorakit
from lorakit.errors import AdapterError
from lorakit.inspect.check import check
from lorakit.io.formats.checkpoint import Checkpoint

ROOT = Path(__file__).resolve().parents[1] / "fixtures" / "peft" / "trainers"
#: fixture -> what lorakit must read in it: (targets, replaced modules, DoRA, token rows)
READ = {
    "mergekit_tied": (14, ["lm_head", "model.embed_tokens", "norm"], False, None),
    "mergekit_untied": (14, ["lm_head", "model.embed_tokens", "norm"], False, None),
    "mergekit_embed_lora": (16, ["norm"], False, None),
    "llamafactory_rslora_resize": (14, ["lm_head", "model.embed_tokens"], False, None),
    "llamafactory_dora": (14, [], True, None),
    "axolotl_patterns_tokens": (7, ["model.embed_tokens"], False, (1, 2)),
}


@pytest.mark.parametrize("name", sorted(READ))
def test_fused_as_peft_merges_it(name: str, tmp_path: Path) -> None:
    fx = ROOT / name
    ad = lorakit.load_adapter(fx / "adapter")
    n, saved, dora, rows = READ[name]
    assert len(ad.targets) == n and ad.is_dora == dora
    assert sorted({"norm" if r.module.endswith("norm") else r.module
                   for r in ad.replacements}) == saved
    assert rows is None or [r.rows for r in ad.replacements] == [rows]
    res = lorakit.fuse(fx / "base", ad, tmp_path / "out", rounding="round-once", progress=False)
    ours, peft = Checkpoint(res.output), Checkpoint(fx / "merged")
    assert [t for t in ours.tensors if not np.array_equal(ours.read(t), peft.read(t))] == []
    # PEFT unties a tied head that modules_to_save copied (mergekit writes the head's copy
    # beside the embedding's); the tied checkpoint keeps one tensor with those values
    extra = set(peft.tensors) - set(ours.tensors)
    assert extra == ({"lm_head.weight"} if name == "mergekit_tied" else set())
    for t in extra:
        assert np.array_equal(peft.read(t), ours.read("model.embed_tokens.weight"))
    rep = check(res.output, fx / "base", ad)
    assert rep.ok and rep.summary["untouched tensors changed"] == 0, str(rep)


def test_axolotl_layers_and_patterns_are_read() -> None:
    ad = lorakit.load_adapter(ROOT / "axolotl_patterns_tokens" / "adapter")
    assert {t.module.split(".")[2] for t in ad.targets} == {"1"}  # layers_to_transform [1]
    by = {t.module.rsplit(".", 1)[1]: t for t in ad.targets}
    assert by["down_proj"].rank == 4 and by["o_proj"].scale == 4 / 8 and by["q_proj"].scale == 2


def test_a_trainer_field_lorakit_cannot_merge_is_refused_by_name(tmp_path: Path) -> None:
    fx = ROOT / "axolotl_layer_replication"
    with pytest.raises(AdapterError) as e:
        lorakit.load_adapter(fx / "adapter")
    assert "unsupported PEFT feature: layer_replication" in str(e.value)
    r = run_cli("fuse", "--model", fx / "base", "--adapter-path", fx / "adapter",
                "--save-path", tmp_path / "out", "-q")
    assert r.returncode == 2 and "layer_replication" in r.stderr
    assert not (tmp_path / "out").exists()


def test_a_tied_head_copy_that_is_not_the_embeddings_is_refused(tmp_path: Path) -> None:
    """On a tied checkpoint the head's copy can only be dropped when it is the embedding's."""
    fx, ad = ROOT / "mergekit_tied", tmp_path / "ad"
    shutil.copytree(fx / "adapter", ad)
    from lorakit.io.formats.safetensors import read_header

    info = read_header(ad / "adapter_model.safetensors").tensors["base_model.model.lm_head.weight"]
    with open(ad / "adapter_model.safetensors", "r+b") as f:
        f.seek(info.begin)
        f.write(np.array([0x3F80], dtype=np.uint16).tobytes())  # element 0 becomes 1.0
    with pytest.raises(AdapterError) as e:
        lorakit.fuse(fx / "base", ad, tmp_path / "out", progress=False)
    assert "lm_head.weight: no tensor lm_head.weight" in str(e.value)
    assert "not the embedding's copy" in str(e.value) and not (tmp_path / "out").exists()
