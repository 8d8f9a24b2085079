"""Prometheus metrics per rule, tier and outcome.

Decisions are counted in plain dicts and exposed through a custom collector: a labelled prometheus ``Counter``
takes a lock and a label lookup per increment, which would cost more than an L1 hit itself. The collector
turns the dicts into ``evocache_requests_total`` and ``evocache_lookup_seconds`` when scraped. Increments are
not locked: under the GIL a lost update needs a thread switch between the read and the write of one dict item,
so a count can be short by a few under heavy multi-threaded load, never over.

Rare events (tier errors, dropped entries, SLO breaker transitions) use ordinary prometheus counters and
gauges.
Each ``CacheMetrics`` owns a ``CollectorRegistry`` unless given one (``prometheus_client.REGISTRY`` exposes on
the process default).
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.00001, 0.00005, 0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)


# Cells of one (rule, tier, outcome): a count per bucket (bisect_left index; the last one is +Inf), then the
# sum of seconds. Their total is the decision count, so one structure serves the counter and the histogram.
_SUM = len(LATENCY_BUCKETS) + 1


class _DecisionCollector(Collector):
    def __init__(self) -> None:
        self.cells: dict[tuple[str, str, str], list[float]] = {}
        self.stored: dict[tuple[str, str], int] = {}

    def collect(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        requests = CounterMetricFamily(
            "evocache_requests", "Cache decisions by rule, tier and outcome.", labels=["rule", "tier", "outcome"]
        )
        hist = HistogramMetricFamily(
            "evocache_lookup_seconds", "Time spent in the cache per decision (function time excluded).",
            labels=["rule", "tier", "outcome"],
        )
        for labels, cells in list(self.cells.items()):
            cumulative, buckets = 0.0, []
            for bound, n in zip((*map(str, LATENCY_BUCKETS), "+Inf"), cells[:_SUM], strict=True):
                cumulative += n
                buckets.append((bound, cumulative))
            requests.add_metric(list(labels), cumulative)
            hist.add_metric(list(labels), buckets, cells[_SUM])
        yield requests
        yield hist
        stored = CounterMetricFamily(
            "evocache_stored_bytes", "Payload bytes written, by rule and tier.", labels=["rule", "tier"]
        )
        for labels, n in list(self.stored.items()):
            stored.add_metric(list(labels), n)
        yield stored


class CacheMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._decisions = _DecisionCollector()
        self.registry.register(self._decisions)
        # Read and updated in place by the L1 hit path (controller._cache_if), which inlines `record`.
        self.decisions = self._decisions.cells
        self.tier_errors = Counter(
            "evocache_tier_errors", "Tier failures turned into misses or skipped writes.",
            ["tier", "op"], registry=self.registry,
        )
        self.tier_faults = Counter(
            "evocache_tier_faults", "Entries dropped as corrupt or undecodable, by tier.",
            ["tier", "kind"], registry=self.registry,
        )
        # Counted by controller._rollout.RolloutRuntimes.compare, off the L1 hit path.
        self.shadow_decisions = Counter(
            "evocache_shadow_decisions", "Calls planned under the shadow policy beside the policy that served "
            "them, by the rule of each and whether they decided alike.",
            ["base_rule", "shadow_rule", "agree"], registry=self.registry,
        )

        # Set by controller._slo on each breaker transition, off the request path.
        # A tenant's series lives while the rule keeps its breaker (controller._slo.MAX_TENANT_BREAKERS per
        # rule), so the tenant label is bounded; the counter has no tenant label, as it is never removed.
        self.slo_states = Gauge(
            "evocache_slo_state", "SLO breaker state per policy, rule and tenant namespace (ns; empty: the "
            "rule-wide state): 0 closed, 1 half-open, 2 open (from the breaker's first transition).",
            ["policy", "rule", "ns"], registry=self.registry,
        )
        self.slo_transitions = Counter(
            "evocache_slo_transitions", "SLO breaker transitions, by policy, rule, scope (a tenant's "
            "breaker, or the rule-wide state) and the state entered.",
            ["policy", "rule", "scope", "state"], registry=self.registry,
        )

    def record(self, rule: str, tier: str | None, outcome: str, seconds: float) -> None:
        # Inlined on the request path (controller._cache_if: CachedFunction._emit and the L1 hit path): keep
        # them in step.
        labels = (rule, tier or "", outcome)
        cells = self.decisions.get(labels) or self.cells(labels)
        cells[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        cells[-1] += seconds

    def cells(self, labels: tuple[str, str, str]) -> list[float]:
        """The cells of ``(rule, tier, outcome)``: a count per bucket (the last is +Inf), then the sum."""
        return self.decisions.setdefault(labels, [0.0] * (_SUM + 1))

    def stored(self, rule: str, tier: str, size: int) -> None:
        stored = self._decisions.stored
        stored[(rule, tier)] = stored.get((rule, tier), 0) + size

    def tier_error(self, tier: str, op: str, _exc: BaseException | None = None) -> None:
        self.tier_errors.labels(tier, op).inc()

    def tier_fault(self, tier: str, kind: str) -> None:
        self.tier_faults.labels(tier, kind).inc()

    def slo_transition(
        self, policy: str, rule: str, ns: str, scope: str, state: str, value: int | None
    ) -> None:
        """A breaker entered ``state``; its gauge is set to ``value``, or dropped for None (so is it)."""
        self.slo_transitions.labels(policy, rule, scope, state).inc()
        if value is None:
            self.slo_forget(policy, rule, ns)
        else:
            self.slo_states.labels(policy, rule, ns).set(value)

    def slo_forget(self, policy: str, rule: str, ns: str) -> None:
        """Drop a breaker's state gauge (its policy left, or it was dropped; its transitions stay counted)."""
        with contextlib.suppress(KeyError):
            self.slo_states.remove(policy, rule, ns)

    def value(self, name: str, **labels: str) -> float:
        """A sample's current value (0.0 when never set): for reports and tests."""
        return self.registry.get_sample_value(name, labels) or 0.0

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
