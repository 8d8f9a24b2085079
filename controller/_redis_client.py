"""The one place a Redis client is built: ``connect(url)`` gives a ``redis.Redis`` for a single server, or a
``redis.cluster.RedisCluster`` for a Redis Cluster, chosen by the URL's scheme.

    redis://10.0.0.5:6379/0                       one server (also rediss://, unix://)
    redis+cluster://10.0.0.5:6379                 a Redis Cluster, discovered from that node
    redis+cluster://10.0.0.5:6379,10.0.0.6:6379   ... from the first of these that answers
    rediss+cluster://...                          the same over TLS

The scheme says it, so the choice travels with the URL (``$EVOCACHE_REDIS_URL``, ``RedisConfig.url``,
``PolicyStoreConfig.redis_url``) and nothing probes the server to guess. A cluster has database 0 only; a URL
naming another one is refused.

A single-server client connects on its first command. A cluster client learns the cluster's slots when it is
built: ``connect`` then raises ``redis.ConnectionError`` naming the nodes when none of them answers. Either
client raises one of ``REDIS_ERRORS`` when Redis fails later (a cluster client also raises
``RedisClusterException`` subclasses, which are no ``RedisError``, for slots no node serves).

Keys that a multi-key command, a transaction or a Lua script uses together must share one hash slot on a
cluster: ``hash_tag(name)`` wraps a name in braces so that every key built on it lands in one slot.
"""

from __future__ import annotations

from typing import TypeAlias
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry

__all__ = ["REDIS_ERRORS", "Client", "cluster_url", "connect", "hash_tag", "is_cluster", "server_run_id"]

Client: TypeAlias = "redis.Redis | RedisCluster"

REDIS_ERRORS: tuple[type[BaseException], ...] = (redis.RedisError, RedisClusterException, OSError)
"""What a Redis call may raise when Redis (a server, a cluster node, the network) fails."""

_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def is_cluster(url: str) -> bool:
    """Whether ``url`` names a Redis Cluster (``redis+cluster://`` or ``rediss+cluster://``)."""
    return url.split("://", 1)[0].lower() in _CLUSTER_SCHEMES


def cluster_url(url: str) -> tuple[list[tuple[str, int]], str]:
    """The nodes of a cluster URL and the plain URL of its first node (which carries the credentials and
    options for every node). ``ValueError`` names what is wrong: no host, a bad port, a database other
    than 0."""
    parts = urlsplit(url)
    scheme = _CLUSTER_SCHEMES.get(parts.scheme.lower())
    if scheme is None:
        raise ValueError(f"{url!r} is not a Redis Cluster URL (redis+cluster:// or rediss+cluster://)")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    nodes: list[tuple[str, int]] = []
    for host in hosts.split(","):
        name, sep, port = host.strip().rpartition(":")
        if not sep:
            name, port = port, "6379"
        if not name or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{url!r}: {host!r} is not host:port")
        nodes.append((name.strip("[]"), int(port)))
    db = parts.path.strip("/")
    if db not in ("", "0"):
        raise ValueError(f"{url!r}: a Redis Cluster has database 0 only, not {db!r}")
    first = f"{nodes[0][0]}:{nodes[0][1]}"
    plain = urlunsplit((scheme, f"{userinfo}@{first}" if userinfo else first, "", parts.query, ""))
    return nodes, plain


def connect(
    url: str,
    *,
    socket_timeout: float | None = None,
    connect_timeout: float | None = None,
    retries: int | None = None,
) -> Client:
    """A client for ``url`` (module docstring): a ``redis.RedisCluster`` for a cluster URL, else a
    ``redis.Redis``. Responses are bytes. ``retries``: how often redis-py retries a failed command (``None``:
    its default; ``0`` where a circuit breaker decides when to try again)."""
    options: dict[str, object] = {}
    if socket_timeout is not None:
        options["socket_timeout"] = socket_timeout
    if connect_timeout is not None:
        options["socket_connect_timeout"] = connect_timeout
    if retries is not None:
        options["retry"] = Retry(NoBackoff(), retries)
    if not is_cluster(url):
        return redis.Redis.from_url(url, **options)
    nodes, plain = cluster_url(url)
    settings = redis.connection.parse_url(plain)
    for name in ("host", "port", "db"):
        settings.pop(name, None)
    try:
        return RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in nodes], **settings, **options
        )
    except RedisClusterException as exc:
        # Raised as a RedisError, which every caller already treats as Redis being unreachable.
        where = ",".join(f"{host}:{port}" for host, port in nodes)
        raise redis.ConnectionError(f"Redis Cluster {where}: {exc}") from exc


def hash_tag(name: str) -> str:
    """``name`` as a hash tag: every key containing ``{name}`` lands in one cluster slot (``name`` must not
    contain braces)."""
    if "{" in name or "}" in name:
        raise ValueError(f"a hash tag cannot contain braces: {name!r}")
    return "{" + name + "}"


def server_run_id(client: Client, key: str) -> str:
    """The run id of the server that holds ``key`` (on a cluster, the primary of its slot): it changes when
    that server restarts or another one takes the slot over."""
    if isinstance(client, RedisCluster):
        node = client.get_node_from_key(key)
        info = client.info("server", target_nodes=node)
    else:
        info = client.info("server")
    return str(info["run_id"])
