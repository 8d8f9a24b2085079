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

import json
import logging
import threading
import time
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from .._codec import check_ns

if TYPE_CHECKING:
    import numpy as np  # numpy loads only when vectors are made: `evocache policy check` never needs it

__all__ = [
    "Change",
    "IndexOptions",
    "Neighbour",
    "Scope",
    "ScopedIndex",
    "SemanticIndex",
    "SharedEntry",
    "VectorIndex",
]

log = logging.getLogger("evocache.controller.semantic.index")

EXACT = "exact"
HNSW = "hnsw"

# Unit rows only: a vector off by more than this was not normalised, and its inner products are not cosines.
NORM_TOLERANCE = 1e-3
# Removed entries stay in the faiss index as tombstones (HNSW cannot delete); it is rebuilt from the live
# vectors once tombstones outnumber live entries (and are at least this many), so removals cost O(1) amortised.
_MIN_COMPACT = 64
_NO_META: Mapping[str, Any] = types.MappingProxyType({})  # one shared, read-only: most entries have none


class Scope(NamedTuple):
    """One index: a neighbour never crosses it.

    ``namespace`` is the tenant namespace (``[A-Za-z0-9._-]{1,128}``); ``boundary`` identifies the contract
    (function identity, model, revision, generation parameters digest) and the embedder's ``name``. Any
    change in either gives a different scope and so an empty index.
    """

    namespace: str
    boundary: str

    @classmethod
    def of(cls, namespace: str, embedder: str, **contract: str) -> Scope:
        """The scope of a contract: ``boundary`` binds the embedder's name and every ``contract`` part (function
        identity, model, revision, parameters digest, ...) unambiguously (sorted JSON), so two contracts that
        differ in any part, or in the embedder, never share an index.

            Scope.of("tenant-a", embedder.name, fn=fn_id, model="m1", revision="7", params=params_digest)
        """
        for key, value in contract.items():
            if not isinstance(value, str):
                raise TypeError(f"contract part {key}={value!r} must be a str")
        return cls(
            namespace, json.dumps({"embedder": embedder, **contract}, sort_keys=True, separators=(",", ":"))
        )


class Neighbour(NamedTuple):
    entry_id: str
    similarity: float
    """Cosine similarity: inner product of unit vectors, in [-1, 1]."""


class SharedEntry(NamedTuple):
    """What an index keeps of an entry besides its vector: the caller's metadata and its expiry."""

    meta: Mapping[str, Any]
    expires_at: float | None


class Change(NamedTuple):
    """A change that reached an index from elsewhere (another replica, an expiry, a rebuild).

    ``kind`` is ``add`` or ``remove`` (``ids`` of ``scope``), or ``reset``: the whole local index was rebuilt
    from Redis (``scope`` and ``ids`` empty); a listener that keeps per-entry state should re-read it.
    """

    kind: str
    scope: Scope | None
    ids: tuple[str, ...]


class ScopedIndex(Protocol):
    """The vectors of every scope, searched one scope at a time: what ``SemanticCache`` reads and writes.

    ``add`` stores (or replaces) entries with their metadata and, where the index keeps expiries, when each
    expires; ``get`` is what it keeps of an entry besides the vector (None when it does not hold it);
    ``listen(fn)`` has ``fn(Change)`` called for changes made without the caller (expiries, other replicas).
    ``SemanticIndex`` (this process) and ``SharedIndex`` (shared through Redis, with expiry) implement it.
    """

    def add(
        self,
        scope: Scope,
        ids: Sequence[str],
        vecs: Any,
        *,
        metas: Sequence[Mapping[str, Any]] | None = None,
        expires_at: Sequence[float | None] | None = None,
    ) -> None: ...

    def remove(self, scope: Scope, ids: Sequence[str]) -> None: ...

    def search(self, scope: Scope, vecs: Any, k: int) -> list[list[Neighbour]]: ...

    def vector(self, scope: Scope, entry_id: str) -> np.ndarray: ...

    def get(self, scope: Scope, entry_id: str) -> SharedEntry | None: ...

    def scopes(self) -> list[Scope]: ...

    def listen(self, fn: Callable[[Change], None]) -> None: ...

    def close(self) -> None: ...

    def __len__(self) -> int: ...


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
    off = np.abs(norms - 1.0) > NORM_TOLERANCE
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


@dataclass(frozen=True, slots=True)
class IndexOptions:
    """How every scope's ``VectorIndex`` is built: exact (``IndexFlatIP``) up to ``exact_limit`` live entries,
    HNSW beyond, with ``hnsw_m`` links per node, ``ef_construction`` when building and ``ef_search`` at query
    time (raised to ``k`` when ``k`` is larger). ``background``: rebuilds (the migration to HNSW, compactions)
    run on a thread of their own while the current index serves; ``False`` rebuilds inside the write that
    calls for it.

    A misspelt option is a ``TypeError``; a value out of range a ``ValueError`` naming the option.
    """

    exact_limit: int = 10_000
    hnsw_m: int = 32
    ef_construction: int = 80
    ef_search: int = 64
    background: bool = True

    def __post_init__(self) -> None:
        counts = (
            ("exact_limit", self.exact_limit, 0),
            ("hnsw_m", self.hnsw_m, 2),
            ("ef_construction", self.ef_construction, 1),
            ("ef_search", self.ef_search, 1),
        )
        for name, value, least in counts:
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"IndexOptions.{name} must be an int, got {value!r}")
            if value < least:
                raise ValueError(f"IndexOptions.{name} must be >= {least}, got {value}")
        if not isinstance(self.background, bool):
            raise TypeError(f"IndexOptions.background must be a bool, got {self.background!r}")


class VectorIndex:
    """The vectors of one scope, searchable by cosine similarity; safe to share between threads.

    Exact up to ``options.exact_limit`` live entries, HNSW beyond (``IndexOptions``). Adding an id that is
    already present replaces its vector. Removing an unknown id is a no-op. Bad input (wrong shape or
    dimension, rows that are not unit vectors, NaN, duplicate ids in one call) raises ``ValueError`` and changes
    nothing.

    Rebuilds (the migration to HNSW when an add crosses ``exact_limit``, and the compaction that drops
    tombstones once they outnumber live entries) take seconds at 10^4-10^5 entries, so with ``background``
    (the default) a thread builds the new index from a snapshot while the current one goes on serving
    searches and taking writes; the writes made meanwhile are replayed onto the new index when it is swapped
    in. ``wait_rebuilt()`` waits for a rebuild in flight. ``background=False`` rebuilds inside the call.
    A background rebuild that fails is logged and counted (``rebuild_errors``, and ``on_rebuild_error()`` is
    called), and the current index goes on serving; the next write that calls for a rebuild tries again.
    """

    def __init__(
        self,
        dim: int,
        options: IndexOptions = IndexOptions(),
        *,
        on_rebuild_error: Callable[[], None] | None = None,
    ) -> None:
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim must be a positive int, got {dim!r}")
        if not isinstance(options, IndexOptions):
            raise TypeError(f"options must be an IndexOptions, got {type(options).__name__}")
        import faiss

        self._faiss = faiss
        self.dim = dim
        self.exact_limit = options.exact_limit
        self._hnsw_m = options.hnsw_m
        self._ef_construction = options.ef_construction
        self._ef_search = options.ef_search
        self._background = options.background
        self._touched: list[str] | None = None  # ids written since a rebuild's snapshot; None: no rebuild
        self._rebuilder: threading.Thread | None = None
        self._lock = threading.RLock()
        # faiss labels are positions in add order; a removed entry leaves a tombstone (None) at its position.
        self._slots: list[str | None] = []
        self._where: dict[str, int] = {}
        self._dead: set[int] = set()
        self._dead_bits: np.ndarray | None = None  # bit i set: position i is a tombstone
        self._dead_filter: Any = (
            None  # faiss selector of the live positions; None while there are no tombstones
        )
        self.kind = EXACT
        self.rebuilds = 0  # rebuilds swapped in (migrations and compactions)
        self.rebuild_errors = 0  # background rebuilds that failed (the current index stayed)
        self._on_rebuild_error = on_rebuild_error
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
            start = len(self._slots)
            self._index.add(arr)
            self._slots.extend(items)
            self._where.update((entry_id, start + n) for n, entry_id in enumerate(items))
            self._wrote(items)

    def remove(self, ids: Sequence[str]) -> None:
        items = _check_ids(ids)
        with self._lock:
            gone = [i for i in dict.fromkeys(items) if i in self._where]
            self._bury([self._where.pop(i) for i in gone])
            self._wrote(gone)

    def wait_rebuilt(self, timeout: float | None = None) -> bool:
        """Wait until no rebuild is in flight (one may chain another); ``False`` if one still is after
        ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._touched is not None:
            thread = self._rebuilder
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            # A rebuilder not started yet (its writer is between making and starting it) cannot be joined.
            if thread is not None and thread.ident is not None:
                thread.join(None if left is None else min(left, 0.1))
            else:  # or a rebuild inside another thread's call (background=False): it ends with that call
                time.sleep(0.001)
        return True

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
        """(Under the lock.) Make ``positions`` tombstones: out of ``_where`` and masked out of searches."""
        import numpy as np

        if not positions:
            return
        for pos in positions:
            entry_id = self._slots[pos]
            if entry_id is not None and self._where.get(entry_id) == pos:
                del self._where[entry_id]
            self._slots[pos] = None
        self._dead.update(positions)
        # A bitmap the faiss selector reads in place: burying is O(1) per entry, whatever the tombstone count.
        need = len(self._slots) // 8 + 1
        if self._dead_bits is None or len(self._dead_bits) < need:
            bits = np.zeros(2 * need, dtype=np.uint8)
            if self._dead_bits is not None:
                bits[: len(self._dead_bits)] = self._dead_bits
            inner = self._faiss.IDSelectorBitmap(8 * len(bits), self._faiss.swig_ptr(bits))
            self._dead_filter = self._faiss.IDSelectorNot(inner)
            # The selectors point into ``bits`` and IDSelectorNot does not own ``inner``: keep both alive.
            self._dead_filter.refs = (inner, bits)
            self._dead_bits = bits
        pos = np.asarray(positions, dtype=np.int64)
        np.bitwise_or.at(self._dead_bits, pos >> 3, np.left_shift(1, pos & 7).astype(np.uint8))

    def _wrote(self, ids: list[str]) -> None:
        """After a write (under the lock): log it for a rebuild in flight, or start one if it is due."""
        if self._touched is not None:
            self._touched.extend(ids)
        elif self.kind == EXACT and len(self._where) > self.exact_limit:
            self._start_rebuild(HNSW)
        elif len(self._dead) >= _MIN_COMPACT and len(self._dead) > len(self._where):
            self._start_rebuild(HNSW if len(self._where) > self.exact_limit else EXACT)

    def _start_rebuild(self, kind: str) -> None:
        ids, vecs = self.vectors()
        self._touched = []
        if not self._background:
            self._swap_in(kind, ids, self._build(kind, vecs))
            return
        self._rebuilder = threading.Thread(
            target=self._rebuild_in_background,
            args=(kind, ids, vecs),
            name="evocache-index-rebuild",
            daemon=True,
        )
        self._rebuilder.start()

    def _rebuild_in_background(self, kind: str, ids: list[str], vecs: np.ndarray) -> None:
        try:
            # Without the lock: searches and writes go on against the current index meanwhile.
            index = self._build(kind, vecs)
        except Exception:  # out of memory, say: keep serving from the current index, rebuild on a later write
            log.exception("rebuilding a %d-entry index as %s failed; the current one stays", len(ids), kind)
            with self._lock:
                self.rebuild_errors += 1  # before the rebuild is over: wait_rebuilt() returns after it
                if self._on_rebuild_error is not None:
                    self._on_rebuild_error()
                self._touched = None
            return
        with self._lock:
            self._swap_in(kind, ids, index)

    def _build(self, kind: str, vecs: np.ndarray) -> Any:
        index = self._new_index(kind)
        if len(vecs):
            index.add(vecs)
        return index

    def _swap_in(self, kind: str, ids: list[str], index: Any) -> None:
        """(Under the lock.) Replay onto ``index``, built from the snapshot ``ids``, the writes made since, and
        make it the index: an id written since is taken out of the snapshot and, if live now, added again."""
        import numpy as np

        touched, self._touched = self._touched or [], None
        slots: list[str | None] = list(ids)
        where = {entry_id: n for n, entry_id in enumerate(ids)}
        dead: list[int] = []
        again: list[str] = []
        for entry_id in dict.fromkeys(touched):
            pos = where.pop(entry_id, None)
            if pos is not None:
                slots[pos] = None
                dead.append(pos)
            if entry_id in self._where:
                again.append(entry_id)
        if again:
            positions = np.array([self._where[entry_id] for entry_id in again], dtype=np.int64)
            index.add(self._index.reconstruct_batch(positions))
            where.update((entry_id, len(slots) + n) for n, entry_id in enumerate(again))
            slots.extend(again)
        self._index, self.kind, self._slots, self._where = index, kind, slots, where
        self.rebuilds += 1
        self._dead, self._dead_bits, self._dead_filter = set(), None, None
        self._bury(dead)
        self._wrote([])  # the writes replayed here may call for the next rebuild already


class SemanticIndex:
    """``Scope -> VectorIndex``: each scope's index is created on its first add, with that add's dimension,
    and dropped when a remove empties it.

    Searching a scope that holds nothing returns empty neighbour lists; removing from it is a no-op. Every
    ``VectorIndex`` is built with ``options``. Safe to share between threads.

    Each entry's metadata (``add(metas=)``) is kept with it (``get``). Nothing changes it but its caller, so
    ``listen`` has nothing to tell; it keeps no expiry (an ``expires_at`` is a ``ValueError``: ``SharedIndex``,
    embedded with ``url=None``, keeps them).

    ``rebuild_errors`` counts the failed background rebuilds of its scopes' indexes (``VectorIndex``), those
    of scopes dropped since included; ``on_rebuild_error()`` is called on each.
    """

    def __init__(
        self, options: IndexOptions = IndexOptions(), *, on_rebuild_error: Callable[[], None] | None = None
    ) -> None:
        if not isinstance(options, IndexOptions):
            raise TypeError(f"options must be an IndexOptions, got {type(options).__name__}")
        self._options = options
        self.rebuild_errors = 0
        self._on_rebuild_error = on_rebuild_error
        self._indexes: dict[Scope, VectorIndex] = {}
        self._metas: dict[Scope, dict[str, Mapping[str, Any]]] = {}
        self._lock = threading.Lock()

    def add(
        self,
        scope: Scope,
        ids: Sequence[str],
        vecs: Any,
        *,
        metas: Sequence[Mapping[str, Any]] | None = None,
        expires_at: Sequence[float | None] | None = None,
    ) -> None:
        check_scope(scope)
        arr = check_vectors(vecs, None)
        if expires_at is not None and any(deadline is not None for deadline in expires_at):
            raise ValueError("SemanticIndex keeps no expiry: use SharedIndex (url=None keeps it in this process)")
        if metas is not None:
            metas = [dict(meta) for meta in metas]
            if len(metas) != arr.shape[0]:
                raise ValueError(f"{len(metas)} metas for {arr.shape[0]} vectors")
        while True:
            index = self._indexes.get(scope)
            if index is None:
                with self._lock:
                    index = self._indexes.get(scope)
                    if index is None:
                        index = self._indexes[scope] = VectorIndex(
                            arr.shape[1], self._options, on_rebuild_error=self._rebuild_failed
                        )
            index.add(ids, arr)
            # A remove that emptied the scope may have dropped this index meanwhile: add to its successor.
            # (Checked under the lock remove drops under, so a drop decided before this add is seen here.)
            with self._lock:
                if self._indexes.get(scope) is index:
                    held = self._metas.setdefault(scope, {})
                    for i, entry_id in enumerate(ids):
                        held[entry_id] = _NO_META if metas is None else metas[i]
                    return

    def _rebuild_failed(self) -> None:
        self.rebuild_errors += 1
        if self._on_rebuild_error is not None:
            self._on_rebuild_error()

    def remove(self, scope: Scope, ids: Sequence[str]) -> None:
        """Remove ``ids`` from ``scope`` (unknown ids are ignored); a scope left empty is dropped, so the
        number of indexes held follows the scopes that hold entries, not every scope ever used."""
        check_scope(scope)
        index = self._indexes.get(scope)
        if index is not None:
            index.remove(ids)
            with self._lock:
                held = self._metas.get(scope)
                if held is not None:
                    for entry_id in ids:
                        held.pop(entry_id, None)
                if not len(index) and self._indexes.get(scope) is index:
                    del self._indexes[scope]
                    self._metas.pop(scope, None)

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

    def get(self, scope: Scope, entry_id: str) -> SharedEntry | None:
        """The entry's metadata (no expiry: this index keeps none), or None if ``scope`` does not hold it."""
        meta = self._metas.get(scope, {}).get(entry_id)
        return None if meta is None else SharedEntry(meta, None)

    def listen(self, fn: Callable[[Change], None]) -> None:
        """Nothing changes this index but its caller: ``fn`` is never called."""

    def close(self) -> None:
        """Nothing to release (no thread, no connection)."""

    def index(self, scope: Scope) -> VectorIndex | None:
        """The scope's ``VectorIndex``, or ``None`` before its first add (and after a remove emptied it)."""
        return self._indexes.get(scope)

    def scopes(self) -> list[Scope]:
        """The scopes that hold at least one entry."""
        return [scope for scope, index in list(self._indexes.items()) if len(index)]

    def __len__(self) -> int:
        return sum(len(index) for index in list(self._indexes.values()))
