"""Fusion: bit-identity with mlx-lm (running mlx-lm itself), accuracy against an exact
reference, dtype policies, DoRA, in-memory fusion."""
from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import mlx.core as mx
import model_factory as mf
import numpy as np
import pytest
from helpers import run_mlx_lm_fuse

import lorakit
from lorakit import numerics as nm
from lorakit.fusion.core import fuse_weight
from lorakit.io.formats.checkpoint import Checkpoint
from lorakit.io.formats.safetensors import NUMPY_STORAGE

BF16 = nm.float_format("BF16")


def raw_tensors(path: Path) -> dict:
    ck = Checkpoint(path)
    return {n: (ck.info(n).dtype, ck.info(n).shape, ck.read(n).tobytes()) for n in ck.tensors}


CASES = {
    "llama-lora": dict(family="llama", adapter={}),
    "qwen3-embedding": dict(family="qwen3",
                            adapter=dict(keys=("self_attn.q_proj", "mlp.up_proj", "embed_tokens"))),
    "qwen3-moe-switch": dict(family="qwen3_moe", adapter=dict(
        keys=("self_attn.k_proj", "mlp.switch_mlp.gate_proj", "mlp.switch_mlp.down_proj"))),
    "qwen3-4bit": dict(family="qwen3", quantize=dict(group_size=32, bits=4), adapter={}),
    "qwen3-4bit-dequantize": dict(family="qwen3", quantize=dict(group_size=32, bits=4),
                                  adapter={}, extra=("--dequantize",)),
    "llama-8bit-embedding": dict(family="llama", quantize=dict(group_size=32, bits=8),
                                 adapter=dict(keys=("self_attn.o_proj", "embed_tokens"))),
    "llama-fp16": dict(family="llama", dtype="float16", adapter=dict(scale=8.0)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bit_identical_to_mlx_lm_fuse(case: str, tmp_path: Path) -> None:
    c = CASES[case]
    dtype = {"float16": mx.float16}.get(c.get("dtype"), mx.bfloat16)
    base = mf.make_model(tmp_path / "base", c["family"], quantize=c.get("quantize"), dtype=dtype)
    adapter = mf.make_adapter(base, tmp_path / "adapter", **c["adapter"])
    extra = c.get("extra", ())
    run_mlx_lm_fuse(base, adapter, tmp_path / "mlx", *extra)
    res = lorakit.fuse(base, adapter, tmp_path / "lk", rounding="mlx-lm",
                       dequantize="--dequantize" in extra, progress=False)
    assert res.tensors_fused > 0
    ours, theirs = raw_tensors(tmp_path / "lk"), raw_tensors(tmp_path / "mlx")
    assert sorted(ours) == sorted(theirs)
    differing = [n for n in ours if ours[n] != theirs[n]]
    assert differing == []


def test_dora_mlx_lm_writes_f32_lorakit_keeps_bf16(tmp_path: Path) -> None:
    base = mf.make_model(tmp_path / "base", "llama")
    adapter = mf.make_adapter(base, tmp_path / "adapter", dora=True)
    run_mlx_lm_fuse(base, adapter, tmp_path / "mlx")
    theirs = Checkpoint(tmp_path / "mlx")
    fused_names = [n for n in theirs.tensors if "q_proj.weight" in n]
    # mlx-lm's defect: DoRA-fused weights come out float32 for a bf16 base
    assert {theirs.info(n).dtype for n in fused_names} == {"F32"}
    kept = lorakit.fuse(base, adapter, tmp_path / "kept", rounding="mlx-lm", progress=False)
    ours = Checkpoint(kept.output)
    assert {ours.info(n).dtype for n in fused_names} == {"BF16"}
    # kept dtype = mlx-lm's own f32 result, rounded once to bf16
    for n in fused_names:
        want = nm.round_to_format(theirs.read(n), BF16)
        np.testing.assert_array_equal(ours.read(n), want)
    # and promote reproduces mlx-lm's f32 output bit for bit
    promoted = lorakit.fuse(base, adapter, tmp_path / "promoted", rounding="mlx-lm",
                            dtype="promote", progress=False)
    assert raw_tensors(promoted.output) == raw_tensors(tmp_path / "mlx")


# -- accuracy against an exact reference ------------------------------------------------------
def _exact_round(w_bits, A, B, scale):
    """Correctly rounded bf16 of W + scale*(B@A), by exact rational arithmetic (slow)."""
    out = np.empty(w_bits.shape, np.uint16)
    w = nm.to_float64(w_bits, BF16)
    s = Fraction(scale)
    for i in range(w.shape[0]):
        for j in range(w.shape[1]):
            exact = Fraction(float(w[i, j])) + s * sum(
                Fraction(float(B[i, k])) * Fraction(float(A[k, j])) for k in range(A.shape[0]))
            x = float(exact)
            if Fraction(x) != exact:
                x = float(np.nextafter(x, np.inf if exact > x else -np.inf))
            out[i, j] = nm.round_to_format(np.array([x]), BF16)[0]
    return out


def _random_case(rng, rows=64, cols=96, rank=8, delta_ulps=1.0):
    w = nm.round_to_format(rng.normal(0, 0.02, (rows, cols)), BF16)
    A = rng.normal(0, 1, (rank, cols)).astype(np.float32)
    B = rng.normal(0, 1, (rows, rank)).astype(np.float32)
    # scale the delta to about `delta_ulps` bf16 ulps of the weights (typical adapters)
    scale = float(delta_ulps * 0.02 * 2.0 ** -8 / np.sqrt(rank))
    return w, A, B, scale


def test_nearest_is_correctly_rounded(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    for delta_ulps in (0.3, 1.0, 30.0):
        w, A, B, scale = _random_case(rng, 24, 40, delta_ulps=delta_ulps)
        ours, code = fuse_weight(w, "BF16", A, B, scale)
        assert code == "BF16"
        np.testing.assert_array_equal(ours, _exact_round(w, A, B, scale))


def test_nearest_breaks_exact_ties_to_even() -> None:
    # W = 1.0; bf16 spacing at 1 is 2^-7, so a delta of 2^-8 lands exactly on a tie
    w = nm.round_to_format(np.array([[1.0, 1.0 + 2 ** -7, 1.0, -1.0]]), BF16)
    A = np.array([[1.0, 1.0, 1.0 + 2 ** -20, -1.0]], np.float32)
    B = np.array([[2.0 ** -8]], np.float32)
    out, _ = fuse_weight(w, "BF16", A, B, 1.0)
    got = nm.to_float64(out, BF16)[0]
    assert got[0] == 1.0  # tie: to even (1.0)
    assert got[1] == 1.0 + 2 * 2 ** -7  # tie: to even (up)
    assert got[2] == 1.0 + 2 ** -7  # just above the tie: up
    assert got[3] == -1.0  # -1 - 2^-8: tie, to even (-1.0)


def test_error_statistics_of_the_modes() -> None:
    """nearest: never more than 0.5 ulp from the f64 reference; the double-rounding
    modes are off by a ulp or more on a measurable fraction (more where W and the
    delta nearly cancel, since the delta was rounded on its own scale)."""
    rng = np.random.default_rng(1)
    w, A, B, scale = _random_case(rng, 512, 768, rank=8, delta_ulps=2.0)
    ref = nm.to_float64(w, BF16) + scale * (B.astype(np.float64) @ A.astype(np.float64))
    frac_off = {}
    for mode in ("nearest", "round-once", "mlx-lm", "scale-after"):
        out, code = fuse_weight(w, "BF16", A, B, scale, rounding=mode)
        assert code == "BF16"
        err = nm.ulp_error_vs_reference(out, ref, BF16)
        if mode == "nearest":
            assert err.max() <= 0.5
        frac_off[mode] = float((err > 0.5).mean())
    assert frac_off["nearest"] == 0.0
    assert frac_off["mlx-lm"] > 0.005  # two roundings: percent-level
    assert frac_off["round-once"] < frac_off["mlx-lm"]


@pytest.mark.parametrize("policy,code", [("preserve", "BF16"), ("promote", "F32"),
                                         ("bfloat16", "BF16"), ("float16", "F16"),
                                         ("float32", "F32")])
@pytest.mark.parametrize("rounding", ["nearest", "round-once", "mlx-lm", "scale-after"])
def test_dtype_policy_for_every_rounding(policy: str, code: str, rounding: str) -> None:
    rng = np.random.default_rng(2)
    w, A, B, scale = _random_case(rng, 16, 24)
    out, got = fuse_weight(w, "BF16", A, B, scale, rounding=rounding, dtype_policy=policy)
    assert got == code
    assert out.dtype == NUMPY_STORAGE[code]


@pytest.mark.parametrize("policy", ["preserve", "promote", "float16"])
def test_checkpoint_dtypes_for_every_layer_type(policy: str, tmp_path: Path) -> None:
    base = mf.make_model(tmp_path / "base", "qwen3_moe")
    adapter = mf.make_adapter(base, tmp_path / "adapter", keys=(
        "self_attn.q_proj", "mlp.switch_mlp.up_proj", "embed_tokens"))
    res = lorakit.fuse(base, adapter, tmp_path / "out", dtype=policy, progress=False)
    ck = Checkpoint(res.output)
    want = {"preserve": "BF16", "promote": "F32", "float16": "F16"}[policy]
    for name in res.fused_names:
        assert ck.info(name).dtype == want, name
    others = {ck.info(n).dtype for n in ck.tensors if n not in res.fused_names}
    assert others == ({"F16"} if policy == "float16" else {"BF16"})


def test_fused_model_loads_and_generates(tmp_path: Path) -> None:
    from mlx_lm import load
    from mlx_lm.generate import generate

    base = mf.make_model(tmp_path / "base", "qwen3")
    adapter = mf.make_adapter(base, tmp_path / "adapter")
    res = lorakit.fuse(base, adapter, tmp_path / "out", progress=False)
    model, tok = load(str(res.output))
    text = generate(model, tok, prompt="w1 w2 w3", max_tokens=5)
    assert isinstance(text, str)
    meta = Checkpoint(res.output).headers["model.safetensors"].metadata
    assert meta["lorakit.rounding"] == "nearest"
    assert meta["lorakit.adapter_sha256"] == lorakit.load_adapter(adapter).sha256
    assert json.loads((res.output / "config.json").read_text())["model_type"] == "qwen3"
    assert (res.output / "tokenizer.json").exists()


def test_quantized_fuse_reports_surviving_delta(tmp_path: Path) -> None:
    base = mf.make_model(tmp_path / "base", "qwen3", quantize=dict(group_size=32, bits=4))
    small = mf.make_adapter(base, tmp_path / "small", b_std=1e-4)
    large = mf.make_adapter(base, tmp_path / "large", b_std=0.5)
    r_small = lorakit.fuse(base, small, tmp_path / "o1", progress=False)
    r_large = lorakit.fuse(base, large, tmp_path / "o2", progress=False)
    s_small = np.median([r.survived for r in r_small.requant])
    s_large = np.median([r.survived for r in r_large.requant])
    assert len(r_small.requant) == r_small.tensors_fused
    assert s_small < 0.5 < s_large  # a tiny delta is mostly erased by 4-bit codes
    assert "delta survived" in str(r_small) and "codes changed" in str(r_small)


# -- in memory -----------------------------------------------------------------------------
@pytest.mark.parametrize("family,keys,quant", [
    ("llama", ("self_attn.q_proj", "mlp.down_proj"), None),
    ("qwen3", ("self_attn.v_proj", "embed_tokens"), dict(group_size=32, bits=4)),
    ("qwen3_moe", ("mlp.switch_mlp.gate_proj",), None),
])
def test_in_memory_fuse_matches_disk_fuse(family, keys, quant, tmp_path: Path) -> None:
    from mlx.utils import tree_flatten
    from mlx_lm import load

    base = mf.make_model(tmp_path / "base", family, quantize=quant)
    adapter = mf.make_adapter(base, tmp_path / "adapter", keys=keys)
    disk = lorakit.fuse(base, adapter, tmp_path / "out", rounding="mlx-lm", progress=False)
    want = {k: v for k, v in mx.load(str(disk.output / "model.safetensors")).items()}
    # route 1: model loaded with its adapter (LoRA layers attached)
    model, _ = load(str(base), adapter_path=str(adapter))
    lorakit.fuse(model, rounding="mlx-lm")
    got = dict(tree_flatten(model.parameters()))
    assert not any("lora" in k for k in got)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and mx.array_equal(got[k], v).item(), k
    # route 2: plain model plus adapter directory
    model2, _ = load(str(base))
    lorakit.fuse(model2, adapter, rounding="mlx-lm")
    got2 = dict(tree_flatten(model2.parameters()))
    for k, v in want.items():
        assert mx.array_equal(got2[k], v).item(), k


def test_progress_callback_reaches_total(tmp_path: Path) -> None:
    base = mf.make_model(tmp_path / "base", "llama")
    adapter = mf.make_adapter(base, tmp_path / "adapter")
    seen = []
    lorakit.fuse(base, adapter, tmp_path / "out", progress=lambda d, t: seen.append((d, t)))
    total = Checkpoint(base).nbytes
    assert seen and seen[-1] == (total, total)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_old_mlx_lm_dora_config_with_use_dora(tmp_path: Path) -> None:
    """mlx-lm before fine_tune_type marked DoRA adapters with "use_dora": true."""
    from lorakit.io.adapters.load import load_adapter

    base = mf.make_model(tmp_path / "base", "qwen3")
    new = mf.make_adapter(base, tmp_path / "new", dora=True)
    old = mf.copy_tree(new, tmp_path / "old")
    cfg = json.loads((old / "adapter_config.json").read_text())
    del cfg["fine_tune_type"]
    cfg["use_dora"] = True
    (old / "adapter_config.json").write_text(json.dumps(cfg))
    a, b = load_adapter(new), load_adapter(old)
    assert [t.module for t in a.targets] == [t.module for t in b.targets]
    assert all(t.magnitude is not None for t in b.targets)
    r1 = lorakit.fuse(base, new, tmp_path / "f1", progress=False)
    r2 = lorakit.fuse(base, old, tmp_path / "f2", progress=False)
    assert raw_tensors(tmp_path / "f1") == raw_tensors(tmp_path / "f2")
    assert r1.tensors_fused == r2.tensors_fused > 0


def test_nearest_survives_catastrophic_cancellation() -> None:
    """W + scale * B @ A where large products cancel: the f64 sum loses everything
    (x == 0) while the exact value is 2**-22 + 2**-46. The error bound flags the
    element and the exact redo gives the correctly rounded bf16 value."""
    w = nm.round_to_format(np.array([[-1.0, 0.5]]), BF16)
    A = np.array([[2.0 ** 20, 0.0], [1 + 2.0 ** -23, 0.0], [2.0 ** 20, 0.0]], np.float32)
    B = np.array([[2.0 ** 20, 1 + 2.0 ** -23, -2.0 ** 20]], np.float32)
    exact = Fraction(-1) + sum(Fraction(float(B[0, k])) * Fraction(float(A[k, 0]))
                               for k in range(3))
    assert exact == Fraction(2) ** -22 + Fraction(2) ** -46
    out = fuse_weight(w, "BF16", A, B, 1.0)
    out = out[0] if isinstance(out, tuple) else out
    want = nm.round_to_format(np.array([[float(exact), 0.5]]), BF16)
    assert out.tolist() == want.tolist()


@pytest.mark.parametrize("fmt", ["BF16", "F16", "F32"])
def test_nearest_cancellation_to_a_tiny_value(fmt: str) -> None:
    """Products of 2**40 cancel to leave 2**-60 (plus the weight, which cancels too):
    the f64 sum says 0, the correctly rounded result is the format's nearest value to
    2**-60 (0 for bf16/f16 would be wrong too: bf16 reaches 2**-133)."""
    f = nm.float_format(fmt)
    w = nm.round_to_format(np.array([[0.0]]), f)
    A = np.array([[2.0 ** 20], [2.0 ** -30], [2.0 ** 20]], np.float32)
    B = np.array([[2.0 ** 20, 2.0 ** -30, -2.0 ** 20]], np.float32)
    exact = sum(Fraction(float(B[0, k])) * Fraction(float(A[k, 0])) for k in range(3))
    assert exact == Fraction(2) ** -60
    out = fuse_weight(w, fmt, A, B, 1.0)
    out = out[0] if isinstance(out, tuple) else out
    want = nm.round_to_format(np.array([[2.0 ** -60]]), f)
    assert np.asarray(out).view(f.storage).tolist() == want.tolist()


def test_tie_distance_is_a_lower_bound() -> None:
    """_tie_distance never exceeds the true distance to the nearest tie (checked
    against exact rationals on random values, powers of two and zero)."""
    from lorakit.fusion.nearest import _tie_distance

    rng = np.random.default_rng(3)
    for fmt in ("BF16", "F16", "F32"):
        f = nm.float_format(fmt)
        xs = np.concatenate([np.abs(rng.normal(0, 1, 300)) * 2.0 ** rng.integers(-140, 10, 300),
                             2.0 ** np.arange(-20, 5, dtype=np.float64), [0.0]])
        d = _tie_distance(xs, f)
        for x, dx in zip(xs.tolist(), d.tolist()):
            # the representable neighbours of x and the ties between them
            lo = float(nm.to_float64(nm.round_to_format(np.array([x]), f), f)[0])
            nb = [float(v) for v in nm.to_float64(np.array(
                [max(int(nm.round_to_format(np.array([x]), f)[0]) + k, 0) for k in (-2, -1, 0, 1, 2)],
                dtype=f.storage), f)]
            ties = [(Fraction(a) + Fraction(b)) / 2 for a, b in zip(nb, nb[1:]) if a != b]
            true = min(abs(Fraction(x) - t) for t in ties)
            assert Fraction(dx) <= true, (fmt, x, dx, float(true), lo)
