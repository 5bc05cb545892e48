"""The fuse's speed measures change how bytes move, never which bytes are written
(timings are in benchmarks/fuse.py and BENCHMARKS.md, not here)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lorakit.fusion import fuse as stream
from lorakit.io.formats.checkpoint import Checkpoint
from lorakit.io.formats.safetensors import TensorSpec, read_header, read_raw
from lorakit.io.outputs import safetensors_write as sw
from lorakit.io.outputs.safetensors_write import SafetensorsWriter

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "data" / "tiny-qwen3"


def _write(path: Path, src: Path) -> bytes:
    """A file of written tensors and kernel-copied ones, mixed."""
    h = read_header(src)
    infos = list(h.tensors.values())[:6]
    with SafetensorsWriter(path, [TensorSpec(t.name, t.dtype, tuple(t.shape))
                                  for t in infos], {"k": "v"}) as w:
        for i, t in enumerate(infos):
            if i % 2:
                w.copy(t.name, t)
            else:
                w.write(t.name, read_raw(t))
    return path.read_bytes()


def test_starting_writeback_early_changes_no_byte(tmp_path, monkeypatch):
    src = next(TINY.glob("*.safetensors"))
    monkeypatch.setattr(sw, "WRITEBACK_BYTES", 0)
    off = _write(tmp_path / "off.safetensors", src)
    calls = []
    real = sw.start_writeback
    monkeypatch.setattr(sw, "WRITEBACK_BYTES", 1)  # after every tensor
    monkeypatch.setattr(sw, "start_writeback", lambda *a: (calls.append(a), real(*a)))
    on = _write(tmp_path / "on.safetensors", src)
    assert on == off
    assert len(calls) == 6  # it did run, once per tensor, over consecutive ranges
    assert all(calls[i][1] + calls[i][2] == calls[i + 1][1] for i in range(5))
    assert calls[-1][1] + calls[-1][2] == len(on)


def test_mlx_orders_read_the_weight_through_mlx(tmp_path):
    """The MLX orders get a lazily loaded mx.array (no numpy copy), the other orders raw
    numpy storage; both hold the same bytes."""
    mx = pytest.importorskip("mlx.core")
    ck = Checkpoint(TINY)
    name = "model.layers.0.self_attn.q_proj.weight"
    it = stream._Item(name, TensorSpec(name, "BF16", tuple(ck.tensors[name].shape)),
                      ck.tensors[name], "fuse")
    raw = stream._read_weight(ck, it, "nearest")
    assert isinstance(raw, np.ndarray)
    got = stream._read_weight(ck, it, "mlx-lm")
    assert isinstance(got, mx.array)
    assert np.array_equal(np.array(got.view(mx.uint16)), raw)
