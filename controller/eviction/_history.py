"""Per-object history for the learned policy, kept in columns so that a batch of objects becomes a feature
matrix (``_features.FEATURES``) with a few numpy operations; and the ring of training samples.

numpy is imported here, and this module only when a learned policy is built: the eviction package itself
stays light (``evocache`` commands start without numpy).
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Hashable

import numpy as np

from ._base import EntryInfo
from ._features import FEATURES, HALF_LIVES

_NAN = float("nan")
_HALF_LIVES = np.array(HALF_LIVES)
_IN_FLIGHT = 4096  # requests whose blocks may be read interleaved
_HEADS = 65_536  # first blocks whose request counts are kept


def _code(text: str) -> float:
    return float(zlib.crc32(text.encode()) % 4096) if text else -1.0


class History:
    """Columns of per-object state, one row ("slot") per object whose history is kept; slots are reused.

    ``touch`` records an access; ``rows`` builds feature rows; ``forget`` drops objects. ``children`` is
    maintained by the owner of the cache structure (the policy), as it knows what is held.
    """

    def __init__(self, capacity: int = 1024) -> None:
        self.slot: dict[Hashable, int] = {}
        self._free: list[int] = []
        self._n = 0
        # The per-slot columns, empty until _alloc sizes them. ctx: pos, req_len, head requests, head gap, ns,
        # rule, req_out, req_new.
        self.last = np.empty(0)
        self.gaps = np.empty((0, 3))
        self.edc = np.empty((0, len(HALF_LIVES)))
        self.edc_t = np.empty(0)
        self.count = np.empty(0)
        self.size = np.empty(0)
        self.ctx = np.empty((0, 8))
        self.children = np.empty(0)
        self._alloc(capacity)
        self._codes: dict[str, float] = {}
        self._head_requests: dict[Hashable, int] = {}
        self._head_last: dict[Hashable, int] = {}
        # Per request in flight (an owner may interleave requests' blocks): [head requests, head gap, position
        # of its first block never seen before (-1: none yet)]; dropped at its last block, at most _IN_FLIGHT.
        self._requests: OrderedDict[int, list[float]] = OrderedDict()

    def _alloc(self, n: int) -> None:
        """Make room for ``n`` slots, keeping the rows there are."""
        grow = self._grow
        self.last = grow(self.last, n, 0.0)
        self.gaps = grow(self.gaps, n, _NAN)
        self.edc = grow(self.edc, n, 0.0)
        self.edc_t = grow(self.edc_t, n, 0.0)
        self.count = grow(self.count, n, 0.0)
        self.size = grow(self.size, n, 1.0)
        self.ctx = grow(self.ctx, n, _NAN)
        self.children = grow(self.children, n, 0.0)

    @staticmethod
    def _grow(old: np.ndarray, n: int, fill: float) -> np.ndarray:
        new = np.full((n, *old.shape[1:]), fill)
        new[: len(old)] = old
        return new

    def __len__(self) -> int:
        return len(self.slot)

    def slot_of(self, key: Hashable) -> int:
        """The slot of ``key``, made (with an empty history) if it has none."""
        s = self.slot.get(key)
        if s is None:
            if self._free:
                s = self._free.pop()
            else:
                s = self._n
                self._n += 1
                if s >= len(self.last):
                    self._alloc(2 * len(self.last))
            self.slot[key] = s
            self.count[s] = 0.0
            self.gaps[s] = _NAN
            self.edc[s] = 0.0
            self.children[s] = 0.0
            self.ctx[s] = _NAN
        return s

    def start_request(self, head: Hashable, tick: int, req: int = -1) -> None:
        """Request ``req`` (-1: unnumbered), whose first block is ``head``, begins at ``tick``."""
        requests = self._head_requests.get(head, 0) + 1
        self._head_requests[head] = requests
        previous = self._head_last.get(head)
        self._head_last[head] = tick
        self._request(req)[:2] = (float(requests), _NAN if previous is None else float(tick - previous))

    def _request(self, req: int) -> list[float]:
        """The state of request ``req``, made fresh (head unknown, no new block yet) on its first sight."""
        state = self._requests.get(req)
        if state is None:
            state = self._requests[req] = [_NAN, _NAN, -1.0]
            if len(self._requests) > _IN_FLIGHT:
                self._requests.popitem(last=False)
        return state

    def forget_heads(self, keep: int = _HEADS) -> None:
        """Keep the request counts of the ``keep`` first blocks requested most recently, drop the others' (a
        count is worth keeping long after its blocks left: a chain's popularity is the best single feature)."""
        excess = len(self._head_last) - keep
        if excess > 0:
            for h, _ in sorted(self._head_last.items(), key=lambda item: item[1])[:excess]:
                del self._head_last[h]
                del self._head_requests[h]

    def touch(self, key: Hashable, tick: int, info: EntryInfo | None) -> int:
        """Record an access of ``key`` at ``tick`` (``info``: its context, if known). Returns its slot."""
        s = self.slot_of(key)
        request = self._request(info.req) if info is not None and info.pos >= 0 else None
        if request is not None and not self.count[s] and request[2] < 0:
            # Chained block hashes: every block after the first unknown one is unknown too.
            request[2] = info.pos
        if self.count[s]:
            gaps = self.gaps[s]
            gaps[2], gaps[1], gaps[0] = gaps[1], gaps[0], tick - self.last[s]
            elapsed = tick - self.edc_t[s]
            self.edc[s] = self.edc[s] * np.exp2(-elapsed / _HALF_LIVES) + 1.0
        else:
            self.edc[s] = 1.0
        self.edc_t[s] = tick
        self.last[s] = tick
        self.count[s] += 1.0
        if info is not None:
            self.size[s] = max(info.size, 1)
            ctx = self.ctx[s]
            if info.pos >= 0:
                ctx[0], ctx[1] = info.pos, info.req_len
                assert request is not None
                ctx[2], ctx[3] = request[0], request[1]
                ctx[7] = info.req_len - request[2] if request[2] >= 0 else 0.0
                if info.pos >= info.req_len - 1:
                    self._requests.pop(info.req, None)
            ctx[4] = self._code(info.ns)
            ctx[5] = self._code(info.rule)
            ctx[6] = info.req_out if info.req_out >= 0 else _NAN
        return s

    def _code(self, text: str) -> float:
        code = self._codes.get(text)
        if code is None:
            code = self._codes[text] = _code(text)
        return code

    def forget(self, key: Hashable) -> None:
        self._free.append(self.slot.pop(key))

    def rows(self, slots: np.ndarray | list[int], tick: int) -> np.ndarray:
        """Feature rows (``FEATURES`` order) of ``slots`` as of ``tick``."""
        ctx = self.ctx[slots]
        edc = self.edc[slots] * np.exp2(-(tick - self.edc_t[slots])[:, None] / _HALF_LIVES)
        return np.column_stack(
            (
                tick - self.last[slots],
                self.gaps[slots],
                edc,
                self.count[slots],
                np.log2(self.size[slots]),
                ctx[:, :2],
                ctx[:, 1] - ctx[:, 0],
                ctx[:, 6:8],
                self.children[slots],
                ctx[:, 2:6],
            )
        )


class Samples:
    """Training samples in a ring of ``2 * window`` rows: features as of the sampling access, the horizon,
    and the distance (in accesses) to the object's next access, -1 until it happens. Ids count samples ever
    taken; a distance for an id the ring has overwritten is dropped.
    """

    def __init__(self, window: int) -> None:
        self.window = window
        self.ring = 2 * window
        self.rows = np.zeros((self.ring, len(FEATURES)))
        self.labels = np.full(self.ring, -1.0)
        self.taken_at = np.zeros(self.ring)
        self.horizons = np.zeros(self.ring)
        self.next_id = 0
        self.pending: dict[Hashable, list[int]] = {}

    def add(self, keys: list[Hashable], rows: np.ndarray, tick: int, horizon: float) -> None:
        for key, row in zip(keys, rows, strict=True):
            i = self.next_id
            self.next_id += 1
            j = i % self.ring
            self.rows[j] = row
            self.labels[j] = -1.0
            self.taken_at[j] = tick
            self.horizons[j] = horizon
            self.pending.setdefault(key, []).append(i)

    def accessed(self, key: Hashable, tick: int) -> None:
        """Label the samples of ``key`` waiting for its next access, which is now."""
        waiting = self.pending.pop(key, None)
        if waiting:
            oldest = self.next_id - self.ring
            for i in waiting:
                if i >= oldest:
                    j = i % self.ring
                    self.labels[j] = tick - self.taken_at[j]

    def training_set(self, tick: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int] | None:
        """The latest ``window`` samples whose horizon has passed, as ``(rows, distances, horizons, first id,
        last id)`` (copies; distance ``inf``: not accessed again yet); ``None`` when there are none. Drops
        pending lists that can no longer label anything."""
        ids = np.arange(max(0, self.next_id - self.ring), self.next_id)
        j = ids % self.ring
        # Only samples whose horizon has passed: a recent one labelled 1 already would otherwise count while
        # its peers that will be 0 do not yet, and the newest samples would look far more reusable than they are.
        done = self.taken_at[j] + self.horizons[j] < tick
        known = ids[done][-self.window :]
        oldest = self.next_id - self.ring
        self.pending = {
            k: waiting
            for k, waiting in self.pending.items()
            if waiting[-1] >= oldest and self.taken_at[waiting[-1] % self.ring] + self.horizons[waiting[-1] % self.ring] >= tick
        }
        if not len(known):
            return None
        k = known % self.ring
        distances = self.labels[k]
        distances[distances < 0] = np.inf
        return self.rows[k], distances, self.horizons[k], int(known[0]), int(known[-1])


def targets(distances: np.ndarray, horizons: np.ndarray, target: str) -> np.ndarray:
    """What the model learns: ``reuse``, 1 if the next access came within the horizon, else 0; ``distance``
    (LRB's), minus the log distance to the next access, censored at the horizon (minus: the lowest is evicted,
    as with a probability)."""
    if target == "distance":
        return -np.log2(1.0 + np.minimum(distances, horizons))
    return (distances <= horizons).astype(float)


def lowest(
    predict, history: History, slots: list[int], tick: int, candidates: int, columns: list[int] | None
) -> tuple[int, list[float]]:
    """Score ``slots`` in one batch with ``predict`` (on the feature ``columns``, all if None); return the
    index of the lowest of the first ``candidates`` (ties: accessed longest ago) and every probability."""
    index = np.array(slots)
    rows = history.rows(index, tick)
    p = predict(rows if columns is None else rows[:, columns])
    best = int(np.lexsort((history.last[index[:candidates]], p[:candidates]))[0])
    return best, p.tolist()


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve of ``scores`` for 0/1 ``labels`` (Mann-Whitney, ties counted half)."""
    from scipy.stats import rankdata

    labels = np.asarray(labels, dtype=float)
    positives = labels.sum()
    negatives = len(labels) - positives
    if not positives or not negatives:
        return float("nan")
    ranks = rankdata(scores)
    return float((ranks[labels == 1].sum() - positives * (positives + 1) / 2) / (positives * negatives))
