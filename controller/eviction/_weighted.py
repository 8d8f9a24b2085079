"""A cost-aware score: GDSF with the tenant's weight."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Hashable

from ._base import Clock
from ._priority import AgingPolicy


class WeightedPolicy(AgingPolicy):
    """Evicts the lowest ``H = L + weight**tenant_power * hits**frequency_power * cost / size**size_power``.

    - recency: through ``L`` (see ``AgingPolicy``): a key's ``H`` is fixed with the ``L`` of its last
      access, and ``L`` grows with every eviction, so keys not accessed lately fall behind; ties go to the
      older access;
    - frequency: ``hits`` counts the accesses, the insertion included;
    - saved cost: ``cost = max(saved_ms, min_saved_ms)``; the floor keeps entries of unknown cost (0 ms)
      comparable by frequency and size instead of all tying at ``L``;
    - size: bytes, at least 1; a large entry must save proportionally more to stay (GDSF's cost per byte);
    - tenant weight: ``EntryInfo.weight`` (policy ``tenants.<name>.weight``) scales a tenant's entries.

    With the defaults (all powers 1, ``min_saved_ms=1``) this is GDSF with cost = saved milliseconds, scaled
    by the tenant's weight. A power of 0 switches its factor off.
    """

    name = "weighted"

    def __init__(
        self,
        *,
        frequency_power: float = 1.0,
        size_power: float = 1.0,
        tenant_power: float = 1.0,
        min_saved_ms: float = 1.0,
        clock: Clock = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        for label, value in (
            ("frequency_power", frequency_power),
            ("size_power", size_power),
            ("tenant_power", tenant_power),
        ):
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{label} must be a finite number >= 0, got {value!r}")
        if not math.isfinite(min_saved_ms) or min_saved_ms <= 0:
            raise ValueError(f"min_saved_ms must be a finite number > 0, got {min_saved_ms!r}")
        super().__init__(clock=clock, rng=rng)
        self.frequency_power = frequency_power
        self.size_power = size_power
        self.tenant_power = tenant_power
        self.min_saved_ms = min_saved_ms

    def score(self, key: Hashable) -> float:
        info = self._infos[key]
        cost = max(info.saved_ms, self.min_saved_ms)
        weight = max(info.weight, 0.0) ** self.tenant_power
        return weight * self._hits[key] ** self.frequency_power * cost / max(info.size, 1) ** self.size_power
