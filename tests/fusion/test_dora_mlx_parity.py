"""DoRA with ``rounding="mlx-lm"``: what the help promises is what is written.

``mlx_lm fuse`` writes a DoRA-fused weight float32 (``DoRALinear.fuse`` rescales by a
float32 magnitude). lorakit's default keeps the checkpoint's dtype and writes the same
values (mlx-lm's float32 cast to bf16 is lorakit's tensor, bit for bit);
``dtype="promote"`` writes mlx_lm fuse's exact bytes, every tensor (issue 26).
Both compared with mlx-lm's own fuse code on the embedded DoRA adapter."""
from __future__ import annotations

from pathlib import Path

import pytest

from lorakit.fusion.options import DORA_PARITY, ROUNDING_HELP

DATA = Path(__file__).resolve().parents[2] / "data"
BASE, DORA = DATA / "tiny-qwen3", DATA / "adapters" / "dora"


def test_help_says_what_a_dora_fuse_writes():
    assert DORA_PARITY == ("same values as mlx_lm fuse; dtype kept (mlx_lm fuse writes DoRA "
                           "weights float32; --dtype promote writes its exact bytes)")
    assert DORA_PARITY in ROUNDING_HELP["mlx-lm"]
    assert "LoRA bit-identical" in ROUNDING_HELP["mlx-lm"]


def _tensors(path: Path):
    import mlx.core as mx

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(mx.load(str(f)))
    return out


def _same_bytes(a, b) -> bool:
    import mlx.core as mx
    import numpy as np

    u = {2: mx.uint16, 4: mx.uint32}
    return a.dtype == b.dtype and a.shape == b.shape and \
        np.array_equal(np.array(a.view(u[a.dtype.size])), np.array(b.view(u[b.dtype.size])))


@pytest.fixture(scope="module")
def fuses(tmp_path_factory):
    from helpers import run_mlx_lm_fuse

    import lorakit

    d = tmp_path_factory.mktemp("dora")
    run_mlx_lm_fuse(BASE, DORA, d / "mlx")
    lorakit.fuse(BASE, DORA, d / "kept", rounding="mlx-lm", progress=False)
    lorakit.fuse(BASE, DORA, d / "promote", rounding="mlx-lm", dtype="promote", progress=False)
    return d


@pytest.mark.slow  # two fuses and mlx-lm's (~4 s with imports)
def test_dora_mlx_lm_rounding_keeps_dtype_with_mlx_lm_values(fuses):
    from lorakit.io.formats.checkpoint import Checkpoint

    mlx, ours, base = _tensors(fuses / "mlx"), _tensors(fuses / "kept"), Checkpoint(BASE)
    assert set(ours) == set(mlx)
    assert {n: Checkpoint(fuses / "kept").info(n).dtype for n in ours} == \
        {n: base.info(n).dtype for n in base.tensors}
    widened = [n for n in mlx if mlx[n].dtype != ours[n].dtype]
    assert len(widened) >= 4  # mlx-lm writes every DoRA-fused weight float32
    for n in mlx:
        assert _same_bytes(ours[n], mlx[n].astype(ours[n].dtype)), n
    card = (fuses / "kept" / "README.md").read_text()
    assert DORA_PARITY in card


@pytest.mark.slow  # shares the fuses above
def test_dora_mlx_lm_rounding_with_promote_is_mlx_lm_fuse_byte_for_byte(fuses):
    mlx, ours = _tensors(fuses / "mlx"), _tensors(fuses / "promote")
    assert set(ours) == set(mlx)
    bad = [n for n in mlx if not _same_bytes(ours[n], mlx[n])]
    assert not bad, bad[:5]
