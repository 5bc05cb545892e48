"""Edges of the numbers lorakit takes in: float64 weights and packed sub-byte codes are
one clear error or handled, never a traceback."""
from __future__ import annotations

import json
import struct
import warnings
from pathlib import Path

import numpy as np
import pytest

import lorakit
from lorakit.errors import FuseError
from lorakit.fusion.core import fuse_weight
from lorakit.inspect.ulp_count import bits_dtype

W64 = np.linspace(-1, 1, 6).reshape(2, 3)
A = np.ones((1, 3), np.float32)
B = np.ones((2, 1), np.float32)


@pytest.mark.parametrize("rounding, policy, says", [
    ("nearest", "preserve", "F64 -> F64"),
    ("nearest", "float32", "F64 -> F32"),
    ("mlx-lm", "preserve", "F64 -> F64"),
    ("scale-after", "bfloat16", "F64 -> BF16"),
])
def test_f64_weight_is_one_clear_error(rounding: str, policy: str, says: str) -> None:
    with pytest.raises(FuseError) as info:
        fuse_weight(W64, "F64", A, B, 0.5, rounding=rounding, dtype_policy=policy,
                    name="model.layers.0.q_proj.weight")
    msg = str(info.value)
    assert says in msg and "model.layers.0.q_proj.weight" in msg and "float64" in msg


def _f4_file(path: Path, data: bytes) -> Path:
    header = json.dumps({"x": {"dtype": "F4", "shape": [4, 8], "data_offsets": [0, 16]}})
    blob = header.encode() + b" " * ((8 - len(header) % 8) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    return path


def test_packed_codes_compare_byte_by_byte(tmp_path: Path) -> None:
    assert bits_dtype("F4") == np.dtype("uint8") and bits_dtype("F6_E2M3") == np.dtype("uint8")
    a = _f4_file(tmp_path / "a.safetensors", bytes(range(16)))
    b = _f4_file(tmp_path / "b.safetensors", bytes(range(16)))
    c = _f4_file(tmp_path / "c.safetensors", bytes(range(15)) + b"\xff")
    assert lorakit.diff(a, b, progress=False).identical
    rep = lorakit.diff(a, c, progress=False)
    assert not rep.identical and rep.rows[0]["differing"] == 1


@pytest.mark.parametrize("rounding", ["nearest", "round-once", "mlx-lm", "scale-after"])
def test_dora_zero_norm_row_is_one_clear_error(rounding: str) -> None:
    """W + delta all zeros in row 1: every order gives the same error, no RuntimeWarning."""
    w = np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]], np.float32)
    b = np.array([[1.0], [0.0]], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(FuseError, match="DoRA row has zero norm") as info:
            fuse_weight(w, "F32", A, b, 0.5, magnitude=np.ones(2, np.float32),
                        rounding=rounding, name="model.layers.0.q_proj.weight")
    assert "zero norm in row 1" in str(info.value)
    assert "model.layers.0.q_proj.weight" in str(info.value)
