"""The package's shape, checked from its source (tools/archcheck.py reads it without
importing anything): the layer order written in ARCHITECTURE.md, no import cycles, no
private name imported from another package, function-level imports only where they buy
something and say what, ruff (pyflakes + import order) clean."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import archcheck  # noqa: E402

#: third-party modules that load only when used: heavy (MLX, mlx-lm, matplotlib,
#: ipywidgets, IPython, pandas, tokenizers, tqdm's notebook widgets) or optional;
#: numpy where a header-only path (``lorakit inspect`` of a checkpoint) must not load it
LAZY_OK = ("numpy", "mlx", "mlx_lm", "matplotlib", "ipywidgets", "IPython", "pandas", "tokenizers",
           "tqdm", "huggingface_hub", "ctypes", "gguf")
#: where lorakit's own modules may be imported lazily: the CLI (``lorakit --help`` must
#: start without numpy) and the packages' lazy attribute exports
LAZY_INTERNAL_OK = ("lorakit.cli", "lorakit.timing", "lorakit.widgets", "lorakit")


def test_no_import_cycles():
    assert archcheck.cycles(archcheck.graph()) == []


def test_function_level_imports_are_lazy_heavy_dependencies_with_a_reason():
    bad = []
    for mod, line, target, text in archcheck.function_level_imports():
        top = target.split(".")[0]
        internal = target.startswith("lorakit")
        ok = (top in LAZY_OK) if not internal else (
            mod in LAZY_INTERNAL_OK or mod.startswith("lorakit.cli"))
        if not ok or "# lazy:" not in text and not mod.startswith("lorakit.cli") \
                and mod not in LAZY_INTERNAL_OK:
            bad.append(f"{mod}:{line}: {text}")
    assert bad == []


def test_layers_are_the_architecture_page():
    order = archcheck.layers()
    assert order[0] == ["cli", "__main__.py"] and order[-1][0] == "report.py"
    units = {u for layer in order for u in layer}
    pkgs = {p.name for p in archcheck.PKG.iterdir() if (p / "__init__.py").exists()}
    tops = {p.name for p in archcheck.PKG.glob("*.py") if p.name != "__init__.py"}
    assert units == pkgs | tops  # every package and top-level module has its layer


def test_no_import_goes_up_a_layer():
    assert archcheck.layer_violations() == []


def test_no_private_name_crosses_a_package():
    assert archcheck.private_imports() == []


def test_ruff_is_clean():
    """pyflakes and import order over the package, tests, benchmarks and tools."""
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    proc = subprocess.run([ruff, "check", "--no-cache", "lorakit", "tests", "benchmarks", "tools"],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_archcheck_finds_a_cycle_and_a_lazy_import(tmp_path, monkeypatch):
    """The checker itself can fail: a planted cycle and function-level import are seen."""
    pkg = tmp_path / "lorakit"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n")
    monkeypatch.setattr(archcheck, "ROOT", tmp_path)
    monkeypatch.setattr(archcheck, "PKG", pkg)
    assert archcheck.cycles(archcheck.graph()) == [["lorakit.a", "lorakit.b"]]
    assert [r[0] for r in archcheck.function_level_imports()] == ["lorakit.b"]


def test_archcheck_finds_an_upward_import_and_a_private_name(tmp_path, monkeypatch):
    """A low layer importing a high one, and a private name taken from another package,
    are both seen; the same imports the other way round are not."""
    pkg = tmp_path / "lorakit"
    for sub in ("low", "high"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("def f():\n    from ..high.b import g\n")
    (pkg / "high" / "b.py").write_text("from ..low.a import _secret, f\n\ndef g():\n    pass\n")
    doc = tmp_path / "ARCHITECTURE.md"
    doc.write_text("# x\n\n## Layers\n\n```\nhigh/  on top\nlow/   below\n```\n")
    monkeypatch.setattr(archcheck, "ROOT", tmp_path)
    monkeypatch.setattr(archcheck, "PKG", pkg)
    monkeypatch.setattr(archcheck, "DOC", doc)
    assert archcheck.layers() == [["high"], ["low"]]
    bad = archcheck.layer_violations()
    assert len(bad) == 1 and bad[0].startswith("lorakit.low.a:2: low imports high")
    assert archcheck.private_imports() == ["lorakit.high.b:1: _secret from lorakit.low.a"]
