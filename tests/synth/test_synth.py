"""Synthetic checkpoints and adapters: real shapes, real files, loadable by mlx-lm and lorakit,
written through the one output lifecycle (provenance, a safe ``force``)."""
from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers import tree_hash
from mlx.utils import tree_flatten

import lorakit
import lorakit.synth as synth
from lorakit import numerics as nm
from lorakit.cli.main import main
from lorakit.errors import AdapterError, FormatError, OutputExistsError
from lorakit.io.adapters.load import load_adapter
from lorakit.io.adapters.naming import bind
from lorakit.io.formats.checkpoint import Checkpoint
from lorakit.io.formats.safetensors import read_header
from lorakit.io.outputs.directory import PROVENANCE
from lorakit.synth import PRESETS, parse_size, plan_checkpoint, synth_adapter, synth_checkpoint

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=600)
TINY_MOE = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                num_experts=4, num_experts_per_tok=2, vocab_size=600)


def _logits(model, tok, text="hello world"):
    if any("switch_mlp" in k for k, _ in tree_flatten(model.parameters())):
        # MLX's CPU backend runs gather_mm (MoE experts) in float32 only
        model.set_dtype(mx.float32)
    out = model(mx.array([tok.encode(text)]))
    mx.eval(out)
    return out


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Path:
    return synth_checkpoint(tmp_path_factory.mktemp("synth") / "qwen", "qwen3-1.7b",
                            overrides=TINY, progress=False)


@pytest.fixture(scope="module")
def moe_hf(tmp_path_factory) -> Path:
    return synth_checkpoint(tmp_path_factory.mktemp("synth") / "moe-hf", "qwen3-moe",
                            overrides=TINY_MOE, layout="hf", progress=False)


@pytest.fixture(scope="module")
def moe_mlx(tmp_path_factory) -> Path:
    return synth_checkpoint(tmp_path_factory.mktemp("synth") / "moe-mlx", "qwen3-moe",
                            overrides=TINY_MOE, layout="mlx", progress=False)


# -- shapes ---------------------------------------------------------------------------------
@pytest.mark.parametrize("preset,params,tensors", [
    ("qwen3-1.7b", 1_720_574_976, 310),  # published: 1.7B (tied embedding)
    ("llama-3.2-1b", 1_235_814_400, 146),  # published: 1.23B
    ("llama-3.1-8b", 8_030_261_248, 291),  # published: 8.03B
    ("qwen3-30b-a3b", 30_532_122_624, 579),  # published: 30.5B
])
def test_presets_have_the_published_parameter_counts(preset, params, tensors):
    plan = plan_checkpoint(PRESETS[preset])
    assert sum(int(np.prod(s)) for _, s in plan) == params
    assert len(plan) == tensors


def test_hf_layout_of_moe_preset_splits_experts():
    mlx = dict(plan_checkpoint(PRESETS["qwen3-30b-a3b"], "mlx"))
    hf = dict(plan_checkpoint(PRESETS["qwen3-30b-a3b"], "hf"))
    assert mlx["model.layers.0.mlp.switch_mlp.gate_proj.weight"] == (128, 768, 2048)
    assert hf["model.layers.0.mlp.experts.127.gate_proj.weight"] == (768, 2048)
    assert hf["model.layers.47.mlp.experts.0.down_proj.weight"] == (2048, 768)
    assert not any("switch_mlp" in n for n in hf)
    assert len(hf) == len(mlx) - 3 * 48 + 3 * 48 * 128
    assert sum(np.prod(s) for s in hf.values()) == sum(np.prod(s) for s in mlx.values())


def test_parse_size():
    assert parse_size("2GB") == 2_000_000_000
    assert parse_size("1.5GiB") == 3 * 2**29
    assert parse_size("64kb") == 64_000
    assert parse_size(123) == 123
    with pytest.raises(FormatError, match="cannot read a size"):
        parse_size("two gigs")
    with pytest.raises(FormatError, match="positive"):
        parse_size(0)


# -- checkpoints ----------------------------------------------------------------------------
def test_tiny_qwen_loads_and_generates_in_mlx_lm(qwen):
    import mlx_lm

    cfg = json.loads((qwen / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["tie_word_embeddings"] is True
    assert cfg["torch_dtype"] == "bfloat16" and cfg["rope_theta"] == 1000000
    assert list(cfg) == sorted(cfg)  # as mlx-lm's save_config writes it
    model, tok = mlx_lm.load(str(qwen))
    logits = _logits(model, tok)
    assert logits.shape == (1, 11, 600)
    assert mx.isfinite(logits).all().item()
    assert 0.1 < mx.std(logits.astype(mx.float32)).item() < 10
    text = mlx_lm.generate(model, tok, "hello world", max_tokens=6, verbose=False)
    assert isinstance(text, str) and text
    # the special tokens moved to the top of the small vocabulary; config follows
    assert cfg["eos_token_id"] == 599 and tok.eos_token_id == 599
    assert tok.convert_ids_to_tokens(599) == "<|im_end|>"
    # every id the model can emit decodes
    assert isinstance(tok.decode(list(range(600))), str)


def test_weights_are_normal_and_norms_are_one(qwen):
    ck = Checkpoint(qwen)
    assert ck.dtype == "BF16" and {t.dtype for t in ck.tensors.values()} == {"BF16"}
    w = nm.to_float32(ck.read("model.layers.1.mlp.down_proj.weight"), "bf16")
    assert w.shape == (64, 128)
    assert abs(w.std() - 0.02) < 0.002 and abs(w.mean()) < 0.002
    assert len(np.unique(w)) > 500  # not a handful of repeated values
    norm = nm.to_float32(ck.read("model.layers.0.input_layernorm.weight"), "bf16")
    assert (norm == 1).all()
    assert "lm_head.weight" not in ck.tensors  # tied, as in the real model


def test_real_special_token_ids_with_the_real_vocabulary(tmp_path):
    from transformers import AutoTokenizer

    p = synth_checkpoint(tmp_path / "q", "qwen3-0.6b", progress=False,
                         overrides=dict(TINY, vocab_size=151936))
    tok = AutoTokenizer.from_pretrained(str(p))
    assert len(tok) == 151936
    assert tok.convert_tokens_to_ids("<|im_end|>") == 151645
    assert json.loads((p / "config.json").read_text())["eos_token_id"] == 151645
    assert tok.decode(tok.encode("Hello, world")) == "Hello, world"


def test_sharding_and_index(tmp_path):
    p = synth_checkpoint(tmp_path / "q", "qwen3-1.7b", overrides=TINY, shard_size="60KB",
                         progress=False)
    index = json.loads((p / "model.safetensors.index.json").read_text())
    ck = Checkpoint(p)
    n = len(ck.shards)
    assert n > 3
    assert sorted(ck.shards) == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert set(index["weight_map"]) == set(ck.tensors) == {k for k, _ in plan_checkpoint(
        dict(PRESETS["qwen3-1.7b"], **TINY))}
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in ck.tensors.values())
    for shard, h in ck.headers.items():
        assert h.nbytes <= 60_000 or len(h.tensors) == 1
        assert h.metadata["format"] == "mlx"
    embed = ck.tensors["model.embed_tokens.weight"]  # 600*64*2 bytes > 60KB: alone
    assert len(ck.headers[embed.file.name].tensors) == 1


def test_hf_layout_has_no_index_for_one_shard_and_mlx_layout_has_one(tmp_path):
    hf = synth_checkpoint(tmp_path / "hf", "llama-3.2-1b", layout="hf", overrides=TINY,
                          progress=False)
    mlx = synth_checkpoint(tmp_path / "mlx", "llama-3.2-1b", overrides=TINY, progress=False)
    assert not (hf / "model.safetensors.index.json").exists()
    assert (hf / "generation_config.json").exists()
    assert (mlx / "model.safetensors.index.json").exists()
    assert Checkpoint(hf).headers["model.safetensors"].metadata["format"] == "pt"


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    a = synth_checkpoint(tmp_path / "a", "llama-3.2-1b", overrides=TINY, seed=3, progress=False)
    b = synth_checkpoint(tmp_path / "b", "llama-3.2-1b", overrides=TINY, seed=3, progress=False)
    c = synth_checkpoint(tmp_path / "c", "llama-3.2-1b", overrides=TINY, seed=4, progress=False)
    name = "model.layers.2.self_attn.o_proj.weight"
    ra, rb, rc = (Checkpoint(x).read(name) for x in (a, b, c))
    assert np.array_equal(ra, rb) and not np.array_equal(ra, rc)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


@pytest.mark.parametrize("dtype,code", [("float16", "F16"), ("float32", "F32")])
def test_other_dtypes_load_and_run(tmp_path, dtype, code):
    import mlx_lm

    p = synth_checkpoint(tmp_path / dtype, "llama-3.2-1b", overrides=TINY, dtype=dtype,
                         progress=False)
    ck = Checkpoint(p)
    assert {t.dtype for t in ck.tensors.values()} == {code}
    assert json.loads((p / "config.json").read_text())["torch_dtype"] == dtype
    w = nm.to_float32(ck.read("model.layers.0.mlp.up_proj.weight"), code)
    assert abs(w.std() - 0.02) < 0.002
    model, tok = mlx_lm.load(str(p))
    assert mx.isfinite(_logits(model, tok)).all().item()


def test_moe_hf_layout_has_per_expert_tensors_and_loads(moe_hf, moe_mlx):
    import mlx_lm

    hf, mlx = Checkpoint(moe_hf), Checkpoint(moe_mlx)
    assert hf.tensors["model.layers.1.mlp.experts.3.up_proj.weight"].shape == (32, 64)
    assert not any("switch_mlp" in n for n in hf.tensors)
    assert mlx.tensors["model.layers.1.mlp.switch_mlp.up_proj.weight"].shape == (4, 32, 64)
    assert not any(".experts." in n for n in mlx.tensors)
    for p in (moe_hf, moe_mlx):
        model, tok = mlx_lm.load(str(p))
        assert mx.isfinite(_logits(model, tok)).all().item()


def test_generic_config_file(tmp_path):
    import mlx_lm

    cfg = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5,
               vocab_size=300, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text(json.dumps(cfg))
    p = synth_checkpoint(tmp_path / "g", tmp_path / "src", progress=False)
    written = json.loads((p / "config.json").read_text())
    assert written["eos_token_id"] == 299  # ids below the byte tokens moved to the top
    assert "lm_head.weight" in Checkpoint(p).tensors
    model, tok = mlx_lm.load(str(p))
    assert mx.isfinite(_logits(model, tok)).all().item()


def test_writing_streams_tensor_by_tensor(tmp_path):
    """Peak Python/numpy allocation stays far below the checkpoint's size."""
    over = dict(TINY, hidden_size=1024, intermediate_size=4096, num_hidden_layers=4,
                num_attention_heads=16, num_key_value_heads=4, head_dim=64, vocab_size=32000)
    tracemalloc.start()
    try:
        p = synth_checkpoint(tmp_path / "m", "llama-3.2-1b", overrides=over, progress=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    size = sum(f.stat().st_size for f in p.glob("*.safetensors"))
    assert size > 100e6
    assert peak < 40e6, f"peak {peak / 1e6:.1f} MB for a {size / 1e6:.0f} MB checkpoint"


def test_checkpoint_errors(tmp_path, qwen):
    with pytest.raises(FormatError, match="unknown preset"):
        synth_checkpoint(tmp_path / "x", "qwen9-1t", progress=False)
    assert not (tmp_path / "x").exists()
    with pytest.raises(OutputExistsError, match="already exists"):
        synth_checkpoint(qwen, "qwen3-1.7b", overrides=TINY, progress=False)
    with pytest.raises(FormatError, match="vocab_size too small"):
        synth_checkpoint(tmp_path / "y", "qwen3-1.7b", overrides=dict(TINY, vocab_size=100),
                         progress=False)
    assert not (tmp_path / "y").exists()
    assert not list(tmp_path.glob(".y.lorakit-synth-*"))  # temporary removed
    with pytest.raises(FormatError, match="unsupported dtype"):
        synth_checkpoint(tmp_path / "z", "qwen3-1.7b", dtype="int8", progress=False)


# -- adapters ---------------------------------------------------------------------------------
def test_mlx_lm_adapter_loads_in_mlx_lm_and_lorakit(tmp_path, qwen):
    import mlx_lm

    a = synth_adapter(tmp_path / "a", qwen, rank=4, layers=2)
    cfg = json.loads((a / "adapter_config.json").read_text())
    assert cfg["fine_tune_type"] == "lora" and cfg["num_layers"] == 2
    assert cfg["lora_parameters"] == {"rank": 4, "dropout": 0.0, "scale": 20.0, "keys": [
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]}
    ad = load_adapter(a)
    assert ad.format == "mlx-lm" and len(ad.targets) == 14
    assert {t.module.split(".")[2] for t in ad.targets} == {"1", "2"}  # the last 2 layers
    t = next(x for x in ad.targets if x.module == "model.layers.2.mlp.down_proj")
    assert t.A.shape == (4, 128) and t.B.shape == (64, 4) and t.scale == 20.0
    delta = t.scale * (t.B @ t.A)
    assert 0.7e-3 < delta.std() < 1.3e-3  # delta_std default 1e-3
    assert len(bind(ad, Checkpoint(qwen))) == 14
    base_model, tok = mlx_lm.load(str(qwen))
    lora_model, _ = mlx_lm.load(str(qwen), adapter_path=str(a))
    base, lora = _logits(base_model, tok), _logits(lora_model, tok)
    assert mx.isfinite(lora).all().item()
    assert mx.abs(lora - base).max().item() > 0  # non-zero lora_b changes the output


def test_layer_list_and_keys(tmp_path, qwen):
    import mlx_lm

    a = synth_adapter(tmp_path / "a", qwen, layers=[0, 2], keys=["q", "mlp.down_proj"])
    ad = load_adapter(a)
    assert sorted(t.module for t in ad.targets) == [
        "model.layers.0.mlp.down_proj", "model.layers.0.self_attn.q_proj",
        "model.layers.2.mlp.down_proj", "model.layers.2.self_attn.q_proj"]
    assert json.loads((a / "adapter_config.json").read_text())["num_layers"] == 3
    mlx_lm.load(str(qwen), adapter_path=str(a))  # mlx-lm accepts it


def test_dora_adapter(tmp_path, qwen):
    import mlx_lm

    a = synth_adapter(tmp_path / "d", qwen, kind="dora", layers=1, keys=["v", "up"])
    ad = load_adapter(a)
    assert ad.fine_tune_type == "dora" and all(t.is_dora for t in ad.targets)
    ck = Checkpoint(qwen)
    t = next(x for x in ad.targets if x.module.endswith("v_proj"))
    w = nm.to_float32(ck.read(t.module + ".weight"), "bf16")
    norms = np.linalg.norm(w, axis=1)
    assert np.allclose(t.magnitude, norms, rtol=0.05) and not np.allclose(t.magnitude, norms)
    model, tok = mlx_lm.load(str(qwen), adapter_path=str(a))
    assert mx.isfinite(_logits(model, tok)).all().item()


def test_peft_adapter_loads_in_lorakit(tmp_path, qwen):
    a = synth_adapter(tmp_path / "p", qwen, format="peft", rank=4, layers=[1, 2], kind="dora")
    cfg = json.loads((a / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 8.0
    assert cfg["use_dora"] is True and cfg["layers_to_transform"] == [1, 2]
    names = list(read_header(a / "adapter_model.safetensors").tensors)
    assert "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight" in names
    assert "base_model.model.model.layers.2.mlp.up_proj.lora_magnitude_vector" in names
    ad = load_adapter(a)
    assert ad.format == "peft" and len(ad.targets) == 14
    t = next(x for x in ad.targets if x.module == "model.layers.1.mlp.gate_proj")
    assert t.A.shape == (4, 64) and t.B.shape == (128, 4) and t.scale == 2.0
    assert len(bind(ad, Checkpoint(qwen))) == 14


def test_moe_adapters_bind_to_both_layouts(tmp_path, moe_hf, moe_mlx):
    import mlx_lm

    for ck_path in (moe_hf, moe_mlx):
        a = synth_adapter(tmp_path / f"m-{ck_path.name}", ck_path, layers=2)
        ad = load_adapter(a)
        sw = [t for t in ad.targets if t.kind == "switch"]
        assert len(sw) == 6 and sw[0].A.shape[0] == 4  # gate/up/down x 2 layers, 4 experts
        assert all(".switch_mlp." in t.module for t in sw)
        for other in (moe_hf, moe_mlx):
            assert len(bind(ad, Checkpoint(other))) == 8 + 6 * (4 if other == moe_hf else 1)
        model, tok = mlx_lm.load(str(ck_path), adapter_path=str(a))
        assert mx.isfinite(_logits(model, tok)).all().item()
        p = synth_adapter(tmp_path / f"p-{ck_path.name}", ck_path, layers=1, format="peft")
        pad = load_adapter(p)
        assert any(".experts.3.down_proj" in t.module for t in pad.targets)
        assert len(bind(pad, Checkpoint(moe_mlx))) == len(pad.targets) == 4 + 3 * 4


def test_adapter_errors(tmp_path, qwen, moe_mlx):
    with pytest.raises(AdapterError, match="not in the checkpoint") as e:
        synth_adapter(tmp_path / "a", qwen, keys=["q", "mlp.nope"], layers=2)
    assert "mlp.nope" in str(e.value) and "layer 1" in str(e.value) and "layer 2" in str(e.value)
    with pytest.raises(AdapterError, match="layers out of range"):
        synth_adapter(tmp_path / "a", qwen, layers=4)
    with pytest.raises(OutputExistsError, match="overlap the checkpoint"):
        synth_adapter(qwen / "adapter", qwen, layers=1, force=True)
    assert (qwen / "model.safetensors").exists()
    with pytest.raises(AdapterError, match="no DoRA for MoE"):
        synth_adapter(tmp_path / "a", moe_mlx, kind="dora", layers=1)
    assert not (tmp_path / "a").exists()


def test_synth_pair_fuses_with_lorakit(tmp_path, qwen):
    from lorakit import fuse

    a = synth_adapter(tmp_path / "a", qwen, layers=2)
    r = fuse(qwen, a, tmp_path / "fused", progress=False)
    assert r.tensors_fused == 14 and r.dtypes_written == {"BF16": len(Checkpoint(qwen).tensors)}
    base, fused = Checkpoint(qwen), Checkpoint(tmp_path / "fused")
    name = "model.layers.2.self_attn.q_proj.weight"
    changed = (base.read(name) != fused.read(name)).mean()
    assert changed > 0.5  # delta_std 1e-3 moves most bf16 elements of a 0.02-scale weight


# -- public names, provenance, force -------------------------------------------------------
def test_public_names() -> None:
    for name in ("synth_checkpoint", "synth_adapter", "presets", "parse_size", "resolve_config",
                 "plan_checkpoint", "write_tokenizer", "PRESETS", "DEFAULT_KEYS"):
        assert hasattr(synth, name), name
    assert synth.presets() == list(synth.PRESETS)


@pytest.fixture(scope="module")
def ck(tmp_path_factory) -> Path:
    """A checkpoint of this section's own (the tests below list its files)."""
    return synth_checkpoint(tmp_path_factory.mktemp("pkg") / "ck", "qwen3-1.7b",
                            overrides=TINY, progress=False)


def test_outputs_carry_provenance(ck: Path, tmp_path: Path) -> None:
    doc = json.loads((ck / PROVENANCE).read_text())
    assert doc["kind"] == "synth-checkpoint" and doc["settings"]["model"] == "qwen3-1.7b"
    assert sorted(doc["files"]) == sorted(p.name for p in ck.iterdir() if p.name != PROVENANCE)
    for fmt in ("mlx-lm", "peft"):
        a = synth_adapter(tmp_path / fmt, ck, rank=2, layers=1, format=fmt)
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
        synth_adapter(mine, ck, rank=2, layers=1, force=True)
    assert "notes.txt" in str(e.value) and tree_hash(mine) == before
    with pytest.raises(OutputExistsError, match="refusing to replace"):
        synth_checkpoint(mine, "qwen3-1.7b", overrides=TINY, progress=False, force=True)
    assert tree_hash(mine) == before
    # an empty directory needs no force; a previous output needs it
    (tmp_path / "empty").mkdir()
    a = synth_adapter(tmp_path / "empty", ck, rank=2, layers=1)
    with pytest.raises(OutputExistsError, match="already exists"):
        synth_adapter(a, ck, rank=2, layers=1)
    first = tree_hash(a)
    synth_adapter(a, ck, rank=2, layers=1, seed=1, force=True)
    assert tree_hash(a) != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "mine"]  # no temporaries


# -- CLI ----------------------------------------------------------------------------------------
def test_cli(tmp_path, capsys):
    rc = main(["synth", "checkpoint", str(tmp_path / "c"), "--preset", "llama-3.2-1b", "-q",
               "--set", "hidden_size=64", "--set", "intermediate_size=128",
               "--set", "num_hidden_layers=2", "--set", "num_attention_heads=4",
               "--set", "num_key_value_heads=2", "--set", "head_dim=16",
               "--set", "vocab_size=400", "--layout", "hf", "--dtype", "float16"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "llama" in out and "hf layout, float16" in out
    assert Checkpoint(tmp_path / "c").dtype == "F16"
    rc = main(["synth", "adapter", str(tmp_path / "a"), "--model", str(tmp_path / "c"),
               "--rank", "2", "--layers", "0-1", "--keys", "q,v", "--format", "peft"])
    assert rc == 0
    assert "peft" in capsys.readouterr().out
    assert len(load_adapter(tmp_path / "a").targets) == 4
    assert main(["synth", "checkpoint", str(tmp_path / "c"), "--preset", "llama-3.2-1b"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["synth", "presets"]) == 0
    assert "qwen3-1.7b" in capsys.readouterr().out


def test_write_tokenizer_takes_a_null_max_position_embeddings(tmp_path):
    """A config with ``"max_position_embeddings": null`` (mlx-lm's dots1 test config) gets
    the default model_max_length instead of a TypeError (the architecture sweep's dots1)."""
    from lorakit.synth.tokenizer import write_tokenizer

    write_tokenizer(tmp_path, {"model_type": "llama", "vocab_size": 384,
                               "max_position_embeddings": None})
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["model_max_length"] == 4096
