"""mlx-lm's fuse orders (lorakit/fusion/mlx_order.py) against mlx-lm's own ``LoRALinear.fuse``
and ``DoRALinear.fuse``, bit for bit: every in/out format pair, both orders (``mlx-lm``;
``scale-after``, ``weight + ((B @ A) * scale).astype(weight.dtype)``), the promoting fuse,
ranks 1 to 69, odd shapes, zeros, signed zeros and subnormals; a non-finite result is the
clear error, a finite one MLX's bits."""
from __future__ import annotations

import numpy as np
import pytest

from lorakit import numerics as nm
from lorakit.errors import FuseError
from lorakit.fusion.core import fuse_weight, output_code
from lorakit.io.formats.dtypes import mx_dtype
from lorakit.io.formats.safetensors import mx_to_raw, raw_to_mx

mx = pytest.importorskip("mlx.core")
lora = pytest.importorskip("mlx_lm.tuner.lora")
dora = pytest.importorskip("mlx_lm.tuner.dora")

CODES = ("BF16", "F16", "F32")
POLICIES = ("preserve", "promote", "bfloat16", "float16", "float32")


def weights(rng, shape, code, spread=1.0):
    vals = rng.standard_normal(shape) * spread
    bits = nm.round_to_format(vals, nm.float_format(code))
    return bits if code == "BF16" else bits.view(np.float16 if code == "F16" else np.float32)


def reference(w, code, A, B, scale, rounding, policy, magnitude=None):
    """mlx-lm's fuse of the weight (its module's ``fuse``; ``scale-after`` written out),
    then the policy's cast, as raw storage of the output code."""
    weight = raw_to_mx(w, code)
    out_dims, in_dims = w.shape
    if magnitude is not None:
        layer = dora.DoRALinear(in_dims, out_dims, r=A.shape[0], scale=scale)
        layer.linear.weight = weight
        layer.m = mx.array(magnitude)
    else:
        layer = lora.LoRALinear(in_dims, out_dims, r=A.shape[0], scale=scale)
        layer.linear.weight = weight
    layer.lora_a, layer.lora_b = mx.array(A.T), mx.array(B.T)
    mB, mA = mx.array(B), mx.array(A)
    delta = (mB @ mA) * scale if rounding == "scale-after" else (scale * mB) @ mA
    if policy == "promote" and magnitude is None:  # the fuse that forgets the cast
        fused = weight + delta
    elif rounding == "scale-after":
        fused = weight + delta.astype(weight.dtype)
    else:
        fused = layer.fuse().weight
    code_out = output_code(code, policy)
    if policy != "promote" or fused.dtype != mx.float32:
        fused = fused.astype(mx_dtype(code_out))
    raw, _ = mx_to_raw(fused)
    return code_out, np.asarray(raw).view(nm.float_format(code_out).storage)


def assert_as_mlx_lm(w, code, A, B, scale, rounding, policy, magnitude=None):
    want_code, want = reference(w, code, A, B, scale, rounding, policy, magnitude)
    try:
        out, oc = fuse_weight(w, code, A, B, scale, magnitude=magnitude, rounding=rounding,
                              dtype_policy=policy, name="t")
    except FuseError:  # lorakit's one clear error where mlx-lm's result is not finite
        assert not np.isfinite(nm.to_float64(want, nm.float_format(want_code))).all()
        return
    got = np.asarray(out).view(nm.float_format(oc).storage)
    assert oc == want_code
    bad = np.flatnonzero(got.reshape(-1) != want.reshape(-1))
    assert bad.size == 0, f"{bad.size} of {got.size} elements differ from mlx-lm, first {bad[:5]}"


@pytest.mark.parametrize("rounding", ("mlx-lm", "scale-after"))
@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("policy", POLICIES)
def test_every_format_pair_and_order_is_mlx_lm_bit_for_bit(code, policy, rounding):
    rng = np.random.default_rng(abs(hash((code, policy, rounding))) % 2**32)
    for out_dim, in_dim, r in ((1, 1, 1), (3, 5, 2), (17, 33, 8), (64, 130, 16),
                               (40, 257, 69)):
        w = weights(rng, (out_dim, in_dim), code, 0.05)
        A = (rng.standard_normal((r, in_dim)) * 0.02).astype(np.float32)
        B = (rng.standard_normal((out_dim, r)) * 0.02).astype(np.float32)
        scale = float(rng.choice([1.0, 2.0, 0.37, 20.0]))
        assert_as_mlx_lm(w, code, A, B, scale, rounding, policy)


@pytest.mark.parametrize("code", CODES)
def test_zeros_signed_zeros_and_subnormals(code):
    rng = np.random.default_rng(7)
    fmt = nm.float_format(code)
    tiny = float(fmt.min_subnormal) if hasattr(fmt, "min_subnormal") else 2.0 ** -140
    w = weights(rng, (24, 40), code, 1e-3)
    w.reshape(-1)[:40] = weights(rng, (40,), code, 0.0).reshape(-1)  # +0
    neg0 = nm.round_to_format(np.full(20, -0.0), fmt)
    w.reshape(-1)[40:60] = neg0 if code == "BF16" else neg0.view(w.dtype)
    sub = nm.round_to_format(rng.standard_normal(60) * tiny * 8, fmt)
    w.reshape(-1)[60:120] = sub if code == "BF16" else sub.view(w.dtype)
    A = (rng.standard_normal((4, 40)) * 1e-3).astype(np.float32)
    B = (rng.standard_normal((24, 4)) * 1e-3).astype(np.float32)
    B[:3] = 0.0  # rows with no change: weight + 0, -0 + 0
    A[:, :5] = -0.0
    B[5, :] = np.float32(2.0 ** -149)  # f32 subnormal products underflow to 0
    for policy in ("preserve", "promote"):
        for rounding in ("mlx-lm", "scale-after"):
            assert_as_mlx_lm(w, code, A, B, 3.0, rounding, policy)


@pytest.mark.parametrize("code", ("BF16", "F16"))
def test_a_non_finite_result_is_the_error_a_finite_one_mlx_lm_s_bits(code):
    rng = np.random.default_rng(3)
    w = weights(rng, (8, 16), code, 0.1)
    A = rng.standard_normal((2, 16)).astype(np.float32)
    B = rng.standard_normal((8, 2)).astype(np.float32)
    B[2, 0] = 3e38  # the delta overflows f32 (and then the format)
    assert_as_mlx_lm(w, code, A, B, 10.0, "mlx-lm", "preserve")
    B[2, 0] = 70000.0 if code == "F16" else 1e38  # finite in f32, not in the weight's format
    assert_as_mlx_lm(w, code, A, B, 4.0, "mlx-lm", "preserve")


def test_dora_is_dora_linear_fuse():
    rng = np.random.default_rng(5)
    w = weights(rng, (12, 20), "BF16", 0.1)
    A = (rng.standard_normal((4, 20)) * 0.05).astype(np.float32)
    B = (rng.standard_normal((12, 4)) * 0.05).astype(np.float32)
    mag = (np.abs(rng.standard_normal(12)) + 0.5).astype(np.float32)
    assert_as_mlx_lm(w, "BF16", A, B, 2.0, "mlx-lm", "preserve", mag)
