"""What a replica holds to enforce a policy rollout per request: the active version, a canary on a stable
fraction of request keys, and a shadow version planned beside each call without acting on it.

    arms = RolloutRuntimes(current_runtime())
    PolicyFollower(store, replica_id, arms.apply).start()    # every rollout the store puts in force

    with arms.use(conversation_id) as arm:                     # "active" or "canary", stable by key
        answer = generate(prompt, temperature=0)
        arms.compare(generate, (prompt,), {"temperature": 0})  # what the shadow would have decided

The active policy is activated on the replica's store (``CacheRuntime.activate``: its rules, tenant quotas and
eviction); the canary and the shadow are runtimes on the same store with only their own rules
(``CacheRuntime.with_rules``), so quotas and eviction always follow the active policy, and every access event
names the version that decided. A shadow never serves, stores or emits: ``compare`` plans the call under it
beside the plan that served, and counts where the two decide otherwise.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NamedTuple

from ._cache_if import CachedFunction
from ._contract import Plan
from ._metrics import CacheMetrics
from ._policy_store import Rollout, canary_for
from ._runtime import CacheRuntime, check_policy, current_runtime, use_runtime

if TYPE_CHECKING:
    from evocache.dsl import Policy

__all__ = ["RolloutArm", "RolloutRuntimes", "ShadowComparison"]


class RolloutArm(NamedTuple):
    """The arm a request runs on: ``name`` (``"active"`` or ``"canary"``) and its ``runtime``."""

    name: str
    runtime: CacheRuntime


@dataclass(frozen=True, slots=True)
class ShadowComparison:
    """One call planned under the runtime that served it and under the shadow: each plan's rule, and the parts
    of the decision that differ, empty when they agree: ``cache`` (one caches, the other bypasses) and
    ``rule``, or, when both cache, those of ``DECISION_PARTS`` (in its order)."""

    base_rule: str
    shadow_rule: str
    differs: tuple[str, ...]

    @property
    def agree(self) -> bool:
        return not self.differs


def _semantic(plan: Plan) -> object:
    return None if plan.semantic is None else plan.semantic.spec


def _max_error(plan: Plan) -> float | None:
    return None if plan.semantic is None else plan.semantic.spec.max_error


# The parts of a caching decision, read off a plan. Compared part by part only when both plans cache: a
# bypass has no ttl or tiers to compare.
DECISION_PARTS: Mapping[str, Callable[[Plan], object]] = {
    "rule": lambda plan: plan.rule,
    "ttl": lambda plan: plan.ttl,
    "sliding": lambda plan: plan.sliding,
    "tiers": lambda plan: plan.tiers,
    "max_entry_bytes": lambda plan: plan.max_entry_bytes,
    "stream": lambda plan: plan.stream_ok,
    "semantic": lambda plan: plan.semantic is not None,
    "max_error": _max_error,
    "semantic_spec": _semantic,
    "key": lambda plan: plan.key,
}


def _differences(base: Plan, shadow: Plan) -> tuple[str, ...]:
    if (base.key is None) != (shadow.key is None):
        return ("cache", "rule") if base.rule != shadow.rule else ("cache",)
    if base.key is None:  # both bypass: the same decision, maybe by another rule
        return ("rule",) if base.rule != shadow.rule else ()
    return tuple(name for name, part in DECISION_PARTS.items() if part(base) != part(shadow))


@dataclass(frozen=True, slots=True)
class _Arms:
    """Everything ``arm_for`` and ``compare`` read, swapped whole by ``apply``: a request sees one rollout."""

    rollout: Rollout | None
    active: CacheRuntime
    canary: CacheRuntime | None = None
    fraction: float = 0.0
    shadow: CacheRuntime | None = None


class _Tally:
    """Shadow comparisons of one shadow version, by rule pair and by differing part."""

    def __init__(self, shadow: str | None) -> None:
        self.shadow = shadow
        self.compared = 0
        self.agreed = 0
        self.parts: dict[str, int] = {}
        self.pairs: dict[tuple[str, str], list[int]] = {}  # (base rule, shadow rule) -> [agreed, differed]

    def add(self, comparison: ShadowComparison) -> None:
        self.compared += 1
        pair = self.pairs.setdefault((comparison.base_rule, comparison.shadow_rule), [0, 0])
        if comparison.agree:
            self.agreed += 1
            pair[0] += 1
        else:
            pair[1] += 1
        for part in comparison.differs:
            self.parts[part] = self.parts.get(part, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "shadow": self.shadow,
            "compared": self.compared,
            "agreed": self.agreed,
            "differed": dict(sorted(self.parts.items())),
            "pairs": [{"base_rule": base, "shadow_rule": shadow, "agreed": n[0], "differed": n[1]}
                      for (base, shadow), n in sorted(self.pairs.items())],
        }


class RolloutRuntimes:
    """The runtimes of one replica's rollout, built from its ``base`` runtime (the store it serves from).

    ``apply(rollout)`` puts a rollout in force (``PolicyFollower``'s ``on_policy``); ``arm_for(key)`` and
    ``use(key)`` give a request its arm; ``compare`` plans a call under the shadow. Until the first
    ``apply``, every request runs on ``base`` with whatever policy it has. ``base`` itself is not replaced:
    calls outside ``use`` still run on it (or on the process runtime), with the active policy's quotas and
    eviction, which live in the shared store, but its own rules. So a replica runs each request inside
    ``use``.
    """

    def __init__(self, base: CacheRuntime) -> None:
        if not isinstance(base, CacheRuntime):
            raise TypeError(f"RolloutRuntimes() takes a CacheRuntime, got {type(base).__qualname__}")
        self._arms = _Arms(None, replace(base, arm="active"))
        self._lock = threading.Lock()  # one apply at a time; tally updates
        self._tally = _Tally(None)
        self._counters: dict[tuple[str, str, str], Any] = {}  # label values -> prometheus child

    @property
    def rollout(self) -> Rollout | None:
        """The rollout in force (None before the first ``apply``)."""
        return self._arms.rollout

    @property
    def active(self) -> CacheRuntime:
        return self._arms.active

    @property
    def canary(self) -> CacheRuntime | None:
        return self._arms.canary

    @property
    def shadow(self) -> CacheRuntime | None:
        return self._arms.shadow

    def apply(self, rollout: Rollout) -> None:
        """Put ``rollout`` in force: the active policy activated on the store (rules, quotas, eviction), the
        canary's and the shadow's rules beside it. Every policy is checked before anything changes, so one
        this store cannot enforce raises ``StoreConfigError`` and leaves the previous arms in force. An arm
        whose policy did not change keeps its runtime, and so its memoised plans."""
        if not isinstance(rollout, Rollout):
            raise TypeError(f"apply() takes a Rollout, got {type(rollout).__qualname__}")
        if not 0.0 <= rollout.fraction <= 1.0:
            raise ValueError(f"canary fraction {rollout.fraction!r} is not between 0 and 1")
        with self._lock:
            arms = self._arms
            for policy in (rollout.active, rollout.canary, rollout.shadow):
                check_policy(policy, arms.active.config)
            # activate() is all or nothing too (it raises before changing anything); nothing after it fails.
            active = arms.active
            if active.policy != rollout.active:
                active = active.activate(rollout.active)
            canary = self._kept(arms.canary, rollout.canary, active, "canary")
            # Planning under the shadow creates the metric cells of its rules' L1 hits: it plans on metrics of
            # its own, so the served metrics show no series of a version that never served.
            shadow = self._kept(arms.shadow, rollout.shadow, replace(active, metrics=CacheMetrics()), "shadow")
            fraction = rollout.fraction if canary is not None else 0.0
            self._arms = _Arms(rollout, active, canary, fraction, shadow)
            ref = None if rollout.shadow is None else str(rollout.shadow.ref)
            if ref != self._tally.shadow:
                self._tally = _Tally(ref)

    @staticmethod
    def _kept(
        old: CacheRuntime | None, policy: Policy | None, beside: CacheRuntime, arm: str
    ) -> CacheRuntime | None:
        """The runtime deciding by ``policy``'s rules: ``old`` if it already does (it shares the store with
        every activation), else a new one built from ``beside``."""
        if policy is None:
            return None
        if old is not None and old.policy == policy:
            return old
        return beside.with_rules(policy, arm=arm)

    def arm_for(self, request_key: bytes | str) -> RolloutArm:
        """The arm of the request with ``request_key``: the canary on its fraction of keys (``canary_for``:
        stable by key, so one conversation stays on one version), else the active."""
        arms = self._arms
        if arms.canary is not None and canary_for(request_key, arms.fraction):
            return RolloutArm("canary", arms.canary)
        return RolloutArm("active", arms.active)

    @contextlib.contextmanager
    def use(self, request_key: bytes | str) -> Iterator[RolloutArm]:
        """Run the block's ``@cache_if`` calls on the arm of ``request_key`` (``use_runtime``)."""
        arm = self.arm_for(request_key)
        with use_runtime(arm.runtime):
            yield arm

    def compare(self, fn: Callable[..., Any], args: tuple = (), kwargs: Mapping[str, Any] | None = None,
                base: CacheRuntime | None = None) -> ShadowComparison | None:
        """Plan the call ``fn(*args, **kwargs)`` under ``base`` (default: ``current_runtime()``, the arm of
        an enclosing ``use``) and under the shadow, count whether they decide alike, and return the
        comparison. Nothing runs, is looked up, stored or emitted; plans are memoised as for calls. Call it
        in the call's tenant scope. None when there is no shadow, or when ``fn`` has a store of its own (its
        calls do not follow the rollout). ``TypeError`` for anything but a ``@cache_if`` function, or
        arguments that do not fit it."""
        arms = self._arms
        try:
            cached = fn.cached_function  # type: ignore[attr-defined]
        except AttributeError:
            cached = None
        if not isinstance(cached, CachedFunction):
            raise TypeError(f"compare() takes a @cache_if function, got {fn!r}")
        if arms.shadow is None or cached.runtime is not None:
            return None
        kwargs = dict(kwargs or {})
        base_plan = cached.contract.plan(base or current_runtime(), args, kwargs)
        shadow_plan = cached.contract.plan(arms.shadow, args, kwargs)
        comparison = ShadowComparison(base_plan.rule, shadow_plan.rule, _differences(base_plan, shadow_plan))
        labels = (comparison.base_rule, comparison.shadow_rule, "true" if comparison.agree else "false")
        with self._lock:
            if self._arms.shadow is arms.shadow:  # not a comparison of a shadow replaced meanwhile
                self._tally.add(comparison)
            counter = self._counters.get(labels)
            if counter is None:
                counter = self._counters[labels] = arms.active.metrics.shadow_decisions.labels(*labels)
        counter.inc()
        return comparison

    def shadow_tally(self) -> dict[str, Any]:
        """The comparisons counted for the shadow in force since it was applied, as plain data: ``shadow``
        (its ref, or None), ``compared``, ``agreed``, ``differed`` (part -> calls) and ``pairs`` (per base
        and shadow rule, calls agreed and differed)."""
        with self._lock:
            return self._tally.as_dict()
