"""A replica's policy follower outlives its store's outages: Redis killed and restarted, the follower keeps the
rollout it had, says why it cannot follow, and follows again once the store answers."""

from __future__ import annotations

import pytest
from _helpers import eventually

from evocache.controller import PolicyFollower, RedisPolicyStore

pytestmark = pytest.mark.redis

DOC = "policy: outage\nversion: {v}\n"


def test_the_follower_survives_redis_going_away_and_follows_again(restartable_redis):
    store = RedisPolicyStore(restartable_redis.url)
    store.apply(DOC.format(v=1))
    seen = []
    follower = PolicyFollower(RedisPolicyStore(restartable_redis.url), "replica-1",
                              lambda rollout: seen.append(str(rollout.active.ref)), interval=0.1).start()
    try:
        eventually(lambda: seen == ["outage@1"], interval=0.05, message="the follower to load outage@1")
        restartable_redis.stop()
        eventually(lambda: follower.error is not None and "unreachable" in follower.error, interval=0.05,
                   message="the follower to say the store is unreachable")
        assert follower.rollout is not None and str(follower.rollout.active.ref) == "outage@1"  # kept
        restartable_redis.start()  # an empty Redis: the store is written again
        RedisPolicyStore(restartable_redis.url).apply(DOC.format(v=2))
        eventually(lambda: seen[-1:] == ["outage@2"], interval=0.05,
                   message=f"the follower to load outage@2 (seen {seen}, error {follower.error!r})")
        eventually(lambda: follower.error is None, interval=0.05, message="the follower's error to clear")
    finally:
        follower.stop()
        store.close()
