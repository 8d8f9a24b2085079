"""Event files of both schema versions read back as one event per call (``controller.replay.read_events``).

tests/data/events/v1-sample.jsonl was written by the version 1 writer (a call spread over its decision, its
store or reject, and its kv event): nine calls of two tenants, a hit, a result too large to store, a call whose
engine reported KV usage, a bypass with a keyless kv event, a stream."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from evocache.controller import AccessEvent
from evocache.controller.replay import CallEvents, TraceError, read_events, read_trace

V1 = Path(__file__).parent / "data" / "events" / "v1-sample.jsonl"
KV = {"prompt_tokens": 24, "cached_tokens": 16, "reused": {"l1": 16}, "miss": ""}


def test_a_version_1_file_reads_as_one_event_per_call():
    calls = list(read_events(V1))
    assert [(c.ns, c.rule, c.outcome, c.size, c.stored, c.rejected, c.kv) for c in calls] == [
        ("acme", "short", "miss", 9, "l1", "", None),
        ("acme", "short", "hit", 9, "", "", None),
        ("acme", "short", "miss", 101, "", "too-large", None),
        ("acme", "short", "miss", 9, "l1", "", KV),
        ("acme", "short", "hit", 9, "", "", None),
        ("acme", "long", "bypass", 0, "", "", None),  # v1 wrote the bypass's kv event with no key: not folded
        ("acme", "short", "miss", 13, "l1", "", None),
        ("acme", "short", "hit", 13, "", "", None),
        ("globex", "short", "miss", 9, "l1", "", None),
    ]
    assert {c.v for c in calls} == {2}
    assert all(c.saved_ms > 0 for c in calls if c.outcome != "bypass")  # a miss's is its function's time
    assert [c.t for c in calls] == sorted(c.t for c in calls)


def test_the_replay_reads_the_same_file_as_accesses_sized_by_their_results():
    accesses = list(read_trace(V1, "events"))
    assert [(a.ns, a.size) for a in accesses] == [("acme", 9), ("acme", 9), ("acme", 101), ("acme", 9),
                                                  ("acme", 9), ("acme", 13), ("acme", 13), ("globex", 9)]


def _v2(**fields) -> AccessEvent:
    base = {"v": 2, "t": 1.0, "key": "k", "ns": "a", "rule": "r", "policy": "p@1", "outcome": "miss",
            "tier": None, "size": 5, "latency_ms": 0.1, "saved_ms": 3.0, "call": "c-1", "stored": "l1"}
    return AccessEvent.from_dict({**base, **fields})


def test_version_2_events_pass_through_in_order():
    events = [_v2(t=1.0, call="c-1"), _v2(t=2.0, call="c-2", outcome="hit", tier="l1", stored=""),
              _v2(t=3.0, call="c-3", outcome="bypass", key="", size=0, stored="", reason="rule")]
    calls = CallEvents()
    out = [c for e in events for c in calls.feed(e)] + calls.flush()
    assert out == events


def test_a_version_1_miss_never_sized_comes_out_incomplete_and_in_order():
    lines = [json.dumps({"t": 1, "key": "a", "outcome": "miss", "size": 0}),
             json.dumps({"t": 2, "key": "b", "outcome": "hit", "size": 4})]
    calls = list(read_events(lines))
    assert [(c.key, c.outcome, c.size, c.rejected) for c in calls] == [("a", "miss", 0, "incomplete"),
                                                                       ("b", "hit", 4, "")]


def test_a_version_2_file_refuses_the_outcomes_of_version_1():
    with pytest.raises(ValueError, match="field 'outcome' must be one of"):
        AccessEvent.from_dict({"v": 2, "t": 1, "key": "k", "outcome": "store", "size": 3})


@pytest.mark.parametrize(("line", "message"), [
    ('{"t": 1, "key": "k", "outcome": "hit"}', "missing field 'size'"),
    ('{"t": "x", "key": "k", "outcome": "hit", "size": 1}', "field 't' must be a finite number"),
    ('{"t": 1, "key": "k", "outcome": "hit", "size": 1, "kv": [1]}', "field 'kv' must be an object or null"),
    ('{"v": 0, "t": 1, "key": "k", "outcome": "hit", "size": 1}', "field 'v' must be an int >= 1"),
    ('[1, 2]', "expected a JSON object, got list"),
])
def test_a_bad_line_is_named_with_its_file_and_line(line: str, message: str):
    good = '{"t": 0, "key": "k", "outcome": "hit", "size": 1}'
    with pytest.raises(TraceError, match=rf"events\.jsonl:2: {message}"):
        list(read_events(io.StringIO(f"{good}\n{line}\n"), name="events.jsonl"))
