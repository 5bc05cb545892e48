"""The C ulp kernel (lorakit/inspect/_ulpkernel.c) against the numpy path and against
numerics.ulp_distance: every field, every format, NaN/inf/zero/subnormal patterns,
pieces of every length, blocks with and without specials, every histogram size."""
from __future__ import annotations

from typing import Tuple

import numpy as np
import pytest

from lorakit import kernels
from lorakit import numerics as nm
from lorakit.inspect.ulp_count import Accumulator as _Acc
from lorakit.inspect.ulp_count import TensorDiff

KERNEL = kernels.load("lorakit.inspect._ulpkernel")
pytestmark = pytest.mark.skipif(KERNEL is None, reason="C ulp kernel not built here")

STORAGE = {"BF16": np.uint16, "F16": np.uint16, "F32": np.uint32}


def run(code: str, x: np.ndarray, y: np.ndarray, piece: int, max_bin: int,
        kernel: bool) -> Tuple:
    acc = _Acc(code, max_bin)
    with kernels.use_kernels(kernel):
        for s in range(0, x.size, piece):
            part = _Acc(code, max_bin)
            part.add(x[s:s + piece], y[s:s + piece])
            acc.merge(part)
    td = acc.result(TensorDiff("t", "", code, code, x.shape, x.shape))
    return (td.elements, td.differing, td.nan_mismatch, td.max_ulp, td.ulp_sum, td.max_abs,
            td.counts.tolist(), acc.raw.tolist())


def special_values(code: str) -> np.ndarray:
    """Bits of zeros, subnormals, the largest finite, inf and NaNs of both signs."""
    f = nm.float_format(code)
    mag = np.array([0, 1, 2, 3, f.inf_bits - 1, f.inf_bits, f.inf_bits + 1,
                    (1 << (f.bits - 1)) - 1], np.uint64)
    sign = np.uint64(1 << (f.bits - 1))
    return np.concatenate([mag, mag | sign]).astype(STORAGE[code])


def pairs(code: str, rng: np.random.Generator, n: int) -> Tuple[np.ndarray, np.ndarray]:
    """Random weights, a nearby "fused" copy (a few ulps off, some sign changes), a block
    of equal values and sprinkled special values."""
    dt = np.float32 if code == "F32" else np.float64
    w = rng.normal(0, 0.02, n).astype(dt)
    w2 = w + rng.normal(0, 0.002, n)
    fmt = nm.float_format(code)
    x = nm.round_to_format(w, fmt).astype(STORAGE[code])
    y = nm.round_to_format(w2, fmt).astype(STORAGE[code])
    y[1000:1600] = x[1000:1600]  # whole equal blocks
    sp = special_values(code)
    at = rng.choice(n // 2, sp.size * 3, replace=False) + n // 2  # only in the second half
    x[at] = rng.choice(sp, at.size)
    y[at[::2]] = rng.choice(sp, at[::2].size)
    return x, y


@pytest.mark.parametrize("code", ["BF16", "F16", "F32"])
@pytest.mark.parametrize("piece", [1 << 16, 4099, 256, 255,
                                   pytest.param(3, marks=pytest.mark.slow)])  # 3: ~2 s
def test_kernel_equals_numpy_path(code: str, piece: int) -> None:
    rng = np.random.default_rng(7)
    x, y = pairs(code, rng, 1 << 15)
    for max_bin in (3, 15, 1023):
        a = run(code, x, y, piece, max_bin, True)
        b = run(code, x, y, piece, max_bin, False)
        assert a == b, (code, piece, max_bin)


@pytest.mark.parametrize("code", ["BF16", "F16"])
def test_kernel_every_16bit_pattern(code: str) -> None:
    """All 65,536 patterns against shuffled and neighbouring partners: distances from
    numerics.ulp_distance, max |a - b| from numpy's float32 arithmetic."""
    rng = np.random.default_rng(1)
    x = np.arange(1 << 16, dtype=np.uint16)
    for y in (rng.permutation(x), x ^ np.uint16(1), (x + np.uint16(3)).astype(np.uint16)):
        got = run(code, x, y, 1 << 16, 1023, True)
        assert got == run(code, x, y, 1 << 16, 1023, False)
        ref = nm.ulp_distance(x, y, code)
        finite = ref[ref != nm.NAN_MISMATCH]
        assert got[1] == int((x != y).sum())
        assert got[2] == int((ref == nm.NAN_MISMATCH).sum())
        assert (got[3], got[4]) == (int(finite.max()), float(finite.sum()))
        assert got[6] == nm.ulp_histogram(ref)[1].tolist()
        with np.errstate(invalid="ignore", over="ignore"):
            d = np.abs(nm.to_float32(x, code) - nm.to_float32(y, code))
        assert got[5] == float(np.fmax.reduce(d))


def test_kernel_float32_extremes() -> None:
    """float32 distances beyond 2**31 (largest negative vs largest positive) and beyond
    the histogram: exact sum and max, capped count."""
    x = np.array([0xFF7FFFFF, 0x00000001, 0x7F800000, 0x3F800000], np.uint32)
    y = np.array([0x7F7FFFFF, 0x80000001, 0xFF800000, 0x3F800001], np.uint32)
    got = run("F32", x, y, 4, 1023, True)
    assert got == run("F32", x, y, 4, 1023, False)
    ref = nm.ulp_distance(x, y, "f32")
    assert got[3] == int(ref.max()) == 2 * 0x7F800000
    assert got[4] == float(ref.sum())
    assert got[5] == float("inf")  # inf - (-inf)


def test_kernel_rejects_bad_buffers() -> None:
    h = np.zeros(1025, np.int64)
    a = np.zeros(8, np.uint16)
    with pytest.raises(ValueError, match="same whole number"):
        KERNEL.accumulate(a, a[:7], 0, h)
    with pytest.raises(ValueError, match="fmt"):
        KERNEL.accumulate(a, a, 3, h)
    with pytest.raises(ValueError, match="hist"):
        KERNEL.accumulate(a, a, 0, np.zeros(1, np.int64))
    with pytest.raises(TypeError):
        KERNEL.accumulate(a, a, 0, np.zeros(1025, np.int64)[::2])  # not contiguous
