"""L2: entries shared by every replica through Redis, with per-namespace byte quotas.

Layout under ``prefix`` (``p``) for a namespace ``ns``::

    p:ns:<key>      the signed entry (controller._codec), with a Redis TTL taken from entry.expires_at
    p:ns:#sizes     HASH  key -> stored bytes
    p:ns:#order     ZSET  key -> sequence number of its last store (or hit, under a quota): eviction order
    p:ns:#exp       ZSET  key -> server-clock deadline (ms) of keys stored with a TTL
    p:ns:#used      STRING bytes held by the namespace
    p:ns:#seq       STRING the sequence counter behind #order
    p:#namespaces   SET   namespaces ever written, for usage() over all of them

On a Redis Cluster (a ``redis+cluster://`` URL) the namespace is a hash tag, ``p:{ns}:<key>``,
``p:{ns}:#sizes`` and so on, so that a namespace's entries and its bookkeeping share one slot (the scripts
below touch them together); ``p:#namespaces`` lives elsewhere and is updated beside the store script rather
than in it. A tenant's L2 is then held by one primary; tenants spread over the cluster.

Keys are hex digests and namespaces cannot contain ``:``, ``#`` or braces, so no entry name can collide with
the bookkeeping names. The bookkeeping changes only inside Lua scripts, so it moves atomically with the entries:
a store, a delete and a quota eviction are each one script call. Redis expires entries on its own; the sizes
of entries it expired are removed when a script meets them (``#exp`` due, or reached by an eviction walk).
The bookkeeping keys carry no TTL: under a ``maxmemory`` policy, use a ``volatile-*`` one so that Redis evicts
entries with a TTL rather than the bookkeeping (an ``allkeys-*`` policy can drop it and skew ``usage``).
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Callable, Sequence
from typing import NoReturn

import redis
from redis.cluster import RedisCluster
from redis.exceptions import DataError, NoScriptError, ResponseError

from .._breaker import Breaker
from .._codec import check_keys, check_ns, is_ns
from .._redis_client import REDIS_ERRORS as _ERRORS
from .._redis_client import connect, hash_tag
from .._types import L2, CacheKey, Entry, Namespace
from ..errors import TierUnavailable
from ._base import FaultHook, log_fault
from ._blob import BlobTier

log = logging.getLogger("evocache.controller.tiers.redis")

# redis-py 7+ connections may be told by the server to reconnect (maintenance notices); older ones are not.
_SHOULD_RECONNECT = hasattr(getattr(redis.connection, "AbstractConnection", object), "should_reconnect")

Quota = Callable[[Namespace], int | None]
"""``quota(ns)``: the bytes a namespace may hold in L2, or ``None`` for no limit."""

_PREFIX_RE = re.compile(r"[A-Za-z0-9._:-]{1,64}")

# Expired entries whose sizes a store may clean up before storing (bounded to keep a store's latency flat)
# and that a usage() call may clean up (enough for an exact figure in any realistic interval between calls).
_PURGE_ON_STORE = 64
_PURGE_ON_USAGE = 10_000

# The longest TTL handed to Redis, in milliseconds: the largest integer a Lua number (a double) holds exactly.
# Redis refuses a longer one (past 2**63 ms with the clock added, or formatted inexactly by the script), and a
# refused write would fail every store of the entry; a longer-lived entry is held this long (about 285,000
# years) and keeps its own expiry in its header.
_MAX_PX = 2**53 - 1

# KEYS: sizes, order, exp, used, seq, namespaces (absent on a cluster: another slot).
# ARGV[1]: the entry key prefix "p:ns:", ARGV[2]: ns.
_PRELUDE = """
local sizes, order, exp, used, seq, spaces = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local prefix = ARGV[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function forget(member)
  local size = redis.call('HGET', sizes, member)
  if size then
    redis.call('HDEL', sizes, member)
    redis.call('DECRBY', used, size)
  end
  redis.call('ZREM', order, member)
  redis.call('ZREM', exp, member)
end

local function purge(limit)
  local due = redis.call('ZRANGEBYSCORE', exp, '-inf', now, 'LIMIT', 0, limit)
  for _, member in ipairs(due) do
    if redis.call('EXISTS', prefix .. member) == 0 then forget(member) end
  end
end
"""

# ARGV[3]: quota in bytes (-1: none); then (key, blob, px) per item, px 0 meaning no expiry.
# Returns the keys evicted for the quota, oldest first.
_STORE = (
    _PRELUDE
    + f"purge({_PURGE_ON_STORE})"
    + """
local quota = tonumber(ARGV[3])
if spaces then redis.call('SADD', spaces, ARGV[2]) end
for i = 4, #ARGV, 3 do
  local member, blob, px = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
  -- An entry larger than the whole quota would evict everything and then itself: leave the namespace alone.
  if quota < 0 or #blob <= quota then
    local old = redis.call('HGET', sizes, member)
    if old then redis.call('DECRBY', used, old) end
    if px > 0 then
      redis.call('SET', prefix .. member, blob, 'PX', px)
      redis.call('ZADD', exp, now + px, member)
    else
      redis.call('SET', prefix .. member, blob)
      redis.call('ZREM', exp, member)
    end
    redis.call('HSET', sizes, member, #blob)
    redis.call('INCRBY', used, #blob)
    redis.call('ZADD', order, redis.call('INCR', seq), member)
  end
end
local evicted = {}
if quota >= 0 then
  while tonumber(redis.call('GET', used) or '0') > quota do
    local oldest = redis.call('ZRANGE', order, 0, 0)
    if #oldest == 0 then break end
    if redis.call('DEL', prefix .. oldest[1]) == 1 then evicted[#evicted + 1] = oldest[1] end
    forget(oldest[1])
  end
end
return evicted
"""
)

# ARGV[3..]: keys. Returns how many entries were present.
_DELETE = (
    _PRELUDE
    + """
local n = 0
for i = 3, #ARGV do
  n = n + redis.call('DEL', prefix .. ARGV[i])
  forget(ARGV[i])
end
return n
"""
)

# ARGV[3..]: keys that were read; the ones still accounted for move to the young end of the eviction order.
_TOUCH = (
    _PRELUDE
    + """
for i = 3, #ARGV do
  if redis.call('ZSCORE', order, ARGV[i]) then
    redis.call('ZADD', order, redis.call('INCR', seq), ARGV[i])
  end
end
return 0
"""
)

_USAGE = _PRELUDE + f"purge({_PURGE_ON_USAGE})" + "\nreturn tonumber(redis.call('GET', used) or '0')\n"


class RedisTier(BlobTier):
    """Entries in Redis, shared by every process that uses the same ``url`` and ``prefix``.

    ``get_many`` is one round trip (one MGET; MGET plus an order update, pipelined, for a namespace with a
    quota); hits on sliding entries cost a second one to store the renewed lifetime. ``set_many`` is one
    script call for the whole batch. Entries carry a Redis TTL, from ``entry.expires_at`` on ``clock``, capped at
    about 285,000 years (``_MAX_PX``, what Redis and its scripts can hold).

    ``quota(ns)`` caps the bytes a namespace holds; a store that takes it over evicts that namespace's entries
    in least-recently-stored order (least-recently-used among hits, since a hit under a quota refreshes the
    entry's place) until it fits. ``usage`` counts stored bytes (entry plus the codec's header and checksum).

    Every Redis failure (down, timeout, OOM refusal, ...) raises ``TierUnavailable``. After one that concerns
    the whole server, calls within ``retry_after`` seconds (measured on ``clock``) raise ``TierUnavailable``
    without touching the network (``breaker``, a ``controller._breaker.Breaker``), so a dead or hung Redis
    costs one timeout per ``retry_after``, not one per request; the first call after that tries again, and
    redis-py reconnects by itself when Redis is back.

    ``secret`` signs every entry (``_codec.EntryCodec``): processes that share ``url`` and ``prefix`` must share
    it, and an entry that fails its check (written under another key, namespace or secret) is dropped.

    ``url`` names one Redis or a Redis Cluster (``redis+cluster://host:port[,host:port...]``: module
    docstring, ``controller._redis_client``). On a cluster the breaker is the tier's, not a node's: a dead
    primary opens it like a dead server, and the call after ``retry_after`` tries again.

    ``client`` replaces the client built from ``url`` and the timeouts (a ``redis.Redis`` or a
    ``RedisCluster``; it must not decode responses); ``close()`` closes only a client the tier built itself.
    """

    name = L2

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        secret: bytes,
        prefix: str = "evc",
        socket_timeout: float = 0.05,
        connect_timeout: float = 0.05,
        retry_after: float = 1.0,
        quota: Quota | None = None,
        clock: Callable[[], float] = time.time,
        on_fault: FaultHook = log_fault,
        client: redis.Redis | RedisCluster | None = None,
    ) -> None:
        super().__init__(secret=secret, clock=clock, on_fault=on_fault)
        if not _PREFIX_RE.fullmatch(prefix):
            raise ValueError(f"invalid prefix {prefix!r}: expected 1-64 characters of [A-Za-z0-9._:-]")
        if socket_timeout <= 0 or connect_timeout <= 0:
            raise ValueError("socket_timeout and connect_timeout must be positive")
        if retry_after < 0:
            raise ValueError("retry_after must not be negative")
        self._prefix = prefix
        self.breaker = Breaker(retry_after, clock=clock)
        self._quota = quota
        self._owns_client = client is None
        if client is None:
            # No redis-py retries: a retry doubles the time a dead Redis costs a request, and the circuit
            # breaker below already decides when to try again.
            client = connect(url, socket_timeout=socket_timeout, connect_timeout=connect_timeout, retries=0)
        self._client = client
        self._cluster = isinstance(client, RedisCluster)
        # A client of our own is a plain redis.Redis over a connection pool: the request path's GET can then
        # go to a pooled connection directly (see _get), skipping redis-py's per-command wrapper (retries we
        # turned off, observability hooks), which costs more than everything else an L2 hit does.
        self._pool = client.connection_pool if self._owns_client and not self._cluster else None
        self._store_script = client.register_script(_STORE)
        self._delete_script = client.register_script(_DELETE)
        self._touch_script = client.register_script(_TOUCH)
        self._usage_script = client.register_script(_USAGE)
        self._get_guard = _Guard(self, "get")

    # -- the tier interface -------------------------------------------------------------------------------

    def _fetch(self, ns: Namespace, keys: Sequence[CacheKey]) -> list[bytes | None]:
        entry_prefix = self._entry_prefix(ns)
        names = [entry_prefix + key for key in keys]
        with self._backend("get"):
            if self._limit(ns) is None:
                return self._client.mget(names)
            return self._mget_and_touch(ns, names, keys)

    def _fetch_one(self, ns: Namespace, key: CacheKey) -> bytes | None:
        if self._quota is not None and self._quota(ns) is not None:
            return self._fetch(ns, [key])[0]  # under a quota a read also refreshes the key's eviction order
        # _Guard's steps inlined (two Python calls less on the request path): refuse while the breaker is
        # open, open it on a Redis or socket error, close it on success.
        guard, breaker = self._get_guard, self.breaker
        trips = breaker.trips
        if breaker.open_until:
            guard.refuse_if_open()
        try:
            # GET: its bulk reply parses faster than MGET's array, and this is the request path.
            blob = self._get(self._entry_prefix(ns) + key)
        except _ERRORS as exc:
            guard.trip(exc)
        if breaker.open_until and breaker.trips == trips:
            breaker.open_until = 0.0  # Breaker.succeeded, inlined
        return blob

    def _get(self, name: str) -> bytes | None:
        """GET ``name`` on a pooled connection (thread-safe: the pool hands each caller its own); a
        connection whose exchange did not complete is disconnected before it goes back, so no later command
        can read a stale reply. Errors propagate as redis-py raises them."""
        pool = self._pool
        if pool is None:
            return self._client.get(name)
        conn = pool.get_connection()
        try:
            conn.send_command("GET", name)
            blob = conn.read_response()
            if blob is not None and type(blob) is not bytes:
                # A reply meant for another command (a connection left out of step by an interrupted
                # exchange elsewhere): never decode it; the connection is dropped and the read is a miss.
                raise redis.ConnectionError(f"out-of-step reply to GET: {type(blob).__name__}")
        except BaseException:
            conn.disconnect()
            raise
        finally:
            if _SHOULD_RECONNECT and conn.should_reconnect():  # redis-py's server maintenance notices
                conn.disconnect()
            pool.release(conn)
        return blob

    def delete(self, ns: Namespace, keys: Sequence[CacheKey]) -> int:
        check_ns(ns)
        check_keys(keys)
        if not keys:
            return 0
        with self._backend("delete"):
            return int(self._delete_script(keys=self._books(ns), args=[self._entry_prefix(ns), ns, *keys]))

    def usage(self, ns: Namespace | None = None) -> int:
        if ns is not None:
            check_ns(ns)
        with self._backend("usage"):
            if ns is not None:
                return _count(ns, self._usage_script(keys=self._books(ns), args=[self._entry_prefix(ns), ns]))
            # Only members that are namespaces: this tier adds no other, and another is no name to build keys of.
            raws = self._client.smembers(f"{self._prefix}:#namespaces")
            spaces = sorted(space for space in (raw.decode("utf-8", "replace") for raw in raws) if is_ns(space))
            pipe = self._client.pipeline(transaction=False)  # on a cluster: one batch per node
            for space in spaces:
                args = [self._entry_prefix(space), space]
                self._queue_script(pipe, self._usage_script, self._books(space), args)
            replies = pipe.execute(raise_on_error=False)
            total = 0
            for space, reply in zip(spaces, replies, strict=True):
                if isinstance(reply, NoScriptError):  # Redis restarted since the script was loaded
                    args = [self._entry_prefix(space), space]
                    reply = self._usage_script(keys=self._books(space), args=args)
                elif isinstance(reply, Exception):
                    raise reply
                total += _count(space, reply)
            return total

    def close(self) -> None:
        if self._owns_client:
            self._client.close()

    # -- internals ---------------------------------------------------------------------------------------

    def _limit(self, ns: Namespace) -> int | None:
        return None if self._quota is None else self._quota(ns)

    def _entry_prefix(self, ns: str) -> str:
        return f"{self._prefix}:{hash_tag(ns) if self._cluster else ns}:"

    def _books(self, ns: str) -> list[str]:
        base = self._entry_prefix(ns) + "#"
        books = [base + "sizes", base + "order", base + "exp", base + "used", base + "seq"]
        if not self._cluster:  # on a cluster the namespaces set is in another slot: _store adds to it
            books.append(self._namespaces_key)
        return books

    @property
    def _namespaces_key(self) -> str:
        return f"{self._prefix}:#namespaces"

    @staticmethod
    def _queue_script(pipe: object, script: object, keys: list[str], args: list) -> None:
        # EVALSHA as a raw command: redis-py's pipelined Script objects add a SCRIPT EXISTS round trip to
        # every execute, and its cluster pipeline refuses evalsha() (the keys here share one slot).
        pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)  # type: ignore[attr-defined]

    def _mget_and_touch(
        self, ns: Namespace, names: list[str], keys: Sequence[CacheKey]
    ) -> list[bytes | None]:
        # One slot (a namespace's), so one node and one round trip on a cluster too. MGET as a raw command for
        # the reason of _queue_script. The script is missing only after a Redis restart; it is loaded here.
        books = self._books(ns)
        args = [self._entry_prefix(ns), ns, *keys]
        pipe = self._client.pipeline(transaction=False)
        pipe.execute_command("MGET", *names)
        self._queue_script(pipe, self._touch_script, books, args)
        blobs, touched = pipe.execute(raise_on_error=False)
        if isinstance(blobs, Exception):
            raise blobs
        if isinstance(touched, NoScriptError):
            self._touch_script(keys=books, args=args)
        elif isinstance(touched, Exception):
            raise touched
        return blobs

    def _store(self, ns: Namespace, items: Sequence[tuple[CacheKey, Entry]], now: float) -> None:
        limit = self._limit(ns)
        if limit is not None and limit < 0:
            raise ValueError(f"quota for namespace {ns!r} is {limit}; it must be >= 0 or None")
        args: list[str | bytes | int] = [self._entry_prefix(ns), ns, -1 if limit is None else limit]
        for key, entry in items:
            if entry.expires_at is None:
                px = 0
            else:
                left_ms = (entry.expires_at - now) * 1000
                px = max(math.ceil(left_ms), 1) if left_ms < _MAX_PX else _MAX_PX  # NaN and inf: the cap
            args += [key, self._codec.encode(ns, key, entry), px]
        with self._backend("set"):
            if self._cluster:
                self._client.sadd(self._namespaces_key, ns)
            evicted = self._store_script(keys=self._books(ns), args=args)
        if evicted:
            log.debug("namespace %s over its L2 quota: evicted %d entries", ns, len(evicted))

    def _backend(self, op: str) -> _Guard:
        """Run Redis calls behind the circuit breaker, mapping every Redis error to ``TierUnavailable``."""
        return _Guard(self, op)


# Replies that say the server as a whole refuses commands now (not this key or these arguments): they open the
# breaker like a lost connection. redis-py raises some as their own classes, others as a plain ResponseError
# whose message starts with the code.
_SERVER_WIDE_CODES = frozenset(("BUSY", "MISCONF", "MASTERDOWN", "LOADING", "CLUSTERDOWN", "NOAUTH", "TRYAGAIN"))


def _server_wide(exc: BaseException) -> bool:
    """Whether ``exc`` (a Redis or socket error) says Redis is unusable for every key: lost or slow
    connections, and error replies about the server's state (out of memory, read-only replica, busy, loading).
    An error reply about one key or command (``WRONGTYPE``: another program's value under our name; a bad
    argument) is not: other keys are fine."""
    if isinstance(exc, DataError):
        return False
    if not isinstance(exc, ResponseError):
        return True
    from redis.exceptions import OutOfMemoryError, ReadOnlyError

    if isinstance(exc, (OutOfMemoryError, ReadOnlyError)):
        return True
    return str(exc).split(" ", 1)[0] in _SERVER_WIDE_CODES


def _count(ns: Namespace, reply: object) -> int:
    """The usage script's reply: a byte count. ``nil`` when the namespace's ``#used`` holds something else
    (written by another program): the figure is unknown, a ``TierUnavailable``."""
    if type(reply) is not int:
        raise TierUnavailable(L2, f"usage: the byte count of namespace {ns} is not a number")
    return reply


class _Guard:
    """The tier's ``Breaker`` around one Redis call (a class, not @contextmanager: this is on the request path).

    Entering raises ``TierUnavailable`` at once while the breaker is open; a Redis or socket error inside the
    block is re-raised as ``TierUnavailable``, and opens the breaker for ``retry_after`` seconds when it is
    server-wide (``_server_wide``: one key holding a foreign value fails alone). A success closes the breaker,
    unless it opened while this call was in flight (``Breaker.succeeded``).
    """

    __slots__ = ("breaker", "op", "trips")

    def __init__(self, tier: RedisTier, op: str) -> None:
        self.breaker = tier.breaker
        self.op = op
        self.trips = 0

    def __enter__(self) -> None:
        breaker = self.breaker
        self.trips = breaker.trips
        if breaker.open_until:
            self.refuse_if_open()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> bool:
        if exc is None:
            self.breaker.succeeded(self.trips)
        elif isinstance(exc, _ERRORS):
            self.trip(exc)
        return False

    def refuse_if_open(self) -> None:
        """Raise ``TierUnavailable`` while the breaker is open."""
        breaker = self.breaker
        if breaker.refuses():
            raise TierUnavailable(
                L2, f"{self.op} skipped: Redis failed less than {breaker.retry_after}s ago ({breaker.last_error})"
            )

    def trip(self, exc: BaseException) -> NoReturn:
        """Raise ``exc`` as ``TierUnavailable``; a server-wide one first opens the breaker."""
        message = f"{self.op}: {type(exc).__name__}: {exc}"
        if _server_wide(exc):
            self.breaker.trip(message)
        raise TierUnavailable(L2, message) from exc
