"""``SharedIndex``: the scoped semantic index, shared by every replica through Redis (embedded without it).

Each replica searches its own in-memory ``SemanticIndex``; Redis holds the shared truth and a stream of
changes. A new replica rebuilds its index from Redis, then follows the stream; so an entry one replica adds
is found by all, and a removal or an expiry anywhere takes the entry out everywhere.

Layout under ``prefix`` (``p``), for a namespace ``ns`` and a boundary whose SHA-256 hex digest is ``b``::

    p:#ns           SET    namespaces that hold semantic entries
    p:#due          ZSET   "ns:b" -> when the scope's earliest expiry is due (ms); 0: check it for emptiness
    p:ns:#scopes    HASH   b -> the boundary itself (checked against its digest when loaded)
    p:ns:b:e        HASH   entry id -> sealed record (expiry, metadata JSON, float32 vector; see
                           ``encode_record``), then its tag
    p:ns:b:x        ZSET   entry id -> expiry deadline (ms) of entries stored with one
    p:#stream       STREAM {op: add, ns, bd, id, rec (sealed)} | {op: del, ns, bd, ids (JSON list), tag}

On a Redis Cluster (a ``redis+cluster://`` url) ``p`` is written as the hash tag ``{p}``: every key of the
index is in one slot, since a write is one transaction over a scope's keys, the registries and the stream
(one primary holds the index; its reads are the followers' loads and stream reads, never a request's).

A write and its stream message go in one MULTI transaction, so a follower never sees one without the other.
Every key of a scope is built from its own namespace and boundary digest, and a stream message is applied
to the scope it names, so nothing of one scope is ever loaded into another's index.

Records and removal messages are signed under the deployment secret (``_signing.IndexSigner``): the tag binds
a record to its scope, its entry id, and its vector, metadata and expiry. Every record is checked before it is
decoded, on load, on follow and on sweep; one that fails (planted, altered, copied from another scope, signed
under another secret) is skipped and counted (``stats().forged``), and left where it is: a replica started
with the wrong secret sees every record fail, and must not wipe the index the others share (the sweep still
removes a due entry whose record fails). A message that fails is skipped and counted. So every replica sharing
a Redis must use the same secret.

Failure behaviour: search never touches Redis. A failed write leaves the entry in the local index only, is
counted (``stats().errors``) and logged, and opens a breaker: writes within ``retry_after`` seconds skip
Redis. The follower thread retries on its own; when Redis answers again it goes on from where it stopped if
the server and the stream are the same, and otherwise (Redis restarted, stream trimmed past it) rebuilds the
local index from Redis, the shared truth, dropping the entries it had only locally.
"""

from __future__ import annotations

import collections
import hashlib
import heapq
import json
import logging
import math
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from .._breaker import Breaker
from .._redis_client import server_run_id
from ._index import (
    NORM_TOLERANCE,
    Change,
    IndexOptions,
    Neighbour,
    Scope,
    SemanticIndex,
    SharedEntry,
    check_scope,
    check_vectors,
)
from ._signing import IndexSigner, check_secret

if TYPE_CHECKING:
    import numpy as np
    import redis

__all__ = ["Change", "SharedEntry", "SharedIndex", "SharedStats"]

log = logging.getLogger("evocache.controller.semantic.shared")

_HEADER = struct.Struct("<dI")  # expires_at (NaN: never), length of the metadata JSON
_SWEEP_BATCH = 512  # entries per scope per sweep step
_SWEEP_SCOPES = 10_000  # scopes per sweep; the rest are due still and come next time

# KEYS: entries hash, expiry zset, stream, the namespace's scopes hash, the namespaces set, the due zset.
# ARGV: ns, boundary digest, stream maxlen, the scope's member in the due zset, the boundary ('': no
# message), the JSON list of the ids to remove and its tag, n, then n pairs (id, its deadline as read), then
# triples (id, deadline as read, deadline to set; '': none) of entries whose deadline the zset has wrong.
# The caller has read the due entries and checked their records (``SharedIndex._sweep_scope``), and signed the
# message that announces their removal; if any of them has another deadline now (a write came in between),
# nothing is done (-1) and the scope stays due for the next sweep. Otherwise it removes them and announces
# them in that one message; moves the scope's due time to its next expiry (or takes it off the due zset when
# none is left); unregisters the scope when it holds nothing (then the namespace when it has no scope left).
# All atomically: an add (one MULTI that registers, stores and sets the due time) lands either before (the
# scope is not empty) or after (it registers it again).
_SWEEP = """
local n = tonumber(ARGV[8])
local ids = {}
for i = 9, 8 + 2 * n, 2 do
  local seen = redis.call('ZSCORE', KEYS[2], ARGV[i])
  if not seen or tonumber(seen) ~= tonumber(ARGV[i + 1]) then
    return -1
  end
  ids[#ids + 1] = ARGV[i]
end
if #ids > 0 then
  redis.call('HDEL', KEYS[1], unpack(ids))
  redis.call('ZREM', KEYS[2], unpack(ids))
  if ARGV[5] ~= '' and redis.call('HEXISTS', KEYS[4], ARGV[2]) == 1 then
    redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', 'op', 'del', 'ns', ARGV[1], 'bd', ARGV[5],
               'ids', ARGV[6], 'tag', ARGV[7])
  end
end
for i = 9 + 2 * n, #ARGV - 2, 3 do
  local seen = redis.call('ZSCORE', KEYS[2], ARGV[i])
  if seen and tonumber(seen) == tonumber(ARGV[i + 1]) then
    if ARGV[i + 2] == '' then
      redis.call('ZREM', KEYS[2], ARGV[i])
    else
      redis.call('ZADD', KEYS[2], ARGV[i + 2], ARGV[i])
    end
  end
end
local next = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
if next[2] then
  redis.call('ZADD', KEYS[6], next[2], ARGV[4])
else
  redis.call('ZREM', KEYS[6], ARGV[4])
end
if redis.call('HLEN', KEYS[1]) == 0 then
  redis.call('DEL', KEYS[2])
  redis.call('HDEL', KEYS[4], ARGV[2])
  if redis.call('HLEN', KEYS[4]) == 0 then
    redis.call('SREM', KEYS[5], ARGV[1])
  end
end
return #ids
"""

# KEYS: entries hash, expiry zset. ARGV: pairs (id, stored record). Deletes each record that is still the one
# given (a write since it was read is left alone); how many.
class SharedStats(NamedTuple):
    errors: int  # Redis calls that failed (writes, reads, rebuilds, sweeps)
    corrupt: int  # records or messages skipped: failed their tag, or could not be decoded or indexed
    applied: int  # stream messages applied
    rebuilds: int  # full rebuilds of the local index from Redis
    connected: bool  # the last Redis call succeeded (always False without Redis)
    forged: int  # of the corrupt ones, those that failed their tag (planted, altered, copied, other secret)
    rebuild_errors: int  # failed background rebuilds of a scope's vector index (the current one stays)


def boundary_digest(boundary: str) -> str:
    return hashlib.sha256(boundary.encode()).hexdigest()


def encode_record(vec: np.ndarray, meta: Mapping[str, Any], expires_at: float | None) -> bytes:
    """``vec`` (one float32 row), ``meta`` (JSON-serialisable) and the expiry, as one byte string."""
    body = json.dumps(meta, separators=(",", ":"), sort_keys=True).encode()
    head = _HEADER.pack(math.nan if expires_at is None else expires_at, len(body))
    return head + body + vec.astype("<f4").tobytes()


def decode_record(raw: bytes) -> tuple[np.ndarray, dict[str, Any], float | None]:
    """Inverse of ``encode_record``; ``ValueError`` for bytes that are not a record."""
    import numpy as np

    if len(raw) < _HEADER.size:
        raise ValueError("record shorter than its header")
    expires_at, n = _HEADER.unpack_from(raw)
    tail = len(raw) - _HEADER.size - n
    if n > len(raw) - _HEADER.size or tail <= 0 or tail % 4:
        raise ValueError("record length does not fit a metadata block and a float32 vector")
    meta = json.loads(raw[_HEADER.size : _HEADER.size + n])
    if not isinstance(meta, dict):
        raise ValueError("record metadata is not a JSON object")  # noqa: TRY004 - bad stored data, not a bad argument
    vec = np.frombuffer(raw, dtype="<f4", offset=_HEADER.size + n).astype(np.float32)
    return vec, meta, None if math.isnan(expires_at) else expires_at


class SharedIndex:
    """A ``SemanticIndex`` (same ``add``/``remove``/``search``/``scopes``) with metadata, expiry, and sharing.

    ``url=None`` is the embedded mode: the local index alone, no thread. With a ``url`` and ``follow`` (the
    default), a daemon thread loads every scope from Redis, then applies the stream (blocking reads of
    ``block_ms``) and removes expired entries every ``sweep_interval`` seconds. The constructor waits up to
    ``initial_wait`` seconds for that first load (or its failure) and then returns whatever the state: a
    large index goes on loading behind, and until it is loaded a lookup is only a miss; ``wait_synced()``
    waits for the load. With ``follow=False`` the constructor loads (a failure is counted)
    and the caller drives the rest: ``follow_once()``, ``sweep()``, ``sync()``.

    Entry ids must be unique across replicas (an exact cache key is); re-adding an id replaces it everywhere.
    ``expires_at`` is absolute time on ``clock`` (wall clock by default, so every replica agrees); an expired
    entry is never returned by ``search``. ``listen(fn)`` calls ``fn(Change)`` for changes from elsewhere, on
    the follower's thread. ``index_options`` build the local ``SemanticIndex``.

    With a ``url``, ``secret`` (the deployment secret, at least 16 bytes; the one every replica uses) signs
    what this replica writes to Redis and checks what it reads (module docstring); it is required there.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        secret: bytes | None = None,
        prefix: str = "evc-sem",
        clock: Callable[[], float] = time.time,
        socket_timeout: float = 0.05,
        connect_timeout: float = 0.05,
        retry_after: float = 1.0,
        follow: bool = True,
        block_ms: int = 200,
        sweep_interval: float = 1.0,
        stream_maxlen: int = 100_000,
        initial_wait: float = 2.0,
        index_options: IndexOptions = IndexOptions(),
    ) -> None:
        if not prefix or any(c in prefix for c in "#{} ") or len(prefix) > 64:
            raise ValueError(f"invalid prefix {prefix!r}: 1-64 characters, no '#', braces or spaces")
        if retry_after < 0 or block_ms < 1 or sweep_interval <= 0 or stream_maxlen < 1 or initial_wait < 0:
            raise ValueError(
                "retry_after >= 0, block_ms >= 1, sweep_interval > 0, stream_maxlen >= 1 and initial_wait >= 0"
            )
        if url is not None and secret is None:
            raise TypeError("SharedIndex(url) needs secret=, the deployment secret that signs the shared index")
        self._signer = None if secret is None else IndexSigner(check_secret(secret, "SharedIndex secret"))
        self._prefix = prefix
        self._keys = prefix  # what every Redis key starts with: the prefix, or on a cluster its hash tag
        self._clock = clock
        self._retry_after = retry_after
        self._block_ms = block_ms
        self._sweep_interval = sweep_interval
        self._maxlen = stream_maxlen
        self._index_options = index_options
        self._index = self._new_index()
        self._entries: dict[Scope, dict[str, SharedEntry]] = {}
        self._due: list[tuple[float, Scope, str]] = []  # heap of (expiry, scope, id): the local expiry
        self._next_expiry = 0.0
        self._lock = threading.RLock()  # local state: the index, the entries, the stream position
        self._listeners: list[Callable[[Change], None]] = []
        self._counts = dict.fromkeys((f for f in SharedStats._fields if f != "connected"), 0)
        self._connected = False
        self._down_logged = False
        self._breaker = Breaker(retry_after, clock=clock)  # writes skip Redis while it is open
        self._last_id = b"0-0"
        self._run_id: str | None = None
        self._synced = False
        self._loaded = threading.Event()  # set by the first successful load from Redis
        self._first_try = threading.Event()  # set once the follower's first load has succeeded or failed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._client: redis.Redis | None = None
        self._reader: redis.Redis | None = None
        if url is None:
            return
        from .._redis_client import REDIS_ERRORS, connect, hash_tag, is_cluster

        self._redis_errors = REDIS_ERRORS
        if is_cluster(url):
            # Every write is one MULTI over a scope's keys, the namespace registry and the one stream, and a
            # sweep is one script over the same: on a cluster the whole index is one hash slot.
            self._keys = hash_tag(prefix)
        # Writes are on the request path: short timeouts, no redis-py retries (the breaker decides when to
        # try again). The follower blocks in XREAD, so its client waits longer than a block.
        self._client = connect(url, socket_timeout=socket_timeout, connect_timeout=connect_timeout, retries=0)
        self._reader = connect(
            url, socket_timeout=block_ms / 1000 + 2.0, connect_timeout=max(connect_timeout, 1.0), retries=0
        )
        self._sweep_script = self._reader.register_script(_SWEEP)
        if not follow:
            self.sync()
        else:
            self._thread = threading.Thread(target=self._run, name=f"evocache-semantic-{prefix}", daemon=True)
            self._thread.start()
            self._first_try.wait(initial_wait)

    # -- the index interface (local; never raises for Redis) ---------------------------------------------------

    def add(
        self,
        scope: Scope,
        ids: Sequence[str],
        vecs: Any,
        *,
        metas: Sequence[Mapping[str, Any]] | None = None,
        expires_at: Sequence[float | None] | None = None,
    ) -> None:
        """Add (or replace) entries here and in Redis. Bad input raises ``ValueError``/``TypeError`` and
        changes nothing; metadata must be JSON-serialisable (``TypeError`` otherwise)."""
        check_scope(scope)
        arr = check_vectors(vecs, None)
        ids = list(ids)
        metas = [{} for _ in ids] if metas is None else list(metas)
        deadlines = [None] * len(ids) if expires_at is None else list(expires_at)
        if not len(ids) == len(metas) == len(deadlines) == arr.shape[0]:
            raise ValueError(
                f"{len(ids)} ids, {len(metas)} metas, {len(deadlines)} expiries, {arr.shape[0]} vectors"
            )
        records = [
            encode_record(arr[i], metas[i], deadlines[i]) for i in range(len(ids))
        ]  # TypeError: not JSON
        if self._signer is not None:
            seal = self._signer.seal
            records = [seal(scope, entry_id, rec) for entry_id, rec in zip(ids, records, strict=True)]
        with self._lock:
            self._index.add(scope, ids, arr)
            held = self._entries.setdefault(scope, {})
            for entry_id, meta, deadline in zip(ids, metas, deadlines, strict=True):
                held[entry_id] = SharedEntry(dict(meta), deadline)
            self._expiring(scope, ids, deadlines)
        if self._client is not None and ids:
            self._write(lambda pipe: self._queue_add(pipe, scope, ids, records, deadlines))
        self._maybe_expire()

    def remove(self, scope: Scope, ids: Sequence[str]) -> None:
        """Remove entries here and in Redis (unknown ids are ignored)."""
        check_scope(scope)
        ids = list(dict.fromkeys(ids))
        self._forget(scope, ids)
        if self._client is not None and ids:
            self._write(lambda pipe: self._queue_remove(pipe, scope, ids))

    def search(self, scope: Scope, vecs: Any, k: int) -> list[list[Neighbour]]:
        """``SemanticIndex.search`` over live entries: expired entries met on the way are forgotten and the
        search is run again, so each row still holds the ``k`` best live entries."""
        self._maybe_expire()
        while True:
            rows = self._index.search(scope, vecs, k)
            now = self._clock()
            held = self._entries.get(scope, {})
            expired = [
                n.entry_id
                for row in rows
                for n in row
                if (e := held.get(n.entry_id)) is not None
                and e.expires_at is not None
                and now >= e.expires_at
            ]
            if not expired:
                return rows
            self._forget(scope, expired)
            self._notify(Change("remove", scope, tuple(expired)))

    def get(self, scope: Scope, entry_id: str) -> SharedEntry | None:
        """The entry's metadata and expiry, or ``None`` if this replica does not hold it (or it expired)."""
        entry = self._entries.get(scope, {}).get(entry_id)
        if entry is None or (entry.expires_at is not None and self._clock() >= entry.expires_at):
            return None
        return entry

    def vector(self, scope: Scope, entry_id: str) -> np.ndarray:
        return self._index.vector(scope, entry_id)

    def scopes(self) -> list[Scope]:
        return self._index.scopes()

    def __len__(self) -> int:
        return len(self._index)

    def listen(self, fn: Callable[[Change], None]) -> None:
        self._listeners.append(fn)

    def stats(self) -> SharedStats:
        return SharedStats(connected=self._connected, **self._counts)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for client in (self._client, self._reader):
            if client is not None:
                client.close()

    # -- following Redis ---------------------------------------------------------------------------------------

    def sync(self) -> bool:
        """Rebuild the local index from Redis now; ``False`` (counted, logged) if Redis failed."""
        if self._reader is None:
            return False
        try:
            self._rebuild()
        except self._redis_errors as exc:
            self._failed("rebuild", exc)
            return False
        return True

    def wait_synced(self, timeout: float | None = None) -> bool:
        """Wait until the index has been loaded from Redis once; ``False`` on timeout or without Redis."""
        return self._reader is not None and self._loaded.wait(timeout)

    def follow_once(self, block_ms: int | None = None) -> int:
        """Apply the stream messages waiting now (blocking up to ``block_ms`` for the first); how many.

        After a Redis failure it first checks whether it can go on (same server, stream not trimmed past
        its position) and rebuilds from Redis when it cannot. A Redis failure is counted and returns 0.
        """
        if self._reader is None:
            return 0
        try:
            if not self._synced:
                self._recover()
            # block=0 would mean forever to Redis: 0 and None both mean do not block
            rows = self._reader.xread({self._stream: self._last_id}, count=1000, block=block_ms or None)
        except self._redis_errors as exc:
            self._failed("follow", exc)
            return 0
        self._ok()
        n = 0
        for _, messages in rows or ():
            for msg_id, fields in messages:
                self._apply(msg_id, fields)
                n += 1
        return n

    def sweep(self) -> int:
        """Remove entries whose expiry has passed from Redis (announced to every replica); how many. A scope
        left empty (expired or removed) is unregistered in the same step, so sweeps and rebuilds visit the
        scopes that hold entries, not every scope ever used. Forgets this replica's expired entries too."""
        self._expire_local()
        if self._reader is None:
            return 0
        now_ms = int(self._clock() * 1000)
        removed = 0
        try:
            # Only the scopes whose earliest expiry has passed (or that a removal may have emptied).
            due = self._reader.zrangebyscore(self._due_key, "-inf", now_ms, start=0, num=_SWEEP_SCOPES)
            for member in due:
                if _text(member) is None or len(member) < 66:
                    # Not a member any replica writes (namespace ':' digest): bookkeeping, dropped.
                    self._corrupt(f"due scope {member!r}", ValueError("not a scope of this index"))
                    self._reader.zrem(self._due_key, member)
                    continue
                removed += self._sweep_scope(member, now_ms)
        except self._redis_errors as exc:
            self._failed("sweep", exc)
        return removed

    def _sweep_scope(self, member: bytes, now_ms: int) -> int:
        """Remove the due entries of one scope (at most ``_SWEEP_BATCH``), announced in one signed message.

        The expiry zset only says which to look at: an entry goes if its record is missing, fails its tag
        (then it is counted) or does not decode, or its signed expiry has passed; one whose signed expiry lies
        ahead (or that has none) stays, and its deadline in the zset is set from the record."""
        reader, signer = self._reader, self._signer
        assert reader is not None and signer is not None
        ns, digest = member.decode()[:-65], member.decode()[-64:]
        base = f"{self._keys}:{ns}:{digest}"
        seen = reader.zrangebyscore(base + ":x", "-inf", now_ms, start=0, num=_SWEEP_BATCH, withscores=True)
        raw_boundary = reader.hget(self._scopes_key(ns), digest)
        scope = self._registered_scope(ns, digest, raw_boundary)
        records = reader.hmget(base + ":e", [raw_id for raw_id, _ in seen]) if seen else []
        gone: list[tuple[bytes, float]] = []
        fixes: list[tuple[bytes, float, str]] = []
        for (raw_id, score), sealed in zip(seen, records, strict=True):
            if scope is None or sealed is None:
                gone.append((raw_id, score))  # unregistered or forged scope: nothing can load it anyway
                continue
            record = signer.open(scope, raw_id, sealed)
            if record is None:
                self._forged(f"{base}:e/{raw_id!r} (on sweep)")
                gone.append((raw_id, score))
                continue
            try:
                _, _, deadline = decode_record(record)
            except ValueError as exc:
                self._corrupt(f"{base}:e/{raw_id!r} (on sweep)", exc)
                gone.append((raw_id, score))
                continue
            if deadline is not None and int(deadline * 1000) <= now_ms:
                gone.append((raw_id, score))
            else:
                fixes.append((raw_id, score, "" if deadline is None else str(int(deadline * 1000))))
        ids_json = json.dumps([raw_id.decode(errors="surrogateescape") for raw_id, _ in gone]).encode()
        tag = signer.removal(scope, ids_json) if scope is not None else b""
        keys = [base + ":e", base + ":x", self._stream, self._scopes_key(ns), self._ns_key, self._due_key]
        args: list[Any] = [ns, digest, self._maxlen, member]
        args += [scope.boundary if scope is not None else "", ids_json, tag, len(gone)]
        for raw_id, score in gone:
            args += [raw_id, int(score)]
        for raw_id, score, deadline_ms in fixes:
            args += [raw_id, int(score), deadline_ms]
        return max(int(self._sweep_script(keys=keys, args=args)), 0)  # -1: a write came in between

    # -- internals ---------------------------------------------------------------------------------------------

    @property
    def _stream(self) -> str:
        return f"{self._keys}:#stream"

    @property
    def _due_key(self) -> str:
        return f"{self._keys}:#due"

    @property
    def _ns_key(self) -> str:
        return f"{self._keys}:#ns"

    def _due_member(self, scope: Scope) -> str:
        return f"{scope.namespace}:{boundary_digest(scope.boundary)}"

    def _scopes_key(self, ns: str) -> str:
        return f"{self._keys}:{ns}:#scopes"

    def _scope_base(self, scope: Scope) -> str:
        return f"{self._keys}:{scope.namespace}:{boundary_digest(scope.boundary)}"

    def _queue_add(
        self, pipe: Any, scope: Scope, ids: list[str], records: list[bytes], deadlines: list
    ) -> None:
        base = self._scope_base(scope)
        pipe.sadd(f"{self._keys}:#ns", scope.namespace)
        pipe.hset(self._scopes_key(scope.namespace), boundary_digest(scope.boundary), scope.boundary)
        pipe.hset(base + ":e", mapping=dict(zip(ids, records, strict=True)))
        timed = {i: int(d * 1000) for i, d in zip(ids, deadlines, strict=True) if d is not None}
        untimed = [i for i, d in zip(ids, deadlines, strict=True) if d is None]
        if timed:
            pipe.zadd(base + ":x", timed)
            pipe.zadd(self._due_key, {self._due_member(scope): min(timed.values())}, lt=True)
        if untimed:
            pipe.zrem(base + ":x", *untimed)
        for entry_id, record in zip(ids, records, strict=True):
            fields = {"op": "add", "ns": scope.namespace, "bd": scope.boundary, "id": entry_id, "rec": record}
            pipe.xadd(self._stream, fields, maxlen=self._maxlen, approximate=True)

    def _queue_remove(self, pipe: Any, scope: Scope, ids: list[str]) -> None:
        base = self._scope_base(scope)
        pipe.hdel(base + ":e", *ids)
        pipe.zrem(base + ":x", *ids)
        pipe.zadd(self._due_key, {self._due_member(scope): 0}, lt=True)  # the next sweep: is it empty now?
        assert self._signer is not None
        ids_json = json.dumps(ids).encode()
        tag = self._signer.removal(scope, ids_json)
        fields = {"op": "del", "ns": scope.namespace, "bd": scope.boundary, "ids": ids_json, "tag": tag}
        pipe.xadd(self._stream, fields, maxlen=self._maxlen, approximate=True)

    def _write(self, queue_ops: Callable[[Any], None]) -> None:
        """One MULTI transaction behind the breaker; a failure is counted and logged, never raised."""
        assert self._client is not None
        if self._breaker.refuses():
            self._counts["errors"] += 1
            return
        trips = self._breaker.trips
        try:
            pipe = self._client.pipeline(transaction=True)
            queue_ops(pipe)
            pipe.execute()
        except self._redis_errors as exc:
            self._breaker.trip(f"{type(exc).__name__}: {exc}")
            self._failed("write", exc)
            return
        self._breaker.succeeded(trips)
        self._ok()

    def _failed(self, op: str, exc: BaseException) -> None:
        self._counts["errors"] += 1
        if not self._down_logged:  # one line per outage, not one per retry; every failure is counted
            log.warning(
                "semantic index %s: Redis %s failed (%s: %s)", self._prefix, op, type(exc).__name__, exc
            )
            self._down_logged = True
        self._connected = False
        if op in ("follow", "rebuild"):
            self._synced = False

    def _ok(self) -> None:
        if self._down_logged:
            log.info("semantic index %s: Redis answers again", self._prefix)
        self._connected, self._down_logged = True, False

    def _forget(self, scope: Scope, ids: list[str]) -> None:
        with self._lock:
            self._index.remove(scope, ids)
            held = self._entries.get(scope)
            if held is not None:
                for entry_id in ids:
                    held.pop(entry_id, None)
                if not held:
                    del self._entries[scope]

    def _expiring(self, scope: Scope, ids: Sequence[str], deadlines: Sequence[float | None]) -> None:
        """Note deadlines for the local expiry (caller holds the lock); the heap is rebuilt from the entries
        held once stale deadlines (replaced or removed entries) make up most of it."""
        for entry_id, deadline in zip(ids, deadlines, strict=True):
            if deadline is not None:
                heapq.heappush(self._due, (deadline, scope, entry_id))
        if len(self._due) > 2 * sum(map(len, self._entries.values())) + 1024:
            self._reheap()

    def _reheap(self) -> None:
        """The expiry heap from the entries held (caller holds the lock)."""
        self._due = [
            (e.expires_at, scope, entry_id)
            for scope, held in self._entries.items()
            for entry_id, e in held.items()
            if e.expires_at is not None
        ]
        heapq.heapify(self._due)

    def _maybe_expire(self) -> None:
        # No follower sweeps for this replica: its adds and searches do, every sweep_interval at most.
        if self._thread is None and self._clock() >= self._next_expiry:
            self._next_expiry = self._clock() + self._sweep_interval
            self._expire_local()

    def _expire_local(self) -> None:
        """Forget the expired entries this replica holds (searches skip them anyway; this frees them, also
        those no search meets, and tells the listeners)."""
        now = self._clock()
        expired: dict[Scope, list[str]] = {}
        with self._lock:
            while self._due and self._due[0][0] <= now:
                deadline, scope, entry_id = heapq.heappop(self._due)
                entry = self._entries.get(scope, {}).get(entry_id)
                if entry is not None and entry.expires_at == deadline:
                    expired.setdefault(scope, []).append(entry_id)
            for scope, ids in expired.items():
                self._forget(scope, ids)
        for scope, ids in expired.items():
            self._notify(Change("remove", scope, tuple(ids)))

    def _recover(self) -> None:
        """Go on from the last position if the server and stream are the same, else rebuild."""
        run_id = server_run_id(self._reader, self._stream)
        first = self._reader.xrange(self._stream, count=1)
        trimmed = bool(first) and _id_key(first[0][0]) > _id_key(self._last_id) and self._last_id != b"0-0"
        if run_id != self._run_id or trimmed:
            self._rebuild()
        else:
            self._synced = True

    def _rebuild(self) -> None:
        """Load every scope from Redis into a fresh local index and swap it in; then follow from that point."""
        reader = self._reader
        assert reader is not None
        run_id = server_run_id(reader, self._stream)
        # The stream position first: anything written after it is applied again on top of the snapshot, and
        # every operation is idempotent, so the result is the state at the end of the stream.
        last = reader.xrevrange(self._stream, count=1)
        last_id = last[0][0] if last else b"0-0"
        index = self._new_index()
        entries: dict[Scope, dict[str, SharedEntry]] = {}
        now = self._clock()
        registered: dict[str, int] = {}
        for raw_ns in sorted(reader.smembers(f"{self._keys}:#ns")):
            ns = _text(raw_ns)
            if ns is None:
                self._corrupt(f"namespace {raw_ns!r}", ValueError("not UTF-8"))
                continue
            for raw_digest, raw_boundary in reader.hgetall(self._scopes_key(ns)).items():
                digest, boundary = _text(raw_digest), _text(raw_boundary)
                if digest is None or boundary is None:
                    self._corrupt(f"scope {ns}/{raw_digest!r}", ValueError("not UTF-8"))
                    continue
                registered[f"{ns}:{digest}"] = 0
                scope = self._loaded_scope(ns, digest, boundary)
                if scope is None:
                    continue
                loaded = self._load_scope(reader, scope, f"{self._keys}:{ns}:{digest}", now)
                if loaded is not None:
                    ids, vecs, held = loaded
                    index.add(scope, ids, vecs)
                    entries[scope] = held
        if registered:
            # Every registered scope is checked by the next sweep once (which then keeps its due time exact):
            # scopes written before the due zset existed are swept too, and an emptied one is unregistered.
            reader.zadd(self._due_key, registered, lt=True)
        with self._lock:
            self._index, self._entries = index, entries
            self._reheap()
            self._last_id, self._run_id, self._synced = last_id, run_id, True
        self._loaded.set()
        self._ok()
        self._counts["rebuilds"] += 1
        self._notify(Change("reset", None, ()))

    def _load_scope(
        self, reader: Any, scope: Scope, base: str, now: float
    ) -> tuple[list[str], np.ndarray, dict[str, SharedEntry]] | None:
        """The live entries of one scope's hash: ids, vectors (one row each) and what else is known of them.
        Records that fail their tag are counted and skipped, never deleted (under a wrong secret every record
        fails, and one replica must not empty the index the others share); records that do not decode, or whose vector is not a unit row of the scope's dimension, are counted and
        skipped. ``None`` if none is left."""
        import numpy as np

        assert self._signer is not None
        key = base + ":e"
        ids: list[str] = []
        rows: list[np.ndarray] = []
        held: dict[str, SharedEntry] = {}
        for raw_id, raw in reader.hscan_iter(key, count=1000):
            record = self._signer.open(scope, raw_id, raw)
            if record is None:
                self._forged(f"{key}/{raw_id!r}")
                continue
            try:
                entry_id = raw_id.decode()
                vec, meta, deadline = decode_record(record)
            except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
                self._corrupt(f"{key}/{raw_id!r}", exc)
                continue
            if deadline is None or now < deadline:
                ids.append(entry_id)
                rows.append(vec)
                held[entry_id] = SharedEntry(meta, deadline)
        if not ids:
            return None
        # Checked all at once (a per-row check was a third of a 20 k-entry load): one dimension, finite, unit.
        dims = collections.Counter(len(row) for row in rows)
        dim = dims.most_common(1)[0][0]
        good = [len(row) == dim for row in rows]
        vecs = np.stack([row for row, ok in zip(rows, good, strict=True) if ok])
        with np.errstate(invalid="ignore"):
            unit = np.isfinite(vecs).all(axis=1) & (
                np.abs(np.linalg.norm(vecs, axis=1) - 1.0) <= NORM_TOLERANCE
            )
        kept = [entry_id for entry_id, ok in zip(ids, good, strict=True) if ok]
        for entry_id, ok in [*zip(ids, good, strict=True), *zip(kept, unit.tolist(), strict=True)]:
            if not ok:
                self._corrupt(
                    f"{key}/{entry_id}", ValueError("vector of the wrong dimension, not finite or not unit")
                )
                held.pop(entry_id, None)
        if not unit.any():
            return None
        return [e for e, ok in zip(kept, unit.tolist(), strict=True) if ok], vecs[unit], held

    def _registered_scope(self, ns: str, digest: str, raw_boundary: bytes | None) -> Scope | None:
        """The scope registered under ``digest`` in ``ns``; ``None`` if there is none, or one that does not
        match its digest (not counted: ``_loaded_scope`` counts it on load)."""
        if raw_boundary is None:
            return None
        try:
            scope = Scope(ns, raw_boundary.decode())
            check_scope(scope)
        except ValueError:
            return None
        return scope if boundary_digest(scope.boundary) == digest else None

    def _new_index(self) -> SemanticIndex:
        return SemanticIndex(self._index_options, on_rebuild_error=self._rebuild_failed)

    def _rebuild_failed(self) -> None:
        self._counts["rebuild_errors"] += 1

    def _loaded_scope(self, ns: str, digest: str, boundary: str) -> Scope | None:
        scope = Scope(ns, boundary)
        try:
            check_scope(scope)
        except ValueError as exc:
            self._corrupt(f"scope {ns}/{digest}", exc)
            return None
        if boundary_digest(boundary) != digest:
            self._corrupt(f"scope {ns}/{digest}", ValueError("boundary does not match its digest"))
            return None
        return scope

    def _apply(self, msg_id: bytes, fields: dict[bytes, bytes]) -> None:
        """Apply one stream message to the scope it names (idempotent: re-applying changes nothing)."""
        signer = self._signer
        assert signer is not None
        try:
            op = fields[b"op"]
            scope = Scope(fields[b"ns"].decode(), fields[b"bd"].decode())
            check_scope(scope)
            # The tag first: nothing of a message is decoded before it is known to come from a replica.
            if op == b"add":
                raw_id = fields[b"id"]
                record = signer.open(scope, raw_id, fields[b"rec"])
                if record is None:
                    raise _TagMismatch
                entry_id = raw_id.decode()
                vec, meta, deadline = decode_record(record)
                check_vectors(vec[None, :], None)
                change = Change("add", scope, (entry_id,))
            elif op == b"del":
                if not signer.removal_ok(scope, fields[b"ids"], fields.get(b"tag", b"")):
                    raise _TagMismatch
                ids = json.loads(fields[b"ids"])
                if not (isinstance(ids, list) and all(isinstance(i, str) for i in ids)):
                    raise ValueError("ids is not a JSON list of strings")
                change = Change("remove", scope, tuple(ids))
            else:
                raise ValueError(f"unknown op {op!r}")
        except _TagMismatch:
            self._forged(f"stream message {msg_id!r}")
            with self._lock:
                self._last_id = msg_id
            return
        except (KeyError, ValueError, UnicodeDecodeError) as exc:
            self._corrupt(f"stream message {msg_id!r}", exc)
            with self._lock:
                self._last_id = msg_id
            return
        with self._lock:
            try:
                if change.kind == "add":
                    held = self._entries.setdefault(scope, {})
                    entry = SharedEntry(meta, deadline)
                    # A replica reads its own adds back from the stream: an identical one leaves the index
                    # alone (replacing it would only leave a tombstone behind).
                    if held.get(entry_id) != entry or not _same(self._index.vector(scope, entry_id), vec):
                        self._index.add(scope, [entry_id], vec[None, :])
                        held[entry_id] = entry
                        self._expiring(scope, [entry_id], [deadline])
                else:
                    self._forget(scope, list(change.ids))
            except (ValueError, TypeError) as exc:
                # A message this replica's index cannot take (a vector of another dimension: another model
                # under the same embedder name) is skipped and counted; the follower goes on.
                self._last_id = msg_id
                self._corrupt(f"stream message {msg_id!r}", exc)
                return
            self._last_id = msg_id
        self._counts["applied"] += 1
        self._notify(change)

    def _notify(self, change: Change) -> None:
        for fn in list(self._listeners):
            try:
                fn(change)
            except Exception:  # a listener's bug must not stop the follower; it is logged with its traceback
                log.exception("semantic index %s: listener %r failed on %s", self._prefix, fn, change.kind)

    def _corrupt(self, where: str, exc: BaseException) -> None:
        self._counts["corrupt"] += 1
        log.warning("semantic index %s: skipped %s: %s", self._prefix, where, exc)

    def _forged(self, where: str) -> None:
        self._counts["forged"] += 1
        self._corrupt(where, ValueError("its tag does not match: not written by a replica holding the secret"))

    def _run(self) -> None:
        next_sweep = 0.0
        while not self._stop.is_set():
            try:
                self.follow_once(self._block_ms)  # the first call loads the index from Redis
                self._first_try.set()
                if self._clock() >= next_sweep:
                    self.sweep()
                    next_sweep = self._clock() + self._sweep_interval
            except Exception:  # noqa: BLE001 - the follower must outlive any one bad step; logged and counted
                self._counts["errors"] += 1
                log.exception("semantic index %s: follower step failed; going on", self._prefix)
                self._first_try.set()
                self._stop.wait(max(self._retry_after, 0.01))
                continue
            if not self._connected:
                self._stop.wait(max(self._retry_after, 0.01))


class _TagMismatch(Exception):
    """A stream message whose tag does not match (``_apply`` counts it as forged; it never leaves there)."""


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool((a == b).all())


def _id_key(stream_id: bytes) -> tuple[int, int]:
    ms, _, seq = stream_id.partition(b"-")
    return int(ms), int(seq or 0)


def _text(raw: bytes) -> str | None:
    """``raw`` as UTF-8 text, or None: Redis holds bytes, and anyone who can write to it can plant others."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return None
