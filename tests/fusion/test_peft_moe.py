"""PEFT ``target_parameters`` adapters: LoRA on transformers 5's fused 3-D expert
parameters, from the real PEFT 0.22 + transformers 5 (tests/fixtures/make_peft_moe_fixtures.py).
Read, fused bit-identical to PEFT's ``merge_and_unload()`` in round-once into each layout a
base has (transformers' fused experts, its per-expert tensors, mlx-lm's stacked
switch_mlp), converted to mlx-lm and back to PEFT, and checked one expert at a time: a
fuse that drops one expert's delta fails naming that expert. No torch needed."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import missing_modules, run_cli, run_mlx_lm_fuse

import lorakit
from lorakit import numerics as nm
from lorakit.algebra import convert
from lorakit.errors import AdapterError
from lorakit.io.adapters.base import AdapterTensors
from lorakit.io.formats.checkpoint import Checkpoint
from lorakit.io.formats.safetensors import TensorSpec
from lorakit.io.outputs.safetensors_write import SafetensorsWriter

FX = Path(__file__).resolve().parents[1] / "fixtures" / "peft" / "moe" / "qwen3_moe_params_bf16"
AD = FX / "adapter"
DATA = Path(__file__).resolve().parents[2] / "data"
GATE_UP = "model.layers.0.mlp.experts.gate_up_proj"


def _write(dst: Path, like: Path, tensors: dict) -> Path:
    """A checkpoint in ``dst``: ``like``'s config, ``tensors`` (name -> (raw, code))."""
    dst.mkdir(parents=True)
    shutil.copy(like / "config.json", dst / "config.json")
    plan = [TensorSpec(n, c, tuple(r.shape)) for n, (r, c) in tensors.items()]
    with SafetensorsWriter(dst / "model.safetensors", plan) as w:
        for p in plan:
            w.write(p.name, tensors[p.name][0])
    return dst


def _raw(path: Path) -> dict:
    ck = Checkpoint(path)
    return {n: (np.array(ck.read(n)), ck.info(n).dtype) for n in ck.tensors}


def stacked(src: Path, dst: Path) -> Path:
    """``src`` (per-expert tensors) in mlx-lm's layout, as its qwen3_moe sanitize() stacks
    them: ``mlp.switch_mlp.<proj>.weight`` (experts, out, in)."""
    t = _raw(src)
    out = {n: v for n, v in t.items() if ".experts." not in n}
    for n in [n for n in t if ".experts.0." in n]:
        head, tail = n.split(".experts.0.")
        k = 0
        parts = []
        while f"{head}.experts.{k}.{tail}" in t:
            parts.append(t.pop(f"{head}.experts.{k}.{tail}")[0])
            k += 1
        out[f"{head}.switch_mlp.{tail}"] = (np.stack(parts), "BF16")
    return _write(dst, src, out)


def differing(a: Path, b: Path) -> dict:
    x, y = _raw(a), _raw(b)
    assert set(x) == set(y)
    return {n: int((x[n][0] != y[n][0]).sum()) for n in x if not np.array_equal(x[n][0], y[n][0])}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict:
    """layout -> (base, PEFT's merged model in that layout)."""
    work = tmp_path_factory.mktemp("moe")
    return {"transformers fused": (FX / "base_fused", FX / "merged_fused"),
            "per-expert": (FX / "base", FX / "merged"),
            "mlx-lm stacked": (stacked(FX / "base", work / "base_st"),
                               stacked(FX / "merged", work / "merged_st"))}


def test_read_as_peft_lays_it_out() -> None:
    """A (experts*r, in) expert-major, B (out, r*experts) rank-major, as ParamWrapper's
    get_delta_weight reshapes them; the nested wrapper (base_layer) is gate_up_proj."""
    ad = lorakit.load_adapter(AD)
    t = {x.module: x for x in ad.targets}
    g, d = t[GATE_UP], t["model.layers.0.mlp.experts.down_proj"]
    assert (g.kind, g.shape, d.shape, g.scale, g.round_delta) == \
        ("switch", (4, 32, 32), (4, 32, 16), 2.0, True)
    ts = AdapterTensors(AD / "adapter_model.safetensors")
    A = ts.read_f32("base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight")
    B = ts.read_f32("base_model.model.model.layers.0.mlp.experts.base_layer.lora_B.weight")
    e, k = 2, 3
    assert np.array_equal(g.A[e, k], A[e * 4 + k]) and np.array_equal(g.B[e][:, k], B[:, k * 4 + e])


@pytest.mark.parametrize("layout", ["transformers fused", "per-expert", "mlx-lm stacked"])
def test_round_once_is_peft_merge_and_unload_bit_for_bit(layouts, layout, tmp_path: Path) -> None:
    base, merged = layouts[layout]
    res = lorakit.fuse(base, AD, tmp_path / "out", rounding="round-once", progress=False)
    assert res.tensors_fused == {"transformers fused": 6, "per-expert": 26,
                                 "mlx-lm stacked": 8}[layout]
    assert differing(res.output, merged) == {}
    assert differing(base, merged)  # the merge changed something to be right about


@pytest.mark.parametrize("rounding", ["nearest", "round-once", "mlx-lm", "scale-after"])
@pytest.mark.parametrize("layout", ["transformers fused", "per-expert", "mlx-lm stacked"])
def test_every_rounding_in_every_layout_checks_ok(layouts, layout, rounding, tmp_path) -> None:
    base, _ = layouts[layout]
    out = lorakit.fuse(base, AD, tmp_path / "out", rounding=rounding, progress=False).output
    rep = lorakit.check(out, base, AD, progress=False)
    assert rep.status == "ok", str(rep)


def test_nearest_is_the_exact_delta_rounded_once(tmp_path: Path) -> None:
    out = lorakit.fuse(FX / "base_fused", AD, tmp_path / "out", progress=False).output
    t = next(x for x in lorakit.load_adapter(AD).targets if x.module == GATE_UP)
    fmt = nm.float_format("BF16")
    W = nm.to_float64(Checkpoint(FX / "base_fused").read(GATE_UP), fmt)
    want = nm.round_to_format(W + t.scale * (t.B.astype(np.float64) @ t.A.astype(np.float64)), fmt)
    assert np.array_equal(Checkpoint(out).read(GATE_UP), want)
    # PEFT rounds the delta first: round-once and nearest differ, so the test can tell
    assert differing(out, FX / "merged_fused")


@pytest.mark.parametrize("layout", ["transformers fused", "per-expert", "mlx-lm stacked"])
def test_check_passes_peft_merge_one_row_per_expert(layouts, layout) -> None:
    base, merged = layouts[layout]
    rep = lorakit.check(merged, base, AD, progress=False)
    assert rep.status == "ok", str(rep)
    names = [r["tensor"] for r in rep.rows if r["verdict"] == "ok"]
    assert len(names) == {"transformers fused": 18, "per-expert": 26, "mlx-lm stacked": 26}[layout]


@pytest.mark.parametrize("layout,dropped", [
    ("transformers fused", [f"{GATE_UP}[2]"]),
    ("per-expert", ["model.layers.0.mlp.experts.2.gate_proj.weight",
                    "model.layers.0.mlp.experts.2.up_proj.weight"]),
    ("mlx-lm stacked", ["model.layers.0.mlp.switch_mlp.gate_proj.weight[2]",
                        "model.layers.0.mlp.switch_mlp.up_proj.weight[2]"])])
def test_one_expert_dropped_fails_naming_that_expert(layouts, layout, dropped, tmp_path) -> None:
    """The negative control: PEFT's merge with expert 2's gate/up delta undone (that
    expert left as the base) fails, naming exactly that expert, untouched."""
    base, merged = layouts[layout]
    b, m = _raw(base), _raw(merged)
    for name in dropped:
        n, _, e = name.partition("[")
        if e:
            m[n][0][int(e[:-1])] = b[n][0][int(e[:-1])]
        else:
            m[n] = b[n]
    bad = _write(tmp_path / "bad", merged, m)
    rep = lorakit.check(bad, base, AD, progress=False)
    assert rep.status == "wrong" and rep.exit_code() == 1
    assert rep.causes() == {n: "not applied" for n in dropped}, str(rep)


def test_convert_to_peft_is_the_same_adapter_and_to_mlx_lm_fuses_the_same(tmp_path) -> None:
    peft = convert(AD, tmp_path / "peft", to="peft")
    cfg = json.loads((peft / "adapter_config.json").read_text())
    assert cfg["target_parameters"] == sorted(
        f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1) for p in ("down_proj", "gate_up_proj"))
    ours, theirs = (AdapterTensors(d / "adapter_model.safetensors") for d in (peft, AD))
    assert sorted(ours.names) == sorted(theirs.names)
    assert all(np.array_equal(ours.read_raw(n)[0], theirs.read_raw(n)[0]) for n in ours.names)
    mlx = convert(AD, tmp_path / "mlx", to="mlx-lm")
    ad = lorakit.load_adapter(mlx)
    assert {t.module: (t.kind, t.A.shape, t.B.shape) for t in ad.targets
            if "layers.0.mlp" in t.module} == {
        f"model.layers.0.mlp.switch_mlp.{p}": ("switch", (4, 4, i), (4, o, 4))
        for p, i, o in (("gate_proj", 32, 16), ("up_proj", 32, 16), ("down_proj", 16, 32))}
    back = convert(mlx, tmp_path / "back", to="peft")  # mlx-lm's experts: per-expert modules
    ref = lorakit.fuse(FX / "base", AD, tmp_path / "ref", progress=False).output
    for ad in (mlx, back):
        out = lorakit.fuse(FX / "base", ad, tmp_path / "o", force=True, progress=False).output
        assert differing(out, ref) == {}, ad


def test_transposed_experts_refused_by_name(tmp_path: Path) -> None:
    """gpt-oss keeps its experts (experts, in, out): PEFT adds the delta transposed there."""
    base = shutil.copytree(FX / "base_fused", tmp_path / "gptoss")
    cfg = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps(dict(cfg, model_type="gpt_oss")))
    with pytest.raises(AdapterError, match="gpt_oss stores its experts"):
        lorakit.fuse(base, AD, tmp_path / "out", progress=False)
    r = run_cli("fuse", "--model", base, "--adapter-path", AD, "--save-path", tmp_path / "o2", "-q")
    assert r.returncode == 2 and "gpt_oss" in r.stderr and not (tmp_path / "o2").exists()


def test_bad_target_parameters_refused_by_name(tmp_path: Path) -> None:
    d = shutil.copytree(AD, tmp_path / "ad")
    cfg = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps(dict(cfg, target_parameters="experts")))
    with pytest.raises(AdapterError, match="target_parameters must be a list"):
        lorakit.load_adapter(d)


@pytest.mark.parametrize("names", [["gate_up_proj", "down_proj"],
                                   ["model.layers.0.mlp.experts.gate_up_proj",
                                    "model.layers.0.mlp.experts.down_proj",
                                    "model.layers.1.mlp.experts.gate_up_proj",
                                    "model.layers.1.mlp.experts.down_proj"]])
def test_target_parameters_match_as_peft_matches_them(names, tmp_path: Path) -> None:
    """A bare parameter name or a full path matches as PEFT's ``key.endswith`` does."""
    d = shutil.copytree(AD, tmp_path / "ad")
    cfg = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps(dict(cfg, target_parameters=names)))
    ours, ref = lorakit.load_adapter(d), lorakit.load_adapter(AD)
    assert [(t.module, t.shape) for t in ours.targets] == [(t.module, t.shape) for t in ref.targets]


def test_tensors_of_a_parameter_not_targeted_are_refused(tmp_path: Path) -> None:
    """Only down_proj in target_parameters: the gate_up_proj LoRA (under base_layer) has
    no parameter PEFT would wrap, and is refused by name."""
    d = shutil.copytree(AD, tmp_path / "ad")
    cfg = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps(dict(cfg, target_parameters=["down_proj"])))
    with pytest.raises(AdapterError, match=r"experts\.base_layer\.lora_A\.weight: PEFT puts no"):
        lorakit.load_adapter(d)


@pytest.mark.skipif(bool(missing_modules("mlx_lm")), reason="mlx-lm not installed")
def test_mlx_lm_fuses_the_converted_adapter_as_lorakit_does(tmp_path: Path) -> None:
    """mlx-lm itself loads the converted adapter into its LoRASwitchLinear layers; its fuse
    equals lorakit's ``--rounding mlx-lm`` of the PEFT adapter bit for bit, and passes."""
    base = shutil.copytree(FX / "base", tmp_path / "base")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(DATA / "tiny-qwen3-moe" / f, base / f)
    cfg = json.loads((base / "config.json").read_text())  # mlx-lm reads transformers 4 keys
    cfg.update(num_experts=cfg["num_local_experts"],
               rope_theta=cfg["rope_parameters"]["rope_theta"])
    (base / "config.json").write_text(json.dumps(cfg))
    run_mlx_lm_fuse(base, convert(AD, tmp_path / "mlx", to="mlx-lm"), tmp_path / "theirs")
    st = stacked(base, tmp_path / "stacked")
    ours = lorakit.fuse(st, AD, tmp_path / "ours", rounding="mlx-lm", progress=False).output
    assert differing(ours, tmp_path / "theirs") == {}
    assert lorakit.check(tmp_path / "theirs", st, AD, progress=False).status == "ok"


def test_one_expert_wrong_is_named_with_its_cause(tmp_path: Path) -> None:
    """Expert 1 of one fused weight given twice its delta: that expert alone is wrong,
    ``wrong scale`` x2; the untouched and the right experts are not flagged."""
    fmt = nm.float_format("BF16")
    b, m = _raw(FX / "base_fused"), _raw(FX / "merged_fused")
    W, F = (nm.to_float64(x[GATE_UP][0][1], fmt) for x in (b, m))
    t = next(x for x in lorakit.load_adapter(AD).targets if x.module == GATE_UP)
    delta = t.scale * (t.B[1].astype(np.float64) @ t.A[1].astype(np.float64))
    m[GATE_UP][0][1] = nm.round_to_format(W + 2 * delta, fmt)
    assert not np.array_equal(W, F)
    rep = lorakit.check(_write(tmp_path / "bad", FX / "merged_fused", m), FX / "base_fused", AD,
                        progress=False)
    assert rep.causes() == {f"{GATE_UP}[1]": "wrong scale"}, str(rep)
    assert "x2" in next(r["detail"] for r in rep.rows if r["tensor"] == f"{GATE_UP}[1]")


def test_delta_norms_weigh_gate_up_against_both_halves() -> None:
    """gate_up_proj's weight norm is the same whether the base holds it fused or as its
    per-expert gate_proj and up_proj tensors."""
    from lorakit.inspect import delta_norms

    fused, split = (delta_norms(AD, FX / b) for b in ("base_fused", "base"))
    w = {(r["module"], r["expert"]): r["w_fro"] for r in fused.rows}
    assert len(w) == 18 and all(w[(r["module"], r["expert"])] == pytest.approx(r["w_fro"], 1e-12)
                                for r in split.rows)


def test_mlx_lm_experts_to_target_parameters_and_onto_fused_experts(tmp_path: Path) -> None:
    """mlx-lm's LoRASwitchLinear experts written as PEFT ``target_parameters``
    (``experts="parameters"``: gate_proj and up_proj as one gate_up_proj of rank 2r, B
    block-diagonal) fuse as the original does, on mlx-lm's stacked base and on
    transformers' fused one; the embedded MoE adapter too."""
    mlx = convert(AD, tmp_path / "mlx", to="mlx-lm")
    peft = convert(mlx, tmp_path / "peft", to="peft", experts="parameters")
    t = {x.module: x for x in lorakit.load_adapter(peft).targets}
    assert (t[GATE_UP].rank, t["model.layers.0.mlp.experts.down_proj"].rank) == (8, 4)
    for base in (FX / "base_fused", FX / "base"):
        ref = lorakit.fuse(base, AD, tmp_path / f"ref-{base.name}", progress=False).output
        for ad in (mlx, peft):
            out = lorakit.fuse(base, ad, tmp_path / "o", force=True, progress=False).output
            assert differing(out, ref) == {}, (base, ad)
            assert lorakit.check(out, base, ad, progress=False).status == "ok"
    moe, base = DATA / "adapters" / "moe-lora", DATA / "tiny-qwen3-moe"
    params = convert(moe, tmp_path / "moe-p", to="peft", experts="parameters")
    assert json.loads((params / "adapter_config.json").read_text())["target_parameters"]
    a = lorakit.fuse(base, moe, tmp_path / "a", progress=False).output
    b = lorakit.fuse(base, params, tmp_path / "b", progress=False).output
    assert differing(a, b) == {}
    with pytest.raises(lorakit.errors.ArgumentError, match="experts"):
        convert(moe, tmp_path / "bad", to="peft", experts="fused")


def test_experts_parameters_cli_and_refusal_of_what_it_cannot_hold(tmp_path: Path) -> None:
    """``lorakit convert --experts parameters``; experts it cannot join (a stack with an
    expert missing stays per-expert) are refused by name, nothing written."""
    from dataclasses import replace

    from lorakit.io.adapters.write import save_adapter

    moe = DATA / "adapters" / "moe-lora"
    r = run_cli("convert", moe, "--to", "peft", "--experts", "parameters", "--save-path",
                tmp_path / "p")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "p" / "adapter_config.json").read_text())["target_parameters"]
    per = lorakit.load_adapter(convert(moe, tmp_path / "m", to="peft"))  # per-expert modules
    gone = "model.layers.1.mlp.experts.2.gate_proj"
    assert gone in {t.module for t in per.targets}
    holed = replace(per, targets=[t for t in per.targets if t.module != gone])
    with pytest.raises(AdapterError, match="does not hold as fused") as e:
        save_adapter(holed, tmp_path / "x", format="peft", experts="parameters")
    assert "model.layers.1.mlp.experts." in str(e.value) and not (tmp_path / "x").exists()
