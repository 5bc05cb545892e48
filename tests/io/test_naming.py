"""Adapter targets land on the right tensors whatever the naming: mlx-lm and HF layouts,
stacked and per-expert MoE weights, mixtral's w1/w2/w3, prefixed multimodal names."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import model_factory as mf
import numpy as np
import pytest

import lorakit
from lorakit.errors import AdapterError
from lorakit.io.adapters.naming import bind
from lorakit.io.formats.checkpoint import Checkpoint
from lorakit.io.formats.safetensors import TensorSpec
from lorakit.io.outputs.safetensors_write import SafetensorsWriter


def rewrite(src: Path, dst: Path, rename) -> Path:
    """Copy a checkpoint, mapping each tensor (name, raw) through ``rename`` -> list of
    (name, raw); writes one shard."""
    ck = Checkpoint(src)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    out = []
    for name, info in ck.tensors.items():
        for n, raw in rename(name, ck.read(name)):
            out.append((n, info.dtype, raw))
    plan = [TensorSpec(n, d, tuple(r.shape)) for n, d, r in out]
    with SafetensorsWriter(dst / "model.safetensors", plan, {"format": "pt"}) as w:
        for n, _, r in out:
            w.write(n, r)
    return dst


def unstack_experts(mixtral: bool = False):
    leaf = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}

    def f(name, raw):
        if ".switch_mlp." not in name:
            return [(name, raw)]
        head, tail = name.split(".switch_mlp.")
        proj, kind = tail.split(".")
        if mixtral:
            head = head.replace(".mlp", ".block_sparse_moe")
            proj = leaf[proj]
        return [(f"{head}.experts.{e}.{proj}.{kind}", raw[e]) for e in range(raw.shape[0])]
    return f


def test_stacked_adapter_on_per_expert_checkpoint(tmp_path: Path) -> None:
    base = mf.make_model(tmp_path / "mlx", "qwen3_moe")
    adapter = mf.make_adapter(base, tmp_path / "ad", keys=(
        "mlp.switch_mlp.gate_proj", "mlp.switch_mlp.down_proj", "self_attn.q_proj"))
    hf = rewrite(base, tmp_path / "hf", unstack_experts())
    a = lorakit.fuse(base, adapter, tmp_path / "f-mlx", progress=False)
    b = lorakit.fuse(hf, adapter, tmp_path / "f-hf", progress=False)
    assert b.tensors_fused == 2 * (4 + 4) + 2  # 2 layers x (4 gate + 4 down experts) + 2 q
    ca, cb = Checkpoint(a.output), Checkpoint(b.output)
    for name in ca.tensors:
        if ".switch_mlp." in name:
            head, tail = name.split(".switch_mlp.")
            parts = [cb.read(f"{head}.experts.{e}.{tail}") for e in range(4)]
            np.testing.assert_array_equal(np.stack(parts), ca.read(name))
        else:
            np.testing.assert_array_equal(cb.read(name), ca.read(name))


def test_mixtral_names(tmp_path: Path) -> None:
    base = mf.make_model(tmp_path / "mlx", "qwen3_moe")
    adapter = mf.make_adapter(base, tmp_path / "ad", keys=("mlp.switch_mlp.up_proj",))
    # a mixtral-style checkpoint keeps experts under block_sparse_moe.experts.{e}.w1/w2/w3
    mix = rewrite(base, tmp_path / "mix", unstack_experts(mixtral=True))
    ad = lorakit.load_adapter(adapter)
    for t in ad.targets:
        t.module = t.module.replace(".mlp.", ".block_sparse_moe.")
    ad.config["lora_parameters"]["keys"] = ["block_sparse_moe.switch_mlp.up_proj"]
    binds = bind(ad, Checkpoint(mix))
    assert sorted({b.tensor.split(".")[-2] for b in binds}) == ["w3"]
    assert len(binds) == 2 * 4


def test_per_expert_peft_targets_on_stacked_checkpoint(tmp_path: Path) -> None:
    base = mf.make_model(tmp_path / "mlx", "qwen3_moe")
    ck = Checkpoint(base)
    stacked = ck.info("model.layers.0.mlp.switch_mlp.gate_proj.weight")
    e_count, out_dim, in_dim = stacked.shape
    rng = np.random.default_rng(0)
    ad = tmp_path / "peft"
    ad.mkdir()
    tensors = {}
    for e in (1, 3):
        p = f"base_model.model.model.layers.0.mlp.experts.{e}.gate_proj"
        tensors[f"{p}.lora_A.weight"] = rng.normal(0, 0.1, (2, in_dim)).astype(np.float32)
        tensors[f"{p}.lora_B.weight"] = rng.normal(0, 0.1, (out_dim, 2)).astype(np.float32)
    plan = [TensorSpec(n, "F32", v.shape) for n, v in tensors.items()]
    with SafetensorsWriter(ad / "adapter_model.safetensors", plan) as w:
        for n, v in tensors.items():
            w.write(n, v)
    (ad / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["gate_proj"]}))
    res = lorakit.fuse(base, ad, tmp_path / "out", progress=False)
    assert res.tensors_fused == 1  # one stacked tensor, two of its experts changed
    before = ck.read("model.layers.0.mlp.switch_mlp.gate_proj.weight")
    after = Checkpoint(res.output).read("model.layers.0.mlp.switch_mlp.gate_proj.weight")
    changed = [bool((before[e] != after[e]).any()) for e in range(e_count)]
    assert changed == [False, True, False, True]


def test_prefixed_multimodal_names(tmp_path: Path) -> None:
    base = mf.make_model(tmp_path / "mlx", "llama")
    adapter = mf.make_adapter(base, tmp_path / "ad", keys=("self_attn.q_proj",))
    pre = rewrite(base, tmp_path / "vlm", lambda n, r: [("language_model." + n, r)])
    binds = bind(lorakit.load_adapter(adapter), Checkpoint(pre))
    assert binds and all(b.tensor.startswith("language_model.model.layers.") for b in binds)


def test_unmatched_targets_are_all_listed(tmp_path: Path) -> None:
    base = mf.make_model(tmp_path / "m", "llama")
    adapter = mf.make_adapter(base, tmp_path / "ad", keys=("self_attn.q_proj",))
    ad = lorakit.load_adapter(adapter)
    ad.targets[0].module = "model.layers.0.self_attn.nope"
    ad.targets[1].module = "model.layers.1.self_attn.nada"
    with pytest.raises(AdapterError) as e:
        bind(ad, Checkpoint(base))
    msg = str(e.value)
    assert "2 of 2 targets" in msg and "nope" in msg and "nada" in msg
    assert str(ad.weights_file) in msg
