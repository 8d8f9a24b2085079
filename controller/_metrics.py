"""Prometheus metrics per rule, tier and outcome.

Each ``CacheMetrics`` owns a ``CollectorRegistry`` (pass ``prometheus_client.REGISTRY`` to expose on the
process default). Labelled children are bound once and kept in dicts: ``Counter.labels()`` costs more than the
increment itself, and this runs on every request.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

_LATENCY_BUCKETS = (0.00001, 0.00005, 0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)


class CacheMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.requests = Counter(
            "evocache_requests", "Cache decisions by rule, tier and outcome.",
            ["rule", "tier", "outcome"], registry=self.registry,
        )
        self.latency = Histogram(
            "evocache_lookup_seconds", "Time spent in the cache per decision (function time excluded).",
            ["rule", "outcome"], buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.stored_bytes = Counter(
            "evocache_stored_bytes", "Payload bytes written, by rule and tier.",
            ["rule", "tier"], registry=self.registry,
        )
        self.tier_errors = Counter(
            "evocache_tier_errors", "Tier failures turned into misses or skipped writes.",
            ["tier", "op"], registry=self.registry,
        )
        self.tier_faults = Counter(
            "evocache_tier_faults", "Entries a tier dropped itself (corrupt payloads).",
            ["tier", "kind"], registry=self.registry,
        )
        self._req: dict[tuple[str, str, str], Counter] = {}
        self._lat: dict[tuple[str, str], Histogram] = {}

    def record(self, rule: str, tier: str | None, outcome: str, seconds: float) -> None:
        key = (rule, tier or "", outcome)
        child = self._req.get(key)
        if child is None:
            child = self._req[key] = self.requests.labels(*key)
        child.inc()
        lkey = (rule, outcome)
        hist = self._lat.get(lkey)
        if hist is None:
            hist = self._lat[lkey] = self.latency.labels(*lkey)
        hist.observe(seconds)

    def stored(self, rule: str, tier: str, size: int) -> None:
        self.stored_bytes.labels(rule, tier).inc(size)

    def tier_error(self, tier: str, op: str, _exc: BaseException | None = None) -> None:
        self.tier_errors.labels(tier, op).inc()

    def tier_fault(self, tier: str, kind: str) -> None:
        self.tier_faults.labels(tier, kind).inc()

    def value(self, name: str, **labels: str) -> float:
        """A sample's current value (0.0 when never set): for reports and tests."""
        return self.registry.get_sample_value(name, labels) or 0.0

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
