"""Quantization policies for a fuse into a quantized base (issue 15), ``--quant-policy
learned`` (mlx-lm's GPTQ re-quantizes the fused weights) among them."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import lorakit
from lorakit.errors import ArgumentError, FuseError
from lorakit.fusion.options import parse_method, parse_policy
from lorakit.fusion.quant import calibration_tokens, pack_codes, unpack_codes


def load_file(path):
    """Raw storage of every tensor of a checkpoint's shard (bf16 as uint16 bits)."""
    ck = lorakit.open(Path(path).parent, checkpoint=True)
    return {n: ck.read(n) for n in ck.tensors}

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "data/tiny-qwen3-4bit"
WEAK = ROOT / "data/adapters/lora-4bit-weak"


def _fuse(tmp_path, policy, **kw):
    out = tmp_path / policy.replace(":", "_")
    return lorakit.fuse(str(BASE), str(WEAK), str(out), progress=False, quant_policy=policy,
                        **kw), out


def _generate(out):
    from mlx_lm import generate, load
    model, tok = load(str(out))
    text = generate(model, tok, "The LORD", max_tokens=4)
    assert isinstance(text, str) and text.strip()


def test_pack_codes_inverts_unpack_and_matches_mlx():
    import mlx.core as mx
    rng = np.random.default_rng(0)
    for bits in (2, 3, 4, 5, 6, 8):
        x = mx.array(rng.standard_normal((4, 128)).astype(np.float32))
        w, _, _ = mx.quantize(x, group_size=64, bits=bits)
        packed = np.array(w)
        codes = unpack_codes(packed, bits)
        assert np.array_equal(pack_codes(codes, bits), packed), bits


def test_parse_policy_refuses_unknown_and_bad_bits():
    assert parse_policy("bits:8").bits == 8
    for bad in ("bits:7", "bits:x", "fancy"):
        with pytest.raises(ArgumentError, match="quant_policy"):
            parse_policy(bad)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["requant", "same-grid", "bits:8", "float", "auto"])
def test_every_policy_loads_in_mlx_lm_and_generates(tmp_path, policy):
    r, out = _fuse(tmp_path, policy)
    assert r.requant and all(s.policy != "" for s in r.requant)
    _generate(out)


@pytest.mark.slow
def test_same_grid_keeps_the_base_where_the_delta_is_zero(tmp_path):
    """A zero delta (lora_b = 0 on every module) re-rounds nothing: same bytes as the base."""
    import mlx.core as mx
    ad = tmp_path / "zero"
    ad.mkdir()
    (ad / "adapter_config.json").write_text((WEAK / "adapter_config.json").read_text())
    t = mx.load(str(WEAK / "adapters.safetensors"))
    t = {k: (mx.zeros_like(v) if "lora_b" in k else v) for k, v in t.items()}
    mx.save_safetensors(str(ad / "adapters.safetensors"), t)
    out = tmp_path / "sg"
    lorakit.fuse(str(BASE), str(ad), str(out), progress=False, quant_policy="same-grid")
    a, b = load_file(str(BASE / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for k in a:
        assert np.array_equal(a[k], b[k]), k
    # requant, by contrast, re-fits the grid even where nothing was asked (unsloth-zoo 970)
    out2 = tmp_path / "rq"
    lorakit.fuse(str(BASE), str(ad), str(out2), progress=False, quant_policy="requant")
    c = load_file(str(out2 / "model.safetensors"))
    assert any(not np.array_equal(a[k], c[k]) for k in a if k.endswith(".weight"))


@pytest.mark.slow
def test_same_grid_moves_codes_where_the_delta_is_large(tmp_path):
    r, out = _fuse(tmp_path, "same-grid")
    a, b = load_file(str(BASE / "model.safetensors")), load_file(str(out / "model.safetensors"))
    q = "model.layers.0.self_attn.q_proj"
    assert np.array_equal(a[f"{q}.scales"], b[f"{q}.scales"])
    assert not np.array_equal(a[f"{q}.weight"], b[f"{q}.weight"])
    assert np.median([s.survived for s in r.requant]) > 0.5


@pytest.mark.slow
def test_bits_policy_is_recorded_per_layer_for_mlx_lm(tmp_path):
    r, out = _fuse(tmp_path, "bits:8")
    cfg = json.loads((out / "config.json").read_text())
    m = "model.layers.0.mlp.down_proj"
    assert cfg["quantization"][m] == {"group_size": 64, "bits": 8, "mode": "affine"}
    assert cfg["quantization"]["bits"] == 4  # the rest stays 4-bit
    ck = lorakit.open(out, checkpoint=True)
    assert ck.quant_params(m).bits == 8
    assert ck.quant_params("model.embed_tokens").bits == 4
    assert min(s.survived for s in r.requant) > 0.99  # 16x finer step keeps the delta


@pytest.mark.slow
def test_float_policy_bytes(tmp_path):
    r, out = _fuse(tmp_path, "float")
    cfg = json.loads((out / "config.json").read_text())
    m = "model.layers.1.self_attn.k_proj"
    assert cfg["quantization"][m] is False
    ck, base = lorakit.open(out, checkpoint=True), lorakit.open(BASE, checkpoint=True)
    w = ck.tensors[f"{m}.weight"]
    assert w.dtype == base.tensors[f"{m}.scales"].dtype
    assert f"{m}.scales" not in ck.tensors
    # bytes: every adapted weight at 2 bytes per element instead of 4 bits + scales/biases
    grow = 0
    for n in r.fused_names:
        mod = n[: -len(".weight")]
        rows, cols = ck.tensors[n].shape
        old = sum(base.tensors[f"{mod}.{p}"].nbytes for p in ("weight", "scales", "biases"))
        grow += rows * cols * 2 - old
    assert r.bytes_written == pytest.approx((BASE / "model.safetensors").stat().st_size + grow,
                                            abs=8192)
    assert min(s.survived for s in r.requant) == pytest.approx(1.0, abs=1e-2)


@pytest.mark.slow
@pytest.mark.parametrize("budget", [1.0, 1.05, 1.15])
def test_auto_respects_the_budget(tmp_path, budget):
    r, out = _fuse(tmp_path, "auto", quant_budget=budget)
    base = (BASE / "model.safetensors").stat().st_size
    assert r.bytes_written <= budget * base + 4096  # header growth: per-tensor JSON
    if budget == 1.0:
        assert {s.policy for s in r.requant} <= {"same-grid", "requant"}
    else:
        assert {s.policy for s in r.requant} - {"same-grid", "requant"}  # something upgraded


@pytest.mark.slow
def test_auto_keeps_more_than_requant(tmp_path):
    r1, _ = _fuse(tmp_path, "requant")
    r2, _ = _fuse(tmp_path, "auto")
    s1 = np.array([s.survived for s in r1.requant])
    s2 = np.array([s.survived for s in r2.requant])
    assert s2.min() > s1.min() and np.median(s2) >= np.median(s1)


@pytest.mark.slow
def test_requant_policy_is_todays_fuse(tmp_path):
    a = lorakit.fuse(str(BASE), str(WEAK), str(tmp_path / "a"), progress=False,
                     rounding="mlx-lm")
    b = lorakit.fuse(str(BASE), str(WEAK), str(tmp_path / "b"), progress=False,
                     rounding="mlx-lm", quant_policy="requant")
    assert (tmp_path / "a/model.safetensors").read_bytes() == \
        (tmp_path / "b/model.safetensors").read_bytes()
    assert [s.survived for s in a.requant] == [s.survived for s in b.requant]


@pytest.mark.parametrize("policy", ["learned:dwq", "learned:awq"])
def test_learned_methods_that_cannot_run_are_refused_with_the_reason(tmp_path, policy):
    with pytest.raises(ArgumentError, match=policy + ".*not available"):
        _fuse(tmp_path, policy)
    assert not (tmp_path / policy.replace(":", "_")).exists()


def test_policy_on_a_float_base_is_refused(tmp_path):
    with pytest.raises(FuseError, match="quantized base"):
        lorakit.fuse(str(ROOT / "data/tiny-qwen3"), str(ROOT / "data/adapters/lora"),
                     str(tmp_path / "x"), progress=False, quant_policy="same-grid")


@pytest.mark.slow
def test_float_base_fuses_into_the_float_original(tmp_path):
    out = tmp_path / "fb"
    r = lorakit.fuse(str(BASE), str(WEAK), str(out), progress=False,
                     float_base=str(ROOT / "data/tiny-qwen3"))
    ck = lorakit.open(out, checkpoint=True)
    assert not ck.quantization and r.tensors_fused == 28
    with pytest.raises(FuseError, match="float original"):
        lorakit.fuse(str(BASE), str(WEAK), str(tmp_path / "bad"), progress=False,
                     float_base=str(ROOT / "data/tiny-qwen3-moe"))


@pytest.mark.slow
def test_summary_names_the_policy(tmp_path):
    r, _ = _fuse(tmp_path, "auto")
    assert "quant policy" in str(r) and "auto:" in str(r)
    assert r.to_dict()["quant_policy"] == "auto"
    assert {d["policy"] for d in r.to_dict()["requant"]} <= {"same-grid", "requant", "bits:5",
                                                            "bits:6", "bits:8", "float"}


def test_readme_and_benchmarks_numbers_come_from_the_json():
    import importlib.util
    spec = importlib.util.spec_from_file_location("qp_bench", ROOT / "benchmarks/quant_policies.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = json.loads((ROOT / "benchmarks/results/quant_policies.json").read_text())
    table = mod.markdown_table(res)
    for doc in ("docs/quantized.md", "BENCHMARKS.md"):
        text = (ROOT / doc).read_text()
        assert table in text, f"{doc}: the quant-policy table differs from the JSON"
        assert res["command"] in text
    ratio = json.loads((ROOT / "data/logs/lora-4bit-weak-ratio.json").read_text())
    data_readme = (ROOT / "data/README.md").read_text()
    assert f"overall {ratio['overall_ratio']:.2f}, median {ratio['median_ratio']:.2f}" \
        in data_readme
    nb = (ROOT / "notebooks/07_quantized_fuses.ipynb").read_text()
    assert "quant_policies.json" in nb  # the notebook's KL numbers are loaded, not typed


# -- learned: mlx-lm's GPTQ ---------------------------------------------------------------
def test_learned_parses_to_gptq_and_refuses_what_cannot_run():
    assert parse_policy("learned").kind == "learned"
    assert parse_policy("learned:gptq").kind == "learned"
    assert parse_method("learned") == "gptq"
    for method in ("dwq", "awq"):
        with pytest.raises(ArgumentError, match="backprop|folds per-channel"):
            parse_policy(f"learned:{method}")
    with pytest.raises(ArgumentError, match="learned \\| learned:gptq"):
        parse_policy("learned:fancy")


def test_calibration_is_the_training_text_not_the_scored_validation_text(tmp_path):
    class Tok:  # one id per character: enough to check the windows
        def encode(self, text):
            return [ord(c) % 97 for c in text]
    f = tmp_path / "c.jsonl"
    f.write_text('{"text": "abcdef"}\n{"text": "ghij"}\n', encoding="utf-8")
    x = np.array(calibration_tokens(Tok(), f, sequence_length=4, samples=8))
    assert x.shape == (2, 4)  # "abcdef\nghij" = 11 ids -> two windows, partial dropped
    assert x[0].tolist() == [ord(c) % 97 for c in "abcd"]
    with pytest.raises(FuseError, match="shorter than one window"):
        calibration_tokens(Tok(), f, sequence_length=64)


@pytest.mark.slow
def test_learned_loads_generates_and_beats_requant_on_kl(tmp_path, capsys):
    from mlx_lm import generate, load

    ref = load(str(BASE), adapter_path=str(WEAK))  # the QLoRA reference, unfused
    res, kl = {}, {}
    for policy in ("requant", "learned"):
        out = tmp_path / policy
        res[policy] = lorakit.fuse(str(BASE), str(WEAK), str(out), progress=False,
                                   quant_policy=policy)
        kl[policy] = lorakit.compare_outputs(ref, str(out), tokens=512, context=256)
    out = tmp_path / "learned"
    model, tok = load(str(out))
    text = generate(model, tok, "The LORD", max_tokens=4)
    assert isinstance(text, str) and text.strip()
    # same layout and bytes as the 4-bit base: one grid, untouched tensors copied
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    assert res["learned"].bytes_written == res["requant"].bytes_written
    b, o = lorakit.open(BASE, checkpoint=True), lorakit.open(out, checkpoint=True)
    assert np.array_equal(o.read("model.embed_tokens.weight"), b.read("model.embed_tokens.weight"))
    # GPTQ chose other codes than round-to-nearest of the same fused weights
    name = "model.layers.0.mlp.down_proj.weight"
    r = lorakit.open(tmp_path / "requant", checkpoint=True)
    assert not np.array_equal(o.read(name), r.read(name))
    # survival is reported like the other policies
    assert {s.policy for s in res["learned"].requant} == {"learned"}
    surv = np.array([s.survived for s in res["learned"].requant])
    ratio = kl["learned"].mean_kl / kl["requant"].mean_kl
    with capsys.disabled():
        print(f"\nlearned: mean KL vs unfused {kl['learned'].mean_kl:.6f}, requant "
              f"{kl['requant'].mean_kl:.6f} (x{ratio:.3f}); top-1 "
              f"{kl['learned'].top1_agreement:.4f} vs {kl['requant'].top1_agreement:.4f}; "
              f"survived median {np.median(surv):.3f}")
    assert ratio < 0.5  # measured 0.11 (benchmarks/results/quant_policies.json)
    assert kl["learned"].top1_agreement >= kl["requant"].top1_agreement
