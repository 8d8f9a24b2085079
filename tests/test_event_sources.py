"""The shared EventSource suite: every place the loop tails access events from (a JSONL file, a Redis stream)
answers ``read()`` the same way: what was appended since the last read, each record once, in order, with where
it came from; an undecodable record skipped and counted, the rest still read; nothing yet is no records."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from evocache.agents.signals import EventSource, JsonlTail, RedisStreamTail


@dataclass
class Harness:
    source: EventSource
    write: Callable[[dict], None]  # appends one record as the sink writes it
    write_bad: Callable[[], None]  # appends one record that is not JSON


def jsonl(tmp_path: Path) -> Harness:
    path = tmp_path / "events.jsonl"

    def write(record: dict) -> None:
        with path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")

    def write_bad() -> None:
        with path.open("a") as fh:
            fh.write("{not json\n")

    return Harness(JsonlTail(path), write, write_bad)


def stream(url: str) -> Harness:
    client = redis.Redis.from_url(url)
    return Harness(RedisStreamTail(url, stream="evc:test-events"),
                   lambda record: client.xadd("evc:test-events", {"e": json.dumps(record)}),
                   lambda: client.xadd("evc:test-events", {"e": "{not json"}))


@pytest.fixture(params=["jsonl", pytest.param("redis", marks=pytest.mark.redis)])
def harness(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    made = jsonl(tmp_path) if request.param == "jsonl" else stream(request.getfixturevalue("redis_url"))
    yield made
    made.source.close()
    made.source.close()  # closing twice is harmless


def record(i: int) -> dict:
    return {"t": float(i), "key": f"k{i}", "outcome": "hit", "size": i}


def keys(read: list[tuple[str, dict]]) -> list[str]:
    return [rec["key"] for _, rec in read]


def test_nothing_written_yet_is_no_records(harness: Harness) -> None:
    assert harness.source.read() == []
    assert harness.source.skipped == 0


def test_each_record_is_read_once_in_order(harness: Harness) -> None:
    for i in range(3):
        harness.write(record(i))
    assert keys(harness.source.read()) == ["k0", "k1", "k2"]
    assert harness.source.read() == []
    for i in range(3, 5):
        harness.write(record(i))
    assert keys(harness.source.read()) == ["k3", "k4"]


def test_where_names_the_source(harness: Harness) -> None:
    harness.write(record(0))
    ((where, _),) = harness.source.read()
    assert harness.source.name in where


def test_a_record_that_is_not_json_is_skipped_and_counted(harness: Harness) -> None:
    harness.write(record(0))
    harness.write_bad()
    harness.write(record(1))
    assert keys(harness.source.read()) == ["k0", "k1"]
    assert harness.source.skipped == 1
