"""The transformers (per-expert) layout of a fused MoE checkpoint (lorakit/io/outputs/hf_layout.py):
every expert tensor is the stacked fuse's slice, bit for bit; the names are the ones
transformers saves (``synth_checkpoint(layout="hf")``, itself checked against mlx-lm's
``sanitize()``); mlx-lm reads it back; unknown families and quantized experts are refused
before anything is written; the report says which layout was written."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import DATA

import lorakit
from lorakit.errors import ArgumentError, FuseError
from lorakit.fusion.options import FuseOptions
from lorakit.io.formats.safetensors import read_header, read_raw
from lorakit.io.outputs.hf_layout import FAMILIES, LAYOUT_NOTES
from lorakit.synth import synth_adapter, synth_checkpoint

MOE = DATA / "tiny-qwen3-moe"
MOE_LORA = DATA / "adapters" / "moe-lora"

_SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, vocab_size=300, max_position_embeddings=64,
              rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
#: one tiny config per family of the mapping (mlx-lm builds each)
CONFIGS = {
    "qwen2_moe": dict(_SMALL, model_type="qwen2_moe", num_experts=3, num_experts_per_tok=2,
                      moe_intermediate_size=16, shared_expert_intermediate_size=32,
                      decoder_sparse_step=1, mlp_only_layers=[]),
    "olmoe": dict(_SMALL, model_type="olmoe", num_experts=3, num_experts_per_tok=2,
                  norm_topk_prob=False),
    "mixtral": dict(_SMALL, model_type="mixtral", num_local_experts=3, num_experts_per_tok=2),
    "phimoe": dict(_SMALL, model_type="phimoe", num_local_experts=3, num_experts_per_tok=2,
                   sliding_window=64, max_position_embeddings=64,
                   original_max_position_embeddings=64,
                   rope_scaling={"type": "longrope", "short_factor": [1.0] * 8,
                                 "long_factor": [1.0] * 8, "short_mscale": 1.0,
                                 "long_mscale": 1.0}),
}


def _tensors(folder: Path) -> dict:
    """name -> raw storage (bf16 as uint16 bits) of every shard in ``folder``."""
    out = {}
    for p in sorted(folder.glob("*.safetensors")):
        out.update({k: read_raw(v) for k, v in read_header(p).tensors.items()})
    return out


def _both(base: Path, adapter: Path, tmp: Path):
    a = lorakit.fuse(base, adapter, tmp / "stacked", progress=False)
    b = lorakit.fuse(base, adapter, tmp / "experts", progress=False, layout="transformers")
    return a, b, _tensors(tmp / "stacked"), _tensors(tmp / "experts")


def _check_slices(stacked: dict, experts: dict, family: str, n: int) -> int:
    """Every expert tensor equals its stacked slice bit for bit; returns how many."""
    fam = FAMILIES[family]
    seen = 0
    for name, arr in stacked.items():
        if ".switch_mlp." not in name:
            assert np.array_equal(experts[name].view(np.uint8), arr.view(np.uint8)), name
            continue
        assert arr.shape[0] == n
        for e in range(n):
            got = experts.pop(fam.name(name, e))
            assert got.dtype == arr.dtype and got.shape == arr.shape[1:]
            assert got.tobytes() == arr[e].tobytes(), (name, e)
            seen += 1
    assert not any(".switch_mlp." in k for k in experts)
    return seen


def test_embedded_qwen3_moe_per_expert_bit_identical(tmp_path):
    a, b, stacked, experts = _both(MOE, MOE_LORA, tmp_path)
    n_stacked = sum(".switch_mlp." in k for k in stacked)
    assert _check_slices(stacked, dict(experts), "qwen3_moe", 4) == n_stacked * 4
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in experts
    # the index lists exactly the tensors written, the config is the base's
    index = json.loads((tmp_path / "experts" / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(experts)
    assert index["metadata"]["total_size"] == b.bytes_written
    assert json.loads((tmp_path / "experts" / "config.json").read_text()) == \
        json.loads((MOE / "config.json").read_text())
    # the report: which layout was written, and who reads it
    assert (a.layout, b.layout) == ("mlx-lm", "transformers")
    assert b.layout_note == LAYOUT_NOTES["transformers"] and "mlx-lm" in a.layout_note
    assert f"layout          {LAYOUT_NOTES['transformers']}" in str(b)
    assert "transformers&#x27; per-expert" in b._repr_html_() or \
        "transformers' per-expert" in b._repr_html_()
    assert b.to_dict()["layout"] == "transformers"
    assert b.tensors_total == len(experts) and a.tensors_total == len(stacked)
    assert json.loads((tmp_path / "experts" / "lorakit.json").read_text())["settings"][
        "layout"] == "transformers"


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_each_family_names_as_transformers_saves_them(tmp_path, family):
    cfg = CONFIGS[family]
    base = synth_checkpoint(tmp_path / "base", cfg, progress=False)
    hf = synth_checkpoint(tmp_path / "hf", cfg, layout="hf", progress=False)
    ad = synth_adapter(tmp_path / "ad", base, rank=2, layers=2, keys=("q", "gate", "down"))
    a, b, stacked, experts = _both(base, ad, tmp_path)
    assert a.tensors_fused == b.tensors_fused > 0
    n = cfg.get("num_experts", cfg.get("num_local_experts"))
    assert _check_slices(stacked, dict(experts), family, n) > 0
    # the names and shapes transformers saves (synth's hf layout, checked by sanitize())
    want = {k: v.shape for k, v in _tensors(hf).items()}
    assert {k: v.shape for k, v in experts.items()} == want
    # and mlx-lm's own sanitize() stacks them back into the stacked fuse, bit for bit
    # (this is what tells w1 from w3: their shapes are equal)
    assert _sanitized(family, base, experts) == {k: v.tobytes() for k, v in stacked.items()}


def _sanitized(family: str, base: Path, experts: dict) -> dict:
    import importlib

    import mlx.core as mx

    mod = importlib.import_module(f"mlx_lm.models.{family}")
    cfg = json.loads((base / "config.json").read_text())
    model = mod.Model(mod.ModelArgs.from_dict(cfg))
    arrays = {k: mx.array(v).view(mx.bfloat16) for k, v in experts.items()}
    back = model.sanitize(arrays)
    return {k: np.array(v.view(mx.uint16)).tobytes() for k, v in back.items()}


def test_mlx_lm_reads_the_transformers_layout(tmp_path):
    mx = pytest.importorskip("mlx.core")
    from mlx_lm import load

    lorakit.fuse(MOE, MOE_LORA, tmp_path / "stacked", progress=False)
    lorakit.fuse(MOE, MOE_LORA, tmp_path / "experts", progress=False, layout="transformers")
    x = mx.array([[1, 5, 9, 200, 7]])
    logits = []
    for sub in ("stacked", "experts"):
        model, _ = load(str(tmp_path / sub))
        model.set_dtype(mx.float32)  # MLX's CPU GatherMM is float32 only (same weights)
        out = model(x)
        mx.eval(out)
        logits.append(np.array(out.astype(mx.float32)))
    assert np.array_equal(logits[0], logits[1])


def _moe_copy(tmp_path: Path, **config) -> Path:
    dst = tmp_path / "moe"
    shutil.copytree(MOE, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(config)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_unknown_family_refused_before_any_work(tmp_path):
    base = _moe_copy(tmp_path, model_type="granitemoe")
    out = tmp_path / "out"
    with pytest.raises(FuseError) as e:
        lorakit.fuse(base, MOE_LORA, out, progress=False, layout="transformers")
    msg = str(e.value)
    assert "no transformers layout is known" in msg and "config.json" in msg
    assert "granitemoe" in msg and "qwen3_moe" in msg and "switch_mlp" in msg
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["moe"]


def test_expert_count_mismatch_leaves_nothing(tmp_path):
    base = _moe_copy(tmp_path, num_experts=5)  # the tensors stack 4
    out = tmp_path / "out"
    with pytest.raises(FuseError) as e:
        lorakit.fuse(base, MOE_LORA, out, progress=False, layout="transformers")
    assert "one row per expert" in str(e.value) and "[5, ...]" in str(e.value)
    assert "[4, " in str(e.value)
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["moe"]


def test_dense_model_same_either_way(tmp_path):
    base, ad = DATA / "tiny-qwen3", DATA / "adapters" / "lora"
    a, b, stacked, experts = _both(base, ad, tmp_path)
    assert a.layout_note == b.layout_note == "" and "layout" not in str(b)
    assert stacked.keys() == experts.keys()
    for k in stacked:
        assert stacked[k].tobytes() == experts[k].tobytes()


def test_layout_option_checked():
    with pytest.raises(ArgumentError, match=r"for layout\n  expected: mlx-lm \| transformers"):
        FuseOptions(layout="hf")
    assert FuseOptions(layout="transformers").settings()["layout"] == "transformers"
    assert "layout" not in FuseOptions().settings()


def test_quantized_experts_refused_unless_dequantized(tmp_path):
    from mlx_lm import convert

    q = tmp_path / "moe-4bit"
    convert(str(MOE), str(q), quantize=True, q_bits=4, q_group_size=64)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(FuseError) as e:
        lorakit.fuse(q, MOE_LORA, tmp_path / "out", progress=False, layout="transformers")
    assert "needs float weights" in str(e.value) and "--dequantize" in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    r = lorakit.fuse(q, MOE_LORA, tmp_path / "out", progress=False, layout="transformers",
                     dequantize=True)
    names = list(_tensors(tmp_path / "out"))
    assert r.layout == "transformers" and "model.layers.0.mlp.experts.3.up_proj.weight" in names
    assert not any(n.endswith((".scales", ".biases")) or ".switch_mlp." in n for n in names)
