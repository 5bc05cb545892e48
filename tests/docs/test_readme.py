"""The README's Python example and the CLI reference's commands run as written (from the
repository root); the README's set-up times are measured; the CLI reference names every
subcommand."""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


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
    import sys
    import time
    import urllib.error
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, LORAKIT_NO_SETUP="1", LORAKIT_VENV=sys.prefix)
    p = subprocess.Popen(["bash", str(ROOT / "tools" / "walkthrough.sh"), "--no-browser",
                          f"--port={port}", "--ServerApp.port_retries=0"],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    lines, path, token, served = [], None, None, None
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(rf"http://(?:localhost|127\.0\.0\.1):{port}(/\S*)\?token=(\w+)", line)
            if m:
                path, token = m.groups()
                break
        if path and path.startswith("/lab/tree/"):
            # the server itself must find the file the URL names (given a notebook
            # argument, Jupyter once served notebooks/ and this path was missing)
            api = f"http://127.0.0.1:{port}/api/contents/{path[len('/lab/tree/'):]}"
            while served is None and time.monotonic() < deadline:
                try:  # the script prints the URL before the server has started listening
                    with urllib.request.urlopen(f"{api}?content=0&token={token}",
                                                timeout=30) as r:
                        served = json.loads(r.read())
                except ConnectionError:
                    time.sleep(0.5)
                except urllib.error.URLError as e:
                    if not isinstance(e.reason, ConnectionError):
                        raise
                    time.sleep(0.5)
    finally:
        p.terminate()
        p.wait(timeout=30)
    assert path is not None, "".join(lines)
    assert path.startswith("/lab/tree/notebooks/") and path.endswith(".ipynb"), path
    assert (ROOT / path[len("/lab/tree/"):]).is_file()
    assert served is not None and served["type"] == "notebook", served


@pytest.mark.slow  # runs the README's and docs/cli.md's commands in fresh processes
def test_readme_examples_run_in_either_order(tmp_path: Path) -> None:
    """docs/cli.md's shell example's complete `lorakit` lines, then the README's Python
    example, then the shell lines again: each finds the other's outputs in scratch/ and
    replaces them."""
    import subprocess
    import sys

    text = (ROOT / "README.md").read_text()
    cli_doc = (ROOT / "docs" / "cli.md").read_text()
    shell = re.search(r"```bash\nlorakit fuse (.*?)```", cli_doc, re.S).group(0)
    lines = [ln.split("#")[0].strip() for ln in shell.splitlines()[1:-1]]
    lines = [ln for ln in lines if ln.startswith("lorakit ") and "..." not in ln
             and not ln.startswith(("lorakit time-decode", "lorakit synth checkpoint",
                                    "lorakit synth adapter"))]  # minutes, gigabytes
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


def _setup_copy(tmp_path: Path) -> Path:
    """tools/setup.sh alone in an empty folder laid out like the repository."""
    (tmp_path / "tools").mkdir()
    shutil.copy(ROOT / "tools" / "setup.sh", tmp_path / "tools" / "setup.sh")
    return tmp_path


def test_setup_shows_a_failing_steps_output_and_status(tmp_path: Path) -> None:
    """Set-up hides what tools print while they succeed, but a failing step's own output
    (the error a user needs) is shown, with its exit status, and set-up stops there."""
    import subprocess

    repo = _setup_copy(tmp_path)
    py = tmp_path / "broken-python"
    py.write_text("#!/bin/sh\necho 'chatter a user does not need'\n"
                  "echo 'Error: [Errno 28] No space left on device' >&2\nexit 3\n")
    py.chmod(0o755)
    r = subprocess.run(["bash", "tools/setup.sh"], cwd=repo, capture_output=True, text=True,
                       env=dict(os.environ, PYTHON=str(py), TMPDIR=str(tmp_path)))
    assert r.returncode == 3
    assert r.stdout.splitlines() == [f"setup: creating .venv with {py} ... failed (exit 3)"]
    assert "Error: [Errno 28] No space left on device" in r.stderr
    assert "chatter a user does not need" in r.stderr  # the whole log, not a guess at it
    assert not (repo / ".venv").exists()
    assert not list(tmp_path.glob("lorakit-setup.*"))  # its log is removed


@pytest.mark.slow  # a fresh virtual environment and every dependency: minutes
def test_setup_prints_progress_only(tmp_path: Path) -> None:
    """A real set-up in a fresh copy: one line per step, none of pip's notices or
    setuptools' experimental-backend and editable-install banners."""
    import subprocess

    repo = tmp_path / "repo"
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    for f in files:
        if (ROOT / f).is_file():
            (repo / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, repo / f)
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    r = subprocess.run(["bash", "tools/setup.sh"], cwd=repo, capture_output=True, text=True,
                       env=dict(env, TMPDIR=str(tmp_path)))
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert all(re.fullmatch(r"setup: .+ \.\.\. done \(\d+ s\)", ln) for ln in lines[:-1]), lines
    assert re.fullmatch(r"setup: ready \(\.venv/bin/python; \d+ s in all\)", lines[-1])
    assert any("installing lorakit" in ln for ln in lines)
    assert r.stderr == ""
    assert (repo / ".venv" / "bin" / "python").exists()


def test_readme_setup_times_are_the_committed_measurement() -> None:
    """The set-up and walkthrough times the README states are those of the committed
    benchmark JSON (rounded to seconds), next to the command that wrote it."""
    import json

    text = " ".join((ROOT / "README.md").read_text().split())
    d = json.loads((ROOT / "benchmarks" / "results" / "readme_commands.json").read_text())
    fresh = d["setup_fresh"]
    install = next(ln for ln in fresh["stdout"] if "installing lorakit" in ln)
    install_s = int(re.search(r"done \((\d+) s\)", install).group(1))
    assert fresh["exit"] == 0 and d["setup_again"]["exit"] == 0
    assert (f"set-up in a fresh copy {fresh['seconds']:.0f} s ({install_s} s of it installing "
            "the dependencies)") in text
    assert f"{d['setup_again']['seconds']:.0f} s when `.venv` is already set up" in text
    assert f"prints its URL {d['walkthrough_until_url']['seconds']:.0f} s later" in text
    assert d["walkthrough_until_url"]["url"].endswith("/lab/tree/notebooks/"
                                                      "01_why_dtype_matters.ipynb")
    assert d["command"] in text
    setup_doc = " ".join((ROOT / "docs" / "setup.md").read_text().split())
    assert f"(`{install}`)" in setup_doc  # the example line there is the measured one


def test_cli_doc_lists_every_subcommand() -> None:
    """docs/cli.md's subcommand table names every subcommand the CLI registers, and no
    other."""
    import argparse

    from lorakit.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    listed = re.findall(r"^\| `lorakit ([\w-]+)` \| \S", (ROOT / "docs" / "cli.md").read_text(),
                        re.M)
    assert sorted(listed) == sorted(sub.choices), listed
