"""Every teaching notebook runs top to bottom, offline, within its time budget, and
shows what it is meant to show.

The notebooks are executed by nbclient in a real kernel, in place (working
directory ``notebooks/``, so the setup cell finds ``../data``), with TMPDIR pointing
into pytest's temporary folder so that fused outputs are cleaned up. One notebook
is also run from a temporary copy with ``LORAKIT_DATA`` set, as CI and the browser
suite do. Outputs must be stripped in git.

Environment:
    LORAKIT_DATA: use this data/ folder instead of the repository's.
    LORAKIT_NOTEBOOK_BUDGET_S: seconds a notebook may take (default 60).
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
from helpers import LazyModule, missing_modules

# imported on first use: nbformat's schema validator alone takes seconds to import
_MISSING = missing_modules("nbformat", "nbclient", "ipykernel")
pytestmark = pytest.mark.skipif(bool(_MISSING), reason=f"not installed: {_MISSING}")
nbformat = LazyModule("nbformat")
nbclient = LazyModule("nbclient")

REPO = Path(__file__).resolve().parents[2]
NB_DIR = REPO / "notebooks"
NOTEBOOKS = sorted(NB_DIR.glob("[0-9][0-9]_*.ipynb"))
DATA = Path(os.environ.get("LORAKIT_DATA") or REPO / "data").resolve()
BUDGET_S = float(os.environ.get("LORAKIT_NOTEBOOK_BUDGET_S", "60"))
TIMINGS = REPO / "test-artifacts" / "notebook-timings.json"

# Strings each notebook's outputs must contain: the facts its story stands on.
EXPECT: Dict[str, List[str]] = {
    "01": ["<- the bug", "mlx.core.float32", "W + delta.astype(W.dtype) -> mlx.core.bfloat16",
           "promoted", "all verdicts ok: True"],
    "02": ["not correctly rounded", "nearest", "mlx-lm", "round-once", "scale-after",
           "singular"],
    "03": ["lorakit --rounding mlx-lm vs mlx_lm fuse: identical = True",
           "mlx_lm fuse on DoRA writes: F32", "lorakit fuse on DoRA writes: BF16",
           "mlx_lm fuse on DoRA, check status: promoted"],
    "04": ["decode tok/s", "base", "promoted", "fused"],
    "05": ["cosine", "diverges_at"],
    "06": ["lost to quantization", "dequantized", "peft", "identical = True", "applied twice"],
    "07": ["delta RMS / quantization step", "delta survived: median", "mean KL vs unfused", "float-base"],
    "08": ["cross terms / exact sum", "within rounding noise: 28 of 28", "(bound: 2)",
           "fraction differing", "||mix||_F"],
    "09": ["at scale 0.5: KL(base || 0.5)", "of the whole (KL", "parts removed one at a time",
           "requant  effect kept", "auto     effect kept"],
}


@pytest.fixture(autouse=True)
def _kernel_env(monkeypatch, tmp_path):
    # the kernel inherits this process's environment
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel must choose inline itself
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("PYTHONPATH", str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if DATA == (REPO / "data").resolve():
        monkeypatch.delenv("LORAKIT_DATA", raising=False)  # prove ../data is found
    else:
        monkeypatch.setenv("LORAKIT_DATA", str(DATA))


def _require_data() -> None:
    if not (DATA / "tiny-qwen3").is_dir():
        pytest.fail(f"embedded assets missing under {DATA} (data/build.py makes them)")


def execute(path: Path, cwd: Path) -> Tuple[object, float, List[float]]:
    """Run a notebook in a fresh kernel; return it with outputs, its wall time, and each
    cell's seconds."""
    nb = nbformat.read(path, as_version=4)
    # coalesce_streams: ipykernel flushes stdout on a timer, so under load one print can
    # arrive as two stream outputs; joined apart, a checked line would read broken
    client = nbclient.NotebookClient(nb, timeout=180, kernel_name="python3",
                                     coalesce_streams=True,
                                     resources={"metadata": {"path": str(cwd)}})
    per_cell: List[float] = []
    t0 = time.perf_counter()
    with client.setup_kernel():
        for i, cell in enumerate(nb.cells):
            t = time.perf_counter()
            client.execute_cell(cell, i)
            per_cell.append(time.perf_counter() - t)
    return nb, time.perf_counter() - t0, per_cell


def _outputs(nb) -> Tuple[str, Dict[str, int]]:
    """All text of the outputs, and a count of outputs per MIME type."""
    text: List[str] = []
    kinds: Dict[str, int] = {}
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                text.append(out.text)
                kinds["stream"] = kinds.get("stream", 0) + 1
            elif out.output_type == "error":
                text.append("\n".join(out.traceback))
                kinds["error"] = kinds.get("error", 0) + 1
            else:
                for mime, value in out.get("data", {}).items():
                    kinds[mime] = kinds.get(mime, 0) + 1
                    if mime in ("text/plain", "text/html"):
                        text.append(value if isinstance(value, str) else "".join(value))
    return "\n".join(text), kinds


def _record(name: str, seconds: float, per_cell: List[float]) -> None:
    TIMINGS.parent.mkdir(exist_ok=True)
    data = json.loads(TIMINGS.read_text()) if TIMINGS.exists() else {}
    data[name] = {"seconds": round(seconds, 2),
                  "slowest cells": sorted(((round(s, 2), i) for i, s in enumerate(per_cell)),
                                          reverse=True)[:3]}
    TIMINGS.write_text(json.dumps(data, indent=1))


def test_the_notebooks_exist():
    assert [p.name[:2] for p in NOTEBOOKS] == ["01", "02", "03", "04", "05", "06", "07", "08",
                                            "09"]


@pytest.mark.slow  # nbformat's schema validator takes seconds to import
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_stripped_and_shaped(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, \
                f"{path.name}: outputs must be stripped in git"
    first, last = nb.cells[0], nb.cells[-1]
    assert first.cell_type == "markdown" and "What you will learn" in first.source
    assert last.cell_type == "markdown" and "Exercise" in last.source
    setup = nb.cells[1].source
    assert "LORAKIT_DATA" in setup and "tempfile.TemporaryDirectory" in setup


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path):
    _require_data()
    data_before = sorted(p.relative_to(DATA) for p in DATA.rglob("*"))
    nb, seconds, per_cell = execute(path, NB_DIR)
    _record(path.stem, seconds, per_cell)
    text, kinds = _outputs(nb)
    assert "error" not in kinds
    assert kinds.get("image/png", 0) >= 1, f"{path.name} shows no figure"
    assert "<table" in text, f"{path.name} shows no table"
    missing = [s for s in EXPECT[path.name[:2]] if s not in text]
    near = [ln for s in missing for ln in text.splitlines() if ln.startswith(s.split(":")[0])]
    assert not missing, f"{path.name}: outputs lack {missing}; found {near}"
    # nothing is written into data/, and what it made in the temporary folder is gone
    assert sorted(p.relative_to(DATA) for p in DATA.rglob("*")) == data_before
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("lorakit"))
    assert left == [], f"{path.name} left {left} behind (TMPDIR={tmp_path})"
    assert seconds <= BUDGET_S, f"{path.name} took {seconds:.1f} s (budget {BUDGET_S:.0f} s)"


@pytest.mark.slow
def test_notebook_from_temp_copy(tmp_path, monkeypatch):
    """A copy elsewhere finds data/ through LORAKIT_DATA (as CI and the browser suite run)."""
    _require_data()
    monkeypatch.setenv("LORAKIT_DATA", str(DATA))
    copy = tmp_path / "copy"
    copy.mkdir()
    src = NOTEBOOKS[1]  # fusing and inspecting: no subprocesses, quick
    shutil.copy(src, copy / src.name)
    nb, _, _ = execute(copy / src.name, copy)
    text, kinds = _outputs(nb)
    assert "error" not in kinds and f"data: {DATA}" in text


def test_readme_lists_every_notebook():
    readme = (NB_DIR / "README.md").read_text()
    for p in NOTEBOOKS:
        assert p.name in readme


def test_readme_lists_every_widget_each_notebook_uses():
    import lorakit.widgets

    names = [n for n in lorakit.widgets.__all__ if n[0].isupper()]
    rows = {line.split("|")[2]: line.split("|")[-2] for line in
            (NB_DIR / "README.md").read_text().splitlines() if line.startswith("| ")}
    for p in NOTEBOOKS:
        row = next(w for nb, w in rows.items() if p.name in nb)
        used = {n for n in names if n in p.read_text()}
        listed = {n for n in names if f"`{n}`" in row}
        assert used == listed, f"{p.name}: uses {sorted(used)}, README lists {sorted(listed)}"
