"""Fusion on more of mlx-lm's architectures than the embedded Qwen3: each has its own
layer names (fused qkv and gate_up projections, c_fc / fc1 / dense, GPT-2's
``h.N.attn.c_attn``, InternLM2's ``attention.wqkv``) and its own norms and ties.
An adapter on every linear layer (mlx-lm's default keys) is fused by lorakit in
mlx-lm's order and by ``mlx_lm fuse`` itself: bit-identical. The default fuse keeps
every dtype, and the fused model loads and runs in mlx-lm."""
from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import model_factory as mf
import pytest
from helpers import run_mlx_lm_fuse

import lorakit
from lorakit.inspect.diff import diff
from lorakit.io.formats.checkpoint import Checkpoint

pytestmark = pytest.mark.slow  # ten mlx-lm architectures, each fused twice and run


@pytest.mark.parametrize("family", sorted(mf.OTHER_CONFIGS))
def test_fuse_matches_mlx_lm_on_architecture(family: str, tmp_path: Path) -> None:
    from mlx_lm.utils import load_model

    base = mf.make_model(tmp_path / "base", family)
    adapter = mf.make_adapter(base, tmp_path / "adapter", keys=None, rank=4)
    ours = lorakit.fuse(base, adapter, tmp_path / "lorakit", rounding="mlx-lm", progress=False)
    assert ours.tensors_fused >= 4 * 2  # several projections in each of the 2 layers
    run_mlx_lm_fuse(base, adapter, tmp_path / "mlx")
    rep = diff(tmp_path / "lorakit", tmp_path / "mlx")
    assert rep.identical, str(rep)

    lorakit.fuse(base, adapter, tmp_path / "nearest", progress=False)
    before, after = Checkpoint(base), Checkpoint(tmp_path / "nearest")
    assert {n: after.info(n).dtype for n in after.tensors} == \
        {n: before.info(n).dtype for n in before.tensors}
    model, _ = load_model(tmp_path / "nearest")
    logits = model(mx.array([[1, 2, 3]]))
    assert logits.shape[-1] == mf.VOCAB and bool(mx.all(mx.isfinite(logits)))
