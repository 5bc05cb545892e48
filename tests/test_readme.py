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
