"""Semantic matching as ``@cache_if`` uses it: after an exact miss, a rule with ``semantic: {max_error: δ}`` may
serve the cached answer of a similar prompt, with the estimated error kept within δ (``controller.semantic``).

This module binds that machinery to cached functions:

- which argument is the prompt (``@cache_if(semantic={"text": "prompt"})``; by default a parameter named
  ``prompt``, ``query`` or ``text``);
- the scope a neighbour must share: the tenant namespace, and a boundary digest of everything else the exact
  key binds (function, model, revision, template, generation parameters, every other argument) plus the
  embedder's name. So a neighbour never crosses tenants, models, parameters or embedders;
- entry ids: an entry's exact cache key. A semantic hit reads the neighbour's entry from the tiers like an
  exact hit (checksums, expiry, tenant namespace all apply); an id whose entry is gone is forgotten;
- the judge: it compares the model's new answer with the neighbour's cached one (decoded values), with the
  function's own ``judge`` (default: equality);
- one ``SemanticCache`` per function and semantic setting (its error model learns that function's traffic),
  over one index per runtime, shared by replicas through Redis when the store has one.

Nothing here imports torch, faiss or sentence-transformers until the first semantic lookup.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from ._types import CacheKey, Namespace
from .semantic._config import DEFAULT_JUDGE_BUDGET, SemanticConfig
from .semantic._signing import check_secret

if TYPE_CHECKING:
    from evocache.dsl import SemanticSpec

    from .semantic import Embedder, Scope, SharedIndex
    from .semantic._cache import SemanticCache
    from .semantic._policies import SemanticDecision
    from .tiers import TieredStore

log = logging.getLogger("evocache.controller.semantic")

TEXT_PARAMS = ("prompt", "query", "text")
"""Parameters taken as the prompt text when ``SemanticOptions.text`` is not given, in this order."""

Judge = Callable[[Any, Any], bool]


class SemanticPlan(NamedTuple):
    """The semantic part of a call's plan: the prompt, the scope boundary and the rule's resolved ``semantic``
    (``SemanticSpec.resolved``: mode and explore filled in)."""

    text: str
    boundary: str  # digest of the exact key's material without the prompt (see module docstring)
    spec: SemanticSpec
    tiers: tuple[str, ...] = ()  # the rule's tiers: where its answers live (and are read back for the judge)

    @property
    def shared(self) -> bool:
        """Whether other replicas can read these answers (they live in Redis), so the entries are shared."""
        return "l2" in self.tiers


@dataclass(frozen=True, slots=True)
class SharedRedis:
    """The Redis a ``SharedIndex`` keeps the semantic entries in (the store's, under its own ``prefix``;
    ``url`` may name a Redis Cluster, ``redis+cluster://``, where the whole index is one hash slot), and
    ``secret``: the deployment secret (bytes, at least 16) that signs them, the one the store's entries are
    signed with (``controller._secret``). Left out of the repr."""

    url: str
    prefix: str
    timeout_s: float = 0.05
    retry_after_s: float = 1.0
    secret: bytes = field(kw_only=True, repr=False)

    def __post_init__(self) -> None:
        check_secret(self.secret, "SharedRedis.secret")


def _prior_for(embedder: Embedder) -> Any:
    """The shipped error-model prior when it was fitted on ``embedder``'s similarities, else None: a prior
    fitted on another embedder's similarity scale would start the model miscalibrated (docs/semantic.md,
    'Prior')."""
    from .semantic._prior import SHIPPED_PRIOR, shipped_prior

    fitted = shipped_prior().meta.get("fit", {})
    return SHIPPED_PRIOR if isinstance(fitted, dict) and fitted.get("embedder") == embedder.name else None


@dataclass(frozen=True, slots=True)
class JudgeLimits:
    """How much judging a miss may bring (``SemanticCache``): ``links``, the other answer clusters judged for
    a link (None: all); ``budget``, judge calls per lookup on average (None: no bound)."""

    links: int | None = None
    budget: float | None = DEFAULT_JUDGE_BUDGET


class Served(NamedTuple):
    """A neighbour's answer, read back from the tiers for a semantic hit."""

    value: Any
    tier: str | None
    size: int
    saved_ms: float
    saved: tuple[int, float, float] = (0, 0.0, 0.0)  # the entry's tokens and cost: saved, and its cost


class Learning(NamedTuple):
    """What ``SemanticLayer.learn`` needs after a semantic miss: the cache, scope and decision of the lookup."""

    cache: SemanticCache
    scope: Scope
    decision: SemanticDecision


class Outcome(NamedTuple):
    """What one semantic lookup came to (``SemanticLayer.lookup``).

    ``served``: the neighbour's answer on a hit (None: a miss). ``reason``: a miss's reason for its event
    (``""``, ``semantic-explore``, ``semantic-too-long``, ``semantic-error``). ``explanation``: the event's
    ``semantic`` field (None when no neighbour was considered). ``learning``: what ``learn`` needs after the
    model answered a miss (None: nothing to learn). ``verdict``: ``(cache, entry id, decision)`` of a hit, for
    feedback on it.
    """

    served: Served | None
    reason: str = ""
    explanation: dict[str, Any] | None = None
    learning: Learning | None = None
    verdict: tuple[SemanticCache, str, SemanticDecision] | None = None


class Gone(LookupError):
    """A cached answer the judge needed is no longer in any tier."""


class JudgeError(RuntimeError):
    """The user's judge raised a ``LookupError`` of its own (not ``Gone``)."""


class _Stored(NamedTuple):
    """The answer ref kept with a semantic entry: where its exact entry lives (not the answer itself)."""

    ns: Namespace
    key: CacheKey
    tiers: tuple[str, ...] = ()  # read back from these only (no promotion into tiers the rule does not use)


class _Fresh(NamedTuple):
    """The answer the model just computed, handed to the judge."""

    value: Any


class SemanticLayer:
    """The runtime's semantic side: the embedder, the index and the per-function ``SemanticCache`` objects.

    Built empty with the runtime from its ``SemanticConfig``; the embedder and index are made on the first
    lookup (``embedder`` injects one; otherwise ``config.embedder`` says which). With ``redis`` (and
    ``config.shared``) the index is a ``SharedIndex`` in that Redis (entries and vectors followed by every
    replica), else one of this process. ``max_entries`` bounds the entries this process has inserted: past it
    the oldest are removed from the index. ``on_error(op, exc)`` is told of every failure of the semantic side
    (``op``: ``lookup`` or ``learn``; a link search failing on the background thread is a ``learn``), which is
    also logged; the call it happened in goes on as a plain miss.
    ``clock`` dates the entries' expiry; ``rng`` draws every cache's exploration coin (seed it for a
    reproducible run; None: each cache draws from its own unseeded ``random.Random``).

    After a semantic miss the judge's link search (comparing the new answer with each neighbouring answer
    cluster) runs on one background thread (``later``), so the missed call returns without waiting for it; at
    most ``link_backlog`` searches wait, later ones are dropped (counted by the cache). ``drain`` waits for the
    backlog (tests, shutdown).
    """

    def __init__(
        self,
        config: SemanticConfig,
        *,
        redis: SharedRedis | None = None,
        embedder: Embedder | None = None,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
        on_error: Callable[[str, BaseException], None] | None = None,
        max_entries: int = 1_000_000,
        link_backlog: int = 1024,
    ) -> None:
        if not isinstance(config, SemanticConfig):
            raise TypeError(f"config must be a SemanticConfig, got {type(config).__name__}")
        if rng is not None and not isinstance(rng, random.Random):
            raise TypeError(f"rng must be a random.Random, got {type(rng).__name__}")
        self._config = config
        self._redis = redis
        self._on_error = on_error
        self._embedder = embedder
        self._clock = clock
        self._rng = rng
        self._max_entries = max_entries
        self._index: SharedIndex | None = None  # shared through Redis when the store has one
        self._local: SharedIndex | None = None  # this process only: answers other replicas cannot read
        self._caches: dict[tuple, SemanticCache] = {}
        self._inserted: OrderedDict[str, tuple[Scope, SemanticCache]] = OrderedDict()
        self._lock = threading.Lock()
        self._later: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize=link_backlog)
        self._worker: threading.Thread | None = None
        # The answer classifiers' refits (seconds each) run on a thread of their own, never ahead of the link
        # searches in the backlog above: a tenant's refit must not make other tenants' links drop. At most one
        # refit per scope waits (the classifier asks for the next only when the last one ended).
        self._fits: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False

    @property
    def embedder(self) -> Embedder:
        if self._embedder is None:
            with self._lock:
                if self._embedder is None:
                    self._embedder = self._config.embedder.build()
        return self._embedder

    def _index_for(self, shared: bool) -> SharedIndex:
        if shared:
            return self._shared_index()
        if self._local is None:
            with self._lock:
                if self._local is None:
                    from .semantic import SharedIndex

                    self._local = SharedIndex(None, clock=self._clock)
        return self._local

    def _shared_index(self) -> SharedIndex:
        if self._index is None:
            with self._lock:
                if self._index is None:
                    from .semantic import SharedIndex

                    redis = self._redis
                    if redis is None:
                        self._index = SharedIndex(None, clock=self._clock)
                    else:
                        self._index = SharedIndex(
                            redis.url if self._config.shared else None,
                            secret=redis.secret,
                            prefix=redis.prefix,
                            clock=self._clock,
                            socket_timeout=redis.timeout_s,
                            connect_timeout=redis.timeout_s,
                            retry_after=redis.retry_after_s,
                        )
        return self._index

    def scope(self, ns: Namespace, plan: SemanticPlan) -> Scope:
        from .semantic import Scope

        return Scope(ns, f"{self.embedder.name}|{plan.boundary}")

    def cache_for(
        self, identity: str, plan: SemanticPlan, judge: Judge, *, limits: JudgeLimits = JudgeLimits()
    ) -> SemanticCache:
        """The ``SemanticCache`` of one function under one semantic setting (made on first use); ``limits``
        bound the judging after a miss (``SemanticCache``'s ``link_tries`` and ``judge_budget``)."""
        # max_error too: the pacer spends one bound's budget (a strict and a lenient rule must not share one).
        # tiers: where the answers live decides which index (shared or local) and where the judge reads them.
        key = (identity, plan.spec, plan.tiers, limits)
        cache = self._caches.get(key)
        if cache is None:
            from .semantic._cache import SemanticCache
            from .semantic._policies import PolicyOptions

            embedder, index = self.embedder, self._index_for(plan.shared)  # each locks itself: not under it
            with self._lock:
                cache = self._caches.get(key)
                if cache is None:
                    spec = plan.spec
                    policy = PolicyOptions(
                        mode=spec.mode, explore=spec.explore, threshold=spec.threshold, prior=_prior_for(embedder)
                    ).build()
                    cache = SemanticCache(
                        embedder, index=index, judge=judge, policy=policy, link_tries=limits.links,
                        judge_budget=limits.budget, rng=self._rng,
                        # An entry id is an exact key, so any replica's neighbour can be judged from the tiers.
                        answer_ref_of=lambda scope, entry_id: _Stored(
                            scope.namespace, CacheKey(entry_id), plan.tiers
                        ),
                        # The answer classifier's refits take seconds: never in a caller's request.
                        fit_later=self.fit_later,
                    )
                    self._caches[key] = cache
        return cache

    def lookup(
        self,
        identity: str,
        ns: Namespace,
        plan: SemanticPlan,
        *,
        judge: Judge,
        limits: JudgeLimits,
        store: TieredStore,
        decode: Callable[[bytes], Any],
        read: Callable[[CacheKey], Served | None],
    ) -> Outcome:
        """The semantic lookup of ``identity``'s call in ``ns`` after an exact miss.

        A prompt longer than the embedder reads is a miss (``semantic-too-long``): prompts that differ only
        past its window would look alike. A served neighbour's answer is read with ``read(its exact key)``
        like any hit (checksums, expiry, tenant namespace all apply; None when it is gone or undecodable:
        the neighbour is then forgotten and the call is a miss). ``judge`` compares decoded answers, read back
        from ``store`` with ``decode`` (``make_judge``). A failure of the embedder or the index is logged,
        told to ``on_error`` and a miss (``semantic-error``), never a failed call.
        """
        try:
            if not self.embedder.fits(plan.text):
                return Outcome(None, "semantic-too-long")
            cache = self.cache_for(identity, plan, make_judge(_resolver(store, decode), judge), limits=limits)
            scope = self.scope(ns, plan)
            decision, entry_id = cache.lookup(scope, plan.text, max_error=plan.spec.max_error)
        except Exception as exc:  # noqa: BLE001 - the embedder or index failing is a miss, never a failed call
            log.warning("%s: semantic lookup failed, treated as a miss: %s: %s", identity, type(exc).__name__, exc)
            self._failed("lookup", exc)
            return Outcome(None, "semantic-error")
        if entry_id is not None:
            served = read(CacheKey(entry_id))
            if served is not None:
                return Outcome(served, "semantic", explanation(decision), verdict=(cache, entry_id, decision))
            cache.remove(scope, [entry_id])  # its entry left every tier: never offer it again
            decision = decision._replace(serve=False)
        return Outcome(
            None,
            "semantic-explore" if decision.explore else "",
            explanation(decision) if decision.neighbour is not None else None,
            Learning(cache, scope, decision),
        )

    def learn(
        self, identity: str, ns: Namespace, key: CacheKey, plan: SemanticPlan, ttl: float, value: Any,
        stored: bool, learning: Learning,
    ) -> bool | None:
        """After the model answered a semantic miss: index the new entry under its exact ``key`` (when it was
        stored) and let the judge compare its answer with the neighbour's. Failures are logged and told to
        ``on_error``, never raised.

        Returns an exploration's verdict, whether serving the neighbour would have been wrong (the rule's SLO
        breaker counts it); None for a miss that was no exploration, or that nothing judged."""
        cache, scope, decision = learning
        same = None
        try:
            if stored:
                # The semantic entry expires with its answer's exact entry (one with a sliding TTL may then
                # live on, reachable by its exact key only).
                cache.insert(scope, key, plan.text, _Stored(ns, key, plan.tiers), expires_at=self._clock() + ttl)
                self.inserted(cache, scope, key)
            # An answer that was not stored (too large, unencodable, invalidated meanwhile) is still a verdict,
            # but no entry carries it: its links would otherwise wait for the prompt's next stored answer.
            same = cache.judge_miss(scope, plan.text, _Fresh(value), decision, link=stored, defer=self.later)
        except Gone:
            pass  # the neighbour's answer left the tiers before it could be judged: no observation
        except Exception as exc:  # noqa: BLE001 - the embedder, index or the user's judge: never fail the call
            log.warning("%s: semantic update failed: %s: %s", identity, type(exc).__name__, exc)
            self._failed("learn", exc)
        return None if same is None or not decision.explore else not same

    def _failed(self, op: str, exc: BaseException) -> None:
        if self._on_error is not None:
            self._on_error(op, exc)

    def inserted(self, cache: SemanticCache, scope: Scope, entry_id: str) -> None:
        """Note an insert; removes the oldest entries past ``max_entries``."""
        with self._lock:
            self._inserted[entry_id] = (scope, cache)
            self._inserted.move_to_end(entry_id)
            dropped = []
            while len(self._inserted) > self._max_entries:
                dropped.append(self._inserted.popitem(last=False))
        # Only the cache that inserted an entry removes it: it forgets its own state and takes the entry out of
        # the index (once: the index, and Redis behind it, are shared by every cache).
        for old_id, (old_scope, old_cache) in dropped:
            old_cache.remove(old_scope, [old_id])

    def later(self, work: Callable[[], None]) -> bool:
        """Run ``work`` on the layer's background thread (started on first use), after what is queued before
        it. False when the backlog is full or the layer is closed: ``work`` will not run."""
        with self._lock:
            if self._closed:
                return False
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="evocache-semantic-links", daemon=True)
                self._worker.start()
            try:
                self._later.put_nowait(work)
            except queue.Full:
                return False
        return True

    def _work(self) -> None:
        while True:
            work = self._later.get()
            try:
                if work is None:
                    return
                work()
            except Exception as exc:  # noqa: BLE001 - one search's failure must not end the thread
                log.warning("semantic background work failed: %s: %s", type(exc).__name__, exc)
                self._failed("learn", exc)
            finally:
                self._later.task_done()

    def fit_later(self, work: Callable[[], None]) -> bool:
        """Run an answer classifier's refit on the layer's refit thread (started on first use). False when the
        layer is closed: ``work`` will not run."""
        with self._lock:
            if self._closed:
                return False
            if self._fits is None:
                self._fits = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="evocache-semantic-fits")
            self._fits.submit(work)
            return True

    def drain(self) -> None:
        """Wait until every queued background search has run."""
        self._later.join()

    def close(self) -> None:
        """Let the queued searches finish (they may read the tiers and the index), stop the thread, then close
        the indexes."""
        with self._lock:
            self._closed = True
            worker = self._worker
            fits, self._fits = self._fits, None
        if fits is not None:
            fits.shutdown(wait=True, cancel_futures=True)  # a refit under way ends (it reads the index)
        if worker is not None:
            self._later.put(None)  # after the queued work; close() waits for a full queue to make room
            worker.join(timeout=30)
            with self._lock:
                self._worker = None
        for index in (self._index, self._local):
            if index is not None:
                index.close()


def _resolver(store: TieredStore, decode: Callable[[bytes], Any]) -> Callable[[_Stored], Any]:
    """Reads a stored answer ref back from ``store``'s tiers (only those its rule uses); ``Gone`` if absent."""

    def resolve(ref: _Stored) -> Any:
        entry = store.get(ref.ns, ref.key, ref.tiers or None).entry
        if entry is None:
            raise Gone(ref.key)
        return decode(entry.value)

    return resolve


def make_judge(resolve: Callable[[_Stored], Any], judge: Judge) -> Judge:
    """The judge ``SemanticCache`` calls with answer refs: resolves each to its value (``resolve`` reads a
    stored one from the tiers and raises ``Gone`` when it cannot) and asks ``judge``."""

    def value_of(ref: Any) -> Any:
        return ref.value if type(ref) is _Fresh else resolve(ref)

    def judge_refs(new_ref: Any, cached_ref: Any) -> bool:
        new, cached = value_of(new_ref), value_of(cached_ref)  # Gone: an answer left the tiers
        try:
            return bool(judge(new, cached))
        except LookupError as exc:
            # Not Gone: a bug in the user's judge. Raised as something else, so the cache does not mistake it
            # for an answer that has gone (which it skips without a word).
            raise JudgeError(f"the judge raised {type(exc).__name__}: {exc}") from exc

    return judge_refs


def explanation(decision: SemanticDecision) -> dict[str, Any]:
    """The ``semantic`` field of an access event (ARCHITECTURE.md's event format)."""
    est = decision.est_error
    return {
        "neighbour": decision.neighbour,
        "similarity": round(float(decision.similarity), 6),
        "threshold": round(float(decision.threshold), 6),
        "est_error": None if est != est else round(float(est), 6),  # NaN (static mode): estimates nothing
        "served": bool(decision.serve),
        "explore": bool(decision.explore),
    }
