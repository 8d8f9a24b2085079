"""The store event says where an entry went: the tiers that took the write, never the ones a rule only named."""

from __future__ import annotations

import pytest

from evocache.controller import DiskConfig, RedisConfig, StoreConfig, build_runtime, cache_if

pytestmark = pytest.mark.redis


def _replica(url: str):
    return build_runtime(StoreConfig(redis=RedisConfig(url=url, timeout_s=0.5)))


def _answer(runtime, calls: list, **options):
    @cache_if("true", name="answer", model="m", store=runtime, **options)
    def answer(prompt: str) -> str:
        calls.append(prompt)
        return f"answer to {prompt}"

    return answer


def _stores(runtime) -> list[tuple[str, str]]:
    """(the tiers that took it, why none did) of each miss's event."""
    return [(e.stored, e.rejected) for e in runtime.events.events() if e.outcome == "miss"]


def test_a_ttl_longer_than_redis_holds_is_stored_in_l2(redis_url: str) -> None:
    a, b = _replica(redis_url), _replica(redis_url)
    calls: list = []
    both = {"tiers": ["l1", "l2"]}
    _answer(a, calls, ttl=1e15, admission=both)("q")
    assert _stores(a) == [("l1,l2", "")]
    assert _answer(b, calls, ttl=1e15, admission=both)("q") == "answer to q"  # another replica reads L2
    assert calls == ["q"]
    assert [(e.outcome, e.tier) for e in b.events.events()] == [("hit", "l2")]
    assert a.store.error_counts == {}
    a.close(), b.close()


def test_a_write_redis_refuses_is_not_reported_as_stored_there(restartable_redis) -> None:
    runtime = _replica(restartable_redis.url)
    calls: list = []
    both = _answer(runtime, calls, admission={"tiers": ["l1", "l2"]})
    only_l2 = _answer(runtime, calls, admission={"tiers": ["l2"]})
    restartable_redis.stop()
    both("q")
    only_l2("r")
    assert _stores(runtime) == [("l1", ""), ("", "not-stored")]
    assert runtime.store.error_counts[("l2", "set")] == 2  # one failed, one skipped by the open breaker
    assert only_l2.cache_info().rejects == 1 and only_l2.cache_info().stores == 0
    runtime.close()


def test_tiers_the_store_does_not_hold_are_not_reported(tmp_path) -> None:
    runtime = build_runtime(StoreConfig(disk=DiskConfig(path=str(tmp_path / "l3"))))
    _answer(runtime, [], admission={"tiers": ["l1", "l2", "l3"]})("q")
    assert _stores(runtime) == [("l1,l3", "")]
    runtime.close()
