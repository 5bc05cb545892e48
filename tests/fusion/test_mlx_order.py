"""mlx-lm's fuse orders in one C pass (lorakit/fusion/mlx_order.py) against MLX itself,
bit for bit: every in/out format pair, both orders (``mlx-lm``, ``scale-after``), the
promoting fuse, ranks 1 to 69, odd shapes, zeros, signed zeros and subnormals; a
non-finite delta or result goes to MLX (same bits or same error); one probed row that
differs from MLX turns the kernel off for the process and the tensor still comes out
as MLX computes it; a whole ``lorakit.fuse(rounding='mlx-lm')`` is the same file with
the kernel on and off."""
from __future__ import annotations

import numpy as np
import pytest

from lorakit import numerics as nm
from lorakit.errors import FuseError
from lorakit.fusion import mlx_order as mo
from lorakit.fusion import nearest as nr
from lorakit.fusion.core import fuse_weight

pytestmark = pytest.mark.skipif(nr._kernel is None, reason="C fuse kernel not built here")

CODES = ("BF16", "F16", "F32")
POLICIES = ("preserve", "promote", "bfloat16", "float16", "float32")


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch):
    """Each test starts with the kernel trusted; what a test turns off stays its own."""
    monkeypatch.setitem(mo._state, "ok", True)
    yield


def weights(rng, shape, code, spread=1.0):
    vals = rng.standard_normal(shape) * spread
    bits = nm.round_to_format(vals, nm.float_format(code))
    return bits if code == "BF16" else bits.view(np.float16 if code == "F16" else np.float32)


def run(monkeypatch, w, code, A, B, scale, rounding, policy, kernel):
    """fuse_weight's bits (or the error's message) with mlx_order on or off, and
    whether the C pass gave them."""
    served = []
    real = mo.fuse_mlx_order

    def spy(*args, **kw):
        out = real(*args, **kw)
        served.append(out is not None)
        return out

    monkeypatch.setattr(mo, "fuse_mlx_order", spy)
    monkeypatch.setattr(nr, "USE_KERNEL", kernel)
    try:
        out, oc = fuse_weight(w, code, A, B, scale, rounding=rounding,
                              dtype_policy=policy, name="t")
        res = (oc, np.asarray(out).view(nm.float_format(oc).storage).copy())
    except FuseError as e:
        res = ("error", str(e))
    monkeypatch.setattr(mo, "fuse_mlx_order", real)
    return res, any(served)


def assert_as_mlx(monkeypatch, w, code, A, B, scale, rounding, policy, must_serve=True):
    (ck, k), served = run(monkeypatch, w, code, A, B, scale, rounding, policy, True)
    (cm, m), mlx_served = run(monkeypatch, w, code, A, B, scale, rounding, policy, False)
    assert not mlx_served
    assert served == must_serve, "the C pass was not used" if must_serve else "it was"
    assert ck == cm
    if ck == "error":
        assert k == m
        return
    bad = np.flatnonzero(k.reshape(-1) != m.reshape(-1))
    assert bad.size == 0, f"{bad.size} of {k.size} elements differ from MLX, first {bad[:5]}"


@pytest.mark.parametrize("rounding", ("mlx-lm", "scale-after"))
@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("policy", POLICIES)
def test_every_format_pair_and_order_is_mlx_bit_for_bit(monkeypatch, code, policy, rounding):
    rng = np.random.default_rng(abs(hash((code, policy, rounding))) % 2**32)
    for out_dim, in_dim, r in ((1, 1, 1), (3, 5, 2), (17, 33, 8), (64, 130, 16),
                               (40, 257, 69)):
        w = weights(rng, (out_dim, in_dim), code, 0.05)
        A = (rng.standard_normal((r, in_dim)) * 0.02).astype(np.float32)
        B = (rng.standard_normal((out_dim, r)) * 0.02).astype(np.float32)
        scale = float(rng.choice([1.0, 2.0, 0.37, 20.0]))
        assert_as_mlx(monkeypatch, w, code, A, B, scale, rounding, policy)


@pytest.mark.parametrize("code", CODES)
def test_zeros_signed_zeros_and_subnormals(monkeypatch, code):
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
            assert_as_mlx(monkeypatch, w, code, A, B, 3.0, rounding, policy)


@pytest.mark.parametrize("code", ("BF16", "F16"))
def test_a_non_finite_delta_or_result_goes_to_mlx(monkeypatch, code):
    rng = np.random.default_rng(3)
    w = weights(rng, (8, 16), code, 0.1)
    A = rng.standard_normal((2, 16)).astype(np.float32)
    B = rng.standard_normal((8, 2)).astype(np.float32)
    B[2, 0] = 3e38  # the delta overflows f32 (and then the format): MLX says what it says
    assert_as_mlx(monkeypatch, w, code, A, B, 10.0, "mlx-lm", "preserve", must_serve=False)
    B[2, 0] = 70000.0 if code == "F16" else 1e38  # finite in f32, not in the weight's format
    assert_as_mlx(monkeypatch, w, code, A, B, 4.0, "mlx-lm", "preserve", must_serve=False)


def test_a_probed_row_unlike_mlx_turns_the_kernel_off(monkeypatch):
    rng = np.random.default_rng(11)
    w = weights(rng, (50, 64), "BF16", 0.05)
    A = (rng.standard_normal((8, 64)) * 0.02).astype(np.float32)
    B = (rng.standard_normal((50, 8)) * 0.02).astype(np.float32)
    (_, mlx_bits), _ = run(monkeypatch, w, "BF16", A, B, 2.0, "mlx-lm", "preserve", False)
    real_rows = mo._mlx_rows

    def another_blas(*args):  # what an MLX with another BLAS (FMA, another order) gives
        out = real_rows(*args).copy()
        out[0, 0] ^= 1
        return out

    monkeypatch.setattr(mo, "_mlx_rows", another_blas)
    monkeypatch.setattr(nr, "USE_KERNEL", True)
    assert mo.serves()
    (_, bits), served = run(monkeypatch, w, "BF16", A, B, 2.0, "mlx-lm", "preserve", True)
    assert not served and not mo._state["ok"] and not mo.serves()
    assert np.array_equal(bits, mlx_bits)  # the tensor came out as MLX computes it


def test_the_probe_takes_the_first_and_last_rows_and_the_largest_changes():
    bs = np.zeros((100, 3), np.float32)
    bs[[17, 42, 63, 80], 1] = [5.0, -6.0, 7.0, 8.0]
    rows = mo._probe_rows(bs)
    assert set(rows) == set(range(mo.PROBE_ROWS)) | set(range(100 - mo.PROBE_ROWS, 100)) \
        | {17, 42, 63, 80}
    assert list(mo._probe_rows(np.ones((5, 2), np.float32))) == [0, 1, 2, 3, 4]


def test_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setattr(nr, "USE_KERNEL", False)
    assert not mo.serves()
    monkeypatch.setattr(nr, "USE_KERNEL", True)
    assert mo.serves()


def test_dora_goes_through_mlx(monkeypatch):
    rng = np.random.default_rng(5)
    w = weights(rng, (12, 20), "BF16", 0.1)
    A = (rng.standard_normal((4, 20)) * 0.05).astype(np.float32)
    B = (rng.standard_normal((12, 4)) * 0.05).astype(np.float32)
    mag = (np.abs(rng.standard_normal(12)) + 0.5).astype(np.float32)
    calls = []
    monkeypatch.setattr(mo, "fuse_mlx_order", lambda *a, **k: calls.append(1))
    fuse_weight(w, "BF16", A, B, 2.0, magnitude=mag, rounding="mlx-lm", name="t")
    assert not calls


@pytest.mark.parametrize("rounding", ("mlx-lm", "scale-after"))
def test_a_whole_fuse_is_the_same_file_with_the_kernel_on_and_off(monkeypatch, tmp_path,
                                                                   rounding):
    import model_factory as mf

    import lorakit
    from lorakit.io.checkpoint import Checkpoint

    base = mf.make_model(tmp_path / "base", "qwen3")
    adapter = mf.make_adapter(base, tmp_path / "adapter")
    served = []
    real = mo.fuse_mlx_order
    monkeypatch.setattr(mo, "fuse_mlx_order",
                        lambda *a, **k: served.append(1) or real(*a, **k))
    files = {}
    for on in (True, False):
        monkeypatch.setattr(nr, "USE_KERNEL", on)
        out = tmp_path / f"fused-{on}"
        lorakit.fuse(base, adapter, out, rounding=rounding, progress=False)
        ck = Checkpoint(out)
        files[on] = {n: ck.read(n).tobytes() for n in ck.tensors}
        if on:
            assert served and mo._state["ok"], "the C pass did not serve the fuse"
    assert files[True] == files[False]
