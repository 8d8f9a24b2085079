"""The learned policy that ranks (LRB): at each eviction, the ``sample`` least recently used leaves are scored
in one batch and the one least likely to return goes.

One of those candidates, drawn with the policy's rng, is taken as a training sample per access. On the Mooncake
trace it ranks about as well as LRU, below the classifying ``LearnedPolicy`` (docs/eviction.md, "The learned
policy"); it stays to compare with: ``evocache bench eviction --policies learned,learned-rank``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Hashable
from itertools import islice

from ._base import Clock, EntryInfo, EvictionPolicy
from ._learned import LearnedBase, LearnedTraining
from ._model import LearnedModel

TARGETS = ("reuse", "distance")


class LearnedRankPolicy(LearnedBase):
    """Evicts, of the ``sample`` least recently used keys (leaves first), the one the model deems least likely
    to be accessed again within ``horizon`` times the number of objects held.

    Options (besides ``LearnedBase``'s): ``target``, what the model learns: ``reuse`` (default), whether the
    object returns within the horizon, or ``distance`` (LRB's), minus the log distance to its next access
    censored at the horizon. With ``admission``, a missed object is bypassed when the cache is full and it is
    less likely to return than the victim.

    Costs: O(1) Python work, one feature row and a scan of ``sample`` keys per access; one batched prediction
    over ``sample`` rows per eviction or admission decision; a training of ``rounds`` trees on ``window`` rows
    per retraining.
    """

    name = "learned-rank"

    def __init__(
        self,
        *,
        target: str = "reuse",
        training: LearnedTraining = LearnedTraining(),
        fallback: EvictionPolicy | None = None,
        model: LearnedModel | None = None,
        sample: int = 64,
        leaves_first: bool = True,
        admission: bool = False,
        capacity: int | None = None,
        background: bool = False,
        clock: Clock = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        from ._history import lowest  # numpy: only when a learned policy is built

        if target not in TARGETS:
            raise ValueError(f"target must be 'reuse' or 'distance', got {target!r}")
        self.target = target
        self._lowest = lowest
        self._named: tuple[Hashable, str | None, float] | None = None  # (victim, ns asked, its probability)
        super().__init__(training=training, fallback=fallback, model=model, sample=sample,
                         leaves_first=leaves_first, admission=admission, capacity=capacity, background=background,
                         clock=clock, rng=rng)

    def _notified(self) -> None:
        self._named = None

    # -- decisions ----------------------------------------------------------------------------------------------

    def _victim(self, model: LearnedModel, ns: str | None) -> Hashable:
        named = self._named
        if named is not None and named[1] == ns:
            return named[0]
        key, p, _ = self._score(model, ns, None)
        self._named = (key, ns, p)
        return key

    def _declines(self, model: LearnedModel, key: Hashable) -> bool:
        slot = self._hist.slot.get(key)
        if slot is None:  # no history (no announced access): nothing to compare
            return False
        victim, p_victim, p_new = self._score(model, None, slot)
        self._named = (victim, None, p_victim)
        return p_new < p_victim

    def _score(self, model: LearnedModel, ns: str | None, extra: int | None) -> tuple[Hashable, float, float]:
        """The ``sample`` least recently used keys (of ``ns``; leaves first) scored in one batch, with the slot
        ``extra`` appended: the least likely to return (ties: accessed longest ago), its probability, and
        ``extra``'s."""
        candidates = self._window(ns)
        if not candidates:
            raise KeyError("no key held" if ns is None else f"no key held in namespace {ns!r}")
        hist = self._hist
        slots = [hist.slot[k] for k in candidates]
        if ns is not None and self.leaves_first:
            leaves = [i for i, s in enumerate(slots) if not hist.children[s]]
            if leaves:
                candidates = [candidates[i] for i in leaves]
                slots = [slots[i] for i in leaves]
        n = len(candidates)
        if extra is not None:
            slots.append(extra)
        best, p = self._lowest(model.predict, hist, slots, self._tick, n, self._columns)
        return candidates[best], p[best], p[n] if extra is not None else 0.0

    def _window(self, ns: str | None) -> list[Hashable]:
        """The eviction candidates: the ``sample`` least recently used keys (of ``ns``), leaves first."""
        order = self._order if ns is None else self._by_ns.get(ns)
        if not order:
            return []
        if ns is None and self.leaves_first and self._leaves:
            order = self._leaves
        return list(islice(order, self.sample))

    # -- learning -------------------------------------------------------------------------------------------------

    def _learn(self, key: Hashable, info: EntryInfo | None, slot: int, tick: int, horizon: float) -> None:
        window = self._window(None)
        if window:
            other = window[self.rng.randrange(len(window))]
            hist = self._hist
            self._samples.add([other], hist.rows([hist.slot[other]], tick), tick, horizon)
        if tick % self._retrain_every == 0:
            self._retrain()
