"""The GGUF files lorakit writes, read back with llama.cpp's own reader (gguf.GGUFReader):
metadata keys and their types, tensor names, dtypes, shapes and bits, and the refusals.
That llama.cpp loads them and computes the same logits: tests/io/test_gguf_clients.py."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
from helpers import REPO as ROOT

import lorakit
from lorakit.algebra import convert
from lorakit.errors import AdapterError, FormatError, OutputExistsError
from lorakit.io.outputs.directory import TMP_MARK
from lorakit.io.outputs.gguf import write_lora_gguf, write_model_gguf

BASE = ROOT / "data" / "tiny-qwen3"
ADAPTER = ROOT / "data" / "adapters" / "lora"
VT = gguf.GGUFValueType


def _fields(path: Path):
    r = gguf.GGUFReader(path)
    return r, r.fields, {t.name: t for t in r.tensors}


def _value(f):
    return f.contents()


def _bpe_model(tmp: Path, family: str = "llama", **kw) -> Path:
    """A random model of ``family`` carrying the embedded byte-level BPE tokenizer."""
    from model_factory import make_model

    m = make_model(tmp / family, family, vocab_size=2048, **kw)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(BASE / f, m / f)
    return m


def _bits(raw, dtype):
    """A tensor's stored bits as GGUFReader returns them (bf16 as uint16)."""
    return np.asarray(raw).view(np.uint16) if dtype == "BF16" else np.asarray(raw)


def test_qwen3_metadata_tokenizer_and_tensors(tmp_path: Path) -> None:
    out = write_model_gguf(BASE, tmp_path / "m.gguf")
    r, f, t = _fields(out)
    cfg = json.loads((BASE / "config.json").read_text())
    assert _value(f["general.architecture"]) == "qwen3"
    want = {"qwen3.context_length": 1024, "qwen3.embedding_length": 256,
            "qwen3.block_count": 4, "qwen3.feed_forward_length": 512,
            "qwen3.attention.head_count": 4, "qwen3.attention.head_count_kv": 2,
            "qwen3.attention.key_length": 64, "qwen3.attention.value_length": 64}
    for k, v in want.items():
        assert _value(f[k]) == v and f[k].types == [VT.UINT32], k
    assert _value(f["qwen3.rope.freq_base"]) == pytest.approx(10000.0)
    assert f["qwen3.attention.layer_norm_rms_epsilon"].types == [VT.FLOAT32]
    # the tokenizer's real model: byte-level BPE with merges, INT32 token types
    tok = json.loads((BASE / "tokenizer.json").read_text())
    assert _value(f["tokenizer.ggml.model"]) == "gpt2"
    assert _value(f["tokenizer.ggml.pre"]) == "gpt-2"  # its pre-tokenizer: GPT-2's regex
    assert f["tokenizer.ggml.token_type"].types == [VT.ARRAY, VT.INT32]
    tokens = _value(f["tokenizer.ggml.tokens"])
    assert len(tokens) == cfg["vocab_size"] and tokens[5] == \
        {v: k for k, v in tok["model"]["vocab"].items()}[5]
    assert len(_value(f["tokenizer.ggml.merges"])) == len(tok["model"]["merges"])
    types = _value(f["tokenizer.ggml.token_type"])
    assert types[0] == gguf.TokenType.CONTROL and types[100] == gguf.TokenType.NORMAL
    assert _value(f["tokenizer.ggml.bos_token_id"]) == 1
    assert _value(f["tokenizer.ggml.eos_token_id"]) == 0
    assert _value(f["tokenizer.ggml.padding_token_id"]) == 2
    # llama.cpp's names; tied embeddings: no output.weight; norms F32, weights as stored
    names = set(t)
    assert "output.weight" not in names and "token_embd.weight" in names
    per_block = {"attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm",
                 "attn_k_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"}
    assert names == {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{i}.{n}.weight" for i in range(4) for n in per_block}
    assert t["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert t["blk.0.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType.BF16
    assert list(t["blk.0.attn_k.weight"].shape) == [256, 128]  # ggml order (in, out)
    # bits: qwen's q is not permuted; the norm is the bf16 value widened exactly
    src = lorakit.open(BASE)
    q = src.read("model.layers.0.self_attn.q_proj.weight")
    assert np.array_equal(_bits(t["blk.0.attn_q.weight"].data, "BF16").reshape(q.shape), q)
    n = src.read("model.layers.0.input_layernorm.weight")
    widened = (n.astype(np.uint32) << 16).view(np.float32)
    assert np.array_equal(np.asarray(t["blk.0.attn_norm.weight"].data), widened)


def test_llama_q_k_rows_permuted_untied_output_and_outtype(tmp_path: Path) -> None:
    m = _bpe_model(tmp_path, "llama")
    out = write_model_gguf(m, tmp_path / "m.gguf", outtype="f16")
    _, f, t = _fields(out)
    assert _value(f["general.architecture"]) == "llama"
    assert _value(f["llama.rope.dimension_count"]) == 16
    assert _value(f["tokenizer.ggml.pre"]) == "gpt-2"  # the tokenizer's, not the family's
    assert "output.weight" in t
    assert t["blk.0.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    assert t["output_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    src = lorakit.open(m)
    for name, heads in (("q_proj", 4), ("k_proj", 2)):
        w = src.read(f"model.layers.1.self_attn.{name}.weight")
        w = (w.astype(np.uint32) << 16).view(np.float32)
        # llama.cpp's convert_hf_to_gguf.py LlamaModel.permute, spelled out
        want = w.reshape(heads, 2, w.shape[0] // heads // 2, w.shape[1]).swapaxes(1, 2) \
            .reshape(w.shape).astype(np.float16)
        g = "attn_q" if name == "q_proj" else "attn_k"
        got = np.asarray(t[f"blk.1.{g}.weight"].data).reshape(w.shape)
        assert np.array_equal(got, want)
        assert not np.array_equal(got, w.astype(np.float16))


def test_moe_experts_stacked_router_f32(tmp_path: Path) -> None:
    out = write_model_gguf(ROOT / "data" / "tiny-qwen3-moe", tmp_path / "m.gguf")
    _, f, t = _fields(out)
    assert _value(f["general.architecture"]) == "qwen3moe"
    assert _value(f["qwen3moe.expert_count"]) == 4
    assert _value(f["qwen3moe.expert_used_count"]) == 2
    assert _value(f["qwen3moe.expert_feed_forward_length"]) == 256
    assert list(t["blk.0.ffn_gate_exps.weight"].shape) == [128, 256, 4]
    assert list(t["blk.0.ffn_down_exps.weight"].shape) == [256, 128, 4]
    assert t["blk.0.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32


def test_fuse_export_gguf_is_the_new_writer_and_listed(tmp_path: Path) -> None:
    from lorakit.io.outputs.provenance import foreign_entries

    r = lorakit.fuse(BASE, ADAPTER, tmp_path / "out", export_gguf="m.gguf", progress=False)
    _, f, t = _fields(r.output / "m.gguf")
    assert _value(f["tokenizer.ggml.model"]) == "gpt2"
    w = lorakit.open(r.output).read("model.layers.2.mlp.down_proj.weight")
    assert np.array_equal(_bits(t["blk.2.ffn_down.weight"].data, "BF16").reshape(w.shape), w)
    assert foreign_entries(r.output) == []
    assert not [p for p in r.output.iterdir() if p.name.endswith(".tmp") or TMP_MARK in p.name]
    assert r.gguf == r.output / "m.gguf" and "  gguf  " in str(r)
    assert f"{r.gguf} (llama.cpp)" in str(r)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_gguf_files_follow_the_umask_as_every_other_output(tmp_path: Path, umask: int) -> None:
    """A llama.cpp server under another account reads the GGUF it may read the rest by."""
    import os

    old = os.umask(umask)
    try:
        r = lorakit.fuse(BASE, ADAPTER, tmp_path / "out", export_gguf="m.gguf", progress=False)
        lora = convert(ADAPTER, tmp_path / "l.gguf", to="gguf-lora", base=BASE)
    finally:
        os.umask(old)
    mode = lambda p: p.stat().st_mode & 0o777  # noqa: E731
    assert mode(r.output / "config.json") == mode(r.output / "model.safetensors") == 0o666 & ~umask
    assert mode(r.output / "m.gguf") == mode(lora) == 0o666 & ~umask


def test_base_gguf_is_fuse_with_weights_zero(tmp_path: Path, capsys) -> None:
    """The base's GGUF, for a GGUF-LoRA to apply to: ``fuse --weights 0 --export-gguf``;
    the report names the file (text and --json), and llama.cpp's reader finds the base's
    tensors exactly as the GGUF writer gives them for the base itself."""
    from lorakit.cli.main import main

    args = ["fuse", "--model", str(BASE), "--adapter-path", str(ADAPTER), "--weights", "0",
            "--export-gguf", "--gguf-path", "base.gguf", "-q"]
    assert main(args + ["--save-path", str(tmp_path / "a"), "--json"]) == 0
    written = Path(json.loads(capsys.readouterr().out)["gguf"])
    assert written == tmp_path / "a" / "base.gguf"
    assert main(args + ["--save-path", str(tmp_path / "b")]) == 0
    assert f"{tmp_path / 'b' / 'base.gguf'} (llama.cpp)" in capsys.readouterr().out
    _, _, got = _fields(written)
    _, _, want = _fields(write_model_gguf(BASE, tmp_path / "direct.gguf"))
    assert sorted(got) == sorted(want) and len(got) > 20
    for name, t in want.items():
        assert got[name].tensor_type == t.tensor_type
        assert np.array_equal(np.asarray(got[name].data), np.asarray(t.data)), name


@pytest.mark.parametrize("case, says", [
    ("arch", "does not support this architecture"),
    ("tokenizer", "byte-level BPE tokenizers only"),
    ("quantized", "needs float weights"),
])
def test_model_refusals_write_nothing(tmp_path: Path, case: str, says: str) -> None:
    from model_factory import make_model

    if case == "arch":
        m = make_model(tmp_path / "m", "phi3")
    elif case == "tokenizer":
        m = make_model(tmp_path / "m", "llama")  # a WordLevel tokenizer
    else:
        m = ROOT / "data" / "tiny-qwen3-4bit"
    with pytest.raises(FormatError, match=says) as e:
        write_model_gguf(m, tmp_path / "o" / "m.gguf")
    if case == "arch":
        assert "'phi3'" in str(e.value) and "qwen3_moe" in str(e.value)
    assert not (tmp_path / "o").exists() or not list((tmp_path / "o").iterdir())


_QWEN2_RX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}"
             r"\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@pytest.mark.parametrize("rx, want", [
    (_QWEN2_RX, "qwen2"),
    (_QWEN2_RX.replace(r"\p{N}|", r"\p{N}{1,3}|"), "llama-bpe"),
    (r"\p{L}+|\s+", None),
])
def test_pre_tokenizer_named_by_its_split_regex(tmp_path: Path, rx: str, want) -> None:
    m = tmp_path / "m"
    shutil.copytree(BASE, m)
    tj = json.loads((m / "tokenizer.json").read_text())
    tj["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": rx}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
         "use_regex": False}]}
    (m / "tokenizer.json").write_text(json.dumps(tj))
    if want is None:
        with pytest.raises(FormatError, match="does not know this BPE pre-tokenizer"):
            write_model_gguf(m, tmp_path / "o" / "m.gguf")
        assert not (tmp_path / "o").exists() or not list((tmp_path / "o").iterdir())
        return
    _, f, _ = _fields(write_model_gguf(m, tmp_path / "m.gguf"))
    assert _value(f["tokenizer.ggml.pre"]) == want


@pytest.mark.parametrize("change, says", [
    ({"norm_topk_prob": False}, "always renormalizes"),
    ({"mlp_only_layers": [1]}, "no dense layers"),
    ({"decoder_sparse_step": 2}, "no dense layers"),
])
def test_qwen3_moe_graphs_llama_cpp_lacks_are_refused(change: dict, says: str) -> None:
    from lorakit.io.outputs.gguf import check_gguf_model

    cfg = json.loads((ROOT / "data" / "tiny-qwen3-moe" / "config.json").read_text())
    assert check_gguf_model(cfg) == "qwen3moe"
    with pytest.raises(FormatError, match=says):
        check_gguf_model(dict(cfg, **change))


def test_lora_gguf_metadata_names_shapes_and_exact_factors(tmp_path: Path) -> None:
    out = convert(ADAPTER, tmp_path / "l.gguf", to="gguf-lora", base=BASE)
    _, f, t = _fields(out)
    assert _value(f["general.type"]) == "adapter"
    assert _value(f["adapter.type"]) == "lora"
    assert _value(f["general.architecture"]) == "qwen3"
    assert f["adapter.lora.alpha"].types == [VT.FLOAT32]
    assert _value(f["adapter.lora.alpha"]) == 160.0  # mlx-lm scale 20 x rank 8
    ad = lorakit.load_adapter(ADAPTER)
    assert len(t) == 2 * len(ad.targets)
    tg = next(x for x in ad.targets if x.module == "model.layers.1.self_attn.q_proj")
    a, b = t["blk.1.attn_q.weight.lora_a"], t["blk.1.attn_q.weight.lora_b"]
    assert list(a.shape) == [256, 8] and list(b.shape) == [8, 256]  # ggml (in, r), (r, out)
    assert np.array_equal(np.asarray(a.data).reshape(tg.A.shape), tg.A)
    assert np.array_equal(np.asarray(b.data).reshape(tg.B.shape), tg.B)  # qwen: no permute
    assert a.tensor_type == gguf.GGMLQuantizationType.F32


def test_lora_gguf_llama_permutes_b_and_f16(tmp_path: Path) -> None:
    from model_factory import make_adapter

    m = _bpe_model(tmp_path, "llama")
    ad_path = make_adapter(m, tmp_path / "ad", keys=("self_attn.q_proj", "self_attn.k_proj"))
    out = convert(ad_path, tmp_path / "l.gguf", to="gguf-lora", outtype="f16")
    _, f, t = _fields(out)
    assert _value(f["adapter.lora.alpha"]) == 8.0  # scale 2 x rank 4
    ad = lorakit.load_adapter(ad_path)
    tg = next(x for x in ad.targets if x.module == "model.layers.0.self_attn.k_proj")
    B = tg.B.reshape(2, 2, -1, 4).swapaxes(1, 2).reshape(tg.B.shape)  # 2 kv heads
    got = np.asarray(t["blk.0.attn_k.weight.lora_b"].data).reshape(B.shape)
    assert np.array_equal(got, B.astype(np.float16))
    assert t["blk.0.attn_k.weight.lora_a"].tensor_type == gguf.GGMLQuantizationType.F16


def test_lora_gguf_refusals(tmp_path: Path) -> None:
    from model_factory import make_adapter, make_model

    m = _bpe_model(tmp_path, "llama")
    dora = make_adapter(m, tmp_path / "dora", dora=True)
    with pytest.raises(AdapterError, match="cannot hold a DoRA adapter"):
        convert(dora, tmp_path / "d.gguf", to="gguf-lora")
    phi = make_model(tmp_path / "phi", "phi3")
    ad = make_adapter(phi, tmp_path / "phiad", keys=("self_attn.o_proj",))
    with pytest.raises(FormatError, match="GGUF-LoRA export does not support this arch"):
        convert(ad, tmp_path / "p.gguf", to="gguf-lora")
    emb = lorakit.load_adapter(ADAPTER)
    emb.targets[0].kind = "embedding"
    with pytest.raises(AdapterError, match="Linear layers only"):
        write_lora_gguf(emb, json.loads((BASE / "config.json").read_text()),
                        tmp_path / "e.gguf")
    out = convert(ADAPTER, tmp_path / "x.gguf", to="gguf-lora", base=BASE)
    before = out.read_bytes()
    with pytest.raises(OutputExistsError):
        convert(ADAPTER, out, to="gguf-lora", base=BASE)
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.glob("*.gguf")) == ["x.gguf"]


def test_cli_convert_to_gguf_lora(tmp_path: Path, capsys) -> None:
    from lorakit.cli.main import main

    assert main(["convert", str(ADAPTER), "--to", "gguf-lora", "--base", str(BASE),
                 "--save-path", str(tmp_path / "l.gguf"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == "gguf-lora"
    _, f, _ = _fields(tmp_path / "l.gguf")
    assert _value(f["adapter.type"]) == "lora"
