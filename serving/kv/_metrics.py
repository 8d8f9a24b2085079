"""The KV prefix cache's Prometheus metrics, on a replica's registry (the runtime's ``CacheMetrics.registry``, so
its exposition and the deployment's ``/metrics`` merge carry them with the rest).

Per request, from its ``KvUsage`` once the model ran (``observe``): tokens reused per tier and recomputed, the
seconds spent loading blocks from L2/L3 (a histogram over the requests that read a lower tier), the seconds the
prefetch spent and the part of them it hid while the request waited (their ratio is the hidden fraction), and
why the first block missed. Read from the cache when scraped (``_HeldCollector``): L1 bytes, L1 evictions, and
blocks lost to a failing tier or to a failed check. ``window`` closes a reuse-rate window
(``KvPrefixCache.reuse_rate``) and sets its gauge; the deployment's housekeeping calls it periodically.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ._cache import KvPrefixCache, KvUsage
from ._reasons import MISS_REASONS

TIERS = ("l1", "l2", "l3")
LOAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _HeldCollector(Collector):
    """What the cache keeps count of itself, read at scrape time: nothing is added to its paths."""

    def __init__(self, cache: KvPrefixCache) -> None:
        self.cache = cache

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        l1 = self.cache.l1
        used = GaugeMetricFamily("evocache_kv_l1_bytes", "Bytes of KV blocks held in the replica's L1 "
                                 "(on the model's device).")
        used.add_metric([], l1.used)
        yield used
        evictions = CounterMetricFamily("evocache_kv_l1_evictions", "KV blocks evicted from L1.")
        evictions.add_metric([], l1.evictions)
        yield evictions
        errors = CounterMetricFamily("evocache_kv_block_errors", "KV block reads or writes lost to a failing "
                                     "tier (tier-error) or blocks dropped for failing their checks (corrupt).",
                                     labels=["kind"])
        errors.add_metric(["tier-error"], self.cache.lower.errors)
        errors.add_metric(["corrupt"], self.cache.lower.corrupt)
        yield errors


class KvMetrics:
    """The KV metrics of one replica's ``cache``, registered on ``registry`` (see the module docstring)."""

    def __init__(self, cache: KvPrefixCache, registry: CollectorRegistry) -> None:
        self.cache = cache
        self.reused = Counter("evocache_kv_reused_tokens", "Prompt tokens served from cached keys and values, "
                              "by the tier their blocks came from.", ["tier"], registry=registry)
        for tier in TIERS:
            self.reused.labels(tier)
        self.recomputed = Counter("evocache_kv_recomputed_tokens", "Prompt tokens the model computed on "
                                  "requests that ran with the KV cache present.", registry=registry)
        self.load = Histogram("evocache_kv_load_seconds", "Seconds a request spent loading its blocks from "
                              "L2/L3 while it held the model (requests that read a lower tier).",
                              buckets=LOAD_BUCKETS, registry=registry)
        self.prefetch = Counter("evocache_kv_prefetch_seconds", "Seconds the prefetch spent loading waiting "
                                "requests' blocks from L2/L3.", registry=registry)
        self.hidden = Counter("evocache_kv_prefetch_hidden_seconds", "Seconds of prefetch that overlapped the "
                              "request's wait for the model (hidden from its latency).", registry=registry)
        self.misses = Counter("evocache_kv_misses", "Requests whose prompt's first uncached block missed, by "
                              f"why ({', '.join(MISS_REASONS)}; a prompt another tenant sent counts as "
                              "never-seen).", ["reason"], registry=registry)
        self.reuse_rate = Gauge("evocache_kv_reuse_rate", "Share of the KV blocks accessed in the last window "
                                "that were accessed more than once.", registry=registry)
        registry.register(_HeldCollector(cache))

    def observe(self, usage: KvUsage) -> None:
        for tier, tokens in usage.reused.items():
            if tokens:
                self.reused.labels(tier).inc(tokens)
        if usage.recomputed:
            self.recomputed.inc(usage.recomputed)
        if usage.load_ms > 0:
            self.load.observe(usage.load_ms / 1000.0)
        if usage.prefetch_ms > 0:
            self.prefetch.inc(usage.prefetch_ms / 1000.0)
            self.hidden.inc(usage.hidden_ms / 1000.0)
        if usage.miss:
            self.misses.labels(usage.miss).inc()

    def window(self) -> float:
        """Close the reuse-rate window: the rate of the accesses since the last call, also set on the gauge."""
        rate = self.cache.reuse_rate()
        self.reuse_rate.set(rate)
        return rate
