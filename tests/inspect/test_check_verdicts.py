"""The merge verdict (issue 13): wrong merges are caught with the right cause, correct
merges made by any tool and order pass.

Wrong merges are built here from the embedded data (``data/``): a correct fuse
perturbed, or a fuse of a changed adapter (another scale, other factors, DoRA without
its magnitudes), or a different base. Correct merges: lorakit's four rounding modes,
``mlx_lm fuse`` run for real, every PEFT fixture's ``merge_and_unload`` output,
re-quantized and dequantized 4-bit fuses, dtype conversions.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Callable, Dict, Optional

import numpy as np
import pytest
from helpers import DATA, REPO, missing_modules, run_cli, run_mlx_lm_fuse
from safetensors.numpy import load_file, save_file

import lorakit
from lorakit import numerics as nm
from lorakit.io.formats.checkpoint import Checkpoint
from lorakit.io.formats.safetensors import TensorSpec
from lorakit.io.outputs.safetensors_write import SafetensorsWriter

BASE, BASE_MOE, BASE_Q4 = DATA / "tiny-qwen3", DATA / "tiny-qwen3-moe", DATA / "tiny-qwen3-4bit"
LORA, DORA, EMBED = DATA / "adapters" / "lora", DATA / "adapters" / "dora", \
    DATA / "adapters" / "lora-embed"
MOE, LORA_Q4, PEFT_LORA = DATA / "adapters" / "moe-lora", DATA / "adapters" / "lora-4bit", \
    DATA / "adapters" / "peft-lora"
PEFT_FIXTURES = REPO / "tests" / "fixtures" / "peft"
SQUARE = "model.layers.1.self_attn.q_proj.weight"  # (256, 256) in tiny-qwen3


# -- building wrong merges ----------------------------------------------------------------
def rewrite(src: Path, dst: Path, change: Dict[str, Optional[Callable]] = None,
            add: Dict[str, np.ndarray] = None, dtype: Dict[str, str] = None) -> Path:
    """A copy of checkpoint ``src`` in one file with some tensors changed
    (``change[name](raw) -> raw``; None drops it), added, or re-typed."""
    change, add, dtype = change or {}, add or {}, dtype or {}
    shutil.copytree(src, dst)
    for f in dst.glob("model*.safetensors*"):
        f.unlink()
    ck = Checkpoint(src)
    out = {}
    for n, meta in ck.tensors.items():
        if n in change and change[n] is None:
            continue
        raw = np.asarray(ck.read(n))
        out[n] = (change[n](raw) if n in change else raw, dtype.get(n, meta.dtype))
    for n, raw in add.items():
        out[n] = (raw, "F32")
    plan = [TensorSpec(n, c, tuple(r.shape)) for n, (r, c) in out.items()]
    with SafetensorsWriter(dst / "model.safetensors", plan) as w:
        for p in plan:
            w.write(p.name, out[p.name][0])
    return dst


def adapter_variant(src: Path, dst: Path, *, scale: float = 1.0,
                    tensors: Optional[Callable[[Dict[str, np.ndarray]], Dict]] = None,
                    cfg: Optional[Callable[[dict], None]] = None) -> Path:
    """A copy of an mlx-lm adapter with its scale multiplied and/or tensors changed."""
    shutil.copytree(src, dst)
    c = json.loads((dst / "adapter_config.json").read_text())
    c["lora_parameters"]["scale"] *= scale
    if cfg:
        cfg(c)
    (dst / "adapter_config.json").write_text(json.dumps(c))
    if tensors:
        f = dst / "adapters.safetensors"
        save_file(tensors(load_file(f)), str(f))
    return dst


def other_factors(corr: float, seed: int = 7):
    """Each lora_b replaced by corr * B + sqrt(1 - corr^2) * (seeded noise of B's std):
    another adapter of the same shapes, sharing ``corr`` of the intended delta."""
    def change(t: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        out = {}
        for k, v in t.items():
            if k.endswith("lora_b"):
                noise = rng.standard_normal(v.shape).astype(np.float32) * v.std()
                v = (corr * v + math.sqrt(1 - corr * corr) * noise).astype(np.float32)
            out[k] = v
        return out
    return change


def fuse(base: Path, adapter: Path, out: Path, **kw) -> Path:
    return lorakit.fuse(base, adapter, out, progress=False, **kw).output


def check(fused: Path, base: Path, adapter: Path, **kw):
    return lorakit.check(fused, base, adapter, progress=False, **kw)


def bf16(x: np.ndarray) -> np.ndarray:
    return nm.round_to_format(x, nm.float_format("BF16"))


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("verdicts")


@pytest.fixture(scope="module")
def good(work: Path) -> Dict[str, Path]:
    """Correct nearest fuses of the embedded adapters."""
    return {"lora": fuse(BASE, LORA, work / "good-lora"),
            "dora": fuse(BASE, DORA, work / "good-dora"),
            "embed": fuse(BASE, EMBED, work / "good-embed"),
            "moe": fuse(BASE_MOE, MOE, work / "good-moe"),
            "q4": fuse(BASE_Q4, LORA_Q4, work / "good-q4")}


def causes(rep) -> set:
    return set(rep.causes().values())


# -- the wrong-merge suite ------------------------------------------------------------------
def _wrong_cases(work: Path, good: Dict[str, Path]):
    """name -> (fused, base, adapter, the cause every adapted tensor must get)."""
    r = 8  # the embedded adapters' rank
    cases = {}

    def add(name, fused, base, adapter, cause):
        cases[name] = (fused, base, adapter, cause)

    add("lora not applied", BASE, BASE, LORA, "not applied")
    add("lora applied twice", fuse(good["lora"], LORA, work / "twice"), BASE, LORA,
        "applied twice")
    for k, label in ((2.0, "x2"), (float(r), "alpha not alpha/r"), (math.sqrt(r), "rslora"),
                     (0.5, "x0.5"), (1 / r, "divided by r")):
        ad = adapter_variant(LORA, work / f"ad-{label}", scale=k)
        add(f"lora scale {label}", fuse(BASE, ad, work / f"f-{label}"), BASE, LORA,
            "wrong scale")
    fitted = adapter_variant(LORA, work / "ad-x1.3", scale=1.3)
    add("lora scale x1.3 (fitted)", fuse(BASE, fitted, work / "f-x1.3"), BASE, LORA,
        "wrong scale")
    neg = adapter_variant(LORA, work / "ad-neg", scale=-1.0)
    add("lora subtracted", fuse(BASE, neg, work / "f-neg"), BASE, LORA, "wrong scale")
    for c in (0.0, 0.8, 0.95):
        ad = adapter_variant(LORA, work / f"ad-other-{c}", tensors=other_factors(c))
        add(f"another adapter corr {c}", fuse(BASE, ad, work / f"f-other-{c}"), BASE, LORA,
            "another adapter")
    other_base = rewrite(BASE, work / "other-base", change={
        n: (lambda raw: (raw ^ np.uint16(3)))
        for n in Checkpoint(BASE).tensors if n.endswith("proj.weight")})
    add("lora on a different base", fuse(other_base, LORA, work / "f-other-base"), BASE, LORA,
        "different base")
    # DoRA
    add("dora not applied", BASE, BASE, DORA, "not applied")
    plain = adapter_variant(DORA, work / "ad-dora-plain",
                            tensors=lambda t: {k: v for k, v in t.items() if not k.endswith(".m")},
                            cfg=lambda c: c.update(fine_tune_type="lora"))
    add("dora magnitude missing", fuse(BASE, plain, work / "f-dora-plain"), BASE, DORA,
        "DoRA magnitude missing")
    add("dora applied twice", fuse(good["dora"], DORA, work / "f-dora-twice"), BASE, DORA,
        "applied twice")
    d2 = adapter_variant(DORA, work / "ad-dora-x2", scale=2.0)
    add("dora scale x2", fuse(BASE, d2, work / "f-dora-x2"), BASE, DORA, "wrong scale")
    d13 = adapter_variant(DORA, work / "ad-dora-x1.05", scale=1.05)
    add("dora scale x1.05 (fitted)", fuse(BASE, d13, work / "f-dora-x1.05"), BASE, DORA,
        "wrong scale")
    # embeddings, MoE, 4-bit
    e2 = adapter_variant(EMBED, work / "ad-embed-x2", scale=2.0)
    add("embedding scale x2", fuse(BASE, e2, work / "f-embed-x2"), BASE, EMBED, "wrong scale")
    add("embedding not applied", BASE, BASE, EMBED, "not applied")
    add("moe applied twice", fuse(good["moe"], MOE, work / "f-moe-twice"), BASE_MOE, MOE,
        "applied twice")
    mo = adapter_variant(MOE, work / "ad-moe-other", tensors=other_factors(0.5))
    add("moe another adapter", fuse(BASE_MOE, mo, work / "f-moe-other"), BASE_MOE, MOE,
        "another adapter")
    add("4-bit not applied", BASE_Q4, BASE_Q4, LORA_Q4, "not applied")
    q2 = adapter_variant(LORA_Q4, work / "ad-q4-x2", scale=2.0)
    add("4-bit scale x2", fuse(BASE_Q4, q2, work / "f-q4-x2"), BASE_Q4, LORA_Q4, "wrong scale")
    add("4-bit dequantized, applied twice",
        fuse(fuse(BASE_Q4, LORA_Q4, work / "f-q4-deq", dequantize=True), LORA_Q4,
             work / "f-q4-deq-twice"), BASE_Q4, LORA_Q4, "applied twice")
    return cases


@pytest.fixture(scope="module")
def wrong_cases(work, good):
    return _wrong_cases(work, good)


@pytest.mark.parametrize("case", ["not applied", "wrong scale", "another adapter",
                                  "DoRA magnitude missing"])
def test_wrong_merges_fast(work: Path, case: str) -> None:
    """A few wrong merges cheap enough for the fast tier (the whole suite is slow)."""
    if case == "not applied":
        fused, base, adapter = BASE, BASE, LORA
    elif case == "wrong scale":
        x2 = adapter_variant(LORA, work / "fast-x2", scale=2.0)
        fused, base, adapter = fuse(BASE, x2, work / "fast-f-x2"), BASE, LORA
    elif case == "another adapter":
        other = adapter_variant(LORA, work / "fast-other", tensors=other_factors(0.8))
        fused, base, adapter = fuse(BASE, other, work / "fast-f-other"), BASE, LORA
    else:
        plain = adapter_variant(DORA, work / "fast-plain",
                                tensors=lambda t: {k: v for k, v in t.items()
                                                   if not k.endswith(".m")},
                                cfg=lambda c: c.update(fine_tune_type="lora"))
        fused, base, adapter = fuse(BASE, plain, work / "fast-f-plain"), BASE, DORA
    rep = check(fused, base, adapter, check_untouched=False)
    assert rep.exit_code() == 1 and set(rep.causes().values()) == {case}, str(rep)
    assert len(rep.causes()) == len(rep.rows)


@pytest.mark.slow
def test_wrong_merges_get_their_cause(wrong_cases) -> None:
    """Every adapted tensor of every wrong merge is wrong, with the planted cause."""
    seen = {}
    for name, (fused, base, adapter, cause) in wrong_cases.items():
        rep = check(fused, base, adapter, check_untouched=False)
        adapted = [r for r in rep.rows if r["distance"] is not None or r["verdict"] == "missing"]
        got = {r["verdict"] for r in adapted}
        seen[name] = (rep.status, got)
        assert rep.status == "wrong" and rep.exit_code() == 1, (name, str(rep))
        assert got == {cause}, (name, str(rep))
    assert len(seen) >= 12


@pytest.mark.slow
def test_named_scales_say_what_they_look_like(wrong_cases) -> None:
    expect = {"lora scale x2": "x2", "lora scale alpha not alpha/r": "alpha used as the scale",
              "lora scale rslora": "rsLoRA", "lora subtracted": "subtracted",
              "lora scale x1.3 (fitted)": "x1.3", "lora scale divided by r": "1/r"}
    for name, text in expect.items():
        fused, base, adapter, _ = wrong_cases[name]
        rep = check(fused, base, adapter, check_untouched=False)
        details = {r["detail"] for r in rep.rows}
        assert all(text in d for d in details), (name, details)
    fused, base, adapter, _ = wrong_cases["lora scale x1.3 (fitted)"]
    rep = check(fused, base, adapter, check_untouched=False)
    assert all(r["fit"] == pytest.approx(1.3, rel=1e-3) for r in rep.rows)


@pytest.mark.slow
def test_another_adapter_reports_its_share(wrong_cases) -> None:
    fused, base, adapter, _ = wrong_cases["another adapter corr 0.8"]
    rep = check(fused, base, adapter, check_untouched=False)
    fits = [r["fit"] for r in rep.rows]
    assert 0.6 < min(fits) and max(fits) < 1.0
    assert all(0.6 < r["corr"] < 0.95 for r in rep.rows), [r["corr"] for r in rep.rows]


@pytest.mark.slow
def test_different_base_also_shows_in_untouched(wrong_cases) -> None:
    fused, base, adapter, _ = wrong_cases["lora on a different base"]
    rep = check(fused, base, adapter)
    assert rep.status == "wrong" and rep.summary["untouched tensors changed"] == 0
    assert set(rep.causes().values()) == {"different base"}


def test_one_tensor_wrong(work: Path, good) -> None:
    """One layer changed by a seeded perturbation of its delta: only it is flagged."""
    ck = Checkpoint(BASE)
    W = nm.to_float64(ck.read(SQUARE), nm.float_format("BF16"))
    F = nm.to_float64(Checkpoint(good["lora"]).read(SQUARE), nm.float_format("BF16"))
    rng = np.random.default_rng(3)
    noise = rng.standard_normal(W.shape) * (F - W).std() * 0.1
    bad = rewrite(good["lora"], work / "one-wrong", change={SQUARE: lambda raw: bf16(F + noise)})
    rep = check(bad, BASE, LORA)
    assert rep.causes() == {SQUARE: "changed otherwise"}, str(rep)


def test_transposed(work: Path, good) -> None:
    """The delta added transposed (a square weight), and a weight stored transposed."""
    ad = load_file(str(LORA / "adapters.safetensors"))
    scale = json.loads((LORA / "adapter_config.json").read_text())["lora_parameters"]["scale"]
    module = SQUARE[: -len(".weight")]
    a, b = ad[f"{module}.lora_a"].astype(np.float64), ad[f"{module}.lora_b"].astype(np.float64)
    W = nm.to_float64(Checkpoint(BASE).read(SQUARE), nm.float_format("BF16"))
    dT = scale * (a @ b)  # the delta (scale * (a @ b).T) transposed
    f = rewrite(good["lora"], work / "delta-transposed", change={SQUARE: lambda raw: bf16(W + dT)})
    assert check(f, BASE, LORA).causes() == {SQUARE: "transposed"}
    down = "model.layers.0.mlp.down_proj.weight"
    g = rewrite(good["lora"], work / "stored-transposed",
                change={down: lambda raw: np.ascontiguousarray(raw.T)})
    rep = check(g, BASE, LORA)
    assert rep.causes() == {down: "transposed"}
    assert "stored as" in [r["detail"] for r in rep.rows if r["tensor"] == down][0]


def test_missing_extra_and_untouched(work: Path, good) -> None:
    victim = "model.layers.2.mlp.up_proj.weight"
    f = rewrite(good["lora"], work / "missing", change={victim: None},
                add={"model.layers.0.self_attn.q_proj.lora_a": np.zeros((4, 2), np.float32)})
    rep = check(f, BASE, LORA)
    assert rep.causes() == {victim: "missing",
                            "model.layers.0.self_attn.q_proj.lora_a": "extra tensor"}
    norm = "model.layers.0.input_layernorm.weight"
    g = rewrite(good["lora"], work / "untouched", change={norm: lambda raw: raw ^ np.uint16(1)})
    assert check(g, BASE, LORA).causes() == {norm: "changed without adapter"}


def test_promoted_is_its_own_class(work: Path) -> None:
    f = fuse(BASE, LORA, work / "promoted", dtype="promote")
    rep = check(f, BASE, LORA)
    assert rep.status == "promoted" and rep.exit_code() == 3 and not rep.ok
    assert {r["verdict"] for r in rep.rows} == {"promoted"}
    assert {r["dtype"] for r in rep.rows} == {"BF16->F32"}


def test_one_ulp_off(work: Path, good) -> None:
    """The detection limit: a correct fuse moved by one ulp on a share of its elements.

    One ulp away from the nearest result is beyond what any correct order can land on
    wherever the delta is small next to the weight (the mlx-lm order's extra half ulp
    is of the delta's own spacing), so a 1-ulp shift on 1% of elements is caught; a
    single element moved by one ulp is caught only where it lands outside the bound."""
    raw = np.asarray(Checkpoint(good["lora"]).read(SQUARE))
    rng = np.random.default_rng(5)
    mask = rng.random(raw.shape) < 0.01
    f = rewrite(good["lora"], work / "ulp-off", change={SQUARE: lambda r: r + mask.astype(np.uint16)})
    rep = check(f, BASE, LORA)
    assert rep.status == "wrong" and set(rep.causes()) == {SQUARE}, str(rep)


# -- the correct-merge suite: zero false alarms ---------------------------------------------
@pytest.mark.parametrize("rounding", ["nearest", "round-once", "mlx-lm", "scale-after"])
def test_every_rounding_mode_passes(work: Path, rounding: str) -> None:
    out = fuse(BASE, LORA, work / f"mode-{rounding}", rounding=rounding)
    rep = check(out, BASE, LORA)
    assert rep.status == "ok" and rep.exit_code() == 0, str(rep)
    assert rep.summary["largest distance"] <= 1.0


@pytest.mark.slow
@pytest.mark.parametrize("rounding", ["nearest", "round-once", "mlx-lm", "scale-after"])
@pytest.mark.parametrize("which", ["dora", "embed", "moe", "q4", "q4-deq", "f16", "f32"])
def test_every_mode_on_every_adapter_passes(work: Path, rounding: str, which: str) -> None:
    base, ad, kw = {"dora": (BASE, DORA, {}), "embed": (BASE, EMBED, {}),
                    "moe": (BASE_MOE, MOE, {}), "q4": (BASE_Q4, LORA_Q4, {}),
                    "q4-deq": (BASE_Q4, LORA_Q4, dict(dequantize=True)),
                    "f16": (BASE, LORA, dict(dtype="float16")),
                    "f32": (BASE, DORA, dict(dtype="float32"))}[which]
    out = fuse(base, ad, work / f"all-{which}-{rounding}", rounding=rounding, **kw)
    rep = check(out, base, ad)
    assert rep.status == "ok", str(rep)


def test_conversion_asked_for_is_not_promotion(work: Path) -> None:
    out = fuse(BASE, LORA, work / "as-f16", dtype="float16")
    rep = check(out, BASE, LORA)
    assert rep.status == "ok" and rep.summary["converted to"] == "F16", str(rep)
    assert rep.summary["untouched tensors changed"] == 0


def test_quantized_fuses_pass(good) -> None:
    rep = check(good["q4"], BASE_Q4, LORA_Q4)
    assert rep.status == "ok", str(rep)


PEFT_CASES = sorted(p.name for p in PEFT_FIXTURES.iterdir() if (p / "merged").is_dir())


@pytest.mark.parametrize("name", PEFT_CASES)
def test_peft_merge_and_unload_passes(name: str) -> None:
    fx = PEFT_FIXTURES / name
    rep = check(fx / "merged", fx / "base", fx / "adapter")
    assert rep.status == "ok", str(rep)


@pytest.mark.slow
@pytest.mark.skipif(bool(missing_modules("mlx_lm")), reason="mlx-lm not installed")
@pytest.mark.parametrize("which", ["lora", "dora", "embed", "q4", "q4-deq"])
def test_mlx_lm_fuse_passes(tmp_path: Path, which: str) -> None:
    """mlx-lm's own fuse, run for real: right everywhere; its DoRA fuse writes float32
    (a known mlx-lm defect), which is the promoted class."""
    base, ad, extra = {"lora": (BASE, LORA, ()), "dora": (BASE, DORA, ()),
                       "embed": (BASE, EMBED, ()), "q4": (BASE_Q4, LORA_Q4, ()),
                       "q4-deq": (BASE_Q4, LORA_Q4, ("--dequantize",))}[which]
    out = tmp_path / "mlx"
    run_mlx_lm_fuse(base, ad, out, *extra)
    rep = check(out, base, ad)
    want = "promoted" if which == "dora" else "ok"
    assert rep.status == want, str(rep)
    # and its folder: the tokenizer re-saved by transformers 5 is the same tokenizer
    assert rep.files is not None and rep.files.rows == [], str(rep.files)


# -- the CLI's exit codes --------------------------------------------------------------------
@pytest.mark.slow
def test_cli_exit_codes(work: Path, good) -> None:
    ok = run_cli("check", "--save-path", good["lora"], "--model", BASE, "--adapter-path", LORA)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = run_cli("check", "--save-path", BASE, "--model", BASE, "--adapter-path", LORA)
    assert bad.returncode == 1 and "not applied" in bad.stdout
    prom = fuse(BASE, LORA, work / "cli-promoted", dtype="promote")
    p = run_cli("check", "--save-path", prom, "--model", BASE, "--adapter-path", LORA, "--json")
    assert p.returncode == 3 and json.loads(p.stdout)["check"]["summary"]["exit code"] == 3
    missing = run_cli("check", "--save-path", work / "nope", "--model", BASE, "--adapter-path", LORA)
    assert missing.returncode == 2
    h = run_cli("check", "--help")
    assert all(s in h.stdout for s in ("0 ", "1 ", "3 ", "2 "))


# -- docs/check.md's detection-limit claims, against the committed benchmark JSON -----------
def test_readme_claims_match_benchmark_json() -> None:
    """docs/check.md quotes benchmarks/results/merge_verdict.json
    (``python benchmarks/merge_verdict.py --json benchmarks/results/merge_verdict.json``)."""
    res = json.loads((REPO / "benchmarks" / "results" / "merge_verdict.json").read_text())
    readme = (REPO / "docs" / "check.md").read_text()
    assert "python benchmarks/merge_verdict.py --json benchmarks/results/merge_verdict.json" \
        in readme
    cases = res["cases"]
    lora, dora, q4 = cases["lora (bf16)"], cases["dora (bf16)"], cases["lora (4-bit base)"]
    # no false alarm, and the largest distances quoted
    for c in cases.values():
        assert all(v["status"] == "ok" for v in c["correct"].values())
    top = {n: max(v["largest distance"] for v in c["correct"].values()) for n, c in cases.items()}
    text = " ".join(readme.split())
    assert (f"largest distance {top['lora (bf16)']:.2g} for LoRA, {top['dora (bf16)']:.2g} "
            f"for DoRA, {top['lora (4-bit base)']:.2g} on the 4-bit base").replace("1 for", "1.0 for") \
        in text
    def caught(c, key):
        v = c["scale"][key]
        return v["tensors flagged"], v["tensors"]
    for k in ("x0.998", "x1.002"):  # 0.2% off, nearest order: every tensor
        f, n = caught(lora, f"{k} nearest")
        assert f == n
    for k in ("x0.999", "x1.001"):  # 0.1% off in mlx-lm's order
        f, n = caught(lora, f"{k} mlx-lm")
        assert f == n
    for k in ("x0.9", "x1.1", "x0.95"):  # 4-bit: 10% off caught everywhere, x0.95 too
        for mode in ("nearest", "mlx-lm"):
            f, n = caught(q4, f"{k} {mode}")
            assert f == n
    assert caught(q4, "x1.05 nearest")[0] == 0  # ... x1.05 not: the stated limit
    flips = lora["ulp flips"]
    assert flips["0.01 of elements +1 ulp"]["tensors flagged"] == 28
    assert flips["1e-05 of elements +1 ulp"]["tensors flagged"] == 12
    assert "to 0.001% of\nthem on 12 of 28" in readme
    assert all(v["status"] == "ok" for v in dora["ulp flips"].values())
    edge = sorted(caught(dora, f"{k} nearest")[0] for k in ("x0.998", "x1.002"))
    assert f"is caught on {edge[0]} or {edge[1]} of 28 tensors (0.5% off: all 28)" in text
    assert all(caught(dora, f"{k} nearest")[0] == 28 for k in ("x0.995", "x1.005"))
    norm = json.loads((REPO / "benchmarks" / "results" / "dora_norm.json").read_text())["rows"]
    over = [r["share_over_one"] for r in norm]
    assert (f"up to {max(r['max_half_ulps'] for r in norm):.3g} half-ulps off, "
            f"{100 * min(over):.0f}-{100 * max(over):.0f}% of rows past one") in text
    top = max(r["max_over_allowance"] for r in norm)
    assert top < 1 and f"{top:.2f} of its allowance at most" in text
