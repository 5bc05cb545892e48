"""The notebooks and widgets in a real JupyterLab, driven by headless Chromium.

Each test opens a notebook (a temporary copy; see conftest.py), runs all cells from
the Run menu, operates the widgets as a user would (choose options, click) and
asserts that what the page shows changed. Screenshots go to test-artifacts/.

Run: ``pytest -m browser tests/browser`` (Chromium from ``apt-get install chromium``).
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest

try:
    from playwright.sync_api import expect
except ImportError:  # conftest's fixture skips these tests (or fails them, in CI) and says why
    expect = None

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"

pytestmark = [pytest.mark.browser, pytest.mark.slow]

WIDGET_TIMEOUT = 60_000  # ms a widget action may take on a busy 2-core machine


def shot(locator, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    locator.scroll_into_view_if_needed()
    locator.screenshot(path=str(ARTIFACTS / f"{name}.png"))


def wait_changed(locator, attr: str, old: str, timeout_s: float = 60) -> str:
    """Wait until an attribute (or the text, for attr='text') differs from ``old``."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = locator.inner_text() if attr == "text" else locator.get_attribute(attr)
        if now != old:
            return now
        if time.monotonic() > deadline:
            raise AssertionError(f"{attr} did not change from {old[:80]!r}")
        time.sleep(0.1)


def test_walkthrough_runs_and_shows_the_promotion(notebook, page):
    nb = notebook("01_why_dtype_matters.ipynb")
    st = nb.run_all(timeout_s=150)
    assert not st["errors"], st["errors"]
    # figures rendered as images, tables as HTML
    assert page.locator(".jp-OutputArea-output img").count() >= 4
    assert page.locator(".jp-OutputArea-output .lorakit-report table").count() >= 2
    view = page.locator(".t-dtype-map-view")
    expect(view).to_be_visible()
    f32 = view.locator(".t-dtype-cell", has_text="F32")
    assert f32.count() > 0
    # hover detail: the cell's tooltip names its tensor and dtype
    cell = f32.first
    cell.hover()
    assert "F32" in cell.get_attribute("title") and ".weight" in cell.get_attribute("title")
    # click detail: a table of that cell's tensors
    detail = view.locator(".t-dtype-detail")
    before = detail.inner_text()
    cell.click()
    after = wait_changed(detail, "text", before)
    assert "F32" in after and ".weight" in after
    shot(view, "walkthrough-dtype-map")
    assert "<- the bug" in page.locator(".jp-Notebook").inner_text()


def test_fuse_panel_and_ulp_explorer(notebook, page):
    nb = notebook("02_fusing_and_inspecting.ipynb")
    st = nb.run_all(timeout_s=150)
    assert not st["errors"], st["errors"]

    # -- FusePanel: promote, then preserve --------------------------------------------
    panel = page.locator(".t-fuse-panel")
    panel.scroll_into_view_if_needed()
    expect(panel.locator(".t-fuse-base select")).to_have_value("tiny-qwen3")
    panel.locator(".t-fuse-dtype select").select_option("promote")
    panel.locator("button.t-fuse-run").click()
    expect(panel.locator(".t-fuse-status")).to_contain_text("done", timeout=WIDGET_TIMEOUT)
    summary = panel.locator(".t-fuse-summary")
    promoted = summary.inner_text()
    assert "promote" in promoted and "F32" in promoted
    cells = panel.locator(".t-dtype-cell")
    assert panel.locator(".t-dtype-cell", has_text="F32").count() > 0
    figure = panel.locator("img.t-dtype-figure")
    promoted_src = figure.get_attribute("src")
    shot(panel, "fuse-panel-promote")

    panel.locator(".t-fuse-dtype select").select_option("preserve")
    panel.locator("button.t-fuse-run").click()
    kept = wait_changed(summary, "text", promoted)
    assert "preserve" in kept and "F32" not in kept
    expect(panel.locator(".t-dtype-cell", has_text="F32")).to_have_count(0)
    assert cells.count() > 0
    wait_changed(figure, "src", promoted_src)
    shot(panel, "fuse-panel-preserve")

    # -- DiffExplorer: against the exact fuse, then one tensor --------------------------
    ulp = page.locator(".t-diff-explorer")
    ulp.scroll_into_view_if_needed()
    ulp_summary = ulp.locator(".t-ulp-summary")
    ulp_figure = ulp.locator("img.t-ulp-figure")
    first_summary, first_src = ulp_summary.inner_text(), ulp_figure.get_attribute("src")
    assert "nearest vs mlx-lm" in ulp.locator(".t-ulp-status").inner_text()
    ulp.locator(".t-ulp-b select").select_option(label="exact fuse (float64)")
    ulp.locator("button.t-ulp-compare").click()
    ref = wait_changed(ulp_summary, "text", first_summary)
    assert "not correctly rounded" in ref
    ref_src = wait_changed(ulp_figure, "src", first_src)
    # the exact-fuse report has no per-layer view: the view buttons follow the report
    expect(ulp.locator(".t-ulp-view button")).to_have_count(2)
    shot(ulp, "ulp-explorer-reference")

    tensor = ulp.locator(".t-ulp-tensor select")
    name = tensor.locator("option").nth(1).get_attribute("value")
    tensor.select_option(name)
    expect(ulp.locator(".t-ulp-facts")).to_contain_text(name, timeout=WIDGET_TIMEOUT)
    expect(ulp.locator(".t-ulp-view button.mod-active")).to_have_text("tensor")
    wait_changed(ulp_figure, "src", ref_src)
    shot(ulp, "ulp-explorer-tensor")
    # a widget's figure keeps its own size (a box used to stretch it to the cell's width)
    for img in (ulp_figure, figure):
        assert img.evaluate("e => e.getBoundingClientRect().width <= e.naturalWidth + 1")


def test_decode_race_leaves_the_kernel_free(notebook, page):
    nb = notebook("decode_race.ipynb")
    st = nb.run_all(timeout_s=60)
    assert not st["errors"], st["errors"]
    race = page.locator(".t-decode-race")
    status = race.locator(".t-race-status")
    # every box's label reads whole (a fixed width cut "prompt tokens" to "prompt tok...")
    labels = race.locator(".widget-label")
    assert labels.count() >= 3 and "prompt tokens" in race.inner_text()
    assert all(labels.nth(i).evaluate("e => e.scrollWidth <= e.clientWidth + 1")
               for i in range(labels.count()))
    race.locator("button.t-race-start").click()
    expect(race.locator("button.t-race-start")).to_be_disabled()
    # while the race runs, another cell executes at once
    nb.run_code("print('kernel free:', 6 * 7)")
    expect(page.locator(".jp-OutputArea-output", has_text="kernel free: 42")).to_be_visible(
        timeout=15_000)
    assert "finished" not in status.inner_text()
    expect(status).to_contain_text("finished", timeout=180_000)
    expect(race.locator("img.t-race-chart")).to_be_visible()
    assert "fused" in race.locator(".t-race-table").inner_text()
    shot(race, "decode-race")
