"""Small random models and adapters built with mlx-lm's own classes, for tests.

The models are made by mlx-lm's model code and saved by mlx-lm's ``save_model``;
the adapters by mlx-lm's ``linear_to_lora_layers`` and saved the way ``mlx_lm lora``
saves them (``tree_flatten(model.trainable_parameters())``), with random non-zero
``lora_b`` so the delta is not zero. They complement the trained assets in data/
with shapes and families the tests need (llama, qwen3, qwen3_moe, quantized, DoRA).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Dict, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

VOCAB = 96

BASE_CONFIGS: Dict[str, dict] = {
    "llama": dict(model_type="llama", hidden_size=64, num_hidden_layers=2,
                  intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                  rms_norm_eps=1e-5, vocab_size=VOCAB, max_position_embeddings=256,
                  rope_theta=10000.0, tie_word_embeddings=False),
    "qwen3": dict(model_type="qwen3", hidden_size=64, num_hidden_layers=2,
                  intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, rms_norm_eps=1e-6, vocab_size=VOCAB,
                  max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=True),
    "qwen3_moe": dict(model_type="qwen3_moe", hidden_size=64, num_hidden_layers=2,
                      intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                      vocab_size=VOCAB, max_position_embeddings=256, rope_theta=10000.0,
                      tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
                      decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True),
}

_COMMON = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=96, num_attention_heads=4,
               num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB,
               max_position_embeddings=256, rope_theta=10000.0)
#: more of mlx-lm's architectures, with their own layer names: fused qkv / gate_up
#: (phi3, internlm2), c_fc / fc1 / dense, GPT-2's h.N.attn.c_attn, norms and ties
OTHER_CONFIGS: Dict[str, dict] = {
    "phi3": dict(_COMMON, model_type="phi3", tie_word_embeddings=False),
    "mistral": dict(_COMMON, model_type="mistral", tie_word_embeddings=False),
    "gemma2": dict(_COMMON, model_type="gemma2", head_dim=16, query_pre_attn_scalar=16,
                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                   sliding_window=128, cache_implementation="hybrid"),
    "gemma3_text": dict(_COMMON, model_type="gemma3_text", head_dim=16,
                        query_pre_attn_scalar=16, sliding_window=128,
                        sliding_window_pattern=2),
    "starcoder2": dict(model_type="starcoder2", hidden_size=64, num_hidden_layers=2,
                       intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                       norm_epsilon=1e-5, vocab_size=VOCAB, rope_theta=10000.0,
                       tie_word_embeddings=True),
    "phi": dict(model_type="phi", hidden_size=64, num_hidden_layers=2, intermediate_size=96,
                num_attention_heads=4, num_key_value_heads=4, layer_norm_eps=1e-5,
                vocab_size=VOCAB,
                partial_rotary_factor=0.5, max_position_embeddings=256),
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, n_ctx=256, n_positions=256,
                 layer_norm_epsilon=1e-5, vocab_size=VOCAB),
    "olmo2": dict(_COMMON, model_type="olmo2", tie_word_embeddings=False),
    "cohere": dict(_COMMON, model_type="cohere", layer_norm_eps=1e-5, logit_scale=0.0625,
                   use_qk_norm=False),
    "internlm2": dict(_COMMON, model_type="internlm2", bias=False, tie_word_embeddings=False),
}
BASE_CONFIGS.update(OTHER_CONFIGS)


def write_tokenizer(path: Path, vocab: int = VOCAB) -> None:
    """A word-level tokenizer over ``vocab`` symbols, saved in the HF layout."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(vocab - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.save_pretrained(str(path))


def make_model(path: Path, family: str = "qwen3", *, dtype=mx.bfloat16, seed: int = 0,
               quantize: Optional[dict] = None, **overrides) -> Path:
    """Save a random model of ``family`` at ``path`` in the mlx-lm layout."""
    from mlx_lm.utils import _get_classes, save_config, save_model

    config = dict(BASE_CONFIGS[family], **overrides)
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    # weights of a realistic scale, so bf16 rounding behaves as in real models
    params = [(k, (mx.random.normal(v.shape) * 0.05).astype(dtype)) for k, v in
              tree_flatten(model.parameters())]
    model.load_weights(params)
    if quantize:
        nn.quantize(model, group_size=quantize["group_size"], bits=quantize["bits"],
                    mode=quantize.get("mode", "affine"))
        config["quantization"] = dict(quantize)
    mx.eval(model.parameters())
    path.mkdir(parents=True, exist_ok=True)
    save_model(path, model)
    save_config(config, path / "config.json")
    write_tokenizer(path)
    return path


def make_adapter(model_path: Path, path: Path, *, keys: Optional[Sequence[str]] = (
        "self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"), rank: int = 4,
        scale: float = 2.0, num_layers: int = -1, dora: bool = False, seed: int = 1,
        b_std: float = 0.02) -> Path:
    """Attach LoRA/DoRA layers with mlx-lm and save an adapter as ``mlx_lm lora`` does.

    ``keys=None``: mlx-lm's default, every linear layer of the adapted blocks."""
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model

    model, config = load_model(model_path)
    model.freeze()
    n = len(model.layers) if num_layers < 0 else num_layers
    lora_config = {"rank": rank, "scale": scale, "dropout": 0.0}
    if keys is not None:
        lora_config["keys"] = list(keys)
    mx.random.seed(seed)
    linear_to_lora_layers(model, n, lora_config, use_dora=dora)
    trainable = dict(tree_flatten(model.trainable_parameters()))
    new = {}
    for k, v in trainable.items():
        if k.endswith("lora_b"):
            v = mx.random.normal(v.shape) * b_std
        elif k.endswith(".m"):
            v = v * (1 + 0.05 * mx.random.normal(v.shape))
        new[k] = v.astype(mx.float32)
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "adapters.safetensors"), new)
    cfg = {"fine_tune_type": "dora" if dora else "lora", "num_layers": n,
           "lora_parameters": lora_config, "model": str(model_path)}
    (path / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    return path


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst
