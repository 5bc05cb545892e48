"""The README's Python example runs as written (from the repository root)."""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # copies data/ and runs the README's fuse and checks
def test_readme_python_example_runs(tmp_path: Path) -> None:
    text = (ROOT / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    shutil.copytree(ROOT / "data", tmp_path / "data",
                    ignore=shutil.ignore_patterns(".build", "corpora", "logs"))
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        ns: dict = {}
        exec(compile(code, "README.md", "exec"), ns)
    finally:
        os.chdir(cwd)
    assert (tmp_path / "fused" / "config.json").exists()
    assert ns["result"].tensors_fused > 0


@pytest.mark.slow  # starts a JupyterLab server
def test_walkthrough_url_opens_the_notebook_itself() -> None:
    """The first README command prints a URL that opens the walkthrough notebook, not
    the Launcher; the notebook it names exists."""
    import socket
    import subprocess
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, LORAKIT_NO_SETUP="1")
    p = subprocess.Popen(["bash", str(ROOT / "tools" / "walkthrough.sh"), "--no-browser",
                          f"--port={port}", "--ServerApp.port_retries=0"],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    lines, path = [], None
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(rf"http://(?:localhost|127\.0\.0\.1):{port}(/\S*)\?token=", line)
            if m:
                path = m.group(1)
                break
    finally:
        p.terminate()
        p.wait(timeout=30)
    assert path is not None, "".join(lines)
    assert path.startswith("/lab/tree/notebooks/") and path.endswith(".ipynb"), path
    assert (ROOT / path[len("/lab/tree/"):]).is_file()
