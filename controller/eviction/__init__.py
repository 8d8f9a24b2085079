"""evocache.controller.eviction: eviction policies and their registry.

One policy = one small class making one decision (see ``_base.EvictionPolicy``). The registry maps the names a
policy document uses (``eviction: {l1: s3fifo}``) to classes; ``make_eviction_policy`` is the one place a name
becomes a policy.
"""

from __future__ import annotations

import inspect
from typing import Any

from ..errors import StoreConfigError
from ._arc import ARCPolicy
from ._base import Clock, EntryInfo, EvictionPolicy
from ._learned import LearnedPolicy, LearnedStats
from ._lfu import LFUPolicy
from ._lookahead import LookaheadPolicy, QueuedRequest
from ._lru import LRUPolicy
from ._lruk import LRUKPolicy
from ._model import LearnedModel, LearnedModelError, TrainingWindow
from ._s3fifo import S3FIFOPolicy
from ._weighted import WeightedPolicy

__all__ = [
    "ARCPolicy",
    "EVICTION_POLICIES",
    "Clock",
    "EntryInfo",
    "EvictionPolicy",
    "LFUPolicy",
    "LearnedModel",
    "LearnedModelError",
    "LearnedPolicy",
    "LearnedStats",
    "LookaheadPolicy",
    "LRUKPolicy",
    "LRUPolicy",
    "QueuedRequest",
    "S3FIFOPolicy",
    "TrainingWindow",
    "WeightedPolicy",
    "make_eviction_policy",
]

EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (LRUPolicy, LFUPolicy, LRUKPolicy, S3FIFOPolicy, ARCPolicy, WeightedPolicy,
                             LearnedPolicy, LookaheadPolicy)
}
"""Policy name -> class."""


def make_eviction_policy(
    name: str, *, capacity: int | None = None, background: bool = False, **kwargs: Any
) -> EvictionPolicy:
    """A new policy of the registered ``name``, built with ``kwargs`` (``clock``, ``rng``, its own options).

    ``capacity`` is the owner's capacity in bytes. An owner always knows it and may always pass it; it reaches
    only the classes whose constructor takes a ``capacity`` (those that size their structure in bytes, like
    S3-FIFO's queues and ARC's lists); the others have no use for it. ``background`` likewise reaches only the
    classes that take it: an owner on a request path passes True so that a learned policy trains on its own
    thread, never inside a request (replay leaves it False: inline training is deterministic).

    Raises ``StoreConfigError`` naming the known policies for an unknown name; an option the class does not
    take raises ``TypeError`` and a bad value ``ValueError``, from the class itself.
    """
    try:
        cls = EVICTION_POLICIES[name]
    except KeyError:
        known = ", ".join(sorted(EVICTION_POLICIES))
        raise StoreConfigError(f"unknown eviction policy {name!r}; known: {known}") from None
    if capacity is not None and "capacity" in inspect.signature(cls).parameters:
        kwargs["capacity"] = capacity
    if background and "background" in inspect.signature(cls).parameters:
        kwargs["background"] = True
    return cls(**kwargs)
