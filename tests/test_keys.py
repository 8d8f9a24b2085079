"""Keys bind every part of a call; namespaces never collide."""

from __future__ import annotations

import dataclasses
from decimal import Decimal
from fractions import Fraction

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


def test_values_a_function_can_tell_apart_by_type_are_two_keys():
    import numpy as np

    distinct = [
        [1, 2], (1, 2), {1, 2}, frozenset({1, 2}), np.array([1, 2]), np.array([1, 2], dtype=np.int32),
        np.array([[1, 2]]), 1, 1.0, True, np.int64(1), np.int32(1), np.float64(1.0), np.float32(1.0),
        np.bool_(True), np.array(1), "1", np.str_("1"), [], (), set(), frozenset(), np.zeros(0),
        np.zeros((0, 2)), [[1, 2]], [(1, 2)], ([1, 2],),
    ]
    keys = [key(args={"p": value}) for value in distinct]
    assert len(set(keys)) == len(distinct)


def test_what_stays_one_key():
    import collections

    import numpy as np

    Point = collections.namedtuple("Point", "x y")
    same = [
        ((1, 2), Point(1, 2)),  # a named tuple keys as a tuple
        ({"a": 1, "b": 2}, collections.OrderedDict([("b", 2), ("a", 1)])),
        (b"ab", bytearray(b"ab")),
        (-0.0, 0.0),
        (float("nan"), -float("nan")),
        (np.array([1.5, 2.0]), np.array([1.5, 2.0])),
        (np.float32(0.5), np.float32(0.5)),
    ]
    for a, b in same:
        assert key(args={"p": a}) == key(args={"p": b}), (a, b)


def test_a_numpy_value_never_keys_like_a_python_value():
    import numpy as np

    assert key(args={"p": np.float64(0.5)}) != key(args={"p": 0.5})
    assert key(args={"p": np.array([1, 2])}) != key(args={"p": [1, 2]})
    assert key(args={"p": np.array(0.5)}) != key(args={"p": np.float64(0.5)})


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


def test_generation_params_key_by_meaning():
    import numpy as np
    from fractions import Fraction

    assert normalise_params({"temperature": np.float32(0.5)}) == normalise_params({"temperature": 0.5})
    assert normalise_params({"temperature": np.array(0.5)}) == normalise_params({"temperature": 0.5})
    assert normalise_params({"temperature": Fraction(1, 2)}) == normalise_params({"temperature": 0.5})
    assert normalise_params({"top_k": np.int64(0)}) == normalise_params({})
    assert normalise_params({"max_tokens": np.int64(16)}) == normalise_params({"max_tokens": 16})
    assert normalise_params({"stop": ("a", "b")}) == normalise_params({"stop": ["a", "b"]})
    assert normalise_params({"temperature": np.float32(0.1)}) != normalise_params({"temperature": 0.1})
    # Tuples of equal numbers compare equal; the key reads their repr, which keeps the kind.
    assert key(params=normalise_params({"top_k": 5.0})) != key(params=normalise_params({"top_k": 5}))
    assert key(params=normalise_params({"seed": True})) != key(params=normalise_params({"seed": 1}))


@pytest.mark.parametrize(
    "params",
    [{"temperature": Decimal("0.5")}, {"top_p": object()}, {"max_tokens": Decimal(3)},
     {"temperature": Fraction(10**400)}, {"stop": [object()]}],
    ids=repr,
)
def test_generation_params_without_a_canonical_form_are_uncacheable(params):
    with pytest.raises(Uncacheable):
        normalise_params(params)


def test_lone_surrogates_key_without_failing():
    assert key(model="\ud800") != key(model="\udc00") != key()
    assert key(function="m.\ud800") != key(function="m.\udc00")
    assert namespace_for("\ud800") != namespace_for("\udc00")


def test_no_tenant_id_maps_to_the_anonymous_namespace():
    from evocache.controller._keys import ANONYMOUS_NS

    for tenant_id in ("default", "anonymous", ".anonymous", "h.anonymous", "anonymous."):
        assert namespace_for(tenant_id) != ANONYMOUS_NS


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=40))
def test_the_anonymous_namespace_is_no_tenant_s(tenant_id):
    from evocache.controller._keys import ANONYMOUS_NS

    assert namespace_for(tenant_id) != ANONYMOUS_NS


def test_negative_zero_is_zero():
    assert key(args={"p": -0.0}) == key(args={"p": 0.0})
