"""Learned eviction: the part every learned policy shares (LRB, Song et al., NSDI '20; Hawkeye, Jain and Lin,
ISCA '16; with the context of KV prefix chains).

A learned policy learns, online, the probability that an object is accessed again within a horizon of
``horizon x (objects held)`` accesses (a relaxed Belady boundary: Belady keeps what returns soonest, and what
returns later than about the cache's turnover is what it gives up; see docs/eviction.md, "Labels"). An XGBoost
model is retrained on the latest ``window`` labelled samples every ``retrain_every`` accesses: inline
(deterministic, for replay) or on a background thread (production). Blocks of a prefix chain are eaten from the
tail (``leaves_first``: a prefix cache can only use a block whose parents it holds).

``LearnedBase`` keeps the held keys in recency order (overall, per namespace, leaves), the per-object history
the features are computed from (``_history``, docs/eviction.md, "Features"), the training samples, the model's
lifecycle and the heuristic that decides while no model is usable. Each subclass makes one decision with the
model: ``LearnedPolicy`` (``_learned_classify``) classifies each object as it is accessed and evicts the least
recently used of the class least likely to return; ``LearnedRankPolicy`` (``_learned_rank``) scores a sample
of eviction candidates at each eviction. What either can and cannot predict on prefix traces is in
docs/eviction.md, "What it can predict".
"""

from __future__ import annotations

import abc
import logging
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import LearnedModelError
from ._base import BuildContext, Clock, EntryInfo, EvictionPolicy
from ._features import FEATURES, MONOTONE
from ._lru import LRUPolicy
from ._model import LearnedModel, TrainingWindow, train

if TYPE_CHECKING:
    import numpy as np

NOBODY: Hashable = object()  # keys are arbitrary hashables, so None could be one
log = logging.getLogger("evocache.controller.eviction")
_SWEEP = 8  # history keys examined for forgetting per access


def _positive_int(label: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{label} must be an int >= 1, got {value!r}")


@dataclass(frozen=True, slots=True)
class LearnedTraining:
    """How a learned policy labels its samples, trains its model and retires it.

    ``horizon``: a sample is positive when its object returns within ``horizon x (objects held)`` accesses
    (docs/eviction.md, "Labels"). ``retrain_every`` accesses, a model is trained on the latest ``window``
    labelled samples with ``rounds`` trees of ``depth`` on ``threads`` threads (shallow trees: deeper ones
    learn the objects of the window by heart and rank new ones worse). ``monotone`` constrains the model to the
    known directions of ``_features.MONOTONE``; ``features`` are its inputs, names of ``_features.FEATURES``
    (default: all). ``stale_after``: accesses after which a model's training start is too old and the
    fallback heuristic decides again (default ``4 * retrain_every``).

    Raises ``ValueError`` for a value out of range or an unknown feature.
    """

    horizon: float = 2.0
    retrain_every: int = 10_000
    window: int = 100_000
    rounds: int = 20
    depth: int = 3
    threads: int = 1
    monotone: bool = False
    features: tuple[str, ...] = FEATURES
    stale_after: int | None = None

    def __post_init__(self) -> None:
        for label in ("retrain_every", "window", "rounds", "depth", "threads"):
            _positive_int(label, getattr(self, label))
        horizon = self.horizon
        if isinstance(horizon, bool) or not (isinstance(horizon, int | float) and 0 < horizon < float("inf")):
            raise ValueError(f"horizon must be a finite number > 0, got {horizon!r}")
        if isinstance(self.features, str):
            raise ValueError(f"features must be a sequence of names, got the string {self.features!r}")
        chosen = tuple(self.features)
        unknown = [f for f in chosen if f not in FEATURES]
        if unknown or not chosen:
            raise ValueError(f"unknown features {unknown or '(none given)'}; known: {', '.join(FEATURES)}")
        object.__setattr__(self, "features", chosen)
        object.__setattr__(self, "horizon", float(horizon))

    @property
    def staleness(self) -> int:
        """``stale_after``, its default resolved."""
        return 4 * self.retrain_every if self.stale_after is None else self.stale_after


@dataclass(frozen=True, slots=True)
class LearnedStats:
    """Counters of a learned policy: ``accesses`` seen, models ``trained`` (and retrainings ``skipped``
    because the background trainer was still busy), training ``samples`` taken, misses ``bypassed``, and
    ``model_tick``, the access count at which the model in use started training (-1: none), ``auc``,
    the area under the ROC curve of the model in use on the samples of the latest training (data it had not
    seen: how well it ranks what happened since; NaN before two trainings), ``averse``, the accesses a
    model classified averse (``LearnedPolicy``; 0 for the others), and ``failed``, trainings that raised
    (logged; the model in use stays, and the next retraining tries again)."""

    accesses: int
    trained: int
    skipped: int
    samples: int
    bypassed: int
    model_tick: int
    auc: float
    averse: int = 0
    failed: int = 0


class LearnedBase(EvictionPolicy):
    """The accounting, features, training and model lifecycle of a learned policy; a subclass decides.

    Options: ``training`` (``LearnedTraining``); ``fallback``, the heuristic that decides while no model is
    usable (a new policy, not a learned one; default an LRU); ``model``, a trained model to start with;
    ``sample``, the least recently used keys a decision looks at (candidates scored per eviction, or, within a
    namespace, the keys scanned for a victim); ``leaves_first``; ``admission`` (off by default): with a
    ``capacity``, a missed object is bypassed when the cache is full and the model says it is less worth
    keeping (see the subclass); ``capacity``, the owner's capacity in its size unit (admission needs it, to
    know when a miss would evict); ``background``, train on a thread (production) instead of inline (replay).
    Built by name (``make_eviction_policy``), ``fallback`` is a registered heuristic's name, built for the same
    owner with a child of the rng.

    The fallback sees every notification, so a policy whose model is missing or stale decides exactly as it
    does.

    Subclasses give ``name`` and the decision: ``_learn`` (what one access teaches), ``_victim`` and
    ``_declines`` (with a usable model), and optionally the ``_hit``, ``_inserted``, ``_removed``, ``_leaf``
    and ``_notified`` hooks on the held keys.
    """

    uses_context = True
    target: str = "reuse"
    """What the model learns (``_history.targets``): ``reuse``, a probability; ``distance``, a regression."""

    def __init__(
        self,
        *,
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
        from ._history import History, Samples, auc, targets  # numpy: only when a learned policy is built

        if not isinstance(training, LearnedTraining):
            raise TypeError(f"training must be a LearnedTraining, not {type(training).__name__}")
        _positive_int("sample", sample)
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
            raise ValueError(f"capacity must be an int >= 1 or None, got {capacity!r}")
        if fallback is not None and not isinstance(fallback, EvictionPolicy):
            raise TypeError(f"fallback must be an EvictionPolicy, not {type(fallback).__name__} (by name: "
                            "make_eviction_policy('learned', fallback=NAME))")
        if isinstance(fallback, LearnedBase):
            raise ValueError("fallback must be a heuristic, not a learned policy")
        if fallback is not None and len(fallback):
            raise ValueError("fallback must be a new policy: it already tracks keys")
        super().__init__(clock=clock, rng=rng)
        self.training = training
        self.capacity = capacity
        self.sample = sample
        self.features = training.features
        self.leaves_first = leaves_first
        self.admission = admission
        self.fallback = fallback if fallback is not None else LRUPolicy(
            clock=clock, rng=random.Random(self.rng.getrandbits(64)))
        self._columns = None if training.features == FEATURES else [FEATURES.index(f) for f in training.features]
        self._horizon = training.horizon
        self._retrain_every = training.retrain_every
        self._stale_after = training.staleness
        self._hist = History()
        self._samples = Samples(training.window)
        self._auc_of = auc
        self._targets = targets
        self._held: dict[Hashable, tuple[str, int, Hashable | None]] = {}  # key -> (ns, size, parent)
        # Held keys by last access, oldest first: overall, per namespace, and the leaves only.
        self._order: OrderedDict[Hashable, None] = OrderedDict()
        self._by_ns: dict[str, OrderedDict[Hashable, None]] = {}
        self._leaves: OrderedDict[Hashable, None] = OrderedDict()
        self._failed = 0
        self._sweep: list[Hashable] = []  # _forget_old's snapshot of the history's keys, and its place in it
        self._sweep_at = 0
        self._averse = 0
        self._used = 0
        self._tick = 0
        self._announced: Hashable = NOBODY
        self._model = None if model is None else self._rebased(model, 0)
        self._trained = self._skipped = self._bypassed = 0
        self._auc = float("nan")
        self._background = background
        self._cond = threading.Condition()
        self._job: tuple[np.ndarray, np.ndarray, TrainingWindow, LearnedModel | None, np.ndarray] | None = None
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._train_forever, name="evocache-learned-eviction", daemon=True)
            self._thread.start()

    @classmethod
    def build(cls, context: BuildContext, *, fallback: str = "lru", **options: Any) -> EvictionPolicy:
        """``fallback`` by name: a registered heuristic, for the same owner with a child of the rng (and never
        in the background: a heuristic does not train)."""
        fallback_class = context.policies.get(fallback)
        if fallback_class is not None and issubclass(fallback_class, LearnedBase):
            raise ValueError(f"fallback must be a heuristic, not the learned policy {fallback!r}")
        heuristic = replace(context, background=False, rng=random.Random(context.rng.getrandbits(64))).build(fallback)
        return cls(fallback=heuristic, capacity=context.capacity, background=context.background,
                   clock=context.clock, rng=context.rng, **options)

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
        self._hit(key)
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
        self._inserted(key, leaf)
        self.fallback.on_insert(key, info)

    def on_remove(self, key: Hashable) -> None:
        """Raises ``KeyError`` if ``key`` is not held."""
        ns, size, parent = self._held.pop(key)
        self._notified()
        self._used -= size
        del self._order[key]
        keys = self._by_ns[ns]
        del keys[key]
        if not keys:
            del self._by_ns[ns]
        self._leaves.pop(key, None)
        self._removed(key)
        if parent is not None:
            hist = self._hist
            s = hist.slot[parent]  # kept while it has cached children (see _forget_old)
            hist.children[s] -= 1
            if not hist.children[s] and parent in self._held:
                # The chain's new tail joins the first candidates, where its child just was.
                self._leaves[parent] = None
                self._leaves.move_to_end(parent, last=False)
                self._leaf(parent)
        self.fallback.on_remove(key)

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key: object) -> bool:
        return key in self._held

    # -- hooks on the held keys (no-ops here) ----------------------------------------------------------------

    def _hit(self, key: Hashable) -> None:  # noqa: B027 (optional hook)
        """``key``, held, was accessed again (its recency is updated already)."""

    def _inserted(self, key: Hashable, leaf: bool) -> None:  # noqa: B027 (optional hook)
        """``key`` is held from now on; ``leaf``: no held block has it as parent."""

    def _removed(self, key: Hashable) -> None:  # noqa: B027 (optional hook)
        """``key`` is no longer held."""

    def _leaf(self, key: Hashable) -> None:  # noqa: B027 (optional hook)
        """``key``, held, became a leaf again: its last held child left."""

    def _notified(self) -> None:  # noqa: B027 (optional hook)
        """A notification arrived: a victim named before it may no longer be the one to name."""

    # -- decisions ------------------------------------------------------------------------------------------

    def victim(self, ns: str | None = None) -> Hashable:
        model = self._usable_model()
        if model is None:
            return self.fallback.victim(ns)
        return self._victim(model, ns)

    def admit(self, key: Hashable, info: EntryInfo) -> bool:
        """Bypass ``key`` when storing it would evict and the model says it is less worth keeping (see
        ``_declines``). Always admits without a usable model, without ``admission``, without a ``capacity``,
        or when it fits."""
        if not self.admission or self.capacity is None or self._used + info.size <= self.capacity:
            return True
        model = self._usable_model()
        if model is None or not self._held:
            return True
        if self._declines(model, key):
            self._bypassed += 1
            return False
        return True

    @abc.abstractmethod
    def _victim(self, model: LearnedModel, ns: str | None) -> Hashable:
        """The key to evict (of namespace ``ns``) with ``model`` usable; ``KeyError`` when none qualifies."""

    @abc.abstractmethod
    def _declines(self, model: LearnedModel, key: Hashable) -> bool:
        """Whether admission bypasses the missed ``key`` (the cache is full and holds keys)."""

    def _usable_model(self) -> LearnedModel | None:
        model = self._model
        if model is None or self._tick - model.window.tick > self._stale_after:
            return None
        return model

    def _predict(self, model: LearnedModel, rows: np.ndarray) -> np.ndarray:
        return model.predict(self._select(rows))

    # -- learning -------------------------------------------------------------------------------------------

    def _consume(self, key: Hashable, info: EntryInfo | None) -> None:
        # An owner with context announced this access in on_access; one without (the L1 tier) did not.
        if self._announced is not NOBODY and self._announced == key:
            self._announced = NOBODY
        else:
            self._record(key, info)
        self._notified()

    def _record(self, key: Hashable, info: EntryInfo | None) -> None:
        self._tick = tick = self._tick + 1
        self._notified()
        hist = self._hist
        if info is not None and info.pos == 0:
            hist.start_request(key, tick, info.req)
        slot = hist.touch(key, tick, info)
        self._forget_old(tick)
        self._samples.accessed(key, tick)
        self._learn(key, info, slot, tick, self._horizon * max(len(self._held), 1))

    @abc.abstractmethod
    def _learn(self, key: Hashable, info: EntryInfo | None, slot: int, tick: int, horizon: float) -> None:
        """What the access of ``key`` (history ``slot``, access count ``tick``) teaches: the samples it adds,
        labelled by their next access within ``horizon`` accesses; and the retraining every ``retrain_every``
        accesses (``_retrain``)."""

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
        memory = 4 * self._horizon * max(len(self._held), 1)
        held, slots, children, last = self._held, hist.slot, hist.children, hist.last
        end = min(self._sweep_at + _SWEEP, len(self._sweep))
        for k in self._sweep[self._sweep_at:end]:
            s = slots.get(k)
            if s is not None and k not in held and not children[s] and tick - last[s] > memory:
                hist.forget(k)
        self._sweep_at = end

    def _fit(self, rows: np.ndarray, labels: np.ndarray, window: TrainingWindow) -> LearnedModel:
        t = self.training
        objective = "reg:squarederror" if self.target == "distance" else "binary:logistic"
        return train(self._select(rows), labels, features=self.features, window=window, objective=objective,
                     rounds=t.rounds, depth=t.depth, threads=t.threads, monotone=MONOTONE if t.monotone else None)

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
        format version or other features, or a model this policy cannot decide with; the model in use is
        then unchanged."""
        self._model = self._rebased(LearnedModel.load(path, features=self.features), self._tick)

    def _select(self, rows: np.ndarray) -> np.ndarray:
        return rows if self._columns is None else rows[:, self._columns]

    def _rebased(self, model: LearnedModel, tick: int) -> LearnedModel:
        """``model`` as if trained at this policy's access ``tick``: a model from elsewhere (a file, another
        policy) is fresh when it arrives, and goes stale by this policy's count. Raises ``LearnedModelError``
        for a model trained on other features (a subclass may refuse more)."""
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

