"""Combining adapters: every method against an independent float64 computation here."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from lorakit.algebra.combine import combine, convert
from lorakit.errors import ArgumentError, LorakitError
from lorakit.io.adapters.load import load_adapter

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data"
LORA, EMB, DORA = DATA / "adapters" / "lora", DATA / "adapters" / "lora-embed", \
    DATA / "adapters" / "dora"
sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
from make_peft_fixtures import read_safetensors  # noqa: E402  (numpy-only reader)


def _f64_delta(t):
    """scale * B @ A in float64, computed here from the loaded factors."""
    return float(t.scale) * (t.B.astype(np.float64) @ t.A.astype(np.float64))


def _exact_sum(paths, weights):
    out = {}
    for p, w in zip(paths, weights):
        for t in load_adapter(p).targets:
            out[t.module] = out.get(t.module, 0.0) + w * _f64_delta(t)
    return out


def _bf16(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _checkpoint(path):
    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(read_safetensors(f))
    return out


def _not_nearest(fused_dir, paths, w):
    """(elements farther than 0.5 ulp from the float64 sum, elements checked); untouched
    tensors must keep their bits."""
    base, fused = _checkpoint(DATA / "tiny-qwen3"), _checkpoint(fused_dir)
    want = _exact_sum(paths, w)
    bad = checked = 0
    for name, (code, raw) in base.items():
        module = name[: -len(".weight")]
        fcode, fraw = fused[name]
        if module not in want:
            assert np.array_equal(raw, fraw), name  # untouched: the same bits
            continue
        assert code == fcode == "BF16"
        exact = _bf16(raw) + want[module]
        got = _bf16(fraw)
        up, down = _bf16(fraw + np.uint16(1)), _bf16(fraw - np.uint16(1))
        # a neighbour by bits of +-0 can be a NaN: then it is no competitor
        up, down = np.where(np.isnan(up), np.inf, up), np.where(np.isnan(down), np.inf, down)
        # nearest: no neighbour of the fused value is closer to the exact one
        err = np.abs(got - exact)
        ok = (err <= np.abs(up - exact)) & (err <= np.abs(down - exact))
        ok &= err <= 0.5 * np.fmax(np.abs(up - got), np.abs(down - got))
        bad += int((~ok).sum())
        checked += got.size
    return bad, checked


def test_exact_fuse_of_several_adapters_is_correctly_rounded(tmp_path):
    import lorakit

    paths, w = [LORA, EMB, LORA], [0.7, -0.3, 0.25]
    assert len(_exact_sum(paths, w)) == 29
    rep = combine(paths, w)
    lorakit.fuse(DATA / "tiny-qwen3", rep.adapter, tmp_path / "f", progress=False)
    bad, checked = _not_nearest(tmp_path / "f", paths, w)
    assert bad == 0 and checked > 100_000
    # the check can fail: mlx-lm's float32 order on the stored cat adapter misses it
    cat = combine(paths, w, method="cat")
    lorakit.fuse(DATA / "tiny-qwen3", cat.adapter, tmp_path / "m", rounding="mlx-lm",
                 progress=False)
    assert _not_nearest(tmp_path / "m", paths, w)[0] > 0


def test_exact_combination_is_the_weighted_sum_and_deterministic():
    paths, w = [LORA, EMB], [1.5, -0.5]
    want = _exact_sum(paths, w)
    a, b = combine(paths, w), combine(paths, w)
    for t, u in zip(a.adapter.targets, b.adapter.targets):
        assert np.array_equal(t.A, u.A) and np.array_equal(t.B, u.B)
        got = (t.B.astype(np.float64) * np.asarray(t.scale)) @ t.A.astype(np.float64)
        # f64 evaluation order only: 1e-12 of the largest element (cancellation)
        np.testing.assert_allclose(got, want[t.module], rtol=0,
                                   atol=1e-12 * np.abs(want[t.module]).max())


def test_cat_fold_is_exact_for_power_of_two_weights_and_measured_otherwise(tmp_path):
    rep = combine([LORA, EMB], [0.5, -2.0], method="cat")
    assert max(rep.column("fold_rel_err")) == 0.0
    back = load_adapter(rep.save(tmp_path / "c", format="peft"))
    want = _exact_sum([LORA, EMB], [0.5, -2.0])
    for t in back.targets:  # the saved adapter's delta is the exact sum, bit for bit
        assert np.array_equal(float(t.scale) * t.B.astype(np.float64),
                              _stacked_scaled_B(t.module, [LORA, EMB], [0.5, -2.0]))
        np.testing.assert_allclose(_f64_delta(t), want[t.module], rtol=0,
                                   atol=1e-12 * np.abs(want[t.module]).max())
    rep = combine([LORA, EMB], [0.7, 0.3], method="cat")
    errs = rep.column("fold_rel_err")
    assert 0 < max(errs) <= 2.0 ** -24


def _stacked_scaled_B(module, paths, w):
    cols = []
    for p, wi in zip(paths, w):
        t = {t.module: t for t in load_adapter(p).targets}.get(module)
        if t is not None:
            cols.append(wi * float(t.scale) * t.B.astype(np.float64))
    return np.concatenate(cols, axis=-1)


@pytest.mark.slow
def test_svd_truncation_error_is_reported_and_vanishes_at_full_rank():
    paths, w = [LORA, EMB], [0.7, 0.3]
    want = _exact_sum(paths, w)
    prev = None
    for r in (2, 8, 16):
        rep = combine(paths, w, method="svd", rank=r)
        for t, row in list(zip(rep.adapter.targets, rep.rows))[-4:]:  # the embedding too
            D = want[t.module]
            s = np.linalg.svd(D, compute_uv=False)
            theory = np.sqrt(np.sum(s[r:] ** 2)) / np.linalg.norm(D)
            measured = np.linalg.norm(D - _f64_delta(t)) / np.linalg.norm(D)
            assert row["trunc_rel_err"] == pytest.approx(measured, rel=1e-9, abs=1e-12)
            assert measured == pytest.approx(theory, rel=1e-3, abs=1e-6)
        worst = rep.summary["worst_trunc_rel_err"]
        assert prev is None or worst < prev
        prev = worst
    assert prev < 1e-6  # rank 16 = 8 + 8 holds the whole sum


def test_linear_is_peft_definition_with_cross_terms():
    paths, w = [LORA, EMB], [0.7, -0.3]
    rep = combine(paths, w, method="linear")
    a = {t.module: t for t in load_adapter(LORA).targets}
    b = {t.module: t for t in load_adapter(EMB).targets}
    module = "model.layers.1.self_attn.q_proj"
    ta, tb, got = a[module], b[module], {t.module: t for t in rep.adapter.targets}[module]
    wa, wb = 0.7 * ta.scale, -0.3 * tb.scale
    A = np.sqrt(abs(wa)) * ta.A.astype(np.float64) - np.sqrt(abs(wb)) * tb.A.astype(np.float64)
    B = np.sqrt(abs(wa)) * ta.B.astype(np.float64) + np.sqrt(abs(wb)) * tb.B.astype(np.float64)
    assert np.array_equal(got.A, A.astype(np.float32)) and np.array_equal(got.B, B.astype(np.float32))
    assert got.scale == 1.0
    exact = _exact_sum(paths, w)[module]
    cross = np.linalg.norm(_f64_delta(got) - exact) / np.linalg.norm(exact)
    assert cross > 0.1  # the cross terms B_i A_j are not small


def test_magnitude_prune_and_ties_by_hand():
    from lorakit.algebra.peft_like import merge

    x = [np.array([3.0, -1.0, 0.5, -4.0], np.float32), np.array([-2.0, 2.0, 1.0, 1.0], np.float32)]
    # density 0.5: keep the 2 largest |x| of each: [3, 0, 0, -4] and [-2, 2, 0, 0]
    assert merge("magnitude_prune", x, [1.0, 0.5], density=0.5).tolist() == [2.0, 1.0, 0.0, -4.0]
    # ties: elected sign of the pruned sum [1, 2, 0, -4] -> [+, +, +, -]; keep agreeing values
    assert merge("ties", x, [1.0, 0.5], density=0.5).tolist() == [3.0, 1.0, 0.0, -4.0]
    assert merge("linear", x, [1.0, -1.0]).tolist() == [5.0, -3.0, -0.5, -5.0]


def test_dare_needs_a_seed_and_repeats_with_it():
    with pytest.raises(ArgumentError, match="seed"):
        combine([LORA, EMB], [0.5, 0.5], method="dare_linear", density=0.5)
    a = combine([LORA, EMB], [0.5, 0.5], method="dare_ties", density=0.5, seed=3)
    b = combine([LORA, EMB], [0.5, 0.5], method="dare_ties", density=0.5, seed=3)
    c = combine([LORA, EMB], [0.5, 0.5], method="dare_ties", density=0.5, seed=4)
    assert all(np.array_equal(t.A, u.A) for t, u in zip(a.adapter.targets, b.adapter.targets))
    assert not all(np.array_equal(t.A, u.A) for t, u in zip(a.adapter.targets, c.adapter.targets))


def test_refusals():
    with pytest.raises(LorakitError, match="DoRA"):  # exact: fused only (test_combine_dora)
        combine([LORA, DORA], [1, 1], method="cat")
    with pytest.raises(ArgumentError, match="weights(.|\\n)*one per adapter"):
        combine([LORA, EMB], [1.0])
    with pytest.raises(ArgumentError, match="density"):
        combine([LORA, EMB], [1, 1], method="ties")


@pytest.mark.slow  # three fuses through the CLI
def test_cli_second_adapter_path_is_not_dropped(tmp_path, capsys):
    from lorakit.cli.main import main

    base = str(DATA / "tiny-qwen3")
    assert main(["fuse", "--model", base, "--adapter-path", str(LORA), "--save-path",
                 str(tmp_path / "one"), "-q"]) == 0
    assert main(["fuse", "--model", base, "--adapter-path", str(LORA), "--adapter-path",
                 str(EMB), "--weights", "1,0", "--save-path", str(tmp_path / "w10"), "-q"]) == 0
    assert main(["fuse", "--model", base, "--adapter-path", str(LORA), "--adapter-path",
                 str(EMB), "--save-path", str(tmp_path / "both"), "-q"]) == 0
    one, w10, both = (_checkpoint(tmp_path / n) for n in ("one", "w10", "both"))
    # weight 0 on the second: the first alone, bit for bit; weight 1: the embedding changes
    assert all(np.array_equal(one[k][1], w10[k][1]) for k in one)
    assert not np.array_equal(one["model.embed_tokens.weight"][1],
                              both["model.embed_tokens.weight"][1])
    assert main(["fuse", "--model", base, "--adapter-path", str(LORA), "--adapter-path",
                 str(EMB), "--rounding", "mlx-lm", "--save-path", str(tmp_path / "x"),
                 "-q"]) == 2
    assert not (tmp_path / "x").exists()


def test_cli_convert_and_combine(tmp_path, capsys):
    from lorakit.cli.main import main

    assert main(["convert", str(LORA), "--to", "peft", "--save-path", str(tmp_path / "p")]) == 0
    assert main(["convert", str(tmp_path / "p"), "--to", "mlx-lm", "--save-path",
                 str(tmp_path / "m")]) == 0
    src, back = load_adapter(LORA), load_adapter(tmp_path / "m")
    sb = {t.module: t for t in back.targets}
    for t in src.targets:
        assert np.array_equal(t.A, sb[t.module].A) and np.array_equal(t.B, sb[t.module].B)
    assert main(["combine", "--adapter-path", str(LORA), "--adapter-path", str(tmp_path / "p"),
                 "--weights", "0.5,0.5", "--method", "svd", "--rank", "8", "--format", "peft",
                 "--save-path", str(tmp_path / "c"), "--json"]) == 0
    c = load_adapter(tmp_path / "c")
    assert c.format == "peft" and {t.rank for t in c.targets} == {8}
    d = convert(tmp_path / "c", tmp_path / "cm", to="mlx-lm")
    assert load_adapter(d).format == "mlx-lm"


def test_compare_adapters_reads_combinations(tmp_path):
    from lorakit.inspect.adapters import compare_adapters

    rep = combine([LORA, LORA], [0.5, 0.5], method="exact")
    cmp_ = compare_adapters(LORA, rep.save(tmp_path / "half-half", format="mlx-lm"))
    assert len(cmp_.rows) == 28
    assert "lora" in str(cmp_)


@pytest.mark.slow  # five commands, one a fuse
def test_readme_algebra_commands_run(tmp_path, monkeypatch, capsys):
    import re

    from lorakit.cli.main import main

    text = (ROOT / "docs" / "algebra.md").read_text()
    block = re.search(r"```bash\n(lorakit convert .*?)```", text, re.S).group(1)
    (tmp_path / "data").symlink_to(DATA, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    lines = [ln.split("#")[0].split() for ln in block.strip().splitlines()]
    assert len(lines) == 5
    for argv in lines:
        assert argv[0] == "lorakit"
        assert main(argv[1:] + (["-q"] if argv[1] == "fuse" else [])) == 0, argv
    assert load_adapter(tmp_path / "scratch" / "mix").targets[0].rank == 16


def test_rslora_and_patterns_combine_with_their_own_scales():
    """Each adapter's own resolved scale (rsLoRA alpha/sqrt(r), rank and alpha patterns)."""
    src = ROOT / "tests" / "fixtures" / "peft" / "qwen3_rslora_patterns" / "adapter"
    rep = combine([src, src], [0.25, 0.75])
    orig = {t.module: t for t in load_adapter(src).targets}
    assert len({t.scale for t in orig.values()}) == 4  # 5.657, 11.31, 2.475, 8.0
    for t in rep.adapter.targets:
        want = _f64_delta(orig[t.module])
        got = (t.B.astype(np.float64) * np.asarray(t.scale)) @ t.A.astype(np.float64)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12 * np.abs(want).max())
        assert t.rank == 2 * orig[t.module].rank


def test_moe_experts_spelled_two_ways_are_refused_not_dropped(tmp_path):
    moe = DATA / "adapters" / "moe-lora"
    peft = convert(moe, tmp_path / "p", to="peft")
    with pytest.raises(LorakitError, match="two ways"):
        combine([moe, peft], [0.5, 0.5])
    back = convert(peft, tmp_path / "m", to="mlx-lm")  # one spelling: combines
    rep = combine([moe, back], [0.5, 0.5])
    assert any(t.kind == "switch" for t in rep.adapter.targets)


def test_exact_combination_refuses_other_rounding_orders(tmp_path):
    import lorakit

    rep = combine([LORA, EMB], [0.7, 0.3])
    for rounding in ("round-once", "mlx-lm"):
        with pytest.raises(LorakitError, match="correctly rounded only"):
            lorakit.fuse(DATA / "tiny-qwen3", rep.adapter, tmp_path / rounding,
                         rounding=rounding, progress=False)
        assert not (tmp_path / rounding).exists()


@pytest.mark.slow  # loads the model with mlx-lm
def test_attach_refuses_per_column_scales_and_takes_cat():
    from mlx_lm import load

    import lorakit

    model, _ = load(str(DATA / "tiny-qwen3"))
    with pytest.raises(LorakitError, match="one per rank column"):
        lorakit.fusion.attach_adapter(model, combine([LORA, EMB], [0.7, 0.3]).adapter)
    lorakit.fusion.attach_adapter(model, combine([LORA, EMB], [0.5, -2.0], method="cat").adapter)
