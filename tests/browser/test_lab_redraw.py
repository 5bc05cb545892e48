"""Notebook 09's AdapterLab in a real JupyterLab: ten slider moves, each timed from the
key press to the redraw of the current-text pane (in the page: performance.now() before
the key, a MutationObserver on the pane), after a heatmap click that switches a layer off.
A second click switches it back on. The times go to test-artifacts/adapter-lab-redraw.json;
benchmarks/lab_widget.py runs this test and commits them (BENCHMARKS.md "The adapter lab").
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

try:
    from playwright.sync_api import expect
except ImportError:  # conftest's fixture skips (or, in CI, fails) and says why
    expect = None

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
TIMES = ARTIFACTS / "adapter-lab-redraw.json"
MOVES = 10

pytestmark = [pytest.mark.browser, pytest.mark.slow]

# Arm a timer: the pane's next mutation that shows ``want`` records the milliseconds since.
_ARM_JS = """([pane, want]) => {
  const L = window.__lab || (window.__lab = {});
  if (!L.observer) {
    L.observer = new MutationObserver(() => {
      if (L.want && L.ms === null && pane.textContent.includes(L.want))
        L.ms = performance.now() - L.t0;
    });
    L.observer.observe(pane, {subtree: true, childList: true, characterData: true});
  }
  L.want = want; L.ms = null; L.t0 = performance.now();
}"""


def test_adapter_lab_slider_and_cell(notebook, page):
    nb = notebook("09_adapter_lab.ipynb")
    st = nb.run_all(timeout_s=300)
    assert not st["errors"], st["errors"]
    lab = page.locator(".t-adapter-lab")
    current = lab.locator(".t-lab-text-current")
    expect(current).to_contain_text("scale 1,", timeout=60_000)
    assert "<|endoftext|>" not in lab.inner_text()
    lab.scroll_into_view_if_needed()
    pane = current.element_handle()

    def timed(action, want: str) -> float:
        page.evaluate(_ARM_JS, [pane, want])
        action()
        page.wait_for_function("() => window.__lab.ms !== null", timeout=60_000)
        return page.evaluate("() => window.__lab.ms") / 1000

    cell = lab.locator(".t-lab-cell:not([disabled])").first
    click_s = timed(cell.click, "LoRA layers off: 1")
    expect(cell).to_have_text("off")
    lab.locator(".t-lab-scale .noUi-handle").focus()
    times = [timed(lambda: page.keyboard.press("ArrowRight"), f"scale {1 + i / 10:g},")
             for i in range(1, MOVES + 1)]  # ten moves of 0.1 from 1, to 2
    timed(cell.click, "LoRA layers off: 0")
    expect(cell).not_to_have_text("off")
    expect(current).to_contain_text("scale 2, LoRA layers off: 0")
    ARTIFACTS.mkdir(exist_ok=True)
    TIMES.write_text(json.dumps({"moves_s": times, "median_s": statistics.median(times),
                                 "cell_click_s": click_s}, indent=1))
    lab.screenshot(path=str(ARTIFACTS / "adapter-lab.png"))
