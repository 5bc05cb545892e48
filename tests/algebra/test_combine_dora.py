"""DoRA in an exact combination (issue 16): ``lorakit fuse`` of several adapters, DoRA
among them, against an independent float64 computation written here from the raw
adapter files (the DoRA formula as mlx-lm and PEFT define it:
``W' = m * (W + s B A) / ||W + s B A||``, the norm of each output row, i.e. over the
input axis: mlx-lm's ``DoRALinear`` takes ``mx.linalg.norm(w, axis=1)`` of the
(out, in) weight, PEFT's ``get_weight_norm`` the norm over dim 1)."""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from lorakit.algebra.combine import combine
from lorakit.errors import ArgumentError, LorakitError
from lorakit.io.adapters.base import Adapter
from lorakit.io.adapters.load import load_adapter

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data"
BASE = DATA / "tiny-qwen3"
LORA, DORA = DATA / "adapters" / "lora", DATA / "adapters" / "dora"
sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
from make_peft_fixtures import read_safetensors  # noqa: E402  (numpy-only reader)
from test_combine import _bf16, _checkpoint  # noqa: E402  (the same readers)


def _raw_adapter(path):
    """module -> (scale, delta (out, in) float64, magnitude or None), from the mlx-lm
    files themselves: ``lora_a`` (in, r), ``lora_b`` (r, out), ``m`` (out,)."""
    cfg = json.loads((path / "adapter_config.json").read_text())
    scale = float(cfg["lora_parameters"]["scale"])
    t = {k: v for k, (_, v) in read_safetensors(path / "adapters.safetensors").items()}
    out = {}
    for k in t:
        if k.endswith(".lora_a"):
            mod = k[: -len(".lora_a")]
            a, b = t[k].astype(np.float64), t[mod + ".lora_b"].astype(np.float64)
            m = t.get(mod + ".m")
            out[mod] = (scale, (b.T @ a.T) * scale, None if m is None else m.astype(np.float64))
    return out


def _independent(W, delta, m):
    """The adapter alone on W, float64: LoRA W + d; DoRA m * (W + d) / ||W + d||_row."""
    T = W + delta
    if m is None:
        return T
    return T * (m / np.sqrt((T * T).sum(axis=1)))[:, None]


def _check(fused_dir, parts):
    """(elements farther than 0.5 ulp from the independent float64 value, elements
    checked, largest distance in ulp); untouched tensors keep their bits."""
    base, fused = _checkpoint(BASE), _checkpoint(fused_dir)
    ads = [(w, _raw_adapter(p)) for p, w in parts]
    bad = checked = 0
    worst = 0.0
    for name, (code, raw) in base.items():
        module = name[: -len(".weight")]
        fcode, fraw = fused[name]
        if not any(module in a for _, a in ads):
            assert np.array_equal(raw, fraw), name
            continue
        assert code == fcode == "BF16"
        W = _bf16(raw)
        want = W.copy()
        for w, a in ads:
            if module in a:
                _, d, m = a[module]
                want += w * (_independent(W, d, m) - W)
        got = _bf16(fraw)
        up, down = _bf16(fraw + np.uint16(1)), _bf16(fraw - np.uint16(1))
        up, down = np.where(np.isnan(up), np.inf, up), np.where(np.isnan(down), np.inf, down)
        err = np.abs(got - want)
        ok = (err <= np.abs(up - want)) & (err <= np.abs(down - want))
        bad += int((~ok).sum())
        # in ulp of the fused value (the larger neighbour spacing at a binade edge)
        worst = max(worst, float(np.max(err / np.fmax(np.abs(up - got), np.abs(down - got)))))
        checked += got.size
    return bad, checked, worst


def test_dora_plus_lora_fuse_is_within_half_ulp(tmp_path):
    import lorakit

    parts = [(DORA, 0.6), (LORA, -0.4)]
    rep = combine([p for p, _ in parts], [w for _, w in parts])
    assert rep.summary["dora_modules"] == 28
    lorakit.fuse(BASE, rep.adapter, tmp_path / "f", progress=False)
    bad, checked, worst = _check(tmp_path / "f", parts)
    assert checked == 2_359_296 and bad == 0, (bad, checked)  # docs/algebra.md states these
    assert worst <= 0.5, worst
    # the check can fail: the same sum with DoRA's row rescale dropped (the DoRA
    # adapter read as plain LoRA, what a LoRA-only combination would fuse) misses
    ad = load_adapter(DORA)
    plain = Adapter(ad.path, ad.format, [replace(t, magnitude=None) for t in ad.targets],
                    ad.config, ad.weights_file, "lora")
    wrong = combine([plain, LORA], [0.6, -0.4])
    assert "dora_modules" not in wrong.summary
    lorakit.fuse(BASE, wrong.adapter, tmp_path / "w", progress=False)
    assert _check(tmp_path / "w", parts)[0] > checked // 2


def test_one_dora_adapter_weight_one_is_the_single_fuse(tmp_path):
    import lorakit

    lorakit.fuse(BASE, combine([DORA], [1.0]).adapter, tmp_path / "c", progress=False)
    lorakit.fuse(BASE, DORA, tmp_path / "s", progress=False)
    a, b = _checkpoint(tmp_path / "c"), _checkpoint(tmp_path / "s")
    assert a.keys() == b.keys()
    for k in a:
        assert a[k][0] == b[k][0] and np.array_equal(a[k][1], b[k][1]), k
    # and the weights matter: 0.999 is not the single fuse
    lorakit.fuse(BASE, combine([DORA], [0.999]).adapter, tmp_path / "n", progress=False)
    n = _checkpoint(tmp_path / "n")
    assert any(not np.array_equal(n[k][1], b[k][1]) for k in b)


def test_saving_a_dora_combination_is_refused(tmp_path):
    rep = combine([DORA, LORA], [0.6, -0.4])
    assert {r["rank"] for r in rep.rows} == {"W-dependent"} and "W-dependent" in str(rep)
    with pytest.raises(LorakitError, match="DoRA.*cannot be saved"):
        rep.save(tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(LorakitError, match="cannot be saved"):
        combine([DORA, LORA], [0.6, -0.4], save_path=tmp_path / "out2")
    assert not (tmp_path / "out2").exists()
    for method in ("cat", "linear"):
        with pytest.raises(LorakitError, match="DoRA adapters cannot be combined by"):
            combine([DORA, LORA], [1, 1], method=method)


def test_other_roundings_refused(tmp_path):
    import lorakit

    rep = combine([DORA, LORA], [0.6, -0.4])
    with pytest.raises(LorakitError, match="correctly rounded only"):
        lorakit.fuse(BASE, rep.adapter, tmp_path / "r", rounding="round-once", progress=False)
    assert not (tmp_path / "r").exists()


@pytest.mark.slow  # CLI runs: fuse, combine refusal
def test_cli_fuse_of_dora_and_lora_and_combine_refusal(tmp_path, capsys):
    import lorakit
    from lorakit.cli.main import main

    args = ["--adapter-path", str(DORA), "--adapter-path", str(LORA), "--weights", "0.6,-0.4"]
    assert main(["fuse", "--model", str(BASE), *args, "--save-path", str(tmp_path / "cli"),
                 "-q"]) == 0
    rep = combine([DORA, LORA], [0.6, -0.4])
    lorakit.fuse(BASE, rep.adapter, tmp_path / "api", progress=False)
    a, b = _checkpoint(tmp_path / "cli"), _checkpoint(tmp_path / "api")
    assert a.keys() == b.keys() and all(np.array_equal(a[k][1], b[k][1]) for k in a)
    assert main(["fuse", "--model", str(BASE), *args, "--save-path", str(tmp_path / "r"),
                 "--rounding", "mlx-lm", "-q"]) == 2
    assert "DoRA adapters one at a time" in capsys.readouterr().err
    assert main(["combine", *args, "--save-path", str(tmp_path / "c")]) == 2
    assert "cannot be saved" in capsys.readouterr().err
    assert not (tmp_path / "c").exists() and not (tmp_path / "r").exists()


@pytest.mark.slow  # SVDs of 28 full deltas, twice, here and in the library
def test_svd_of_dora_combination_truncates_the_w_dependent_sum(tmp_path):
    parts = [(DORA, 0.6), (LORA, -0.4)]
    with pytest.raises(ArgumentError, match="needs the base weights"):
        combine([DORA, LORA], [0.6, -0.4], method="svd")
    base = _checkpoint(BASE)
    ads = [(w, _raw_adapter(p)) for p, w in parts]
    errs = {}
    for R in (8, 64):
        rep = combine([DORA, LORA], [0.6, -0.4], method="svd", rank=R, base=BASE,
                      save_path=tmp_path / f"r{R}")
        assert "dora_modules" not in rep.summary and (tmp_path / f"r{R}").is_dir()
        for t, row in zip(rep.adapter.targets, rep.rows):
            assert t.magnitude is None and t.rank == R == row["rank"]
            W = _bf16(base[t.module + ".weight"][1])
            D = sum(w * (_independent(W, a[t.module][1], a[t.module][2]) - W) for w, a in ads)
            got = float(t.scale) * (t.B.astype(np.float64) @ t.A.astype(np.float64))
            err = np.linalg.norm(D - got) / np.linalg.norm(D)
            assert err == pytest.approx(row["trunc_rel_err"], rel=1e-6, abs=1e-12)
            # the best rank-R approximation (Eckart-Young), up to the float32 factors
            s = np.linalg.svd(D, compute_uv=False)
            assert err <= np.sqrt((s[R:] ** 2).sum()) / np.linalg.norm(D) * (1 + 1e-4) + 1e-6
            errs.setdefault(R, []).append(err)
    # more rank, less error, module by module (the W-dependent sum is not rank 16)
    assert all(a < b for a, b in zip(errs[64], errs[8]))


@pytest.mark.slow  # loads the model with mlx-lm
def test_in_memory_fuse_of_dora_combination_equals_checkpoint_fuse(tmp_path):
    from mlx.utils import tree_flatten
    from mlx_lm import load

    import lorakit
    from lorakit.io.formats.safetensors import mx_to_raw

    rep = combine([DORA, LORA], [0.6, -0.4])
    model, _ = load(str(BASE))
    lorakit.fuse(model, rep.adapter)
    lorakit.fuse(BASE, rep.adapter, tmp_path / "f", progress=False)
    params = dict(tree_flatten(model.parameters()))
    ck = _checkpoint(tmp_path / "f")
    adapted = [k for k in ck if ".layers." in k and k.endswith("proj.weight")]
    assert len(adapted) == 28 and all(k in params for k in adapted)
    for k in adapted:
        assert np.array_equal(mx_to_raw(params[k])[0], ck[k][1]), k
