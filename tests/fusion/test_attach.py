"""Unfused adapters on a model: lorakit's attach_adapter builds mlx-lm's own LoRA/DoRA
layers. For mlx-lm adapters it gives exactly what mlx-lm's load_adapters gives; for
PEFT adapters (which mlx-lm cannot load) its outputs match the fused model's up to
rounding, and decode timing / generation comparison can run them unfused."""
from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import model_factory as mf
import numpy as np
import pytest

import lorakit
from lorakit.fusion.model import attach_adapter, load_unfused

PEFT = Path(__file__).resolve().parents[1] / "fixtures" / "peft"
TOKENS = mx.array([[1, 5, 9, 3, 7, 2, 11, 4]])


def logits(model) -> np.ndarray:
    return np.array(model(TOKENS).astype(mx.float32))


@pytest.mark.parametrize("family,kw", [
    ("llama", dict(keys=("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"))),
    ("qwen3", dict(keys=("self_attn.o_proj", "embed_tokens"), dora=False)),
    ("llama", dict(keys=("self_attn.q_proj", "mlp.up_proj"), dora=True)),
    ("qwen3_moe", dict(keys=("self_attn.k_proj", "mlp.switch_mlp.gate_proj"))),
])
def test_same_as_mlx_lm_load_adapters(family: str, kw: dict, tmp_path: Path) -> None:
    from mlx_lm.utils import load_adapters, load_model

    # MLX's CPU gather-matmul (MoE experts) runs in float32 only
    dtype = mx.float32 if family == "qwen3_moe" else mx.bfloat16
    base = mf.make_model(tmp_path / "base", family, dtype=dtype)
    adapter = mf.make_adapter(base, tmp_path / "adapter", **kw)
    theirs = load_adapters(load_model(base)[0], str(adapter))
    theirs.eval()
    ours = attach_adapter(load_model(base)[0], adapter)
    kinds = sorted({type(m).__name__ for _, m in ours.named_modules()
                    if type(m).__name__.startswith(("LoRA", "DoRA"))})
    assert kinds == sorted({type(m).__name__ for _, m in theirs.named_modules()
                            if type(m).__name__.startswith(("LoRA", "DoRA"))})
    assert np.array_equal(logits(ours), logits(theirs))


# mlx-lm cannot load the GPT-2 fixture itself (transformers 5 no longer writes n_ctx)
@pytest.mark.parametrize("name", sorted(p.name for p in PEFT.iterdir() if (p / "merged").is_dir()
                                        and not p.name.startswith("gpt2")))
def test_peft_unfused_computes_the_merge(name: str, tmp_path: Path) -> None:
    """Per-module ranks and scales (rsLoRA, patterns), DoRA, embeddings, fan_in_fan_out,
    modules_to_save: in float32, the unfused PEFT adapter computes what the merge
    computes (the fuse written in float32, i.e. the merge without the bf16 rounding),
    to float32 noise, far below the adapter's own effect."""
    from mlx_lm.utils import load_model

    fx = PEFT / name
    res = lorakit.fuse(fx / "base", fx / "adapter", tmp_path / "f32", dtype="float32",
                       progress=False)

    def f32(model):
        model.set_dtype(mx.float32)
        return model

    base = logits(f32(load_model(fx / "base")[0]))
    unfused = logits(load_unfused(f32(load_model(fx / "base")[0]), fx / "adapter"))
    fused = logits(load_model(res.output)[0])
    change = np.abs(fused - base).max()
    assert change > 1e-4, name
    assert np.abs(unfused - fused).max() < 0.02 * change, name


@pytest.mark.slow  # a timing run
def test_decode_timing_runs_a_peft_adapter_unfused(tmp_path: Path) -> None:
    fx = PEFT / "qwen3_rslora_patterns"
    t = lorakit.time_decode(fx / "base", fx / "adapter", variants=["base", "unfused", "fused"],
                            prompt_tokens=4, tokens=4, repeats=1, device="cpu", progress=False)
    assert all(v.ok for v in t.variants), [v.error for v in t.variants]
    assert t.variant("unfused").lora_modules > 0
    assert t.variant("unfused").tokens == t.variant("fused").tokens
