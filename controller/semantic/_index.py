"""The scoped vector index: one faiss index per (tenant namespace, contract boundary).

A lookup names its ``Scope`` and searches only that scope's index, so a neighbour from another tenant or from
another model, revision, parameter set or embedder cannot be returned: the separation is structural (separate
indexes), not a filter that a bug could skip.

Each ``VectorIndex`` is exact (``IndexFlatIP``) while small and HNSW (``IndexHNSWFlat``) once it holds more
than ``exact_limit`` entries; it migrates once, when an add crosses the limit. Vectors are unit rows, so the
inner product is the cosine similarity.

faiss is imported inside ``VectorIndex``, so importing this module does not load it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from .._codec import check_ns

if TYPE_CHECKING:
    import numpy as np  # numpy loads only when vectors are made: `evocache policy check` never needs it

__all__ = ["Neighbour", "Scope", "SemanticIndex", "VectorIndex"]

EXACT = "exact"
HNSW = "hnsw"

# Unit rows only: a vector off by more than this was not normalised, and its inner products are not cosines.
_NORM_TOLERANCE = 1e-3
# Removed entries stay in the faiss index as tombstones (HNSW cannot delete); it is rebuilt from the live
# vectors once tombstones outnumber live entries (and are at least this many), so removals cost O(1) amortised.
_MIN_COMPACT = 64


class Scope(NamedTuple):
    """One index: a neighbour never crosses it.

    ``namespace`` is the tenant namespace (``[A-Za-z0-9._-]{1,128}``); ``boundary`` identifies the contract
    (function identity, model, revision, generation parameters digest) and the embedder's ``name``. Any
    change in either gives a different scope and so an empty index.
    """

    namespace: str
    boundary: str


class Neighbour(NamedTuple):
    entry_id: str
    similarity: float
    """Cosine similarity: inner product of unit vectors, in [-1, 1]."""


def check_scope(scope: Scope) -> None:
    """``TypeError``/``ValueError`` naming the field unless ``scope`` is a valid ``Scope``."""
    if not isinstance(scope, Scope):
        raise TypeError(f"scope must be a Scope, got {type(scope).__name__}")
    check_ns(scope.namespace)  # type: ignore[arg-type]
    if not isinstance(scope.boundary, str) or not scope.boundary:
        raise ValueError(f"scope boundary must be a non-empty str, got {scope.boundary!r}")


def check_vectors(vecs: Any, dim: int | None, *, what: str = "vecs") -> np.ndarray:
    """``vecs`` as a C-contiguous float32 ``(n, dim)`` array of unit rows; ``ValueError`` saying what is wrong."""
    import numpy as np

    arr = np.ascontiguousarray(vecs, dtype=np.float32)
    if arr.ndim != 2:
        raise ValueError(f"{what} must be a 2-D array (n, dim), got shape {arr.shape}")
    if dim is not None and arr.shape[1] != dim:
        raise ValueError(f"{what} has dimension {arr.shape[1]}, the index holds dimension {dim}")
    if arr.shape[1] == 0:
        raise ValueError(f"{what} has dimension 0")
    if not np.isfinite(arr).all():
        row = int(np.argmax(~np.isfinite(arr).all(axis=1)))
        raise ValueError(f"{what}[{row}] has a NaN or infinite component")
    norms = np.linalg.norm(arr, axis=1)
    off = np.abs(norms - 1.0) > _NORM_TOLERANCE
    if off.any():
        row = int(np.argmax(off))
        raise ValueError(f"{what}[{row}] has norm {norms[row]:.6f}; rows must be L2-normalised")
    return arr


def _check_ids(ids: Sequence[str], n: int | None = None) -> list[str]:
    if isinstance(ids, str):
        raise TypeError("ids must be a sequence of str, not a single str: wrap it in a list")
    out = list(ids)
    for i, entry_id in enumerate(out):
        if not isinstance(entry_id, str) or not entry_id:
            raise ValueError(f"ids[{i}] must be a non-empty str, got {entry_id!r}")
    if n is not None and len(out) != n:
        raise ValueError(f"{len(out)} ids for {n} vectors")
    return out


class VectorIndex:
    """The vectors of one scope, searchable by cosine similarity; safe to share between threads.

    Exact up to ``exact_limit`` live entries, HNSW (``hnsw_m`` links per node, ``ef_construction``,
    ``ef_search`` at query time, raised to ``k`` when ``k`` is larger) beyond. Adding an id that is already
    present replaces its vector. Removing an unknown id is a no-op. Bad input (wrong shape or dimension,
    rows that are not unit vectors, NaN, duplicate ids in one call) raises ``ValueError`` and changes nothing.
    """

    def __init__(
        self,
        dim: int,
        *,
        exact_limit: int = 10_000,
        hnsw_m: int = 32,
        ef_construction: int = 80,
        ef_search: int = 64,
    ) -> None:
        if dim < 1 or exact_limit < 0 or hnsw_m < 2 or ef_construction < 1 or ef_search < 1:
            raise ValueError("dim, hnsw_m, ef_construction, ef_search must be positive, exact_limit >= 0")
        import faiss

        self._faiss = faiss
        self.dim = dim
        self.exact_limit = exact_limit
        self._hnsw_m = hnsw_m
        self._ef_construction = ef_construction
        self._ef_search = ef_search
        self._lock = threading.RLock()
        # faiss labels are positions in add order; a removed entry leaves a tombstone (None) at its position.
        self._slots: list[str | None] = []
        self._where: dict[str, int] = {}
        self._dead: set[int] = set()
        self._dead_filter: Any = None  # cached faiss selector excluding tombstones; None while there are none
        self.kind = EXACT
        self._index = self._new_index(EXACT)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, entry_id: object) -> bool:
        return entry_id in self._where

    def ids(self) -> list[str]:
        """The live entry ids, in no particular order."""
        with self._lock:
            return list(self._where)

    def add(self, ids: Sequence[str], vecs: Any) -> None:
        arr = check_vectors(vecs, self.dim)
        items = _check_ids(ids, arr.shape[0])
        if len(set(items)) != len(items):
            raise ValueError("ids must be distinct within one add")
        if not items:
            return
        with self._lock:
            self._bury([self._where[i] for i in items if i in self._where])
            if self.kind == EXACT and len(self._where) + len(items) > self.exact_limit:
                self._rebuild(HNSW)
            start = len(self._slots)
            self._index.add(arr)
            self._slots.extend(items)
            self._where.update((entry_id, start + n) for n, entry_id in enumerate(items))
            self._maybe_compact()

    def remove(self, ids: Sequence[str]) -> None:
        items = _check_ids(ids)
        with self._lock:
            self._bury([self._where.pop(i) for i in dict.fromkeys(items) if i in self._where])
            self._maybe_compact()

    def search(self, vecs: Any, k: int) -> list[list[Neighbour]]:
        """The ``k`` most similar live entries for each row of ``vecs``, best first (fewer if fewer exist)."""
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be a positive int, got {k!r}")
        arr = check_vectors(vecs, self.dim)
        with self._lock:
            if not self._where:
                return [[] for _ in range(arr.shape[0])]
            k_eff = min(k, len(self._where))
            sims, labels = self._index.search(arr, k_eff, params=self._params(k_eff))
            return [
                self._neighbours(row_s, row_l)
                for row_s, row_l in zip(sims.tolist(), labels.tolist(), strict=True)
            ]

    def vector(self, entry_id: str) -> np.ndarray:
        """The stored vector of ``entry_id`` (a copy); ``KeyError`` if it is not in the index."""
        with self._lock:
            return self._index.reconstruct(self._where[entry_id])

    def vectors(self) -> tuple[list[str], np.ndarray]:
        """Every live entry id and its vector, row i for id i."""
        import numpy as np

        with self._lock:
            ids = list(self._where)
            if not ids:
                return ids, np.zeros((0, self.dim), dtype=np.float32)
            return ids, self._index.reconstruct_batch(np.array([self._where[i] for i in ids], dtype=np.int64))

    # -- internals ---------------------------------------------------------------------------------------

    def _neighbours(self, sims: list[float], labels: list[int]) -> list[Neighbour]:
        slots = self._slots
        return [Neighbour(slots[label], sim) for sim, label in zip(sims, labels, strict=True) if label >= 0]

    def _new_index(self, kind: str) -> Any:
        faiss = self._faiss
        if kind == EXACT:
            return faiss.IndexFlatIP(self.dim)
        index = faiss.IndexHNSWFlat(self.dim, self._hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = self._ef_construction
        return index

    def _params(self, k: int) -> Any:
        faiss = self._faiss
        if self.kind == HNSW:
            params = faiss.SearchParametersHNSW()
            params.efSearch = max(self._ef_search, k)
        elif self._dead_filter is not None:
            params = faiss.SearchParameters()
        else:
            return None
        if self._dead_filter is not None:
            params.sel = self._dead_filter
        return params

    def _bury(self, positions: list[int]) -> None:
        import numpy as np

        if not positions:
            return
        for pos in positions:
            entry_id = self._slots[pos]
            if entry_id is not None and self._where.get(entry_id) == pos:
                del self._where[entry_id]
            self._slots[pos] = None
        self._dead.update(positions)
        dead = np.fromiter(self._dead, dtype=np.int64, count=len(self._dead))
        batch = self._faiss.IDSelectorBatch(dead)
        # IDSelectorNot does not own the selector it wraps: keep the inner one alive beside it.
        self._dead_filter = self._faiss.IDSelectorNot(batch)
        self._dead_filter.inner_ref = batch

    def _maybe_compact(self) -> None:
        if len(self._dead) >= _MIN_COMPACT and len(self._dead) > len(self._where):
            self._rebuild(HNSW if len(self._where) > self.exact_limit else EXACT)

    def _rebuild(self, kind: str) -> None:
        """Move the live entries into a fresh index of ``kind``, dropping tombstones."""
        ids, vecs = self.vectors()
        index = self._new_index(kind)
        if ids:
            index.add(vecs)
        self._index, self.kind = index, kind
        self._slots = list(ids)
        self._where = {entry_id: n for n, entry_id in enumerate(ids)}
        self._dead = set()
        self._dead_filter = None


class SemanticIndex:
    """``Scope -> VectorIndex``: each scope's index is created on its first add, with that add's dimension.

    Searching a scope that holds nothing returns empty neighbour lists; removing from it is a no-op. The
    keyword arguments are passed to every ``VectorIndex``. Safe to share between threads.
    """

    def __init__(self, **index_options: Any) -> None:
        VectorIndex(1, **index_options)  # validate the options now, not on the first add
        self._options = index_options
        self._indexes: dict[Scope, VectorIndex] = {}
        self._lock = threading.Lock()

    def add(self, scope: Scope, ids: Sequence[str], vecs: Any) -> None:
        check_scope(scope)
        arr = check_vectors(vecs, None)
        index = self._indexes.get(scope)
        if index is None:
            with self._lock:
                index = self._indexes.get(scope)
                if index is None:
                    index = self._indexes[scope] = VectorIndex(arr.shape[1], **self._options)
        index.add(ids, arr)

    def remove(self, scope: Scope, ids: Sequence[str]) -> None:
        check_scope(scope)
        index = self._indexes.get(scope)
        if index is not None:
            index.remove(ids)

    def search(self, scope: Scope, vecs: Any, k: int) -> list[list[Neighbour]]:
        check_scope(scope)
        index = self._indexes.get(scope)
        if index is None:
            if not isinstance(k, int) or k < 1:
                raise ValueError(f"k must be a positive int, got {k!r}")
            return [[] for _ in range(check_vectors(vecs, None).shape[0])]
        return index.search(vecs, k)

    def vector(self, scope: Scope, entry_id: str) -> np.ndarray:
        """The stored vector of ``entry_id`` in ``scope``; ``KeyError`` if that scope does not hold it."""
        index = self._indexes.get(scope)
        if index is None:
            raise KeyError(entry_id)
        return index.vector(entry_id)

    def index(self, scope: Scope) -> VectorIndex | None:
        """The scope's ``VectorIndex``, or ``None`` before its first add."""
        return self._indexes.get(scope)

    def scopes(self) -> list[Scope]:
        """The scopes that hold at least one entry."""
        return [scope for scope, index in list(self._indexes.items()) if len(index)]

    def drop(self, scope: Scope) -> None:
        """Forget a scope's index entirely."""
        with self._lock:
            self._indexes.pop(scope, None)

    def __len__(self) -> int:
        return sum(len(index) for index in list(self._indexes.values()))
