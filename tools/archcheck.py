"""Architecture facts of the lorakit package, from its source alone (no imports run).

    python tools/archcheck.py          # summary: cycles, function-level imports, sizes

Used by tests/test_architecture.py, which holds the rules.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Dict, List, Set, Tuple

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "lorakit"


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
            if isinstance(child, ast.Import):
                for a in child.names:
                    out.append((a.name, child.lineno, in_func, lines[child.lineno - 1]))
            elif isinstance(child, ast.ImportFrom):
                for t in _resolve(mod, is_pkg, child):
                    out.append((t, child.lineno, in_func, lines[child.lineno - 1]))
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


def sizes() -> List[Tuple[int, str]]:
    return sorted(((len(p.read_text().splitlines()), m) for m, p in modules().items()),
                  reverse=True)


if __name__ == "__main__":
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
