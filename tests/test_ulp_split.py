"""inspect/ulp split by idea: the old module's names, one comparison behind parity and
ulp_compare, no import cycle, and the shared progress and HTML helpers."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

import numpy as np
import pytest

from lorakit import _html, numerics as nm
from lorakit._progress import progress_bar
from lorakit.inspect import parity as parity_mod
from lorakit.inspect import ulp_accumulate, ulp_report, ulp_stream
from lorakit.io.safetensors_write import PlannedTensor, SafetensorsWriter

PKG = Path(ulp_accumulate.__file__).resolve().parents[1]
BF16 = nm.float_format("bf16")


def write_file(path: Path, tensors: Dict[str, np.ndarray]) -> Path:
    plan = [PlannedTensor(n, "BF16", tuple(a.shape)) for n, a in tensors.items()]
    with SafetensorsWriter(path, plan) as w:
        for n, a in tensors.items():
            w.write(n, a)
    return path


@pytest.fixture()
def pair(tmp_path: Path):
    rng = np.random.default_rng(0)
    w = {f"model.layers.{i}.mlp.up_proj.weight": rng.normal(0, 0.02, (64, 48)) for i in range(3)}
    a = {n: nm.round_to_format(v, BF16) for n, v in w.items()}
    b = {n: nm.round_to_format(v * (1 + 0.01 * k), BF16) for k, (n, v) in enumerate(w.items())}
    b["only.in.b"] = a["model.layers.0.mlp.up_proj.weight"][:2]
    return write_file(tmp_path / "a.safetensors", a), write_file(tmp_path / "b.safetensors", b)


def test_ulp_compare_is_parity_seen_as_histograms(pair) -> None:
    a, b = pair
    rep = parity_mod.ulp_compare(a, b, progress=False)
    diffs = ulp_stream.compare_sources(a, b)
    direct = ulp_report.ulp_report("ulp distances a.safetensors vs b.safetensors", diffs,
                                   ulp_accumulate.bin_labels(), {"A": str(a), "B": str(b)})
    assert isinstance(rep, ulp_report.UlpReport)
    assert str(rep) == str(direct)
    assert rep.counts.tolist() == direct.counts.tolist()
    assert {k: v.tolist() for k, v in rep.per_layer.items()} == \
        {k: v.tolist() for k, v in direct.per_layer.items()}
    assert [r["status"] for r in rep.rows] == ["equal", "differs", "differs", "only in B"]
    p = parity_mod.parity(a, b, progress=False)
    assert p.overall.tolist() == rep.overall.tolist()


def _imports(path: Path) -> Set[str]:
    """Every lorakit module a file imports, at any depth (function-level ones too)."""
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    here = parts if path.name == "__init__.py" else parts[:-1]
    found: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("lorakit")}
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            if not mod.startswith("lorakit"):
                continue
            found.add(mod)
            found |= {f"{mod}.{a.name}" for a in node.names}
    return found


def test_no_import_cycle_through_the_ulp_modules() -> None:
    files = {".".join(p.relative_to(PKG.parent).with_suffix("").parts).removesuffix(".__init__"): p
             for p in PKG.rglob("*.py")}
    graph: Dict[str, Set[str]] = {m: {i for i in _imports(p) if i in files and i != m}
                                  for m, p in files.items()}
    mine = [m for m in files if m.startswith("lorakit.inspect.ulp") or
            m in ("lorakit.inspect.parity", "lorakit.inspect.merge_check", "lorakit._html",
                  "lorakit._progress", "lorakit.inspect.report")]

    def reaches(start: str, goal: str) -> bool:
        seen: Set[str] = set()
        todo: List[str] = list(graph[start])
        while todo:
            m = todo.pop()
            if m == goal:
                return True
            if m not in seen:
                seen.add(m)
                todo += graph.get(m, ())
        return False

    cycles = [m for m in mine if reaches(m, m)]
    assert not cycles, cycles


def test_progress_bar_forms() -> None:
    calls = []
    bar = progress_bar(lambda d, t: calls.append((d, t)), 5, "x")
    for n in (2, 0, 3):
        bar.update(n)
    bar.close()
    assert calls == [(2, 5), (2, 5), (5, 5)]
    for off in (False, None):
        quiet = progress_bar(off, 5, "x")
        quiet.update(5)
        quiet.set_postfix_str("step")
        quiet.close()
        assert quiet.done == 5 and quiet._bar is None
    shown = progress_bar(True, 5, "x")
    assert shown._bar is not None  # a tqdm bar (disabled when stderr is not a terminal)
    shown.update(5)
    shown.close()


def test_html_table_escapes_once() -> None:
    t = _html.table([["<a>", _html.Cell(_html.Markup("<b>ok</b>"), style="x")]],
                    head=["k&", "v"], row_styles={0: _html.FLAGGED})
    assert t == ("<table><thead><tr><th>k&amp;</th><th>v</th></tr></thead><tbody>"
                 "<tr style='background:#fdd'><td>&lt;a&gt;</td><td style='x'><b>ok</b></td>"
                 "</tr></tbody></table>")
    assert _html.facts_table([("a", "<1>")], key_style="s") == \
        "<table><tr><th style='s'>a</th><td style='text-align:left'>&lt;1&gt;</td></tr></table>"
