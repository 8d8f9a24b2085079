"""Keys bind every part of a call; namespaces never collide."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evocache.controller import derive_key, namespace_for
from evocache.controller._keys import Uncacheable, normalise_params

BASE = dict(function="m.f", model="llama", revision="r1", template="t", params=(), ns="acme", args={"p": "hi"})


def key(**changes):
    return derive_key(**{**BASE, **changes})


@pytest.mark.parametrize(
    "change",
    [
        {"function": "m.g"},
        {"model": "mistral"},
        {"revision": "r2"},
        {"template": "u"},
        {"params": (("temperature", 0.5),)},
        {"ns": "globex"},
        {"args": {"p": "hi!"}},
        {"args": {"q": "hi"}},
        {"args": {"p": "hi", "extra": None}},
    ],
)
def test_every_part_changes_the_key(change):
    assert key(**change) != key()


def test_same_call_same_key():
    assert key() == key()
    assert key(args={"a": 1, "b": 2}) == key(args={"b": 2, "a": 1})


def test_parts_cannot_bleed_into_each_other():
    # Length-prefixed parts: moving characters between model and revision changes the key.
    assert key(model="ab", revision="c") != key(model="a", revision="bc")
    assert key(function="x", model="") != key(function="", model="x")


def test_argument_types_are_distinguished():
    assert key(args={"p": 1}) != key(args={"p": "1"})
    assert key(args={"p": 1}) != key(args={"p": 1.5})
    assert key(args={"p": b"x"}) != key(args={"p": ["b", "78"]})
    assert key(args={"p": {"a": 1}}) != key(args={"p": [["a", 1]]})
    assert key(args={"p": {1, 2}}) != key(args={"p": [1, 2]})
    # A tuple and a list with the same items are the same input (input_ids arrive as either).
    assert key(args={"p": (1, 2)}) == key(args={"p": [1, 2]})


def test_dataclass_arguments_and_unknown_objects():
    @dataclasses.dataclass
    class Params:
        beam: int

    assert key(args={"p": Params(1)}) != key(args={"p": Params(2)})
    with pytest.raises(Uncacheable):
        key(args={"p": object()})


def test_generation_params_normalised():
    assert normalise_params({"top_k": 0, "top_p": 1.0, "temperature": 0.0}) == (("temperature", 0.0),)
    assert normalise_params({"top_k": -1}) == normalise_params({})
    assert normalise_params({"temperature": -0.0}) == normalise_params({"temperature": 0})
    assert normalise_params({"top_p": 0.9000000000000001}) == normalise_params({"top_p": 0.9})
    assert normalise_params({"top_k": 5}) != normalise_params({"top_k": 6})


def test_namespace_for_readable_and_hashed_ids():
    assert namespace_for("tenant-a") == "tenant-a"
    hashed = namespace_for("alice@example.com")
    assert hashed.startswith("h.") and hashed != namespace_for("alice@example.org")
    with pytest.raises(ValueError):
        namespace_for("")


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=40), st.text(min_size=1, max_size=40))
def test_distinct_tenants_never_share_a_namespace(a, b):
    if a != b:
        assert namespace_for(a) != namespace_for(b)


def test_mapping_keys_keep_their_type():
    assert key(args={"p": {1: "a"}}) != key(args={"p": {"1": "a"}})


def test_float_params_compare_as_floats_without_merging_real_settings():
    assert normalise_params({"temperature": 0}) == normalise_params({"temperature": 0.0})
    assert normalise_params({"temperature": 1e-7}) != normalise_params({"temperature": 0.0})
    assert normalise_params({"top_p": 0.1 + 0.2}) == normalise_params({"top_p": 0.3})
    assert normalise_params({"top_p": 1}) == normalise_params({})


def test_negative_zero_is_zero():
    assert key(args={"p": -0.0}) == key(args={"p": 0.0})
