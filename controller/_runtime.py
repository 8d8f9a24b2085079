"""The runtime that decorated functions use, built from a ``StoreConfig`` (``controller._store_config``).

A ``CacheRuntime`` is what a call needs besides its own contract: the tiered store, the event sink, the metrics
and (optionally) the policy in force. It is immutable; applying a new policy or configuration builds a new one
and swaps it in whole, so a call sees either the old runtime or the new one, never a mix.

With no set-up, ``default_runtime()`` is process memory only (64 MiB, LRU) with events in a memory ring:
``@cache_if`` works in a plain script at once. ``configure(StoreConfig(...))`` (or a Ray replica) installs
another one for the whole process; ``use_runtime(rt)`` runs one block's calls on another (a replica's rollout
arm: ``controller._rollout``).
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ._events import EventSink, JsonlSink, RedisStreamSink, RingSink
from ._keys import namespace_for
from ._metrics import CacheMetrics
from ._secret import entry_secret
from ._semantic import SemanticLayer, SharedRedis
from ._slo import SloBreakers
from ._store_config import EventsConfig, StoreConfig
from ._types import Namespace, TierName
from .errors import StoreConfigError, TierUnavailable
from .eviction import make_eviction_policy, start_from_model
from .tiers import DiskTier, MemoryTier, RedisTier, Tier, TieredStore

if TYPE_CHECKING:
    from evocache.dsl import Policy

    from .eviction import EvictionPolicy
    from .semantic import Embedder

log = logging.getLogger("evocache.controller")


class _NullSink:
    errors = 0

    def record(self, rec: object) -> None:
        return None

    def emit(self, event: object) -> None:
        return None

    def flush(self) -> None:
        return None

    def close(self) -> None:
        return None


class _PolicyHolder:
    """Lets tiers built once read quotas and weights from whichever policy is in force."""

    def __init__(self, policy: Policy | None) -> None:
        self.policy = policy

    def _tenant(self, ns: Namespace):
        policy = self.policy
        if policy is None or not policy.tenants:
            return None
        return policy.tenant(_tenant_names(policy).get(ns))  # a namespace no tenant has: the default entry

    def l1_quota(self, capacity: int) -> Callable[[Namespace], int | None]:
        def quota(ns: Namespace) -> int | None:
            spec = self._tenant(ns)
            return None if spec is None else int(spec.l1_share * capacity)

        return quota

    def l2_quota(self, capacity: int) -> Callable[[Namespace], int | None]:
        def quota(ns: Namespace) -> int | None:
            spec = self._tenant(ns)
            return None if spec is None else int(spec.l2_share * capacity)

        return quota

    def weight(self, ns: Namespace) -> float:
        spec = self._tenant(ns)
        return 1.0 if spec is None else float(spec.weight)


_generation = itertools.count(1)


@dataclass(frozen=True, slots=True)
class CacheRuntime:
    store: TieredStore
    events: EventSink
    metrics: CacheMetrics
    policy: Policy | None = None
    clock: Callable[[], float] = time.time
    tenants: _PolicyHolder = field(default_factory=lambda: _PolicyHolder(None))
    config: StoreConfig = field(default_factory=lambda: StoreConfig(events=EventsConfig(sink="none")))
    generation: int = field(default_factory=lambda: next(_generation))
    # Derived in __post_init__ (and again by every `replace`): read on every call, so no property lookups.
    policy_ref: str = field(init=False, default="")
    l1: MemoryTier | None = field(init=False, default=None)
    # The semantic side (embedder, index, per-function error models): shared by every generation, like store.
    semantic: SemanticLayer | None = field(default=None, compare=False)
    # The SLO breakers of the policy's rules (controller._slo); built for `policy` when not given, and anew by
    # `activate`. Stateful, so carried by every `replace` that keeps the policy.
    slo: SloBreakers | None = field(default=None, compare=False)
    # The rollout arm whose rules this runtime enforces (``active``, ``canary``, ``shadow``; empty outside a
    # rollout): what a call's outcome names as its arm.
    arm: str = field(default="", compare=False)
    # What the L1 hit path reads, in one flat tuple: (generation, *l1.hot_read (Nones without an L1), clock,
    # events.record, policy_ref, arm, slo.bypassing).
    hot: tuple = field(init=False, default=(), compare=False)

    def __post_init__(self) -> None:
        policy_ref = self.policy.ref if self.policy is not None else ""
        first = next(iter(self.store.tiers.values()), None)
        l1 = first if isinstance(first, MemoryTier) else None
        object.__setattr__(self, "policy_ref", policy_ref)
        object.__setattr__(self, "l1", l1)
        slo = self.slo
        if slo is None or not slo.serves(self.policy, self.clock, self.metrics, self.events):
            slo = SloBreakers(self.policy, clock=self.clock, metrics=self.metrics, events=self.events)
            object.__setattr__(self, "slo", slo)
        hot_read = l1.hot_read if l1 is not None else (None, None, None, None)
        object.__setattr__(
            self, "hot",
            (self.generation, *hot_read, self.clock, self.events.record, policy_ref, self.arm, slo.bypassing),
        )

    @property
    def tier_names(self) -> tuple[TierName, ...]:
        return tuple(self.store.tiers)

    def activate(self, policy: Policy | None) -> CacheRuntime:
        """Put ``policy`` in force on this runtime's store; returns the runtime to use from now on.

        Everything is checked first (eviction names, the trained model file, L2 quotas); a policy that cannot be enforced raises
        ``StoreConfigError`` and changes nothing. Then, together: tenant quotas and weights switch (tiers read
        them through the shared holder), L1 and L3 switch eviction if the policy names another one (L1 also for
        another model file; its new policy is told of every held entry, oldest first), and the returned runtime is a new generation, so
        memoised decisions of the old rules are not reused. The new rules' SLO breakers start closed, and this
        runtime's are retired (they stop deciding). The store is shared: this runtime object keeps the old
        rules but sees the new quotas, so build candidates with the replay simulator, not here.
        """
        check_policy(policy, self.config)
        new_l1 = None
        if self.l1 is not None and _l1_spec(self.config, policy) != _l1_spec(self.config, self.policy):
            new_l1 = _l1_policy(self.config, policy, background=True)
        disk = self.store.tiers.get("l3")
        if isinstance(disk, DiskTier):
            # The one step that can fail (another process holding the disk index locked), so it goes first.
            try:
                disk.set_eviction(_L3_EVICTION[_l3_eviction(policy)])
            except TierUnavailable as exc:
                if new_l1 is not None:
                    new_l1.close()
                raise StoreConfigError(f"policy {policy.ref if policy else None}: L3 eviction: {exc}") from exc
        # -- nothing below can fail --
        self.tenants.policy = policy
        if new_l1 is not None:
            self.l1.replace_policy(new_l1)
        self.slo.retire()
        slo = SloBreakers(policy, clock=self.clock, metrics=self.metrics, events=self.events)
        return replace(self, policy=policy, generation=next(_generation), slo=slo)

    def with_rules(self, policy: Policy | None, *, arm: str = "") -> CacheRuntime:
        """A runtime on this one's store whose calls ``policy``'s rules decide: a canary's or a shadow's arm.

        It shares the store, events, metrics, semantic layer and tenant holder, so quotas and eviction stay
        those of the policy activated on the store (``activate``); only the rules differ. Its ``policy_ref``
        is ``policy``'s, so every access event it emits names the version that decided, and it is a new
        generation, so no plan memoised under other rules is reused; ``arm`` names it in call outcomes.
        ``StoreConfigError`` for a policy this
        store cannot enforce (``check_policy``); nothing is built then.
        """
        _policy_or_none("with_rules", policy)
        check_policy(policy, self.config)
        return replace(self, policy=policy, generation=next(_generation), arm=arm)

    def flush(self) -> None:
        """Write out buffered events (a JSONL sink buffers a batch)."""
        self.events.flush()

    def close(self) -> None:
        self.events.close()
        if self.semantic is not None:
            self.semantic.close()
        self.store.close()


_index_cache: dict[str, dict[Namespace, str]] = {}


def _tenant_names(policy: Policy) -> dict[Namespace, str]:
    """The namespace of each tenant the policy names -> its name, for ``Policy.tenant``."""
    index = _index_cache.get(policy.content_hash)
    if index is None:
        index = {namespace_for(name): name for name in policy.tenants}
        _index_cache[policy.content_hash] = index
    return index


# L1 runs any registered policy class. L2 evicts inside a tenant's quota by last use (Redis's own maxmemory
# policy governs the rest); L3 maps onto diskcache's policies. A name a tier cannot honour is refused, not ignored.
_L2_EVICTION = frozenset({"lru"})
_L3_EVICTION = {"lru": "least-recently-used", "lfu": "least-frequently-used", "fifo": "least-recently-stored"}


def _l1_eviction(config: StoreConfig, policy: Policy | None) -> str:
    return policy.eviction.l1 if policy is not None and policy.eviction.l1 else config.l1.eviction


def _l1_spec(config: StoreConfig, policy: Policy | None) -> tuple[str, str | None]:
    """What L1's eviction is built from: the class name and the model file; a change of either rebuilds it."""
    return _l1_eviction(config, policy), (policy.eviction.model if policy is not None else None)


def _l1_model(config: StoreConfig, policy: Policy | None) -> Path | None:
    """The file of the trained model ``policy`` names for L1's learned eviction, or None. Raises
    ``StoreConfigError`` when it names one and the store has no ``l1.models`` directory."""
    name = policy.eviction.model if policy is not None else None
    if name is None:
        return None
    if config.l1.models is None:
        raise StoreConfigError(
            f"policy {policy.ref}: eviction.model: names {name!r}, but the store has no l1.models directory "
            "to read it from (L1Config.models)"
        )
    return Path(config.l1.models) / name


def _l1_policy(config: StoreConfig, policy: Policy | None, *, background: bool) -> EvictionPolicy:
    """L1's eviction policy for ``policy``, started from the trained model it names (if any). Raises
    ``StoreConfigError`` for a model file that is missing, unreadable or not a model this policy can use;
    nothing is left running then."""
    path = _l1_model(config, policy)  # before anything is built: a store without the directory refuses
    built = make_eviction_policy(_l1_eviction(config, policy), capacity=config.l1.bytes, background=background)
    return start_from_model(built, path, policy.ref if policy is not None else "")


def _l3_eviction(policy: Policy | None) -> str:
    return policy.eviction.l3 if policy is not None and policy.eviction.l3 else "fifo"


def _policy_or_none(caller: str, policy: object) -> None:
    """A ``TypeError`` for anything but a ``Policy`` or None, naming ``caller`` and what it takes."""
    from evocache.dsl import Policy  # noqa: PLC0415 - at call time: the dsl is imported lazily here

    if policy is not None and not isinstance(policy, Policy):
        raise TypeError(
            f"{caller}() takes a Policy (evocache.dsl.load_policy or parse_policy) or None, "
            f"got {type(policy).__qualname__}"
        )


def check_policy(policy: Policy | None, config: StoreConfig | None = None) -> None:
    """Raise ``StoreConfigError`` unless this controller can enforce ``policy`` (with ``config``'s store);
    ``None`` (no policy) always passes. Nothing is applied: activation and building call this first.

    The dsl room validates a policy on its own; this adds what only the controller knows: the eviction
    policies it has, and that L2 tenant shares have an ``l2_bytes`` to be shares of.
    """
    _policy_or_none("check_policy", policy)
    if policy is None:
        return
    if config is not None and config.redis is not None and not config.redis.l2_bytes:
        shared = sorted(name for name, spec in policy.tenants.items() if spec.l2_share < 1.0)
        if shared:
            raise StoreConfigError(
                f"policy {policy.ref}: tenants {shared} set l2_share, but the store has no l2_bytes to share "
                "(RedisConfig.l2_bytes: evocache's part of Redis memory)"
            )
    spec = policy.eviction
    for field_name, name in (("l1", spec.l1), ("fallback", spec.fallback)):
        if name is None:
            continue
        try:
            make_eviction_policy(name)
        except StoreConfigError as exc:
            raise StoreConfigError(f"policy {policy.ref}: eviction.{field_name}: {exc}") from exc
    if spec.model is not None and config is not None:
        _l1_policy(config, policy, background=False).close()  # the file must hold a model it can use
    if spec.l2 is not None and spec.l2 not in _L2_EVICTION:
        raise StoreConfigError(
            f"policy {policy.ref}: eviction.l2: {spec.l2!r} is not supported; known: {sorted(_L2_EVICTION)}"
        )
    if spec.l3 is not None and spec.l3 not in _L3_EVICTION:
        raise StoreConfigError(
            f"policy {policy.ref}: eviction.l3: {spec.l3!r} is not supported; known: {sorted(_L3_EVICTION)}"
        )


def build_runtime(
    config: StoreConfig | None = None,
    *,
    policy: Policy | None = None,
    clock: Callable[[], float] = time.time,
    metrics: CacheMetrics | None = None,
    embedder: Embedder | None = None,
    rng: random.Random | None = None,
) -> CacheRuntime:
    """Build tiers, event sink and metrics from ``config``. Raises ``StoreConfigError``; builds nothing partial.

    ``embedder`` replaces the one ``config.semantic.embedder`` names for semantic matching (built lazily
    otherwise). ``rng`` draws every semantic exploration coin (``SemanticLayer``): seed it to reproduce a run;
    None gives each semantic cache its own unseeded coin."""
    config = config or StoreConfig()
    check_policy(policy, config)
    if rng is not None and not isinstance(rng, random.Random):  # before anything is built
        raise TypeError(f"build_runtime(rng=) takes a random.Random or None, got {type(rng).__name__}")
    holder = _PolicyHolder(policy)
    metrics = metrics or CacheMetrics()
    l1, l2, l3 = config.l1, config.redis, config.disk
    secret = entry_secret(config) if l2 is not None or l3 is not None else b""
    tiers: list[Tier] = [
        MemoryTier(
            l1.bytes,
            policy=_l1_policy(config, policy, background=True),
            quota=holder.l1_quota(l1.bytes),
            weight=holder.weight,
            clock=clock,
            on_fault=metrics.tier_fault,
        )
    ]
    if l2 is not None:
        tiers.append(
            RedisTier(
                l2.url,
                secret=secret,
                prefix=l2.prefix,
                socket_timeout=l2.timeout_s,
                connect_timeout=l2.timeout_s,
                retry_after=l2.retry_after_s,
                quota=holder.l2_quota(l2.l2_bytes) if l2.l2_bytes else None,
                clock=clock,
                on_fault=metrics.tier_fault,
            )
        )
    if l3 is not None:
        tiers.append(
            DiskTier(
                l3.path,
                size_limit=l3.bytes,
                secret=secret,
                eviction_policy=_L3_EVICTION[_l3_eviction(policy)],
                clock=clock,
                on_fault=metrics.tier_fault,
            )
        )
    store = TieredStore(tiers, clock=clock, on_error=metrics.tier_error)
    events = _SINKS[config.events.sink](config)
    return CacheRuntime(
        store=store, events=events, metrics=metrics, policy=policy, clock=clock, tenants=holder, config=config,
        slo=SloBreakers(policy, clock=clock, metrics=metrics, events=events),
        semantic=SemanticLayer(
            config.semantic, redis=_semantic_redis(config, secret), embedder=embedder, clock=clock, rng=rng,
            on_error=lambda op, exc: metrics.tier_error("semantic", op, exc),
        ),
    )


def _semantic_redis(config: StoreConfig, secret: bytes) -> SharedRedis | None:
    """The store's Redis, where a shared semantic index keeps its entries (under the L2 prefix + ``-sem``),
    signed with ``secret``, the one that signs the store's entries."""
    redis = config.redis
    if redis is None:
        return None
    return SharedRedis(redis.url, f"{redis.prefix}-sem", redis.timeout_s, redis.retry_after_s, secret=secret)


# By EventsConfig.sink; the config's validators have checked that each sink has what it needs.
_SINKS: dict[str, Callable[[StoreConfig], EventSink]] = {
    "ring": lambda config: RingSink(config.events.ring_capacity),
    "jsonl": lambda config: JsonlSink(Path(config.events.path)),
    "redis": lambda config: RedisStreamSink(
        config.redis.url, socket_timeout=config.redis.timeout_s, retry_after=config.redis.retry_after_s
    ),
    "none": lambda config: _NullSink(),
}


# Guards _default. Reentrant: set_policy and configure hold it across the whole swap, so two of them never
# interleave (each activation compares against the runtime actually in force).
_lock = threading.RLock()
_default: CacheRuntime | None = None
# A runtime for the calls of one context (use_runtime): a replica runs each request on its rollout arm. A
# ContextVar, so asyncio tasks and threads started with a copied context inherit it and nothing else sees it.
_override: contextvars.ContextVar[CacheRuntime | None] = contextvars.ContextVar(
    "evocache_runtime", default=None
)
_override_get = _override.get


def current_runtime() -> CacheRuntime:
    """The runtime of this context (``use_runtime``), else the process runtime. The request path's accessor:
    one ContextVar read and one global read once the process runtime exists."""
    return _override_get() or _default or default_runtime()


@contextlib.contextmanager
def use_runtime(rt: CacheRuntime) -> Iterator[CacheRuntime]:
    """Calls made inside the block by ``@cache_if`` functions without a store of their own run on ``rt``
    (their plans, lookups, stores and events); outside it nothing changes. Tasks and ``asyncio.to_thread``
    calls started inside it inherit it (they copy the context); a plain ``threading.Thread`` does not. A
    stream takes its runtime when it is called, so one created inside the block keeps ``rt``. Blocks nest;
    the innermost wins. Anything but a ``CacheRuntime`` is a ``TypeError``."""
    if not isinstance(rt, CacheRuntime):
        raise TypeError(f"use_runtime() takes a CacheRuntime, got {type(rt).__qualname__}")
    token = _override.set(rt)
    try:
        yield rt
    finally:
        _override.reset(token)


def default_runtime() -> CacheRuntime:
    """The process runtime, created on first use as process memory only."""
    global _default
    rt = _default
    if rt is None:
        with _lock:
            if _default is None:
                _default = build_runtime(StoreConfig())
            rt = _default
    return rt


def configure(
    config: StoreConfig | CacheRuntime | None = None, *, policy: Policy | None = None
) -> CacheRuntime:
    """Install a runtime for every ``@cache_if`` function of the process that was not given its own store.

    The previous runtime is closed after the swap. Returns the new runtime. A ``policy`` that is not a
    ``Policy`` is a ``TypeError``; one it cannot enforce raises; either way nothing changes.
    """
    _policy_or_none("configure", policy)
    global _default
    with _lock:
        new = config if isinstance(config, CacheRuntime) else build_runtime(config, policy=policy)
        if isinstance(config, CacheRuntime) and policy is not None:
            new = new.activate(policy)
        old, _default = _default, new
    if old is not None and old is not new and old.store is not new.store:
        old.close()
    return new


def set_policy(policy: Policy | None) -> CacheRuntime:
    """Apply ``policy`` to the process runtime. A policy it cannot enforce raises and changes nothing; anything
    but a ``Policy`` or None is a ``TypeError``."""
    _policy_or_none("set_policy", policy)
    global _default
    with _lock:
        _default = default_runtime().activate(policy)
        return _default
