"""Every ``>>>`` example in lorakit's docstrings runs and shows what it says.

Modules are found by reading the source files (nothing is imported while collecting);
each module's examples run in a fresh temporary folder that holds a link to the
repository's ``data/``, so ``"data/tiny-qwen3"`` and ``"data/adapters/lora"`` are the
embedded assets and anything an example writes (``"fused"``, ``"out/..."``) lands in
the temporary folder.
"""
from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest
from helpers import DATA, REPO

PKG = REPO / "lorakit"
#: modules whose examples run decode-timing workers (seconds each)
SLOW = {"lorakit.timing.decode"}


def _modules() -> list:
    out = []
    for f in sorted(PKG.rglob("*.py")):
        if ">>>" not in f.read_text():
            continue
        parts = f.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        marks = [pytest.mark.slow] if name in SLOW else []
        out.append(pytest.param(name, id=name, marks=marks))
    return out


MODULES = _modules()


def test_modules_with_examples_are_found() -> None:
    assert len(MODULES) >= 10 and "lorakit.numerics" in [p.values[0] for p in MODULES]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str, tmp_path: Path, monkeypatch) -> None:
    if not (DATA / "adapters" / "lora" / "adapters.safetensors").exists():
        pytest.skip("embedded assets not built")
    (tmp_path / "data").symlink_to(DATA, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LORAKIT_DATA", str(DATA))
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    tests = [t for t in finder.find(module, name) if t.examples]
    assert tests, f"{name} has '>>>' in its source but no example was found"
    for t in tests:
        runner.run(t)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
