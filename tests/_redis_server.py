"""A throwaway redis-server: free loopback port, no persistence, can be killed and restarted; and a throwaway
Redis Cluster of such servers (``RedisClusterServers``).

The one redis-server launcher of the repository: the test fixtures (tests/conftest.py) and the benches that need
a Redis (bench/overhead.py, which puts this directory on sys.path) start theirs with it. It lives beside the
tests, not in the evocache package: product code never starts servers.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path

import redis
from _helpers import eventually, free_port
from redis.cluster import ClusterNode, RedisCluster

MISSING = (
    "redis-server was not found on PATH. The test suite starts its own Redis: run `make test` "
    "(it installs redis-server where it can) or install it yourself "
    "(Debian/Ubuntu: sudo apt-get install redis-server) and rerun."
)


def free_cluster_port() -> int:
    """A free loopback port whose cluster bus port (10000 higher, at most 65535) is free as well."""
    while True:
        port = free_port()
        if port > 55535:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


class RedisServer:
    """One redis-server process on 127.0.0.1:``port`` with its own working directory.

    ``stop()`` kills it (SIGKILL by default: what a crash looks like to clients) and ``start()`` brings a
    fresh, empty one back on the same port, so clients configured with ``url`` reconnect to it unchanged.
    ``executable`` defaults to the ``redis-server`` on PATH; without one, ``FileNotFoundError(MISSING)``.
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        maxmemory: str | None = None,
        executable: str | None = None,
        options: dict[str, str] | None = None,
    ):
        found = executable or shutil.which("redis-server")
        if found is None:
            raise FileNotFoundError(MISSING)
        self.executable = found
        self.port = port or free_port()
        self.maxmemory = maxmemory
        self.options = dict(options or {})  # further redis-server settings (a cluster node's)
        self._dir = Path(tempfile.mkdtemp(prefix="evc-redis-"))
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def client(self, **kwargs: object) -> redis.Redis:
        """A plain client for test set-up and inspection (not the one under test)."""
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, **kwargs)  # type: ignore[arg-type]

    def start(self, timeout: float = 10.0) -> RedisServer:
        if self.running:
            return self
        options = {
            "port": str(self.port),
            "bind": "127.0.0.1",
            "save": "",
            "appendonly": "no",
            "dir": str(self._dir),
            "logfile": str(self._dir / "redis.log"),
            "daemonize": "no",
            "enable-debug-command": "local",
        }
        if self.maxmemory is not None:
            options |= {"maxmemory": self.maxmemory, "maxmemory-policy": "noeviction"}
        options |= self.options
        args = [self.executable, *(arg for name, value in options.items() for arg in (f"--{name}", value))]
        self._proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        self._wait_ready(timeout)
        return self

    def stop(self, sig: signal.Signals = signal.SIGKILL, timeout: float = 10.0) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.send_signal(sig)
            self._proc.wait(timeout)
        self._proc = None

    def close(self) -> None:
        """Stop the server and remove its working directory."""
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _wait_ready(self, timeout: float) -> None:
        probe = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)

        def answers() -> bool:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self._proc.returncode}: {self._log_tail()}")
            return bool(probe.ping())

        try:  # a RedisError is "not listening yet"
            eventually(answers, timeout=timeout, message=f"redis-server on port {self.port} to answer PING",
                       ignoring=(redis.RedisError,))
        except AssertionError as exc:
            self.stop()
            raise RuntimeError(f"{exc}: {self._log_tail()}") from None
        finally:
            probe.close()

    def _log_tail(self) -> str:
        try:
            return (self._dir / "redis.log").read_text()[-2000:]
        except OSError as exc:
            return f"(no log: {exc})"


class RedisClusterServers:
    """A Redis Cluster of ``masters`` redis-servers (no replicas) on free loopback ports.

    ``start()`` launches the servers with cluster mode on, joins them with ``redis-cli --cluster create``
    (which spreads the 16384 slots over them) and waits until every node reports ``cluster_state:ok``.
    ``url`` is the ``redis+cluster://`` URL naming every node. ``kill(i)`` kills node ``i`` (SIGKILL) and
    leaves it dead: its slots are then served by no one. ``node_timeout_ms`` is how long the others take to
    mark a dead node failed; ``full_coverage=False`` lets the others serve their slots on after that
    (``cluster-require-full-coverage no``), else the whole cluster refuses commands (``CLUSTERDOWN``).
    """

    def __init__(
        self,
        masters: int = 3,
        *,
        node_timeout_ms: int = 2000,
        full_coverage: bool = True,
        executable: str | None = None,
    ):
        cli = shutil.which("redis-cli")
        if cli is None:
            raise FileNotFoundError(MISSING.replace("redis-server was", "redis-cli was"))
        self.cli = cli
        self.nodes = [
            RedisServer(
                port=free_cluster_port(),
                executable=executable,
                options={
                    "cluster-enabled": "yes",
                    "cluster-config-file": "nodes.conf",
                    "cluster-node-timeout": str(node_timeout_ms),
                    "cluster-require-full-coverage": "yes" if full_coverage else "no",
                },
            )
            for _ in range(masters)
        ]

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self.nodes]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in self.ports)

    def client(self, **kwargs: object) -> RedisCluster:
        """A cluster client for test set-up and inspection (not the one under test)."""
        nodes = [ClusterNode("127.0.0.1", node.port) for node in self.nodes if node.running]
        return RedisCluster(startup_nodes=nodes, socket_timeout=5, **kwargs)  # type: ignore[arg-type]

    def start(self, timeout: float = 30.0) -> RedisClusterServers:
        for node in self.nodes:
            node.start()
        addresses = [f"127.0.0.1:{port}" for port in self.ports]
        created = subprocess.run(
            [self.cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if created.returncode != 0:
            self.close()
            output = created.stdout[-2000:] + created.stderr[-2000:]
            raise RuntimeError(f"redis-cli --cluster create failed: {output}")
        self._wait_ok(timeout)
        return self

    def flush(self) -> None:
        """Empty every running node."""
        for node in self.nodes:
            if node.running:
                with node.client() as admin:
                    admin.flushall()

    def kill(self, index: int) -> RedisServer:
        node = self.nodes[index]
        node.stop()
        return node

    def close(self) -> None:
        for node in self.nodes:
            node.close()

    def _wait_ok(self, timeout: float) -> None:
        def states() -> list[str]:
            out = []
            for node in self.nodes:
                with node.client() as admin:
                    out.append(admin.cluster("INFO").get("cluster_state"))
            return out

        try:
            eventually(lambda: all(state == "ok" for state in states()), timeout=timeout, interval=0.05,
                       message=f"every node of the Redis Cluster on {self.ports} to be ok")
        except AssertionError as exc:
            states_now = states()
            self.close()
            raise RuntimeError(f"{exc}: {states_now}") from None
