"""The replay simulator: a production eviction policy, unchanged, run over a trace on the trace's own clock.

The simulator is the policy's owner, like the L1 tier but lean: it keeps ``key -> size`` and the bytes used,
no payloads. Every miss is admitted when it fits and the policy's ``admit`` agrees (cache-on-miss by default; a
bypassed miss is still a miss); room is made by evicting the policy's victims first. Policies that ask for the
access context (``uses_context``) get it for every access, hit or miss. What was hit is counted apart from how it was decided (``_tally``), so that the Belady bound
(``_belady``) reports exactly the same measures as the online policies it is compared with.

With a ``QueueModel`` a look-ahead policy (``LookaheadPolicy``) is also told, at each request's service start,
which requests wait in the queue (``_queue.serve``). Service is FIFO, so the accesses and their order are the
trace's: every other policy replays exactly as without the queue.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from ..eviction import EntryInfo, EvictionPolicy, LookaheadPolicy, QueuedRequest, make_eviction_policy
from ._access import Access
from ._queue import QueueModel, serve

Unit = Literal["bytes", "objects"]
Outcomes = Iterable[tuple[Access, bool]]
"""One ``(access, hit)`` per access of a trace, in trace order: what any simulator hands to ``_tally``."""

PolicyFactory = Callable[..., EvictionPolicy]
"""Called as ``factory(clock=..., rng=...)``: a policy class, or ``functools.partial`` of one with options."""


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """What one policy did over one trace at one capacity.

    ``capacity`` is in ``capacity_unit``: bytes, or objects (each object counting 1 whatever its size).
    Byte measures always use the accesses' sizes. ``per_ns`` maps each namespace seen ("" for none) to
    ``(requests, hits)``. ``windows`` holds ``(t_start, requests, hits)`` for each window of ``window_s``
    seconds of trace time that saw at least one access (windows start at the first access's ``t``; empty
    windows are left out, so a gap in the trace costs nothing). ``prefix_*`` count the accesses that carry
    a request number (Mooncake blocks): a block is a prefix hit when it and every earlier block of its
    request hit; ``prefix_hit_ratio`` is 0 when the trace has no such accesses.
    """

    policy: str
    capacity: int
    capacity_unit: Unit
    requests: int
    hits: int
    bytes_requested: int
    bytes_hit: int
    hit_ratio: float
    byte_hit_ratio: float
    per_ns: dict[str, tuple[int, int]]
    windows: tuple[tuple[float, int, int], ...]
    prefix_requests: int
    prefix_hits: int
    prefix_hit_ratio: float


class WorkingSet(NamedTuple):
    """The distinct objects of a trace: how many, and their total size (each at its first size seen)."""

    objects: int
    bytes: int


def working_set(trace: Iterable[Access]) -> WorkingSet:
    """Count the distinct ``(ns, key)`` objects of ``trace`` and their total size, in one streaming pass.

    Memory is one set entry per distinct object. An object whose size changes counts at its first size, the
    size the simulator would have admitted.
    """
    seen: set[Hashable] = set()
    add = seen.add
    total = 0
    for _, key, size, ns, *_ in trace:
        k = (ns, key) if ns else key
        if k not in seen:
            add(k)
            total += size
    return WorkingSet(len(seen), total)


def replay(
    trace: Iterable[Access],
    policy: str | PolicyFactory,
    *,
    capacity_bytes: int | None = None,
    capacity_objects: int | None = None,
    fraction: float | None = None,
    fraction_of: Unit = "bytes",
    window_s: float | None = None,
    seed: int = 0,
    queue: QueueModel | None = None,
) -> ReplayResult:
    """Run ``policy`` over ``trace`` with cache-on-miss and return what it hit.

    ``policy`` is a registered name (built by ``make_eviction_policy``, which also hands the capacity to the
    classes that take one) or a factory called as ``factory(clock=..., rng=...)``. The policy's clock reads
    the ``t`` of the access being replayed; its rng is ``random.Random(seed)``, so the same trace, policy and
    seed give the same result.

    Give exactly one capacity: ``capacity_bytes``; ``capacity_objects`` (every object weighs 1, and the
    policy is told size 1, so size-aware policies see what the owner counts); or ``fraction`` of the trace's
    working set (``working_set``), in ``fraction_of`` units, rounded down and at least 1. ``fraction`` reads
    the trace twice, so it needs a re-iterable trace (a list, a reader that opens its file anew per
    ``iter``); with a one-shot iterator it raises ``TypeError`` before reading anything.

    An object is keyed by ``(ns, key)`` (by ``key`` alone when ``ns`` is ""). One heavier than the capacity is
    never admitted. A hit is a hit whatever size the access gives: the object keeps the size it was admitted
    with. Raises ``TypeError``/``ValueError`` for bad arguments and ``StoreConfigError`` for an unknown
    policy name (naming the known ones).

    ``queue``: requests wait for one FIFO server (``QueueModel``), and a ``LookaheadPolicy`` is told the
    waiting requests at each service start (``_queue.serve``; it needs a KV-block trace, every access with a
    request number, arrivals in time order, else ``ValueError`` while replaying). Other policies ignore it.
    The policy's clock still reads each access's trace ``t`` (its arrival), and so do the windows.
    """
    if queue is not None and not isinstance(queue, QueueModel):
        raise TypeError(f"queue must be a QueueModel or None, not {type(queue).__name__}")
    if window_s is not None and not (isinstance(window_s, int | float) and 0 < window_s < math.inf):
        raise ValueError(f"window_s must be a finite number of seconds > 0, got {window_s!r}")
    capacity, unit = _capacity(trace, capacity_bytes, capacity_objects, fraction, fraction_of)
    if isinstance(policy, str):
        name = policy
        factory: PolicyFactory = lambda *, clock, rng: make_eviction_policy(name, capacity=capacity, clock=clock,
                                                                            rng=rng)
    elif callable(policy):
        name, factory = "", policy
    else:
        raise TypeError(f"policy must be a policy name or a factory, not {type(policy).__name__}")
    now = 0.0

    def clock() -> float:
        return now

    instance = factory(clock=clock, rng=random.Random(seed))
    if not isinstance(instance, EvictionPolicy):
        raise TypeError(f"the policy factory returned {type(instance).__name__}, not an EvictionPolicy")
    if len(instance):
        raise ValueError("the policy factory returned a policy that already tracks keys; it must be new")

    def outcomes() -> Iterator[tuple[Access, bool]]:
        # Inlined and bound to locals: this loop runs once per access of traces millions long.
        nonlocal now
        cache: dict[Hashable, int] = {}
        used = 0
        by_objects = unit == "objects"
        on_hit, on_insert = instance.on_hit, instance.on_insert
        on_remove, victim = instance.on_remove, instance.victim
        pop = cache.pop
        # EntryInfo is immutable, and making a named tuple costs more than finding one: one per (size, ns)
        infos: dict[tuple[int, str], EntryInfo] = {}
        for a in trace:
            t, key, size, ns, _, _, _, _ = a
            now = t
            k = (ns, key) if ns else key
            if k in cache:
                on_hit(k)
                yield a, True
                continue
            m = 1 if by_objects else size
            if m <= capacity:
                used += m
                while used > capacity:
                    v = victim()
                    used -= pop(v)
                    on_remove(v)
                cache[k] = m
                info = infos.get((m, ns))
                if info is None:
                    info = infos[(m, ns)] = EntryInfo(m, ns)
                on_insert(k, info)
            yield a, False

    def outcomes_in_context() -> Iterator[tuple[Access, bool]]:
        # The same owner for policies that want each access's context and may bypass a miss (``admit``).
        nonlocal now
        cache: dict[Hashable, int] = {}
        used = 0
        by_objects = unit == "objects"
        on_access, admit = instance.on_access, instance.admit
        if queue is not None and isinstance(instance, LookaheadPolicy):
            contexts = _queued_context(trace, by_objects, queue, instance.on_queue)
        else:
            contexts = _in_context(trace, by_objects)
        for a, info in contexts:
            now = a.t
            k = (a.ns, a.key) if a.ns else a.key
            on_access(k, info)
            if k in cache:
                instance.on_hit(k)
                yield a, True
                continue
            m = info.size
            if m <= capacity and admit(k, info):
                used += m
                while used > capacity:
                    v = instance.victim()
                    used -= cache.pop(v)
                    instance.on_remove(v)
                cache[k] = m
                instance.on_insert(k, info)
            yield a, False

    return _tally(
        outcomes_in_context() if instance.uses_context else outcomes(),
        policy=name or instance.name or type(instance).__name__,
        capacity=capacity,
        unit=unit,
        window_s=window_s,
    )


def _in_context(trace: Iterable[Access], by_objects: bool) -> Iterator[tuple[Access, EntryInfo]]:
    """Each access with the ``EntryInfo`` of its context. A request's blocks (consecutive accesses with one
    ``req`` >= 0) are read together first, as a server has the whole prompt when the request arrives: that
    gives ``req_len``; ``parent`` is the key of the block before in the same request. Memory: one request."""
    batch: list[Access] = []
    for a in trace:
        if batch and a.req != batch[0].req:
            yield from _request_context(batch, by_objects)
            batch.clear()
        if a.req >= 0:
            batch.append(a)
        else:
            yield a, EntryInfo(1 if by_objects else a.size, a.ns, rule=a.rule)
    yield from _request_context(batch, by_objects)


def _queued_context(
    trace: Iterable[Access], by_objects: bool, queue: QueueModel,
    on_queue: Callable[[tuple[QueuedRequest, ...]], None],
) -> Iterator[tuple[Access, EntryInfo]]:
    """``_in_context`` for a KV-block trace served through ``queue``: before a request's first access,
    ``on_queue`` gets the requests waiting at its service start. The generator calls it only when the request
    before has been consumed, so the policy never hears of a later moment than the access it decides."""
    for service in serve(trace, queue):
        on_queue(service.waiting)
        yield from _request_context(service.request.accesses, by_objects)


def _request_context(batch: Sequence[Access], by_objects: bool) -> Iterator[tuple[Access, EntryInfo]]:
    """The accesses of one request (its blocks, in prefix order) with their ``EntryInfo``: ``req_len`` the
    request's blocks, ``parent`` the key of the block before, ``req_out`` the request's output length."""
    parent: Hashable | None = None
    for a in batch:
        k = (a.ns, a.key) if a.ns else a.key
        yield a, EntryInfo(1 if by_objects else a.size, a.ns, rule=a.rule, req=a.req, pos=a.pos,
                           req_len=len(batch), parent=parent, req_out=a.req_out)
        parent = k


def _capacity(
    trace: Iterable[Access],
    capacity_bytes: int | None,
    capacity_objects: int | None,
    fraction: float | None,
    fraction_of: Unit,
) -> tuple[int, Unit]:
    given = [
        name
        for name, value in (
            ("capacity_bytes", capacity_bytes),
            ("capacity_objects", capacity_objects),
            ("fraction", fraction),
        )
        if value is not None
    ]
    if len(given) != 1:
        raise ValueError(
            f"give exactly one of capacity_bytes, capacity_objects, fraction; got {given or 'none'}"
        )
    if capacity_bytes is not None:
        return check_capacity("capacity_bytes", capacity_bytes), "bytes"
    if capacity_objects is not None:
        return check_capacity("capacity_objects", capacity_objects), "objects"
    assert fraction is not None
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
    if fraction_of not in ("bytes", "objects"):
        raise ValueError(f"fraction_of must be 'bytes' or 'objects', got {fraction_of!r}")
    if iter(trace) is trace:
        raise TypeError(
            "fraction reads the trace twice: pass a re-iterable trace (a list, a reader), or size "
            "the cache yourself with working_set()"
        )
    ws = working_set(trace)
    return max(1, math.floor(fraction * (ws.bytes if fraction_of == "bytes" else ws.objects))), fraction_of


def check_capacity(label: str, value: object) -> int:
    """``value`` as a capacity: an int > 0. Raises ``TypeError`` for a non-int (bools included), else
    ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{label} must be an int, not {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{label} must be > 0, got {value}")
    return value


def _tally(
    outcomes: Outcomes, *, policy: str, capacity: int, unit: Unit, window_s: float | None
) -> ReplayResult:
    """Count ``outcomes`` into a ``ReplayResult`` (see its docstring for the measures).

    Prefix hits assume, as the Mooncake reader yields them, that the blocks of a request come together and in
    prefix order: a new request number starts a new chain. That keeps the state O(1) however long the trace.
    Trace time is assumed not to go backwards; an access earlier than its predecessor is counted in the
    current window.
    """
    requests = hits = bytes_requested = bytes_hit = 0
    ns_requests: dict[str, int] = {}
    ns_hits: dict[str, int] = {}
    prefix_requests = prefix_hits = 0
    chain_req, chain_intact = -1, False
    windows: list[tuple[float, int, int]] = []
    t0 = w_start = 0.0
    w_end = math.inf  # stays infinite without window_s: the window test then never fires
    w_requests = w_hits = 0
    step = window_s if window_s is not None else math.inf
    for a, hit in outcomes:
        t, _, size, ns, _, req, _, _ = a
        if t >= w_end:
            windows.append((w_start, w_requests, w_hits))
            w_requests = w_hits = 0
            # From the window index, not by repeated addition: no drift over millions of windows.
            index = (t - t0) // step
            w_start, w_end = t0 + index * step, t0 + (index + 1) * step
        elif not requests and window_s is not None:
            t0 = w_start = t
            w_end = t + step
        requests += 1
        w_requests += 1
        bytes_requested += size
        ns_requests[ns] = ns_requests.get(ns, 0) + 1
        if hit:
            hits += 1
            w_hits += 1
            bytes_hit += size
            ns_hits[ns] = ns_hits.get(ns, 0) + 1
        if req >= 0:
            prefix_requests += 1
            if req != chain_req:
                chain_req, chain_intact = req, True
            chain_intact = chain_intact and hit
            prefix_hits += chain_intact
    if window_s is not None and w_requests:
        windows.append((w_start, w_requests, w_hits))
    return ReplayResult(
        policy=policy,
        capacity=capacity,
        capacity_unit=unit,
        requests=requests,
        hits=hits,
        bytes_requested=bytes_requested,
        bytes_hit=bytes_hit,
        hit_ratio=hits / requests if requests else 0.0,
        byte_hit_ratio=bytes_hit / bytes_requested if bytes_requested else 0.0,
        per_ns={ns: (n, ns_hits.get(ns, 0)) for ns, n in ns_requests.items()},
        windows=tuple(windows),
        prefix_requests=prefix_requests,
        prefix_hits=prefix_hits,
        prefix_hit_ratio=prefix_hits / prefix_requests if prefix_requests else 0.0,
    )
