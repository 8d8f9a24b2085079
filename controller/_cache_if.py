"""``@cache_if``: the decorator that enforces a dsl contract on a function.

    @cache_if("512 <= len(input_ids) <= 2048 and top_k <= 10", ttl="10m", model="llama-3-8b")
    def generate(input_ids: list[int], top_k: int = 0, temperature: float = 0.0) -> str: ...

At decoration time the contract is compiled against the request view the function can provide (its own
parameters plus ``tenant``, ``model`` and ``model_revision``); naming anything else is a ``ContractError`` there
and then (fail closed at import). At call time:

1. The request view is built once; the contract must hold, then the policy in force (if any) picks the first
   matching rule, whose values decide ttl, tiers, size limit, sampling and streams. Without a policy the
   decorator's own options decide.
2. A call that may sample (a ``temperature`` not provably <= 0, and no ``seed``) is bypassed unless allowed.
3. The key binds function, model, revision, template, normalised generation params, tenant namespace and the
   canonical arguments (``controller._keys``).
4. Exact lookup through the tiers; on a miss the function runs and its result is admitted by the rule.
   Identical misses at the same time run it once (single flight, below).

The cache never fails a call: tier failures are misses (``TieredStore``), unserialisable results are rejected
and counted, a payload that does not decode is dropped and recomputed. Every decision emits an access event.
What a call will do is planned by its ``Contract`` (``controller._contract``); this module enforces the plan:
the L1 hit path, lookups through the tiers, admission, events and the per-call controls. One generator,
``CachedFunction._steps``, carries every call past the L1 hit path, whatever the kind of function; the sync,
async, generator and async-generator wrappers only run the steps it asks for.

Single flight: a miss whose key (the namespace with it: tenants never share) another call of the same function
on the same store is already computing in this process does not compute it again. The first call to miss (the
leader) computes and admits; the others (followers) wait for it and are served its result, decoded from the
payload it computed, as a hit: outcome ``hit``, reason ``coalesced``, the tier that stored it (None when the
rule did not store it), its size and what computing it took. A stream's followers wait for the leader's
stream to end, then replay its chunks like any hit (no follower serves a partial answer it might have to
take back). A leader that raises or is closed early (its caller gone) shares nothing: its followers look up
again, and the first of them to miss leads. A leader with nothing to share (a semantic hit, a result that
cannot be serialised) lets each follower compute for itself. Refreshes and bypasses never coalesce, nor does a
stream its rule keeps out of the cache; a call never waits for a leader it drives itself (one consumer
interleaving two streams of one key). Across processes (replicas) nothing is shared until the entry is
stored; the serving room's router sends identical prompts to one replica.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import inspect
import logging
import operator
import threading
import time
from bisect import bisect_left
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from ._contract import (
    DECODED_MAX_BYTES,
    SIMPLE_TYPES,
    Admission,
    Contract,
    Options,
    Plan,
    SemanticOptions,
    current_tenant,
    function_identity,
)
from ._events import INCOMPLETE, SCHEMA_VERSION
from ._keys import template_hash
from evocache.dsl import CLIENT_CONTROLS

from ._control import NO_STORE, REFRESH, CacheControl, current_control
from ._outcome import COALESCED, AsyncCallStream, Called, CallHandle, CallOutcome, CallStream, next_call_number
from ._metrics import LATENCY_BUCKETS
from ._runtime import CacheRuntime, StoreConfig, build_runtime, current_runtime
from ._semantic import JudgeLimits, Served
from ._serialize import SERIALIZERS, Serializer, Unserializable, dump_chunks, load_chunks
from ._slo import SLO_REASON
from ._types import L1, CacheKey, Entry, Namespace
from .errors import ContractError
from .tiers._memory import READ_BUFFER_DRAIN

log = logging.getLogger("evocache.controller")

_INVALIDATED_MAX = 65_536
_SERVED_MAX = 4096  # semantic hits remembered for feedback(), per function
_IMMUTABLE_TAGS = frozenset(b"sb")  # payload tags of str and bytes values (controller._serialize)


class _FullPath:
    """What the async wrappers' L1 probe returns when the call must take the full path: the plan it found (or
    None), the memo key it computed (so neither is computed twice) and the runtime it used. A private type, so
    no function's result is ever one."""

    __slots__ = ("plan", "memo_key", "rt")

    def __init__(self, plan: Plan | None, memo_key: tuple | None, rt: CacheRuntime | None = None) -> None:
        self.plan = plan
        self.memo_key = memo_key
        self.rt = rt


class _Store(NamedTuple):
    """A step of ``CachedFunction._steps``: run ``call()`` (a store or semantic-layer call) and send back its
    result. An async wrapper runs it in a thread when the store reaches beyond process memory, or when ``cpu``
    (it may embed a prompt)."""

    call: Callable[[], Any]
    cpu: bool = False


class _Compute:
    """The step of ``CachedFunction._steps`` that runs the function itself: ``_COMPUTE`` for a result the cache
    may store (a stream's chunks are kept), ``_RUN`` for a bypass (a stream's chunks are only played)."""

    __slots__ = ()


_COMPUTE = _Compute()
_RUN = _Compute()


class _Flight:
    """One key's miss under way in this process (module docstring, single flight): ``ended`` resolves to how
    its leader ended (``_Landed``, ``_RETRY`` or ``_ALONE``), once; it is made when the first follower joins
    (most misses have none, and a future costs more than the rest of the flight). ``owner`` drives the leader
    (its task or thread), so a follower it also drives does not wait for itself."""

    __slots__ = ("slot", "owner", "ended", "followers")

    def __init__(self, slot: tuple, owner: object) -> None:
        self.slot = slot
        self.owner = owner
        self.followers = 0
        self.ended: concurrent.futures.Future[Any] | None = None

    def follow(self) -> None:
        """One more follower (under the flights' lock)."""
        self.followers += 1
        if self.ended is None:
            ended: concurrent.futures.Future[Any] = concurrent.futures.Future()
            # Running, so it cannot be cancelled: an async follower that stops waiting cancels its own wrapper
            # of it (asyncio.wrap_future), never the flight the others wait on.
            ended.set_running_or_notify_cancel()
            self.ended = ended


class _Landed(NamedTuple):
    """What a leader computed, for its followers: the payload (each follower decodes its own copy, as a hit
    does), the tiers that stored it and what computing it took."""

    payload: bytes
    stored: tuple[str, ...]
    saved_ms: float


_RETRY = "retry"  # the leader raised or was closed early: look up again, and the first to miss leads
_ALONE = "alone"  # the leader has nothing to share: each follower computes for itself


class _Wait(NamedTuple):
    """The step of ``CachedFunction._steps`` that waits for a leader: send back what ``flight.ended`` holds
    (blocking for a sync wrapper, awaited by an async one)."""

    flight: _Flight


class _Lookup(NamedTuple):
    """``_lookup``'s answer: a hit's value, the epoch a miss is admitted against, the flight the call leads
    (a miss that coalesces) or follows (a miss another call is computing: not decided yet)."""

    hit: bool
    value: Any
    epoch: int
    lead: _Flight | None = None
    follow: _Flight | None = None


_Step = _Store | _Compute | _Wait


def _owner() -> object:
    """What drives the running code: its asyncio task, else its thread."""
    try:
        return asyncio.current_task()
    except RuntimeError:  # no event loop runs in this thread
        return threading.get_ident()


@dataclass(frozen=True, slots=True)
class CacheInfo:
    """A function's counters; ``waiting``: its calls waiting now for another call computing their key."""

    hits: int
    misses: int
    bypasses: int
    stores: int
    rejects: int
    waiting: int = 0


class _Counters:
    __slots__ = ("hits", "misses", "bypasses", "stores", "rejects")

    def __init__(self) -> None:
        self.hits = self.misses = self.bypasses = self.stores = self.rejects = 0


# --- the decorator -----------------------------------------------------------------------------------------


def cache_if(
    condition: str | Callable[[Mapping[str, Any]], bool] = "true",
    *,
    ttl: str | float = "5m",
    model: str = "",
    model_revision: str = "",
    prompt_template: str | None = None,
    name: str | None = None,
    ignore: Sequence[str] = (),
    store: CacheRuntime | StoreConfig | None = None,
    serializer: str | Serializer = "json",
    admission: Admission | Mapping[str, Any] | None = None,
    semantic: SemanticOptions | Mapping[str, Any] | None = None,
    call_param: str | None = None,
    **moved: Any,
) -> Callable[[Callable[..., Any]], Any]:
    """Cache a function's results while ``condition`` holds for the call.

    ``condition`` is a policy-language expression over the request view, or a Python callable taking the view
    (a dict of the call's arguments plus ``tenant``, ``model``, ``model_revision``) and returning a bool. A
    callable condition must be a pure function of the view: it is evaluated once per distinct call (see
    ``controller._contract``).

    What decides, when no policy is in force (with a policy, its rules decide): ``ttl``, a duration
    (``"10m"``) or seconds, and ``admission`` (``Admission``: sliding renewal, tiers, size limit, sampling,
    streams).

    What the key binds: ``model``/``model_revision``/``prompt_template``, and the function's identity (``name``,
    default its module, qualified name and code). ``ignore`` names parameters left out of the key and view
    (``self``, a logger).

    Where it is stored: ``store`` pins a runtime, or a ``StoreConfig`` to build one for this function alone
    (default: the process runtime, see ``configure``, which a replica sets); ``serializer`` (``"json"``, or
    ``"pickle"`` for trusted stores, or a ``Serializer``) turns results into payloads.

    Semantic matching (every kind of function; a stream's answer is its chunk list): after an exact miss, a similar earlier prompt's answer may
    be served while the estimated error stays within ``max_error`` (``controller._semantic``). ``semantic``
    (``SemanticOptions``, or a mapping of its fields: ``{"max_error": 0.02, "judge": same_answer}``) turns it
    on without a policy and says which parameter is the prompt and how answers are compared; with a policy, its
    rules' ``semantic:`` decide when. After a semantic miss the judge compares the new answer with the
    candidate neighbour's and then with one answer of each other answer cluster among the neighbours, to link
    the new entry to every cluster that shares its answer; ``judge_links`` bounds those other clusters, and
    ``judge_budget`` (2 by default) the judge calls per semantic lookup on average. The candidate's judging
    runs in the missed call, after the model; the search for other links runs on a background thread, each
    judge call reading a neighbour's answer from the tiers: bound it further when the judge is costly (a model
    call). Clusters then stay more fragmented and fewer prompts are served. A judge should be
    transitive; two clusters merge only if it also finds their answers equal.

    The call's outcome: ``fn.call(...)`` calls the function and hands back what the cache did
    (``CallOutcome``: decision, outcome, tier, sizes; ``controller._outcome``). ``call_param`` names a
    parameter of the function that the cache fills with the call's ``CallHandle`` when the function runs
    (decided by then: its resolved decision is there; an engine reports its KV usage into it). The parameter
    is not part of the call's signature for the cache: callers do not pass it, and it is in neither the key
    nor the view.

    Raises ``TypeError`` for an unknown option (an option that moved into ``admission`` or ``semantic`` says
    where), ``ContractError`` at decoration time for an invalid contract or option value (``StoreConfigError``
    for a store that cannot be built).
    """
    if moved:
        _refuse(moved)
    rule = Admission.of(admission)
    matching = SemanticOptions.of(semantic)

    ignored = frozenset(ignore)

    def decorate(fn: Callable[..., Any]) -> Any:
        identity = function_identity(fn, name)
        contract = Contract(
            fn,
            condition,
            Options.validated(ttl, rule, matching.spec),
            identity=identity,
            model=model,
            model_revision=model_revision,
            template=template_hash(prompt_template),
            ignore=ignored,
            supplied=call_param,
            semantic_text=matching.text,
            semantic_text_forms=matching.text_forms,
        )
        runtime = build_runtime(store) if isinstance(store, StoreConfig) else store
        limits = JudgeLimits(links=matching.judge_links, budget=matching.judge_budget)
        return CachedFunction(fn, contract, _serializer(serializer), runtime, judge=matching.judge or operator.eq,
                              judge_limits=limits, call_param=call_param).wrapper

    return decorate


# Options of cache_if that live in a group now: keyword -> where it is given.
_MOVED: Mapping[str, str] = {
    "sliding": "admission=Admission(sliding=...)",
    "tiers": "admission=Admission(tiers=...)",
    "max_entry_bytes": "admission=Admission(max_entry_bytes=...)",
    "allow_sampling": "admission=Admission(allow_sampling=...)",
    "stream": "admission=Admission(stream=...)",
    "semantic_text": "semantic=SemanticOptions(text=...)",
    "judge": "semantic=SemanticOptions(judge=...)",
    "judge_links": "semantic=SemanticOptions(judge_links=...)",
}
_OPTIONS = ("ttl", "model", "model_revision", "prompt_template", "name", "ignore", "store", "serializer",
            "admission", "semantic", "call_param")


def _refuse(moved: Mapping[str, Any]) -> None:
    """A keyword ``cache_if`` does not take: a ``TypeError`` naming the new place of an option that moved."""
    keyword = sorted(moved, key=lambda k: (k not in _MOVED, k))[0]
    if keyword in _MOVED:
        raise TypeError(f"cache_if({keyword}=...) is now cache_if({_MOVED[keyword]})")
    raise TypeError(f"cache_if() got an unexpected keyword argument {keyword!r}; its options: {list(_OPTIONS)}")


def _serializer(spec: str | Serializer) -> Serializer:
    if isinstance(spec, str):
        try:
            return SERIALIZERS[spec]
        except KeyError:
            raise ContractError(f"serializer: unknown {spec!r}; known: {sorted(SERIALIZERS)}") from None
    return spec


class CachedFunction:
    """Enforces one function's contract on its calls. ``wrapper`` is what the decorator returns."""

    def __init__(
        self,
        fn: Callable[..., Any],
        contract: Contract,
        serializer: Serializer,
        runtime: CacheRuntime | None,
        *,
        judge: Callable[[Any, Any], bool] = operator.eq,
        judge_limits: JudgeLimits = JudgeLimits(),
        call_param: str | None = None,
    ) -> None:
        self.fn = fn
        self.call_param = call_param
        self.judge = judge
        self.judge_limits = judge_limits
        self.contract = contract
        self.identity = contract.identity
        self.serializer = serializer
        self.runtime = runtime
        self.counters = _Counters()
        self._epoch = 0  # bumped by every invalidate/refresh (see _invalidate_slot)
        self._epoch_floor = 0
        self._invalidated: dict[tuple[Namespace, CacheKey], int] = {}
        self._epoch_lock = threading.Lock()
        # (ns, key) of a call -> ((semantic cache, neighbour id, decision) that served it last, the mark of
        # the tenant's SLO breaker of its rule then (SloBreakers.mark)): for feedback() and its verdict.
        self._served: collections.OrderedDict[tuple[Namespace, CacheKey], tuple[tuple[Any, str, Any], Any]]
        self._served = collections.OrderedDict()
        self._served_lock = threading.Lock()
        # (id of the store, namespace, key) -> the flight computing it (module docstring, single flight).
        self._flights: dict[tuple[int, Namespace, CacheKey], _Flight] = {}
        self._flights_lock = threading.Lock()
        if inspect.isasyncgenfunction(fn):
            self.kind, wrapper = "asyncgen", self._wrap_asyncgen()
        elif inspect.iscoroutinefunction(fn):
            self.kind, wrapper = "async", self._wrap_async()
        elif inspect.isgeneratorfunction(fn):
            self.kind, wrapper = "gen", self._wrap_gen()
        else:
            self.kind, wrapper = "sync", self._wrap_sync()
        self._streams = self.kind in ("gen", "asyncgen")
        # Streams are stored as their chunk list; everything else through the serializer.
        self._decode = load_chunks if self._streams else serializer.loads
        # Semantic matching serves a neighbour's whole answer; for a stream that is its stored chunk list,
        # replayed like an exact hit (the judge compares chunk lists).
        self._semantic_kinds = True
        functools.update_wrapper(wrapper, fn)
        wrapper.cache_info = self.cache_info  # type: ignore[attr-defined]
        wrapper.cache_key = self.cache_key  # type: ignore[attr-defined]
        wrapper.invalidate = self.invalidate  # type: ignore[attr-defined]
        wrapper.bypass = self.bypass  # type: ignore[attr-defined]
        wrapper.call = self.call  # type: ignore[attr-defined]
        wrapper.lookup = self.lookup  # type: ignore[attr-defined]
        wrapper.refresh = self.refresh  # type: ignore[attr-defined]
        wrapper.feedback = self.feedback  # type: ignore[attr-defined]
        wrapper.cached_function = self  # type: ignore[attr-defined]
        self.wrapper = wrapper

    # -- events ------------------------------------------------------------------------------------------

    def _observe(self, rt: CacheRuntime, plan: Plan, outcome: str, tier: str | None, seconds: float,
                 lookup: bool = True) -> None:
        """The decision's metrics, and its lookup time in the tenant's SLO breaker of the rule (unless it was
        no lookup's time: a follower's wait for its leader is the model's)."""
        # CacheMetrics.record, inlined (it runs on every L2/L3 hit and every miss).
        metrics = rt.metrics
        labels = (plan.rule, tier or "", outcome)
        cells = metrics.decisions.get(labels) or metrics.cells(labels)
        cells[0 if seconds <= LATENCY_BUCKETS[0] else bisect_left(LATENCY_BUCKETS, seconds)] += 1
        cells[-1] += seconds
        # The tenant's SLO breaker of the rule measures its lookups, but not the decisions made in safe mode
        # (a reason).
        slo = rt.slo
        if slo.by_rule and lookup and (outcome == "hit" or outcome == "miss") and not plan.reason:
            slo.observe(plan.rule, plan.ns, seconds)

    def _decided(self, rt: CacheRuntime, plan: Plan, handle: CallHandle, outcome: str, tier: str | None,
                 size: int, seconds: float, saved_ms: float = 0.0, reason: str = "",
                 semantic: dict | None = None, saved: tuple[int, float, float] = (0, 0.0, 0.0)) -> None:
        """The call is decided: its metrics, and its handle's ``decided`` (its event waits for its end)."""
        self._observe(rt, plan, outcome, tier, seconds, lookup=reason != COALESCED)
        handle.decided = self._outcome(rt, plan, handle, outcome, tier, size, seconds, saved_ms, reason, semantic,
                                       saved)

    @staticmethod
    def _outcome(rt: CacheRuntime, plan: Plan, handle: CallHandle, outcome: str, tier: str | None, size: int,
                 seconds: float, saved_ms: float = 0.0, reason: str = "",
                 semantic: dict | None = None, saved: tuple[int, float, float] = (0, 0.0, 0.0)) -> CallOutcome:
        key = plan.key if plan.key is not None else plan.would_key
        # Positional, in CallOutcome's field order (a keyword costs a named tuple a slower path).
        return CallOutcome(handle.call_id, outcome, plan.rule, rt.policy_ref, reason or plan.reason, key,
                           plan.ns, plan.decision, rt.arm, tier, size, seconds * 1000.0, saved_ms, semantic, (),
                           "", None, rt.clock(), *saved)

    def _record(self, rt: CacheRuntime, outcome: CallOutcome) -> None:
        """The call's one access event, from its final outcome: a plain tuple in ``AccessEvent`` field order
        (``controller._events``)."""
        (call_id, what, rule, policy, reason, key, ns, _, arm, tier, size, latency_ms, saved_ms, semantic, stored,
         rejected, kv, at, saved_tokens, saved_cost, cost) = outcome
        rt.events.record((
            at, key or "", ns, rule, policy, what, tier, size, latency_ms, saved_ms, self.identity, reason, semantic,
            call_id, arm, saved_tokens, saved_cost, cost, None if kv is None else dict(kv.detail), ",".join(stored),
            rejected, SCHEMA_VERSION,
        ))

    # -- the L1 hit path ---------------------------------------------------------------------------------

    def _make_entry(
        self, full_path: Callable[[CacheRuntime, tuple, dict, Plan | None, tuple | None], Any]
    ) -> Callable[..., Any]:
        """A function taking the call's arguments that serves L1 hits itself (memoised plan, lock-free L1 read
        through ``MemoryTier.peek``, no store round trip) and hands every other call to
        ``full_path(rt, args, kwargs, plan, memo_key)`` with the plan (or None) and memo key (None: not
        memoisable) already looked up.

        The sync wrapper is this function itself (one call level less on the path that matters most); async
        wrappers use it with a ``full_path`` that returns a ``_FullPath``, then await the full path. It runs on
        every call, so everything it reads is bound here once (a closure variable is cheaper than an
        attribute). Streams take the full path.
        """
        runtime = self.runtime
        memo_get = self.contract.memo.get
        loads = self.serializer.loads
        counters = self.counters
        identity = self.identity
        tenant_get = current_tenant.get
        control_get = current_control.get
        issimple = SIMPLE_TYPES.issuperset
        buckets = LATENCY_BUCKETS
        first_bucket = buckets[0]
        read_buffer_drain = READ_BUFFER_DRAIN
        next_call = next_call_number

        def entry_point(*args: Any, **kwargs: Any) -> Any:
            rt = runtime or current_runtime()
            # Inlined controller._contract.memo_key (a call costs as much as the rest of this line).
            types_ = tuple(map(type, args))
            if kwargs:
                kw = tuple(kwargs.items())
                types_ += tuple(map(type, kwargs.values()))
            else:
                kw = ()
            if not issimple(types_):
                return full_path(rt, args, kwargs, None, None)
            generation, entries_get, append, reads, note_reads, clock, record, policy_ref, arm, bypassing = rt.hot
            memo_key = (args, kw, types_, tenant_get(), generation)
            plan = memo_get(memo_key)
            # l1_first: this runtime has an L1. A tenant's rule its SLO breaker tripped to bypass (or the
            # rule, tripped rule-wide) takes the full path, where the breaker decides; the set is empty while
            # every breaker holds.
            if plan is None or not plan.l1_first or (
                bypassing and (plan.rule in bypassing or plan.tenant_rule in bypassing)
            ) or control_get() is not None:  # a caller's directives are the full path's to apply
                return full_path(rt, args, kwargs, plan, memo_key)
            now = clock()
            slot = plan.slot
            # MemoryTier.peek(slot, now), inlined: the same steps, in the same order (see MemoryTier.hot_read).
            entry = entries_get(slot)
            if entry is None or entry.sliding_ttl is not None or (
                entry.expires_at is not None and now >= entry.expires_at
            ):
                return full_path(rt, args, kwargs, plan, memo_key)
            append(slot)
            if len(reads) >= read_buffer_drain:
                note_reads()
            decoded_entry, value = plan.decoded
            if decoded_entry is not entry:
                payload = entry.value
                try:
                    value = loads(payload)
                except ValueError:  # the full path drops and counts it
                    return full_path(rt, args, kwargs, plan, memo_key)
                if payload and payload[0] in _IMMUTABLE_TAGS and len(payload) <= DECODED_MAX_BYTES:
                    object.__setattr__(plan, "decoded", (entry, value))  # see Plan.decoded
            counters.hits += 1
            seconds = clock() - now
            cells = plan.hit_cells  # inlined CacheMetrics.record
            # An L1 hit nearly always lands in the first bucket: skip the bisect then (same index).
            cells[0 if seconds <= first_bucket else bisect_left(buckets, seconds)] += 1
            cells[-1] += seconds
            tally = plan.slo_hits
            if tally is not None:  # the tenant's breaker of the rule counts it as a fast lookup
                tally[0] += 1
            # The call's one event; its id a number the sink formats (controller._outcome.call_id_of).
            record((
                now, plan.key, plan.ns, plan.rule, policy_ref, "hit", L1, len(entry.value), seconds * 1000.0,
                entry.saved_ms, identity, "", None, next_call(), arm, entry.saved_tokens, entry.saved_cost,
                entry.saved_cost,
            ))
            return value

        return entry_point

    # -- lookup and admission (shared by every function kind) ---------------------------------------------

    def _lookup(self, rt: CacheRuntime, plan: Plan, started: float, handle: CallHandle,
                owner: object = None, max_age: float | None = None) -> _Lookup:
        """A hit's value, or a miss with its ``epoch``, what ``_admit`` checks its result against (see
        ``_invalidate_slot``). A payload that does not decode is deleted and counted, and the call is a miss.
        With an ``owner`` (the call coalesces), a miss joins its key's flight: as its leader (decided a miss
        here), or as a follower (left undecided: ``_steps`` waits)."""
        epoch = self._epoch
        found = rt.store.get(plan.ns, plan.key, plan.tiers)
        entry = found.entry
        if entry is not None and max_age is not None and rt.clock() - entry.created_at > max_age:
            entry = None  # older than the caller accepts: a miss for this call, kept for the others
        if entry is not None:
            try:
                value = self._decode(entry.value)
            except ValueError as exc:  # UnicodeDecodeError is one; serializers raise nothing else
                log.warning("%s: undecodable payload in %s dropped: %s", self.identity, found.tier, exc)
                rt.metrics.tier_fault(found.tier or "", "undecodable")
                rt.store.delete(plan.ns, [plan.key])
            else:
                self.counters.hits += 1
                self._decided(rt, plan, handle, "hit", found.tier, len(entry.value), time.perf_counter() - started,
                              entry.saved_ms, saved=(entry.saved_tokens, entry.saved_cost, entry.saved_cost))
                return _Lookup(True, value, epoch)
        lead = None
        if owner is not None:
            flight, leading = self._join(rt, plan, owner)
            if flight is not None and not leading:
                return _Lookup(False, None, epoch, follow=flight)
            lead = flight
        if plan.semantic is not None and self._semantic_kinds and rt.semantic is not None:
            return _Lookup(False, None, epoch, lead)  # _semantic_lookup decides, and records the call's event
        self.counters.misses += 1
        self._decided(rt, plan, handle, "miss", None, 0, time.perf_counter() - started)
        return _Lookup(False, None, epoch, lead)

    def _join(self, rt: CacheRuntime, plan: Plan, owner: object) -> tuple[_Flight | None, bool]:
        """The flight computing this call's key and whether ``owner`` leads it: ``(new flight, True)``, or
        ``(flight under way, False)`` to follow, or ``(None, False)`` when ``owner`` drives that flight's
        leader itself (waiting would wait for itself: the call computes alone)."""
        assert plan.key is not None  # only a call with a key looks up
        slot = (id(rt.store), plan.ns, plan.key)
        with self._flights_lock:
            flight = self._flights.get(slot)
            if flight is None:
                flight = self._flights[slot] = _Flight(slot, owner)
                return flight, True
            if flight.owner == owner:  # a thread's id is an int: compared by value
                return None, False
            flight.follow()
            return flight, False

    def _land(self, flight: _Flight, ended: _Landed | str) -> None:
        """The leader has ended: later calls no longer find its flight, and its followers get ``ended`` (only
        the first landing counts)."""
        with self._flights_lock:
            if self._flights.get(flight.slot) is flight:
                del self._flights[flight.slot]
            if flight.ended is None or flight.ended.done():  # no follower, or landed already
                return
            flight.ended.set_result(ended)

    def _coalesced(self, rt: CacheRuntime, plan: Plan, started: float, handle: CallHandle, landed: _Landed) -> Any:
        """A follower served its leader's result: a hit, reason ``coalesced``, from the tier that stored it."""
        value = self._decode(landed.payload)
        self.counters.hits += 1
        self._decided(rt, plan, handle, "hit", landed.stored[0] if landed.stored else None, len(landed.payload),
                      time.perf_counter() - started, landed.saved_ms, COALESCED)
        return value

    def _semantic_lookup(
        self, rt: CacheRuntime, plan: Plan, started: float, handle: CallHandle
    ) -> tuple[bool, Any, Any]:
        """After an exact miss: ``(hit, value, learning)`` from the semantic layer (``SemanticLayer.lookup``),
        with the call's one event; ``learning`` is what ``_semantic_learn`` needs after a miss."""
        outcome = rt.semantic.lookup(
            self.identity, plan.ns, plan.semantic, judge=self.judge, limits=self.judge_limits,
            store=rt.store, decode=self._decode, read=functools.partial(self._read_neighbour, rt, plan),
        )
        served = outcome.served
        if served is not None:
            with self._served_lock:
                self._served[plan.slot] = (outcome.verdict, rt.slo.mark(plan.rule, plan.ns))
                self._served.move_to_end(plan.slot)
                if len(self._served) > _SERVED_MAX:
                    self._served.popitem(last=False)
            self.counters.hits += 1
            self._decided(rt, plan, handle, "hit", served.tier, served.size, time.perf_counter() - started,
                          served.saved_ms, outcome.reason, outcome.explanation, served.saved)
            return True, served.value, None
        self.counters.misses += 1
        self._decided(rt, plan, handle, "miss", None, 0, time.perf_counter() - started, reason=outcome.reason,
                      semantic=outcome.explanation)
        return False, None, outcome.learning

    def _read_neighbour(self, rt: CacheRuntime, plan: Plan, key: CacheKey,
                        max_age: float | None = None) -> Served | None:
        """An entry in the plan's tiers (a semantic neighbour's, or the call's own for ``lookup``), read and
        decoded like an exact hit; None if gone or older than ``max_age`` (an undecodable one is dropped and
        counted)."""
        found = rt.store.get(plan.ns, key, plan.tiers)
        entry = found.entry
        if entry is None or (max_age is not None and rt.clock() - entry.created_at > max_age):
            return None
        try:
            value = self._decode(entry.value)
        except ValueError as exc:
            log.warning("%s: undecodable payload in %s dropped: %s", self.identity, found.tier, exc)
            rt.metrics.tier_fault(found.tier or "", "undecodable")
            rt.store.delete(plan.ns, [key])
            return None
        return Served(value, found.tier, len(entry.value), entry.saved_ms,
                      (entry.saved_tokens, entry.saved_cost, entry.saved_cost))

    def _semantic_learn(self, rt: CacheRuntime, plan: Plan, value: Any, stored: bool, learning: Any) -> None:
        """After the model answered a semantic miss (``SemanticLayer.learn``); never raises. An exploration's
        verdict counts in the tenant's SLO breaker of the rule."""
        wrong = rt.semantic.learn(
            self.identity, plan.ns, plan.key, plan.semantic, plan.ttl, value, stored, learning
        )
        if wrong is not None:
            rt.slo.verdict(plan.rule, plan.ns, wrong)

    def _admit(
        self, rt: CacheRuntime, plan: Plan, payload: bytes | None, saved_ms: float, reason: str, epoch: int,
        handle: CallHandle, ttl: float | None = None,
    ) -> tuple[str, ...]:
        """Store the computed payload if the plan allows it (and no invalidate overtook it), for ``ttl`` (a
        caller's, shorter than the plan's) or the plan's; returns the tiers that took it (none: not stored),
        and finishes the call's outcome with them."""
        started = time.perf_counter()
        if payload is not None and (epoch < self._epoch_floor or self._invalidated.get(plan.slot, 0) > epoch):
            payload, reason = None, "invalidated"  # computed before an invalidate/refresh: stale on arrival
        tokens, cost, saved_tokens, saved_cost = handle.usage  # the engine's report, if it made one
        if payload is None or (plan.max_entry_bytes is not None and len(payload) > plan.max_entry_bytes):
            self.counters.rejects += 1
            size = 0 if payload is None else len(payload)
            self._observe(rt, plan, "reject", None, time.perf_counter() - started)
            handle.finish(size=size, saved_ms=saved_ms, rejected=reason or "too-large", saved_tokens=saved_tokens,
                          saved_cost=saved_cost, cost=cost)
            return ()
        now = rt.clock()
        entry = Entry(
            value=payload,
            expires_at=now + (plan.ttl if ttl is None else ttl),
            created_at=now,
            rule=plan.rule,
            saved_ms=saved_ms,
            sliding_ttl=(plan.ttl if ttl is None else ttl) if plan.sliding else None,
            saved_tokens=tokens,
            saved_cost=cost,
        )
        stored_in = rt.store.set(plan.ns, plan.key, entry, plan.tiers)  # the tiers that took it
        if not stored_in:  # every selected tier failed the write (the store counted each failure)
            self.counters.rejects += 1
            self._observe(rt, plan, "reject", None, time.perf_counter() - started)
            handle.finish(size=len(payload), saved_ms=saved_ms, rejected="not-stored", saved_tokens=saved_tokens,
                          saved_cost=saved_cost, cost=cost)
            return ()
        self.counters.stores += 1
        for tier in stored_in:
            rt.metrics.stored(plan.rule, tier, len(payload))
        self._observe(rt, plan, "store", ",".join(stored_in), time.perf_counter() - started)
        stored = tuple(stored_in)
        handle.finish(size=len(payload), saved_ms=saved_ms, stored=stored, saved_tokens=saved_tokens,
                      saved_cost=saved_cost, cost=cost)
        return stored

    def _invalidate_slot(self, slot: tuple[Namespace, CacheKey]) -> int:
        """Mark ``slot`` invalidated now; returns the new epoch. A miss whose lookup began before this (its
        epoch is lower) finishes but is not stored, so an invalidate or refresh is never undone by a slower
        call that read the old state. Within this process; other replicas' in-flight misses are not seen."""
        with self._epoch_lock:
            self._epoch += 1
            if len(self._invalidated) >= _INVALIDATED_MAX:
                # Forgetting the marks would let an old miss through, so refuse every miss begun before now.
                self._invalidated.clear()
                self._epoch_floor = self._epoch
            self._invalidated[slot] = self._epoch
            return self._epoch

    def _encode(self, value: Any) -> tuple[bytes | None, str]:
        try:
            return self.serializer.dumps(value), ""
        except Unserializable as exc:
            log.debug("%s: result not cached: %s", self.identity, exc)
            return None, "unserializable"

    def _bypass(self, rt: CacheRuntime, plan: Plan, started: float, handle: CallHandle, reason: str = "") -> None:
        self.counters.bypasses += 1
        self._decided(rt, plan, handle, "bypass", None, 0, time.perf_counter() - started, reason=reason)

    def _start(self, args: tuple, kwargs: dict) -> tuple[CacheRuntime, Plan, float]:
        started = time.perf_counter()
        rt = self.runtime or current_runtime()
        return rt, self.contract.plan(rt, args, kwargs), started

    def _offload(self, rt: CacheRuntime) -> bool:
        """Whether an async caller should run store calls in a thread (anything beyond process memory)."""
        return any(name != L1 for name in rt.store.tiers)

    # -- one call, for every kind of function ------------------------------------------------------------

    def _steps(
        self, rt: CacheRuntime, plan: Plan, started: float, handle: CallHandle, refresh_epoch: int | None = None
    ) -> Generator[_Step, Any, tuple[bool, Any]]:
        """The cache's side of one call: a generator of the steps its wrapper carries out.

        It yields ``_Store`` steps (run ``step.call()``, send back its result), ``_COMPUTE`` (run the function,
        send back what it returned; a stream's wrapper plays the stream to the caller and sends back the chunks
        it yielded) and ``_RUN`` (the same, uncached: a bypass, whose result is only sized).
        It returns ``(hit, value)``: a hit's value (a stream's wrapper replays it), or what the function
        computed (a stream's: already played). ``handle`` is the call's (``CallHandle``): decided once the
        lookup is done, finished when the function has run and its result was admitted or not.
        ``refresh_epoch``: a refresh's epoch (``_invalidate_slot``): no lookup.

        Every kind of function (sync, async, generator, async generator) is driven through this one generator,
        so bypasses, lookups, admission, events, counters and outcomes are the same for all; its wrapper plans
        the call and decides only how a step runs: called, awaited, iterated, or in a thread.
        """
        lead: _Flight | None = None
        try:
            if plan.key is None:
                self._bypass(rt, plan, started, handle)
                value = yield _RUN
                self._finish_bypass(rt, plan, handle, value)
                return False, value
            tripped = rt.slo.tripped
            if tripped and plan.rule in tripped:  # after the memo: a plan outlives the breaker's state
                safe = rt.slo.admit(plan)
                if safe is None:
                    self._bypass(rt, plan, started, handle, SLO_REASON)
                    value = yield _RUN
                    self._finish_bypass(rt, plan, handle, value)
                    return False, value
                plan = safe
            learning = None
            control = _control_for(plan)
            ttl = None if control is None or control.ttl_s is None else min(plan.ttl, control.ttl_s)
            if control is not None and control.no_cache and refresh_epoch is None:
                refresh_epoch = self._invalidate_slot(plan.slot)
                self.counters.misses += 1
                self._decided(rt, plan, handle, "miss", None, 0, time.perf_counter() - started, reason=REFRESH)
                epoch = refresh_epoch
            elif refresh_epoch is not None:
                epoch = refresh_epoch
                handle.decide(self._outcome(rt, plan, handle, "miss", None, 0, time.perf_counter() - started))
            else:
                # A stream its rule keeps out of the cache has nothing to share: it does not coalesce.
                if self.kind == "sync":
                    owner: object = threading.get_ident()  # no task can be inside a sync call but its own
                else:
                    owner = _owner() if not self._streams or plan.stream_ok else None
                max_age = control.max_age_s if control is not None else None
                while True:
                    found = yield _Store(functools.partial(self._lookup, rt, plan, started, handle, owner, max_age))
                    if found.follow is None:
                        break
                    landed = yield _Wait(found.follow)
                    if type(landed) is _Landed:
                        value = self._coalesced(rt, plan, started, handle, landed)
                        self._finish(rt, handle)
                        return True, value
                    if landed is _ALONE:
                        owner = None  # look up once more, then compute without a flight
                hit, value, epoch, lead = found.hit, found.value, found.epoch, found.lead
                if hit:
                    self._finish(rt, handle)
                    return True, value
                if plan.semantic is not None and self._semantic_kinds and rt.semantic is not None:
                    # Embedding a prompt is CPU work: an async wrapper runs it in a thread.
                    hit, value, learning = yield _Store(
                        functools.partial(self._semantic_lookup, rt, plan, started, handle), cpu=True
                    )
                    if hit:
                        if lead is not None:
                            self._land(lead, _ALONE)
                        self._finish(rt, handle)
                        return True, value
            t0 = time.perf_counter()
            value = yield _COMPUTE
            saved_ms = (time.perf_counter() - t0) * 1000.0
            payload, reason = self._payload(plan, value)
            if control is not None and control.no_store and payload is not None:
                payload, reason = None, NO_STORE
            stored = yield _Store(functools.partial(self._admit, rt, plan, payload, saved_ms, reason, epoch, handle,
                                                    ttl))
            if lead is not None:  # stored (or not) by now: later calls find the entry, followers get the payload
                self._land(lead, _ALONE if payload is None else _Landed(payload, stored, saved_ms))
            if learning is not None:  # the semantic update may embed
                yield _Store(functools.partial(self._semantic_learn, rt, plan, value, bool(stored), learning),
                             cpu=True)
            self._finish(rt, handle)
            return False, value
        finally:
            # Closed before its end (the function raised, or its stream was closed): the call's one event
            # still goes out, with nothing stored, and its followers look up again.
            if lead is not None:
                self._land(lead, _RETRY)
            if handle.outcome is None and handle.decided is not None:
                self._abandon(rt, handle)

    def _finish(self, rt: CacheRuntime, handle: CallHandle) -> None:
        """The call has ended: its outcome is final (with the engine's KV report, if it gave one) and its one
        access event is recorded."""
        self._record(rt, handle.outcome if handle.outcome is not None else handle.finish())

    def _finish_bypass(self, rt: CacheRuntime, plan: Plan, handle: CallHandle, value: Any) -> None:
        """A bypass has ended: a call with a key (one its rule or sampling, or its SLO breaker, kept out of the
        cache) has its result's size in its outcome, what it would weigh if cached."""
        assert handle.decided is not None
        size = 0
        if handle.decided.key is not None:
            payload, _ = self._payload(plan, value)
            size = len(payload) if payload is not None else 0
        _, cost, saved_tokens, saved_cost = handle.usage  # the engine's report, if it made one
        self._record(rt, handle.finish(size=size, saved_tokens=saved_tokens, saved_cost=saved_cost, cost=cost))

    def _abandon(self, rt: CacheRuntime, handle: CallHandle) -> None:
        """The call ended before its result was admitted: a miss's outcome says ``incomplete``, and its event
        is recorded."""
        assert handle.decided is not None
        rejected = INCOMPLETE if handle.decided.outcome == "miss" else ""
        self._record(rt, handle.finish(rejected=rejected))

    def _payload(self, plan: Plan, value: Any) -> tuple[bytes | None, str]:
        """What a computed result is stored as, or ``(None, reason)`` when it cannot be: a stream's chunk list
        (when its plan allows streams), anything else through the serializer."""
        if not self._streams:
            return self._encode(value)
        if not plan.stream_ok:
            return None, "stream-not-allowed"
        try:
            return dump_chunks(value), ""
        except Unserializable:
            return None, "unserializable"

    def _fn_kwargs(self, kwargs: dict, handle: CallHandle) -> dict:
        """The function's keyword arguments: the caller's, and its own call's handle where it asks for it."""
        if self.call_param is None:
            return kwargs
        return {**kwargs, self.call_param: handle}

    # -- wrappers: each drives _steps ---------------------------------------------------------------------

    def _wrap_sync(self) -> Callable[..., Any]:
        return self._make_entry(self._sync_full_path)

    def _sync_full_path(
        self, rt: CacheRuntime, args: tuple, kwargs: dict, plan: Plan | None, memo_key: tuple | None
    ) -> Any:
        started = time.perf_counter()
        plan = plan or self.contract.plan(rt, args, kwargs, memo_key)
        handle = CallHandle()
        return self._call(self._steps(rt, plan, started, handle), handle, args, kwargs)

    def _sync_called(
        self, rt: CacheRuntime, args: tuple, kwargs: dict, plan: Plan | None, memo_key: tuple | None
    ) -> Called:
        started = time.perf_counter()
        plan = plan or self.contract.plan(rt, args, kwargs, memo_key)
        handle = CallHandle()
        value = self._call(self._steps(rt, plan, started, handle), handle, args, kwargs)
        assert handle.outcome is not None  # _steps finishes every call it returns from
        return Called(value, handle.outcome)

    def _call(
        self, steps: Generator[_Step, Any, tuple[bool, Any]], handle: CallHandle, args: tuple, kwargs: dict
    ) -> Any:
        fn_kwargs = self._fn_kwargs(kwargs, handle)
        reply = None
        try:
            while True:
                try:
                    step = steps.send(reply)
                except StopIteration as done:
                    value = done.value[1]
                    break
                kind = type(step)
                if kind is _Store:
                    reply = step.call()
                elif kind is _Wait:
                    reply = step.flight.ended.result()
                else:
                    reply = self.fn(*args, **fn_kwargs)
        finally:
            steps.close()  # after a failure: the call's event, as incomplete
        return value

    def _wrap_async(self) -> Callable[..., Any]:
        # Serves L1 hits; for anything else returns a _FullPath to await here.
        probe = self._make_entry(lambda rt, args, kwargs, plan, memo_key: _FullPath(plan, memo_key, rt))

        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            found = probe(*args, **kwargs)
            if type(found) is not _FullPath:
                return found
            return (await self._async_called(found.rt, args, kwargs, found.plan, found.memo_key)).value

        return wrapper

    async def _async_called(
        self, rt: CacheRuntime, args: tuple, kwargs: dict, plan: Plan | None, memo_key: tuple | None
    ) -> Called:
        started = time.perf_counter()
        plan = plan or self.contract.plan(rt, args, kwargs, memo_key)
        handle = CallHandle()
        return await self._await(rt, self._steps(rt, plan, started, handle), handle, args, kwargs)

    async def _await(
        self, rt: CacheRuntime, steps: Generator[_Step, Any, tuple[bool, Any]], handle: CallHandle, args: tuple,
        kwargs: dict,
    ) -> Called:
        offload = self._offload(rt)
        fn_kwargs = self._fn_kwargs(kwargs, handle)
        reply = None
        try:
            while True:
                try:
                    step = steps.send(reply)
                except StopIteration as done:
                    value = done.value[1]
                    break
                if type(step) is _Compute:  # _COMPUTE or _RUN: the same for a coroutine
                    reply = await self.fn(*args, **fn_kwargs)
                elif type(step) is _Wait:
                    reply = await asyncio.wrap_future(step.flight.ended)
                elif offload or step.cpu:
                    reply = await asyncio.to_thread(step.call)
                else:
                    reply = step.call()
        finally:
            steps.close()  # after a failure or a cancellation: the call's event, as incomplete
        assert handle.outcome is not None  # _steps finishes every call it returns from
        return Called(value, handle.outcome)

    def _wrap_gen(self) -> Callable[..., Any]:
        # A plain function returning the stream, not a generator function: the runtime, the tenant scope and
        # the plan are taken when the call is made, as for every other kind. A generator's body would read
        # them at the first next(), maybe outside the caller's tenant_scope, and cache under another tenant.
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return self._gen_called(args, kwargs)._pieces

        return wrapper

    def _gen_called(self, args: tuple, kwargs: dict) -> CallStream:
        rt, plan, started = self._start(args, kwargs)
        handle = CallHandle()
        return CallStream(handle, self._iterate(self._steps(rt, plan, started, handle), handle, args, kwargs))

    def _iterate(
        self, steps: Generator[_Step, Any, tuple[bool, Any]], handle: CallHandle, args: tuple, kwargs: dict
    ) -> Iterator[Any]:
        fn_kwargs = self._fn_kwargs(kwargs, handle)
        reply = None
        try:
            while True:
                try:
                    step = steps.send(reply)
                except StopIteration as done:
                    hit, value = done.value
                    break
                if type(step) is _Compute:  # _COMPUTE or _RUN: played, and its chunks sent back
                    # A stream that raises or is closed early ends here: partial streams are never stored.
                    reply = []
                    stream = self.fn(*args, **fn_kwargs)
                    try:
                        for chunk in stream:
                            reply.append(chunk)
                            yield chunk
                    finally:
                        stream.close()  # closed early: the function stops now, not when collected
                elif type(step) is _Wait:
                    reply = step.flight.ended.result()
                else:
                    reply = step.call()
        finally:
            steps.close()  # a stream closed early, or failed: the call's event, as incomplete
        if hit:
            yield from value

    def _wrap_asyncgen(self) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:  # see _wrap_gen
            return self._asyncgen_called(args, kwargs)._pieces

        return wrapper

    def _asyncgen_called(self, args: tuple, kwargs: dict) -> AsyncCallStream:
        rt, plan, started = self._start(args, kwargs)
        handle = CallHandle()
        steps = self._steps(rt, plan, started, handle)
        return AsyncCallStream(handle, self._aiterate(rt, steps, handle, args, kwargs))

    async def _aiterate(
        self, rt: CacheRuntime, steps: Generator[_Step, Any, tuple[bool, Any]], handle: CallHandle, args: tuple,
        kwargs: dict,
    ) -> AsyncIterator[Any]:
        offload = self._offload(rt)
        fn_kwargs = self._fn_kwargs(kwargs, handle)
        reply = None
        try:
            while True:
                try:
                    step = steps.send(reply)
                except StopIteration as done:
                    hit, value = done.value
                    break
                if type(step) is _Compute:  # _COMPUTE or _RUN: played, and its chunks sent back
                    reply = []
                    stream = self.fn(*args, **fn_kwargs)
                    try:
                        async for chunk in stream:
                            reply.append(chunk)
                            yield chunk
                    finally:
                        await stream.aclose()  # closed early: the function stops now, not when collected
                elif type(step) is _Wait:
                    reply = await asyncio.wrap_future(step.flight.ended)
                elif offload or step.cpu:
                    reply = await asyncio.to_thread(step.call)
                else:
                    reply = step.call()
        finally:
            steps.close()  # a stream closed early, or failed: the call's event, as incomplete
        if hit:
            for chunk in value:
                yield chunk

    def call(self, *args: Any, **kwargs: Any) -> Any:
        """Call the function and hand back what the cache did (``controller._outcome``): a sync function's
        ``Called(value, outcome)``; an async function's awaitable of one; a generator function's
        ``CallStream`` (an async generator's ``AsyncCallStream``), whose ``handle`` is decided once the first
        piece is out and has its outcome after the last. Takes the full path (no L1 fast path), with the
        same decisions, events and counters as a plain call."""
        if self.kind == "gen":
            return self._gen_called(args, kwargs)
        if self.kind == "asyncgen":
            return self._asyncgen_called(args, kwargs)
        rt = self.runtime or current_runtime()
        if self.kind == "async":
            return self._async_called(rt, args, kwargs, None, None)
        return self._sync_called(rt, args, kwargs, None, None)

    def lookup(self, *args: Any, **kwargs: Any) -> Called | None:
        """An exact hit of this call, without running the function on a miss: ``Called(value, outcome)`` for
        a hit in the plan's tiers (recorded as any hit: counters, metrics, its access event), or None, with
        nothing recorded, when the call would run the function (a miss, a bypass, a caller's ``no-cache``, a
        rule its SLO breaker holds) so that whoever computes it records it. For a front end that answers hits
        itself and hands everything else to the process that computes (a gateway's ingress); no semantic
        lookup, no single flight (a miss here is decided where it is computed)."""
        rt, plan, started = self._start(args, kwargs)
        if plan.key is None:
            return None
        tripped = rt.slo.tripped
        if tripped and (plan.rule in tripped or plan.tenant_rule in tripped):
            return None
        control = _control_for(plan)
        if control is not None and control.no_cache:
            return None
        served = self._read_neighbour(rt, plan, plan.key, control.max_age_s if control is not None else None)
        if served is None:
            return None
        handle = CallHandle()
        self.counters.hits += 1
        self._decided(rt, plan, handle, "hit", served.tier, served.size, time.perf_counter() - started,
                      served.saved_ms, saved=served.saved)
        self._finish(rt, handle)
        assert handle.outcome is not None  # _finish finished it
        return Called(served.value, handle.outcome)

    # -- per-call controls -------------------------------------------------------------------------------

    def cache_info(self) -> CacheInfo:
        c = self.counters
        with self._flights_lock:
            waiting = sum(flight.followers for flight in self._flights.values())
        return CacheInfo(c.hits, c.misses, c.bypasses, c.stores, c.rejects, waiting)

    def cache_key(self, *args: Any, **kwargs: Any) -> CacheKey | None:
        """The key this call would use, or None when it would bypass the cache."""
        rt = self.runtime or current_runtime()
        return self.contract.plan(rt, args, kwargs).key

    def invalidate(self, *args: Any, **kwargs: Any) -> bool:
        """Delete this call's entry from every tier (a miss of it already under way will not store its
        result). True when some tier held it."""
        rt = self.runtime or current_runtime()
        plan = self.contract.plan(rt, args, kwargs)
        if plan.key is None:
            return False
        self._invalidate_slot(plan.slot)
        return rt.store.delete(plan.ns, [plan.key]) > 0

    def bypass(self, *args: Any, **kwargs: Any) -> Any:
        """Call the function without reading or writing the cache (an event with reason ``caller``)."""
        rt, plan, started = self._start(args, kwargs)
        handle = CallHandle()
        self._bypass(rt, plan, started, handle, "caller")
        try:
            return self.fn(*args, **self._fn_kwargs(kwargs, handle))
        finally:
            self._finish(rt, handle)

    def feedback(self, *args: Any, correct: bool, **kwargs: Any) -> bool:
        """A verdict on the answer a semantic hit served for this call (``correct=False``: it was wrong for
        this prompt). It weighs on the served entry's own error estimate and counts in the realised error.
        Returns False when no semantic hit of this call is remembered (exact hits need no verdict)."""
        rt = self.runtime or current_runtime()
        plan = self.contract.plan(rt, args, kwargs)
        if plan.key is None:
            return False
        with self._served_lock:
            served = self._served.pop(plan.slot, None)
        if served is None:
            return False
        (cache, entry_id, decision), mark = served
        cache.feedback(entry_id, bool(correct), decision=decision)  # the verdict is on that very lookup
        if mark is not None:  # the tenant's breaker of the rule that served it, if still in that state
            breaker, transitions = mark
            breaker.verdict(not correct, transitions)
        return True

    def refresh(self, *args: Any, **kwargs: Any) -> Any:
        """Recompute and store, ignoring what is cached (sync and async functions)."""
        rt, plan, started = self._start(args, kwargs)
        handle = CallHandle()
        if self.kind not in ("sync", "async"):
            raise TypeError("refresh() is for sync and async functions; for streams, invalidate() then call")
        # Misses already under way must not overwrite this result (a bypass has no slot to mark).
        epoch = self._invalidate_slot(plan.slot) if plan.key is not None else 0
        steps = self._steps(rt, plan, started, handle, refresh_epoch=epoch)
        if self.kind == "async":
            return _value_of(self._await(rt, steps, handle, args, kwargs))
        return self._call(steps, handle, args, kwargs)


def _control_for(plan: Plan) -> CacheControl | None:
    """The caller's directives for this call (``cache_control``), less those its rule does not allow."""
    control = current_control.get()
    if control is None:
        return None
    return control.within(plan.decision.client_controls if plan.decision is not None else CLIENT_CONTROLS)


async def _value_of(called: Awaitable[Called]) -> Any:
    return (await called).value
