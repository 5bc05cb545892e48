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
    assert (tmp_path / "scratch" / "fused" / "config.json").exists()
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


@pytest.mark.slow  # runs the README's commands in fresh processes
def test_readme_examples_run_in_either_order(tmp_path: Path) -> None:
    """The shell example's complete `lorakit` lines, then the Python example, then the
    shell lines again: each finds the other's outputs in scratch/ and replaces them."""
    import subprocess
    import sys

    text = (ROOT / "README.md").read_text()
    shell = re.search(r"```bash\nlorakit fuse (.*?)```", text, re.S).group(0)
    lines = [ln.split("#")[0].strip() for ln in shell.splitlines()[1:-1]]
    lines = [ln for ln in lines if ln.startswith("lorakit ") and "..." not in ln
             and not ln.startswith("lorakit bench")]
    assert any(ln.startswith("lorakit fuse") for ln in lines), lines
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    code = "\n".join(ln for ln in code.splitlines() if "time_decode" not in ln)
    shutil.copytree(ROOT / "data", tmp_path / "data",
                    ignore=shutil.ignore_patterns(".build", "corpora", "logs"))
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")

    def run_shell() -> None:
        for ln in lines:
            r = subprocess.run([sys.executable, "-m", "lorakit", *ln.split()[1:]], cwd=tmp_path,
                               env=env, capture_output=True, text=True)
            ok = (0, 1) if ln.startswith("lorakit diff") else (0,)  # diff: 1 = they differ
            assert r.returncode in ok and not r.stderr.strip(), (ln, r.stderr)

    run_shell()
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    run_shell()
    assert sorted(p.name for p in (tmp_path / "scratch").iterdir()) == ["fused", "mlx-fused"]
