"""A replica's policy follower outlives its store's outages: Redis killed and restarted, the follower keeps the
rollout it had, says why it cannot follow, and follows again once the store answers."""

from __future__ import annotations

import time

import pytest

from evocache.controller import PolicyFollower, RedisPolicyStore

pytestmark = pytest.mark.redis

DOC = "policy: outage\nversion: {v}\n"


def _until(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def test_the_follower_survives_redis_going_away_and_follows_again(restartable_redis):
    store = RedisPolicyStore(restartable_redis.url)
    store.apply(DOC.format(v=1))
    seen = []
    follower = PolicyFollower(RedisPolicyStore(restartable_redis.url), "replica-1",
                              lambda rollout: seen.append(str(rollout.active.ref)), interval=0.1).start()
    try:
        assert _until(lambda: seen == ["outage@1"])
        restartable_redis.stop()
        assert _until(lambda: follower.error is not None and "unreachable" in follower.error)
        assert follower.rollout is not None and str(follower.rollout.active.ref) == "outage@1"  # kept
        restartable_redis.start()  # an empty Redis: the store is written again
        RedisPolicyStore(restartable_redis.url).apply(DOC.format(v=2))
        assert _until(lambda: seen[-1:] == ["outage@2"]), (seen, follower.error)
        assert _until(lambda: follower.error is None)
    finally:
        follower.stop()
        store.close()
