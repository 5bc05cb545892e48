"""Parity with the real PEFT 0.21.2 (fixtures in tests/fixtures/algebra, made once by
tests/fixtures/make_algebra_fixtures.py; no torch here).

* convert: an mlx-lm adapter converted by lorakit, loaded by PEFT and merged, equals
  lorakit's round-once fuse of the original mlx-lm adapter, bit for bit (LoRA, DoRA);
* combine --like peft: PEFT's add_weighted_adapter + merge_and_unload, bit for bit for
  linear, cat, ties and magnitude_prune; svd within 1 ulp on at most 0.1% of elements.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import lorakit
from lorakit.algebra.combine import combine, convert
from lorakit.errors import LorakitError
from lorakit.io.adapters.load import load_adapter

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures" / "algebra"
BASE = ROOT / "tests" / "fixtures" / "peft" / "llama_lora_bf16" / "base"
sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
from make_peft_fixtures import read_safetensors  # noqa: E402  (numpy-only reader)

WEIGHTS = [0.7, -0.4]


def _mismatch(out: Path, fixture: str):
    got = read_safetensors(out / "model.safetensors")
    want = read_safetensors(FIX / "merged" / fixture)
    n = sum(v[1].size for v in want.values())
    bad = sum(int((got[k][1] != v[1]).sum()) for k, v in want.items())
    ulps = max(int(np.abs(got[k][1].astype(np.int64) - v[1].astype(np.int64)).max())
               for k, v in want.items())
    return bad, ulps, n


@pytest.mark.parametrize("name", ["lora-a", "lora-b", "dora"])
def test_converted_adapter_merged_by_peft_is_lorakits_round_once_fuse(tmp_path, name):
    lorakit.fuse(BASE, FIX / name, tmp_path / "f", rounding="round-once", progress=False)
    bad, _, n = _mismatch(tmp_path / "f", f"convert-{name}.safetensors")
    assert n == 73728 and bad == 0
    # and the committed PEFT copy is what lorakit's convert writes today, bit for bit
    out = convert(FIX / name, tmp_path / "p", to="peft")
    for f in ("adapter_model.safetensors",):
        assert (out / f).read_bytes() == (FIX / f"{name}-peft" / f).read_bytes()
    back = convert(out, tmp_path / "m", to="mlx-lm")
    assert (back / "adapters.safetensors").read_bytes() == \
        (FIX / name / "adapters.safetensors").read_bytes()


def test_a_wrong_merge_is_caught(tmp_path):
    """The parity check can fail: the default (correctly rounded) fuse is not PEFT's."""
    lorakit.fuse(BASE, FIX / "lora-a", tmp_path / "f", rounding="mlx-lm", progress=False)
    bad, _, _ = _mismatch(tmp_path / "f", "convert-lora-a.safetensors")
    assert bad > 0


@pytest.mark.parametrize("method", ["linear", "cat", "ties", "magnitude_prune"])
def test_like_peft_is_bit_for_bit(tmp_path, method):
    for srcs in ((FIX / "lora-a", FIX / "lora-b"), (FIX / "lora-a-peft", FIX / "lora-b-peft")):
        c = combine(srcs, WEIGHTS, method=method, density=0.5, like="peft")
        out = tmp_path / srcs[0].name
        lorakit.fuse(BASE, c.adapter, out, rounding="round-once", progress=False)
        bad, _, n = _mismatch(out, f"combine-{method}.safetensors")
        assert bad == 0, (method, srcs[0].name, bad, n)


def test_like_peft_svd_within_stated_tolerance(tmp_path):
    c = combine([FIX / "lora-a", FIX / "lora-b"], WEIGHTS, method="svd", like="peft")
    lorakit.fuse(BASE, c.adapter, tmp_path / "f", rounding="round-once", progress=False)
    bad, ulps, n = _mismatch(tmp_path / "f", "combine-svd.safetensors")
    assert ulps <= 1 and bad <= n // 1000, (bad, ulps, n)


def test_lorakit_cat_is_not_pefts_double_rounding(tmp_path):
    """Without --like, cat's fuse is rounded once: it differs from PEFT's in-memory merge
    (bf16 factors, bf16 delta) on some elements, and the exact sum is nearer."""
    c = combine([FIX / "lora-a", FIX / "lora-b"], WEIGHTS, method="exact")
    lorakit.fuse(BASE, c.adapter, tmp_path / "f", progress=False)
    bad, _, _ = _mismatch(tmp_path / "f", "combine-cat.safetensors")
    assert bad > 0


def test_cli_fuse_like_peft(tmp_path):
    from lorakit.cli.main import main

    assert main(["fuse", "--model", str(BASE), "--adapter-path", str(FIX / "lora-a-peft"),
                 "--adapter-path", str(FIX / "lora-b"), "--weights", "0.7,-0.4", "--combine",
                 "ties", "--density", "0.5", "--like", "peft", "--save-path",
                 str(tmp_path / "f"), "-q"]) == 0
    assert _mismatch(tmp_path / "f", "combine-ties.safetensors")[0] == 0
    with pytest.raises(LorakitError, match="does not reproduce"):
        combine([FIX / "lora-a", FIX / "lora-b"], WEIGHTS, method="dare_ties", density=0.5,
                seed=1, like="peft")


def test_like_peft_cat_saved_holds_pefts_factors(tmp_path):
    c = combine([FIX / "lora-a", FIX / "lora-b"], WEIGHTS, method="cat", like="peft")
    back = load_adapter(c.save(tmp_path / "c", format="peft"))
    for t in back.targets:  # bf16 values, stored exactly in F32: low 16 bits all zero
        assert not np.any(t.A.view(np.uint32) & 0xFFFF)
        assert not np.any(t.B.view(np.uint32) & 0xFFFF)
