"""What lorakit writes in mlx-lm format is what mlx-lm itself loads and fuses."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import run_mlx_lm_fuse

import lorakit
from lorakit.algebra.combine import combine, convert

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data"
sys_fixtures = ROOT / "tests" / "fixtures"


def _tensors(path: Path):
    import sys

    sys.path.insert(0, str(sys_fixtures))
    from make_peft_fixtures import read_safetensors

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(read_safetensors(f))
    return out


@pytest.mark.slow  # runs mlx_lm fuse twice
@pytest.mark.parametrize("name", ["lora", "lora-embed", "dora"])
def test_mlx_lm_fuses_a_round_tripped_adapter_as_the_original(tmp_path, name):
    src = DATA / "adapters" / name
    peft = convert(src, tmp_path / "peft", to="peft")
    back = convert(peft, tmp_path / "back", to="mlx-lm")
    run_mlx_lm_fuse(DATA / "tiny-qwen3", src, tmp_path / "f-src")
    run_mlx_lm_fuse(DATA / "tiny-qwen3", back, tmp_path / "f-back")
    a, b = _tensors(tmp_path / "f-src"), _tensors(tmp_path / "f-back")
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k][0] == b[k][0] and np.array_equal(a[k][1], b[k][1]), k


@pytest.mark.slow  # runs mlx_lm fuse
def test_mlx_lm_loads_a_combination_with_padded_ranks(tmp_path):
    """cat of an adapter with an embedding and one without: ranks 16 and 8, the lower
    one zero-padded; mlx-lm's own fuse of it equals lorakit's mlx-lm-order fuse."""
    c = combine([DATA / "adapters" / "lora", DATA / "adapters" / "lora-embed"], [0.5, -2.0],
                method="cat")
    out = c.save(tmp_path / "cat", format="mlx-lm")
    run_mlx_lm_fuse(DATA / "tiny-qwen3", out, tmp_path / "f-mlx")
    lorakit.fuse(DATA / "tiny-qwen3", out, tmp_path / "f-lk", rounding="mlx-lm", progress=False)
    a, b = _tensors(tmp_path / "f-mlx"), _tensors(tmp_path / "f-lk")
    assert "model.embed_tokens.weight" in a
    for k in a:
        assert np.array_equal(a[k][1], b[k][1]), k
