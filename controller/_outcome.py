"""What the cache decided for one call, handed to the caller: ``CallOutcome``, and the ``CallHandle`` it grows in.

A caller that needs to know what happened (a model replica building its response headers and ``cached_tokens``)
asks the cached function for its call (``fn.call(...)``) instead of listening to the event sink:

    called = answer.call(prompt="hi", max_tokens=8)         # a sync function: (value, outcome)
    called.outcome.outcome, called.outcome.tier               # "hit", "l2"

    stream = answer.call(prompt="hi")                         # a generator function: a stream with its handle
    first = next(stream)                                      # the lookup is done once the first piece is out
    stream.handle.decided.rule                                # what was decided, known from the lookup on
    ...                                                       # (after the last piece) stream.handle.outcome

A function can also be handed its own call (``cache_if(call_param="call")``): it reads the resolved decision
(``call.decided.decision``: the policy's rule with every section resolved, ``kv`` included) and reports what
its engine's KV cache did (``call.report_kv``), which then travels in the outcome and the call's ``kv`` event.

The handle fills in two steps: ``decided`` once the lookup is done (outcome ``hit``, ``miss`` or ``bypass``, the
rule, key and namespace, a hit's tier and size), ``outcome`` once the call or its stream has ended (a miss's
stored tiers and size, or why it was not stored, and the KV report). A call that raises, or a stream closed
before its end, stores nothing: its ``outcome`` says ``rejected="incomplete"`` (a miss's). The call's one
access event (``controller._events``) is recorded from its final outcome.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, NewType

from ._types import CacheKey, Namespace

if TYPE_CHECKING:
    from evocache.dsl import Decision

__all__ = ["CallHandle", "CallId", "CallOutcome", "CallStream", "Called", "KvReport"]

COALESCED = "coalesced"
"""The reason of a hit served from another call's miss of the same key, computed while this call waited
(single flight, ``controller._cache_if``)."""

CallId = NewType("CallId", str)
"""Unique per call: this process's random prefix and a counter (``"3fa9c2d1-1b"``)."""

_PROCESS = os.urandom(4).hex()
next_call_number = itertools.count(1).__next__
"""This process's next call number (atomic under the GIL); the L1 hit path records the number, and the event's
reader makes it the id (``call_id_of``), so the hot path formats nothing."""


def call_id_of(number: int) -> CallId:
    # The prefix makes ids unique across the replicas that write one event stream; the number, within it.
    return CallId(f"{_PROCESS}-{number:x}")


def new_call_id() -> CallId:
    return call_id_of(next_call_number())


@dataclass(frozen=True, slots=True)
class KvReport:
    """What an engine's KV prefix cache did for one call, as the engine reports it (``CallHandle.report_kv``):
    the prompt's tokens, those served from cached keys and values, the deepest tier they came from (None when
    none), the time spent loading blocks from lower tiers, why the first uncached block missed (``""`` when
    none did), and the engine's whole usage as plain data (what the ``kv`` access event carries)."""

    prompt_tokens: int
    cached_tokens: int
    tier: str | None
    load_ms: float
    miss: str
    detail: Mapping[str, Any]


class CallOutcome(NamedTuple):
    """What the cache did for one call.

    ``outcome`` is ``hit`` (served from ``tier``; ``reason`` ``semantic`` for a similar prompt's answer,
    ``coalesced`` for the answer another call computed for the same key while this one waited: ``tier`` the
    tier that stored it, None when none did),
    ``miss`` (the function ran) or ``bypass`` (not looked up: ``reason`` says why, as in the access events).
    ``decision`` is the policy's resolved ``dsl.Decision`` for the call (None without a policy, or when the
    contract or tenant could not be evaluated); ``rule`` and ``policy`` name what decided. ``key`` and ``ns``
    are the entry's (a bypass's ``key``: the one it would have if its rule or sampling let it be cached, None
    when no key can be made). ``size``: a hit's entry bytes, a miss's result bytes (stored or
    not), 0 for a bypass. ``latency_ms``: the lookup's time; ``saved_ms``: what a hit saved (the model time its
    entry cost), or what a miss's function took. ``stored``: the tiers that took a miss's result; ``rejected``:
    why a computed result was not stored (``incomplete``: the function raised, or its stream was closed before
    its end). ``semantic``: the semantic lookup's explanation. ``kv``: the engine's KV report, when it gave one.
    ``at``: when the call was decided (the runtime's clock), the time its access event carries.
    ``saved_tokens``, ``saved_cost``: what the call saved in an engine's tokens and in money: a hit, what its
    entry's answer cost when it was computed; a miss, what the engine's own cache saved it (both as the engine
    reported them, ``CallHandle.report_usage``; 0 when it did not). ``cost``: what the call's answer costs
    without any cache, in money (a hit, its entry's; a miss or bypass, the engine's report): what caching it
    is worth, which the policy loop weighs its proposals by.

    Immutable (a named tuple: every call on the cache's full path makes one, and a tuple is cheap to make).
    """

    call_id: CallId
    outcome: str
    rule: str
    policy: str
    reason: str
    key: CacheKey | None
    ns: Namespace
    decision: Decision | None = None
    arm: str = ""
    tier: str | None = None
    size: int = 0
    latency_ms: float = 0.0
    saved_ms: float = 0.0
    semantic: Mapping[str, Any] | None = None
    stored: tuple[str, ...] = ()
    rejected: str = ""
    kv: KvReport | None = None
    at: float = 0.0
    saved_tokens: int = 0
    saved_cost: float = 0.0
    cost: float = 0.0


class CallHandle:
    """One call's outcome as it becomes known (module docstring). Made by the cache, one per call."""

    __slots__ = ("call_id", "decided", "outcome", "_kv", "usage")

    def __init__(self) -> None:
        self.call_id = new_call_id()
        self.decided: CallOutcome | None = None
        self.outcome: CallOutcome | None = None
        self._kv: KvReport | None = None
        self.usage: tuple[int, float, int, float] = (0, 0.0, 0, 0.0)

    @property
    def kv(self) -> KvReport | None:
        return self._kv

    def report_kv(self, report: KvReport) -> None:
        """The engine's KV usage for this call, to be carried in its outcome (once; a second report replaces
        the first). ``TypeError`` for anything but a ``KvReport``."""
        if not isinstance(report, KvReport):
            raise TypeError(f"report_kv() takes a KvReport, got {type(report).__qualname__}")
        self._kv = report

    def report_usage(self, tokens: int, cost: float, saved_tokens: int = 0, saved_cost: float = 0.0) -> None:
        """What computing this call's answer took (``tokens`` an engine processed, ``cost`` in money), kept with
        its entry so that each hit says what it saved, and what the engine's own cache saved this call
        (``saved_tokens``, ``saved_cost``: its cached prompt tokens). ``ValueError`` for a negative or
        non-finite figure."""
        figures = (tokens, cost, saved_tokens, saved_cost)
        if any(not (isinstance(f, int | float) and 0 <= f < float("inf")) or isinstance(f, bool) for f in figures):
            raise ValueError(f"report_usage() takes non-negative finite figures, got {figures!r}")
        self.usage = (int(tokens), float(cost), int(saved_tokens), float(saved_cost))

    def decide(self, outcome: CallOutcome) -> None:
        self.decided = outcome

    def finish(self, **parts: Any) -> CallOutcome:
        """The final outcome: what was decided, with ``parts`` (stored, size, rejected, saved_ms) and the KV
        report."""
        decided = self.decided
        assert decided is not None  # every call is decided before it finishes
        if parts or self._kv is not None:
            decided = decided._replace(kv=self._kv, **parts)
        self.outcome = decided
        return decided


class Called(NamedTuple):
    """A sync or async function's ``call``: its value and its outcome."""

    value: Any
    outcome: CallOutcome


class CallStream:
    """A generator function's ``call``: iterate it as the stream itself; ``handle`` says what the cache did
    (``handle.decided`` once the first piece is out, ``handle.outcome`` after the last)."""

    __slots__ = ("handle", "_pieces")

    def __init__(self, handle: CallHandle, pieces: Iterator[Any]) -> None:
        self.handle = handle
        self._pieces = pieces

    def __iter__(self) -> CallStream:
        return self

    def __next__(self) -> Any:
        return next(self._pieces)

    def close(self) -> None:
        close = self._pieces.close  # a generator's; a stream closed early stores nothing
        close()


class AsyncCallStream:
    """An async generator function's ``call``: ``async for`` over it; ``handle`` as for ``CallStream``."""

    __slots__ = ("handle", "_pieces")

    def __init__(self, handle: CallHandle, pieces: Any) -> None:
        self.handle = handle
        self._pieces = pieces

    def __aiter__(self) -> AsyncCallStream:
        return self

    async def __anext__(self) -> Any:
        return await self._pieces.__anext__()

    async def aclose(self) -> None:
        await self._pieces.aclose()
