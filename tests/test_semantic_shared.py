"""SharedIndex: the scoped index shared through a real redis-server (rebuild, stream, expiry, failures)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
from _helpers import eventually
from evocache.controller.semantic import Change, Scope, SharedEntry, SharedIndex

DIM = 384
A = Scope("tenant-a", "fn=chat|model=m1|rev=1|params=0f|emb=st:all-MiniLM-L6-v2")
B = Scope("tenant-b", A.boundary)  # another tenant, same contract
A2 = Scope("tenant-a", "fn=chat|model=m2|rev=1|params=0f|emb=st:all-MiniLM-L6-v2")  # same tenant, other model
SECRET = b"the deployment secret of these replicas"


def unit(rows: np.ndarray) -> np.ndarray:
    rows = np.asarray(rows, dtype=np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def random_unit(n: int, seed: int = 0) -> np.ndarray:
    return unit(np.random.default_rng(seed).standard_normal((n, DIM)))


def ids(rows) -> list[list[str]]:
    return [[n.entry_id for n in row] for row in rows]


@pytest.fixture
def replicas(redis_url, fake_clock) -> Iterator[Callable[..., SharedIndex]]:
    """Build replicas on the test's Redis and fake clock; all closed at the end."""
    made: list[SharedIndex] = []

    def make(**options) -> SharedIndex:
        options = {"follow": False, "clock": fake_clock, "secret": SECRET, **options}
        replica = SharedIndex(options.pop("url", redis_url), **options)
        made.append(replica)
        return replica

    yield make
    for replica in made:
        replica.close()


# -- embedded mode -------------------------------------------------------------------------------------------


def test_embedded_mode_without_redis(fake_clock):
    index = SharedIndex(clock=fake_clock)
    vecs = random_unit(3)
    index.add(
        A, ["x", "y", "z"], vecs, metas=[{"answer": "k1"}, {}, {}], expires_at=[None, None, fake_clock() + 5]
    )
    assert ids(index.search(A, vecs[:1], 3))[0][0] == "x"
    assert index.get(A, "x") == SharedEntry({"answer": "k1"}, None)
    assert index.search(B, vecs[:1], 3) == [[]]
    fake_clock.advance(5)
    assert "z" not in ids(index.search(A, vecs, 3))[2]
    assert index.get(A, "z") is None
    assert len(index) == 2  # the expired entry was forgotten when a search met it
    index.remove(A, ["x"])
    assert ids(index.search(A, vecs[:1], 3)) == [["y"]]
    assert index.stats().connected is False and index.stats().errors == 0
    assert index.sync() is False and index.follow_once() == 0 and index.sweep() == 0
    index.close()


def test_metadata_must_be_json(fake_clock):
    index = SharedIndex(clock=fake_clock)
    with pytest.raises(TypeError):
        index.add(A, ["x"], random_unit(1), metas=[{"answer": object()}])
    with pytest.raises(ValueError, match="1 ids, 2 metas"):
        index.add(A, ["x"], random_unit(1), metas=[{}, {}])
    assert len(index) == 0


# -- rebuild from Redis ----------------------------------------------------------------------------------------


def test_a_new_replica_rebuilds_the_same_index_from_redis(replicas):
    first = replicas()
    vecs = random_unit(300, seed=1)
    first.add(A, [f"a{i}" for i in range(100)], vecs[:100], metas=[{"answer": f"ans{i}"} for i in range(100)])
    first.add(B, [f"b{i}" for i in range(100)], vecs[100:200])
    first.add(A2, [f"m{i}" for i in range(100)], vecs[200:])
    first.remove(A, ["a5"])

    second = replicas()
    assert sorted(second.scopes()) == sorted(first.scopes()) == sorted([A, B, A2])
    queries = random_unit(20, seed=2)
    for scope in (A, B, A2):
        got, want = second.search(scope, queries, 5), first.search(scope, queries, 5)
        assert ids(got) == ids(want)
        sims = [n.similarity for row in got for n in row]
        assert sims == pytest.approx([n.similarity for row in want for n in row], abs=1e-6)
    assert second.get(A, "a7") == SharedEntry({"answer": "ans7"}, None)
    assert second.get(A, "a5") is None and len(second) == 299
    np.testing.assert_array_equal(second.vector(B, "b3"), vecs[103])
    assert second.stats().rebuilds == 1 and second.stats().connected


def test_identical_vectors_in_redis_never_cross_scopes(replicas, redis_server):
    first = replicas()
    vecs = random_unit(10, seed=3)
    near = unit(vecs + 0.001)
    first.add(A, [f"a{i}" for i in range(10)], vecs)
    first.add(B, [f"b{i}" for i in range(10)], vecs)  # identical vectors, other tenant
    first.add(A2, [f"m{i}" for i in range(10)], near)  # near-identical, same tenant, other model
    second = replicas()
    for scope, prefix in ((A, "a"), (B, "b"), (A2, "m")):
        found = {e for row in ids(second.search(scope, vecs, 10)) for e in row}
        assert found == {f"{prefix}{i}" for i in range(10)}
    with redis_server.client() as admin:
        tenant_b_keys = {k.decode() for k in admin.scan_iter("evc-sem:tenant-b:*")}
    assert all(not k.startswith("evc-sem:tenant-a") for k in tenant_b_keys) and len(tenant_b_keys) == 2


def test_a_scope_whose_boundary_does_not_match_its_digest_is_not_loaded(replicas, redis_server):
    first = replicas()
    first.add(A, ["a0"], random_unit(1))
    with redis_server.client() as admin:
        [(digest, _)] = admin.hgetall("evc-sem:tenant-a:#scopes").items()
        admin.hset("evc-sem:tenant-a:#scopes", digest, B.boundary + "-forged")
    second = replicas()
    assert second.scopes() == []
    assert second.stats().corrupt == 1


def test_records_that_are_not_unit_vectors_of_the_scope_are_skipped_on_load(replicas, redis_server):
    from evocache.controller.semantic._shared import encode_record
    from evocache.controller.semantic._signing import IndexSigner

    first = replicas()
    vecs = random_unit(3, seed=14)
    first.add(A, ["a0", "a1", "a2"], vecs)
    key = f"evc-sem:tenant-a:{_digest(A.boundary)}:e"
    seal = IndexSigner(SECRET).seal  # signed as a replica would: the checks after the tag's are the ones at work
    with redis_server.client() as admin:
        admin.hset(key, "junk", seal(A, "junk", b"not a record"))
        admin.hset(key, "long", seal(A, "long", encode_record(vecs[0] * 2, {}, None)))
        admin.hset(key, "short", seal(A, "short", encode_record(unit(vecs[:1, :10])[0], {}, None)))
        admin.hset(key, "nan", seal(A, "nan", encode_record(np.full(DIM, np.nan, dtype=np.float32), {}, None)))
    second = replicas()
    assert second.stats().corrupt == 4 and second.stats().forged == 0
    assert sorted(ids(second.search(A, vecs[:1], 10))[0]) == ["a0", "a1", "a2"]
    assert second.get(A, "long") is None


# -- following the stream ----------------------------------------------------------------------------------


def test_a_following_replica_loads_in_the_background(replicas):
    first = replicas()
    vecs = random_unit(3, seed=12)
    first.add(A, ["a0", "a1", "a2"], vecs)
    follower = replicas(follow=True, block_ms=50, initial_wait=0)  # returns at once, loads behind
    assert follower.wait_synced(15)
    assert ids(follower.search(A, vecs, 1)) == [["a0"], ["a1"], ["a2"]]
    assert follower.stats().rebuilds == 1
    assert SharedIndex().wait_synced(0) is False  # embedded: nothing to load


def test_a_following_replica_waits_a_little_for_its_first_load(replicas):
    first = replicas()
    vec = random_unit(1, seed=13)
    first.add(A, ["a0"], vec)
    follower = replicas(follow=True, block_ms=50, initial_wait=15)
    assert follower.stats().rebuilds == 1  # loaded before the constructor returned
    assert ids(follower.search(A, vec, 1)) == [["a0"]]


def test_a_second_replica_follows_inserts_and_removals(replicas):
    first, second = replicas(), replicas()
    vecs = random_unit(4, seed=4)
    first.add(A, ["a0", "a1"], vecs[:2], metas=[{"answer": "r0"}, {"answer": "r1"}])
    first.add(B, ["b0"], vecs[2:3])
    assert second.search(A, vecs[:1], 2) == [[]]  # nothing until it reads the stream
    assert second.follow_once() == 3
    assert ids(second.search(A, vecs[:1], 2)) == [["a0", "a1"]]
    assert ids(second.search(B, vecs[:1], 2)) == [["b0"]]
    assert second.get(A, "a1") == SharedEntry({"answer": "r1"}, None)
    first.remove(A, ["a0"])
    assert second.follow_once() == 1
    assert ids(second.search(A, vecs[:1], 2)) == [["a1"]]
    assert second.follow_once() == 0


def test_a_cache_stores_the_prompt_with_its_entry_so_other_replicas_read_it(replicas):
    from evocache.controller.semantic import SemanticCache

    class Table:
        name, dim = "test:table", DIM

        def fits(self, text):
            return True

        def embed(self, texts):
            return random_unit(1, seed=sum(map(ord, texts[0])))

    first, second = replicas(), replicas()
    mine, theirs = SemanticCache(Table(), index=first), SemanticCache(Table(), index=second)
    mine.insert(A, "a0", "Cancel my subscription", "r0")
    assert second.follow_once() == 1
    assert second.get(A, "a0") == SharedEntry({"prompt": "Cancel my subscription"}, None)
    assert theirs.prompt_of("a0", A) == "Cancel my subscription"  # another replica's entry, read from Redis
    assert theirs.prompt_of("a0", B) is None and theirs.prompt_of("a0") is None  # never outside its scope


def test_followed_entries_stay_in_their_scope(replicas):
    first, second = replicas(), replicas()
    vecs = random_unit(5, seed=11)
    first.add(A, [f"a{i}" for i in range(5)], vecs)
    first.add(B, [f"b{i}" for i in range(5)], vecs)  # identical vectors, other tenant
    first.add(A2, [f"m{i}" for i in range(5)], unit(vecs + 0.001))  # near-identical, other model
    assert second.follow_once() == 15
    for scope, prefix in ((A, "a"), (B, "b"), (A2, "m")):
        rows = ids(second.search(scope, vecs, 10))
        assert all(len(row) == 5 and {e[0] for e in row} == {prefix} for row in rows)
    first.remove(B, ["b0"])
    second.follow_once()
    assert ids(second.search(A, vecs[:1], 1)) == [["a0"]]
    assert "b0" not in ids(second.search(B, vecs[:1], 5))[0]


def test_the_follower_thread_applies_changes_by_itself(replicas):
    first = replicas()
    second = replicas(follow=True, block_ms=50)
    assert second.wait_synced(15)
    changes: list[Change] = []
    second.listen(changes.append)
    vec = random_unit(1, seed=5)
    first.add(A, ["a0"], vec)
    eventually(lambda: ids(second.search(A, vec, 1)) == [["a0"]],
               timeout=15, message="the follower to apply the add")
    first.remove(A, ["a0"])
    eventually(lambda: second.search(A, vec, 1) == [[]],
               timeout=15, message="the follower to apply the removal")
    assert changes == [Change("add", A, ("a0",)), Change("remove", A, ("a0",))]


def test_reading_back_its_own_adds_leaves_the_index_alone(replicas):
    replica = replicas()
    vecs = random_unit(3, seed=6)
    replica.add(A, ["a0", "a1", "a2"], vecs)
    assert replica.follow_once() == 3
    assert replica._index.index(A)._dead == set()  # no replace, so no tombstone
    assert ids(replica.search(A, vecs, 1)) == [["a0"], ["a1"], ["a2"]]


def test_a_garbled_stream_message_is_skipped(replicas, redis_server):
    first, second = replicas(), replicas()
    with redis_server.client() as admin:
        admin.xadd(
            "evc-sem:#stream", {"op": "add", "ns": "tenant-a", "bd": A.boundary, "id": "x", "rec": b"junk"}
        )
        admin.xadd("evc-sem:#stream", {"op": "add", "ns": "bad:ns", "bd": "b", "id": "x", "rec": b"junk"})
    first.add(A, ["a0"], random_unit(1))
    assert second.follow_once() == 3
    assert second.stats().corrupt == 2 and second.stats().applied == 1
    assert second.scopes() == [A]


# -- expiry ------------------------------------------------------------------------------------------------


def test_expired_entries_leave_every_replica(replicas, fake_clock):
    first, second = replicas(), replicas()
    vecs = random_unit(2, seed=7)
    first.add(A, ["short", "long"], vecs, expires_at=[fake_clock() + 10, fake_clock() + 100])
    second.follow_once()
    fake_clock.advance(10)
    assert ids(second.search(A, vecs, 1)) == [["long"], ["long"]]  # filtered locally at once
    assert replicas().get(A, "short") is None  # a rebuild skips it too
    assert first.sweep() == 1 and first.sweep() == 0
    assert second.follow_once() == 1
    assert ids(replicas().search(A, vecs, 2)) == [["long"], ["long"]]


# -- Redis failures ---------------------------------------------------------------------------------------


def test_redis_down_never_fails_a_lookup(restartable_redis, fake_clock, caplog):
    restartable_redis.stop()
    replica = SharedIndex(restartable_redis.url, secret=SECRET, follow=False, clock=fake_clock, retry_after=1.0)
    try:
        vecs = random_unit(2, seed=8)
        assert replica.search(A, vecs[:1], 3) == [[]]  # a miss, no exception
        errors = replica.stats().errors
        assert errors >= 1 and not replica.stats().connected
        assert "semantic index evc-sem: Redis rebuild failed (ConnectionError" in caplog.text
        assert caplog.text.count("semantic index evc-sem: Redis") == 1  # one line per outage
        replica.add(A, ["local"], vecs[:1])  # kept here, not shared
        assert ids(replica.search(A, vecs[:1], 1)) == [["local"]]
        assert replica.follow_once() == 0 and replica.sweep() == 0
        assert replica.stats().errors == errors + 3
        assert caplog.text.count("semantic index evc-sem: Redis") == 1  # counted, not logged again

        restartable_redis.start()
        writer = SharedIndex(restartable_redis.url, secret=SECRET, follow=False, clock=fake_clock)
        writer.add(A, ["shared"], vecs[1:])
        assert replica.follow_once() == 0  # rebuilt: the add came with the snapshot, nothing after it
        # Redis came back as another server: the replica rebuilt from it, the shared truth.
        assert replica.stats().rebuilds == 1 and replica.stats().connected
        assert ids(replica.search(A, vecs, 1)) == [["shared"], ["shared"]]
        writer.close()
    finally:
        replica.close()


def test_a_failed_write_opens_the_breaker_for_retry_after(restartable_redis, fake_clock):
    replica = SharedIndex(restartable_redis.url, secret=SECRET, follow=False, clock=fake_clock, retry_after=1.0)
    try:
        vecs = random_unit(3, seed=9)
        restartable_redis.stop()
        replica.add(A, ["while-down"], vecs[:1])
        restartable_redis.start()
        replica.add(A, ["breaker-open"], vecs[1:2])  # within retry_after: Redis is not tried
        fake_clock.advance(1.0)
        replica.add(A, ["breaker-closed"], vecs[2:])
        assert replica.stats().errors == 2
        with restartable_redis.client() as admin:
            assert admin.hkeys(f"evc-sem:tenant-a:{_digest(A.boundary)}:e") == [b"breaker-closed"]
    finally:
        replica.close()


def test_the_follower_thread_picks_up_again_when_redis_returns(restartable_redis, fake_clock):
    replica = SharedIndex(restartable_redis.url, secret=SECRET, clock=fake_clock, retry_after=0.02, block_ms=20)
    try:
        vec = random_unit(1, seed=10)
        assert replica.wait_synced(15)
        restartable_redis.stop()
        eventually(lambda: not replica.stats().connected,
                   timeout=15, message="the follower to notice Redis is gone")
        restartable_redis.start()
        writer = SharedIndex(restartable_redis.url, secret=SECRET, follow=False, clock=fake_clock)
        writer.add(A, ["after-restart"], vec)
        eventually(lambda: ids(replica.search(A, vec, 1)) == [["after-restart"]],
                   timeout=15, message="the follower to catch up")
        assert replica.stats().connected
        writer.close()
    finally:
        replica.close()


def _digest(boundary: str) -> str:
    import hashlib

    return hashlib.sha256(boundary.encode()).hexdigest()


def test_a_stream_message_the_index_cannot_take_is_skipped_and_the_follower_goes_on(replicas):
    """A vector of another dimension in a scope (another model under the same embedder name, a rolling upgrade)
    must not stop a replica from following: it is counted as corrupt, and later changes still arrive."""
    follower = replicas()
    old, new = replicas(), replicas()
    old.add(A, ["a"], random_unit(1))
    follower.follow_once(block_ms=50)
    assert ids(follower.search(A, random_unit(1), 1)) == [["a"]]
    new.add(A, ["b"], unit(np.ones((1, 8))))  # same scope, dimension 8
    old.add(B, ["c"], random_unit(1, seed=1))
    old.remove(A, ["a"])
    for _ in range(3):
        follower.follow_once(block_ms=50)
    assert follower.stats().corrupt == 1
    assert ids(follower.search(B, random_unit(1, seed=1), 1)) == [["c"]]  # later changes were applied
    assert ids(follower.search(A, random_unit(1), 1)) == [[]]
