"""No import circles: no module of ``mambacache``, ``models`` or ``pallas_kernels`` imports one
that imports it back, directly or around a loop. Every import counts, a function's lazy one
included (it is a dependency all the same); only imports under ``if TYPE_CHECKING:`` do not
(a type, not a dependency at run time). A planted cycle is found, to see the check fail."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mambacache", "models", "pallas_kernels")


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of ``PACKAGES`` under ``root``."""
    out = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported_names(name: str, path: Path) -> set[str]:
    """Every dotted name ``path`` imports at run time (relative imports resolved)."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.update(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the project modules it imports (a name resolves to its longest module)."""
    files = module_files(root)
    graph = {}
    for name, path in files.items():
        edges = set()
        for target in imported_names(name, path):
            while target and target not in files:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.add(target)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph)))
    try:
        for v in sorted(graph):
            if v not in index:
                connect(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(found)


def test_no_import_cycles():
    assert cycles(import_graph(ROOT)) == []


def test_a_planted_cycle_is_found(tmp_path):
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            dest = tmp_path / path.relative_to(ROOT)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(path.read_text())
    # a lazy import inside a function counts; one under TYPE_CHECKING does not
    low = tmp_path / "mambacache/cache/node.py"
    text = low.read_text()
    planted = "from mambacache.cache import radix\n"
    low.write_text(text + "\n\ndef _planted():\n    " + planted)
    pair = {"mambacache.cache.node", "mambacache.cache.radix"}
    assert any(pair <= set(c) for c in cycles(import_graph(tmp_path)))
    low.write_text(text + "\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    " + planted)
    assert not any("mambacache.cache.node" in c for c in cycles(import_graph(tmp_path)))
    assert "mambacache.cache.node" in import_graph(tmp_path)["mambacache.cache.radix"]
