"""LRU-K (O'Neil, O'Neil and Weikum, SIGMOD '93)."""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Hashable

from ._base import Clock
from ._priority import PriorityPolicy


class LRUKPolicy(PriorityPolicy):
    """Evicts the key whose K-th most recent access is oldest (largest backward K-distance).

    Keys with fewer than ``k`` accesses (insertion included) have an infinite K-distance and go first, least
    recently used first among them (the paper's subsidiary LRU). Access times are the logical counter of
    ``PriorityPolicy``, so order is exact and replay deterministic. History is kept only for held keys (no
    retained-information period): a key that comes back starts again with one access. ``k=1`` is plain LRU.
    """

    name = "lruk"

    def __init__(
        self, *, k: int = 2, clock: Clock = time.monotonic, rng: random.Random | None = None
    ) -> None:
        if isinstance(k, bool) or not isinstance(k, int):
            raise TypeError(f"k must be an int, not {type(k).__name__}")
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        super().__init__(clock=clock, rng=rng)
        self.k = k
        self._history: dict[Hashable, deque[int]] = {}  # the last k access ticks, oldest first

    def priority(self, key: Hashable) -> tuple[int, int]:
        history = self._history[key]
        if len(history) < self.k:
            return (0, history[-1])
        return (1, history[0])

    def _record(self, key: Hashable, *, first: bool) -> None:
        if first:
            self._history[key] = deque(maxlen=self.k)
        self._history[key].append(self._tick)

    def _forget(self, key: Hashable) -> None:
        del self._history[key]
