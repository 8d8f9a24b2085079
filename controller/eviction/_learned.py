"""Learned eviction and admission (LRB, Song et al., NSDI '20; Hawkeye, Jain and Lin, ISCA '16; with the
context of KV prefix chains).

The policy learns, online, the probability that an object is accessed again within a horizon of
``horizon x (objects held)`` accesses (a relaxed Belady boundary: Belady keeps what returns soonest, and what
returns later than about the cache's turnover is what it gives up). An XGBoost classifier is retrained on the
latest ``window`` labelled samples every ``retrain_every`` accesses: inline (deterministic, for replay) or on
a background thread (production). Blocks of a prefix chain are eaten from the tail (``leaves_first``: a
prefix cache can only use a block whose parents it holds).

Two ways to decide (``decide``):

- ``classify`` (the default, after Hawkeye): every access is a training sample (the accessed object's
  features as of the access, labelled by its next access), and the model classifies the accessed object as
  it is accessed: *averse* when its probability of returning within the horizon is below ``averse_below``
  times the reuse rate of the model's training window, *friendly* otherwise. Victims are the least recently
  used averse leaf while there is one, else the least recently used friendly leaf. The model only sorts
  objects into two classes with a margin, at the moment it knows the most about them (what the request that
  touched them looks like); recency orders each class. An access whose context carries the request's output
  length (``EntryInfo.req_out``, known when the request completes) is classified at that completion instead:
  the request's blocks stay friendly while it is in flight and are classified in one batch when the next
  request begins (the owner serves one request at a time, as replay does). On the Mooncake trace what it learns
  is which requests leave chains that never return (long generations; a short new tail on a known document).
- ``rank`` (LRB): the ``sample`` least recently used leaves are scored in one batch at each eviction and the
  least likely to return goes; one of them is taken as a training sample per access. It ranked poorly where
  it decided (docs/notes/learned-eviction-policy-2026-11-29.md) and stays for comparison.

With ``admission`` (off by default), a missed object is bypassed when the cache is full and it is averse
(``classify``) or less likely to return than the victim (``rank``). Without a model (or with a stale one)
every decision is the configured heuristic's, which sees every notification. What the policy achieves
against LRU and Belady, and what did not work, is in docs/notes/learned-eviction-*.md.
"""

from __future__ import annotations

import heapq
import logging
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING

from ._base import Clock, EntryInfo, EvictionPolicy
from ._features import FEATURES, MONOTONE
from ._model import LearnedModel, LearnedModelError, TrainingWindow, train

if TYPE_CHECKING:
    import numpy as np

_NOBODY: Hashable = object()  # keys are arbitrary hashables, so None could be one
log = logging.getLogger("evocache.controller.eviction")
_SWEEP = 8  # history keys examined for forgetting per access


@dataclass(frozen=True, slots=True)
class LearnedStats:
    """Counters of a learned policy: ``accesses`` seen, models ``trained`` (and retrainings ``skipped``
    because the background trainer was still busy), training ``samples`` taken, misses ``bypassed``, and
    ``model_tick``, the access count at which the model in use started training (-1: none), ``auc``,
    the area under the ROC curve of the model in use on the samples of the latest training (data it had not
    seen: how well it ranks what happened since; NaN before two trainings), ``averse``, the accesses a
    model classified averse (``decide="classify"``), and ``failed``, trainings that raised (logged; the
    model in use stays, and the next retraining tries again)."""

    accesses: int
    trained: int
    skipped: int
    samples: int
    bypassed: int
    model_tick: int
    auc: float
    averse: int = 0
    failed: int = 0


class LearnedPolicy(EvictionPolicy):
    """Evicts (and, with ``admission`` and a ``capacity``, declines to admit) the objects a learned model deems
    least likely to be accessed again within ``horizon`` times the number of objects held.

    Options: ``fallback``, the registered heuristic used while no model is usable; ``retrain_every`` accesses;
    ``window``, the labelled samples a model is trained on; ``sample``, the candidates scored per eviction;
    ``rounds``, ``depth`` and ``threads`` of XGBoost (shallow trees: deeper ones learned the objects of the
    window by heart and ranked new candidates worse); ``monotone``, constrain the model to the known
    directions of ``_features.MONOTONE``; ``background``, train on a thread (production) instead of inline
    (replay); ``stale_after``, accesses after which a model's training start is too old and the heuristic
    decides again (default ``4 * retrain_every``); ``model``, a trained model to start with; ``capacity``,
    the owner's capacity in its size unit (admission needs it, to know when a miss would evict). Admission is
    off by default: on the Mooncake trace it lost hits (docs/notes).

    Costs: O(1) Python work, one feature row and a scan of ``sample`` keys per access; one batched
    prediction over ``sample`` rows per eviction or admission decision; a training of ``rounds`` trees on
    ``window`` rows per retraining.
    """

    name = "learned"
    uses_context = True

    def __init__(
        self,
        *,
        capacity: int | None = None,
        fallback: str = "lru",
        horizon: float = 2.0,
        retrain_every: int = 10_000,
        window: int = 100_000,
        sample: int = 64,
        rounds: int = 20,
        depth: int = 3,
        monotone: bool = False,
        target: str = "reuse",
        decide: str = "classify",
        averse_below: float = 0.6,
        features: Sequence[str] | None = None,
        threads: int = 1,
        background: bool = False,
        leaves_first: bool = True,
        admission: bool = False,
        stale_after: int | None = None,
        model: LearnedModel | None = None,
        clock: Clock = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        from . import make_eviction_policy  # the registry imports this module
        from ._history import History, Samples, auc, lowest, targets  # numpy: only when a learned policy is built

        for label, value in (("retrain_every", retrain_every), ("window", window), ("sample", sample),
                             ("rounds", rounds), ("depth", depth), ("threads", threads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{label} must be an int >= 1, got {value!r}")
        if not (isinstance(horizon, int | float) and 0 < horizon < float("inf")):
            raise ValueError(f"horizon must be a finite number > 0, got {horizon!r}")
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
            raise ValueError(f"capacity must be an int >= 1 or None, got {capacity!r}")
        chosen = FEATURES if features is None else tuple(features)
        unknown = [f for f in chosen if f not in FEATURES]
        if unknown or not chosen:
            raise ValueError(f"unknown features {unknown or '(none given)'}; known: {', '.join(FEATURES)}")
        if fallback == self.name:
            raise ValueError("fallback must be a heuristic, not 'learned' itself")
        if decide not in ("classify", "rank"):
            raise ValueError(f"decide must be 'classify' or 'rank', got {decide!r}")
        if not (isinstance(averse_below, int | float) and 0 <= averse_below < float("inf")):
            raise ValueError(f"averse_below must be a finite number >= 0, got {averse_below!r}")
        super().__init__(clock=clock, rng=rng)
        self.capacity = capacity
        self.horizon = float(horizon)
        self.retrain_every = retrain_every
        self.window = window
        self.sample = sample
        self.rounds = rounds
        self.depth = depth
        self.monotone = monotone
        if target not in ("reuse", "distance"):
            raise ValueError(f"target must be 'reuse' or 'distance', got {target!r}")
        if decide == "classify" and target != "reuse":
            raise ValueError("decide='classify' needs target='reuse' (a probability to compare with the reuse rate)")
        self.target = target
        self.classify = decide == "classify"
        self.averse_below = float(averse_below)
        self.features = chosen
        self._columns = None if chosen == FEATURES else [FEATURES.index(f) for f in chosen]
        self.threads = threads
        self.leaves_first = leaves_first
        self.admission = admission
        self.stale_after = 4 * retrain_every if stale_after is None else stale_after
        self.fallback = make_eviction_policy(
            fallback, capacity=capacity, clock=clock, rng=random.Random(self.rng.getrandbits(64))
        )
        self._hist = History()
        self._samples = Samples(window)
        self._lowest = lowest
        self._auc_of = auc
        self._targets = targets
        self._held: dict[Hashable, tuple[str, int, Hashable | None]] = {}  # key -> (ns, size, parent)
        # Held keys by last access, oldest first: overall, per namespace, and the leaves only.
        self._order: OrderedDict[Hashable, None] = OrderedDict()
        self._by_ns: dict[str, OrderedDict[Hashable, None]] = {}
        self._leaves: OrderedDict[Hashable, None] = OrderedDict()
        # classify: each held key's class (0 averse, 1 friendly); the keys of each class by last access; and
        # per class a heap of (last access, key) over its leaves, entries going stale when the key is accessed
        # again, changes class, gains a child or leaves (checked when they reach the top).
        self._class: dict[Hashable, int] = {}
        self._by_class: tuple[OrderedDict[Hashable, None], OrderedDict[Hashable, None]] = (
            OrderedDict(), OrderedDict())
        self._leaf_heaps: tuple[list[tuple[float, int, Hashable]], list[tuple[float, int, Hashable]]] = ([], [])
        self._pushes = 0  # tie-breaker: keys need not be comparable
        self._in_flight: dict[Hashable, np.ndarray] = {}  # the request in flight's blocks: their rows at access
        self._in_flight_req = -1
        self._failed = 0
        self._sweep: list[Hashable] = []  # _forget_old's snapshot of the history's keys, and its place in it
        self._sweep_at = 0
        self._classified: tuple[Hashable, int] = (_NOBODY, 1)  # the latest access's key and class
        self._averse = 0
        self._used = 0
        self._tick = 0
        self._announced: Hashable = _NOBODY
        self._named: tuple[Hashable, str | None, float] | None = None  # (victim, ns asked, its probability)
        self._model = None if model is None else self._rebased(model, 0)
        self._trained = self._skipped = self._bypassed = 0
        self._auc = float("nan")
        self._objective = "reg:squarederror" if target == "distance" else "binary:logistic"
        self._background = background
        self._cond = threading.Condition()
        self._job: tuple[np.ndarray, np.ndarray, TrainingWindow, LearnedModel | None, np.ndarray] | None = None
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._train_forever, name="evocache-learned-eviction", daemon=True)
            self._thread.start()

    # -- notifications ------------------------------------------------------------------------------------

    def on_access(self, key: Hashable, info: EntryInfo) -> None:
        self._record(key, info)
        self._announced = key

    def on_hit(self, key: Hashable) -> None:
        """Raises ``KeyError`` if ``key`` is not held."""
        ns = self._held[key][0]
        self._consume(key, None)
        self._order.move_to_end(key)
        self._by_ns[ns].move_to_end(key)
        if key in self._leaves:
            self._leaves.move_to_end(key)
        if self.classify:
            now = self._class_of(key)
            del self._by_class[self._class[key]][key]
            self._class[key] = now
            self._by_class[now][key] = None
            self._push_leaf(key)
        self.fallback.on_hit(key)

    def on_insert(self, key: Hashable, info: EntryInfo) -> None:
        """Raises ``ValueError`` if ``key`` is held already (replacing is ``on_remove`` + ``on_insert``)."""
        if key in self._held:
            raise ValueError(f"{key!r} is already held; replace it with on_remove then on_insert")
        self._consume(key, info)
        hist = self._hist
        parent = info.parent
        self._held[key] = (info.ns, info.size, parent)
        self._used += info.size
        self._order[key] = None
        self._by_ns.setdefault(info.ns, OrderedDict())[key] = None
        leaf = not hist.children[hist.slot_of(key)]
        if leaf:
            self._leaves[key] = None
        if parent is not None:
            hist.children[hist.slot_of(parent)] += 1
            self._leaves.pop(parent, None)
        if self.classify:
            cls = self._class[key] = self._class_of(key)
            self._by_class[cls][key] = None
            if leaf:
                self._push_leaf(key)
        self.fallback.on_insert(key, info)

    def on_remove(self, key: Hashable) -> None:
        """Raises ``KeyError`` if ``key`` is not held."""
        ns, size, parent = self._held.pop(key)
        self._named = None
        self._used -= size
        del self._order[key]
        keys = self._by_ns[ns]
        del keys[key]
        if not keys:
            del self._by_ns[ns]
        self._leaves.pop(key, None)
        if self.classify:
            del self._by_class[self._class.pop(key)][key]
        if parent is not None:
            hist = self._hist
            s = hist.slot[parent]  # kept while it has cached children (see _forget_old)
            hist.children[s] -= 1
            if not hist.children[s] and parent in self._held:
                # The chain's new tail joins the first candidates, where its child just was.
                self._leaves[parent] = None
                self._leaves.move_to_end(parent, last=False)
                if self.classify:
                    self._push_leaf(parent)  # at its own last access: it may be far more recent than its child
        self.fallback.on_remove(key)

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key: object) -> bool:
        return key in self._held

    # -- decisions ------------------------------------------------------------------------------------------

    def victim(self, ns: str | None = None) -> Hashable:
        model = self._usable_model()
        if model is None:
            return self.fallback.victim(ns)
        if self.classify:
            return self._classified_victim(ns)
        named = self._named
        if named is not None and named[1] == ns:
            return named[0]
        key, p, _ = self._score(model, ns, None)
        self._named = (key, ns, p)
        return key

    def admit(self, key: Hashable, info: EntryInfo) -> bool:
        """Bypass ``key`` when storing it would evict an object the model deems more likely to return. Always
        admits without a usable model, without ``admission``, without a ``capacity``, or when it fits."""
        if not self.admission or self.capacity is None or self._used + info.size <= self.capacity:
            return True
        model = self._usable_model()
        if model is None or not self._held:
            return True
        if self.classify:
            # An owner that announced no access (the L1 tier) leaves nothing classified for it: admit.
            if self._classified[0] == key and self._classified[1] == 0:
                self._bypassed += 1
                return False
            return True
        slot = self._hist.slot.get(key)
        if slot is None:  # no history (no announced access): nothing to compare
            return True
        victim, p_victim, p_new = self._score(model, None, slot)
        self._named = (victim, None, p_victim)
        if p_new < p_victim:
            self._bypassed += 1
            return False
        return True

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

    def _classified_victim(self, ns: str | None) -> Hashable:
        """The least recently used averse leaf, else the least recently used friendly leaf (without
        ``leaves_first``: the least recently used averse key, else friendly key); within a namespace, the same
        among its ``sample`` least recently used keys (leaves first, then any). O(log held) amortised: each
        class's leaves are in a heap by last access (a block that becomes a leaf again enters at its own)."""
        if ns is None:
            if not self._order:
                raise KeyError("no key held")
            if not self.leaves_first:
                return next(iter(self._by_class[0] or self._by_class[1]))
            for cls in (0, 1):
                key = self._top_leaf(cls)
                if key is not _NOBODY:
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

    def _cut(self, model: LearnedModel) -> float:
        window = model.window
        return self.averse_below * window.positives / max(window.samples, 1)

    def _predict(self, model: LearnedModel, rows: np.ndarray) -> np.ndarray:
        return model.predict(self._select(rows))

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
                    del self._by_class[1][key]
                    self._class[key] = 0
                    self._by_class[0][key] = None
                    self._push_leaf(key)

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
        """The least recently used leaf of class ``cls`` (``_NOBODY`` when it has none), stale entries popped."""
        heap, classes, hist = self._leaf_heaps[cls], self._class, self._hist
        while heap:
            last, _, key = heap[0]
            if classes.get(key) == cls:
                s = hist.slot[key]
                if not hist.children[s] and hist.last[s] == last:
                    return key
            heapq.heappop(heap)
        return _NOBODY

    def _class_of(self, key: Hashable) -> int:
        """The class given to ``key`` at its latest access (friendly when it came with no usable model)."""
        latest, cls = self._classified
        return cls if latest == key else 1

    def _window(self, ns: str | None) -> list[Hashable]:
        """The eviction candidates: the ``sample`` least recently used keys (of ``ns``), leaves first."""
        order = self._order if ns is None else self._by_ns.get(ns)
        if not order:
            return []
        if ns is None and self.leaves_first and self._leaves:
            order = self._leaves
        return list(islice(order, self.sample))

    def _usable_model(self) -> LearnedModel | None:
        model = self._model
        if model is None or self._tick - model.window.tick > self.stale_after:
            return None
        return model

    # -- learning -------------------------------------------------------------------------------------------

    def _consume(self, key: Hashable, info: EntryInfo | None) -> None:
        # An owner with context announced this access in on_access; one without (the L1 tier) did not.
        if self._announced is not _NOBODY and self._announced == key:
            self._announced = _NOBODY
        else:
            self._record(key, info)
        self._named = None

    def _record(self, key: Hashable, info: EntryInfo | None) -> None:
        self._tick = tick = self._tick + 1
        self._named = None
        hist = self._hist
        if info is not None and info.pos == 0:
            hist.start_request(key, tick, info.req)
        slot = hist.touch(key, tick, info)
        self._forget_old(tick)
        samples = self._samples
        samples.accessed(key, tick)
        horizon = self.horizon * max(len(self._held), 1)
        if self.classify:
            if self._in_flight and info is not None and info.req >= 0 and info.req != self._in_flight_req:
                self._complete()  # another request's block: the one in flight completed
            row = hist.rows([slot], tick)
            samples.add([key], row, tick, horizon)
            if tick % self.retrain_every == 0:
                self._retrain()
            cls = 1
            if info is not None and info.req_out >= 0 and info.req >= 0:
                # The request's output length is known when it completes: its blocks (in use until then) are
                # friendly for now and classified at completion, with the rest of the request (_complete).
                self._in_flight_req = info.req
                self._in_flight[key] = row
            else:
                model = self._usable_model()
                if model is not None and self._predict(model, row)[0] < self._cut(model):
                    cls = 0
                    self._averse += 1
            self._classified = (key, cls)
            return
        window = self._window(None)
        if window:
            other = window[self.rng.randrange(len(window))]
            samples.add([other], hist.rows([hist.slot[other]], tick), tick, horizon)
        if tick % self.retrain_every == 0:
            self._retrain()

    def _retrain(self) -> None:
        tick = self._tick
        found = self._samples.training_set(tick)
        if found is None:
            return
        rows, distances, horizons, first, last = found
        reused = distances <= horizons
        positives = int(reused.sum())
        y = self._targets(distances, horizons, self.target)
        if positives == 0 or positives == len(y):
            return  # one class only: nothing to learn yet
        window = TrainingWindow(first, last, tick, len(y), positives)
        previous = self._model
        if not self._background:
            self._judge(previous, rows, reused, first)
            self._model = self._fit(rows, y, window)
            self._trained += 1
            return
        with self._cond:
            if self._busy or self._job is not None:
                self._skipped += 1
                return
            self._job = (rows, y, window, previous, reused)  # copies: the ring moves on meanwhile
            self._cond.notify_all()

    def _judge(self, model: LearnedModel | None, rows: np.ndarray, reused: np.ndarray, first: int) -> None:
        """``auc``: ``model`` on the samples it has not seen (ids after its window; approximate for a model
        from elsewhere, whose ids are another policy's)."""
        if model is not None:
            unseen = slice(max(0, model.window.last + 1 - first), None)
            self._auc = self._auc_of(model.predict(self._select(rows[unseen])), reused[unseen])

    def _forget_old(self, tick: int) -> None:
        """Drop the history of objects neither held, nor parent of a held block, nor accessed within the
        last ``4 x horizon`` accesses: memory stays bounded by the cache's turnover, not the trace's length.

        Incremental, so that no request pays for a whole pass: each access examines the next ``_SWEEP`` keys of
        a snapshot of the history, and a finished snapshot is replaced by a new one (one pass per
        ``len(history) / _SWEEP`` accesses; the history stays within a few turnovers)."""
        hist = self._hist
        if self._sweep_at >= len(self._sweep):
            self._sweep = list(hist.slot)
            self._sweep_at = 0
            hist.forget_heads()
        memory = 4 * self.horizon * max(len(self._held), 1)
        held, slots, children, last = self._held, hist.slot, hist.children, hist.last
        end = min(self._sweep_at + _SWEEP, len(self._sweep))
        for k in self._sweep[self._sweep_at:end]:
            s = slots.get(k)
            if s is not None and k not in held and not children[s] and tick - last[s] > memory:
                hist.forget(k)
        self._sweep_at = end

    def _fit(self, rows: np.ndarray, labels: np.ndarray, window: TrainingWindow) -> LearnedModel:
        return train(self._select(rows), labels, features=self.features, window=window, objective=self._objective, rounds=self.rounds, depth=self.depth,
                     threads=self.threads, monotone=MONOTONE if self.monotone else None)

    def _train_forever(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._job is not None or self._closed)
                if self._closed:
                    return
                assert self._job is not None
                rows, labels, window, previous, reused = self._job
                self._job = None
                self._busy = True
            try:
                self._judge(previous, rows, reused, window.first)  # off the request path, as the fit
                model = self._fit(rows, labels, window)
            except Exception:  # a failed training must not end the thread: the next retraining tries again
                log.exception("learned eviction: training on %d samples failed; the model in use stays", len(labels))
                with self._cond:
                    self._busy = False
                    self._failed += 1
                    self._cond.notify_all()
                continue
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
            with self._cond:
                self._model = model  # one reference store: the request path sees the old model or the new one
                self._trained += 1
                self._cond.notify_all()

    # -- the model's lifecycle -----------------------------------------------------------------------------

    @property
    def model(self) -> LearnedModel | None:
        """The model in use (``None`` before the first training), stale or not."""
        return self._model

    @property
    def stats(self) -> LearnedStats:
        model = self._model
        return LearnedStats(
            accesses=self._tick,
            trained=self._trained,
            skipped=self._skipped,
            samples=self._samples.next_id,
            bypassed=self._bypassed,
            model_tick=model.window.tick if model is not None else -1,
            auc=self._auc,
            averse=self._averse,
            failed=self._failed,
        )

    def wait_trained(self, count: int, timeout: float | None = None) -> bool:
        """Wait until ``count`` models have been trained; False if ``timeout`` seconds passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._trained >= count, timeout)

    def save_model(self, path: str | Path) -> None:
        """Write the model in use as JSON (``LearnedModel.save``). Raises ``ValueError`` before any training."""
        if self._model is None:
            raise ValueError("no model to save: the policy has not trained one yet")
        self._model.save(path)

    def load_model(self, path: str | Path) -> None:
        """Use the model saved at ``path`` from now on. Raises ``LearnedModelError`` for a file of another
        format version or other features; the model in use is then unchanged."""
        self._model = self._rebased(LearnedModel.load(path, features=self.features), self._tick)

    def _select(self, rows: np.ndarray) -> np.ndarray:
        return rows if self._columns is None else rows[:, self._columns]

    def _rebased(self, model: LearnedModel, tick: int) -> LearnedModel:
        """``model`` as if trained at this policy's access ``tick``: a model from elsewhere (a file, another
        policy) is fresh when it arrives, and goes stale by this policy's count."""
        if self.classify and not model.forest.logistic:
            raise LearnedModelError(
                "the model is a regression (target='distance'); decide='classify' needs a classifier's probability"
            )
        if tuple(model.features) != self.features:
            raise LearnedModelError(
                f"the model was trained on features {list(model.features)}, expected {list(self.features)}"
            )
        return replace(model, window=replace(model.window, tick=tick))

    def close(self) -> None:
        """Stop the background trainer (if any) and wait for it. The policy goes on deciding with its model."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

