"""Helpers the tests share, one copy each: a free loopback port, a clock that moves only when told, and polling
until a condition holds.

Plain functions and classes, no pytest import: the benches that start servers (bench/*.py put this directory on
sys.path) use them too. A test that needs a clock with other behaviour subclasses ``FakeClock``.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

T0 = 1_700_000_000.0  # FakeClock's default start: a plausible epoch time, so timestamps format as dates


def free_port() -> int:
    """A loopback port nobody listens on right now (the kernel's choice for an ephemeral bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class FakeClock:
    """A clock that moves only when told: ``clock()`` reads it; ``clock.advance(s)`` or ``clock.now = t``
    moves it."""

    def __init__(self, start: float = T0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class SteppingClock(FakeClock):
    """A clock that moves ``step`` seconds before each reading: it reads ``start + step``, ``start + 2 * step``,
    and so on. For code that stamps each record it writes, so that every stamp is distinct and predictable."""

    def __init__(self, start: float = T0, step: float = 10.0) -> None:
        super().__init__(start)
        self.step = step

    def __call__(self) -> float:
        self.advance(self.step)
        return self.now


def eventually(
    predicate: Callable[[], T],
    *,
    timeout: float = 10.0,
    interval: float = 0.01,
    message: str = "the condition",
    ignoring: tuple[type[BaseException], ...] = (),
) -> T:
    """Calls ``predicate`` every ``interval`` seconds until it returns something truthy, and returns that.

    After ``timeout`` seconds it fails with ``AssertionError`` naming ``message`` (what was waited for) and the
    last value seen. Exceptions of the types in ``ignoring`` count as "not yet" (a server that does not listen
    yet); any other exception propagates at once.
    """
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            value = predicate()
        except ignoring as exc:
            last = exc
        else:
            if value:
                return value
            last = value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {message} (last: {last!r})")
        time.sleep(interval)
