"""An honest queue for KV-block traces: requests arrive at their trace time and wait for one FIFO server.

What a serving system knows when it starts a request is the prompts of the requests that have arrived and not
started; that is all ``serve`` gives a look-ahead policy (``eviction.LookaheadPolicy``), at the moment the
request's service starts, when its blocks are accessed. The order of service is the order of arrival, so the
accesses are exactly the trace's, in the trace's order: a policy that does not read the queue replays as it
would without it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from ..eviction import QueuedRequest
from ._access import Access


@dataclass(frozen=True, slots=True)
class QueueModel:
    """One FIFO server; a request's service time is ``per_request + per_block x (its blocks)`` seconds.

    ``for_utilisation`` derives ``per_block`` from a trace and a target utilisation; ``utilisation`` says what
    a model gives on a trace. Raises ``ValueError`` for a cost that is negative, not finite or not a number.
    """

    per_block: float = 0.0
    per_request: float = 0.0

    def __post_init__(self) -> None:
        for label, value in (("per_block", self.per_block), ("per_request", self.per_request)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
                raise ValueError(f"QueueModel.{label} must be a finite number of seconds >= 0, got {value!r}")

    def service_time(self, blocks: int) -> float:
        return self.per_request + self.per_block * blocks

    @classmethod
    def for_utilisation(cls, trace: Iterable[Access], utilisation: float) -> QueueModel:
        """The per-block model whose utilisation on ``trace`` is ``utilisation`` (see ``utilisation``).
        Raises ``ValueError`` for a utilisation that is not a finite number > 0, or a trace whose requests do
        not span any time."""
        if isinstance(utilisation, bool) or not isinstance(utilisation, int | float) or not (
                0 < utilisation < math.inf):
            raise ValueError(f"utilisation must be a finite number > 0, got {utilisation!r}")
        load = Load.of(trace)
        return cls(per_block=utilisation * load.span / load.blocks)

    def utilisation(self, trace: Iterable[Access]) -> float:
        """Arrival rate x mean service time: (requests / span) x (total service time / requests), where span
        is the time from the first arrival to the last. Above 1 the queue grows for as long as the trace lasts.
        Raises ``ValueError`` for a trace whose requests do not span any time."""
        load = Load.of(trace)
        return (load.requests * self.per_request + load.blocks * self.per_block) / load.span


class Load(NamedTuple):
    """A KV-block trace's requests, their blocks, and the time from the first arrival to the last."""

    requests: int
    blocks: int
    span: float

    @classmethod
    def of(cls, trace: Iterable[Access]) -> Load:
        requests = blocks = 0
        first = last = 0.0
        for arrival in arrivals(trace):
            if not requests:
                first = arrival.t
            last = arrival.t
            requests += 1
            blocks += len(arrival.accesses)
        if not last > first:
            raise ValueError(f"the trace's {requests} request(s) span no time: a utilisation means nothing")
        return cls(requests, blocks, last - first)


class Backlog(NamedTuple):
    """The queue a look-ahead policy is shown: the requests waiting at a service start (arrived, not started),
    their mean over every request's service start and the most at one. It does not depend on the cache, only on
    the trace and the model. Raises what ``serve`` raises."""

    mean: float
    most: int

    @classmethod
    def of(cls, trace: Iterable[Access], model: QueueModel) -> Backlog:
        starts = total = most = 0
        for service in serve(trace, model):
            waiting = len(service.waiting)
            starts += 1
            total += waiting
            most = max(most, waiting)
        return cls(total / starts if starts else 0.0, most)


class Arrival(NamedTuple):
    """One request of the trace: when it arrives, its accesses (its blocks, in prefix order), and what a
    look-ahead policy is told of it while it waits."""

    t: float
    accesses: tuple[Access, ...]
    queued: QueuedRequest


class Service(NamedTuple):
    """The start of one request's service: when, the request, and the requests waiting at that moment (arrived
    at or before ``start``, not started), in queue order."""

    start: float
    request: Arrival
    waiting: tuple[QueuedRequest, ...]


def arrivals(trace: Iterable[Access]) -> Iterator[Arrival]:
    """The trace's requests: runs of consecutive accesses with one request number, arriving at the first one's
    ``t``. Keys are the replay's (``(ns, key)``, or ``key`` when ``ns`` is ""). Raises ``ValueError`` for an
    access without a request number (not a KV-block trace) or a request that arrives before the one before it
    (naming both)."""
    batch: list[Access] = []
    previous: Arrival | None = None

    def flush() -> Arrival:
        nonlocal previous
        first = batch[0]
        if previous is not None and first.t < previous.t:
            raise ValueError(f"request {first.req} arrives at t={first.t} before request {previous.queued.req} "
                             f"(t={previous.t}): a queue needs arrivals in time order")
        keys: tuple[Hashable, ...] = tuple((a.ns, a.key) if a.ns else a.key for a in batch)
        previous = Arrival(first.t, tuple(batch), QueuedRequest(first.req, keys))
        batch.clear()
        return previous

    for i, a in enumerate(trace):
        if a.req < 0:
            raise ValueError(f"access {i} (key {a.key!r}) has no request number: the queue model needs a "
                             "KV-block trace (Mooncake)")
        if batch and a.req != batch[0].req:
            yield flush()
        batch.append(a)
    if batch:
        yield flush()


def serve(trace: Iterable[Access], model: QueueModel) -> Iterator[Service]:
    """Each request's service start, in order. A request starts at its arrival or when the one before it
    finishes, whichever is later; the waiting requests are read ahead of it from the trace only as far as
    they have arrived by then. Memory: the queue. Raises what ``arrivals`` raises."""
    incoming = arrivals(trace)
    pending = next(incoming, None)
    waiting: deque[Arrival] = deque()
    free_at = -math.inf
    while waiting or pending is not None:
        if not waiting:
            assert pending is not None
            waiting.append(pending)
            pending = next(incoming, None)
        head = waiting.popleft()
        start = max(head.t, free_at)
        while pending is not None and pending.t <= start:
            waiting.append(pending)
            pending = next(incoming, None)
        yield Service(start, head, tuple(w.queued for w in waiting))
        free_at = start + model.service_time(len(head.accesses))
