"""The figures a notebook shows are readable: tick labels of at least 9 px that do not
overlap, in model order, and legends that cover no bar."""
from __future__ import annotations

import random

import pytest

from lorakit.inspect import plots
from lorakit.timing.compare import load_benchmark

KINDS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _names(layers: int) -> list:
    return [f"model.layers.{i}.{k}" for i in range(layers) for k in KINDS]


def _drawn(fig):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).draw()
    return fig


def _boxes(fig, texts):
    r = fig.canvas.get_renderer()
    return [t.get_window_extent(r) for t in texts if t.get_visible() and t.get_text()]


def _overlap(a, b) -> bool:
    return a.x0 < b.x1 - 0.5 and b.x0 < a.x1 - 0.5 and a.y0 < b.y1 - 0.5 and b.y0 < a.y1 - 0.5


@pytest.mark.parametrize("layers", [4, 28])
def test_grouped_bars_ticks_are_readable_and_in_model_order(layers):
    names = _names(layers)
    shuffled = random.Random(0).sample(names, len(names))  # reports list them in any order
    vals = {n: float(i) for i, n in enumerate(names)}
    fig = plots.grouped_bars(shuffled, {"A": [vals[n] for n in shuffled],
                                        "B": [vals[n] + 0.5 for n in shuffled]},
                             title="t", ylabel="y")
    _drawn(fig)
    ax = fig.axes[0]
    assert fig.get_figwidth() <= 10  # shown at its size in a notebook, not scaled down
    labels = [t for t in ax.get_xticklabels() if t.get_text()]
    assert all(t.get_fontsize() * fig.dpi / 72 >= 9 for t in labels)
    boxes = _boxes(fig, labels)
    assert not any(_overlap(a, b) for a, b in zip(boxes, boxes[1:]))
    texts = [t.get_text() for t in labels]
    assert texts[0] == "L0 q" and (texts[1] == "L0 k" if layers == 4 else texts[-1] != "")
    assert (len(texts) == len(names)) == (layers == 4)  # 196 names: every k-th labelled
    # bars follow the labels: A's heights rise in model order
    heights = [p.get_height() for p in ax.containers[0]]
    assert heights == sorted(heights)
    # the legend covers no bar
    leg = ax.get_legend().get_window_extent(fig.canvas.get_renderer())
    assert not any(_overlap(leg, p.get_window_extent()) for c in ax.containers for p in c)


def test_decode_timing_legend_covers_no_bar_or_label():
    fig = _drawn(load_benchmark("h200-qwen3-8b.json").plot())
    r = fig.canvas.get_renderer()
    ax = fig.axes[1]
    leg = ax.get_legend().get_window_extent(r)
    covered = [p.get_window_extent(r) for c in ax.containers for p in c]
    covered += _boxes(fig, ax.texts)  # the "1.38x" labels over the bars
    assert covered and not any(_overlap(leg, b) for b in covered)
    assert ax.get_legend().get_texts()[0].get_fontsize() * fig.dpi / 72 >= 9
