"""Models whose ops MLX's CPU backend lacks in bf16 (bf16 GatherMM, the MoE experts):
``compare_outputs``, ``check``'s behaviour line, generation and timing find it by trying
one forward pass, run the model in float32 and say so, instead of a traceback (issue 26)."""
from __future__ import annotations

from pathlib import Path

import pytest

mx = pytest.importorskip("mlx.core")
nn = pytest.importorskip("mlx.nn")

DATA = Path(__file__).resolve().parents[2] / "data"
MOE, ADAPTER = DATA / "tiny-qwen3-moe", DATA / "adapters" / "moe-lora"


class Experts(nn.Module):
    """The op behind mlx-lm's SwitchLinear: MLX's CPU has no bf16 kernel for it."""

    def __init__(self, dtype):
        super().__init__()
        self.weight = mx.random.normal((4, 8, 8), key=mx.random.key(0)).astype(dtype)

    def __call__(self, x):
        return mx.gather_mm(x.astype(self.weight.dtype), self.weight,
                            rhs_indices=mx.array([0, 1, 2]))


@pytest.fixture(autouse=True)
def _cpu():
    mx.set_default_device(mx.cpu)


def test_a_refused_dtype_runs_again_in_float32_with_a_note():
    from lorakit.inspect.moe_cpu import refuses_dtype, run_or_float32

    m = Experts(mx.bfloat16)
    x = mx.random.normal((1, 3, 8), key=mx.random.key(1))
    with pytest.raises(RuntimeError) as e:
        mx.eval(m(x.astype(mx.bfloat16)))
    assert refuses_dtype(e.value)  # the premise: MLX's CPU refuses bf16 GatherMM
    want = Experts(mx.bfloat16)
    want.set_dtype(mx.float32)
    out, note = run_or_float32(m, lambda: m(x))
    assert m.weight.dtype == mx.float32 and "float32" in note and "GatherMM" in note
    assert "bfloat16" in note
    assert bool(mx.array_equal(out, want(x)))


def test_a_model_that_runs_is_left_alone_and_other_errors_propagate():
    from lorakit.inspect.moe_cpu import run_or_float32

    m = Experts(mx.float32)
    x = mx.ones((1, 3, 8))
    out, note = run_or_float32(m, lambda: m(x))
    assert note == "" and m.weight.dtype == mx.float32
    with pytest.raises(ValueError, match="broadcast"):
        run_or_float32(m, lambda: m(mx.ones((2, 3, 8))))  # a real bug is not hidden


needs_moe = pytest.mark.skipif(not (MOE / "config.json").exists(), reason="no MoE data")


@needs_moe
@pytest.mark.slow  # loads the MoE model twice (~4 s with mlx-lm's imports)
def test_compare_outputs_on_the_moe_model_runs_in_float32_and_says_so():
    import mlx_lm

    import lorakit
    from lorakit.fusion.model import attach_adapter

    rep = lorakit.compare_outputs((str(MOE), str(ADAPTER)), str(MOE), tokens=48, context=24)
    assert rep.float32 == ["reference", "test"] and rep.to_dict()["float32"] == rep.float32
    assert "float32" in rep.summary["note"] and "GatherMM" in rep.summary["note"]
    assert "GatherMM" in str(rep) and "GatherMM" in rep._repr_html_()
    # the same numbers as the two models cast to float32 by hand
    ref, tok = mlx_lm.load(str(MOE))[:2]
    ref = attach_adapter(ref, str(ADAPTER))
    test = mlx_lm.load(str(MOE))[0]
    ref.set_dtype(mx.float32)
    test.set_dtype(mx.float32)
    by_hand = lorakit.compare_outputs((ref, tok), (test, tok), tokens=48, context=24)
    assert by_hand.float32 == [] and "note" not in by_hand.summary
    assert by_hand.mean_kl == rep.mean_kl and by_hand.top1_agreement == rep.top1_agreement


@needs_moe
@pytest.mark.slow  # a fuse and a behaviour check of the MoE model
def test_check_behaviour_line_on_the_moe_model(tmp_path):
    import lorakit

    fused = tmp_path / "fused"
    lorakit.fuse(MOE, ADAPTER, fused, progress=False)
    rep = lorakit.check(fused, MOE, ADAPTER, progress=False, behaviour=32)
    assert rep.ok
    assert rep.behaviour["float32"] == ["reference", "test"]
    assert "GatherMM" in rep.behaviour["note"]
    assert "computed in float32" in rep.summary["fused vs unfused"]
    assert rep.behaviour["mean_kl"] < 1e-3
