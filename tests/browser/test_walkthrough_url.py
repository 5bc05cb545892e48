"""The README's first command, as a newcomer meets it: ``bash tools/walkthrough.sh``
prints a URL, and opening that URL in a browser shows the walkthrough notebook itself,
not JupyterLab's Launcher.

The script runs as written from a temporary copy of ``tools/``, ``notebooks/`` and
``.gitignore`` committed to a fresh git repository, on the environment that runs the tests
(``LORAKIT_VENV``; set-up skipped), with temporary Jupyter folders. It serves a copy of the notebooks in ``scratch/walkthrough/`` (Lab
saves what it opens) and says so; the notebooks it was given stay byte for byte as
they were. The URL is the one the script prints, token and all; the browser is the
suite's Chromium.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = "01_why_dtype_matters.ipynb"

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def printed_url(tmp_path):
    """Start tools/walkthrough.sh in a copy of the repository; yield the URL it prints."""
    root = tmp_path / "repo"
    (root / "tools").mkdir(parents=True)
    shutil.copy(REPO / "tools" / "walkthrough.sh", root / "tools" / "walkthrough.sh")
    shutil.copytree(REPO / "notebooks", root / "notebooks",
                    ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    shutil.copy(REPO / ".gitignore", root / ".gitignore")
    for args in (["init", "-q"], ["add", "-A"], ["-c", "user.name=t", "-c", "user.email=t@t",
                                                 "commit", "-qm", "copy"]):
        subprocess.run(["git", *args], cwd=root, check=True)
    settings = tmp_path / "user-settings"
    for rel, value in {  # no news toast over the page; every cell kept in the DOM
        "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
            {"fetchNews": "false", "checkForUpdates": False},
        "@jupyterlab/notebook-extension/tracker.jupyterlab-settings":
            {"windowingMode": "none"}}.items():
        (settings / rel).parent.mkdir(parents=True, exist_ok=True)
        (settings / rel).write_text(json.dumps(value))
    (tmp_path / "tmp").mkdir()
    env = dict(os.environ, LORAKIT_NO_SETUP="1", LORAKIT_VENV=sys.prefix,
               JUPYTER_CONFIG_DIR=str(tmp_path / "config"),
               JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               JUPYTER_DATA_DIR=str(tmp_path / "data"),
               JUPYTERLAB_SETTINGS_DIR=str(settings),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"),
               IPYTHONDIR=str(tmp_path / "ipython"), TMPDIR=str(tmp_path / "tmp"),
               LORAKIT_DATA=os.environ.get("LORAKIT_DATA") or str(REPO / "data"))
    port = _free_port()
    proc = subprocess.Popen(["bash", "tools/walkthrough.sh", "--no-browser",
                             "--ip=127.0.0.1", f"--port={port}", "--port-retries=0"],
                            cwd=root, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list = []
    found: list = []

    def read() -> None:  # keep draining the pipe so the server never blocks on it
        for line in proc.stdout:
            lines.append(line)
            m = re.search(rf"(http://127\.0\.0\.1:{port}/\S+\?token=\w+)", line)
            if m and not found:
                found.append(m.group(1))

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + 90
    while not found and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        assert found, "walkthrough.sh printed no URL:\n" + "".join(lines)[-3000:]
        yield found[0]
        # it served a copy, said so, and left the tracked notebooks as they were
        assert any("opening a copy of notebooks/ in scratch/walkthrough/notebooks" in x
                   for x in lines), "".join(lines)[-3000:]
        assert (root / "scratch" / "walkthrough" / "notebooks" / NOTEBOOK).is_file()
        for nb in (REPO / "notebooks").glob("*.ipynb"):
            assert (root / "notebooks" / nb.name).read_bytes() == nb.read_bytes(), nb.name
        status = subprocess.run(["git", "status", "--porcelain"], cwd=root, text=True,
                                capture_output=True, check=True).stdout
        assert status == "", status
    finally:
        token = found[0].rsplit("token=", 1)[1] if found else ""
        try:
            urllib.request.urlopen(urllib.request.Request(
                f"http://127.0.0.1:{port}/api/shutdown?token={token}", method="POST"),
                timeout=10).close()
            proc.wait(timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def test_printed_url_opens_the_walkthrough_notebook(printed_url, page):
    assert f"/lab/tree/notebooks/{NOTEBOOK}?token=" in printed_url, printed_url
    page.goto(printed_url)
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
    # the notebook is the open, current document: its tab, its first heading
    tab = page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current")
    assert tab.inner_text().strip() == NOTEBOOK
    first = json.loads((REPO / "notebooks" / NOTEBOOK).read_text())["cells"][0]["source"]
    heading = first[0].lstrip("# ").strip()
    from playwright.sync_api import expect  # lazy: conftest skips (or fails) without it

    expect(page.locator(".jp-Notebook .jp-Cell").first).to_contain_text(heading,
                                                                        timeout=30_000)
    # and the Launcher is nowhere: not shown, not even in a background tab
    assert page.locator(".jp-Launcher").count() == 0
    assert not any("Launcher" in t for t in
                   page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab").all_inner_texts())


def test_run_all_in_the_walkthrough_leaves_git_clean(printed_url, page, driver, tmp_path):
    """A newcomer's session: open the printed URL, Run All, save, reload the page (the
    notebook reopens on its running kernel): the widget cells show their widgets, not
    "model not found", and git sees no change (the fixture checks it when the server
    stops)."""
    page.goto(printed_url)
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
    nb = driver(NOTEBOOK)
    nb.wait_idle()
    st = nb.run_all(timeout_s=240)
    assert not st["errors"], st["errors"]
    page.keyboard.press("Escape")
    page.keyboard.press("Control+s")
    page.wait_for_function("() => !document.querySelector('.jp-mod-dirty')")
    saved = json.loads((tmp_path / "repo" / "scratch" / "walkthrough" / "notebooks"
                        / NOTEBOOK).read_text())  # the fixture's copy (same tmp_path)
    assert any(o.get("data", {}).get("application/vnd.jupyter.widget-view+json")
               for c in saved["cells"] for o in c.get("outputs", [])), "no widget saved"
    page.reload()
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
    view = page.locator(".t-dtype-map-view")
    view.wait_for(timeout=60_000)
    assert view.locator(".t-dtype-cell").count() > 0
    text = page.locator(".jp-Notebook").inner_text()
    assert "Error displaying widget" not in text and "model not found" not in text
    # readable: no kind header ("embedding") runs into the next ("q proj"), byte counts
    # carry separators, a report's sentences are not squeezed to a word per line
    heads = view.locator(".t-dtype-head b")
    boxes = [heads.nth(i).bounding_box() for i in range(heads.count())]
    assert len(boxes) > 5 and all(
        a["x"] + a["width"] <= b["x"] + 0.5 for a, b in zip(boxes, boxes[1:])), boxes
    assert all(heads.nth(i).evaluate("e => e.scrollWidth <= e.clientWidth + 1")
               for i in range(heads.count()))
    facts = view.locator(".t-dtype-summary").inner_text()
    assert re.search(r"^bytes\s+\d{1,3}(,\d{3})+$", facts, re.M), facts
    long_cells = page.locator(".lorakit-report td[style*='min-width']:visible")
    assert long_cells.count() > 0
    timing = page.locator(".lorakit-report", has_text="Decode timing").first
    timing.scroll_into_view_if_needed()
    timing.screenshot(path=str(REPO / "test-artifacts" / "walkthrough-timing-table.png"))
    assert min(long_cells.nth(i).bounding_box()["width"]
               for i in range(long_cells.count())) >= 150
