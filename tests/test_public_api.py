"""Each room's public names are re-exported from its package; everything behind them stays private."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest


@pytest.mark.parametrize(
    "room",
    [
        "evocache.dsl",
        "evocache.controller",
        "evocache.controller.replay",
        "evocache.controller.semantic",
        "evocache.serving",
        "evocache.serving.kv",
        "evocache.agents.signals",
        "evocache.agents.diagnosis",
    ],
)
def test_all_is_exact_and_importable(room):
    module = importlib.import_module(room)
    assert len(set(module.__all__)) == len(module.__all__), "duplicate names in __all__"
    for name in module.__all__:
        assert hasattr(module, name), f"{room}.{name} is in __all__ but not defined"
        obj = getattr(module, name)
        origin = getattr(obj, "__module__", room) or room
        home = ".".join(room.split(".")[:2])  # the room: evocache.controller for evocache.controller.replay
        if origin.startswith("evocache."):
            assert origin == home or origin.startswith(home + "."), f"{room}.{name} comes from {origin}"
    public = {n for n in dir(module) if not n.startswith("_")}
    modules = {n for n in public if type(getattr(module, n)) is type(module)}
    assert public - modules == set(module.__all__)


ROOMS_MAY_IMPORT = {
    "dsl": set(),
    "controller": {"dsl"},
    "serving": {"dsl", "controller"},
    "agents": {"dsl", "controller"},
    "cli": {"dsl", "controller", "serving", "agents"},
}
"""Which other rooms each room's code may import (docs/architecture.md, "The house: four rooms and a face at the
repository root")."""


def _is_private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))  # __main__ is public


def imported_names(path: Path, module: str) -> list[tuple[int, list[str]]]:
    """(line, dotted names) of each thing ``path`` (the module ``module``) imports, wherever the import stands
    (inside functions, under ``TYPE_CHECKING``), relative imports resolved: ``from m import a`` gives ``[m,
    m.a]``, as ``a`` may be a module or a name inside ``m``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, [alias.name]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            found += [(node.lineno, [source, f"{source}.{alias.name}"]) for alias in node.names]
    return found


def _crossing(room: str, name: str) -> str | None:
    """Why importing ``name`` from ``room``'s code crosses a wall, or None."""
    parts = name.split(".")
    if parts[0] != "evocache" or len(parts) < 2 or parts[1] == room:
        return None
    if parts[1] not in ROOMS_MAY_IMPORT[room]:
        return f"{room} may not import {parts[1]}"
    if any(_is_private(part) for part in parts[2:]):
        return f"private to {parts[1]}"
    return None


def wall_crossings(root: Path) -> list[str]:
    """Each import in a room's code of a room it may not import, or of another room's private part (a module,
    package or name whose dotted path has a component starting with ``_`` after ``evocache.<room>``), named
    by its shortest offending path."""
    wrong = set()
    for room in ROOMS_MAY_IMPORT:
        for path in sorted((root / room).rglob("*.py")):
            module = ".".join(["evocache", *path.relative_to(root).with_suffix("").parts]).removesuffix(".__init__")
            for line, names in imported_names(path, module):
                for name in names:
                    why = _crossing(room, name)
                    if why is not None:
                        wrong.add(f"{path.relative_to(root)}:{line}: {name}: {why}")
                        break
    return sorted(wrong)


def test_rooms_import_one_way():
    """dsl imports no other room; controller only dsl; serving and agents only controller and dsl; the face
    (cli) all four; and no room imports another room's private modules or names, the face included
    (docs/architecture.md, "The house: four rooms and a face at the repository root")."""
    assert wall_crossings(Path(__file__).resolve().parents[1]) == []


def test_the_wall_check_sees_every_kind_of_crossing(tmp_path: Path) -> None:
    code = {
        "dsl/a.py": "def f():\n    from evocache.controller import cache_if\n",
        "controller/b.py": "from ..dsl._ast import Node\nfrom ._own import x\nfrom . import _own\n",
        "serving/c.py": "import evocache.agents\nimport evocache.controller._files\n",
        "agents/d.py": "from evocache.dsl.commands import _print_diff\nfrom evocache.controller import cache_if\n",
        "cli/__init__.py": "from evocache.agents.commands import demo\nfrom evocache.serving.kv import x\n",
        "cli/__main__.py": "from .app import main\nfrom evocache.serving._app import start_local\n",
    }
    for name, text in code.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    assert wall_crossings(tmp_path) == [
        "agents/d.py:1: evocache.dsl.commands._print_diff: private to dsl",
        "cli/__main__.py:2: evocache.serving._app: private to serving",
        "controller/b.py:1: evocache.dsl._ast: private to dsl",
        "dsl/a.py:2: evocache.controller: dsl may not import controller",
        "serving/c.py:1: evocache.agents: serving may not import agents",
        "serving/c.py:2: evocache.controller._files: private to controller",
    ]


def test_the_semantic_seams_and_their_options_are_public():
    """What a user implements or configures in the semantic room is importable from its package."""
    import typing

    semantic = importlib.import_module("evocache.controller.semantic")
    protocols = {"AnswerClusters", "DecisionPolicy", "Embedder", "ScopedIndex"}
    options = {"EmbedderConfig", "IndexOptions", "PacerOptions", "PolicyOptions", "SemanticConfig"}
    assert protocols | options | {"EMBEDDERS", "POLICIES"} <= set(semantic.__all__)
    assert all(typing.Protocol in vars(semantic)[name].__mro__ for name in protocols)
    assert typing.get_type_hints(semantic.DecisionPolicy.readings)["return"] is semantic.Readings
