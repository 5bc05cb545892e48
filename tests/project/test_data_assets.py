"""The embedded assets in data/ load with mlx-lm and behave as they were built to.

The base models were trained on King James narrative prose, the adapters on Unix
fortune cookies (data/README.md). Style is measured, not eyeballed: mean token
cross-entropy on a few examples of each corpus' held-out split. Each model is loaded
once per session; no training happens here.
"""
from __future__ import annotations

import json
import struct
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest
from helpers import LazyModule, missing_modules

mx = pytest.importorskip("mlx.core")
nn = pytest.importorskip("mlx.nn")
# imported on first use: mlx_lm pulls in transformers (a second or more to import)
pytestmark = pytest.mark.skipif(bool(missing_modules("mlx_lm")), reason="mlx_lm not installed")
mlx_lm = LazyModule("mlx_lm")

DATA = Path(__file__).resolve().parents[2] / "data"
BASE = DATA / "tiny-qwen3"
BASE_4BIT = DATA / "tiny-qwen3-4bit"
MOE = DATA / "tiny-qwen3-moe"
ADAPTERS = DATA / "adapters"
PROMPTS: list[str] = json.loads((DATA / "prompts.json").read_text())
KJV_PROMPT = "And the LORD said unto Moses,"
FORTUNE_PROMPT = "The computer"
# Two prompts of each style (all eight would double the test's generation time).
STYLE_PROMPTS = [PROMPTS[0], PROMPTS[1], PROMPTS[4], PROMPTS[5]]
# Words that mark King James prose; modern fortunes almost never use them.
KJV_WORDS = {"LORD", "unto", "thee", "thou", "thy", "hath", "shalt", "saith", "Israel",
             "spake", "ye", "begat"}
N_EXAMPLES = 6  # held-out examples per corpus
MAX_TOKENS = 48  # per example; keeps each loss to ~0.3k tokens on a plain CPU

# adapter folder name -> the base it was trained on
ADAPTER_BASES = {
    "lora": BASE,
    "dora": BASE,
    "lora-embed": BASE,
    "lora-4bit": BASE_4BIT,
    "moe-lora": MOE,
}
LINEAR_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def safetensors_dtypes(path: Path) -> dict[str, str]:
    """Tensor name -> dtype string, read from the file header alone."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return {k: v["dtype"] for k, v in header.items()}


@lru_cache(maxsize=None)
def load(model_dir: Path, adapter: str | None = None) -> tuple[Any, Any]:
    adapter_path = str(ADAPTERS / adapter) if adapter else None
    model, tokenizer = mlx_lm.load(str(model_dir), adapter_path=adapter_path)
    if model_dir in (BASE_4BIT, MOE) and mx.default_device() == mx.cpu:
        # Exact upcast of the bf16 tensors (4-bit codes stay packed). MLX's CPU
        # backend runs gather_mm (the MoE experts) in float32 only, and its bf16
        # quantized matmul is ~10x slower than the float32 one.
        model.set_dtype(mx.float32)
    return model, tokenizer


@lru_cache(maxsize=None)
def corpus_batch(corpus: str) -> tuple[Any, Any]:
    """First N_EXAMPLES held-out texts, tokenized as mlx-lm trains (eos appended).

    All the models share one tokenizer, so the base's is used for every model."""
    _, tokenizer = load(BASE)
    lines = (DATA / "corpora" / corpus / "valid.jsonl").read_text().splitlines()
    seqs = []
    for line in lines[:N_EXAMPLES]:
        ids = tokenizer.encode(json.loads(line)["text"]) + [tokenizer.eos_token_id]
        seqs.append(ids[: MAX_TOKENS + 1])
    width = max(len(s) for s in seqs)
    tokens = mx.array([s + [0] * (width - len(s)) for s in seqs])
    mask = mx.array([[1.0] * (len(s) - 1) + [0.0] * (width - len(s)) for s in seqs])
    return tokens, mask


@lru_cache(maxsize=None)
def loss(model_dir: Path, adapter: str | None, corpus: str) -> float:
    """Mean next-token cross-entropy (nats) of a model on a corpus' held-out examples."""
    model, _ = load(model_dir, adapter)
    tokens, mask = corpus_batch(corpus)
    logits = model(tokens[:, :-1]).astype(mx.float32)
    ce = nn.losses.cross_entropy(logits, tokens[:, 1:]) * mask
    return (ce.sum() / mask.sum()).item()


@lru_cache(maxsize=None)
def greedy(model_dir: Path, adapter: str | None, prompt: str) -> str:
    model, tokenizer = load(model_dir, adapter)
    return mlx_lm.generate(model, tokenizer, prompt, max_tokens=40)


def kjv_word_count(text: str) -> int:
    return sum(w.strip(",.;:!?'\"()").removesuffix("'s") in KJV_WORDS for w in text.split())


def kjv_style_score(model_dir: Path, adapter: str | None) -> int:
    """King James words in the greedy continuations of STYLE_PROMPTS."""
    return sum(kjv_word_count(greedy(model_dir, adapter, p)) for p in STYLE_PROMPTS)


# ----------------------------------------------------------------------------- base


def test_base_layout_and_dtypes() -> None:
    config = json.loads((BASE / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    assert config["tie_word_embeddings"] is True
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (BASE / name).is_file(), name
    tok_config = json.loads((BASE / "tokenizer_config.json").read_text())
    assert {"bos_token", "eos_token", "pad_token"} <= tok_config.keys()
    dtypes = safetensors_dtypes(BASE / "model.safetensors")
    assert set(dtypes.values()) == {"BF16"}
    # Tied head: mlx-lm drops lm_head.weight and reuses the embedding.
    assert "lm_head.weight" not in dtypes
    assert "model.embed_tokens.weight" in dtypes
    assert len(dtypes) == 1 + 1 + config["num_hidden_layers"] * 11


@pytest.mark.slow  # cross-entropy and greedy text of the base on both corpora
def test_base_speaks_kjv() -> None:
    kjv, fortunes = loss(BASE, None, "kjv"), loss(BASE, None, "fortunes")
    assert kjv < fortunes - 1.0, (kjv, fortunes)
    texts = [greedy(BASE, None, p) for p in STYLE_PROMPTS]
    # Even prompted with "The computer", the base answers in scripture.
    assert kjv_style_score(BASE, None) >= 2 * len(STYLE_PROMPTS), texts


def test_base_greedy_is_deterministic() -> None:
    model, tokenizer = load(BASE)
    again = mlx_lm.generate(model, tokenizer, KJV_PROMPT, max_tokens=40)
    assert again == greedy(BASE, None, KJV_PROMPT)


def test_prompts_cover_both_styles() -> None:
    assert 6 <= len(PROMPTS) <= 8
    assert STYLE_PROMPTS[0] == KJV_PROMPT and STYLE_PROMPTS[2] == FORTUNE_PROMPT


# ------------------------------------------------------------------------- adapters


@pytest.mark.parametrize("adapter", sorted(ADAPTER_BASES))
def test_adapter_files_are_f32_mlx_layout(adapter: str) -> None:
    folder = ADAPTERS / adapter
    assert sorted(p.name for p in folder.iterdir()) == [
        "adapter_config.json", "adapters.safetensors"]
    config = json.loads((folder / "adapter_config.json").read_text())
    dtypes = safetensors_dtypes(folder / "adapters.safetensors")
    assert set(dtypes.values()) == {"F32"}
    assert config["lora_parameters"]["rank"] == 8
    leaves = {name.rsplit(".", 1)[-1] for name in dtypes}
    expected = {"lora_a", "lora_b", "m"} if config["fine_tune_type"] == "dora" else {
        "lora_a", "lora_b"}
    assert leaves == expected
    # Every layer, every listed projection.
    base_config = json.loads((ADAPTER_BASES[adapter] / "config.json").read_text())
    layers = base_config["num_hidden_layers"]
    modules = {name.rsplit(".", 1)[0] for name in dtypes}
    attention = [f"model.layers.{i}.self_attn.{p}" for i in range(layers)
                 for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    assert set(attention) <= modules
    mlp = "mlp.switch_mlp" if adapter == "moe-lora" else "mlp"
    assert {f"model.layers.{i}.{mlp}.{p}" for i in range(layers)
            for p in ("gate_proj", "up_proj", "down_proj")} <= modules
    extra = modules - set(attention) - {f"model.layers.{i}.{mlp}.{p}" for i in range(layers)
                                        for p in ("gate_proj", "up_proj", "down_proj")}
    assert extra == ({"model.embed_tokens"} if adapter == "lora-embed" else set())


@pytest.mark.slow  # cross-entropy of five adapted models on both corpora
@pytest.mark.parametrize("adapter", sorted(ADAPTER_BASES))
def test_adapter_moves_model_to_fortune_style(adapter: str) -> None:
    base = ADAPTER_BASES[adapter]
    before, after = loss(base, None, "fortunes"), loss(base, adapter, "fortunes")
    assert after < before - 0.5, (before, after)
    # The adapted model now prefers fortunes to scripture... or at least no longer
    # prefers scripture by the base's margin.
    kjv_gap_before = loss(base, None, "fortunes") - loss(base, None, "kjv")
    kjv_gap_after = loss(base, adapter, "fortunes") - loss(base, adapter, "kjv")
    assert kjv_gap_after < kjv_gap_before - 0.5, (kjv_gap_before, kjv_gap_after)


@pytest.mark.slow  # greedy text of five adapted models on four prompts
@pytest.mark.parametrize("adapter", sorted(ADAPTER_BASES))
def test_adapter_changes_greedy_text(adapter: str) -> None:
    base = ADAPTER_BASES[adapter]
    changed = [greedy(base, None, p) != greedy(base, adapter, p) for p in STYLE_PROMPTS]
    assert all(changed), changed
    # The base answers every prompt in scripture; adapted, it no longer does.
    before, after = kjv_style_score(base, None), kjv_style_score(base, adapter)
    assert before >= 2 * len(STYLE_PROMPTS) and after <= before // 4, (before, after)


# The prompts the notebooks decode: data/prompts.json and the lab's default.
NOTEBOOK_PROMPTS = [*PROMPTS, "And it came to pass"]


def words(text: str) -> list[str]:
    return [w for w in (t.strip(",.;:!?'\"()-").lower() for t in text.split()) if w]


@lru_cache(maxsize=None)
def corpus_words(corpus: str) -> frozenset[str]:
    lines = (DATA / "corpora" / corpus / "train.jsonl").read_text().splitlines()
    return frozenset(w for line in lines for w in words(json.loads(line)["text"]))


def fortune_words(text: str) -> set[str]:
    """Words of the fortunes corpus that King James narrative never uses."""
    return (set(words(text)) & corpus_words("fortunes")) - corpus_words("kjv")


def test_fortune_words_tell_the_styles_apart() -> None:
    assert not fortune_words("And the LORD spake unto Moses, saying, Speak unto Aaron")
    assert fortune_words("The computer is a program that crashes.") == {
        "computer", "program", "crashes"}


@pytest.mark.slow  # greedy text of the base and the lora adapter on nine prompts
def test_lora_writes_fortunes_where_the_base_writes_scripture() -> None:
    pairs = {p: (greedy(BASE, None, p), greedy(BASE, "lora", p)) for p in NOTEBOOK_PROMPTS}
    variety = []  # distinct words over words: 0.26-0.37 for a base that loops on one phrase
    for prompt, (base, adapted) in pairs.items():
        # The base writes readable scripture: whole sentences, not one phrase repeated.
        said = words(base)
        variety.append(len(set(said)) / len(said))
        assert len(said) >= 15 and variety[-1] >= 0.25, (prompt, base)
        assert not fortune_words(base), (prompt, base)
        # The adapter answers in words, not only "." or the end of text.
        assert len(words(adapted)) >= 4 and adapted != base, (prompt, adapted)
    # ... and in the fortunes' vocabulary, without the scripture's.
    assert sum(variety) / len(variety) >= 0.45, variety
    styled = [p for p, (_, adapted) in pairs.items() if fortune_words(adapted)]
    assert len(styled) >= 2 * len(pairs) // 3, pairs
    before = sum(kjv_word_count(base) for base, _ in pairs.values())
    after = sum(kjv_word_count(adapted) for _, adapted in pairs.values())
    assert after <= before // 4, (before, after)


def test_lora_shapes_follow_mlx_lm_conventions() -> None:
    config = json.loads((BASE / "config.json").read_text())
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    lora = mx.load(str(ADAPTERS / "lora" / "adapters.safetensors"))
    q_out = config["num_attention_heads"] * config["head_dim"]
    assert lora["model.layers.0.self_attn.q_proj.lora_a"].shape == (hidden, 8)  # (in, r)
    assert lora["model.layers.0.self_attn.q_proj.lora_b"].shape == (8, q_out)  # (r, out)
    assert lora["model.layers.0.mlp.down_proj.lora_a"].shape == (
        config["intermediate_size"], 8)
    embed = mx.load(str(ADAPTERS / "lora-embed" / "adapters.safetensors"))
    assert embed["model.embed_tokens.lora_a"].shape == (vocab, 8)
    assert embed["model.embed_tokens.lora_b"].shape == (8, hidden)
    dora = mx.load(str(ADAPTERS / "dora" / "adapters.safetensors"))
    assert dora["model.layers.0.self_attn.q_proj.m"].shape == (q_out,)


def test_moe_adapter_has_per_expert_pairs() -> None:
    config = json.loads((MOE / "config.json").read_text())
    experts, hidden = config["num_experts"], config["hidden_size"]
    moe_inter = config["moe_intermediate_size"]
    w = mx.load(str(ADAPTERS / "moe-lora" / "adapters.safetensors"))
    # SwitchLinear LoRA: lora_a (experts, r, in), lora_b (experts, out, r).
    assert w["model.layers.0.mlp.switch_mlp.up_proj.lora_a"].shape == (experts, 8, hidden)
    assert w["model.layers.0.mlp.switch_mlp.up_proj.lora_b"].shape == (experts, moe_inter, 8)
    assert w["model.layers.0.mlp.switch_mlp.down_proj.lora_a"].shape == (
        experts, 8, moe_inter)


# ------------------------------------------------------------------- 4-bit and MoE


@pytest.mark.slow  # cross-entropy of the 4-bit and bf16 bases on both corpora
def test_4bit_base_is_quantized_and_still_kjv() -> None:
    config = json.loads((BASE_4BIT / "config.json").read_text())
    assert config["quantization"]["bits"] == 4
    dtypes = safetensors_dtypes(BASE_4BIT / "model.safetensors")
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == "U32"
    assert dtypes["model.layers.0.self_attn.q_proj.scales"] == "BF16"
    assert "model.embed_tokens.scales" in dtypes
    kjv = loss(BASE_4BIT, None, "kjv")
    assert kjv < loss(BASE_4BIT, None, "fortunes") - 1.0
    assert abs(kjv - loss(BASE, None, "kjv")) < 0.5


def test_moe_base_layout_and_style() -> None:
    config = json.loads((MOE / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe"
    assert config["num_experts"] == 4 and config["num_experts_per_tok"] == 2
    dtypes = safetensors_dtypes(MOE / "model.safetensors")
    assert set(dtypes.values()) == {"BF16"}
    # mlx-lm saves experts stacked (SwitchGLU), not as HF's mlp.experts.<e>.*.
    assert "model.layers.0.mlp.switch_mlp.gate_proj.weight" in dtypes
    assert not any(".mlp.experts." in k for k in dtypes)
    assert loss(MOE, None, "kjv") < loss(MOE, None, "fortunes") - 0.5


# ----------------------------------------------------------------------------- PEFT


def test_peft_adapter_is_a_faithful_conversion() -> None:
    folder = ADAPTERS / "peft-lora"
    config = json.loads((folder / "adapter_config.json").read_text())
    mlx_config = json.loads((ADAPTERS / "lora" / "adapter_config.json").read_text())
    lp = mlx_config["lora_parameters"]
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert config["r"] == lp["rank"]
    assert config["lora_alpha"] == lp["scale"] * lp["rank"]
    assert not config["use_rslora"] and not config["use_dora"]
    assert not config["fan_in_fan_out"]
    assert sorted(config["target_modules"]) == sorted(LINEAR_TARGETS)
    peft = mx.load(str(folder / "adapter_model.safetensors"))
    lora = mx.load(str(ADAPTERS / "lora" / "adapters.safetensors"))
    assert len(peft) == len(lora)
    for name, value in lora.items():
        module, leaf = name.rsplit(".", 1)
        key = f"base_model.model.{module}.{'lora_A' if leaf == 'lora_a' else 'lora_B'}.weight"
        assert peft[key].dtype == mx.float32
        assert mx.array_equal(peft[key], value.T).item(), key
