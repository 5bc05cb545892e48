"""The package's shape, checked from its source (tools/archcheck.py reads it without
importing anything): no import cycles, function-level imports only where they buy
something and say what, modules short enough to read in one sitting."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import archcheck  # noqa: E402

#: third-party modules that load only when used: heavy (MLX, mlx-lm, matplotlib,
#: ipywidgets, IPython, pandas, tokenizers, tqdm's notebook widgets) or optional;
#: numpy where a header-only path (``lorakit inspect`` of a checkpoint) must not load it
LAZY_OK = ("numpy", "mlx", "mlx_lm", "matplotlib", "ipywidgets", "IPython", "pandas", "tokenizers",
           "tqdm", "huggingface_hub", "ctypes")
#: where lorakit's own modules may be imported lazily: the CLI (``lorakit --help`` must
#: start without numpy) and the packages' lazy attribute exports
LAZY_INTERNAL_OK = ("lorakit.cli", "lorakit.timing", "lorakit.widgets", "lorakit")
#: modules allowed past MAX_LINES, with the reason
LONG_OK: dict = {}
MAX_LINES = 450


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


def test_modules_read_in_one_sitting():
    long = [(n, m) for n, m in archcheck.sizes() if n > MAX_LINES and m not in LONG_OK]
    assert long == []


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
