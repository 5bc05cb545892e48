"""Fixtures for the real-browser suite: JupyterLab on 127.0.0.1, headless Chromium.

The server is started once per session on a free loopback port with a random token,
serving a temporary copy of ``notebooks/`` (Lab autosaves outputs into what it
opens; the repository's notebooks stay stripped). Its configuration, runtime,
settings and workspace folders are temporary too, so nothing on the machine leaks
in and nothing is left behind. Chromium is the Debian package driven by Playwright
for Python (``executable_path``), never a browser Playwright downloads.

Every test gets a fresh browser context and page; a screenshot of the page is saved
under ``test-artifacts/`` when the test ends, pass or fail.

Environment:
    LORAKIT_CHROMIUM: the Chromium binary (default /usr/bin/chromium).
    LORAKIT_REQUIRE_BROWSER=1: fail instead of skipping when Chromium or Playwright is
        missing (set in CI, so the suite cannot silently vanish).
    LORAKIT_DATA: the data/ folder the kernels use (default: the repository's).
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
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts"
CHROMIUM = os.environ.get("LORAKIT_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--disable-dev-shm-usage"]
# Lab settings written before the server starts: no news toast over the page, and
# every cell kept in the DOM (windowing would detach cells scrolled out of view).
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
        {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings":
        {"windowingMode": "none"},
}


def _missing() -> str:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright (pip) is not installed"
    if not Path(CHROMIUM).exists():
        return f"no Chromium at {CHROMIUM} (apt-get install -y chromium)"
    return ""


@pytest.fixture(scope="session", autouse=True)
def _browser_available() -> None:
    why = _missing()
    if why:
        if os.environ.get("LORAKIT_REQUIRE_BROWSER") == "1":
            pytest.fail(f"browser suite required but {why}")
        pytest.skip(why)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Lab:
    """A running JupyterLab server."""

    url: str
    token: str
    root: Path
    proc: subprocess.Popen
    log: Path

    def notebook_url(self, name: str) -> str:
        # A fresh workspace per test: otherwise Lab restores the previous test's tabs.
        return (f"{self.url}/lab/workspaces/t{uuid.uuid4().hex[:10]}/tree/{name}"
                f"?reset&token={self.token}")


@pytest.fixture(scope="session")
def lab(tmp_path_factory) -> Iterator[Lab]:
    base = tmp_path_factory.mktemp("lab")
    root = base / "notebooks"
    shutil.copytree(REPO / "notebooks", root,
                    ignore=shutil.ignore_patterns(".ipynb_checkpoints", "*.md"))
    for nb in (Path(__file__).parent / "notebooks").glob("*.ipynb"):
        shutil.copy(nb, root / nb.name)
    settings = base / "user-settings"
    for rel, value in LAB_SETTINGS.items():
        p = settings / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(value))
    tmp = base / "tmp"
    tmp.mkdir()
    env = dict(os.environ)
    env.update({
        "JUPYTER_CONFIG_DIR": str(base / "config"),
        "JUPYTER_RUNTIME_DIR": str(base / "runtime"),
        "JUPYTER_DATA_DIR": str(base / "data"),
        "JUPYTERLAB_SETTINGS_DIR": str(settings),
        "JUPYTERLAB_WORKSPACES_DIR": str(base / "workspaces"),
        "IPYTHONDIR": str(base / "ipython"),
        "LORAKIT_DATA": os.environ.get("LORAKIT_DATA") or str(REPO / "data"),
        "TMPDIR": str(tmp),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    })
    env.pop("MPLBACKEND", None)  # the kernel must pick the inline backend itself
    port, token = _free_port(), uuid.uuid4().hex
    log = base / "lab.log"
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1",
           f"--port={port}", "--port-retries=0", f"--IdentityProvider.token={token}",
           f"--ServerApp.root_dir={root}", "--allow-root"]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(proc)
            pytest.fail("JupyterLab did not start:\n" + log.read_text()[-3000:])
        time.sleep(0.2)
    try:
        yield Lab(url, token, root, proc, log)
    finally:
        _stop(proc, f"{url}/api/shutdown?token={token}")
        ARTIFACTS.mkdir(exist_ok=True)
        shutil.copy(log, ARTIFACTS / "jupyterlab.log")


def _stop(proc: subprocess.Popen, shutdown_url: str = "") -> None:
    """Stop the server; its API shutdown also stops its kernels (each kernel runs in a
    session of its own, so signalling the server's process group would miss them)."""
    if shutdown_url and proc.poll() is None:
        try:
            urllib.request.urlopen(urllib.request.Request(shutdown_url, method="POST"),
                                   timeout=10).close()
            proc.wait(timeout=15)
        except (OSError, subprocess.TimeoutExpired):
            pass
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)


@pytest.fixture(scope="session")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser, request):
    context = browser.new_context(viewport={"width": 1400, "height": 1400})
    context.set_default_timeout(30_000)
    pg = context.new_page()
    try:
        yield pg
    finally:
        ARTIFACTS.mkdir(exist_ok=True)
        try:
            pg.screenshot(path=str(ARTIFACTS / f"{request.node.name}.png"), full_page=True)
        except Exception:  # a crashed page must not hide the test's own failure
            pass
        context.close()


# -- driving a notebook ---------------------------------------------------------------------
# One JS probe for the state of a notebook run: the status bar's kernel text, the input
# prompts of the code cells ("[3]:", "[*]:", "[ ]:") and whether an error output exists.
_STATE_JS = """() => {
  const status = [...document.querySelectorAll('.jp-StatusBar-Item')]
      .map(e => e.textContent).find(t => t.includes('(ipykernel) |')) || '';
  const prompts = [...document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt')]
      .map(e => e.textContent.trim());
  const errors = [...document.querySelectorAll('.jp-OutputArea-output')]
      .filter(e => e.getAttribute('data-mime-type') === 'application/vnd.jupyter.stderr')
      .map(e => e.textContent).filter(t => /Traceback \\(most recent call last\\)/.test(t));
  return {status, prompts, errors};
}"""


class NotebookPage:
    """A notebook open in JupyterLab, with the few actions the tests need."""

    def __init__(self, page, lab: Lab, name: str) -> None:
        self.page = page
        self.lab = lab
        self.name = name

    def state(self) -> dict:
        return self.page.evaluate(_STATE_JS)

    def wait_idle(self, timeout_s: float = 60) -> None:
        # Wait for the status bar's "(ipykernel) | Idle": the toolbar's execution
        # indicator goes idle before the kernel is really ready (Run All then drops cells).
        self.page.wait_for_function(
            "() => [...document.querySelectorAll('.jp-StatusBar-Item')]"
            ".some(e => e.textContent.includes('(ipykernel) | Idle'))",
            timeout=timeout_s * 1000)

    def open(self) -> "NotebookPage":
        self.page.goto(self.lab.notebook_url(self.name))
        self.page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
        self.wait_idle()
        return self

    def run_all(self, timeout_s: float = 120) -> dict:
        """Run every cell from the Run menu and wait until all ran or one failed."""
        self.page.get_by_role("menuitem", name="Run", exact=True).click()
        self.page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.state()
            idle = st["status"].endswith("| Idle")
            busy = any("*" in p for p in st["prompts"])
            done = all(re.fullmatch(r"\[\d+\]:", p) for p in st["prompts"])
            if idle and not busy and (done or st["errors"]):
                return st
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: Run All did not finish in {timeout_s} s: "
                                     f"{st['status']!r}, prompts {st['prompts']}")
            time.sleep(0.25)

    def run_code(self, code: str) -> None:
        """Append a code cell at the end, type ``code`` into it and run it."""
        p = self.page
        # select the last cell by its prompt (a click on its output could hit a widget)
        p.locator(".jp-Notebook .jp-Cell .jp-InputPrompt").last.click()
        p.keyboard.press("Escape")  # command mode: single keys are commands
        p.keyboard.press("b")  # insert a cell below and select it
        p.keyboard.press("Enter")  # edit mode
        p.wait_for_selector(".jp-Notebook .jp-Cell.jp-mod-active .cm-content:focus")
        p.keyboard.type(code)
        p.keyboard.press("Shift+Enter")


@pytest.fixture
def notebook(page, lab):
    """Open a notebook of the served folder: ``nb = notebook("02_....ipynb")``."""

    def _open(name: str) -> NotebookPage:
        return NotebookPage(page, lab, name).open()

    return _open


@pytest.fixture
def driver(page):
    """Drive a notebook already open in ``page`` from another server (the walkthrough's):
    ``nb = driver("01_....ipynb")``; ``nb.run_all()``."""
    return lambda name: NotebookPage(page, None, name)
