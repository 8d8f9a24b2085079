"""evocache.controller.eviction: eviction policies and their registry.

One policy = one small class making one decision (see ``_base.EvictionPolicy``). The registry maps the names a
policy document uses (``eviction: {l1: s3fifo}``) to classes; ``make_eviction_policy`` is the one place a name
becomes a policy: it describes the owner in a ``BuildContext`` and the class builds itself from it
(``EvictionPolicy.build``).
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from ..errors import StoreConfigError

from ._arc import ARCPolicy
from ._base import BuildContext, Clock, EntryInfo, EvictionPolicy
from ._learned import LearnedBase, LearnedStats, LearnedTraining
from ._learned_classify import LearnedPolicy
from ._learned_rank import LearnedRankPolicy
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
    "BuildContext",
    "Clock",
    "EntryInfo",
    "EvictionPolicy",
    "LFUPolicy",
    "LearnedBase",
    "LearnedModel",
    "LearnedModelError",
    "LearnedPolicy",
    "LearnedRankPolicy",
    "LearnedStats",
    "LearnedTraining",
    "LookaheadPolicy",
    "LRUKPolicy",
    "LRUPolicy",
    "QueuedRequest",
    "S3FIFOPolicy",
    "TrainingWindow",
    "WeightedPolicy",
    "make_eviction_policy",
    "start_from_model",
]

EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (LRUPolicy, LFUPolicy, LRUKPolicy, S3FIFOPolicy, ARCPolicy, WeightedPolicy,
                             LearnedPolicy, LearnedRankPolicy, LookaheadPolicy)
}
"""Policy name -> class."""


def make_eviction_policy(
    name: str,
    *,
    capacity: int | None = None,
    background: bool = False,
    clock: Clock = time.monotonic,
    rng: random.Random | None = None,
    **options: Any,
) -> EvictionPolicy:
    """A new policy of the registered ``name`` for an owner of ``capacity`` (in the unit of ``EntryInfo.size``;
    None: not told), with ``options``, the class's own keywords.

    An owner always knows its capacity and may always pass it; it reaches the classes that size a structure by
    it (S3-FIFO's queues, ARC's lists, a learned policy's admission). ``background``: True for an owner on a
    request path, so that a learned policy trains on its own thread, never inside a request (replay leaves it
    False: inline training is deterministic). ``rng`` defaults to ``random.Random(0)``.

    Raises ``StoreConfigError`` naming the known policies for an unknown name; an option the class does not
    take raises ``TypeError`` and a bad value ``ValueError``, from the class itself.
    """
    context = BuildContext(EVICTION_POLICIES, capacity=capacity, background=background, clock=clock,
                           rng=rng if rng is not None else random.Random(0))
    return context.build(name, **options)


def start_from_model(policy: EvictionPolicy, path: Path | None, ref: str) -> EvictionPolicy:
    """``policy`` (just built for the policy document ``ref``) started from the trained model in ``path``
    (``eviction.model``; None: as it is). Raises ``StoreConfigError`` naming ``eviction.model`` for a file that
    is missing, unreadable or not a model this policy can use, after closing ``policy``: nothing is left
    running."""
    if path is None:
        return policy
    try:
        if not isinstance(policy, LearnedBase):
            raise LearnedModelError(f"{type(policy).__name__} takes no trained model")
        policy.load_model(path)
    except (OSError, LearnedModelError) as exc:
        policy.close()
        raise StoreConfigError(f"policy {ref}: eviction.model: {exc}") from exc
    return policy
