from __future__ import annotations

import json
import time

import pytest
from _helpers import FakeClock, eventually

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
def test_redis_stream_sink_sends_in_the_background(redis_url):
    sink = RedisStreamSink(redis_url, stream="test:events", interval=0.01)
    sink.emit(EVENT)
    # No flush: the sender thread delivers it.
    assert eventually(sink.read, timeout=5, message="the sender thread to deliver the event") == [EVENT]
    sink.emit(EVENT), sink.emit(EVENT)
    sink.close()  # close flushes what is left
    assert RedisStreamSink(redis_url, stream="test:events").read() == [EVENT] * 3


class CountingDeadClient:
    """A client whose pipeline always fails, counting how often the sink tries."""

    def __init__(self) -> None:
        self.attempts = 0

    def pipeline(self, transaction: bool = False):
        import redis

        client = self

        class Pipe:
            def xadd(self, *args, **kwargs):
                return None

            def execute(self):
                client.attempts += 1
                raise redis.TimeoutError("hung")

        return Pipe()

    def close(self) -> None:
        return None


def test_redis_stream_sink_down_drops_and_counts_without_retrying_each_batch():
    clock, client = FakeClock(0.0), CountingDeadClient()
    sink = RedisStreamSink("redis://unused", batch=2, retry_after=1.0, clock=clock, client=client)
    for _ in range(10):
        sink.emit(EVENT)  # never raises, never waits
    sink.flush()
    assert (sink.errors, client.attempts) == (10, 1)  # one try, then the breaker drops the rest
    assert sink.breaker.trips == 1 and sink.breaker.last_error == "TimeoutError: hung"
    clock.now = 1.5
    sink.emit(EVENT), sink.emit(EVENT)
    sink.flush()
    assert (sink.errors, client.attempts) == (12, 2)
    sink.close()


def test_redis_stream_sink_unreachable_never_raises():
    sink = RedisStreamSink("redis://127.0.0.1:1/0", socket_timeout=0.05, batch=1)
    sink.emit(EVENT)
    sink.flush()
    assert sink.errors == 1
    sink.close()


def test_jsonl_sink_writes_every_flush_every_events_and_nothing_after_close(tmp_path):
    path = tmp_path / "events.jsonl"
    sink = JsonlSink(path, flush_every=3)
    for _ in range(4):
        sink.emit(EVENT)
    assert len(path.read_text().splitlines()) == 3  # one batch written, one event waiting
    sink.close()
    assert len(path.read_text().splitlines()) == 4
    sink.emit(EVENT)  # after close: counted, not kept
    assert sink.errors == 1 and sink._buffer == []


def _append_events(path: str, tag: str, n: int) -> None:
    from evocache.controller import AccessEvent, JsonlSink

    sink = JsonlSink(path, flush_every=64)
    for i in range(n):
        sink.emit(AccessEvent(t=float(i), key=f"{tag}-{i}" + "k" * 200, ns="ns", rule="r", policy="p@1",
                              outcome="miss", tier=None, size=0, latency_ms=0.1, saved_ms=0.0, fn="f",
                              reason="", semantic=None))
    sink.close()


def test_processes_appending_to_one_jsonl_file_never_interleave_lines(tmp_path):
    import multiprocessing

    from evocache.controller import read_events

    path = str(tmp_path / "events.jsonl")
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_append_events, args=(path, tag, 3000)) for tag in ("a", "b")]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    keys = [e.key.split("-")[0] for e in read_events(path)]  # a torn line would not parse
    assert sorted(set(keys)) == ["a", "b"] and len(keys) == 6000
