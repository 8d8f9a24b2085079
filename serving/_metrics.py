"""One Prometheus exposition for every replica: each replica's samples, labelled with its ``replica`` id.

Each model replica exposes its own ``CacheMetrics`` registry; ``/metrics`` on the ingress serves them all at
once. Concatenating expositions would repeat ``# HELP``/``# TYPE`` lines and break parsers, so the texts are
parsed (prometheus_client's own parser), merged by metric family with a ``replica`` label added to every sample,
and rendered once.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

REPLICA_LABEL = "replica"


class _Merged(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._families


def merge_expositions(parts: Mapping[str, bytes]) -> bytes:
    """The expositions in ``parts`` (replica id -> text) as one, each sample labelled with its replica."""
    merged: dict[str, Metric] = {}
    for replica, text in sorted(parts.items()):
        for family in text_string_to_metric_families(text.decode("utf-8", errors="replace")):
            into = merged.get(family.name)
            if into is None:
                into = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for s in family.samples:
                labels = {**s.labels, REPLICA_LABEL: replica}
                into.samples.append(Sample(s.name, labels, s.value, s.timestamp, s.exemplar))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(list(merged.values())))
    return generate_latest(registry)
