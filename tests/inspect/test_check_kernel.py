"""The merge check's C pass over a plain LoRA (``check_lora`` in
lorakit/inspect/_checkkernel.c) against its numpy twin (``check._lora_numpy``): the same
numbers, bit for bit, for every base / fused format pair, ranks 0, 1, 8 and 64,
per-rank-column scales, widths that are not a multiple of its lanes or tiles,
subnormal and overflowing results, wrong fuses, and non-finite values (left to numpy);
and whole checks with the kernel on and off give the same rows."""
from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import DATA

import lorakit
from lorakit import kernels
from lorakit import numerics as nm
from lorakit.inspect import check as ck

KERNEL = kernels.load("lorakit.inspect._checkkernel")
pytestmark = pytest.mark.skipif(KERNEL is None, reason="C check kernel not built here")

CODES = ("BF16", "F16", "F32")
BASE_Q4, LORA_Q4 = DATA / "tiny-qwen3-4bit", DATA / "adapters" / "lora-4bit"
FIN = {"BF16": 0, "F16": 1, "F32": 2}


def storage(values: np.ndarray, code: str) -> np.ndarray:
    """Bits of ``values`` rounded to ``code`` (uint16 / uint32, the kernel's input)."""
    return nm.round_to_format(np.asarray(values, np.float64), nm.float_format(code))


def case(seed, rows, cols, r, base, out, *, wscale=0.05, dscale=0.01, scale=2.0,
         wrong=0.0, f64_base=False):
    """(W bits or f64, F bits, Bs, A, c32) of a fuse (correctly rounded, then a share
    ``wrong`` of its elements moved by a few ulps)."""
    rng = np.random.default_rng(seed)
    w = storage(rng.standard_normal((rows, cols)) * wscale, base)
    W = nm.to_float64(w, nm.float_format(base))
    A = (rng.standard_normal((r, cols)) * dscale).astype(np.float64)
    B = (rng.standard_normal((rows, r)) * dscale).astype(np.float32).astype(np.float64)
    Bs = np.ascontiguousarray(B * np.asarray(scale, np.float64))
    f = storage(W + Bs @ A, out)
    if wrong:
        hit = rng.random(f.shape) < wrong
        f = np.where(hit, f + rng.integers(1, 4, f.shape).astype(f.dtype), f).astype(f.dtype)
    return (W if f64_base else w), f, Bs, np.ascontiguousarray(A), (r + 2) * 2.0 ** -24


def same(x, y) -> bool:
    if isinstance(x, tuple):
        return len(x) == len(y) and all(same(a, b) for a, b in zip(x, y))
    if isinstance(x, float) and math.isnan(x):
        return isinstance(y, float) and math.isnan(y)
    return x == y and type(x) is type(y)


def compare(w, f, Bs, A, c32, base, out, carry=(0.0, 1.5, -0.0, 2.0 ** -30, 7.0),
            f64_base=False):
    fw, fo = nm.float_format(base), nm.float_format(out)
    special, *k = KERNEL.check_lora(
        w, 3 if f64_base else FIN[base], f, FIN[out], FIN[base], f.shape[1], Bs, A, c32, carry)
    W = w if f64_base else nm.to_float64(w, fw)
    n = ck._lora_numpy(W, nm.to_float64(f, fo), Bs, A, c32, fw, fo, carry)
    if special:
        return None, n
    assert same(tuple(k), n), (k, n)
    return tuple(k), n


@pytest.mark.parametrize("base", CODES)
@pytest.mark.parametrize("out", CODES)
@pytest.mark.parametrize("r", (0, 1, 8, 64))
def test_every_format_pair_and_rank(base, out, r) -> None:
    k, _ = compare(*case(r, 37, 1031, r, base, out), base, out)
    assert k is not None and k[2] == 0  # a correct fuse: nothing beyond the bound
    k, _ = compare(*case(r + 1, 9, 13, r, base, out, wrong=0.3), base, out)
    assert k is not None
    if r:  # one scale per rank column (an exact combination of adapters)
        scales = np.random.default_rng(r).uniform(-3, 3, r)
        assert compare(*case(r, 11, 600, r, base, out, scale=scales), base, out)[0]


@pytest.mark.parametrize("cols", (1, 7, 8, 9, 511, 512, 513, 1537))
def test_widths(cols) -> None:
    assert compare(*case(cols, 5, cols, 8, "BF16", "BF16", wrong=0.1), "BF16", "BF16")[0]


def test_dequantized_base_as_float64() -> None:
    for out in CODES:
        w, f, Bs, A, c32 = case(3, 20, 300, 8, "BF16", out, f64_base=True)
        assert compare(w, f, Bs, A, c32, "BF16", out, f64_base=True)[0]


@pytest.mark.parametrize("base,out", [("BF16", "BF16"), ("F16", "F16"), ("F32", "BF16"),
                                      ("F16", "F32")])
def test_subnormal_and_huge_results(base, out) -> None:
    """Tiny weights and deltas (results in and below the subnormal range) and weights
    near the largest finite value (results that round to inf are left to numpy)."""
    fmt = nm.float_format(out)
    for wscale, dscale in ((fmt.min_normal, fmt.min_normal ** 0.5 / 8),
                           (fmt.min_subnormal * 4, fmt.min_subnormal ** 0.5 / 4)):
        k, _ = compare(*case(5, 16, 100, 4, base, out, wscale=wscale, dscale=dscale),
                       base, out)
        assert k is not None
    big = nm.float_format(base).max_value / 2
    if nm.float_format(out).max_value >= big:
        compare(*case(6, 8, 64, 4, base, out, wscale=big / 3, dscale=big ** 0.5 / 2), base, out)


def test_non_finite_is_left_to_numpy() -> None:
    w, f, Bs, A, c32 = case(1, 8, 40, 4, "BF16", "BF16")
    for which, bits in (("w", 0x7F80), ("w", 0x7FC1), ("f", 0xFF80), ("f", 0x7FC0)):
        ww, ff = w.copy(), f.copy()
        (ww if which == "w" else ff)[3, 5] = bits
        k, _ = compare(ww, ff, Bs, A, c32, "BF16", "BF16")
        assert k is None


def test_carry_continues_the_order() -> None:
    """Two blocks with the carry passed on give the same sums as one block."""
    w, f, Bs, A, c32 = case(2, 40, 70, 8, "BF16", "BF16", wrong=0.2)
    kern = KERNEL
    one = kern.check_lora(w, 0, f, 0, 0, 70, Bs, A, c32, (0.0,) * 5)
    a = kern.check_lora(w[:17].copy(), 0, f[:17].copy(), 0, 0, 70, Bs[:17].copy(), A, c32,
                        (0.0,) * 5)
    b = kern.check_lora(w[17:].copy(), 0, f[17:].copy(), 0, 0, 70, Bs[17:].copy(), A, c32,
                        a[5])
    assert b[5] == one[5]
    assert max(a[1], b[1]) == one[1] and a[3] + b[3] == one[3] and a[4] + b[4] == one[4]


@pytest.fixture(scope="module")
def fuses(tmp_path_factory):
    d = tmp_path_factory.mktemp("check-kernel")
    base, lora = DATA / "tiny-qwen3", DATA / "adapters" / "lora"
    out = {"nearest": lorakit.fuse(base, lora, d / "nearest", progress=False).output,
           "mlx-lm": lorakit.fuse(base, lora, d / "mlx", rounding="mlx-lm",
                                  progress=False).output,
           "f32": lorakit.fuse(base, lora, d / "f32", dtype="float32", progress=False).output,
           "q4-deq": lorakit.fuse(BASE_Q4, LORA_Q4, d / "q4", dequantize=True,
                                  progress=False).output}
    return base, lora, out


@pytest.mark.parametrize("which", ("nearest", "mlx-lm", "f32", "q4-deq"))
def test_check_rows_kernel_on_and_off(fuses, which) -> None:
    base, lora, out = fuses
    if which == "q4-deq":  # a dequantized fuse of a 4-bit base: W comes as float64
        base, lora = BASE_Q4, LORA_Q4
    reps = []
    for on in (True, False):
        with kernels.use_kernels(on):
            assert (kernels.load("lorakit.inspect._checkkernel") is not None) is on
            reps.append(lorakit.check(out[which], base, lora, progress=False))
    assert reps[0].rows == reps[1].rows
    assert reps[0].status == reps[1].status


def test_wrong_scale_kernel_on_and_off(tmp_path, fuses) -> None:
    base, lora, out = fuses
    import json
    import shutil
    ad = tmp_path / "half"
    shutil.copytree(lora, ad)
    c = json.loads((ad / "adapter_config.json").read_text())
    c["lora_parameters"]["scale"] *= 0.5
    (ad / "adapter_config.json").write_text(json.dumps(c))
    reps = []
    for on in (True, False):
        with kernels.use_kernels(on):
            reps.append(lorakit.check(out["nearest"], base, ad, progress=False))
    assert reps[0].rows == reps[1].rows and reps[0].status == "wrong"
