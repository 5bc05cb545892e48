"""PEFT adapters made on a changed base (PiSSA, OLoRA; issue 41), from the real PEFT
(tests/fixtures/make_peft_residual_fixtures.py): refused by name unconverted, converted
with their initial adapter exactly as PEFT's ``path_initial_model_for_weight_conversion``
(round-once bit-identical to PEFT's merge of the converted adapter, ``nearest`` the
exact delta ``scale * (B @ A - B0 @ A0)`` rounded once), and ``check`` names the wrong
merge. Also the config allow-list on real PEFT configs. No torch needed."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import run_cli

import lorakit
from lorakit.errors import AdapterError, ArgumentError
from lorakit.io.formats.checkpoint import Checkpoint

FX = Path(__file__).resolve().parents[1] / "fixtures"
sys.path.insert(0, str(FX))
from make_peft_fixtures import read_safetensors, round_f64_to, to_f32  # noqa: E402

ROOT = FX / "peft" / "residual"
NAMES = ["llama_pissa_bf16", "llama_olora_rslora_bf16"]
CONFIGS = FX / "peft" / "configs"
BASE = FX / "peft" / "llama_lora_bf16" / "base"


def _same(a: Path, b: Path) -> int:
    """Count of differing elements between two checkpoints (same tensors)."""
    x, y = Checkpoint(a), Checkpoint(b)
    assert set(x.tensors) == set(y.tensors)
    return sum(int((x.read(n).view(np.uint8) != y.read(n).view(np.uint8)).sum())
               for n in x.tensors)


@pytest.mark.parametrize("name", NAMES)
def test_unconverted_refused_by_name_exit_2_nothing_written(name: str, tmp_path: Path) -> None:
    fx = ROOT / name
    init = json.loads((fx / "adapter" / "adapter_config.json").read_text())["init_lora_weights"]
    with pytest.raises(AdapterError) as e:
        lorakit.load_adapter(fx / "adapter")
    msg = str(e.value)
    assert f"residual-base adapter: init_lora_weights={init!r}" in msg
    assert "path_initial_model_for_weight_conversion" in msg and "--initial-adapter" in msg
    r = run_cli("fuse", "--model", fx / "base", "--adapter-path", fx / "adapter",
                "--save-path", tmp_path / "out", "-q")
    assert r.returncode == 2 and "init_lora_weights" in r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", NAMES)
def test_initial_adapter_converts_as_peft(name: str) -> None:
    """The conversion gives PEFT's converted adapter: same factors, bit for bit, same scale."""
    fx = ROOT / name
    ours = lorakit.load_adapter(fx / "adapter", initial_adapter=fx / "initial")
    peft = lorakit.load_adapter(fx / "converted")
    assert [t.module for t in ours.targets] == [t.module for t in peft.targets]
    for a, b in zip(ours.targets, peft.targets):
        assert np.array_equal(a.A, b.A) and np.array_equal(a.B, b.B) and a.scale == b.scale
        assert a.rank == 8


@pytest.mark.parametrize("name", NAMES)
def test_initial_adapter_round_once_is_peft_merge(name: str, tmp_path: Path) -> None:
    fx = ROOT / name
    r = run_cli("fuse", "--model", fx / "base", "--adapter-path", fx / "adapter",
                "--initial-adapter", fx / "initial", "--save-path", tmp_path / "out",
                "--rounding", "round-once", "-q")
    assert r.returncode == 0, r.stderr
    assert _same(tmp_path / "out", fx / "merged") == 0


@pytest.mark.parametrize("name", NAMES)
def test_initial_adapter_nearest_is_exact(name: str, tmp_path: Path) -> None:
    """``nearest`` is W + scale * (B @ A - B0 @ A0) in exact arithmetic, rounded once."""
    fx = ROOT / name
    res = lorakit.fuse(fx / "base", fx / "adapter", tmp_path / "out",
                       initial_adapter=fx / "initial", progress=False)
    base, ad = read_safetensors(fx / "base" / "model.safetensors"), \
        read_safetensors(fx / "adapter" / "adapter_model.safetensors")
    a0 = read_safetensors(fx / "initial" / "adapter_model.safetensors")
    scale = lorakit.load_adapter(fx / "converted").targets[0].scale
    out = Checkpoint(res.output)
    assert res.tensors_fused == 14
    for n in res.fused_names:
        m = "base_model.model." + n[: -len(".weight")]
        A, B = (ad[f"{m}.lora_{x}.weight"][1].astype(np.float64) for x in "AB")
        A0, B0 = (a0[f"{m}.lora_{x}.weight"][1].astype(np.float64) for x in "AB")
        tag, w = base[n]
        # exact in float64 here: products of f32 factors at rank 4 (the sums are exact
        # enough that a float64 reference rounded once is the ground truth, as in the
        # PEFT fixtures' f64_round_once)
        want = round_f64_to(tag, to_f32(tag, w).astype(np.float64) + scale * (B @ A - B0 @ A0))
        assert np.array_equal(out.read(n).view(np.uint16), want.view(np.uint16)), n


def test_initial_adapter_refuses_a_mismatch(tmp_path: Path) -> None:
    pissa, olora = (ROOT / n for n in NAMES)
    with pytest.raises(AdapterError, match="initial adapter does not match"):
        lorakit.load_adapter(pissa / "adapter", initial_adapter=olora / "initial")
    with pytest.raises(ArgumentError):
        lorakit.fuse(pissa / "base", lorakit.load_adapter(pissa / "converted"),
                     tmp_path / "o", initial_adapter=pissa / "initial", progress=False)


def test_check_names_an_unconverted_pissa_fused_into_the_original_base(tmp_path: Path) -> None:
    """The wrong merge (today's fuse of the saved PiSSA adapter into the original base)
    passed every tensor bound; check now fails it with the cause ``residual-base adapter``
    and passes the converted fuse."""
    fx = ROOT / "llama_pissa_bf16"
    as_plain = tmp_path / "as_plain"  # the adapter with its init forgotten: what a fuse
    shutil.copytree(fx / "adapter", as_plain)  # that never read init_lora_weights did
    cfg = json.loads((as_plain / "adapter_config.json").read_text())
    (as_plain / "adapter_config.json").write_text(json.dumps(dict(cfg, init_lora_weights=True)))
    wrong = lorakit.fuse(fx / "base", as_plain, tmp_path / "wrong", progress=False).output
    rep = lorakit.check(wrong, fx / "base", fx / "adapter", progress=False)
    assert rep.status == "wrong" and rep.exit_code() == 1
    assert rep.causes() == {"adapter_config.json": "residual-base adapter"}
    r = run_cli("check", "--save-path", wrong, "--model", fx / "base",
                "--adapter-path", fx / "adapter")
    assert r.returncode == 1 and "residual-base adapter" in r.stdout
    right = lorakit.fuse(fx / "base", fx / "adapter", tmp_path / "right",
                         initial_adapter=fx / "initial", progress=False).output
    assert lorakit.check(right, fx / "base", fx / "adapter", progress=False,
                         initial_adapter=fx / "initial").ok
    r = run_cli("check", "--save-path", fx / "merged", "--model", fx / "base",
                "--adapter-path", fx / "adapter", "--initial-adapter", fx / "initial")
    assert r.returncode == 0, r.stdout + r.stderr
    assert lorakit.check(fx / "merged", fx / "base", fx / "converted", progress=False).ok
    # and the wrong merge fails against the converted adapter on the tensors themselves
    assert not lorakit.check(wrong, fx / "base", fx / "converted", progress=False).ok


# -- the config allow-list, on configs PEFT wrote -------------------------------------------
def test_unknown_field_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match="unknown PEFT config field") as e:
        lorakit.load_adapter(CONFIGS / "unknown_field")
    assert "lorakit_test_field" in str(e.value)
    r = run_cli("fuse", "--model", BASE, "--adapter-path", CONFIGS / "unknown_field",
                "--save-path", tmp_path / "out", "-q")
    assert r.returncode == 2 and "lorakit_test_field" in r.stderr
    assert not (tmp_path / "out").exists()


def test_fields_at_their_defaults_pass() -> None:
    ad = lorakit.load_adapter(CONFIGS / "future_fields_default")
    ref = lorakit.load_adapter(FX / "peft" / "llama_lora_bf16" / "adapter")
    assert [(t.module, t.scale) for t in ad.targets] == [(t.module, t.scale) for t in ref.targets]


def test_refused_peft_field_names_itself() -> None:
    with pytest.raises(AdapterError, match="megatron_config"):
        lorakit.load_adapter(CONFIGS / "megatron")


@pytest.mark.parametrize("field,value,words", [
    ("init_lora_weights", "corda", "residual-base adapter: init_lora_weights='corda'"),
    ("init_lora_weights", "pissa_niter_4", "init_lora_weights='pissa_niter_4'"),
    ("init_lora_weights", "lora_ga", "init_lora_weights='lora_ga'"),
    ("init_lora_weights", "astra", "residual-base adapter: init_lora_weights='astra'"),
    ("loftq_config", {"loftq_bits": 4, "loftq_iter": 1}, "residual-base adapter: loftq_config"),
    ("init_lora_weights", "kaiming", "unknown init_lora_weights"),
    ("trainable_token_indices", [1, 2], "trainable_token_indices"),
    ("kasa_config", {"beta": 1.0}, "KaSA"),
    ("use_qalora", True, "QA-LoRA"),
    ("lora_bias", True, "LoRA bias"),
])
def test_allow_list_refusals(field, value, words, tmp_path: Path) -> None:
    d = tmp_path / "ad"
    shutil.copytree(CONFIGS / "future_fields_default", d)
    cfg = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps(dict(cfg, **{field: value})))
    with pytest.raises(AdapterError) as e:
        lorakit.load_adapter(d)
    assert words in str(e.value) and field in str(e.value)


@pytest.mark.parametrize("init", [True, False, "gaussian", "eva", "orthogonal", "mica", "nora"])
def test_inits_that_keep_the_base_pass(init, tmp_path: Path) -> None:
    d = tmp_path / "ad"
    shutil.copytree(CONFIGS / "future_fields_default", d)
    cfg = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps(dict(cfg, init_lora_weights=init,
                                                            eva_config={"rho": 2.0})))
    assert len(lorakit.load_adapter(d).targets) == 14
