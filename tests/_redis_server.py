"""A throwaway redis-server: free loopback port, no persistence, can be killed and restarted.

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
import time
from pathlib import Path

import redis

MISSING = (
    "redis-server was not found on PATH. The test suite starts its own Redis: run `make test` "
    "(it installs redis-server where it can) or install it yourself "
    "(Debian/Ubuntu: sudo apt-get install redis-server) and rerun."
)


def free_port() -> int:
    """A loopback port nobody listens on right now (the kernel's choice for an ephemeral bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """One redis-server process on 127.0.0.1:``port`` with its own working directory.

    ``stop()`` kills it (SIGKILL by default: what a crash looks like to clients) and ``start()`` brings a
    fresh, empty one back on the same port, so clients configured with ``url`` reconnect to it unchanged.
    ``executable`` defaults to the ``redis-server`` on PATH; without one, ``FileNotFoundError(MISSING)``.
    """

    def __init__(
        self, *, port: int | None = None, maxmemory: str | None = None, executable: str | None = None
    ):
        found = executable or shutil.which("redis-server")
        if found is None:
            raise FileNotFoundError(MISSING)
        self.executable = found
        self.port = port or free_port()
        self.maxmemory = maxmemory
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
        deadline = time.monotonic() + timeout
        probe = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            while True:
                assert self._proc is not None
                if self._proc.poll() is not None:
                    raise RuntimeError(
                        f"redis-server exited with {self._proc.returncode}: {self._log_tail()}"
                    )
                try:
                    if probe.ping():
                        return
                except redis.RedisError:
                    pass  # not listening yet: poll again until the deadline
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"redis-server did not answer PING within {timeout}s: {self._log_tail()}"
                    )
                time.sleep(0.01)
        finally:
            probe.close()

    def _log_tail(self) -> str:
        try:
            return (self._dir / "redis.log").read_text()[-2000:]
        except OSError as exc:
            return f"(no log: {exc})"
