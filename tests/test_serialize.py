from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evocache.controller._serialize import JsonSerializer, PickleSerializer, Unserializable, dump_chunks, load_chunks

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(json_values)
def test_json_round_trip(value):
    s = JsonSerializer()
    assert s.loads(s.dumps(value)) == value


@pytest.mark.parametrize("value", ["héllo", b"\x00\xff", ("a", 1), [1, "x"], {"k": [1, 2]}, None, 3.5])
def test_json_round_trip_keeps_type(value):
    s = JsonSerializer()
    back = s.loads(s.dumps(value))
    assert back == value and type(back) is type(value)


@pytest.mark.parametrize("value", [object(), {1: "int key"}, [("nested", "tuple")], float("nan"), {"s": {1, 2}}])
def test_json_refuses_what_would_not_round_trip(value):
    with pytest.raises(Unserializable):
        JsonSerializer().dumps(value)


def test_pickle_is_opt_in_and_round_trips():
    s = PickleSerializer()
    assert s.loads(s.dumps({1: ("a", {2})})) == {1: ("a", {2})}
    with pytest.raises(ValueError):
        JsonSerializer().loads(s.dumps("x"))  # the json serializer never unpickles


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text() | st.binary(), max_size=20))
def test_chunks_round_trip_byte_identical(chunks):
    back = load_chunks(dump_chunks(chunks))
    assert back == chunks and [type(c) for c in back] == [type(c) for c in chunks]


def test_truncated_chunks_rejected():
    payload = dump_chunks(["hello", "world"])
    with pytest.raises(ValueError):
        load_chunks(payload[:-2])
