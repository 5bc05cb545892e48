"""Report tables as a newcomer reads them: rows in model order (layer numerically, then
kind), long tables collapsed behind a summary line in HTML and cut with a count in
text, every column explained (hover in HTML, a legend in text); the HTML table builder escapes
every value once.

Built on :class:`Report` itself with made-up rows (no files), so each rule is seen
failing on the order, count or text it guards. That every real report explains every
column it shows is checked in tests/project/test_text_twins.py, on the reports themselves.
"""
from __future__ import annotations

import html
import re

from lorakit.layers import model_order
from lorakit.report import COLLAPSE_ROWS, FLAGGED, Cell, Markup, Report, facts_table, table

# file order as a checkpoint may hold it: layers 10, 2, 0, 1 mixed, embed and head inside
FILE_ORDER = [
    "model.layers.10.mlp.down_proj.weight",
    "model.layers.2.self_attn.v_proj.weight",
    "lm_head.weight",
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.2.self_attn.q_proj.weight",
    "model.norm.weight",
    "model.layers.1.input_layernorm.weight",
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.10.self_attn.q_proj.weight",
]
MODEL_ORDER = [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.1.input_layernorm.weight",
    "model.layers.2.self_attn.q_proj.weight",
    "model.layers.2.self_attn.v_proj.weight",
    "model.layers.10.self_attn.q_proj.weight",
    "model.layers.10.mlp.down_proj.weight",
    "model.norm.weight",
    "lm_head.weight",
]


class _Tensors(Report):
    column_help = {"tensor": "the tensor's name", "n": "a number < 5 & > 1"}


def _report(names, flagged=(), **kw) -> _Tensors:
    return _Tensors(title="t", rows=[{"tensor": n, "n": i} for i, n in enumerate(names)],
                    columns=["tensor", "n"], flagged=list(flagged), **kw)


def _text_rows(text: str) -> list:
    return re.findall(r"^[ !] (\S+\.weight)", text, re.M)


def _html_rows(out: str) -> list:
    return re.findall(r"<tr[^>]*><td>([^<]+\.weight)</td>", out)


def test_model_order_sorts_layers_numerically_then_kind():
    assert [FILE_ORDER[i] for i in model_order(FILE_ORDER)] == MODEL_ORDER
    # a plain text sort would put 10 before 2: the order is numeric
    names = ["x.layers.10.q_proj", "x.layers.2.q_proj", "x.layers.0.q_proj", "x.layers.1.q_proj"]
    assert [names[i] for i in model_order(names)] == [
        "x.layers.0.q_proj", "x.layers.1.q_proj", "x.layers.2.q_proj", "x.layers.10.q_proj"]
    # experts numerically too, and equal names keep their order (stable)
    ex = ["l.layers.0.mlp.experts.10.up_proj", "l.layers.0.mlp.experts.2.up_proj", "a", "a"]
    assert model_order(ex)[:2] == [1, 0] and model_order(ex)[2:] == [2, 3]


def test_text_and_html_show_rows_in_model_order():
    rep = _report(FILE_ORDER)
    assert _text_rows(str(rep)) == MODEL_ORDER
    assert _html_rows(rep._repr_html_()) == MODEL_ORDER
    # the data keeps the order it was made in, and its numbers stay with their rows
    assert [r["tensor"] for r in rep.rows] == FILE_ORDER
    line = next(ln for ln in str(rep).splitlines() if "lm_head" in ln)
    assert line.split()[-1] == "2"


def test_flag_marks_follow_their_rows_after_sorting():
    rep = _report(FILE_ORDER, flagged=[FILE_ORDER.index("model.norm.weight")])
    marked = [ln for ln in str(rep).splitlines() if ln.startswith("!")]
    assert len(marked) == 1 and "model.norm.weight" in marked[0]
    out = rep._repr_html_()
    flagged_row = re.findall(r"<tr style='background:#fdd'><td>([^<]+)</td>", out)
    assert flagged_row == ["model.norm.weight"]


def test_rows_without_tensor_names_keep_their_order():
    rep = Report(title="t", rows=[{"variant": v} for v in ("base", "unfused", "fused")])
    assert re.findall(r"^  (base|unfused|fused)$", str(rep), re.M) == ["base", "unfused", "fused"]


def _layers(n: int) -> list:
    return [f"model.layers.{i}.self_attn.q_proj.weight" for i in range(n)]


def test_long_tables_start_collapsed_short_ones_open():
    short = _report(_layers(COLLAPSE_ROWS))._repr_html_()
    assert "<details open><summary>20 rows</summary>" in short
    long = _report(_layers(COLLAPSE_ROWS + 1), flagged=[3])._repr_html_()
    m = re.search(r"<details(?P<open>[^>]*)><summary>(?P<s>[^<]*)</summary>", long)
    assert m and m["open"] == ""  # collapsed
    assert m["s"] == "21 rows, 1 flagged (click to show)"
    assert len(_html_rows(long)) == COLLAPSE_ROWS + 1  # collapsed, not cut


def test_text_shows_the_first_rows_and_says_how_many_more():
    names = _layers(30)
    rep = _report(names, max_rows=5)
    text = str(rep)
    assert _text_rows(text) == names[:5]
    assert "  ... 25 more rows ..." in text
    assert "(25 of 30 rows not shown: raise max_rows, or --max-rows in the CLI)" in text
    # a flagged row past the cut is still shown, and the counts say so
    text = str(_report(names, flagged=[20], max_rows=5))
    assert _text_rows(text) == names[:5] + [names[20]]
    assert "  ... 15 rows ..." in text and "  ... 9 more rows ..." in text
    assert "(24 of 30 rows not shown" in text
    # the HTML cuts at the same place and says so too
    out = _report(names, max_rows=5)._repr_html_()
    assert len(_html_rows(out)) == 5 and "&hellip; 25 more rows" in out
    # short tables: no count line
    assert "not shown" not in str(_report(names[:5], max_rows=5))


def test_every_column_is_explained_on_hover_and_in_a_legend():
    rep = _report(FILE_ORDER)
    out = rep._repr_html_()
    heads = re.findall(r"<th title='([^']*)'>([^<]*)</th>", out)
    assert heads == [(html.escape("the tensor's name", quote=True), "tensor"),
                     (html.escape("a number < 5 & > 1", quote=True), "n")]
    text = str(rep)
    legend = text.split("\n  columns:\n", 1)[1].splitlines()
    assert legend == ["    tensor  the tensor's name", "    n       a number < 5 & > 1"]
    # a column without an explanation gets no empty title and no legend line
    bare = Report(title="t", rows=[{"tensor": "a.weight"}])
    assert "title=" not in bare._repr_html_() and "columns:" not in str(bare)


def test_html_table_escapes_once() -> None:
    t = table([["<a>", Cell(Markup("<b>ok</b>"), style="x")]], head=["k&", "v"],
              row_styles={0: FLAGGED})
    assert t == ("<table><thead><tr><th>k&amp;</th><th>v</th></tr></thead><tbody>"
                 "<tr style='background:#fdd'><td>&lt;a&gt;</td><td style='x'><b>ok</b></td>"
                 "</tr></tbody></table>")
    assert facts_table([("a", "<1>")], key_style="s") == \
        "<table><tr><th style='s'>a</th><td style='text-align:left'>&lt;1&gt;</td></tr></table>"


def test_counts_carry_separators_and_sentences_keep_a_readable_width() -> None:
    from lorakit.report import LONG_STYLE, format_value

    assert [format_value(v) for v in (10491392, 9999, -12345, True, 46)] == \
        ["10,491,392", "9,999", "-12,345", "True", "46"]
    import numpy as np
    assert format_value(np.int64(2886400)) == "2,886,400"
    words = "1.82x weight bytes (f32 9.44 MB); same speed within noise"
    rep = Report(title="t", rows=[{"verdict": words, "n": 2886400}])
    html_ = rep._repr_html_()
    assert f"<td style='{LONG_STYLE}'>{words}</td>" in html_ and "<td>2,886,400</td>" in html_
    assert "<div style='overflow-x:auto'><table>" in html_  # wide tables scroll sideways
    assert "2,886,400" in str(rep)
