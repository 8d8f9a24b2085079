"""Each room's public names are re-exported from its package; everything behind them stays private."""

from __future__ import annotations

import importlib

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


def test_rooms_import_one_way():
    """dsl imports no other room; controller imports only dsl; serving only controller and dsl
    (docs/architecture.md, "The house: four rooms and a face at the repository root")."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1]
    pattern = re.compile(r"^\s*(?:from|import)\s+evocache\.(\w+)", re.MULTILINE)
    allowed = {
        "dsl": {"dsl"},
        "controller": {"dsl", "controller"},
        "serving": {"dsl", "controller", "serving"},
    }
    for room, ok in allowed.items():
        for path in (root / room).rglob("*.py"):
            used = set(pattern.findall(path.read_text()))
            assert used <= ok, f"{path.relative_to(root)} imports {sorted(used - ok)}"


def test_the_semantic_seams_and_their_options_are_public():
    """What a user implements or configures in the semantic room is importable from its package."""
    import typing

    semantic = importlib.import_module("evocache.controller.semantic")
    protocols = {"AnswerClusters", "DecisionPolicy", "Embedder", "ScopedIndex"}
    options = {"EmbedderConfig", "IndexOptions", "PacerOptions", "PolicyOptions", "SemanticConfig"}
    assert protocols | options | {"EMBEDDERS", "POLICIES"} <= set(semantic.__all__)
    assert all(typing.Protocol in vars(semantic)[name].__mro__ for name in protocols)
    assert typing.get_type_hints(semantic.DecisionPolicy.readings)["return"] is semantic.Readings
