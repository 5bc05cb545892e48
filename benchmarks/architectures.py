"""Every mlx-lm architecture: a tiny random bf16 model of each module in ``mlx_lm.models``
that defines ``Model`` and ``ModelArgs``, LoRA and DoRA adapters made by mlx-lm's own
``linear_to_lora_layers`` (random non-zero ``lora_b``), fused by lorakit and by mlx-lm's
fuse code, then compared.

Per architecture, in a child process with a timeout (one crash does not stop the sweep):

* ``build``: the model from its tiny config, random bf16 weights, saved with mlx-lm's
  ``save_model`` / ``save_config`` and loaded back with ``mlx_lm.utils.load_model``;
* ``lora`` / ``dora``: the adapter (mlx-lm's ``linear_to_lora_layers``, every linear of
  every block, rank 4), saved as ``mlx_lm lora`` does;
* ``mlx_fuse``: ``mlx_lm.fuse.main`` in-process (LoRA and DoRA);
* ``bits``: lorakit ``fuse(rounding="mlx-lm")`` against mlx-lm's output, tensor by
  tensor: LoRA bit-identical (names, dtypes, bytes); DoRA the same values (mlx-lm writes
  DoRA weights float32, lorakit keeps the checkpoint's dtype) and, with
  ``dtype="promote"`` (fused weights float32, the rest kept), mlx-lm's exact bytes;
* ``dtypes``: lorakit's default fuse keeps every tensor's dtype;
* ``check``: ``lorakit.check`` of that fuse: 0 wrong;
* ``forward``: the fused model loaded by mlx-lm runs one forward pass (finite logits);
  where MLX's CPU lacks a bf16 op (GatherMM) the run is repeated in float32 and says so;
* ``kl``: ``compare_outputs`` fused vs base + adapter unfused (64 tokens).

A step that fails records the error text and whose it is: ``mlx-lm`` when mlx-lm's own
code fails without lorakit (its build, load, adapter, fuse or forward of the unfused
model), ``lorakit`` otherwise.

Tiny configs come from ``TINY`` (written for this sweep where the others do not build,
run or pass transformers' config check), else mlx-lm's own ``tests/test_models.py``
(``--mlx-lm-tests``, a copy of that file; its ``ModelArgs(...)`` calls with literal
arguments and its list of config dicts); the others are built from each ``ModelArgs``'s
fields. The configs used are recorded in the JSON, and a run without ``--mlx-lm-tests``
reuses them.

  python benchmarks/architectures.py --mlx-lm-tests /path/to/mlx-lm/tests/test_models.py \\
      --out benchmarks/results/architectures.json
  python benchmarks/architectures.py --only llama,qwen3       # a few, printed
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "architectures.json"
STEPS = ("build", "lora", "dora", "mlx_fuse", "bits_lora", "bits_dora", "dtypes", "check",
         "forward", "kl")

# small values for the fields a tiny model sets (a config without a test in mlx-lm)
SMALL: Dict[str, Any] = dict(
    hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=128, head_dim=16, rms_norm_eps=1e-5,
    layer_norm_eps=1e-5, norm_eps=1e-5, max_position_embeddings=256, rope_theta=10000.0,
    num_experts=4, num_experts_per_tok=2, n_routed_experts=4, moe_intermediate_size=32,
    n_shared_experts=1, shared_expert_intermediate_size=64, num_local_experts=4,
    n_layer=2, n_head=4, n_embd=64, n_positions=256, d_model=64, n_heads=4, n_layers=2,
    num_layers=2, dim=64, hidden_dim=128, ffn_dim=128, kv_lora_rank=16, q_lora_rank=16,
    qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, first_k_dense_replace=1,
    sliding_window=64, tie_word_embeddings=False, kv_channels=16, seq_length=256,
    n_group=1, topk_group=1, num_key_value_groups=2,
)
TYPE_DEFAULTS = {"List": [], "list": [], "Dict": {}, "dict": {}, "int": 2, "float": 1e-5,
                 "bool": False, "str": ""}

# Tiny configs written for this sweep, one per architecture whose config from its fields
# (or mlx-lm's test config made narrower) does not build or run: the fields its model
# reads set as the Hugging Face configs of that family set them (rope parameters per layer
# type, head sizes that divide, a nested ``text_config``), every size small. They come
# before mlx-lm's tests' configs; each builds and runs one forward pass in mlx-lm alone
# (``--probe``) except where mlx-lm's own code fails (the row says so). dbrx, exaone4 and
# mamba2 are mlx-lm's test configs with the values transformers' config class refuses
# (``mlx_lm fuse`` loads the tokenizer, so ``config.json``, through transformers) spelt as
# the published checkpoints spell them (muse_spark's audio width too).
_ROPE = {"rope_theta": 10000.0, "rope_type": "default"}
_BASE = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
             max_position_embeddings=256, tie_word_embeddings=False)
_QWEN2 = dict(_BASE, model_type="qwen2", rope_theta=10000.0)
_DSV3 = {"model_type": "deepseek_v3", "vocab_size": 384, "hidden_size": 128,
         "intermediate_size": 256, "moe_intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 4,
         "n_group": 1, "topk_group": 1, "num_experts_per_tok": 2, "n_shared_experts": 1,
         "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": 16,
         "qk_rope_head_dim": 16, "v_head_dim": 16, "qk_nope_head_dim": 16}
TINY = {
    "dbrx": {"model_type": "dbrx", "d_model": 1024, "ffn_config": {
        "ffn_hidden_size": 2048, "moe_num_experts": 4, "moe_top_k": 2}, "attn_config": {
            "kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000}, "n_layers": 4,
        "n_heads": 4, "vocab_size": 10000},
    "exaone4": {"model_type": "exaone4", "hidden_size": 128, "intermediate_size": 128,
                "num_attention_heads": 4, "vocab_size": 1000, "rms_norm_eps": 1e-05,
                "num_hidden_layers": 4, "max_position_embeddings": 1000, "rope_theta": 10000,
                "layer_norm_epsilon": 1e-05, "num_key_value_heads": 2, "head_dim": 32,
                "tie_word_embeddings": False, "rope_scaling": None, "sliding_window": 8,
                "sliding_window_pattern": "LLGL",
                "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                                "sliding_attention"]},
    "mamba2": {"model_type": "mamba2", "num_heads": 8, "head_dim": 16, "vocab_size": 1000,
               "hidden_size": 128, "intermediate_size": 128, "state_size": 32,
               "num_hidden_layers": 4, "layer_norm_epsilon": 0.0001, "conv_kernel": 3,
               "n_groups": 4, "use_bias": False, "use_conv_bias": False,
               "tie_word_embeddings": True, "time_step_limit": [0.01, 10.0],
               "time_step_rank": "auto", "expand": 1},
    "gear": dict(_BASE, model_type="gear", sliding_window=64,
                 layer_types=["sliding_attention", "full_attention"]),
    "mellum": dict(_BASE, model_type="mellum", num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=32, norm_topk_prob=True, sliding_window=64,
                   layer_types=["sliding_attention", "full_attention"],
                   rope_parameters={"full_attention": _ROPE, "sliding_attention": _ROPE}),
    "spark2_5": dict(_BASE, model_type="spark2_5", sliding_window=64,
                     layer_types=["sliding_attention", "full_attention"],
                     rope_parameters={"full_attention": _ROPE, "sliding_attention": _ROPE}),
    "glm_moe_dsa": dict(_BASE, model_type="glm_moe_dsa", num_key_value_heads=4,
                        index_head_dim=32, index_n_heads=2, index_topk=4,
                        moe_intermediate_size=32, n_shared_experts=1, n_routed_experts=4,
                        routed_scaling_factor=1.0, kv_lora_rank=16, q_lora_rank=16,
                        qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
                        topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
                        n_group=1, topk_group=1, num_experts_per_tok=2, moe_layer_freq=1,
                        first_k_dense_replace=1, rope_parameters=_ROPE,
                        attention_bias=False),
    "minicpm3": dict(_BASE, model_type="minicpm3", dim_model_base=64, q_lora_rank=16,
                     qk_nope_head_dim=16, qk_rope_head_dim=8, kv_lora_rank=16,
                     scale_depth=1.4, scale_emb=1.0,
                     rope_scaling={"original_max_position_embeddings": 256,
                                   "short_factor": [1.0] * 4, "long_factor": [1.0] * 4}),
    "ministral3": dict(_BASE, model_type="ministral3",
                       rope_parameters=dict(_ROPE, llama_4_scaling_beta=0.1,
                                            original_max_position_embeddings=256)),
    "mistral4": dict(_BASE, model_type="mistral4", moe_intermediate_size=32,
                     n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=1.0,
                     kv_lora_rank=16, q_lora_rank=16, norm_topk_prob=True, topk_group=1,
                     num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
                     qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, head_dim=None,
                     num_key_value_heads=4,
                     rope_parameters=dict(_ROPE, llama_4_scaling_beta=0.1,
                                          original_max_position_embeddings=256)),
    # mlx-lm's test config has 2 layers under a sliding-window pattern of 4: its
    # forward indexes the cache of layer pattern-1, so the tiny model gets 4 layers.
    "cohere2": {"model_type": "cohere2", "hidden_size": 128, "head_dim": 32,
                "num_hidden_layers": 4, "sliding_window": 64, "sliding_window_pattern": 4,
                "intermediate_size": 256, "num_key_value_heads": 1,
                "num_attention_heads": 4, "vocab_size": 384, "bos_token_id": 382,
                "eos_token_id": 383},
    # mlx-lm's test config passes vocab_size outside the dict (None in it).
    "starcoder2": {"model_type": "starcoder2", "hidden_size": 128, "num_hidden_layers": 2,
                   "intermediate_size": 256, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "vocab_size": 384},
    "gptj": {"model_type": "gptj", "n_embd": 64, "vocab_size": 384, "n_positions": 256,
             "n_head": 4, "rotary_dim": 8, "n_layer": 2},
    "phixtral": {"model_type": "phixtral", "num_vocab": 384, "vocab_size": 384, "model_dim": 64, "num_heads": 4,
                 "num_layers": 2, "rotary_dim": 8, "num_experts_per_tok": 2,
                 "num_local_experts": 4},
    "gemma3": {"model_type": "gemma3", "vocab_size": 384, "text_config": {
        "model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 2,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "rms_norm_eps": 1e-6, "sliding_window": 64,
        "sliding_window_pattern": 2}},
    "gemma3_text": {"model_type": "gemma3_text", "hidden_size": 128, "num_hidden_layers": 2,
                    "intermediate_size": 256, "num_attention_heads": 4, "head_dim": 32,
                    "rms_norm_eps": 1e-4, "num_key_value_heads": 1, "sliding_window": 64,
                    "sliding_window_pattern": 2, "vocab_size": 384},
    "mistral3": {"model_type": "mistral3", "text_config": dict(
        _BASE, model_type="ministral3",
        rope_parameters=dict(_ROPE, llama_4_scaling_beta=0.1,
                             original_max_position_embeddings=256))},
    "qwen2_vl": {"model_type": "qwen2_vl", "text_config": _QWEN2},
    "kimi_k25": {"model_type": "kimi_k25", "text_config": _DSV3},
    "kimi_k3": {"model_type": "kimi_k3", "text_config": dict(
        _BASE, model_type="kimi_linear", num_key_value_heads=4,
        linear_attn_config={"num_heads": 4, "head_dim": 16, "kda_layers": [1],
                            "short_conv_kernel_size": 4},
        q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, num_experts=4, num_experts_per_token=2, num_shared_experts=1,
        moe_intermediate_size=32, first_k_dense_replace=1)},
    "minimax_m3_vl": {"model_type": "minimax_m3_vl", "text_config": dict(
        _BASE, model_type="minimax_m3", dense_intermediate_size=128,
        shared_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        rotary_dim=8, moe_layer_freq=[0, 1])},
    "muse_spark": {"model_type": "muse_spark", "audio_config": {"out_hidden_size": 64},
                   "text_config": dict(
        _BASE, post_norm_eps=1e-5, rope_parameters={"rope_theta": 10000.0},
        layer_rope_theta=[10000.0, 0], layer_types=["sliding_attention", "full_attention"],
        sliding_window=64, final_logit_softcapping=30.0, output_multiplier=1.0,
        num_local_experts=4, num_experts_per_tok=2, moe_hidden_size=64,
        moe_intermediate_size=32)},
    "openelm": {"model_type": "openelm", "ffn_dim_divisor": 64, "ffn_multipliers": [0.5, 1.0],
                "head_dim": 16, "model_dim": 64, "normalize_qk_projections": True,
                "num_kv_heads": [2, 2], "num_query_heads": [4, 4],
                "num_transformer_layers": 2, "vocab_size": 384},
    "plamo": {"model_type": "plamo", "hidden_size": 256, "num_hidden_layers": 2,
              "intermediate_size": 512, "num_attention_heads": 4, "n_shared_head": 4,
              "rms_norm_eps": 1e-5, "vocab_size": 384},
    "lfm2": {"model_type": "lfm2", "hidden_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "norm_eps": 1e-5,
             "vocab_size": 384, "full_attn_idxs": [1], "rope_theta": 10000,
             "block_dim": 128, "block_ffn_dim_multiplier": 1.5,
             "block_auto_adjust_ff_dim": True, "block_ff_dim": 256, "block_multiple_of": 64,
             "max_position_embeddings": 1000, "conv_bias": True, "conv_L_cache": 3},
    "solar_open": dict(_BASE, model_type="solar_open", moe_intermediate_size=32,
                       n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=1.0,
                       num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True,
                       rope_theta=10000.0, partial_rotary_factor=0.5),
    "prism_hadamard_qwen35": {"model_type": "prism_hadamard_qwen35", "text_config": {
        "model_type": "qwen3_5", "hidden_size": 128, "num_hidden_layers": 2,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 384, "linear_num_value_heads": 4, "linear_num_key_heads": 4,
        "linear_key_head_dim": 32, "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 3, "rms_norm_eps": 1e-05, "head_dim": 32,
        "rope_theta": 1000.0, "partial_rotary_factor": 0.5, "full_attention_interval": 2,
        "max_position_embeddings": 1000}, "schema_version": 1,
        "tensor_namespace": "mlx-lm-text", "quantization": {
            "bits": 2, "group_size": 128, "mode": "affine"},
        "modules": [{"path": "model.layers.0.mlp.down_proj", "embedding": False,
                     "dtype": "float16", "block": 0}]},
}


def model_modules() -> List[str]:
    """Every module of ``mlx_lm.models`` (the package's files, not imported yet)."""
    import pkgutil

    import mlx_lm.models as pkg

    return sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if not m.ispkg)


def configs_from_tests(path: Path) -> Dict[str, Dict[str, Any]]:
    """``{module: config}`` from the ``<module>.ModelArgs(...)`` and
    ``<module>.ModelArgs.from_dict(...)`` calls of mlx-lm's tests/test_models.py whose
    arguments are literals, or names (``**name`` too) bound to a literal dict earlier in
    the same test function (the first such call per module); then the literal config
    dicts with a ``model_type`` (``test_all_models``' list), keyed by it."""
    tree = ast.parse(path.read_text())
    out: Dict[str, Dict[str, Any]] = {}
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        local: Dict[str, Any] = {}
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 \
                    and isinstance(node.targets[0], ast.Name):
                try:
                    local[node.targets[0].id] = _literal(node.value, local)
                except ValueError:
                    pass
        for node in ast.walk(fn):
            got = _args_call(node, local)
            if got is not None and got[0] not in out:
                out[got[0]] = got[1]
    for node in ast.walk(tree):  # test_all_models' list of config dicts (outer ones first)
        if isinstance(node, ast.Dict):
            try:
                d = _literal(node, {})
            except (ValueError, TypeError, SyntaxError):
                continue
            mt = d.get("model_type") if isinstance(d, dict) else None
            if isinstance(mt, str) and mt not in out:
                out[mt] = d
    return out


def _literal(node: ast.AST, local: Dict[str, Any]) -> Any:
    """A literal, a name bound to one, ``dict(k=literal, **name)`` or ``{**name, ...}``."""
    if isinstance(node, ast.Name) and node.id in local:
        return json.loads(json.dumps(local[node.id]))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict" \
            and not node.args:
        d: Dict[str, Any] = {}
        for k in node.keywords:
            v = _literal(k.value, local)
            d.update(v if k.arg is None else {k.arg: v})
        return d
    if isinstance(node, ast.Dict):
        d = {}
        for k, v in zip(node.keys, node.values):
            val = _literal(v, local)
            d.update(val if k is None else {_literal(k, local): val})
        return d
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e, local) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):  # [{...}] * 4
        a, b = _literal(node.left, local), _literal(node.right, local)
        if isinstance(a, list) and isinstance(b, int):
            return json.loads(json.dumps(a * b))
    return ast.literal_eval(node)


def _args_call(node: ast.AST, local: Dict[str, Any]) -> Optional[tuple]:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return None
    f = node.func
    try:
        if f.attr == "ModelArgs" and isinstance(f.value, ast.Name) and not node.args:
            cfg: Dict[str, Any] = {}
            for k in node.keywords:
                v = _literal(k.value, local)
                cfg.update(v if k.arg is None else {k.arg: v})
            return f.value.id, cfg
        if f.attr == "from_dict" and isinstance(f.value, ast.Attribute) \
                and f.value.attr == "ModelArgs" and isinstance(f.value.value, ast.Name) \
                and len(node.args) == 1:
            return f.value.value.id, _literal(node.args[0], local)
    except (ValueError, TypeError, SyntaxError):
        return None
    return None


def generic_config(module: str) -> Dict[str, Any]:
    """A tiny config from ``ModelArgs``'s own fields: known size fields made small,
    required fields given a small value of their type."""
    import importlib

    m = importlib.import_module(f"mlx_lm.models.{module}")
    cfg: Dict[str, Any] = {}
    for fld in dataclasses.fields(m.ModelArgs):
        if fld.name in SMALL:
            cfg[fld.name] = SMALL[fld.name]
        elif fld.default is dataclasses.MISSING and fld.default_factory is dataclasses.MISSING:
            t = str(fld.type)
            cfg[fld.name] = next((v for k, v in TYPE_DEFAULTS.items() if k in t), None)
    cfg["model_type"] = cfg.get("model_type") or module
    return cfg


def byte_vocab(cfg: Dict[str, Any], least: int = 384) -> Dict[str, Any]:
    """The config with ``vocab_size`` raised to ``least`` where smaller (lorakit.synth's
    byte-level tokenizer needs 256 ids and the specials); nested ``text_config`` too."""
    cfg = json.loads(json.dumps(cfg))
    for c in (cfg, cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}):
        if isinstance(c.get("vocab_size"), int) and c["vocab_size"] < least:
            c["vocab_size"] = least
    return cfg


# -- one architecture (in a child process) -------------------------------------------------
class Step(Exception):
    def __init__(self, step: str, owner: str, err: BaseException):
        super().__init__(f"{type(err).__name__}: {err}")
        self.step, self.owner = step, owner


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400]


def _save_adapter(model_path: Path, out: Path, dora: bool) -> Path:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model

    model, _ = load_model(model_path)
    model.freeze()
    n = len(model.layers)
    lora = {"rank": 4, "scale": 2.0, "dropout": 0.0}
    mx.random.seed(1)
    linear_to_lora_layers(model, n, lora, use_dora=dora)
    new = {}
    for k, v in tree_flatten(model.trainable_parameters()):
        if k.endswith("lora_b"):
            v = mx.random.normal(v.shape) * 0.02
        elif k.endswith(".m"):
            v = v * (1 + 0.05 * mx.random.normal(v.shape))
        new[k] = v.astype(mx.float32)
    if not new:
        kinds = sorted({type(m).__name__ for _, m in model.layers[0].named_modules()
                        if "Linear" in type(m).__name__})
        raise ValueError("mlx-lm's linear_to_lora_layers adapted no layer (this model's "
                         f"linear layers: {', '.join(kinds) or 'none'})")
    out.mkdir(parents=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), new)
    cfg = {"fine_tune_type": "dora" if dora else "lora", "num_layers": n,
           "lora_parameters": lora, "model": str(model_path)}
    (out / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    return out


def _build(module: str, cfg: Dict[str, Any], path: Path) -> Dict[str, Any]:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes, load_model, save_config, save_model

    from lorakit.synth.tokenizer import write_tokenizer

    cfg = dict(cfg)
    model_cls, args_cls = _get_classes(cfg)
    if args_cls.__module__ != f"mlx_lm.models.{module}":  # its Model may be another's
        raise ValueError(f"model_type {cfg['model_type']!r} loads {args_cls.__module__}")
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(cfg))
    shrunk = False
    if _count(model) > MAX_PARAMS:  # a test config at the defaults (cohere: 8192 wide)
        cfg, shrunk = _shrink(cfg, args_cls), True
        model = model_cls(args_cls.from_dict(cfg))
        if _count(model) > MAX_PARAMS:
            raise ValueError(f"no tiny config: {_count(model)} parameters after shrinking")
    params = [(k, (mx.random.normal(v.shape) * 0.05).astype(mx.bfloat16)
               if mx.issubdtype(v.dtype, mx.floating) else v)
              for k, v in tree_flatten(model.parameters())]
    model.load_weights(params)
    mx.eval(model.parameters())
    path.mkdir(parents=True)
    save_model(path, model)
    save_config(cfg, path / "config.json")
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    write_tokenizer(path, cfg if "vocab_size" in cfg or "vocab_size" not in text else
                    {**cfg, "vocab_size": text["vocab_size"]})  # the vocabulary nested only
    load_model(path)  # mlx-lm reads what it wrote
    return {"params": _count(model), "shrunk": shrunk, **({"config": cfg} if shrunk else {})}


#: a tiny model's parameter cap (the sweep runs on a laptop CPU)
MAX_PARAMS = 150_000_000


def _count(model: Any) -> int:
    from mlx.utils import tree_flatten

    n = 0
    for _, v in tree_flatten(model.parameters()):
        n += v.size
    return n


def _shrink(cfg: Dict[str, Any], args_cls: Any) -> Dict[str, Any]:
    """``cfg`` made small the way its own proportions allow: 4 attention heads of the
    config's own head size (the KV heads in the same ratio, widths scaled with the hidden
    size), a vocabulary of at most 1024, at most 8 experts (2 per token), and 2 layers
    where no per-layer list fixes the count. Also in a nested ``text_config``."""
    out = json.loads(json.dumps(cfg))
    for c in (out, out.get("text_config") if isinstance(out.get("text_config"), dict) else None):
        if c is not None:
            _shrink_one(c, {f.name: f.default for f in dataclasses.fields(args_cls)}
                        if c is out else {})
    return byte_vocab(out)


def _pick(c: Dict[str, Any], defaults: Dict[str, Any], names: tuple) -> Optional[str]:
    return next((n for n in names if isinstance(c.get(n, defaults.get(n)), int)), None)


def _shrink_one(c: Dict[str, Any], defaults: Dict[str, Any]) -> None:
    get = lambda n: c.get(n, defaults.get(n))  # noqa: E731
    h = _pick(c, defaults, ("hidden_size", "n_embd", "d_model", "dim"))
    nh = _pick(c, defaults, ("num_attention_heads", "n_head", "n_heads"))
    kv = _pick(c, defaults, ("num_key_value_heads", "n_kv_heads", "num_kv_heads"))
    nl = _pick(c, defaults, ("num_hidden_layers", "n_layer", "n_layers", "num_layers"))
    if h and nh and get(nh) > 4 and get(h) % get(nh) == 0:
        r, head = 4 / get(nh), get(h) // get(nh)
        for w in WIDTHS:
            if w != "vocab_size" and isinstance(get(w), int) and get(w) > 0:
                c[w] = max(8, int(get(w) * r) // 8 * 8)
        c[h] = head * 4  # the head size kept (not the scaled width divided again)
        if kv and get(kv):
            c[kv] = max(1, get(kv) * 4 // get(nh))
        c[nh] = 4
    if isinstance(get("vocab_size"), int) and get("vocab_size") > 1024:
        c["vocab_size"] = 1024
    for e in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"):
        if isinstance(get(e), int) and get(e) > 8:
            c[e] = 8
    for k in ("num_experts_per_tok", "moe_top_k", "top_k"):
        if isinstance(get(k), int) and get(k) > 2:
            c[k] = 2
    if nl and get(nl) > 2:
        n = get(nl)
        if not any(isinstance(v, list) and len(v) == n for v in c.values()):
            c[nl] = 2


#: the fields :func:`_shrink` makes small: widths only (layer counts and per-layer lists,
#: head counts and head sizes stay as the config has them)
WIDTHS = ("hidden_size", "intermediate_size", "moe_intermediate_size",
          "shared_expert_intermediate_size", "n_embd", "d_model", "dim", "hidden_dim",
          "ffn_dim", "vocab_size")


def _tensors(path: Path) -> Dict[str, Any]:
    import mlx.core as mx

    out: Dict[str, Any] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(mx.load(str(f)))
    return out


def _bits(a: Any, b: Any) -> bool:
    import numpy as np

    return a.dtype == b.dtype and a.shape == b.shape and \
        np.array_equal(np.array(a.view(_uint(a))), np.array(b.view(_uint(b))))


def _uint(a: Any):
    import mlx.core as mx

    return {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}[a.dtype.size]


def _compare(ours: Path, theirs: Path, *, values: bool = False) -> Dict[str, Any]:
    """Per tensor: same names, dtypes and bytes (``values``: theirs cast to our dtype
    equals ours bit for bit, i.e. the same values written in another dtype)."""
    a, b = _tensors(ours), _tensors(theirs)
    differ, dtypes = [], []
    for n in sorted(set(a) | set(b)):
        if n not in a or n not in b:
            differ.append(n)
            continue
        if a[n].dtype != b[n].dtype:
            dtypes.append(f"{n}: {a[n].dtype} vs {b[n].dtype}")
        y = b[n].astype(a[n].dtype) if values else b[n]
        if not _bits(a[n], y):
            differ.append(n)
    return {"tensors": len(set(a) | set(b)), "differ": len(differ),
            "first_differ": differ[:3], "dtype_differ": len(dtypes),
            "first_dtype_differ": dtypes[:3], "_differ": differ}


def mlx_lm_rewrites(base: Path, names: List[str], ours: Path, theirs: Path) -> List[str]:
    """Those of ``names`` that mlx-lm itself rewrites when it loads the base, with no
    adapter and no lorakit (a model's ``sanitize``, e.g. baichuan_m1 renormalising
    ``lm_head``): mlx-lm's loaded value differs from the base file, ``mlx_lm fuse`` wrote
    mlx-lm's loaded value, lorakit kept the file's bytes."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    loaded = dict(tree_flatten(load_model(base)[0].parameters()))
    file, a, b = _tensors(base), _tensors(ours), _tensors(theirs)
    return [n for n in names if n in loaded and n in file and n in a and n in b
            and not _bits(loaded[n], file[n]) and _bits(a[n], file[n])
            and _bits(b[n], loaded[n])]


def _forward(path: Path, adapter: Optional[Path] = None) -> Dict[str, Any]:
    """One forward pass of the model at ``path`` (adapter attached unfused), in its own
    dtypes, or in float32 where MLX's CPU lacks the bf16 op (what lorakit's reports do)."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    from lorakit.fusion.model import attach_adapter
    from lorakit.inspect.moe_cpu import run_or_float32

    model, _ = load_model(path)
    if adapter is not None:
        model = attach_adapter(model, adapter)
    x = mx.array([[1, 2, 3, 4]])
    logits, f32 = run_or_float32(model, lambda: model(x))
    return {"finite": bool(mx.all(mx.isfinite(logits.astype(mx.float32)))),
            "float32": bool(f32), "shape": list(logits.shape)}


def _forward_mlx_lm(path: Path, adapter: Optional[Path] = None) -> Dict[str, Any]:
    """The base model's forward pass with mlx-lm and MLX alone (no lorakit; ``adapter``
    attached by mlx-lm's ``load_adapters``): in its own dtypes, else (MLX's CPU refusing
    a bf16 op) with ``set_dtype(float32)``."""
    import mlx.core as mx
    from mlx_lm.utils import load_adapters, load_model

    model, _ = load_model(path)
    if adapter is not None:
        model = load_adapters(model, str(adapter))
    x = mx.array([[1, 2, 3, 4]])
    try:
        out, f32 = model(x), False
        mx.eval(out)
    except RuntimeError as e:
        if "only supports float32" not in str(e):
            raise
        model.set_dtype(mx.float32)
        out, f32 = model(x), True
        mx.eval(out)
    return {"float32": f32}


def run_one(module: str, cfg: Dict[str, Any], work: Path) -> Dict[str, Any]:
    """All steps for one architecture; a failing step ends the row with its error."""
    import lorakit
    from lorakit.io.formats.checkpoint import Checkpoint

    row: Dict[str, Any] = {"module": module, "steps": {}, "config": cfg}
    st = row["steps"]
    base, lora_ad, dora_ad = work / "base", work / "lora", work / "dora"

    def step(name: str, owner: str, fn):
        t0 = time.perf_counter()
        try:
            res = fn()
        except Exception as e:  # recorded: the row says which step and whose
            st[name] = {"ok": False, "owner": owner, "error": _err(e),
                        "trace": traceback.format_exc().splitlines()[-4:]}
            raise Step(name, owner, e) from None
        st[name] = {"ok": True, "s": round(time.perf_counter() - t0, 2)}
        if isinstance(res, dict):
            st[name].update(res)
        return res

    try:
        built = step("build", "mlx-lm", lambda: _build(module, cfg, base))
        if built.get("shrunk"):
            row["config"] = st["build"].pop("config")
        step("lora", "mlx-lm", lambda: _save_adapter(base, lora_ad, False))
        try:
            step("dora", "mlx-lm", lambda: _save_adapter(base, dora_ad, True))
        except Step:
            dora_ad = None
        step("mlx_fuse", "mlx-lm", lambda: _mlx_fuse(base, lora_ad, dora_ad, work))
        if "dora" in st.get("mlx_fuse", {}).get("failed", ""):
            dora_ad = None

        def bits_lora():
            lorakit.fuse(base, lora_ad, work / "k-lora", rounding="mlx-lm", progress=False)
            r = _compare(work / "k-lora", work / "m-lora")
            names = r.pop("_differ")
            rewritten = mlx_lm_rewrites(base, names, work / "k-lora", work / "m-lora")
            if rewritten:  # mlx-lm's load changes them, adapter or not: not the fuse's
                r["mlx_lm_rewrites_untouched"] = rewritten
                r["differ"] -= len(rewritten)
            if r["differ"] or r["dtype_differ"]:
                raise AssertionError(f"LoRA differs from mlx_lm fuse: {r}")
            return r

        step("bits_lora", "lorakit", bits_lora)
        if dora_ad is not None:
            def bits_dora():
                lorakit.fuse(base, dora_ad, work / "k-dora", rounding="mlx-lm", progress=False)
                lorakit.fuse(base, dora_ad, work / "k-dora32", rounding="mlx-lm",
                             dtype="promote", progress=False)
                vals = _compare(work / "k-dora", work / "m-dora", values=True)
                exact = _compare(work / "k-dora32", work / "m-dora")
                for r, ours in ((vals, "k-dora"), (exact, "k-dora32")):
                    rewritten = mlx_lm_rewrites(base, r.pop("_differ"), work / ours,
                                                work / "m-dora")
                    if rewritten:
                        r["mlx_lm_rewrites_untouched"] = rewritten
                        r["differ"] -= len(rewritten)
                if vals["differ"] or exact["differ"] or exact["dtype_differ"]:
                    raise AssertionError(f"DoRA differs: values {vals}, float32 {exact}")
                return {"values": vals, "promote_exact": exact}

            try:
                step("bits_dora", "lorakit", bits_dora)
            except Step:
                pass

        def dtypes():
            lorakit.fuse(base, lora_ad, work / "nearest", progress=False)
            b, a = Checkpoint(base), Checkpoint(work / "nearest")
            bad = [n for n in b.tensors if a.info(n).dtype != b.info(n).dtype]
            if bad or set(a.tensors) != set(b.tensors):
                raise AssertionError(f"dtypes changed: {bad[:3]}")
            return {"tensors": len(b.tensors)}

        step("dtypes", "lorakit", dtypes)

        def check():
            rep = lorakit.check(work / "nearest", base, lora_ad, progress=False)
            wrong = sum(r["status"] == "wrong" for r in rep.rows)
            if wrong:
                raise AssertionError(f"check: {wrong} wrong: {rep}")
            return {"rows": len(rep.rows), "wrong": wrong, "status": rep.status}

        step("check", "lorakit", check)
        try:  # the base in mlx-lm alone first: a failure there is mlx-lm's own
            step("forward_base", "mlx-lm", lambda: _forward_mlx_lm(base))
            step("forward_unfused_mlx_lm", "mlx-lm", lambda: _forward_mlx_lm(base, lora_ad))
            step("forward_unfused", "lorakit", lambda: _forward(base, lora_ad))
        except Step:
            pass
        owner = "mlx-lm" if not st["forward_base"]["ok"] else "lorakit"
        step("forward", owner, lambda: _forward(work / "nearest"))
        if not st.get("forward_unfused_mlx_lm", {}).get("ok"):
            owner = "mlx-lm"  # the unfused side of the KL cannot run in mlx-lm itself

        def kl():
            rep = lorakit.compare_outputs(str(work / "nearest"), (str(base), str(lora_ad)),
                                          tokens=64, context=32)
            return {"mean_kl": float(rep.mean_kl), "top1": float(rep.top1_agreement),
                    "float32": list(rep.float32)}

        step("kl", owner, kl)
    except Step:
        pass
    return row


def _mlx_fuse(base: Path, lora_ad: Path, dora_ad: Optional[Path], work: Path) -> Dict[str, Any]:
    from mlx_lm import fuse as mlx_fuse

    def one(ad: Path, out: Path) -> None:
        argv = sys.argv
        sys.argv = ["mlx_lm.fuse", "--model", str(base), "--adapter-path", str(ad),
                    "--save-path", str(out)]
        try:
            mlx_fuse.main()
        finally:
            sys.argv = argv

    one(lora_ad, work / "m-lora")
    res: Dict[str, Any] = {}
    if dora_ad is not None:
        try:
            one(dora_ad, work / "m-dora")
        except Exception as e:  # mlx-lm cannot fuse its own DoRA adapter here
            res["failed"] = f"dora: {_err(e)}"
    return res


def probe(cfg_json: str) -> int:
    """mlx-lm and MLX alone (no lorakit imported): the model from its config, its random
    float32 weights, one forward pass, as mlx-lm's own tests/test_models.py runs it."""
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    mx.set_default_device(mx.cpu)
    cfg = json.loads(cfg_json)
    model_cls, args_cls = _get_classes(cfg)
    model = model_cls(args_cls.from_dict(cfg))
    model.set_dtype(mx.float32)
    mx.eval(model(mx.array([[0, 1]])))
    assert "lorakit" not in sys.modules
    return 0


def child(module: str, cfg_json: str) -> int:
    import mlx.core as mx

    mx.set_default_device(mx.cpu)
    with tempfile.TemporaryDirectory(prefix=f"arch-{module}-") as d:
        row = run_one(module, json.loads(cfg_json), Path(d))
    sys.stdout.write("\nROW " + json.dumps(row) + "\n")
    return 0


# -- the sweep ------------------------------------------------------------------------------
def classify(module: str) -> Dict[str, Any]:
    import importlib

    try:
        m = importlib.import_module(f"mlx_lm.models.{module}")
    except BaseException as e:  # an optional dependency missing (olmo: sys.exit(1))
        return {"module": module, "import_error": _err(e) if str(e) not in ("", "1") else
                f"{type(e).__name__}({e}) on import (an optional dependency missing)"}
    return {"module": module, "model": hasattr(m, "Model") and hasattr(m, "ModelArgs")}


def classify_build(row: Dict[str, Any]) -> None:
    """A build or base forward pass that fails on a config this script made up (from
    ``ModelArgs``'s fields, or a test config made narrower) is the config's failure
    (owner ``tiny config``), not mlx-lm's nor lorakit's: mlx-lm's own would fail on
    mlx-lm's own config."""
    st = row.get("steps", {})
    made_up = row.get("config_source") == "from ModelArgs fields" or \
        st.get("build", {}).get("shrunk") or \
        st.get("build", {}).get("error", "").startswith("ValueError: no tiny config")
    for name in ("build", "forward_base", "forward", "kl"):
        b = st.get(name, {})
        if made_up and not b.get("ok", True) and b.get("owner") == "mlx-lm" \
                and not b.get("error", "").startswith(("import: ", "mlx-lm alone")):
            b["owner"] = "tiny config"


def summarize(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    def ok(r, s):
        return r.get("steps", {}).get(s, {}).get("ok", False)

    fails = [(r["module"], s, v) for r in rows for s, v in r.get("steps", {}).items()
             if not v["ok"]]
    return {
        "tried": len(rows),
        "built": sum(ok(r, "build") for r in rows),
        "lora_made": sum(ok(r, "lora") for r in rows),
        "dora_made": sum(ok(r, "dora") for r in rows),
        "mlx_fused": sum(ok(r, "mlx_fuse") for r in rows),
        "lora_bit_identical": sum(ok(r, "bits_lora") for r in rows),
        "dora_same_values": sum(ok(r, "bits_dora") for r in rows),
        "mlx_lm_rewrites_untouched": sum(bool(r.get("steps", {}).get("bits_lora", {})
                                              .get("mlx_lm_rewrites_untouched"))
                                         for r in rows),
        "dtypes_kept": sum(ok(r, "dtypes") for r in rows),
        "check_0_wrong": sum(ok(r, "check") for r in rows),
        "forward_runs": sum(ok(r, "forward") for r in rows),
        "forward_float32": sum(r.get("steps", {}).get("forward", {}).get("float32", False)
                               for r in rows),
        "kl_runs": sum(ok(r, "kl") for r in rows),
        "failures_lorakit": sum(v["owner"] == "lorakit" for _, _, v in fails),
        "failures_mlx_lm": sum(v["owner"] == "mlx-lm" for _, _, v in fails),
        "not_built_tiny_config": sum(v["owner"] == "tiny config" for _, _, v in fails),
        "failures_unclassified": sum(v["owner"] == "unclassified" for _, _, v in fails),
        "timeouts": sum(bool(r.get("timeout")) for r in rows),
    }


#: the BENCHMARKS.md rows: (summary key, what it counts)
COUNTS = (
    ("tried", "architectures tried: every module of `mlx_lm.models` with `Model` and `ModelArgs`"),
    ("built", "built: a tiny random bf16 model saved and loaded back by mlx-lm"),
    ("lora_made", "LoRA adapter made by mlx-lm's `linear_to_lora_layers`"),
    ("mlx_fused", "fused by `mlx_lm fuse` (mlx-lm's own code)"),
    ("lora_bit_identical", "LoRA, `--rounding mlx-lm`: bit-identical to `mlx_lm fuse`, every tensor"),
    ("mlx_lm_rewrites_untouched", "... of which `mlx_lm fuse` rewrote a tensor the adapter "
                                  "does not touch (mlx-lm's load does so without an adapter: "
                                  "the model's `sanitize`); lorakit kept the base's bytes"),
    ("dora_made", "DoRA adapter made by mlx-lm"),
    ("dora_same_values", "DoRA, `--rounding mlx-lm`: same values, dtype kept; `--dtype promote`: "
                         "mlx_lm fuse's exact bytes"),
    ("dtypes_kept", "default fuse keeps every tensor's dtype"),
    ("check_0_wrong", "`lorakit check`: 0 wrong"),
    ("forward_runs", "the fused model's forward pass runs (finite logits)"),
    ("forward_float32", "... of which in float32 (MLX's CPU refuses a bf16 op: GatherMM)"),
    ("kl_runs", "`compare_outputs` fused vs unfused runs"),
    ("failures_lorakit", "failures that are lorakit's"),
    ("failures_mlx_lm", "failures that are mlx-lm's own (its error, below)"),
    ("not_built_tiny_config", "stopped by a config this script made up (none in mlx-lm's "
                              "tests, or a test config made narrower) that does not build or run"),
)


def markdown(doc: Dict[str, Any]) -> str:
    """The BENCHMARKS.md section, from the sweep's JSON (a test compares the two)."""
    s = doc["summary"]
    lines = ["## Every mlx-lm architecture", "",
             f"`python benchmarks/architectures.py --mlx-lm-tests mlx-lm/tests/test_models.py --out "
             f"benchmarks/results/architectures.json` (mlx-lm {doc['mlx_lm']}; "
             "`mlx-lm/tests/test_models.py` of its repository gives the tiny configs; each architecture in its own "
             "process). A tiny random bf16 model of every model module, LoRA and DoRA "
             "adapters from mlx-lm's own `linear_to_lora_layers` (rank 4, every linear of "
             "every block, random non-zero `lora_b`), fused by lorakit and by `mlx_lm fuse`, "
             "compared tensor by tensor, checked, run, and compared with the unfused adapter "
             "(KL). Modules without a model (" + ", ".join(f"`{m}`" for m in doc["not_models"])
             + ") are not counted.", "",
             "| what | count |", "|---|---|"]
    lines += [f"| {what} (`{k}`) | {s[k]} |" for k, what in COUNTS]
    groups: Dict[tuple, List[str]] = {}
    for r in doc["rows"]:
        for step, v in r["steps"].items():
            if not v["ok"]:
                groups.setdefault((v["owner"], step, v["error"][:90]), []).append(r["module"])
    lines += ["", "The failures, each with its error (mlx-lm's own: the same error without "
              "lorakit; `tiny config`: the config this script made up does not build):", "",
              "| owner | step | error | architectures |", "|---|---|---|---|"]
    for (owner, step, err), mods in sorted(groups.items(), key=lambda kv: (kv[0][0], -len(kv[1]),
                                                                           kv[0][1:])):
        err = err.replace("|", "\\|")
        lines.append(f"| {owner} | {step} | {err} | {len(mods)}: {', '.join(mods)} |")
    return "\n".join(lines) + "\n"


def readme_line(doc: Dict[str, Any]) -> str:
    """README.md's sentence of the sweep's counts, from its JSON (a test finds it there)."""
    s = doc["summary"]
    tiny = (f", {s['not_built_tiny_config']} a made-up config's"
            if s["not_built_tiny_config"] else "")
    return (f"Every model module of mlx-lm {doc['mlx_lm']}, a tiny random model each: of "
            f"{s['tried']}, {s['built']} build and `mlx_lm fuse` fuses {s['mlx_fused']}; "
            f"lorakit's LoRA fuse is bit-identical to it in {s['lora_bit_identical']} of "
            f"{s['mlx_fused']}, DoRA the same values in {s['dora_same_values']}, "
            f"{s['kl_runs']} run and match the unfused adapter (KL); failures: "
            f"{s['failures_lorakit']} lorakit's, {s['failures_mlx_lm']} mlx-lm's own{tiny} "
            "([measured](BENCHMARKS.md#every-mlx-lm-architecture)).")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mlx-lm-tests", type=Path, help="mlx-lm's tests/test_models.py")
    p.add_argument("--only", help="comma-separated module names")
    p.add_argument("--timeout", type=int, default=240)
    p.add_argument("--out", type=Path)
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--probe", help=argparse.SUPPRESS)
    p.add_argument("--markdown", action="store_true",
                   help="print --out's BENCHMARKS.md section (no model is run)")
    p.add_argument("--readme-line", action="store_true",
                   help="print --out's README.md sentence of the counts (no model is run)")
    p.add_argument("--resummarize", action="store_true",
                   help="recompute --out's summary from its rows (no model is run)")
    a = p.parse_args(argv)
    if a.child:
        return child(*a.child)
    if a.probe:
        return probe(a.probe)
    if a.markdown:
        sys.stdout.write(markdown(json.loads(a.out.read_text())))
        return 0
    if a.readme_line:
        sys.stdout.write(readme_line(json.loads(a.out.read_text())) + "\n")
        return 0
    if a.resummarize:
        doc = json.loads(a.out.read_text())
        for r in doc["rows"]:
            classify_build(r)
        doc["summary"] = summarize(doc["rows"])
        a.out.write_text(json.dumps(doc, indent=1) + "\n")
        print(json.dumps(doc["summary"], indent=1))
        return 0

    old: Dict[str, Any] = {}
    src = a.out if a.out and a.out.exists() else DEFAULT_OUT
    if src.exists():
        old = {r["module"]: r.get("config") for r in json.loads(src.read_text())["rows"]
               if r.get("steps", {}).get("build", {}).get("owner") != "tiny config"}
    from_tests = configs_from_tests(a.mlx_lm_tests) if a.mlx_lm_tests else {}
    mods = model_modules()
    if a.only:
        mods = [m for m in mods if m in a.only.split(",")]
    rows, skipped = [], []
    t_all = time.perf_counter()
    for mod in mods:
        c = classify(mod)
        if "import_error" in c:
            rows.append({"module": mod, "steps": {"build": {
                "ok": False, "owner": "mlx-lm", "error": "import: " + c["import_error"]}}})
            continue
        if not c["model"]:
            skipped.append(mod)
            continue
        if mod in TINY:
            cfg, src = TINY[mod], "written for this sweep (TINY)"
        elif mod in from_tests:
            cfg, src = from_tests[mod], "mlx-lm tests/test_models.py"
        elif old.get(mod):
            cfg, src = old[mod], "recorded"
        else:
            cfg, src = generic_config(mod), "from ModelArgs fields"
        cfg.setdefault("model_type", mod)
        cfg = byte_vocab(cfg)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, __file__, "--child", mod, json.dumps(cfg)],
                                  capture_output=True, text=True, timeout=a.timeout)
            line = [x for x in proc.stdout.splitlines() if x.startswith("ROW ")]
            row = json.loads(line[-1][4:]) if line else {
                "module": mod, "config": cfg, "steps": {"build": {
                    "ok": False, "owner": "unclassified",
                    "error": f"child exited {proc.returncode}: {proc.stderr[-300:]}"}}}
            if not line:  # a crash: does mlx-lm crash the same way without lorakit?
                for _ in range(3):  # heap corruption shows up only now and then
                    pr = subprocess.run([sys.executable, __file__, "--probe", json.dumps(cfg)],
                                        capture_output=True, text=True, timeout=a.timeout)
                    if pr.returncode != 0:
                        break
                if pr.returncode != 0:
                    row["steps"]["build"].update(
                        owner="mlx-lm", error=f"mlx-lm alone (no lorakit: its model, one "
                        f"forward pass) exits {pr.returncode}: {pr.stderr.strip()[-160:]}")
        except subprocess.TimeoutExpired:
            row = {"module": mod, "config": cfg, "timeout": True, "steps": {"build": {
                "ok": False, "owner": "unclassified",
                "error": f"timeout after {a.timeout} s"}}}
        row["config_source"] = src
        classify_build(row)
        row["s"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(_line(row), flush=True)
        if a.out:  # after every row: an interrupted sweep keeps what it did
            _write(a, rows, skipped, t_all)
    print(json.dumps(summarize(rows), indent=1))
    if a.out:
        _write(a, rows, skipped, t_all)
    return 0


def _write(a: Any, rows: List[Dict[str, Any]], skipped: List[str], t_all: float) -> None:
    """The JSON at ``a.out``; a partial run (``--only``) keeps the other rows there."""
    import mlx_lm

    prev = json.loads(a.out.read_text()) if a.only and a.out.exists() else None
    if prev is not None:
        ran = {r["module"] for r in rows}
        rows = sorted([r for r in prev["rows"] if r["module"] not in ran] + rows,
                      key=lambda r: r["module"])
        skipped = prev.get("not_models", skipped)
    doc = {"what": "benchmarks/architectures.py: every mlx-lm model module, tiny bf16 "
                   "model, LoRA + DoRA, lorakit fuse vs mlx_lm fuse",
           "mlx_lm": mlx_lm.__version__, "platform": platform.platform(),
           "not_models": skipped, "summary": summarize(rows),
           "seconds": round(time.perf_counter() - t_all, 1) if prev is None else
           prev.get("seconds"), "rows": rows}
    tmp = a.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(a.out)


def _line(row: Dict[str, Any]) -> str:
    st = row.get("steps", {})
    marks = " ".join(f"{s}:{'ok' if st[s]['ok'] else 'FAIL'}" for s in STEPS if s in st)
    bad = next((f"  [{s} {v['owner']}] {v['error']}" for s, v in st.items() if not v["ok"]), "")
    return f"{row['module']:<24} {marks}{bad}"


if __name__ == "__main__":
    sys.exit(main())
