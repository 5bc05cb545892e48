"""Named model shapes: published config.json fields, and the adapter target keys."""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

__all__ = ["PRESETS", "DEFAULT_KEYS", "presets"]

_LLAMA3_ROPE = {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"}


def _config(arch: str, model_type: str, **fields: Any) -> dict:
    """A published config.json: the fields all these families share, then its own, keys
    sorted as Hugging Face publishes them."""
    common = {"architectures": [arch], "attention_bias": False, "attention_dropout": 0.0,
              "hidden_act": "silu", "initializer_range": 0.02, "model_type": model_type,
              "torch_dtype": "bfloat16", "use_cache": True}
    return dict(sorted({**common, **fields}.items()))


def _qwen(arch: str, model_type: str, layers: int, **fields: Any) -> dict:
    return _config(arch, model_type, bos_token_id=151643, eos_token_id=151645, head_dim=128,
                   max_position_embeddings=40960, max_window_layers=layers,
                   num_hidden_layers=layers, rms_norm_eps=1e-06, rope_scaling=None,
                   sliding_window=None, transformers_version="4.51.0",
                   use_sliding_window=False, vocab_size=151936, **fields)


def _qwen3(hidden: int, inter: int, layers: int, heads: int, kv: int, tied: bool) -> dict:
    return _qwen("Qwen3ForCausalLM", "qwen3", layers, hidden_size=hidden,
                 intermediate_size=inter, num_attention_heads=heads, num_key_value_heads=kv,
                 rope_theta=1000000, tie_word_embeddings=tied)


def _llama3(hidden: int, inter: int, layers: int, heads: int, kv: int, tied: bool,
            rope_factor: float, eos: Any) -> dict:
    return _config("LlamaForCausalLM", "llama", bos_token_id=128000, eos_token_id=eos,
                   head_dim=hidden // heads, hidden_size=hidden, intermediate_size=inter,
                   max_position_embeddings=131072, mlp_bias=False, num_attention_heads=heads,
                   num_hidden_layers=layers, num_key_value_heads=kv, pretraining_tp=1,
                   rms_norm_eps=1e-05, rope_scaling=dict(_LLAMA3_ROPE, factor=rope_factor),
                   rope_theta=500000.0, tie_word_embeddings=tied,
                   transformers_version="4.45.0", vocab_size=128256)


def _qwen3_moe(layers: int, experts: int, per_tok: int) -> dict:
    return _qwen("Qwen3MoeForCausalLM", "qwen3_moe", layers, decoder_sparse_step=1,
                 hidden_size=2048, intermediate_size=6144, mlp_only_layers=[],
                 moe_intermediate_size=768, norm_topk_prob=True, num_attention_heads=32,
                 num_experts=experts, num_experts_per_tok=per_tok, num_key_value_heads=4,
                 output_router_logits=False, rope_theta=1000000.0,
                 router_aux_loss_coef=0.001, tie_word_embeddings=False)


#: Named shapes: the published config.json of each model (Hugging Face), verbatim
#: in every field that decides a tensor's shape. "qwen3-moe" is Qwen3-30B-A3B's
#: layer shape with 8 layers of 16 experts (1.4B parameters): the MoE code path at
#: a size that fits on a laptop.
PRESETS: Dict[str, dict] = {
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, 8, True),
    "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, 8, True),
    "qwen3-4b": _qwen3(2560, 9728, 36, 32, 8, True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, 8, False),
    "llama-3.2-1b": _llama3(2048, 8192, 16, 32, 8, True, 32.0, 128001),
    "llama-3.2-3b": _llama3(3072, 8192, 28, 24, 8, True, 32.0, 128001),
    "llama-3.1-8b": dict(_llama3(4096, 14336, 32, 32, 8, False, 8.0, 128001),
                         eos_token_id=[128001, 128008, 128009]),
    "qwen3-30b-a3b": _qwen3_moe(48, 128, 8),
    "qwen3-moe": _qwen3_moe(8, 16, 4),
}

#: Default adapter targets: the 7 projections of every transformer block.
DEFAULT_KEYS = ("q", "k", "v", "o", "gate", "up", "down")

_KEY_ALIASES: Dict[str, Tuple[str, ...]] = {k: (f"self_attn.{k}_proj",) for k in "qkvo"}
_KEY_ALIASES.update({k: (f"mlp.{k}_proj", f"mlp.switch_mlp.{k}_proj",
                         f"block_sparse_moe.switch_mlp.{k}_proj") for k in ("gate", "up", "down")})
_KEY_ALIASES.update({f"{k}_proj": v for k, v in list(_KEY_ALIASES.items())})
_MIXTRAL = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}


def presets() -> List[str]:
    """Names of the built-in shapes."""
    return list(PRESETS)
