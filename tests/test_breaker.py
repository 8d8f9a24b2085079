"""The one circuit breaker in front of Redis (L2 tier, event stream, shared semantic index)."""

from __future__ import annotations

import pytest
from _helpers import FakeClock

from evocache.controller._breaker import Breaker


def test_closed_until_a_failure_then_open_for_retry_after() -> None:
    clock = FakeClock(100.0)
    breaker = Breaker(2.0, clock=clock)
    assert not breaker.refuses() and not breaker.is_open
    breaker.trip("ConnectionError: refused")
    assert breaker.is_open and breaker.open_until == 102.0
    assert [breaker.refuses() for _ in range(3)] == [True, True, True]
    clock.now = 101.999
    assert breaker.refuses()
    clock.now = 102.0  # retry_after has passed: the next call goes to Redis again
    assert not breaker.refuses() and not breaker.is_open
    assert (breaker.trips, breaker.refused, breaker.last_error) == (1, 4, "ConnectionError: refused")


def test_a_success_closes_it_unless_it_opened_during_the_call() -> None:
    clock = FakeClock(100.0)
    breaker = Breaker(1.0, clock=clock)
    breaker.trip("first")
    clock.now += 1.0
    began = breaker.trips  # a call starts once retry_after has passed
    breaker.trip("second")  # another thread's call fails meanwhile
    breaker.succeeded(began)  # the older call's success is not evidence against the newer failure
    assert breaker.open_until == 102.0
    breaker.succeeded(breaker.trips)
    assert breaker.open_until == 0.0 and not breaker.is_open


def test_zero_retry_after_tries_every_call_and_negative_is_refused() -> None:
    breaker = Breaker(0.0, clock=FakeClock(100.0))
    breaker.trip("down")
    assert not breaker.refuses()
    with pytest.raises(ValueError, match="retry_after must not be negative, not -1"):
        Breaker(-1)


def test_repr_says_the_state() -> None:
    clock = FakeClock(100.0)
    breaker = Breaker(1.0, clock=clock)
    assert repr(breaker) == "Breaker(closed, trips=0, refused=0)"
    breaker.trip("TimeoutError: hung")
    assert repr(breaker) == "Breaker(open (TimeoutError: hung), trips=1, refused=0)"
