"""Access events read back as calls: one event per call, whichever version wrote them.

    for event in read_events("events.jsonl"):      # a path, an open file or lines of JSON
        event.outcome, event.size, event.stored     # "miss", 5321, "l1,l2"

    calls = CallEvents()                            # incremental, for a tail that grows
    done = calls.feed(AccessEvent.from_dict(json.loads(line)))
    done += calls.settle()                          # read to its end for now
    done += calls.flush()                           # at the end of the file

Version 2 events (``v: 2``) are one per call already and pass through. A version 1 file recorded a call as its
decision, then (after a miss) a ``store`` or ``reject`` event with the result's size, then (when its engine had
a KV prefix cache) a ``kv`` event; ``CallEvents`` folds them into the call's event: the miss takes the size,
the function's time (``saved_ms``) and ``stored`` (the store's tiers) or ``rejected`` (the reject's reason); a
``kv`` event's usage goes into the ``kv`` of the latest call of the same namespace and key that is still
queued (version 1 wrote it right after the call's store). A version 1 miss therefore stays queued until its
``kv`` event folds in or ``KV_WINDOW`` more events have arrived; it also waits for its store, at most
``lookahead`` events or ``wait_s`` seconds of event time (later events queue behind it, so the order stays the source's), then comes out with size 0 and
``rejected`` ``incomplete``: its function raised, or the lines were lost. A ``kv`` event with no queued call to
fold into (version 1 wrote no key after a bypass) is dropped and counted in ``unfolded``. Memory is bounded
by ``lookahead``. (Exported by ``controller.replay`` and, as ``read_events``, by ``controller``.)
"""

from __future__ import annotations

import json
import math
import os
from collections import deque
from collections.abc import Iterable, Iterator
from ._events import INCOMPLETE, AccessEvent
from .errors import TraceError

MISS_LOOKAHEAD = 10_000
"""How many events a version 1 miss waits for the store or reject that gives its size."""

KV_WINDOW = 8
"""How many events a version 1 miss stays queued for a ``kv`` event of its own call (written right after its
store, so only calls running at the same time come between)."""



class _Entry:
    """One call while it is queued: its event so far, whether it is complete (a version 1 miss is not until
    its store or reject), and until which event a version 1 call may still take a ``kv`` event."""

    __slots__ = ("complete", "event", "hold")

    def __init__(self, event: AccessEvent, complete: bool, hold: int) -> None:
        self.event = event
        self.complete = complete
        self.hold = hold


class CallEvents:
    """Events of one source, in its order, in; one event per call out (the module docstring says how)."""

    def __init__(self, *, lookahead: int | None = None, wait_s: float = math.inf) -> None:
        lookahead = MISS_LOOKAHEAD if lookahead is None else lookahead
        if lookahead < 0:
            raise ValueError(f"lookahead must be >= 0, got {lookahead}")
        self.lookahead = lookahead
        self.wait_s = wait_s
        self.unfolded = 0  # version 1 kv events with no queued call of their namespace and key
        self.newest = -math.inf  # the latest event time seen
        self._seq = 0  # events fed
        self._queue: deque[_Entry] = deque()
        self._open: dict[tuple[str, str], deque[_Entry]] = {}  # v1 misses waiting for their store, per slot
        self._latest: dict[tuple[str, str], _Entry] = {}  # the newest queued v1 call per slot, for its kv

    def feed(self, event: AccessEvent) -> list[AccessEvent]:
        """Take the source's next event; returns the calls now complete, in the source's order."""
        self._seq += 1
        if event.t > self.newest:
            self.newest = event.t
        slot = (event.ns, event.key)
        outcome = event.outcome
        if outcome == "store" or outcome == "reject":
            waiting = self._open.get(slot)
            if waiting:
                entry = waiting.popleft()
                if not waiting:
                    del self._open[slot]
                entry.event = entry.event._replace(
                    size=event.size, saved_ms=event.saved_ms,
                    stored=(event.tier or "") if outcome == "store" else "",
                    rejected=(event.reason or "not-stored") if outcome == "reject" else "",
                )
                entry.complete = True
                entry.hold = self._seq + KV_WINDOW  # its kv event, if its engine wrote one, comes next
        elif outcome == "kv":
            entry = self._latest.get(slot) if event.key else None
            if entry is not None and entry.event.kv is None:
                entry.event = entry.event._replace(kv=_usage(event))
                entry.hold = 0
            else:
                self.unfolded += 1
        else:
            # A version 1 miss waits for its store (a bypass's kv event named no key: nothing to fold).
            waits = event.v < 2 and outcome == "miss" and event.size == 0 and bool(event.key)
            entry = _Entry(event, not waits, 0)
            self._queue.append(entry)
            if waits:
                self._open.setdefault(slot, deque()).append(entry)
                self._latest[slot] = entry
        return self._release()

    def settle(self) -> list[AccessEvent]:
        """The source has nothing more for now (a tail read to its end): a version 1 miss held only for a kv
        event that did not come with its store comes out; one still waiting for its store stays."""
        out = []
        queue = self._queue
        while queue and queue[0].complete:
            out.append(self._pop())
        return out

    def flush(self) -> list[AccessEvent]:
        """The source has ended: every call still queued comes out (a miss never sized as incomplete)."""
        out = []
        while self._queue:
            out.append(self._pop())
        return out

    def _release(self) -> list[AccessEvent]:
        out = []
        queue = self._queue
        while queue:
            head = queue[0]
            ready = head.complete and head.hold <= self._seq
            if not (ready or len(queue) > self.lookahead or self.newest - head.event.t > self.wait_s):
                break
            out.append(self._pop())
        return out

    def _pop(self) -> AccessEvent:
        entry = self._queue.popleft()
        event = entry.event
        slot = (event.ns, event.key)
        if not entry.complete:  # given up on: it is also the oldest waiting miss of its slot
            waiting = self._open[slot]
            waiting.popleft()
            if not waiting:
                del self._open[slot]
            event = event._replace(rejected=INCOMPLETE)
        if self._latest.get(slot) is entry:
            del self._latest[slot]
        return event._replace(v=2) if event.v < 2 and not event.outcome.startswith("slo-") else event


def _usage(event: AccessEvent) -> dict:
    """A version 1 ``kv`` event's usage: its ``kv`` object, or what the event's own fields said."""
    if event.kv is not None:
        return dict(event.kv)
    return {"cached_tokens": event.size, "load_ms": event.latency_ms, "miss": event.reason}


def read_events(source: str | os.PathLike[str] | Iterable[str], *, name: str = "<events>",
                lookahead: int | None = None) -> Iterator[AccessEvent]:
    """The calls of an event file (a path, or its lines: an open text file, a list), one event per call, of
    either version (module docstring). A malformed line raises ``TraceError`` naming the file (a path's, else
    ``name``) and line."""
    if isinstance(source, (str, os.PathLike)):
        with open(source, encoding="utf-8") as fh:
            yield from _read(fh, os.fspath(source), lookahead)
        return
    yield from _read(source, name, lookahead)


def _read(lines: Iterable[str], name: str, lookahead: int | None) -> Iterator[AccessEvent]:
    calls = CallEvents(lookahead=lookahead)
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            event = AccessEvent.from_dict(json.loads(line))
        except (ValueError, RecursionError) as exc:
            raise TraceError(name, lineno, str(exc)) from None
        yield from calls.feed(event)
    yield from calls.flush()
