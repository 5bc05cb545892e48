"""Widget logic without a browser: set values, click, assert on state and figures.

Handlers run synchronously outside a kernel, so a click is ``button.click()`` and
its effect is in the widgets' values and in the matplotlib Figures they hold. The
models are tiny ones made by mlx-lm's own classes (``model_factory``); the
notebooks (tests/project/test_notebooks.py) cover the embedded assets in data/.
"""
from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("matplotlib")

from matplotlib.figure import Figure  # noqa: E402
from model_factory import make_adapter, make_model  # noqa: E402

import lorakit  # noqa: E402
from lorakit.inspect.diff import (
    RefUlpReport,  # noqa: E402
    UlpReport,  # noqa: E402
)
from lorakit.inspect.generation import eos_ids  # noqa: E402
from lorakit.widgets import (  # noqa: E402
    AdapterCompare,
    DecodeRace,
    DiffExplorer,
    DtypeMapView,
    FusePanel,
    GenerationCompare,
    _assets,  # noqa: E402
    find_data,
)
from lorakit.widgets.diff_explorer import REFERENCE  # noqa: E402
from lorakit.widgets.generation import MARK_STYLE  # noqa: E402

KEYS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _tree_hash(path: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        if p.is_file():
            h.update(p.name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """A data/ folder laid out like the repository's: checkpoints and adapters/."""
    d = tmp_path_factory.mktemp("widgets") / "data"
    base = make_model(d / "tiny-qwen3", "qwen3")
    make_adapter(base, d / "adapters" / "lora", keys=KEYS, rank=8, scale=4.0, b_std=0.5)
    make_adapter(base, d / "adapters" / "lora-b", keys=KEYS[:4], rank=4, seed=7)
    make_adapter(base, d / "adapters" / "dora", dora=True, seed=3)
    q = make_model(d / "tiny-qwen3-4bit", "qwen3", quantize={"group_size": 32, "bits": 4})
    make_adapter(q, d / "adapters" / "lora-4bit", keys=KEYS[:2], seed=5)
    return d


@pytest.fixture(scope="module")
def fused(data, tmp_path_factory) -> dict:
    """The same adapter fused with three roundings, plus the f32-promoted fuse."""
    out = tmp_path_factory.mktemp("fused")
    res = {}
    for r in ("nearest", "mlx-lm", "round-once"):
        res[r] = lorakit.fuse(data / "tiny-qwen3", data / "adapters" / "lora", out / r,
                              rounding=r, progress=False).output
    res["promoted"] = lorakit.fuse(data / "tiny-qwen3", data / "adapters" / "lora",
                                   out / "promoted", dtype="promote", progress=False).output
    return res


# -- import hygiene and asset discovery -----------------------------------------------------
def test_importing_lorakit_imports_no_notebook_stack():
    code = ("import sys, lorakit; lorakit.fuse; lorakit.inspect.dtype_map; lorakit.diff; "
            "lorakit.time_decode; bad = [m for m in ('ipywidgets', 'matplotlib', 'IPython', "
            "'jupyter_client', 'ipykernel') if m in sys.modules]; print(bad); "
            "sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_find_data_env_then_parents(data, tmp_path, monkeypatch):
    monkeypatch.setenv(_assets.ENV, str(tmp_path / "elsewhere"))
    assert find_data() == (tmp_path / "elsewhere").resolve()
    monkeypatch.delenv(_assets.ENV)
    nested = data.parent / "notebooks" / "deeper"
    nested.mkdir(parents=True)
    assert find_data(nested) == data
    assert list(_assets.checkpoints(data)) == ["tiny-qwen3", "tiny-qwen3-4bit"]
    assert list(_assets.adapters(data)) == ["dora", "lora", "lora-4bit", "lora-b"]


# -- DtypeMapView -----------------------------------------------------------------------------
def test_dtype_view_shows_promotion_and_cell_detail(fused):
    v = DtypeMapView(fused["promoted"])
    rep = v.report
    assert rep is not None and v.error.value == ""
    assert isinstance(v.figure.figure, Figure) and v.figure.value[:4] == b"\x89PNG"
    # a promoted fuse mixes F32 into a BF16 checkpoint: the map flags one of the two
    assert {"BF16", "F32"} <= set(rep.bytes_by_dtype)
    assert rep.flagged and "flagged" in v.summary.value
    flagged_cells = [k for k, b in v.cells.items() if "t-dtype-flagged" in b._dom_classes]
    assert flagged_cells
    q = v.cells[("0", "q")]
    assert q.description == "F32"
    assert "model.layers.0.self_attn.q_proj.weight: F32" in q.tooltip
    q.click()
    assert v.selected == ("0", "q")
    assert "model.layers.0.self_attn.q_proj.weight" in v.detail.value
    assert "model.layers.0.self_attn.k_proj" not in v.detail.value
    # an untouched tensor kind keeps BF16
    assert v.cells[("0", "norm_in")].description == "BF16"


def test_dtype_view_headers_are_readable(fused):
    """The grid's column headers name kinds as a reader would ("post-attn norm"), not
    as the code spells them ("norm_attn", which the narrow column cut to "norm_at")."""
    import re

    from lorakit.layers import KIND_ORDER, kind_label

    v = DtypeMapView(fused["promoted"])
    _, kinds, _ = v.report.grid()
    heads = v.grid.children[1:1 + len(kinds)]
    texts = [re.sub(r"<[^>]+>", "", h.value) for h in heads]
    assert texts == [kind_label(k) for k in kinds]
    assert "post-attn norm" in texts and "input norm" in texts
    assert not any("_" in t for t in texts), texts
    # the header may wrap (not clipped) and its hover spells the kind as tables do
    assert all("overflow" not in str(h.layout.overflow or "") for h in heads)
    assert any("title='norm_attn: post-attn norm'" in h.value for h in heads)
    # a clicked cell's detail table is titled in words and explains its columns on hover
    v.select("0", "norm_attn")
    assert "<b>layer 0, post-attn norm</b>" in v.detail.value
    assert "<th title='the dtype stored on disk'>dtype</th>" in v.detail.value
    # every kind lorakit knows has a label of its own, without code spelling
    assert all(kind_label(k) != k or "_" not in k for k in KIND_ORDER)
    assert all("_" not in kind_label(k) for k in KIND_ORDER)


def test_dtype_view_colors_agree_with_report(fused):
    v = DtypeMapView(fused["nearest"])
    assert not v.report.flagged
    colors = {b.style.button_color for k, b in v.cells.items() if b.description == "BF16"}
    assert len(colors) == 1
    labels, kinds, cells = v.report.grid()
    assert len(v.cells) == len(labels) * len(kinds)


def test_dtype_view_reports_bad_source(tmp_path):
    v = DtypeMapView(tmp_path / "missing")
    assert v.report is None
    assert "FormatError" in v.error.value and v.error.layout.display is None


# -- FusePanel --------------------------------------------------------------------------------
def test_fuse_panel_promote_then_fix(data, tmp_path):
    before = _tree_hash(data)
    p = FusePanel(data=data, out_dir=tmp_path, base="tiny-qwen3", adapter="lora")
    assert [lab for lab, _ in p.base.options] == ["tiny-qwen3", "tiny-qwen3-4bit"]
    assert p.quant.disabled  # a float base: nothing to re-quantize
    p.dtype.value = "promote"
    p.button.click()
    assert p.error.value == "" and p.runs == 1
    assert p.result.dtypes_written.get("F32", 0) == len(KEYS) * 2  # 7 projections x 2 layers
    assert p.progress.value == 1.0 and p.progress.bar_style == "success"
    assert "promote" in p.summary.value and p.view.report.flagged
    promoted_png = p.view.figure.value
    promoted_summary = p.summary.value
    assert p.result.output.parent == tmp_path

    p.dtype.value = "preserve"
    p.button.click()
    assert p.runs == 2 and set(p.result.dtypes_written) == {"BF16"}
    assert not p.view.report.flagged
    assert p.summary.value != promoted_summary and p.view.figure.value != promoted_png
    assert p.result.bytes_written < lorakit.inspect.dtype_map(
        tmp_path / "tiny-qwen3+lora-nearest-promote").summary["bytes"]
    assert _tree_hash(data) == before  # inputs untouched


def test_fuse_panel_rounding_and_quantized(data, tmp_path):
    p = FusePanel(data=data, out_dir=tmp_path, base="tiny-qwen3-4bit", adapter="lora-4bit")
    assert not p.quant.disabled
    p.run()
    assert p.error.value == "" and p.result.requant  # re-quantized, survival measured
    assert "codes changed" in p.status.value and "delta survived" in p.summary.value
    assert any(r["stored_as"].startswith("Q") for r in p.view.report.rows)
    p.quant.value = True
    p.rounding.value = "mlx-lm"
    out = p.run().output
    assert out.name.endswith("-mlx-lm-preserve-deq") and p.result.dequantized
    assert not any(n.endswith(".scales") for n in lorakit.open(out).tensors)
    assert p.quant_policy.disabled  # float weights written: no quant policy applies


def test_fuse_panel_quant_policy(data, tmp_path):
    """The panel offers lorakit.fuse's quant policies on a quantized base, and only there."""
    p = FusePanel(data=data, out_dir=tmp_path, base="tiny-qwen3-4bit", adapter="lora-4bit")
    assert not p.quant_policy.disabled and p.quant_policy.value == "requant"
    p.quant_policy.value = "bits:8"
    out = p.run().output
    assert p.error.value == "" and out.name.endswith("-nearest-preserve-bits_8")
    assert p.result.quant_policy == "bits:8"
    assert lorakit.open(out).config["quantization"]  # still a quantized checkpoint
    want = lorakit.fuse(data / "tiny-qwen3-4bit", data / "adapters" / "lora-4bit",
                        tmp_path / "direct", quant_policy="bits:8", progress=False)
    assert lorakit.diff(out, want.output, progress=False).identical  # the verb, nothing else
    f = FusePanel(data=data, out_dir=tmp_path / "f", base="tiny-qwen3", adapter="lora")
    assert f.quant_policy.disabled and f._policy() == "requant"


def test_fuse_panel_shows_errors_and_recovers(data, tmp_path):
    p = FusePanel(data=data, out_dir=tmp_path, base="tiny-qwen3", adapter="lora")
    p.adapter_path.value = str(tmp_path / "no-such-adapter")
    p.button.click()
    assert p.result is None and p.runs == 0
    assert "AdapterError" in p.error.value and p.progress.bar_style == "danger"
    assert not p.button.disabled
    p.adapter_path.value = ""
    p.button.click()
    assert p.runs == 1 and p.error.value == ""


# -- DiffExplorer ------------------------------------------------------------------------------
def test_ulp_explorer_views(fused, data):
    u = DiffExplorer({k: fused[k] for k in ("nearest", "mlx-lm", "round-once")},
                    base=data / "tiny-qwen3", adapter=data / "adapters" / "lora")
    rep = u.report
    assert isinstance(rep, UlpReport) and u.compared == 1
    assert rep.summary["differing"] > 0  # the mlx-lm order rounds twice
    overall = u.figure.value
    u.view.value = "layers"
    assert u.figure.value != overall
    u.layer.value = "1"
    assert u.view.value == "layer"
    assert "model.layers.1." in u.facts.value and "model.layers.0." not in u.facts.value
    assert all(t.startswith("model.layers.1.") for t in u.tensor.options)
    name = "model.layers.1.mlp.down_proj.weight"
    u.tensor.value = name
    assert u.view.value == "tensor" and name in u.facts.value
    # the zero-crossing explanation: relative error first, large ulps by magnitude
    assert "relative error" in u.summary.value and "near zero" in u.summary.value
    assert "differing elements by magnitude" in u.facts.value and "rel_err" in u.facts.value
    d = next(d for d in rep.diffs if d.name == name)
    cells = re.findall(r"<td>([^<]*)</td><td>([^<]*)</td><td>([^<]*)</td>",
                       u.facts.value.split("differing elements by magnitude")[1])
    assert sum(int(c.replace(",", "")) for _, c, _ in cells) == d.differing
    assert max(int(m.replace(",", "")) for _, _, m in cells) == d.max_ulp
    ax = u.figure.figure.axes[0]
    assert name in ax.get_title()


def test_ulp_explorer_reference_and_identity(fused, data):
    u = DiffExplorer({k: fused[k] for k in ("nearest", "mlx-lm")}, b=REFERENCE,
                    base=data / "tiny-qwen3", adapter=data / "adapters" / "lora")
    assert isinstance(u.report, RefUlpReport)
    assert list(u.view.options) == ["overall", "tensor"]
    assert u.report.summary["not correctly rounded"] == 0  # nearest is correctly rounded
    assert "relative error, rms(F - T) / rms(T)" in u.summary.value
    u.a.value = "mlx-lm"
    u.button.click()
    assert u.report.summary["not correctly rounded"] > 0
    u.b.value = "mlx-lm"
    u.compare()
    assert isinstance(u.report, UlpReport) and u.report.summary["differing"] == 0
    assert u.compared == 3


def test_ulp_explorer_shows_errors(fused, tmp_path):
    u = DiffExplorer({"a": fused["nearest"], "gone": tmp_path / "gone"}, compare=False)
    assert u.report is None
    u.button.click()
    assert u.report is None and u.error.value and u.status.value == "failed"


# -- AdapterCompare ---------------------------------------------------------------------------
def test_adapter_compare(data):
    ads = {k: data / "adapters" / k for k in ("lora", "lora-b", "dora")}
    w = AdapterCompare(ads, base=data / "tiny-qwen3")
    rep = w.report
    assert rep.summary["A"] == "lora" and rep.summary["B"] == "lora-b"
    figs = {w.figure.value}
    for view in ("cosine", "col_overlap", "row_overlap"):
        w.view.value = view
        figs.add(w.figure.value)
    assert len(figs) == 4
    w.b.value = "lora"
    w.button.click()
    assert w.report.summary["overall cosine"] == pytest.approx(1.0, abs=1e-6)
    assert "module" in w.table.value
    # the per-module rows sit behind the accordion alone (no second expander) and the
    # summary shown above is not repeated inside it
    assert "<details" not in w.table.value and w.report.title not in w.table.value
    assert w.table.value.count("<tr") == len(w.report.rows) + 1


# -- GenerationCompare ------------------------------------------------------------------------
def test_generation_compare_marks_first_divergence(data, fused):
    base = data / "tiny-qwen3"
    g = GenerationCompare({"base": base, "adapter": (base, data / "adapters" / "lora"),
                           "fused": fused["nearest"]}, prompts=["w1 w2 w3", "w7 w8"],
                          max_tokens=10)
    assert g.report is None
    g.button.click()
    rep = g.report
    assert rep is not None and g.error.value == ""
    assert "parts at token" in g.table.value and "t-gen-diverge" in g.table.value
    # the strong adapter changes greedy text; its fuse does the same
    ad = [r for r in rep.rows if r["model"] == "adapter"]
    assert any(r["diverges_at"] is not None for r in ad)
    assert isinstance(g.figure.figure, Figure)
    g.prompt.value = 1
    assert "prompt 1" in g.figure.figure.axes[0].get_title()
    loaded = dict(g.loaded)
    g.prompts.value = "w3"
    g.run()
    assert g.loaded == loaded  # models stay loaded between runs
    assert len(g.report.generations) == 1
    g.prompts.value = "  "
    g.run()
    assert "at least one prompt" in g.error.value


def test_generation_compare_shows_a_readable_end_mark(data):
    """A text that ends on the end-of-sequence token shows a readable end mark, never
    the raw token (``<|endoftext|>``), also where the texts part at that token."""
    base = data / "tiny-qwen3"
    g = GenerationCompare({"base": base, "again": base}, prompts=["w1 w2"], max_tokens=4)
    g.run()
    tok = g.loaded["base"][1]
    (eos,) = sorted(eos_ids(tok))[:1]
    raw = tok.decode([eos])
    assert raw.strip(), "the synthetic tokenizer spells its end token"
    words = tok.encode("w1 w2 w3")
    for step in (None, 1, len(words)):
        html = g._marked("base", words + [eos], step, MARK_STYLE)
        assert raw not in html and html.count("t-gen-end") == 1, (step, html)
    assert "t-gen-diverge" in g._marked("base", words + [eos], len(words), MARK_STYLE)
    assert "t-gen-end" not in g._marked("base", words, None, MARK_STYLE)  # it did not end


# -- DecodeRace -------------------------------------------------------------------------------
@pytest.mark.slow  # a timing worker thread
def test_decode_race_runs_in_background(data):
    r = DecodeRace(data / "tiny-qwen3", data / "adapters" / "lora", variants=["base", "fused"],
                   tokens=4, prompt_tokens=4, repeats=1, warmup=0, device="cpu", rounds=2)
    assert r.variants == ["base", "fused"]
    t0 = time.monotonic()
    r.start_button.click()
    assert time.monotonic() - t0 < 1.0 and r.running  # the click returns at once
    assert r.start_button.disabled and not r.stop_button.disabled
    with pytest.raises(RuntimeError):
        r.start()
    result = r.wait(timeout=300)
    assert not r.running and r.error.value == "", r.error.value
    assert [v.variant for v in result.variants] == ["base", "fused"]
    assert all(v.ok for v in result.variants)
    assert r.updates == 4 and r.progress.value == r.progress.max == 4  # 2 variants x 2 rounds
    assert r.progress.bar_style == "success"
    assert isinstance(r.chart.figure, Figure) and r.chart.value[:4] == b"\x89PNG"
    assert "fused" in r.table.value and "finished" in r.status.value
    assert not r.start_button.disabled and r.stop_button.disabled


@pytest.mark.slow  # a timing worker thread
def test_decode_race_stop(data):
    r = DecodeRace(data / "tiny-qwen3", data / "adapters" / "lora", tokens=4, prompt_tokens=4,
                   repeats=1, warmup=0, device="cpu", rounds=1)
    seen = []
    r.start()
    deadline = time.monotonic() + 300
    while r.running and r.updates == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    seen.append(r.updates)
    r.stop_button.click()
    r.wait(timeout=120)
    assert not r.running
    assert seen[0] >= 1 and len(r.result.variants) < 5
    assert r.status.value.startswith("stopped")
