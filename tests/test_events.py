from __future__ import annotations

import json

import pytest

from evocache.controller import AccessEvent, JsonlSink, RedisStreamSink, RingSink, read_events

EVENT = AccessEvent(t=1732867200.123, key="9f2c", ns="tenant-a", rule="long-context-greedy", policy="chat-prod@7",
                    outcome="hit", tier="l2", size=5321, latency_ms=0.41, saved_ms=812.0)


def test_event_json_has_the_architecture_fields():
    data = json.loads(EVENT.to_json())
    for field in ("t", "key", "ns", "rule", "policy", "outcome", "tier", "size", "latency_ms", "saved_ms", "semantic"):
        assert field in data
    assert AccessEvent.from_dict(data) == EVENT


def test_ring_keeps_the_last_events():
    ring = RingSink(capacity=2)
    for i in range(3):
        ring.emit(AccessEvent(**{**EVENT.to_dict(), "key": str(i)}))
    assert [e.key for e in ring.events()] == ["1", "2"]


def test_jsonl_sink_round_trip(tmp_path):
    path = tmp_path / "ev" / "events.jsonl"
    sink = JsonlSink(path, flush_every=2)
    for i in range(5):
        sink.emit(AccessEvent(**{**EVENT.to_dict(), "key": str(i)}))
    sink.close()
    assert [e.key for e in read_events(path)] == ["0", "1", "2", "3", "4"]


def test_read_events_names_the_bad_line(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text(EVENT.to_json() + "\n{not json\n")
    with pytest.raises(ValueError, match=r"events.jsonl:2"):
        list(read_events(path))


@pytest.mark.redis
def test_redis_stream_sink(redis_url):
    sink = RedisStreamSink(redis_url, stream="test:events")
    sink.emit(EVENT)
    assert sink.read() == [EVENT]
    sink.close()


def test_redis_stream_sink_down_never_raises():
    sink = RedisStreamSink("redis://127.0.0.1:1/0", socket_timeout=0.05)
    sink.emit(EVENT)
    assert sink.errors == 1
