"""L3: entries in a local diskcache directory (SQLite index, large values in their own files)."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import sqlite3
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import diskcache

from .._codec import check_keys, check_ns
from .._secret import key_file_secret
from .._types import L3, CacheKey, Entry, Namespace
from ..errors import StoreConfigError, TierUnavailable
from ._base import FaultHook, log_fault
from ._blob import BlobTier

log = logging.getLogger("evocache.controller.tiers.disk")

_BACKEND_ERRORS = (diskcache.Timeout, sqlite3.Error, OSError)
# What diskcache raises on an index altered behind its back: it unpacks the rows it selects as exactly one (two
# rows for one key once its unique index is dropped) and adds up settings it reads back (a planted text value).
_MALFORMED_INDEX = (ValueError, TypeError)

# The value file names diskcache makes (Disk.filename): two hex directory levels, then 28 hex digits.
_VALUE_FILE_RE = re.compile(r"[0-9a-f]{2}[/\\][0-9a-f]{2}[/\\][0-9a-f]{28}\.val")


class MalformedRow(ValueError):
    """A row of the disk index that this tier cannot have written: a mode other than raw bytes or a value file,
    a value that is not bytes, a key stored pickled, or a value file that is not one this tier wrote (a name
    outside the store, a link, a special file, a file larger than the store)."""


class BytesDisk(diskcache.Disk):
    """diskcache's serialisation restricted to bytes: keys are strings, values bytes (inline, or in a value
    file past ``min_file_size``). Nothing is ever pickled or unpickled.

    diskcache's own ``Disk`` unpickles any row whose mode column says pickle, so whoever can write the index
    file could run code in every process that reads it. Here every row that does not look like one this class
    wrote raises ``MalformedRow`` on read, before any decoding. A value file is only opened or removed when its
    name has the form ``Disk.filename`` gives and both of its directory levels are directories of the store
    itself, not links (no path leads out of the directory); it is read only when it is a regular file of at
    most ``max_file_size`` bytes (a link to ``/dev/zero``, a FIFO or a sparse terabyte is never read), and
    never through a link. A value is never written through a linked directory either.
    """

    def __init__(self, directory: str, max_file_size: int = 2**30, **settings: int) -> None:
        super().__init__(directory, **settings)
        self.max_file_size = max_file_size

    def put(self, key: object) -> tuple[object, bool]:
        if type(key) is not str:
            raise TypeError(f"disk keys are str, not {type(key).__name__}")
        return key, True

    def get(self, key: object, raw: bool) -> object:
        if not raw or type(key) is not str:
            raise MalformedRow(f"a key stored as {'pickle' if not raw else type(key).__name__}")
        return key

    def store(self, value: object, read: bool, key: object = diskcache.core.UNKNOWN) -> tuple:
        if type(value) is not bytes or read:
            raise TypeError(f"disk values are bytes, not {type(value).__name__}")
        return super().store(value, False, key)

    def filename(self, key: object = diskcache.core.UNKNOWN, value: object = diskcache.core.UNKNOWN) -> tuple:
        filename, full_path = super().filename(key, value)
        for level in self._levels(filename):
            if os.path.lexists(level) and not _is_directory(level):
                # diskcache would create the file through it: a planted link would place values elsewhere.
                raise OSError(errno.ENOTDIR, "a value directory of the store is not a directory", level)
        return filename, full_path

    def fetch(self, mode: int, filename: str | None, value: object, read: bool) -> bytes:
        if read:
            raise TypeError("values are read whole")
        if mode == diskcache.core.MODE_RAW:
            if type(value) is not bytes:
                raise MalformedRow(f"an inline value of type {type(value).__name__}")
            return value
        if mode == diskcache.core.MODE_BINARY:
            if value is not None:
                raise MalformedRow("a value file row that holds an inline value too")
            return self._read(self._checked_path(filename))
        raise MalformedRow(f"a row of mode {mode!r} (only raw bytes, 1, and value files, 2, are written)")

    def remove(self, file_path: str) -> None:
        # Called with the file name of every deleted or culled row, planted ones included.
        try:
            path = self._checked_path(file_path)
        except (MalformedRow, OSError):
            return
        with contextlib.suppress(OSError):  # as diskcache: another process may have removed it first
            os.remove(path)
        for level in reversed(self._levels(file_path)):  # the two levels, if now empty; never the store
            with contextlib.suppress(OSError):
                os.rmdir(level)

    def _levels(self, filename: str) -> tuple[str, str]:
        first = os.path.join(self._directory, filename[:2])
        return first, os.path.join(first, filename[3:5])

    def _checked_path(self, filename: object) -> str:
        """The full path of a value file name this class can have made; ``MalformedRow`` for any other name,
        or one whose directory levels are not directories of the store (a link). ``OSError`` when absent."""
        if not (isinstance(filename, str) and _VALUE_FILE_RE.fullmatch(filename)):
            raise MalformedRow(f"a value file named {filename!r}")
        for level in self._levels(filename):
            if not _is_directory(level):
                raise MalformedRow(f"a value file under {level!r}, which is not a directory of the store")
        return os.path.join(self._directory, filename)

    def _read(self, path: str) -> bytes:
        """The bytes of the regular file at ``path``, at most ``max_file_size`` of them; ``MalformedRow`` for
        a link, a special file or a larger file (checked before reading, so neither is waited on or read)."""
        try:
            fd = os.open(path, os.O_RDONLY | _NO_FOLLOW | _NON_BLOCKING)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise MalformedRow(f"a value file {path!r} that is a link") from exc
            raise  # absent: deleted by another process meanwhile; diskcache reads that as a miss
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise MalformedRow(f"a value file {path!r} that is not a regular file")
            if info.st_size > self.max_file_size:
                raise MalformedRow(f"a value file of {info.st_size} bytes, more than the store holds")
        except BaseException:
            os.close(fd)
            raise
        with os.fdopen(fd, "rb") as fh:
            data = fh.read(self.max_file_size + 1)
        if len(data) > self.max_file_size:
            raise MalformedRow(f"a value file of over {self.max_file_size} bytes, more than the store holds")
        return data


_NO_FOLLOW = os.O_NOFOLLOW if hasattr(os, "O_NOFOLLOW") else 0  # POSIX; elsewhere _is_directory guards
_NON_BLOCKING = os.O_NONBLOCK if hasattr(os, "O_NONBLOCK") else 0


def _is_directory(path: str) -> bool:
    """Whether ``path`` is a directory itself (a link to one is not); False when absent."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


# The settings diskcache keeps in its index's Settings table. DiskTier opens the index with every one given,
# so that no value is taken from the file, and refuses an index holding any other: diskcache would run a
# `sqlite_*` one as a PRAGMA and hand a `disk_*` one to the Disk as a keyword.
_KNOWN_SETTINGS = frozenset((*diskcache.DEFAULT_SETTINGS, *diskcache.core.METADATA, "disk_max_file_size"))


class _Index(diskcache.Cache):
    """diskcache's ``Cache``, taking no SQLite setting from the index file. Every new connection (each thread,
    each process) re-applies the ``sqlite_*`` settings of the Settings table as PRAGMAs: here a known one runs
    with the value ``DiskTier`` opens the index with, whatever the file says, and any other is skipped (a
    planted ``temp_store_directory`` would put SQLite's files outside the store)."""

    def reset(self, key: str, value: object = diskcache.core.ENOVAL, update: bool = True) -> object:
        if key.startswith("sqlite_"):
            if key not in diskcache.DEFAULT_SETTINGS:
                log.warning("l3: the index names a setting diskcache never writes, %r; ignored", key)
                return None
            value = diskcache.DEFAULT_SETTINGS[key]
        return super().reset(key, value, update)


def _check_settings(directory: str) -> None:
    """``StoreConfigError`` when the index in ``directory`` holds a setting diskcache never writes."""
    path = os.path.join(directory, diskcache.core.DBNAME)
    if not os.path.isfile(path):
        return
    try:
        with contextlib.closing(sqlite3.connect(path, timeout=1.0)) as db:
            keys = [key for (key,) in db.execute("SELECT key FROM Settings")]
    except sqlite3.OperationalError as exc:
        if "no such table" in str(exc):
            return  # a new index: diskcache creates the table
        raise StoreConfigError(f"cannot open the disk tier at {directory}: {exc}") from exc
    except sqlite3.Error as exc:
        raise StoreConfigError(f"cannot open the disk tier at {directory}: {exc}") from exc
    unknown = sorted(str(key) for key in keys if key not in _KNOWN_SETTINGS)
    if unknown:
        raise StoreConfigError(
            f"cannot open the disk tier at {directory}: its index holds settings diskcache never writes "
            f"({', '.join(map(repr, unknown[:5]))}): the file was altered; remove {path} to start afresh"
        )


# Bytes held, read from diskcache's index. Values under its min_file_size sit inline in the `value` column
# (their `size` column is 0); larger ones live in files whose length is the `size` column.
_USAGE_SQL = (
    "SELECT COALESCE(SUM(CASE WHEN filename IS NULL THEN length(value) ELSE size END), 0) FROM Cache"
    " WHERE (expire_time IS NULL OR expire_time > ?)"
)


class DiskTier(BlobTier):
    """Entries in ``directory``, bounded to about ``size_limit`` bytes.

    diskcache provides the atomic writes (a value's file is written before the index row that points at it,
    inside one SQLite transaction) and the bound: past ``size_limit`` it culls entries in
    ``eviction_policy`` order (default least-recently-stored, which keeps reads free of index writes).
    Entries are stored as signed bytes (``BytesDisk``: never pickled; a row it cannot have written is a
    deleted, reported miss) under ``"<ns>:<key>"`` and tagged with their namespace, which is what
    ``usage(ns)`` sums (stored bytes: entry plus the codec's header and checksum). ``timeout`` bounds how long
    a call waits for a SQLite lock held by another process. ``secret`` signs the entries
    (``_codec.EntryCodec``); without one, the tier uses (and on first use creates) the key file
    ``evocache.key`` in ``directory``.

    SQLite errors, OS errors (``ENOSPC`` included), lock timeouts and an index diskcache cannot read (rows it
    cannot have written, such as two for one key) raise ``TierUnavailable``. A directory
    that cannot be opened raises ``StoreConfigError`` at construction.
    """

    name = L3

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        size_limit: int = 2**30,
        eviction_policy: str = "least-recently-stored",
        timeout: float = 0.1,
        secret: bytes | None = None,
        clock: Callable[[], float] = time.time,
        on_fault: FaultHook = log_fault,
    ) -> None:
        super().__init__(
            secret=key_file_secret(directory) if secret is None else secret, clock=clock, on_fault=on_fault
        )
        if eviction_policy not in diskcache.EVICTION_POLICY:
            known = ", ".join(sorted(diskcache.EVICTION_POLICY))
            raise ValueError(f"unknown eviction_policy {eviction_policy!r}; known: {known}")
        if size_limit <= 0:
            raise ValueError(f"size_limit must be positive, not {size_limit}")
        try:
            _check_settings(os.fspath(directory))
            self._cache = _Index(
                os.fspath(directory),
                timeout=timeout,
                disk=BytesDisk,
                **{
                    **diskcache.DEFAULT_SETTINGS,
                    "size_limit": size_limit,
                    "eviction_policy": eviction_policy,
                    "tag_index": True,
                    "statistics": False,
                    "disk_max_file_size": size_limit,  # no value file is larger than the store
                },
            )
        except _BACKEND_ERRORS as exc:
            raise StoreConfigError(f"cannot open the disk tier at {directory}: {exc}") from exc

    @property
    def directory(self) -> str:
        return self._cache.directory

    def set_eviction(self, eviction_policy: str) -> None:
        """Switch diskcache's eviction order (a policy document named another); entries stay."""
        if eviction_policy not in diskcache.EVICTION_POLICY:
            known = ", ".join(sorted(diskcache.EVICTION_POLICY))
            raise ValueError(f"unknown eviction_policy {eviction_policy!r}; known: {known}")
        with self._backend("set"):
            if self._cache.eviction_policy != eviction_policy:
                self._cache.reset("eviction_policy", eviction_policy)

    def _fetch(self, ns: Namespace, keys: Sequence[CacheKey]) -> list[bytes | None]:
        with self._backend("get"):
            return [self._fetch_row(ns, key) for key in keys]

    def _fetch_one(self, ns: Namespace, key: CacheKey) -> bytes | None:
        with self._backend("get"):
            return self._fetch_row(ns, key)

    def _fetch_row(self, ns: Namespace, key: CacheKey) -> bytes | None:
        """The stored bytes of ``key``, or ``None``; a malformed row is deleted, reported and a miss."""
        try:
            return self._cache.get(f"{ns}:{key}")
        except MalformedRow as exc:
            log.warning("l3: entry %s/%s: %s; dropped", ns, key, exc)
            self._cache.delete(f"{ns}:{key}")
            self.on_fault(L3, "corrupt")
            return None

    def delete(self, ns: Namespace, keys: Sequence[CacheKey]) -> int:
        check_ns(ns)
        check_keys(keys)
        with self._backend("delete"):
            return sum(bool(self._cache.delete(f"{ns}:{key}")) for key in keys)

    def usage(self, ns: Namespace | None = None) -> int:
        # diskcache has no per-tag size query, so this reads its index through its own connection (a private
        # attribute). Expired rows it has not culled yet are not counted: nothing can read them any more.
        if ns is None:
            sql, params = _USAGE_SQL, (time.time(),)
        else:
            check_ns(ns)
            sql, params = _USAGE_SQL + " AND tag = ?", (time.time(), ns)
        with self._backend("usage"):
            ((used,),) = self._cache._sql(sql, params).fetchall()
        return int(used)

    def close(self) -> None:
        self._cache.close()

    def _store(self, ns: Namespace, items: Sequence[tuple[CacheKey, Entry]], now: float) -> None:
        encode = self._codec.encode
        blobs = [(key, entry, encode(ns, key, entry)) for key, entry in items]
        with self._backend("set"), self._cache.transact():
            for key, entry, blob in blobs:
                expire = None if entry.expires_at is None else entry.expires_at - now
                self._cache.set(f"{ns}:{key}", blob, expire=expire, tag=ns)

    @contextmanager
    def _backend(self, op: str) -> Iterator[None]:
        try:
            yield
        except (*_BACKEND_ERRORS, *_MALFORMED_INDEX) as exc:
            raise TierUnavailable(L3, f"{op}: {type(exc).__name__}: {exc}") from exc
