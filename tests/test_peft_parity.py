"""``--rounding round-once`` on PEFT adapters is bit-identical to PEFT's
``merge_and_unload()``. The fixtures were made once with the real PEFT library
(tests/fixtures/make_peft_fixtures.py, versions in tests/fixtures/peft/README.md);
these tests need no torch."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import lorakit
from lorakit.io.checkpoint import Checkpoint

ROOT = Path(__file__).parent / "fixtures" / "peft"
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
