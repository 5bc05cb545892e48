"""PEFT's trainable tokens (``trainable_token_indices``): the adapter stores the new values
of chosen embedding rows; lorakit fuses them as ``merge_and_unload`` does (those rows
replaced, bit for bit, a tied head following) and ``check`` tells a row left behind.
Fixtures: ``tests/fixtures/peft/tokens/`` (real PEFT 0.21.2, see peft/README.md)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import run_cli

import lorakit
from lorakit.errors import AdapterError
from lorakit.inspect.check import check
from lorakit.io.formats.checkpoint import Checkpoint
from lorakit.io.formats.safetensors import TensorSpec, read_header
from lorakit.io.outputs.safetensors_write import SafetensorsWriter

ROOT = Path(__file__).resolve().parents[1] / "fixtures" / "peft" / "tokens"
NAMES = ["llama_tied_bf16", "llama_untied_dict_bf16"]
EMB = "model.embed_tokens.weight"


def _differing(a: Path, b: Path) -> list:
    x, y = Checkpoint(a), Checkpoint(b)
    assert set(x.tensors) == set(y.tensors)
    return [n for n in x.tensors if not np.array_equal(x.read(n), y.read(n))]


@pytest.mark.parametrize("name", NAMES)
def test_round_once_is_peft_merge_bit_for_bit(name: str, tmp_path: Path) -> None:
    fx = ROOT / name
    ad = lorakit.load_adapter(fx / "adapter")
    cfg = json.loads((fx / "adapter" / "adapter_config.json").read_text())
    rows = {r.module: list(r.rows) for r in ad.replacements}
    want = cfg["trainable_token_indices"]
    assert rows == ({"model.embed_tokens": want} if isinstance(want, list) else
                    {"model.embed_tokens": want["embed_tokens"], "lm_head": want["lm_head"]})
    res = lorakit.fuse(fx / "base", ad, tmp_path / "out", rounding="round-once", progress=False)
    assert _differing(res.output, fx / "merged") == []
    assert EMB in res.replaced_names and "trainable tokens" in str(res)
    base, out = Checkpoint(fx / "base"), Checkpoint(res.output)
    for r in ad.replacements:  # only the named rows moved
        t = f"{r.module}.weight"
        moved = np.flatnonzero((out.read(t) != base.read(t)).any(axis=1)).tolist()
        assert set(moved) <= set(r.rows) and moved
    rep = check(fx / "merged", fx / "base", ad)  # PEFT's own merge passes
    assert rep.ok and rep.summary["untouched tensors changed"] == 0, str(rep)
    assert sum(r["verdict"] == "replaced" for r in rep.rows) == len(ad.replacements)


def test_tokens_in_memory_fuse(tmp_path: Path) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    from lorakit.fusion.model import fuse_model

    fx = ROOT / "llama_untied_dict_bf16"
    model, _ = load_model(fx / "base")
    fuse_model(model, fx / "adapter")
    params, peft = dict(tree_flatten(model.parameters())), Checkpoint(fx / "merged")
    for n in (EMB, "lm_head.weight"):
        assert np.array_equal(np.array(params[n].view(mx.uint16)), peft.read(n).view(np.uint16))


def test_a_tied_head_stored_beside_the_embedding_follows_it(tmp_path: Path) -> None:
    """A tied checkpoint that also stores lm_head.weight: PEFT ties the head to the token
    adapter, so the head's rows change with the embedding's."""
    fx, base = ROOT / "llama_tied_bf16", tmp_path / "base"
    shutil.copytree(fx / "base", base)
    src = Checkpoint(fx / "base")
    specs = [TensorSpec(n, i.dtype, i.shape) for n, i in src.tensors.items()]
    specs.append(TensorSpec("lm_head.weight", "BF16", src.tensors[EMB].shape))
    with SafetensorsWriter(base / "model.safetensors", specs) as w:
        for n in src.tensors:
            w.write(n, src.read(n))
        w.write("lm_head.weight", src.read(EMB))
    res = lorakit.fuse(base, fx / "adapter", tmp_path / "out", rounding="round-once",
                       progress=False)
    out, peft = Checkpoint(res.output), Checkpoint(fx / "merged")
    assert np.array_equal(out.read("lm_head.weight"), peft.read(EMB))
    assert check(res.output, base, fx / "adapter").ok


def _poke_rows(folder: Path, tensor: str, rows: dict) -> None:
    """Overwrite rows of ``tensor`` in place: row -> raw values."""
    info = next(i for f in folder.glob("*.safetensors")
                for n, i in read_header(f).tensors.items() if n == tensor)
    width = info.nbytes // info.shape[0]
    with open(info.file, "r+b") as f:
        for row, raw in rows.items():
            f.seek(info.begin + row * width)
            f.write(np.ascontiguousarray(raw).tobytes())


def test_check_names_a_row_not_replaced_and_a_stray_row(tmp_path: Path) -> None:
    fx, fused = ROOT / "llama_tied_bf16", tmp_path / "fused"
    shutil.copytree(fx / "merged", fused)
    base = Checkpoint(fx / "base").read(EMB)
    _poke_rows(fused, EMB, {17: base[17]})  # the fuse forgot token 17
    rep = check(fused, fx / "base", fx / "adapter")
    r = next(r for r in rep.rows if r["tensor"] == EMB)
    assert not rep.ok and r["verdict"] == "token rows differ"
    assert "rows [17] are not the trained values" in r["detail"] and "outside" not in r["detail"]
    _poke_rows(fused, EMB, {17: Checkpoint(fx / "merged").read(EMB)[17], 9: base[10]})
    r = next(r for r in check(fused, fx / "base", fx / "adapter").rows if r["tensor"] == EMB)
    assert r["status"] == "wrong" and r["detail"] == \
        "rows [9] outside trainable_token_indices changed"


@pytest.mark.parametrize("edit,words", [
    ({"trainable_token_indices": [3, 17, 200]}, "expected 4 indices for model.embed_tokens"),
    ({"trainable_token_indices": [3, 17, 17, 200]}, "one distinct row index per stored row"),
    ({"trainable_token_indices": {"lm_head": [1, 2, 3, 4]}}, "found None"),
    ({"trainable_token_indices": [3, 17, 200, 256]}, "rows below 256"),
])
def test_token_rows_that_do_not_fit_are_refused_by_name(edit, words, tmp_path: Path) -> None:
    fx, ad = ROOT / "llama_tied_bf16", tmp_path / "ad"
    shutil.copytree(fx / "adapter", ad)
    cfg = json.loads((ad / "adapter_config.json").read_text())
    (ad / "adapter_config.json").write_text(json.dumps(dict(cfg, **edit)))
    with pytest.raises(AdapterError) as e:
        lorakit.fuse(fx / "base", ad, tmp_path / "out", progress=False)
    assert words in str(e.value) and "trainable_tokens_delta" in str(e.value)
    r = run_cli("fuse", "--model", fx / "base", "--adapter-path", ad, "--save-path",
                tmp_path / "cli", "-q")
    assert r.returncode == 2 and "trainable_tokens_delta" in r.stderr
    assert not (tmp_path / "cli").exists() and not (tmp_path / "out").exists()


def test_peft_save_keeps_the_token_rows(tmp_path: Path) -> None:
    fx = ROOT / "llama_untied_dict_bf16"
    out = lorakit.algebra.convert(fx / "adapter", tmp_path / "copy", to="peft")
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["trainable_token_indices"] == {"lm_head": [5, 42],
                                              "model.embed_tokens": [0, 5, 99]}
    res = lorakit.fuse(fx / "base", out, tmp_path / "f", rounding="round-once", progress=False)
    assert _differing(res.output, fx / "merged") == []


def test_tokens_attached_unfused() -> None:
    """attach_adapter (the unfused reference the behaviour verbs use) puts the same rows
    in place as PEFT's merge."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    from lorakit.fusion.model import attach_adapter

    fx = ROOT / "llama_untied_dict_bf16"
    model, _ = load_model(fx / "base")
    attach_adapter(model, fx / "adapter")
    params, peft = dict(tree_flatten(model.parameters())), Checkpoint(fx / "merged")
    for n in (EMB, "lm_head.weight"):
        assert np.array_equal(np.array(params[n].view(mx.uint16)), peft.read(n).view(np.uint16))
