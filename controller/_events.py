"""Access events: one JSON object per cached call, the format the replay simulator and the agent read.

    {"v": 2, "call": "3fa9c2d1-1b", "t": 1732867200.123, "key": "9f2c...", "ns": "tenant-a",
     "rule": "long-context-greedy", "policy": "chat-prod@7", "arm": "", "outcome": "miss", "tier": null,
     "size": 5321, "latency_ms": 0.41, "saved_ms": 812.0, "stored": "l1,l2", "rejected": "", "reason": "",
     "semantic": null, "kv": null, "fn": "app:answer", "saved_tokens": 0, "saved_cost": 0.0,
     "cost": 0.0}

One event per call, written when the call ends (a stream: after its last piece), with the call's id (``call``,
as ``CallOutcome.call_id``), the time it was decided (``t``) and the schema version (``v``). ``outcome`` is
``hit`` (served from ``tier``; ``size`` the entry's bytes, ``saved_ms`` what computing it took), ``miss`` (the
function ran: ``size`` its result's bytes, ``saved_ms`` what it took, ``stored`` the tiers that took the result,
comma-separated, or ``rejected`` why none did: ``too-large``, ``unserializable``, ``not-stored``,
``invalidated``, ``stream-not-allowed``, or ``incomplete`` when the function raised or its stream was closed
before its end) or ``bypass`` (not looked up: ``reason`` says why). ``latency_ms`` is the lookup's time.
``arm`` is the rollout arm that decided (``canary``, ``shadow``; empty for the policy in force). ``kv`` is the
engine's KV prefix cache usage when its model ran with one (``serving.kv.KvUsage.as_dict``: prompt and reused
tokens by tier, ``miss`` the reason the first block missed: ``never-seen``, also for tokens another tenant
sent; ``evicted``, ``partial-block``, ``below-min-tokens``, ``off``, ``corrupt``). ``saved_tokens`` and
``saved_cost`` are what the call saved in an engine's tokens and in money (``CallOutcome``; 0 when the engine
reported nothing, and in files written before they were recorded); ``cost`` what the call's answer costs
without any cache (a hit, its entry's; a miss, the engine's report): what caching it is worth. A rule's SLO
breaker (``controller._slo``) records its transitions as ``slo-open``, ``slo-half-open`` and ``slo-closed``, with the
rule, the namespace and a ``reason``, and no key or call; the decisions of a rule it tripped carry reason
``slo-breaker``. A sink that fails never fails a call: its errors are logged and counted in ``errors``.

Version 1 files (no ``v``) recorded a call as up to three events: its decision (a miss with size 0), then
``store`` or ``reject`` with the result's size, then ``kv``. ``controller.replay.read_events`` reads both and
gives one event per call; nothing else reads event files.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from ._breaker import Breaker
from ._outcome import call_id_of

log = logging.getLogger("evocache.controller.events")

SCHEMA_VERSION = 2
OUTCOMES = ("hit", "miss", "bypass", "slo-open", "slo-half-open", "slo-closed")
"""The outcomes recorded now: a call's three and the SLO breaker's transitions."""
INCOMPLETE = "incomplete"
"""``rejected`` of a miss whose result was neither stored nor refused: the function raised, its stream was
closed before its end, or (a version 1 file) the event that sized it was lost."""
V1_OUTCOMES = ("store", "reject", "kv")
"""Outcomes that only version 1 files hold (a miss's result, and the engine's KV usage, as events of their own)."""


class _Fields(NamedTuple):
    # AccessEvent's fields; the methods live on the subclass, since a NamedTuple body may not define _make.
    t: float
    key: str
    ns: str
    rule: str
    policy: str
    outcome: str
    tier: str | None
    size: int
    latency_ms: float
    saved_ms: float
    fn: str = ""
    reason: str = ""
    semantic: dict[str, Any] | None = None
    # After the fields the L1 hit path records (it stops at ``cost``), those a miss or the engine fills in.
    call: str = ""
    arm: str = ""
    saved_tokens: int = 0
    saved_cost: float = 0.0
    cost: float = 0.0
    kv: dict[str, Any] | None = None
    stored: str = ""
    rejected: str = ""
    v: int = SCHEMA_VERSION


class AccessEvent(_Fields):
    """One call (or a breaker's transition). A named tuple, so the request path can record a plain tuple in
    this field order and a reader turns it into an event for free (``AccessEvent._make(record)``).

    A record may stop before the trailing fields that have defaults: ``_make`` fills them in (``v`` as the
    current version). ``from_dict`` reads a decoded JSON object: a record without ``v`` is version 1."""

    __slots__ = ()

    @classmethod
    def _make(cls, iterable: Any) -> AccessEvent:
        record = tuple(iterable)
        missing = len(cls._fields) - len(record)
        if missing:
            if not 0 < missing <= len(_TRAILING_DEFAULTS):
                raise TypeError(f"an access event record has {len(cls._fields)} fields, got {len(record)}")
            record += _TRAILING_DEFAULTS[len(_TRAILING_DEFAULTS) - missing :]
        if type(record[_CALL]) is int:  # the L1 hit path records the call's number (controller._outcome)
            record = (*record[:_CALL], call_id_of(record[_CALL]), *record[_CALL + 1 :])
        return tuple.__new__(cls, record)

    def to_dict(self) -> dict[str, Any]:
        return self._asdict()

    def to_json(self) -> str:
        return json.dumps(self._asdict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AccessEvent:
        """The event a decoded JSON object holds, its fields checked; ``ValueError`` naming the first field
        that is missing or of the wrong type (unknown fields are ignored: readers skip what they do not
        know)."""
        if type(data) is not dict:
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
        version = data.get("v", 1)
        if type(version) is not int or version < 1:
            raise ValueError(f"field 'v' must be an int >= 1, got {_show(version)}")
        outcome = data.get("outcome")
        known = OUTCOMES if version >= 2 else OUTCOMES + V1_OUTCOMES
        if outcome not in known:
            raise ValueError(f"field 'outcome' must be one of {sorted(known)}, got {_show(outcome)}")
        values = {"v": version, **_ABSENT}
        for name, check in _CHECKS.items():
            if name in data:
                values[name] = check(name, data[name])
            elif name in _REQUIRED:
                raise ValueError(f"missing field {name!r}")
        return cls(**values)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _number(name: str, value: Any) -> float:
    if type(value) in (int, float) and math.isfinite(value):
        return value
    raise ValueError(f"field {name!r} must be a finite number, got {_show(value)}")


def _count(name: str, value: Any) -> int:
    if type(value) is int and value >= 0:
        return value
    raise ValueError(f"field {name!r} must be an int >= 0, got {_show(value)}")


def _string(name: str, value: Any) -> str:
    if type(value) is str:
        return value
    raise ValueError(f"field {name!r} must be a string, got {_show(value)}")


def _key(name: str, value: Any) -> str:
    if type(value) is int:  # traces written by other tools number their keys
        return str(value)
    return _string(name, value)


def _optional_string(name: str, value: Any) -> str | None:
    return None if value is None else _string(name, value)


def _object(name: str, value: Any) -> dict[str, Any] | None:
    if value is None or type(value) is dict:
        return value
    raise ValueError(f"field {name!r} must be an object or null, got {_show(value)}")


_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "t": _number, "key": _key, "ns": _string, "rule": _string, "policy": _string, "outcome": _string,
    "tier": _optional_string, "size": _count, "latency_ms": _number, "saved_ms": _number, "fn": _string,
    "reason": _string, "semantic": _object, "kv": _object, "call": _string, "stored": _string,
    "rejected": _string, "arm": _string, "saved_tokens": _count, "saved_cost": _number,
    "cost": _number,
}
_REQUIRED = frozenset(("t", "key", "outcome", "size"))
# What a field a record leaves out reads as (traces written by hand or by other tools carry only the required).
_ABSENT: dict[str, Any] = {"ns": "", "rule": "", "policy": "", "tier": None, "latency_ms": 0.0, "saved_ms": 0.0}


_CALL = _Fields._fields.index("call")
_TRAILING_DEFAULTS = tuple(_Fields._field_defaults[f] for f in _Fields._fields if f in _Fields._field_defaults)

EventRecord = tuple
"""A plain tuple in ``AccessEvent`` field order: what the request path hands to a sink."""


class EventSink(Protocol):
    """Receives every decision. ``record`` is on the request path: it must be cheap and must not raise."""

    errors: int

    def record(self, rec: EventRecord) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class RingSink:
    """The last ``capacity`` events in memory (the embedded default; tests and the demo read it).

    Records are kept as the plain tuples the request path made and become ``AccessEvent``s only when read.
    """

    def __init__(self, capacity: int = 100_000) -> None:
        self._records: collections.deque[EventRecord] = collections.deque(maxlen=capacity)
        self.record = self._records.append  # deque.append is atomic under the GIL: no lock, no extra call
        self.errors = 0

    def emit(self, event: AccessEvent) -> None:
        self._records.append(tuple(event))

    def events(self) -> list[AccessEvent]:
        return [AccessEvent._make(r) for r in list(self._records)]

    def __len__(self) -> int:
        return len(self._records)

    def flush(self) -> None:
        return None

    def close(self) -> None:
        return None


class _AppendOnly:
    """A file descriptor opened for appending, written whole: ``write`` retries a short write, so a batch
    is one line-aligned ``write`` call unless the kernel splits it (a full disk, a signal)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.closed = False

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self.fd)


class JsonlSink:
    """Appends one JSON line per event to ``path``; lines are buffered and flushed every ``flush_every`` events
    and on ``flush()``/``close()``. A write error (disk full) drops the buffered events and counts them.

    Each flush is one ``write`` on a descriptor opened with ``O_APPEND``, so several processes (the replicas of
    one deployment) can append to one file without interleaving their lines."""

    def __init__(self, path: str | os.PathLike[str], *, flush_every: int = 256) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = _AppendOnly(os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644))
        self._lock = threading.Lock()
        self._buffer: list[EventRecord] = []
        self._flush_every = flush_every
        self.errors = 0

    def record(self, rec: EventRecord) -> None:
        # Formatting waits for the flush, so a burst of decisions pays for JSON once per batch.
        with self._lock:
            if self._file.closed:  # a function still pinned to a runtime that was closed: count, keep nothing
                self.errors += 1
                return
            self._buffer.append(rec)
            if len(self._buffer) >= self._flush_every:
                self._flush_locked()

    def emit(self, event: AccessEvent) -> None:
        self.record(tuple(event))

    def _flush_locked(self) -> None:
        if not self._buffer or self._file.closed:
            return
        records, self._buffer = self._buffer, []
        try:
            lines = [AccessEvent._make(r).to_json() for r in records]
            self._file.write(("\n".join(lines) + "\n").encode("utf-8"))
        except OSError as exc:
            self.errors += len(records)
            log.warning("event sink %s: %d events dropped: %s", self.path, len(records), exc)

    def flush(self) -> None:
        with self._lock:
            self._flush_locked()

    def close(self) -> None:
        with self._lock:
            self._flush_locked()
            self._file.close()


class RedisStreamSink:
    """XADD events to a capped Redis stream (field ``e`` = the JSON): the cluster's shared event stream.

    The request path only appends to a buffer; a background thread sends it in pipelined batches every
    ``interval`` seconds (sooner once ``batch`` events wait), so no request, and no event loop, ever waits on
    Redis for its event. While Redis fails, events are dropped and counted in ``errors``: after a failed batch
    nothing is sent for ``retry_after`` seconds (``breaker``, a ``controller._breaker.Breaker`` on ``clock``). The buffer is bounded (``max_buffer``); past it, events are
    dropped and counted too. ``flush`` sends what waits now; ``close`` flushes and stops the thread.
    """

    def __init__(self, url: str, *, stream: str = "evocache:events", maxlen: int = 1_000_000,
                 socket_timeout: float = 0.05, batch: int = 256, interval: float = 0.05,
                 retry_after: float = 1.0, max_buffer: int = 100_000,
                 clock: Callable[[], float] = time.monotonic, client: Any = None) -> None:
        from ._redis_client import REDIS_ERRORS, connect

        self._redis_errors = REDIS_ERRORS
        # One key: on a Redis Cluster (a redis+cluster:// url) the stream lives in one slot, and a batch is
        # one pipeline to its primary.
        self.client = client or connect(url, socket_timeout=socket_timeout, connect_timeout=socket_timeout)
        self.stream = stream
        self.maxlen = maxlen
        self.errors = 0
        self._batch = batch
        self._interval = interval
        self._max_buffer = max_buffer
        self.breaker = Breaker(retry_after, clock=clock)
        self._buffer: collections.deque[EventRecord] = collections.deque()
        self._wake = threading.Event()
        self._send_lock = threading.Lock()  # one sender at a time: the thread, or a caller's flush()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"evocache-events-{stream}", daemon=True)
        self._thread.start()

    def record(self, rec: EventRecord) -> None:
        if self._closed or len(self._buffer) >= self._max_buffer:
            self.errors += 1
            return
        self._buffer.append(rec)  # atomic; the sender pops from the other end
        if len(self._buffer) >= self._batch:
            self._wake.set()

    def emit(self, event: AccessEvent) -> None:
        self.record(tuple(event))

    def flush(self) -> None:
        """Send everything buffered now, on the calling thread."""
        self._send()

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(self._interval)
            self._wake.clear()
            self._send()

    def _send(self) -> None:
        with self._send_lock:
            while self._buffer:
                records = [self._buffer.popleft() for _ in range(min(len(self._buffer), self._batch))]
                if self.breaker.refuses():
                    self.errors += len(records)
                    continue
                trips = self.breaker.trips
                try:
                    pipe = self.client.pipeline(transaction=False)
                    for rec in records:
                        pipe.xadd(self.stream, {"e": AccessEvent._make(rec).to_json()}, maxlen=self.maxlen,
                                  approximate=True)
                    pipe.execute()
                except self._redis_errors as exc:
                    self.breaker.trip(f"{type(exc).__name__}: {exc}")
                    self.errors += len(records)
                    log.warning("event stream %s: %d events dropped, %d in all (%s)", self.stream,
                                len(records), self.errors, exc)
                else:
                    self.breaker.succeeded(trips)

    def read(self, count: int = 1000) -> list[AccessEvent]:
        rows = self.client.xrange(self.stream, count=count)
        return [AccessEvent.from_dict(json.loads(fields[b"e"])) for _, fields in rows]

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=5)
        self._send()
        self.client.close()
