"""``--rounding round-once`` on PEFT adapters is bit-identical to PEFT's
``merge_and_unload()``. The fixtures were made once with the real PEFT library
(tests/fixtures/make_peft_fixtures.py, versions in tests/fixtures/peft/README.md);
these tests need no torch."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import lorakit
from lorakit.io.formats.checkpoint import Checkpoint

ROOT = Path(__file__).resolve().parents[1] / "fixtures" / "peft"
FIXTURES = sorted(p.name for p in ROOT.iterdir() if (p / "merged").is_dir())


def test_fixtures_present() -> None:
    assert len(FIXTURES) >= 6


@pytest.mark.parametrize("name", FIXTURES)
def test_round_once_equals_peft_merge_and_unload(name: str, tmp_path: Path) -> None:
    fx = ROOT / name
    res = lorakit.fuse(fx / "base", fx / "adapter", tmp_path / "out", rounding="round-once",
                       progress=False)
    ours, peft = Checkpoint(res.output), Checkpoint(fx / "merged")
    assert res.tensors_fused > 0
    common = sorted(set(peft.tensors) & set(ours.tensors))
    assert set(peft.tensors) <= set(ours.tensors)
    differing = {}
    for n in common:
        assert ours.info(n).dtype == peft.info(n).dtype, n
        a, b = ours.read(n), peft.read(n)
        if not np.array_equal(a.view(np.uint8), b.view(np.uint8)):
            differing[n] = int((a != b).sum())
    assert differing == {}


@pytest.mark.parametrize("name", ["llama_lora_bf16", "llama_lora_bf16_large"])
def test_nearest_differs_from_peft_only_at_double_rounding(name: str, tmp_path: Path) -> None:
    fx = ROOT / name
    res = lorakit.fuse(fx / "base", fx / "adapter", tmp_path / "out", progress=False)
    ours, peft = Checkpoint(res.output), Checkpoint(fx / "merged")
    total = diff = 0
    for n in res.fused_names:
        a, b = ours.read(n), peft.read(n)
        total += a.size
        d = a != b
        diff += int(d.sum())
        # where they differ, it is by one bf16 ulp (PEFT's f32 double rounding)
        assert np.all(np.abs(a[d].astype(np.int64) - b[d].astype(np.int64)) <= 1)
    assert diff / total < 1e-3


def test_modules_to_save_copies_replace_the_base(tmp_path: Path) -> None:
    """PEFT modules_to_save: merge_and_unload puts the trained copies (here lm_head and
    every RMSNorm) in place. lorakit writes them as they are in every rounding mode,
    rounds them once under a dtype policy, check calls them ``replaced``, and the
    in-memory fuse does the same."""
    from lorakit.inspect.check import check
    from lorakit.io.adapters.load import load_adapter

    fx = ROOT / "llama_modules_to_save_bf16"
    ad = load_adapter(fx / "adapter")
    saved = sorted(f"{r.module}.{r.leaf}" for r in ad.replacements)
    assert saved == ["lm_head.weight", "model.layers.0.input_layernorm.weight",
                     "model.layers.0.post_attention_layernorm.weight",
                     "model.layers.1.input_layernorm.weight",
                     "model.layers.1.post_attention_layernorm.weight", "model.norm.weight"]
    peft = Checkpoint(fx / "merged")
    res = lorakit.fuse(fx / "base", ad, tmp_path / "nearest", progress=False)
    assert sorted(res.replaced_names) == saved and "modules_to_save" in str(res)
    ours = Checkpoint(res.output)
    for n in saved:
        assert np.array_equal(ours.read(n), peft.read(n)), n
    mc = check(res.output, fx / "base", ad)
    assert mc.ok, str(mc)
    assert sum(r["verdict"] == "replaced" for r in mc.rows) == len(saved)
    assert mc.summary["untouched tensors changed"] == 0 and mc.summary["replaced tensors"] == 6

    # a fuse that forgot the copies is caught
    wrong = lorakit.fuse(fx / "base", fx / "adapter", tmp_path / "wrong", progress=False)
    import shutil

    shutil.copy(fx / "base" / "model.safetensors", wrong.output / "model.safetensors")
    bad = check(wrong.output, fx / "base", ad)
    assert not bad.ok and "replacement differs" in bad.verdicts().values()

    f32 = lorakit.fuse(fx / "base", ad, tmp_path / "f32", dtype="float32", progress=False)
    c32 = Checkpoint(f32.output)
    from lorakit import numerics as nm

    for n in saved:
        assert c32.info(n).dtype == "F32"
        assert np.array_equal(nm.to_float64(c32.read(n), "F32"),
                              nm.to_float64(peft.read(n), "BF16")), n  # bf16 -> f32 is exact


def test_modules_to_save_in_memory(tmp_path: Path) -> None:
    import mlx.core as mx
    from mlx_lm.utils import load_model

    from lorakit.fusion.model import fuse_model

    fx = ROOT / "llama_modules_to_save_bf16"
    model, _ = load_model(fx / "base")
    fuse_model(model, fx / "adapter")
    peft = Checkpoint(fx / "merged")
    from mlx.utils import tree_flatten

    params = dict(tree_flatten(model.parameters()))
    for n in ("lm_head.weight", "model.norm.weight", "model.layers.1.input_layernorm.weight"):
        got = np.array(params[n].view(mx.uint16))
        assert np.array_equal(got, peft.read(n).view(np.uint16)), n
