"""Architecture facts of the lorakit package, from its source alone (no imports run).

    python tools/archcheck.py          # summary: layers, cycles, private names, lazy imports

The layer order is read from ARCHITECTURE.md (its "Layers" block, top layer first: a
package may import itself and the layers listed below it). Used by
tests/project/test_architecture.py, which holds the rules.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Dict, List, Set, Tuple

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "lorakit"
DOC = ROOT / "ARCHITECTURE.md"


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> Dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> List[str]:
    if node.level:
        base = mod.split(".") if is_pkg else mod.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if node.module is None or not node.level:
        # "from . import x" / "from pkg import mod": the names may be modules
        return [target] + [f"{target}.{a.name}" for a in node.names]
    return [target] + [f"{target}.{a.name}" for a in node.names]


def imports(path: Path, mod: str) -> List[Tuple[str, int, bool, str]]:
    """(imported module, line, at function level?, the line's text) for each import."""
    tree = ast.parse(path.read_text())
    lines = path.read_text().splitlines()
    is_pkg = path.name == "__init__.py"
    out = []

    def visit(node: ast.AST, in_func: bool) -> None:
        for child in ast.iter_child_nodes(node):
            f = in_func or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                text = " ".join(ln.strip() for ln in
                                lines[child.lineno - 1: child.end_lineno])  # the whole statement
                targets = [a.name for a in child.names] if isinstance(child, ast.Import) \
                    else _resolve(mod, is_pkg, child)
                for t in targets:
                    out.append((t, child.lineno, in_func, text))
            elif isinstance(child, ast.If) and _is_type_checking(child):
                continue
            visit(child, f)

    visit(tree, False)
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def graph() -> Dict[str, Set[str]]:
    mods = modules()
    g: Dict[str, Set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        for target, _, _, _ in imports(p, m):
            if target in mods and target != m:
                g[m].add(target)
    return g


def cycles(g: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components with more than one module (Tarjan).

    A package's ``__init__`` importing its own submodules lazily is not an edge that
    matters; edges into a package ``__init__`` from its children are skipped."""
    g = {m: {t for t in ts if not (m.startswith(t + ".") )} for m, ts in g.items()}
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []
    counter = [0]
    sys.setrecursionlimit(10000)

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in g:
        if v not in index:
            strong(v)
    return out


def function_level_imports() -> List[Tuple[str, int, str, str]]:
    """(module, line, imported, text) for every import inside a function."""
    out = []
    for m, p in modules().items():
        for target, line, in_func, text in imports(p, m):
            if in_func:
                out.append((m, line, target, text.strip()))
    # one row per import statement
    seen = set()
    rows = []
    for r in out:
        if (r[0], r[1]) not in seen:
            seen.add((r[0], r[1]))
            rows.append(r)
    return rows


def layers(doc: Path = None) -> List[List[str]]:
    """The layer order of ARCHITECTURE.md, top first: each layer a list of units (a package
    folder ``fusion`` or a top-level module ``report.py``)."""
    text = (doc or DOC).read_text()
    block = text.split("## Layers", 1)[1].split("```", 2)[1]
    out = []
    for line in block.splitlines()[1:]:
        units = []
        for word in line.split():
            if word.endswith("/"):
                units.append(word[:-1])
            elif word.endswith(".py"):
                units.append(word)
            else:
                break
        if units:
            out.append(units)
    return out


def unit(mod: str) -> str:
    """The layer unit of a lorakit module: its package folder, or ``name.py`` for a
    top-level module; "" for the root ``lorakit/__init__`` (the lazy verb table)."""
    parts = mod.split(".")
    if len(parts) == 1:
        return ""
    if (PKG / parts[1]).is_dir():
        return parts[1]
    return parts[1] + ".py"


def layer_violations(doc: Path = None) -> List[str]:
    """Every import (module or function level) of a unit listed above the importer's."""
    order = layers(doc)
    rank = {u: len(order) - i for i, us in enumerate(order) for u in us}
    mods = modules()
    bad = []
    for m, p in mods.items():
        um = unit(m)
        if um not in rank:
            if um:
                bad.append(f"{m}: its unit {um!r} is not in ARCHITECTURE.md's layers")
            continue
        for target, line, _, text in imports(p, m):
            if target not in mods or target == "lorakit":
                continue
            ut = unit(target)
            if ut not in rank:
                continue  # reported for the target module itself
            if rank[ut] > rank[um]:
                bad.append(f"{m}:{line}: {um} imports {ut} (a layer above it): {text.strip()}")
    return sorted(set(bad))


def private_imports() -> List[str]:
    """``from X import _name`` (or a ``_module`` of X) where X is in another unit."""
    mods = modules()
    bad = []
    for m, p in mods.items():
        tree = ast.parse(p.read_text())
        is_pkg = p.name == "__init__.py"
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            target = _resolve(m, is_pkg, node)[0]
            if not target.startswith("lorakit"):
                continue
            for a in node.names:
                full = f"{target}.{a.name}"
                owner = full if full in mods else target
                private = a.name.startswith("_") and not a.name.startswith("__") or any(
                    part.startswith("_") and not part.startswith("__")
                    for part in target.split(".")[1:])
                if private and unit(owner) != unit(m):
                    bad.append(f"{m}:{node.lineno}: {a.name} from {target}")
    return sorted(bad)


def sizes() -> List[Tuple[int, str]]:
    return sorted(((len(p.read_text().splitlines()), m) for m, p in modules().items()),
                  reverse=True)


if __name__ == "__main__":
    lv = layer_violations()
    print(f"layer violations: {len(lv)}")
    for v in lv:
        print("  ", v)
    pv = private_imports()
    print(f"private names imported across packages: {len(pv)}")
    for v in pv:
        print("  ", v)
    cs = cycles(graph())
    print(f"import cycles: {len(cs)}")
    for c in cs:
        print("  ", " <-> ".join(c))
    fl = function_level_imports()
    print(f"function-level imports: {len(fl)}")
    for m, line, t, text in fl:
        print(f"  {m}:{line}: {text}")
    print("largest modules:")
    for n, m in sizes()[:8]:
        print(f"  {n:5d} {m}")
