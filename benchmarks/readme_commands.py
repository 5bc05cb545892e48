"""How long the README's set-up takes, as a newcomer runs it: wall time of
``bash tools/setup.sh`` in a fresh copy of the repository (no .venv: creates it and
installs everything), of a second run (everything in place), and of
``tools/walkthrough.sh`` (set-up skipped) until JupyterLab prints its URL.

    python benchmarks/readme_commands.py --json benchmarks/results/readme_commands.json

The copy holds the files git tracks (``git ls-files``), in a temporary folder that is
removed afterwards. Output lines of set-up are kept in the JSON, to show what a user sees.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _copy_tracked(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for f in filter(None, files):
        src = ROOT / f
        if src.is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f)


def _timed(cmd, cwd: Path, env: dict) -> dict:
    t = time.perf_counter()
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    return {"seconds": round(time.perf_counter() - t, 1), "exit": r.returncode,
            "stdout": r.stdout.splitlines(), "stderr": r.stderr.splitlines()}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _walkthrough_start(cwd: Path, env: dict) -> dict:
    t = time.perf_counter()
    p = subprocess.Popen(["bash", "tools/walkthrough.sh", "--no-browser", "--ip=127.0.0.1",
                          f"--port={_free_port()}"], cwd=cwd, env=dict(env, LORAKIT_NO_SETUP="1"),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    url = None
    try:
        for line in p.stdout:
            m = re.search(r"(http://\S+/lab/tree/\S+)\?token=", line)
            if m:
                url = m.group(1)
                break
        return {"seconds": round(time.perf_counter() - t, 1), "url": url}
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="lorakit-readme-") as tmp:
        repo = Path(tmp) / "lorakit"
        _copy_tracked(repo)
        env = dict(os.environ, TMPDIR=tmp, JUPYTER_RUNTIME_DIR=f"{tmp}/rt",
                   JUPYTER_CONFIG_DIR=f"{tmp}/cfg")
        env.pop("VIRTUAL_ENV", None)
        fresh = _timed(["bash", "tools/setup.sh"], repo, env)
        again = _timed(["bash", "tools/setup.sh"], repo, env)
        lab = _walkthrough_start(repo, env)
    out = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                       "system": platform.platform()},
           "setup_fresh": fresh, "setup_again": again, "walkthrough_until_url": lab,
           "command": "python benchmarks/readme_commands.py --json "
                      "benchmarks/results/readme_commands.json"}
    text = json.dumps(out, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
