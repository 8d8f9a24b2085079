"""The cache's own signal: access events (``controller._events``), tailed from JSONL files or a Redis stream,
turned into the loop's ``(Request, Outcome)`` pairs.

    JsonlTail(path)                 new lines of one JSONL file since the last read (rotation, rewrite)
    RedisStreamTail(url, stream=)   new entries of the RedisStreamSink's stream since the last id read
    EventsCollector(sources)        poll() -> new pairs; requests_between(start, end); collect(start, end)

How events become pairs: each source's events are read as one event per call
(``controller.replay.CallEvents``: version 2 events as they are, a version 1 miss with its store or reject and
its kv folded in), and each call is one pair, in the source's order:

- ``hit``: ``Outcome(lookups=1, hits=1, tier=...)``; ``size`` the entry's bytes; ``latency_ms`` the event's
  ``saved_ms`` (what the model took when the entry was computed: the time the hit saved). A semantic hit
  (``reason == "semantic"``) has ``semantic=True``.
- ``miss``: ``Outcome(lookups=1, hits=0)``; ``size`` the result's bytes and ``latency_ms`` the function's time
  (``saved_ms``); a miss that never completed (``rejected`` ``incomplete``) has latency -1.
- ``bypass``: ``Outcome(lookups=0, hits=0, bypass=True)``, latency unknown (-1).
- ``prompt_tokens`` comes from the call's KV usage (``kv["prompt_tokens"]``), -1 without one.
- The SLO breaker's ``slo-*`` transitions are not requests.

A malformed line or entry is skipped, counted in ``skipped`` and logged (file and line, or stream and id), so
one bad writer never stops the loop. Memory is bounded: pairs older than ``retention_s`` (behind the newest
event) or beyond ``max_pairs`` are dropped, and each read takes at most ``max_read_bytes`` / ``max_entries``.
"""

from __future__ import annotations

import bisect
import itertools
import json
import logging
import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from evocache.controller import INCOMPLETE, AccessEvent
from evocache.controller.replay import CallEvents

from .._types import Outcome, Request, Series, step_series
from ..errors import SignalUnavailable

log = logging.getLogger("evocache.agents.signals")

_LOGGED_BAD = 20  # bad lines logged per source; the rest are only counted


class EventSource(Protocol):
    """Where events come from. ``read()`` returns the records that arrived since the last call, each as
    ``(where, decoded JSON)``; ``where`` names the file and line (or stream and id) for messages."""

    name: str
    skipped: int

    def read(self) -> list[tuple[str, Any]]: ...

    def close(self) -> None:
        """Release the file or connection (a client the caller handed in stays the caller's)."""


class _Skips:
    """Counts bad records of one source and logs the first few with where they were."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.skipped = 0

    def skip(self, where: str, why: str) -> None:
        self.skipped += 1
        if self.skipped <= _LOGGED_BAD:
            log.warning("%s: skipped: %s", where, why)
        elif self.skipped == _LOGGED_BAD + 1:
            log.warning("%s: more bad records; only counting them from now on", self.name)


class JsonlTail(_Skips):
    """Tails one JSONL event file (``controller._events.JsonlSink``'s output).

    Each ``read()`` returns the complete lines appended since the last one; a partial last line waits for its
    newline. A rotated file (the path now names another inode) is read to its end, then the new file from its
    start. A file rewritten in place is read again from its start: one shorter than what was read, or one
    whose bytes read before no longer match (the first and the last ``_CHECK_BYTES`` read are kept and
    compared before every read), as when it is truncated and written longer, or as long, between two reads.
    A missing file is no events yet. A line longer than ``max_line_bytes`` is skipped; a read takes at most
    ``max_read_bytes``.
    """

    _CHECK_BYTES = 4096

    def __init__(
        self, path: str | os.PathLike[str], *, max_line_bytes: int = 1 << 20, max_read_bytes: int = 64 << 20
    ) -> None:
        super().__init__(str(path))
        self.path = Path(path)
        self.max_line_bytes = max_line_bytes
        self.max_read_bytes = max_read_bytes
        self._fh: Any = None
        self._id: tuple[int, int] | None = None
        self._offset = 0
        self._head = b""  # the first bytes read
        self._tail = b""  # the last bytes read, ending at the offset
        self._partial = b""
        self._discarding = False  # inside an over-long line: drop bytes until its newline
        self._lineno = 0

    def read(self) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        if self._fh is None and not self._open():
            return out
        self._drain(out)
        try:
            st = os.stat(self.path)
        except FileNotFoundError:  # rotated away and not yet recreated: the old handle was read to its end
            return out
        if (st.st_dev, st.st_ino) != self._id:
            if self._partial:
                self.skip(
                    f"{self.path}:{self._lineno + 1}", "an unfinished last line before the file was rotated"
                )
            self.close()
            if self._open():
                self._drain(out)
        return out

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def _open(self) -> bool:
        try:
            self._fh = open(self.path, "rb")  # noqa: SIM115  # held open across reads to follow a rotation
        except FileNotFoundError:
            return False
        st = os.fstat(self._fh.fileno())
        self._id = (st.st_dev, st.st_ino)
        self._restart()
        return True

    def _restart(self) -> None:
        self._offset = 0
        self._head = self._tail = b""
        self._partial = b""
        self._discarding = False
        self._lineno = 0

    def _next_bytes(self) -> bytes:
        """The bytes after what was read; the file from its start when it no longer holds what was read."""
        size = os.fstat(self._fh.fileno()).st_size
        if size < self._offset:
            why = f"truncated ({size} bytes, {self._offset} read)"
        else:
            self._fh.seek(0)
            same = self._fh.read(len(self._head)) == self._head
            why = "" if same else "rewritten (its first bytes changed)"
        if not why:
            # the bytes before the offset and those after it in one read, so that a rewrite cannot fall
            # between the check and the read
            keep = len(self._tail)
            self._fh.seek(self._offset - keep)
            chunk = self._fh.read(keep + self.max_read_bytes)
            if chunk[:keep] == self._tail:
                return chunk[keep:]
            why = "rewritten (the bytes before where it was read to changed)"
        # resuming at the old offset would start mid-line in the new content and lose its first lines
        log.info("%s: %s; reading it from the start", self.path, why)
        self._restart()
        self._fh.seek(0)
        return self._fh.read(self.max_read_bytes)

    def _drain(self, out: list[tuple[str, Any]]) -> None:
        data = self._next_bytes()
        self._offset += len(data)
        if not data:
            return
        if len(self._head) < self._CHECK_BYTES:
            self._head += data[: self._CHECK_BYTES - len(self._head)]
        self._tail = (self._tail + data[-self._CHECK_BYTES :])[-self._CHECK_BYTES :]
        *lines, rest = (self._partial + data).split(b"\n")
        if self._discarding and lines:
            lines = lines[1:]  # the tail of the over-long line
            self._discarding = False
        for raw in lines:
            self._lineno += 1
            self._line(raw, out)
        if len(rest) > self.max_line_bytes:
            self._lineno += 1
            self.skip(f"{self.path}:{self._lineno}", f"a line longer than {self.max_line_bytes} bytes")
            rest, self._discarding = b"", True
        elif self._discarding:
            rest = b""
        self._partial = rest

    def _line(self, raw: bytes, out: list[tuple[str, Any]]) -> None:
        where = f"{self.path}:{self._lineno}"
        if len(raw) > self.max_line_bytes:
            self.skip(where, f"a line longer than {self.max_line_bytes} bytes")
            return
        if not raw.strip():
            return
        try:
            out.append((where, json.loads(raw)))
        except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            self.skip(where, f"invalid JSON: {exc}")


class RedisStreamTail(_Skips):
    """Reads the entries of the event stream (``controller._events.RedisStreamSink``: field ``e`` holds the
    event's JSON, unsigned) added since the last id read, starting after ``start_id`` ("0-0": everything the
    capped stream still holds). Redis failures raise ``SignalUnavailable`` (the next read tries again from
    the same id); a stream that starts over (deleted, or a Redis restarted empty) is read from its start.
    ``client``: an existing redis client, else one is made for ``url``."""

    def __init__(
        self,
        url: str | None = None,
        *,
        stream: str = "evocache:events",
        client: Any = None,
        start_id: str = "0-0",
        batch: int = 1000,
        max_entries: int = 100_000,
    ) -> None:
        from evocache.controller import REDIS_ERRORS
        from evocache.controller import connect_redis as connect

        if client is None:
            if url is None:
                raise ValueError("RedisStreamTail needs a url or a client")
            client = connect(url, socket_timeout=1.0, connect_timeout=1.0)
            self._owned = True
        else:
            self._owned = False
        super().__init__(f"redis stream {stream}")
        self.client = client
        self.stream = stream
        self.last_id = start_id
        self.batch = batch
        self.max_entries = max_entries
        self._errors = REDIS_ERRORS

    def close(self) -> None:
        if self._owned:
            self.client.close()

    def read(self) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        while len(out) < self.max_entries:
            try:
                reply = self.client.xread({self.stream: self.last_id}, count=self.batch)
            except self._errors as exc:
                raise SignalUnavailable("events", f"{self.name}: {type(exc).__name__}: {exc}") from exc
            rows = reply[0][1] if reply else []
            for entry_id, fields in rows:
                self.last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                self._entry(fields, out)
            if len(rows) < self.batch:
                break
        if not out and self._started_over():
            return self.read()  # once: the last id is now 0-0, below any id
        return out

    def _started_over(self) -> bool:
        # A stream that was deleted, or a Redis that restarted empty, numbers its entries from below the last
        # id read: XREAD after that id would wait for ids that come only much later. Start over then.
        try:
            newest = self.client.xrevrange(self.stream, count=1)
        except self._errors as exc:
            raise SignalUnavailable("events", f"{self.name}: {type(exc).__name__}: {exc}") from exc
        top = _id(newest[0][0]) if newest else (0, 0)
        if top < _id(self.last_id):
            log.info(
                "%s: newest id %s is below the last read %s (a new stream); reading it from the start",
                self.name,
                f"{top[0]}-{top[1]}",
                self.last_id,
            )
            self.last_id = "0-0"
            return True
        return False

    def _entry(self, fields: dict[Any, Any], out: list[tuple[str, Any]]) -> None:
        where = f"{self.name} id {self.last_id}"
        raw = fields.get(b"e", fields.get("e"))
        if raw is None:
            self.skip(where, f"no field 'e' (fields {sorted(map(str, fields))})")
            return
        try:
            out.append((where, json.loads(raw)))
        except (ValueError, RecursionError) as exc:
            self.skip(where, f"invalid JSON: {exc}")


def _id(entry_id: str | bytes) -> tuple[int, int]:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


class _Bad(Exception):
    """A record that is not an access event; the message says why."""


def _event(rec: Any) -> AccessEvent:
    try:
        return AccessEvent.from_dict(rec)
    except ValueError as exc:
        raise _Bad(str(exc)) from None


class _Slot:
    """One call as the loop's pair: its request, outcome and the policy version that decided it; ``seq``
    orders calls of one time."""

    __slots__ = ("outcome", "policy", "request", "seq")

    def __init__(self, request: Request, outcome: Outcome, policy: str, seq: int) -> None:
        self.request = request
        self.outcome = outcome
        self.policy = policy
        self.seq = seq


def _order(slot: _Slot) -> tuple[float, int]:
    return slot.request.t, slot.seq


def _prompt_tokens(usage: dict | None) -> int:
    tokens = usage.get("prompt_tokens", -1) if usage is not None else -1
    return tokens if type(tokens) is int and tokens >= 0 else -1


def _pair(e: AccessEvent, seq: int) -> _Slot | None:
    """The call ``e`` as a pair (the module docstring says how); None for what is no request."""
    keys = (e.key,) if e.key else ()
    prompt = _prompt_tokens(e.kv)
    cost = float(e.cost) if e.cost > 0 else -1.0  # what its answer costs without the cache, when reported
    if e.outcome == "hit":
        req = Request(e.t, "response", keys, size=e.size, ns=e.ns, rule=e.rule, latency_ms=float(e.saved_ms),
                      prompt_tokens=prompt, cost=cost)
        return _Slot(req, Outcome(1, 1, tier=e.tier or "", semantic=e.reason == "semantic"), e.policy, seq)
    if e.outcome == "miss":
        latency = -1.0 if e.rejected == INCOMPLETE else float(e.saved_ms)
        req = Request(e.t, "response", keys, size=e.size, ns=e.ns, rule=e.rule, latency_ms=latency,
                      prompt_tokens=prompt, cost=cost)
        return _Slot(req, Outcome(1, 0), e.policy, seq)
    if e.outcome == "bypass":
        req = Request(e.t, "response", keys, size=e.size, ns=e.ns, rule=e.rule, prompt_tokens=prompt, cost=cost)
        return _Slot(req, Outcome(0, 0, bypass=True), e.policy, seq)
    return None


class EventsCollector:
    """Access events as the loop's pairs, and as per-step series (module docstring).

    ``sources``: ``EventSource``s (``JsonlTail``, ``RedisStreamTail``); each is paired on its own, since a
    miss and its store come from the same replica. ``collect(start, end)`` polls, then returns
    ``step_series`` of the kept pairs with ``start <= t < end`` (steps of ``step_s``, sliced by ``by``) and a
    ``policy_qps`` series per policy label. A source that cannot be read (Redis down) raises
    ``SignalUnavailable`` from ``poll``/``collect`` after the other sources were read.
    """

    name = "events"

    def __init__(
        self,
        sources: Sequence[EventSource],
        *,
        step_s: float = 10.0,
        by: Sequence[str] = ("rule", "tenant"),
        retention_s: float = 3600.0,
        max_pairs: int = 500_000,
        miss_lookahead: int = 10_000,
        miss_wait_s: float = 60.0,
    ) -> None:
        if not sources:
            raise ValueError("EventsCollector needs at least one source")
        if not (step_s > 0 and math.isfinite(step_s)):
            raise ValueError(f"step_s must be finite and > 0, got {step_s!r}")
        self.sources = list(sources)
        self.step_s = step_s
        self.by = tuple(by)
        self.retention_s = retention_s
        self.max_pairs = max_pairs
        self._seq = itertools.count()
        self._calls = [CallEvents(lookahead=miss_lookahead, wait_s=miss_wait_s) for _ in self.sources]
        self._pairs: list[_Slot] = []  # kept in (t, seq) order
        self.skipped = 0  # records that were JSON but not access events

    @classmethod
    def from_files(cls, paths: Iterable[str | os.PathLike[str]], **options: Any) -> EventsCollector:
        return cls([JsonlTail(p) for p in paths], **options)

    @classmethod
    def from_redis(cls, url: str, *, stream: str = "evocache:events", **options: Any) -> EventsCollector:
        return cls([RedisStreamTail(url, stream=stream)], **options)

    def poll(self) -> list[tuple[Request, Outcome]]:
        """The pairs completed since the last poll, per source in its order."""
        return [(s.request, s.outcome) for s in self._poll()]

    def close(self) -> None:
        """Close every source."""
        for source in self.sources:
            source.close()

    def poll_labelled(self) -> list[tuple[Request, Outcome, str]]:
        """As ``poll``, each pair with the policy version that decided it (``name@version``): what tells a
        canary's requests from its base's."""
        return [(s.request, s.outcome, s.policy) for s in self._poll()]

    def _poll(self) -> list[_Slot]:
        released: list[_Slot] = []
        failure: SignalUnavailable | None = None
        for source, calls in zip(self.sources, self._calls, strict=True):
            try:
                records = source.read()
            except SignalUnavailable as exc:
                failure = exc
                records = []
            for where, rec in records:
                try:
                    event = _event(rec)
                except _Bad as exc:
                    self.skipped += 1
                    if self.skipped <= _LOGGED_BAD:
                        log.warning("%s: not an access event: %s", where, exc)
                    continue
                released += self._pairs_of(calls.feed(event))
            released += self._pairs_of(calls.settle())  # read to its end: no kv event is on its way
        self._keep(released)
        if failure is not None:
            raise failure
        return released

    def _pairs_of(self, calls: list[AccessEvent]) -> list[_Slot]:
        pairs = (_pair(call, next(self._seq)) for call in calls)
        return [p for p in pairs if p is not None]

    def requests_between(
        self, start: float, end: float, *, policy: str | None = None
    ) -> list[tuple[Request, Outcome]]:
        """The kept pairs with ``start <= t < end`` in time order (only ``policy``'s when given)."""
        return [
            (s.request, s.outcome) for s in self._between(start, end) if policy is None or s.policy == policy
        ]

    def collect(self, start: float, end: float) -> list[Series]:
        self.poll()
        slots = self._between(start, end)
        if not slots:
            return []
        reqs = [s.request for s in slots]
        outs = [s.outcome for s in slots]
        series = step_series(reqs, outs, start=start, end=end, step_s=self.step_s, by=self.by)
        return series + self._policy_series(slots, start, end)

    def _policy_series(self, slots: list[_Slot], start: float, end: float) -> list[Series]:
        n = max(1, math.ceil((end - start) / self.step_s))
        counts: dict[str, list[float]] = {}
        for s in slots:
            i = min(n - 1, max(0, int((s.request.t - start) // self.step_s)))
            counts.setdefault(s.policy, [0.0] * n)[i] += 1
        times = tuple(start + i * self.step_s for i in range(n))
        return [
            Series("policy_qps", (("policy", p),), times, tuple(c / self.step_s for c in row), "1/s")
            for p, row in sorted(counts.items())
        ]

    def _between(self, start: float, end: float) -> list[_Slot]:
        pairs = self._pairs
        lo = bisect.bisect_left(pairs, start, key=lambda s: s.request.t)
        hi = bisect.bisect_left(pairs, end, key=lambda s: s.request.t)
        return pairs[lo:hi]

    def _keep(self, released: list[_Slot]) -> None:
        pairs = self._pairs
        for slot in released:
            if not pairs or _order(pairs[-1]) <= _order(slot):
                pairs.append(slot)
            else:  # another source's pairs, or a miss that waited for its store
                bisect.insort(pairs, slot, key=_order)
        if not pairs:
            return
        newest = max(c.newest for c in self._calls)
        cut = bisect.bisect_left(pairs, newest - self.retention_s, key=lambda s: s.request.t)
        cut = max(cut, len(pairs) - self.max_pairs)
        if cut > 0:
            del pairs[:cut]

    @property
    def lines_skipped(self) -> int:
        """Bad records in all: unreadable lines of the sources and records that were not access events."""
        return self.skipped + sum(s.skipped for s in self.sources)
