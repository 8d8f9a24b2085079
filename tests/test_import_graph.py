"""The import graph of evocache, read from the source (no module is imported): no module imports itself back.

An edge runs from a module to each evocache module it imports: ``from .pkg import name`` counts as an import
of ``pkg.name`` when that is a module, else of ``pkg``. A package's ``__init__`` that Python runs before one of
its submodules is no edge (every submodule would otherwise import its package). Imports under
``if TYPE_CHECKING:`` never run and are left out. ``lazy=True`` adds the imports inside functions and methods:
they run later, but a cycle through them is still two modules that cannot be read apart.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROOMS = ("dsl", "controller", "serving", "agents", "cli")  # pyproject's package-dir: evocache.<room> = <room>/


def modules() -> dict[str, Path]:
    """Every evocache module name -> its file (a package by its ``__init__.py``)."""
    found: dict[str, Path] = {}
    for room in ROOMS:
        for path in sorted((ROOT / room).rglob("*.py")):
            parts = ["evocache", *path.relative_to(ROOT).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module, lazy: bool) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import | ast.ImportFrom):
                found.append(node)
            elif isinstance(node, ast.If):
                if not _is_type_checking(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                    visit(block)
            elif isinstance(node, ast.With):
                visit(node.body)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                if lazy or isinstance(node, ast.ClassDef):
                    visit(node.body)
            elif lazy:
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, ast.stmt):
                        visit([child])

    visit(tree.body)
    return found


def import_graph(lazy: bool = False) -> dict[str, set[str]]:
    """Module -> the evocache modules it imports (see the module docstring)."""
    known = modules()
    graph: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(encoding="utf-8")), lazy):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in node.names]
            for target in targets:
                while target and target not in known:  # `import evocache.x.y` of a name inside a module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted, sorted."""
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

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(found)


def test_the_graph_sees_relative_and_absolute_imports() -> None:
    graph = import_graph()
    assert "evocache.controller.eviction._base" in graph["evocache.controller.eviction._lru"]
    assert "evocache.controller.replay.commands" in graph["evocache.cli.app"]
    assert "evocache.controller.errors" in graph["evocache.controller.eviction._model"]


def test_cycles_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycles() -> None:
    assert cycles(import_graph()) == []


def test_no_import_cycles_even_through_lazy_imports() -> None:
    assert cycles(import_graph(lazy=True)) == []
