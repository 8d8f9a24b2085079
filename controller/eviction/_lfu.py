"""Least frequently used, with dynamic aging (LFU-DA)."""

from __future__ import annotations

from collections.abc import Hashable

from ._priority import AgingPolicy


class LFUPolicy(AgingPolicy):
    """LFU-DA: evicts the lowest ``L + accesses``, the most stale first among equals.

    ``accesses`` counts the insertion and every hit; ``L`` is the priority of the last evicted key (see
    ``AgingPolicy``), which is what lets a key that was hot once but is no longer hit be evicted eventually.
    Dynamic aging rather than periodic halving because it needs no period to tune and costs nothing per
    operation beyond the heap update.
    """

    name = "lfu"

    def score(self, key: Hashable) -> float:
        return self._hits[key]
