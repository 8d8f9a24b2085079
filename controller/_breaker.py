"""``Breaker``: the circuit breaker in front of Redis, for the L2 tier, the event stream and the semantic index.

A dead or hung Redis must cost one timeout per ``retry_after`` seconds, not one per request. After a failure
the breaker is open: callers ask ``refuses()`` first and skip Redis while it says so (each refusal counted);
once ``retry_after`` has passed on ``clock`` the next call goes to Redis again, and a success closes it.

A success only closes the breaker if it did not open while that call was in flight: the call takes
``trips`` before it starts and hands it to ``succeeded``, so a failure seen by another thread in the
meantime (newer evidence than a success that may have begun before it) keeps the breaker open.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Breaker:
    """Open for ``retry_after`` seconds (on ``clock``) after each failure. Thread-safe enough for its use:
    every field is written whole, and a lost update only shifts when Redis is tried again.

    Read on the request path, so the state is plain attributes: ``open_until`` (0.0 when closed), ``trips``
    (times it opened), ``refused`` (calls it refused) and ``last_error`` (what opened it last).
    """

    __slots__ = ("retry_after", "clock", "open_until", "trips", "refused", "last_error")

    def __init__(self, retry_after: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        if retry_after < 0:
            raise ValueError(f"retry_after must not be negative, not {retry_after}")
        self.retry_after = retry_after
        self.clock = clock
        self.open_until = 0.0
        self.trips = 0
        self.refused = 0
        self.last_error = ""

    @property
    def is_open(self) -> bool:
        return bool(self.open_until) and self.clock() < self.open_until

    def refuses(self) -> bool:
        """Whether a call must skip Redis now (the breaker is open); a refusal is counted."""
        if self.open_until and self.clock() < self.open_until:
            self.refused += 1
            return True
        return False

    def trip(self, error: str) -> None:
        """A call failed with ``error``: open for ``retry_after`` seconds from now."""
        self.trips += 1
        self.open_until = self.clock() + self.retry_after
        self.last_error = error

    def succeeded(self, trips: int) -> None:
        """A call that began when ``self.trips`` was ``trips`` succeeded: close, unless it opened since."""
        if self.open_until and self.trips == trips:
            self.open_until = 0.0

    def __repr__(self) -> str:
        state = f"open ({self.last_error})" if self.is_open else "closed"
        return f"Breaker({state}, trips={self.trips}, refused={self.refused})"
