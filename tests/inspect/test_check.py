"""Did the merge take: planted fused outputs get the verdict they deserve, a fuse of an
exact combination of adapters (one scale per rank column) among them."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import model_factory as mf
import numpy as np
import pytest

import lorakit
from lorakit.inspect.check import check
from lorakit.io.formats.checkpoint import Checkpoint
from lorakit.io.formats.safetensors import TensorSpec
from lorakit.io.outputs.safetensors_write import SafetensorsWriter


def scaled_adapter(src: Path, dst: Path, factor: float) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg["lora_parameters"]["scale"] *= factor
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def case(tmp_path_factory, qwen3, qwen3_fused) -> dict:
    """The shared qwen3 base, adapter and nearest fuse; ``root`` is this module's own."""
    return {"root": tmp_path_factory.mktemp("merge"), "base": qwen3["base"], "ad": qwen3["ad"],
            "fused": qwen3_fused["nearest"]}


def verdicts(rep) -> set:
    return {r["verdict"] for r in rep.rows}


def test_correct_fuse_is_ok(case: dict) -> None:
    rep = check(case["fused"], case["base"], case["ad"])
    assert rep.ok and verdicts(rep) == {"ok"} and rep.flagged == []
    for r in rep.rows:
        assert r["survived"] == pytest.approx(r["expected"])
        assert r["max_ulp"] <= 0.5 and r["distance"] <= 1.0 and r["beyond"] == 0
        assert r["corr"] > 0.99 and r["changed"] > 0.9
    assert rep.summary["untouched tensors changed"] == 0


def test_mlx_lm_rounding_is_ok_and_promoted_is_its_own_class(case: dict) -> None:
    root = case["root"]
    mlx = lorakit.fuse(case["base"], case["ad"], root / "mlx", rounding="mlx-lm",
                       progress=False).output
    rep = check(mlx, case["base"], case["ad"], check_untouched=False)
    assert verdicts(rep) == {"ok"}
    f32 = lorakit.fuse(case["base"], case["ad"], root / "f32", dtype="promote",
                       progress=False).output
    rep = check(f32, case["base"], case["ad"], check_untouched=False)
    assert verdicts(rep) == {"promoted"} and rep.status == "promoted" and rep.exit_code() == 3
    assert {r["dtype"] for r in rep.rows} == {"BF16->F32"}
    assert len(rep.flagged) == 6  # drift flagged


def test_base_itself_is_not_applied(case: dict) -> None:
    rep = check(case["base"], case["base"], case["ad"])
    assert verdicts(rep) == {"not applied"} and not rep.ok
    assert all(r["survived"] == 0 and r["changed"] == 0 for r in rep.rows)
    assert rep.exit_code() == 1


def test_applied_twice(case: dict) -> None:
    twice = lorakit.fuse(case["fused"], case["ad"], case["root"] / "twice",
                         progress=False).output
    rep = check(twice, case["base"], case["ad"], check_untouched=False)
    assert verdicts(rep) == {"applied twice"}
    assert all(r["fit"] == pytest.approx(2.0, abs=0.01) for r in rep.rows)


def test_half_scale_is_wrong_scale(case: dict) -> None:
    half = scaled_adapter(case["ad"], case["root"] / "half-ad", 0.5)
    fused = lorakit.fuse(case["base"], half, case["root"] / "half", progress=False).output
    rep = check(fused, case["base"], case["ad"], check_untouched=False)
    assert verdicts(rep) == {"wrong scale"} and {r["detail"] for r in rep.rows} == {"x0.5"}
    assert check(fused, case["base"], half, check_untouched=False).ok


def test_delta_below_rounding(case: dict) -> None:
    tiny = mf.make_adapter(case["base"], case["root"] / "tiny", b_std=1e-6)
    fused = lorakit.fuse(case["base"], tiny, case["root"] / "tiny-fused", progress=False).output
    rep = check(fused, case["base"], tiny, check_untouched=False)
    assert verdicts(rep) == {"rounding-limited"} and rep.ok
    assert all(r["delta_ulps"] < 0.05 for r in rep.rows)
    # the base itself is still caught: a correct fuse changes the elements whose own
    # spacing is finer than the delta (those near zero)
    assert all(r["changed"] > 0 for r in rep.rows)
    assert verdicts(check(case["base"], case["base"], tiny, check_untouched=False)) == \
        {"not applied"}


def test_untouched_tensor_changed(case: dict) -> None:
    """A fuse that also altered a tensor the adapter does not touch is caught."""
    dst = case["root"] / "tampered"
    shutil.copytree(case["fused"], dst)
    ck = Checkpoint(case["fused"])
    victim = "model.layers.0.mlp.gate_proj.weight"
    for f in dst.glob("model*.safetensors*"):
        f.unlink()
    plan = [TensorSpec(n, i.dtype, i.shape) for n, i in ck.tensors.items()]
    with SafetensorsWriter(dst / "model.safetensors", plan) as w:
        for p in plan:
            raw = ck.read(p.name)
            if p.name == victim:
                raw = raw.copy()
                raw[0, 0] ^= np.uint16(1)
            w.write(p.name, raw)
    rep = check(dst, case["base"], case["ad"])
    bad = {r["tensor"]: r["verdict"] for r in rep.rows if r["verdict"] != "ok"}
    assert bad == {victim: "changed without adapter"} and not rep.ok


def test_quantized(tmp_path: Path) -> None:
    q = mf.make_model(tmp_path / "q4", "qwen3", quantize=dict(group_size=32, bits=4))
    ad = mf.make_adapter(q, tmp_path / "ad")
    fused = lorakit.fuse(q, ad, tmp_path / "fused", progress=False).output
    rep = check(fused, q, ad)
    assert rep.ok and all(r["distance"] <= 1 for r in rep.rows)
    assert all(0.5 < r["survived"] <= 1.05 for r in rep.rows)
    assert verdicts(check(q, q, ad, check_untouched=False)) == {"not applied"}
    small = mf.make_adapter(q, tmp_path / "small", b_std=2e-3)
    fs = lorakit.fuse(q, small, tmp_path / "fs", progress=False).output
    rep = check(fs, q, small, check_untouched=False)
    assert rep.ok
    assert verdicts(rep) <= {"partially lost to quantization", "lost to quantization"}
    from matplotlib.figure import Figure

    assert isinstance(rep.plot(), Figure)


# -- an exact combination of adapters ----------------------------------------------------
DATA = Path(__file__).resolve().parents[2] / "data"
TINY = DATA / "tiny-qwen3"
COMBINED = [DATA / "adapters" / "lora", DATA / "adapters" / "lora-embed"]


def test_check_of_an_exact_combination(tmp_path: Path) -> None:
    combo = lorakit.combine(COMBINED, [0.7, -0.3]).adapter
    assert any(getattr(t.scale, "ndim", 0) for t in combo.targets)  # per-column scales
    lorakit.fuse(TINY, combo, tmp_path / "ok", progress=False)
    assert lorakit.check(tmp_path / "ok", TINY, combo, progress=False).status == "ok"

    other = lorakit.combine(COMBINED, [0.7, -0.35]).adapter
    lorakit.fuse(TINY, other, tmp_path / "other", progress=False)
    r = lorakit.check(tmp_path / "other", TINY, combo, progress=False)
    assert r.status == "wrong" and r.exit_code() == 1
    assert len(r.causes()) == len(combo.targets)  # every adapted tensor is named


def test_a_float64_checkpoint_is_one_clear_error(tmp_path) -> None:
    """A float64 weight (no fuse writes one) is refused naming the file, the tensor, what
    check takes and what it found; nothing is written."""

    import mlx.core as mx
    from safetensors.numpy import save_file

    from lorakit.errors import FormatError

    root = Path(__file__).resolve().parents[2] / "data"
    base = tmp_path / "f64"
    shutil.copytree(root / "tiny-qwen3", base)
    shard = next(base.glob("*.safetensors"))
    w = mx.load(str(shard))
    save_file({k: np.array(v.astype(mx.float32)).astype(np.float64) for k, v in w.items()},
              str(shard), metadata={"format": "mlx"})
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(FormatError) as e:
        lorakit.check(base, base, root / "adapters" / "lora", progress=False)
    msg = str(e.value)
    assert "cannot check a merge of this dtype" in msg and "found: F64" in msg
    assert e.value.tensor and e.value.tensor.endswith(".weight") and str(base) in msg
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
