"""Quantized survival counts codes, not packed words (issue 13)."""
import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from lorakit.fusion.quant import unpack_codes


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_unpacked_codes_dequantize_like_mlx(bits):
    w = mx.random.normal((4, 128), key=mx.random.key(bits))
    q, s, b = mx.quantize(w, group_size=64, bits=bits)
    codes = unpack_codes(np.array(q), bits)
    assert codes.shape == (4, 128) and codes.max() < 2 ** bits
    mine = codes.reshape(4, 2, 64) * np.array(s)[..., None] + np.array(b)[..., None]
    ref = np.array(mx.dequantize(q, s, b, group_size=64, bits=bits))
    np.testing.assert_allclose(mine.reshape(4, 128), ref, atol=1e-6)


def test_one_changed_code_counts_once_not_as_a_word():
    q, _, _ = mx.quantize(mx.random.normal((1, 64), key=mx.random.key(0)), group_size=64, bits=4)
    a = np.array(q)
    c = a.copy()
    c[0, 0] ^= np.uint32(1)  # flip one bit of the first code only
    changed = (unpack_codes(a, 4) != unpack_codes(c, 4)).mean()
    assert changed == pytest.approx(1 / 64)
    assert (a != c).mean() == pytest.approx(1 / 8)  # the old per-word count
