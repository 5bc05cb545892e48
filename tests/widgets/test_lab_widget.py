"""AdapterLab without a browser: move the slider, click a cell, change the prompt; the
panes show what LabSession.point computes, and a move made during an update supersedes
it (tests/browser/test_lab_redraw.py drives the same in JupyterLab and times it)."""
from __future__ import annotations

import html
import re

import pytest
from helpers import DATA

pytest.importorskip("ipywidgets")
pytest.importorskip("matplotlib")

pytestmark = [pytest.mark.skipif(not (DATA / "adapters" / "lora" / "adapters.safetensors")
                                 .exists(), reason="embedded assets not built"),
              pytest.mark.slow]  # layer_effects by module, then a point per move


@pytest.fixture(scope="module")
def lab():
    from lorakit.widgets import AdapterLab

    return AdapterLab(str(DATA / "tiny-qwen3"), str(DATA / "adapters" / "lora"), tokens=32,
                      context=32, max_tokens=12)


def test_slider_cell_and_prompt_redraw(lab) -> None:
    assert lab.point.scale == 1.0 and lab.figure.figure is not None
    assert "<|endoftext|>" not in "".join(p.value for p in lab.panes.values())
    for v in (0.3, 0.4, 0.5):  # three quick moves: the last one is what shows
        lab.scale.value = v
    assert lab.wait(60)
    assert lab.point.scale == 0.5 and "scale 0.5" in lab.panes["current"].value
    ref = lab.session.point(0.5, prompt=lab.prompt.value, max_tokens=12)
    assert lab.point.stats["base"]["mean_kl"] == ref.stats["base"]["mean_kl"]
    shown = html.unescape(re.sub("<[^>]+>", "", lab.panes["current"].value))
    assert lab.prompt.value + "".join(ref.segments["current"]) in shown
    cell, names = next((k, m) for k, m in lab.members.items() if m)
    lab.cells[cell].click()
    assert lab.wait(60) and lab.point.off == sorted(names)
    assert lab.cells[cell].description == "off"
    lab.cells[cell].click()
    assert lab.wait(60) and lab.point.off == [] and lab.cells[cell].description != "off"
    lab.prompt.value = "The scientist said,"
    assert lab.wait(60) and "The scientist said," in lab.panes["base"].value


def test_every_cell_is_a_module_of_the_effects(lab) -> None:
    groups = sorted(r["group"] for r in lab.effects.rows)
    assert sorted(n for m in lab.members.values() for n in m) == groups == sorted(
        lab.session.names)
