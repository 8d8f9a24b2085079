"""The learned policy that classifies (after Hawkeye): each object is sorted as it is accessed, recency orders
each class.

Every access is a training sample (the accessed object's features as of the access, labelled by its next
access), and the model classifies the accessed object as it is accessed: *averse* when its probability of
returning within the horizon is below ``averse_below`` times the reuse rate of the model's training window,
*friendly* otherwise. Victims are the least recently used averse leaf while there is one, else the least
recently used friendly leaf. The model only sorts objects into two classes with a margin, at the moment it
knows the most about them (what the request that touched them looks like).

An access whose context carries the request's output length (``EntryInfo.req_out``, known when the request
completes) is classified at that completion instead: the request's blocks stay friendly while it is in flight
and are classified in one batch when the next request begins (the owner serves one request at a time, as
replay does). What the model learns on the Mooncake trace (which requests leave chains that never return:
long generations, a short new tail on a known document) is in docs/eviction.md, "What it can predict".
"""

from __future__ import annotations

import heapq
import random
import time
from collections import OrderedDict
from collections.abc import Hashable
from itertools import islice
from typing import TYPE_CHECKING

from ..errors import LearnedModelError
from ._base import Clock, EntryInfo, EvictionPolicy
from ._learned import NOBODY, LearnedBase, LearnedTraining
from ._model import LearnedModel

if TYPE_CHECKING:
    import numpy as np

AVERSE, FRIENDLY = 0, 1


class LearnedPolicy(LearnedBase):
    """Evicts the least recently used object the model classified averse (unlikely to return within the
    horizon), else the least recently used friendly one, leaves of prefix chains first.

    Options (besides ``LearnedBase``'s): ``averse_below``, the margin: averse is a probability below
    ``averse_below`` times the reuse rate of the model's training window (default 0.6). With ``admission``, a
    missed object classified averse is bypassed when the cache is full. Admission is off by default: every
    configuration measured with it lost hits (docs/eviction.md, "The learned policy").

    Costs: O(1) Python work and one feature row per access, plus a one-row prediction for an access
    classified on the spot; O(log held) amortised per eviction (each class's leaves are in a heap by last
    access); a training of ``rounds`` trees on ``window`` rows per retraining.
    """

    name = "learned"

    def __init__(
        self,
        *,
        averse_below: float = 0.6,
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
        if isinstance(averse_below, bool) or not (
                isinstance(averse_below, int | float) and 0 <= averse_below < float("inf")):
            raise ValueError(f"averse_below must be a finite number >= 0, got {averse_below!r}")
        self.averse_below = float(averse_below)
        # Each held key's class; the keys of each class by last access; and per class a heap of (last access,
        # tie-breaker, key) over its leaves, entries going stale when the key is accessed again, changes class,
        # gains a child or leaves (checked when they reach the top).
        self._class: dict[Hashable, int] = {}
        self._by_class: tuple[OrderedDict[Hashable, None], OrderedDict[Hashable, None]] = (
            OrderedDict(), OrderedDict())
        self._leaf_heaps: tuple[list[tuple[float, int, Hashable]], list[tuple[float, int, Hashable]]] = ([], [])
        self._pushes = 0  # the tie-breaker: keys need not be comparable
        self._in_flight: dict[Hashable, np.ndarray] = {}  # the request in flight's blocks: their rows at access
        self._in_flight_req = -1
        self._classified: tuple[Hashable, int] = (NOBODY, FRIENDLY)  # the latest access's key and class
        super().__init__(training=training, fallback=fallback, model=model, sample=sample,
                         leaves_first=leaves_first, admission=admission, capacity=capacity, background=background,
                         clock=clock, rng=rng)

    # -- hooks on the held keys -------------------------------------------------------------------------------

    def _hit(self, key: Hashable) -> None:
        now = self._class_of(key)
        del self._by_class[self._class[key]][key]
        self._class[key] = now
        self._by_class[now][key] = None
        self._push_leaf(key)

    def _inserted(self, key: Hashable, leaf: bool) -> None:
        cls = self._class[key] = self._class_of(key)
        self._by_class[cls][key] = None
        if leaf:
            self._push_leaf(key)

    def _removed(self, key: Hashable) -> None:
        del self._by_class[self._class.pop(key)][key]

    def _leaf(self, key: Hashable) -> None:
        self._push_leaf(key)  # at its own last access: it may be far more recent than its child

    # -- decisions ----------------------------------------------------------------------------------------------

    def _victim(self, model: LearnedModel, ns: str | None) -> Hashable:
        """The least recently used averse leaf, else the least recently used friendly leaf (without
        ``leaves_first``: the least recently used averse key, else friendly key); within a namespace, the same
        among its ``sample`` least recently used keys (leaves first, then any)."""
        if ns is None:
            if not self._order:
                raise KeyError("no key held")
            if not self.leaves_first:
                return next(iter(self._by_class[AVERSE] or self._by_class[FRIENDLY]))
            for cls in (AVERSE, FRIENDLY):
                key = self._top_leaf(cls)
                if key is not NOBODY:
                    return key
            return next(iter(self._leaves or self._order))
        order = self._by_ns.get(ns)
        if not order:
            raise KeyError(f"no key held in namespace {ns!r}")
        classes = self._class
        children, slot = self._hist.children, self._hist.slot
        first = first_leaf = None
        for key in islice(order, self.sample):
            if first is None:
                first = key
            if not children[slot[key]]:
                if not classes[key]:
                    return key
                if first_leaf is None:
                    first_leaf = key
        return first_leaf if first_leaf is not None else first

    def _declines(self, model: LearnedModel, key: Hashable) -> bool:
        # An owner that announced no access (the L1 tier) leaves nothing classified for it: admit.
        return self._classified[0] == key and self._classified[1] == AVERSE

    # -- learning -------------------------------------------------------------------------------------------------

    def _learn(self, key: Hashable, info: EntryInfo | None, slot: int, tick: int, horizon: float) -> None:
        if self._in_flight and info is not None and info.req >= 0 and info.req != self._in_flight_req:
            self._complete()  # another request's block: the one in flight completed
        row = self._hist.rows([slot], tick)
        self._samples.add([key], row, tick, horizon)
        if tick % self._retrain_every == 0:
            self._retrain()
        cls = FRIENDLY
        if info is not None and info.req_out >= 0 and info.req >= 0:
            # The request's output length is known when it completes: its blocks (in use until then) are
            # friendly for now and classified at completion, with the rest of the request (_complete).
            self._in_flight_req = info.req
            self._in_flight[key] = row
        else:
            model = self._usable_model()
            if model is not None and self._predict(model, row)[0] < self._cut(model):
                cls = AVERSE
                self._averse += 1
        self._classified = (key, cls)

    def _cut(self, model: LearnedModel) -> float:
        window = model.window
        return self.averse_below * window.positives / max(window.samples, 1)

    def _complete(self) -> None:
        """The request in flight completed (the next one begins: the owner serves one at a time, as replay
        does): classify its blocks still held, in one batch, now that its output length counts."""
        in_flight = self._in_flight
        if not in_flight:
            return
        self._in_flight = {}
        self._in_flight_req = -1
        model = self._usable_model()
        held = [k for k in in_flight if k in self._class]
        if model is None or not held:
            return
        import numpy as np

        p = self._predict(model, np.vstack([in_flight[k] for k in held]))
        cut = self._cut(model)
        for key, averse in zip(held, p < cut, strict=True):
            if averse:
                self._averse += 1
                if self._class[key]:
                    del self._by_class[FRIENDLY][key]
                    self._class[key] = AVERSE
                    self._by_class[AVERSE][key] = None
                    self._push_leaf(key)

    def _class_of(self, key: Hashable) -> int:
        """The class given to ``key`` at its latest access (friendly when it came with no usable model)."""
        latest, cls = self._classified
        return cls if latest == key else FRIENDLY

    # -- the leaf heaps -------------------------------------------------------------------------------------------

    def _push_leaf(self, key: Hashable) -> None:
        """Enter ``key`` (held, classified) in its class's leaf heap at its last access, if it is a leaf."""
        hist = self._hist
        s = hist.slot[key]
        if hist.children[s]:
            return
        heap = self._leaf_heaps[self._class[key]]
        self._pushes += 1
        heapq.heappush(heap, (hist.last[s], self._pushes, key))
        if len(heap) > 2 * len(self._held) + 1024:  # stale entries: rebuild from the live leaves
            self._rebuild_leaf_heaps()

    def _rebuild_leaf_heaps(self) -> None:
        hist = self._hist
        for cls, heap in enumerate(self._leaf_heaps):
            heap.clear()
            for key in self._by_class[cls]:
                s = hist.slot[key]
                if not hist.children[s]:
                    self._pushes += 1
                    heap.append((hist.last[s], self._pushes, key))
            heapq.heapify(heap)

    def _top_leaf(self, cls: int) -> Hashable:
        """The least recently used leaf of class ``cls`` (``NOBODY`` when it has none), stale entries popped."""
        heap, classes, hist = self._leaf_heaps[cls], self._class, self._hist
        while heap:
            last, _, key = heap[0]
            if classes.get(key) == cls:
                s = hist.slot[key]
                if not hist.children[s] and hist.last[s] == last:
                    return key
            heapq.heappop(heap)
        return NOBODY

    def _rebased(self, model: LearnedModel, tick: int) -> LearnedModel:
        """Refuses a regression model (``LearnedRankPolicy`` with ``target="distance"``): classifying compares
        a probability with the reuse rate."""
        if not model.forest.logistic:
            raise LearnedModelError(
                "the model is a regression (target='distance'); LearnedPolicy needs a classifier's probability"
            )
        return super()._rebased(model, tick)
