"""extract and resize against independent float64 computations.

The embedded base (data/tiny-qwen3) fused with the embedded rank-8 LoRA by
``lorakit.fuse`` (nearest rounding) is the tuned checkpoint. The adapter's own delta
``scale * B @ A`` (float64 from the adapter file) and the fused checkpoint's rounding
error ``e = (T - W) - delta`` are computed here without lorakit's SVD code. The bound
checked: the rank-r extraction ``D_r`` satisfies ``||D_r - delta||_F <= 2 ||e||_F``
(``delta`` is a rank-r candidate, so ``||D - D_r|| <= ||e||``; triangle inequality),
and ``||e||_F <= noise`` (half an ulp of every fused element). The report's re-fuse
share is compared with a real ``lorakit.fuse`` of the extracted adapter, and its
behaviour line (``lorakit.extract``) with the fused model on the embedded corpus.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from helpers import DATA

import lorakit
from lorakit import numerics as nm
from lorakit.algebra.extract import ExtractOptions, extract, resize
from lorakit.errors import ArgumentError, LorakitError
from lorakit.inspect.check import behaviour_line
from lorakit.io.formats.checkpoint import Checkpoint

BASE, LORA = DATA / "tiny-qwen3", DATA / "adapters" / "lora"


def _f64(ck: Checkpoint, name: str) -> np.ndarray:
    info = ck.tensors[name]
    return nm.to_float64(ck.read(name), info.dtype)


def _adapter_deltas(path: Path) -> dict:
    ad = lorakit.load_adapter(path)
    return {t.module: t.scale * (t.B.astype(np.float64) @ t.A.astype(np.float64))
            for t in ad.targets}


@pytest.fixture(scope="module")
def fused(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("extract") / "fused"
    lorakit.fuse(BASE, LORA, out, progress=False)
    return out


@pytest.fixture(scope="module")
def rank8(fused):
    return extract(BASE, fused, rank=8, progress=False)


def _refuse_diff(fused: Path, adapter, out: Path):
    """Fuse ``adapter`` again and count, over the adapted tensors, the elements that
    differ from ``fused`` and those that differ by more than one ulp of the value; every
    other tensor must come back bit-identical."""
    lorakit.fuse(BASE, adapter, out, progress=False)
    a, b = Checkpoint(fused), Checkpoint(out)
    adapted = {t.module + ".weight" for t in adapter.targets}
    differing = beyond_one = total = 0
    for name in a.tensors:
        x, y = a.read(name), b.read(name)
        if name not in adapted:
            assert x.tobytes() == y.tobytes(), name
            continue
        fx, fy = nm.to_float64(x, "bf16"), nm.to_float64(y, "bf16")
        ulps = np.abs(fx - fy) / nm.ulp(np.maximum(np.abs(fx), np.abs(fy)), "bf16")
        total += x.size
        differing += int(np.count_nonzero(ulps))
        beyond_one += int(np.count_nonzero(ulps > 1))
    return differing, beyond_one, total


def test_rank_r_extraction_recovers_the_delta_within_rounding_noise(fused, rank8):
    rep = rank8
    base, tuned = Checkpoint(BASE), Checkpoint(fused)
    deltas = _adapter_deltas(LORA)
    got = {t.module: t.scale * (t.B.astype(np.float64) @ t.A.astype(np.float64))
           for t in rep.adapter.targets}
    assert set(got) == set(deltas) and len(got) == 28
    ratios = []
    for row in rep.rows:
        name = row["module"] + ".weight"
        D = _f64(tuned, name) - _f64(base, name)
        e = D - deltas[row["module"]]
        e_norm = float(np.linalg.norm(e))
        half_ulp = 0.5 * nm.ulp(_f64(tuned, name), tuned.tensors[name].dtype)
        assert np.all(np.abs(e) <= half_ulp)  # the fuse was correctly rounded
        assert e_norm <= row["noise"] * (1 + 1e-12)
        err = float(np.linalg.norm(got[row["module"]] - deltas[row["module"]]))
        assert err <= 2 * e_norm
        ratios.append(err / e_norm)
        # the reported residual is the stored factors' own, recomputed here
        res = float(np.linalg.norm(D - got[row["module"]]))
        assert math.isclose(res, row["residual"], rel_tol=1e-9)
        # the truncation is the best rank-r fit: at most ||e||
        assert res <= e_norm * (1 + 1e-6)
        S = np.linalg.svd(D, compute_uv=False)
        assert math.isclose(row["energy"], float(np.sum(S[:8] ** 2) / np.sum(S ** 2)),
                            rel_tol=1e-6)
    # measured: the SVD's error is a third of the rounding error at most (it keeps e's
    # share in the delta's spaces)
    assert max(ratios) < 0.5, max(ratios)


def test_the_reported_refuse_share_is_a_real_refuse(fused, rank8, tmp_path):
    """The report's ``reproduced`` counts what a real ``lorakit.fuse`` of the extracted
    adapter gives back. The rank-r truncation keeps the part of the rounding error that
    lies in the delta's row and column spaces, so where the fused value sat near a
    rounding boundary the re-fuse rounds the other way: 14% of the adapted elements
    here (2.9% by more than one ulp: values near zero)."""
    differing, beyond_one, total = _refuse_diff(fused, rank8.adapter, tmp_path / "svd")
    assert total == 2359296
    assert differing / total > 0.1 and beyond_one / total > 0.02, (differing, beyond_one)
    same = sum(round(r["reproduced"] * math.prod(r["shape"])) for r in rank8.rows)
    assert same == total - differing
    assert rank8.summary["re-fuse reproduces"].startswith(f"{same:,} of {total:,} ")


def test_within_flags_a_truncated_extraction_and_not_a_full_one(fused, rank8):
    assert [r["within"] for r in rank8.rows] == ["yes"] * 28 and rank8.flagged == []
    low = extract(BASE, fused, rank=4, progress=False)
    assert all(r["within"] == "no" for r in low.rows)
    assert len(low.flagged) == 28


@pytest.mark.slow  # a few seconds: more extracts and fuses
def test_randomized_svd_agrees_with_exact(fused, rank8):
    rnd, exact = rank8, extract(BASE, fused, rank=8, exact_max=1024, progress=False)
    assert {r["method"] for r in rnd.rows} == {"randomized"}
    assert {r["method"] for r in exact.rows} == {"exact"}
    for a, b in zip(exact.rows, rnd.rows):
        assert a["module"] == b["module"]
        assert abs(a["residual"] - b["residual"]) <= 1e-6 * a["fro"]
        assert b["within"] == "yes"


@pytest.mark.slow  # a few seconds: more extracts and fuses
def test_energy_picks_per_module_ranks(fused):
    base, tuned = Checkpoint(BASE), Checkpoint(fused)
    rep = extract(BASE, fused, energy=0.95, progress=False)
    ranks = [r["rank"] for r in rep.rows]
    assert len(set(ranks)) > 1
    for row in rep.rows:
        name = row["module"] + ".weight"
        S = np.linalg.svd(_f64(tuned, name) - _f64(base, name), compute_uv=False)
        cum = np.cumsum(S ** 2) / np.sum(S ** 2)
        assert row["rank"] == int(np.argmax(cum >= 0.95)) + 1


@pytest.mark.slow  # a few seconds: more extracts and fuses
def test_modules_filter_and_untouched(fused):
    rep = extract(BASE, fused, rank=8, modules=["q_proj"], progress=False)
    assert [r["module"].rsplit(".", 1)[-1] for r in rep.rows] == ["q_proj"] * 4
    same = extract(BASE, BASE, rank=8, progress=False)
    assert same.rows == [] and same.summary["untouched tensors"] == 46


@pytest.mark.slow  # two more extracts
def test_threads_do_not_change_the_result(fused, rank8):
    """Modules worked on at once (threads=3, one at a time with threads=1) give the
    default's adapter bit for bit and its rows in the same order."""
    for n in (1, 3):
        rep = extract(BASE, fused, rank=8, threads=n, progress=False)
        assert rep.adapter._sha256 == rank8.adapter._sha256
        assert [r["module"] for r in rep.rows] == [r["module"] for r in rank8.rows]
        assert [r["reproduced"] for r in rep.rows] == [r["reproduced"] for r in rank8.rows]
        assert rep.summary["untouched tensors"] == rank8.summary["untouched tensors"]


def test_an_error_in_a_module_surfaces_once(fused, monkeypatch):
    """A module that fails in a worker thread raises its own error from extract."""
    import lorakit.algebra.extract as ex

    def boom(*a, **k):
        raise RuntimeError("module failed")
    monkeypatch.setattr(ex, "_lowrank_row", boom)
    with pytest.raises(RuntimeError, match="module failed"):
        extract(BASE, fused, rank=8, threads=2, progress=False)


@pytest.mark.slow  # a few seconds: more extracts and fuses
def test_embedding_changes_are_saved_in_full(tmp_path):
    fused = tmp_path / "fused-embed"
    lorakit.fuse(BASE, DATA / "adapters" / "lora-embed", fused, progress=False)
    rep = extract(BASE, fused, rank=8, progress=False)
    full = [r for r in rep.rows if r["method"] == "full"]
    assert full and all("embed_tokens" in r["module"] for r in full)
    assert [x.name for x in rep.adapter.replacements] == [r["module"] for r in full]
    again = tmp_path / "again"
    lorakit.fuse(BASE, rep.adapter, again, progress=False)
    a, b = Checkpoint(fused), Checkpoint(again)
    for r in full:
        assert a.read(r["module"]).tobytes() == b.read(r["module"]).tobytes()


def test_bad_inputs_are_refused():
    with pytest.raises(LorakitError, match="quantized") as e:
        extract(BASE, DATA / "tiny-qwen3-4bit", rank=4, progress=False)
    assert "tiny-qwen3-4bit" in str(e.value)
    with pytest.raises(ArgumentError, match="exactly one"):
        extract(BASE, BASE, progress=False)
    with pytest.raises(LorakitError, match="pair up"):
        extract(BASE, DATA / "tiny-qwen3-moe", rank=4, progress=False)


@pytest.mark.parametrize("settings, name", [
    ({"rank": 0}, "rank"), ({"rank": 2.5}, "rank"), ({"energy": 1.5}, "energy"),
    ({"rank": 8, "energy": 0.9}, "rank / energy"), ({"rank": 8, "format": "gguf"}, "format"),
    ({"rank": 8, "threads": 0}, "threads"), ({"rank": 8, "seed": -1}, "seed"),
    ({"rank": 8, "behaviour": 1}, "behaviour"), ({"rank": 8, "refine": True}, "refine")])
def test_bad_arguments_name_themselves(settings, name):
    """A bad setting is an ArgumentError naming it, before any file is read (the
    checkpoint here does not exist)."""
    with pytest.raises(ArgumentError, match=f"bad value for {name}"):
        extract("no-such-base", "no-such-tuned", progress=False, **settings)


def test_options_and_keywords_are_one_value():
    opts = ExtractOptions(rank=8, modules="q_proj")
    assert opts.modules == ("q_proj",) and opts.target == "rank 8"
    assert ExtractOptions.of(opts, {"rank": 4}) == ExtractOptions(rank=4, modules=["q_proj"])
    with pytest.raises(Exception):
        opts.rank = 4  # frozen


# -- resize ----------------------------------------------------------------------------

def test_resize_error_is_exact_against_the_dense_svd():
    deltas = _adapter_deltas(LORA)
    rep = resize(LORA, rank=3)
    got = {t.module: t.scale * (t.B.astype(np.float64) @ t.A.astype(np.float64))
           for t in rep.adapter.targets}
    for row in rep.rows:
        D = deltas[row["module"]]
        S = np.linalg.svd(D, compute_uv=False)
        want = math.sqrt(float(np.sum(S[3:] ** 2)))
        assert math.isclose(row["error"], want, rel_tol=1e-6)
        assert math.isclose(float(np.linalg.norm(got[row["module"]] - D)), want, rel_tol=1e-4)
        assert row["rank"] == 3 and row["rank_before"] == 8


def test_resize_at_full_rank_keeps_the_delta():
    deltas = _adapter_deltas(LORA)
    rep = resize(LORA, rank=16)
    for t in rep.adapter.targets:
        assert t.rank == 8
        d = t.scale * (t.B.astype(np.float64) @ t.A.astype(np.float64))
        assert np.allclose(d, deltas[t.module], rtol=0, atol=1e-6 * np.abs(d).max())
    assert max(r["error"] for r in rep.rows) < 1e-9


def test_resize_dora_keeps_magnitudes_and_reports_the_normalised_error():
    ad = lorakit.load_adapter(DATA / "adapters" / "dora")
    rep = resize(ad, rank=4, base=BASE)
    for old, new, row in zip(ad.targets, rep.adapter.targets, rep.rows):
        assert np.array_equal(old.magnitude, new.magnitude)
        assert isinstance(row["dora_error"], float) and row["dora_error"] > 0


def test_compare_adapters_reads_the_results(rank8):
    c = lorakit.inspect.compare_adapters(rank8.adapter, LORA)
    assert c.summary["modules in both"] == 28
    assert min(r["cosine"] for r in c.rows) > 0.9999
    small = resize(LORA, rank=2).adapter
    c2 = lorakit.inspect.compare_adapters(small, LORA)
    assert 0.5 < min(r["cosine"] for r in c2.rows) < 0.9999


# -- saving and the command line ---------------------------------------------------------

@pytest.mark.slow  # a few seconds: more extracts and fuses
def test_saved_results_load_back_exactly(fused, tmp_path):
    rep = extract(BASE, fused, energy=0.99, save_path=tmp_path / "ext", progress=False)
    back = lorakit.load_adapter(tmp_path / "ext")
    assert back.format == "peft" and len({t.rank for t in back.targets}) > 1
    mem = {t.module: t for t in rep.adapter.targets}
    for t in back.targets:
        m = mem[t.module]
        d_back = t.scale * (t.B.astype(np.float64) @ t.A.astype(np.float64))
        d_mem = m.scale * (m.B.astype(np.float64) @ m.A.astype(np.float64))
        assert np.array_equal(d_back, d_mem)
    res = resize(LORA, rank=3, save_path=tmp_path / "r3", format="mlx-lm")
    r3 = lorakit.load_adapter(res.saved)
    assert r3.format == "mlx-lm" and {t.rank for t in r3.targets} == {3}
    # per-module ranks in mlx-lm's one-rank config: lower ranks zero-padded, deltas exact
    mixed = resize(LORA, energy=0.9, save_path=tmp_path / "pad", format="mlx-lm")
    assert len({t.rank for t in mixed.adapter.targets}) > 1
    pad = {t.module: t for t in lorakit.load_adapter(mixed.saved).targets}
    assert len({t.rank for t in pad.values()}) == 1
    for m in mixed.adapter.targets:
        t = pad[m.module]
        assert np.array_equal(t.scale * (t.B.astype(np.float64) @ t.A.astype(np.float64)),
                              m.scale * (m.B.astype(np.float64) @ m.A.astype(np.float64)))


@pytest.mark.slow  # a few seconds: more extracts and fuses
def test_cli_extract_and_resize(fused, tmp_path, capsys):
    from lorakit.cli.main import main

    code = main(["extract", "--base", str(BASE), "--tuned", str(fused), "--rank", "8",
                 "--modules", "q_proj", "--save-path", str(tmp_path / "e"), "-q", "--json"])
    assert code == 0
    import json

    out = json.loads(capsys.readouterr().out)
    assert out["summary"]["low-rank modules"] == 4 and "of 262,144 adapted" in \
        out["summary"]["re-fuse reproduces"]
    assert out["summary"]["behaviour"].startswith("tuned vs base + extracted: mean KL")
    assert set(out["behaviour"]) >= {"mean_kl", "top1_agreement", "tokens"}
    assert len(lorakit.load_adapter(tmp_path / "e").targets) == 4
    assert main(["extract", "--base", str(BASE), "--tuned", str(fused), "--rank", "8",
                 "--modules", "q_proj", "--no-behaviour", "--save-path", str(tmp_path / "n"),
                 "-q", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "behaviour" not in out and "behaviour" not in out["summary"]
    assert all(0 < r["reproduced"] < 1 for r in out["rows"])
    assert main(["extract", "--base", str(BASE), "--tuned", str(fused), "--rank", "0",
                 "--save-path", str(tmp_path / "z"), "-q"]) == 2
    assert "bad value for rank" in capsys.readouterr().err
    assert main(["resize", str(LORA), "--energy", "0.9", "--save-path", str(tmp_path / "r")]) == 0
    assert "resize: lora" in capsys.readouterr().out
    assert main(["resize", str(LORA), "--rank", "2", "--save-path", str(tmp_path / "r")]) == 2
    assert "exists" in capsys.readouterr().err


@pytest.mark.slow  # runs docs/algebra.md's extract and resize lines, twice (--force replaces)
def test_readme_extract_and_resize_lines_run(tmp_path, monkeypatch):
    import re

    from lorakit.cli.main import main

    text = (Path(__file__).resolve().parents[2] / "docs" / "algebra.md").read_text()
    block = re.search(r"```bash\n(lorakit extract .*?)```", text, re.S).group(1)
    lines = [ln.split() for ln in block.splitlines() if ln.startswith("lorakit ")]
    assert [ln[1] for ln in lines] == ["extract", "resize"]
    (tmp_path / "data").symlink_to(DATA, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    lorakit.fuse("data/tiny-qwen3", "data/adapters/lora", "scratch/fused", progress=False)
    for _ in range(2):
        for ln in lines:
            assert main(ln[1:] + ["-q"] * (ln[1] == "extract")) == 0
    assert lorakit.load_adapter("scratch/extracted").format == "peft"


# -- the behaviour line ------------------------------------------------------------------

@pytest.mark.slow  # loads the embedded model twice in MLX and scores 1,024 tokens
def test_behaviour_line_of_the_embedded_model(fused):
    """``lorakit.extract``: the fused model against base + the extracted rank-8 adapter
    (attached unfused) on the embedded corpus; the adapter is the fuse's own up to
    rounding, so the two behave alike (measured: mean KL 3.9e-05, top-1 100%)."""
    rep = lorakit.extract(BASE, fused, rank=8, progress=False)
    b = rep.behaviour
    assert b["tokens"] == 1020 and b["mean_kl"] < 1e-3 and b["top1_agreement"] >= 0.99
    assert rep.summary["behaviour"] == "tuned vs base + extracted: " + behaviour_line(b)
    assert rep.to_dict()["behaviour"] == b
    off = lorakit.extract(BASE, fused, rank=8, behaviour=False, progress=False)
    assert off.behaviour is None and "behaviour" not in off.summary
    assert off.adapter._sha256 == rep.adapter._sha256


def test_behaviour_needs_model_folders(fused):
    one = fused / Checkpoint(fused).shards[0]  # a lone .safetensors file: no model folder
    rep = lorakit.extract(BASE / "model.safetensors", one, rank=8, modules=["q_proj"],
                          progress=False)
    assert rep.behaviour is None and rep.summary["behaviour"].startswith("not measured")
