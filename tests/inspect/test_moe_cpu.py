"""MoE on CPU: MLX's CPU GatherMM is float32-only; generation and timing run the
expert blocks in float32 (with a note) instead of failing (issue 13)."""
from __future__ import annotations

from pathlib import Path

import pytest

mx = pytest.importorskip("mlx.core")

DATA = Path(__file__).resolve().parents[2] / "data"
MOE, ADAPTER = DATA / "tiny-qwen3-moe", DATA / "adapters" / "moe-lora"
pytestmark = [pytest.mark.skipif(not (MOE / "config.json").exists(), reason="no MoE data"),
              pytest.mark.slow]  # loads mlx-lm models (~8 s of imports on this machine)


def _load(adapter=None):
    from mlx_lm import load

    from lorakit.fusion.model import load_unfused

    mx.set_default_device(mx.cpu)
    model, tok = load(str(MOE))[:2]
    return (load_unfused(model, str(adapter)) if adapter else model), tok


def test_bf16_experts_fail_on_cpu_without_it():
    """The premise: if MLX ever runs bf16 GatherMM on CPU, this test says so."""
    model, _ = _load()
    with pytest.raises(RuntimeError, match="GatherMM"):
        mx.eval(model(mx.array([[1, 2, 3]])))


@pytest.mark.parametrize("adapter", [None, ADAPTER], ids=["base", "unfused"])
def test_experts_run_in_float32_the_rest_keeps_bf16(adapter):
    from mlx.utils import tree_flatten

    from lorakit.inspect.moe_cpu import moe_float32_on_cpu

    model, _ = _load(adapter)
    changed = moe_float32_on_cpu(model)
    assert sorted(changed) == ["model.layers.0.mlp.switch_mlp", "model.layers.1.mlp.switch_mlp"]
    dtypes = {k: v.dtype for k, v in tree_flatten(model.parameters())}
    assert all(d == mx.float32 for k, d in dtypes.items() if ".switch_mlp." in k)
    assert all(d == mx.bfloat16 for k, d in dtypes.items()
               if ".switch_mlp." not in k and "lora" not in k)
    out = model(mx.array([[1, 2, 3]]))
    assert out.dtype == mx.bfloat16 and bool(mx.isfinite(out.astype(mx.float32)).all())
    assert moe_float32_on_cpu(model) == changed or moe_float32_on_cpu(model) == []


def test_expert_block_matches_a_float32_reference():
    """The wrapped block computes what the same block does in float32 by hand."""
    from lorakit.inspect.moe_cpu import moe_float32_on_cpu

    model, _ = _load()
    block = model.model.layers[0].mlp.switch_mlp
    x = mx.random.normal((1, 3, 128), key=mx.random.key(1)).astype(mx.bfloat16)
    idx = mx.array([[[0, 1], [2, 3], [1, 3]]])
    moe_float32_on_cpu(model)
    got = block(x, idx)
    want = type(block).__mro__[1].__call__(block, x.astype(mx.float32), idx)
    assert got.dtype == mx.bfloat16
    assert bool(mx.array_equal(got, want.astype(mx.bfloat16)))


def test_compare_generations_on_moe_notes_float32():
    from lorakit.inspect.generation import compare_generations

    rep = compare_generations({"base": str(MOE), "adapter": (str(MOE), str(ADAPTER))},
                              "And it came to pass", max_tokens=6)
    assert "float32 on CPU" in rep.summary["note"] and "GatherMM" in rep.summary["note"]
    assert all(r["tokens"] >= 1 for r in rep.rows)


@pytest.mark.slow  # runs decode timing workers
def test_time_decode_on_moe_notes_float32():
    from lorakit.timing.decode import time_decode

    t = time_decode(MOE, ADAPTER, variants=["base", "fused"], prompt_tokens=8, tokens=8,
                    repeats=2, warmup=0, rounds=1, device="cpu", progress=False)
    assert all(v.ok and v.moe_f32_blocks == 2 for v in t.variants), [v.error for v in t.variants]
    assert "GatherMM" in str(t)
