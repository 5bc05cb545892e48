"""Dtype maps: headers only, planted dtype drift, quantized and in-memory models."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import lorakit
from lorakit import numerics as nm
from lorakit.inspect.dtypes import dtype_map
from lorakit.io.formats.checkpoint import Checkpoint
from lorakit.io.formats.safetensors import TensorSpec
from lorakit.io.outputs.safetensors_write import SafetensorsWriter
from lorakit.layers import split_name


@pytest.fixture(scope="module")
def models(tmp_path_factory, qwen3, qwen3_q4) -> dict:
    """The shared qwen3 base, its 4-bit twin and adapter; ``root`` is this module's own."""
    return {"root": tmp_path_factory.mktemp("dtype"), "base": qwen3["base"], "q4": qwen3_q4,
            "ad": qwen3["ad"]}


def planted_f32(base: Path, dst: Path, name: str) -> Path:
    """A copy of ``base`` with one tensor rewritten as float32 (same values)."""
    shutil.copytree(base, dst)
    ck = Checkpoint(base)
    for f in dst.glob("model*.safetensors*"):
        f.unlink()
    plan, data = [], {}
    for n, info in ck.tensors.items():
        raw = ck.read(n)
        if n == name:
            raw, code = nm.to_float32(raw, "bf16"), "F32"
        else:
            code = info.dtype
        plan.append(TensorSpec(n, code, info.shape))
        data[n] = raw
    with SafetensorsWriter(dst / "model.safetensors", plan) as w:
        for p in plan:
            w.write(p.name, data[p.name])
    return dst


def test_split_name() -> None:
    assert split_name("model.layers.12.self_attn.o_proj.weight") == (12, "o", None, "weight")
    assert split_name("model.layers.0.mlp.switch_mlp.up_proj.scales") == \
        (0, "experts.up", None, "scales")
    assert split_name("model.layers.1.mlp.gate.weight") == (1, "router", None, "weight")
    assert split_name("lm_head.weight") == (None, "head", None, "weight")
    assert split_name("model.layers.2.self_attn.q_proj.lora_A.weight") == \
        (2, "q", None, "lora_A")
    assert split_name("model.layers.2.self_attn.v_proj.linear.weight")[1] == "v"


def test_clean_checkpoint_has_no_flags(models: dict) -> None:
    dm = dtype_map(models["base"])
    ck = Checkpoint(models["base"])
    assert dm.flagged == [] and dm.summary["expected dtype"] == "BF16"
    assert dm.summary["tensors"] == len(ck.tensors)
    assert dm.bytes_by_dtype == {"BF16": ck.nbytes}
    labels, kinds, cells = dm.grid()
    assert labels == ["-", "0", "1"]
    assert {"embed", "q", "k", "v", "o", "gate", "up", "down"} <= set(kinds)
    assert cells[1][kinds.index("q")] == "BF16" and cells[0][kinds.index("q")] == ""


def test_planted_f32_tensor_is_flagged(models: dict) -> None:
    name = "model.layers.1.self_attn.v_proj.weight"
    path = planted_f32(models["base"], models["root"] / "planted", name)
    dm = dtype_map(path)
    assert dm.flagged_names() == [name]
    row = dm.rows[dm.flagged[0]]
    assert row["dtype"] == "F32" and row["flag"] == "F32, majority BF16"
    assert row["bytes"] == 32 * 64 * 4
    assert dm.summary["flagged"] == 1 and dm.summary["flagged bytes"] == 32 * 64 * 4
    assert dm.bytes_by_dtype["F32"] == 32 * 64 * 4
    assert dm.flag_grid()[2][dm.grid()[1].index("v")]  # layer 1 row, v column
    text = str(dm)
    flagged_lines = [ln for ln in text.splitlines() if ln.startswith("!")]
    assert len(flagged_lines) == 1 and name in flagged_lines[0]
    assert json.loads(dm.to_json())["flagged"] == [dm.flagged[0]]


def test_quantized_checkpoint(models: dict) -> None:
    dm = dtype_map(models["q4"])
    assert dm.flagged == []  # packed U32 weights and their scales are not drift
    q = next(r for r in dm.rows if r["tensor"] == "model.layers.0.mlp.up_proj.weight")
    assert q["dtype"] == "U32" and q["stored_as"] == "Q4"
    assert dm.summary["quantized modules"] > 0
    labels, kinds, cells = dm.grid()
    assert cells[labels.index("0")][kinds.index("up")] == "Q4"


def test_in_memory_model_matches_checkpoint(models: dict) -> None:
    from mlx_lm import load

    model, _ = load(str(models["base"]))
    disk, mem = dtype_map(models["base"]), dtype_map(model)
    key = lambda r: (r["tensor"], r["dtype"], tuple(r["shape"]), r["bytes"])  # noqa: E731
    assert sorted(map(key, mem.rows)) == sorted(map(key, disk.rows))
    assert mem.summary["kind"] == "model"
    # with LoRA layers attached: the float32 factors are listed but not flagged
    model, _ = load(str(models["base"]), adapter_path=str(models["ad"]))
    dm = dtype_map(model)
    assert any(r["part"] == "lora_a" and r["dtype"] == "F32" for r in dm.rows)
    assert dm.flagged == []


def test_adapter_directory(models: dict) -> None:
    dm = dtype_map(models["ad"])
    assert dm.summary["kind"] == "adapter" and dm.summary["expected dtype"] == "F32"
    assert {r["part"] for r in dm.rows} == {"lora_a", "lora_b"}
    assert lorakit.open(models["ad"]).kind == "adapter"


def test_plot_and_html(models: dict) -> None:
    from matplotlib.figure import Figure

    dm = dtype_map(models["q4"])
    assert isinstance(dm.plot(), Figure)
    assert "lorakit-report" in dm._repr_html_()


def test_importing_does_not_import_matplotlib() -> None:
    code = ("import sys, lorakit, lorakit.inspect.dtypes, lorakit.inspect.deltas, "
            "lorakit.inspect.diff, lorakit.inspect.diff, lorakit.inspect.diff, "
            "lorakit.inspect.diff, lorakit.inspect.check, "
            "lorakit.inspect.generation, lorakit.inspect.adapters, lorakit.inspect.plots, "
            "lorakit.cli.inspect_cmds; "
            "bad = [m for m in ('matplotlib', 'mlx_lm', 'ipywidgets') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_header_only_speed(models: dict) -> None:
    """No tensor data is read: a dtype map of a 1000-tensor header is quick."""
    import time

    plan = [TensorSpec(f"model.layers.{i // 10}.mlp.up_proj{i % 10}.weight", "BF16",
                          (4, 4)) for i in range(1000)]
    path = models["root"] / "many.safetensors"
    with SafetensorsWriter(path, plan) as w:
        for p in plan:
            w.write(p.name, np.zeros((4, 4), np.uint16))
    t = time.perf_counter()
    dm = dtype_map(path)
    assert time.perf_counter() - t < 1.0 and len(dm.rows) == 1000


def test_promoted_fuse_flags_the_f32_projections_even_as_majority(tmp_path) -> None:
    """After a careless fuse the f32 projections can outweigh everything else; the
    config's declared dtype still says what the model should be."""
    import model_factory as mf

    import lorakit

    base = mf.make_model(tmp_path / "base", "llama", tie_word_embeddings=True)
    adapter = mf.make_adapter(base, tmp_path / "ad", keys=(
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))
    import json
    cfg = json.loads((base / "config.json").read_text())
    cfg["torch_dtype"] = "bfloat16"
    (base / "config.json").write_text(json.dumps(cfg))
    res = lorakit.fuse(base, adapter, tmp_path / "out", dtype="promote", progress=False)
    dm = dtype_map(res.output)
    assert dm.summary["expected dtype"] == "BF16"
    assert sorted(dm.flagged_names()) == sorted(res.fused_names)
