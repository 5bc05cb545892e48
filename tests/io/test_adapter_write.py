"""The adapter writer: every format reads back exactly what was written."""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from lorakit.errors import AdapterError, LorakitError
from lorakit.io.adapters.base import Adapter, LoraTarget
from lorakit.io.adapters.layout import alpha_for
from lorakit.io.adapters.load import load_adapter
from lorakit.io.adapters.write import save_adapter
from lorakit.io.formats.safetensors import read_header

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data" / "adapters"
FIX = ROOT / "tests" / "fixtures" / "peft"


def _by_module(ad):
    return {t.module: t for t in ad.targets}


def _same_targets(a, b):
    ta, tb = _by_module(a), _by_module(b)
    assert sorted(ta) == sorted(tb)
    for m, t in ta.items():
        u = tb[m]
        assert (t.kind, t.scale, t.rank) == (u.kind, u.scale, u.rank), m
        assert t.A.dtype == u.A.dtype == np.float32
        assert np.array_equal(t.A.view(np.uint32), u.A.view(np.uint32)), m
        assert np.array_equal(t.B.view(np.uint32), u.B.view(np.uint32)), m
        assert (t.magnitude is None) == (u.magnitude is None)
        if t.magnitude is not None:
            assert np.array_equal(t.magnitude.view(np.uint32), u.magnitude.view(np.uint32))


@pytest.mark.parametrize("name", ["lora", "dora", "lora-embed", "moe-lora"])
def test_mlx_peft_mlx_round_trip_is_bit_identical(tmp_path, name):
    src = load_adapter(DATA / name)
    peft = load_adapter(save_adapter(src, tmp_path / "peft", format="peft"))
    assert peft.format == "peft"
    back_dir = save_adapter(peft, tmp_path / "mlx", format="mlx-lm")
    back = load_adapter(back_dir)
    _same_targets(src, back)
    cfg_src, cfg_back = src.config, json.loads((back_dir / "adapter_config.json").read_text())
    assert cfg_back["num_layers"] == cfg_src["num_layers"]
    assert cfg_back["fine_tune_type"] == src.fine_tune_type
    p_src, p_back = cfg_src["lora_parameters"], cfg_back["lora_parameters"]
    assert (p_back["rank"], p_back["scale"]) == (p_src["rank"], p_src["scale"])
    assert set(p_back["keys"]) == set(p_src["keys"])
    # the PEFT copy has the same intended delta as the original, per (expert) module
    if name == "moe-lora":
        assert len(peft.targets) > len(src.targets)  # experts split one module each
    else:
        _same_targets(src, _relabel(peft))


def _relabel(ad):
    return ad  # mlx-lm and HF module paths agree for dense models


def test_writer_output_twice_gives_identical_bytes(tmp_path):
    src = load_adapter(DATA / "lora")
    a = save_adapter(src, tmp_path / "a", format="mlx-lm")
    p = save_adapter(load_adapter(a), tmp_path / "p", format="peft")
    b = save_adapter(load_adapter(p), tmp_path / "b", format="mlx-lm")
    assert (a / "adapters.safetensors").read_bytes() == (b / "adapters.safetensors").read_bytes()


def _toy(ranks=(4, 4), scales=(2.0, 2.0), dora=False, seed=0):
    rng = np.random.default_rng(seed)
    ts = []
    for i, (r, s) in enumerate(zip(ranks, scales)):
        A = rng.standard_normal((r, 16)).astype(np.float32)
        B = rng.standard_normal((12, r)).astype(np.float32)
        m = (rng.random(12) + 1).astype(np.float32) if dora else None
        ts.append(LoraTarget(f"model.layers.{i}.self_attn.q_proj", "linear", A, B, s, m))
    return Adapter(Path("/nonexistent/toy"), "mlx-lm", ts, {}, Path("/nonexistent/x"),
                   "dora" if dora else "lora")


def test_per_module_ranks_and_scales_go_to_rank_and_alpha_patterns(tmp_path):
    ad = _toy(ranks=(4, 2), scales=(2.0, 0.1))
    out = save_adapter(ad, tmp_path / "p", format="peft")
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["rank_pattern"] and cfg["alpha_pattern"]
    back = load_adapter(out)
    _same_targets(ad, back)
    with pytest.raises(AdapterError, match="one scale per adapter"):
        save_adapter(ad, tmp_path / "m", format="mlx-lm")
    assert not (tmp_path / "m").exists()
    ad.targets[1].scale = 2.0  # one scale: the rank-2 target is zero-padded to rank 4
    m = load_adapter(save_adapter(ad, tmp_path / "m", format="mlx-lm"))
    for t in ad.targets:
        u = _by_module(m)[t.module]
        assert u.rank == 4
        assert np.array_equal(t.B.astype(np.float64) @ t.A.astype(np.float64),
                              u.B.astype(np.float64) @ u.A.astype(np.float64))


def test_mlx_folds_a_power_of_two_scale_and_refuses_others(tmp_path):
    ad = _toy(scales=(2.0, 8.0))
    back = load_adapter(save_adapter(ad, tmp_path / "m", format="mlx-lm"))
    for t in ad.targets:  # the delta is the same: scale * B, exactly
        u = _by_module(back)[t.module]
        assert np.array_equal(np.float64(t.scale) * t.B, np.float64(u.scale) * u.B)
    with pytest.raises(AdapterError, match="one scale per adapter"):
        save_adapter(_toy(scales=(2.0, 3.0)), tmp_path / "n", format="mlx-lm")
    assert not (tmp_path / "n").exists()


def test_alpha_is_exact_or_refused(tmp_path):
    rng = random.Random(0)
    found_none = None
    for _ in range(2000):
        s, r = rng.random() * 10, rng.choice([1, 2, 3, 5, 8, 12, 48])
        a = alpha_for(s, r)
        if a is None:
            found_none = (s, r)
        else:
            assert a / r == s
    assert alpha_for(20.0, 8) == 160 and isinstance(alpha_for(20.0, 8), int)
    s, r = found_none
    ad = _toy(ranks=(r, r), scales=(s, s))
    with pytest.raises(AdapterError, match="alpha / r exactly"):
        save_adapter(ad, tmp_path / "p", format="peft")
    assert not (tmp_path / "p").exists()
    back = load_adapter(save_adapter(ad, tmp_path / "m", format="mlx-lm"))  # mlx-lm can
    _same_targets(ad, back)


def test_16_bit_factors_only_when_exact(tmp_path):
    ad = _toy()
    with pytest.raises(AdapterError, match="exactly"):
        save_adapter(ad, tmp_path / "b", format="peft", dtype="BF16")
    assert not (tmp_path / "b").exists()
    for t in ad.targets:  # make the values bf16-representable: top 16 bits only
        t.A = (t.A.view(np.uint32) & 0xFFFF0000).view(np.float32)
        t.B = (t.B.view(np.uint32) & 0xFFFF0000).view(np.float32)
    b = save_adapter(ad, tmp_path / "b", format="mlx-lm", dtype="BF16")
    assert {i.dtype for i in read_header(b / "adapters.safetensors").tensors.values()} == {"BF16"}
    p = save_adapter(load_adapter(b), tmp_path / "p", format="peft")  # keeps the file's dtype
    assert {i.dtype for i in read_header(p / "adapter_model.safetensors").tensors.values()} \
        == {"BF16"}
    b2 = save_adapter(load_adapter(p), tmp_path / "b2", format="mlx-lm")
    assert (b / "adapters.safetensors").read_bytes() == (b2 / "adapters.safetensors").read_bytes()
    _same_targets(ad, load_adapter(b2))


def test_dora_peft_fixture_and_modules_to_save_round_trip(tmp_path):
    for name in ("llama_dora_bf16", "llama_modules_to_save_bf16", "llama_embedding_bf16",
                 "qwen3_rslora_patterns"):
        src = load_adapter(FIX / name / "adapter")
        back = load_adapter(save_adapter(src, tmp_path / name, format="peft"))
        _same_targets(src, back)
        assert [(r.module, r.leaf, r.code) for r in src.replacements] == \
            [(r.module, r.leaf, r.code) for r in back.replacements]
        for r, q in zip(src.replacements, back.replacements):
            assert np.array_equal(r.raw, q.raw)
    with pytest.raises(AdapterError, match="whole tensors"):
        save_adapter(load_adapter(FIX / "llama_modules_to_save_bf16" / "adapter"),
                     tmp_path / "mts-mlx", format="mlx-lm")


def test_peft_embedding_layout_is_pefts(tmp_path):
    out = save_adapter(load_adapter(DATA / "lora-embed"), tmp_path / "p", format="peft")
    h = read_header(out / "adapter_model.safetensors").tensors
    ea = h["base_model.model.model.embed_tokens.lora_embedding_A"].shape
    eb = h["base_model.model.model.embed_tokens.lora_embedding_B"].shape
    assert ea[0] == eb[1] == 8 and ea[1] > eb[0]  # (r, vocab), (dims, r)


def test_never_overwrites_user_files(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(LorakitError):
        save_adapter(_toy(), tmp_path / "mine", format="peft", force=True)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    out = save_adapter(_toy(), tmp_path / "ok", format="peft")
    save_adapter(_toy(seed=1), out, format="peft", force=True)  # a lorakit output: replaced
    with pytest.raises(LorakitError):
        save_adapter(_toy(), out, format="peft")


def test_llama_cpp_notes_name_what_its_converter_drops(tmp_path):
    def notes(out):
        return json.loads((out / "lorakit.json").read_text())["settings"]["llama_cpp_convert"]

    out = save_adapter(_toy(ranks=(4, 4), scales=(2.0, 0.5)), tmp_path / "p", format="peft")
    assert notes(out) == ["alpha_pattern is ignored (lora_alpha is used for every module)"]
    assert notes(save_adapter(_toy(), tmp_path / "q", format="peft")) == []
    assert "DoRA magnitudes are refused" in notes(
        save_adapter(_toy(dora=True), tmp_path / "d", format="peft"))
