"""The shared semantic index's records and stream messages are signed: what a replica without the secret writes
to Redis (a planted record, one copied to another scope or id, a flipped bit, a changed expiry, a forged stream
message) is skipped and counted, never found by a lookup; the replicas holding the secret share as before."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from _helpers import eventually
from evocache.controller import RedisConfig, StoreConfig, build_runtime
from evocache.controller._semantic import SharedRedis
from evocache.controller.semantic import Scope, SharedEntry, SharedIndex
from evocache.controller.semantic._shared import encode_record
from evocache.controller.semantic._signing import IndexSigner

DIM = 32
SECRET = b"the deployment secret of these replicas"
OTHER_SECRET = b"a secret no replica of this deployment holds"
A = Scope("tenant-a", "fn=chat|model=m1|emb=test")
A2 = Scope("tenant-a", "fn=chat|model=m2|emb=test")  # the same tenant, another model
B = Scope("tenant-b", A.boundary)  # another tenant, the same contract


def unit(rows) -> np.ndarray:
    rows = np.asarray(rows, dtype=np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def random_unit(n: int, seed: int = 0) -> np.ndarray:
    return unit(np.random.default_rng(seed).standard_normal((n, DIM)))


def ids(rows) -> list[list[str]]:
    return [[n.entry_id for n in row] for row in rows]


def entries_key(scope: Scope) -> str:
    return f"evc-sem:{scope.namespace}:{hashlib.sha256(scope.boundary.encode()).hexdigest()}:e"


@pytest.fixture
def replicas(redis_url, fake_clock) -> Iterator[Callable[..., SharedIndex]]:
    made: list[SharedIndex] = []

    def make(**options) -> SharedIndex:
        replica = SharedIndex(redis_url, **{"follow": False, "clock": fake_clock, "secret": SECRET, **options})
        made.append(replica)
        return replica

    yield make
    for replica in made:
        replica.close()


@pytest.fixture
def admin(redis_server):
    with redis_server.client() as client:
        yield client


def loaded_with(replicas, admin, plant: Callable[[], None]) -> tuple[SharedIndex, np.ndarray]:
    """A writer adds a0..a2 to A; ``plant`` then writes to Redis behind its back; a new replica loads it all."""
    vecs = random_unit(3, seed=1)
    replicas().add(A, ["a0", "a1", "a2"], vecs, metas=[{"answer": f"r{i}"} for i in range(3)])
    plant()
    return replicas(), vecs


# -- records in Redis --------------------------------------------------------------------------------------


def test_a_record_planted_without_the_secret_is_never_found_and_is_left_alone(replicas, admin):
    query = random_unit(1, seed=9)
    planted = {
        "unsigned": encode_record(query[0], {"answer": "theirs"}, None),
        "other-secret": IndexSigner(OTHER_SECRET).seal(A, "other-secret", encode_record(query[0], {}, None)),
        "short": b"x",
    }
    replica, vecs = loaded_with(replicas, admin, lambda: admin.hset(entries_key(A), mapping=planted))
    found = ids(replica.search(A, query, 5))[0]
    assert sorted(found) == ["a0", "a1", "a2"]  # the planted vector is the query itself, and is not there
    assert replica.get(A, "unsigned") is None and replica.get(A, "a1") == SharedEntry({"answer": "r1"}, None)
    assert replica.stats().forged == 3 and replica.stats().corrupt == 3
    # Left in Redis (a replica cannot tell a planted record from one signed under another secret), and
    # skipped again by the next replica.
    assert sorted(admin.hkeys(entries_key(A))) == [b"a0", b"a1", b"a2", b"other-secret", b"short", b"unsigned"]
    assert replicas().stats().forged == 3


def test_a_record_copied_to_another_tenant_another_scope_or_another_id_is_skipped(replicas, admin):
    def copy() -> None:
        sealed = admin.hget(entries_key(A), "a0")
        admin.hset(entries_key(A), "a-copy", sealed)  # the same tenant and scope, another id (exact key)
        admin.hset(entries_key(A2), "a0", sealed)  # the same tenant, another model
        admin.hset(entries_key(B), "a0", sealed)  # another tenant
        for scope in (A2, B):
            digest = hashlib.sha256(scope.boundary.encode()).hexdigest()
            admin.sadd("evc-sem:#ns", scope.namespace)
            admin.hset(f"evc-sem:{scope.namespace}:#scopes", digest, scope.boundary)

    replica, vecs = loaded_with(replicas, admin, copy)
    assert sorted(ids(replica.search(A, vecs[:1], 5))[0]) == ["a0", "a1", "a2"]
    assert ids(replica.search(A, vecs[:1], 1)) == [["a0"]]  # the one copied, under its own id only
    assert replica.search(A2, vecs[:1], 5) == [[]] and replica.search(B, vecs[:1], 5) == [[]]
    assert replica.scopes() == [A] and replica.get(A, "a-copy") is None
    assert replica.stats().forged == 3
    assert admin.hexists(entries_key(A), "a-copy") and admin.hlen(entries_key(B)) == 1  # skipped, not deleted


@pytest.mark.parametrize("where", ["vector", "expiry", "metadata", "tag"])
def test_a_changed_bit_of_a_record_makes_it_skipped(replicas, admin, fake_clock, where):
    vecs = random_unit(2, seed=2)
    replicas().add(A, ["a0", "a1"], vecs, metas=[{"answer": "r0"}, {"answer": "r1"}],
                   expires_at=[fake_clock() + 10, None])
    sealed = bytearray(admin.hget(entries_key(A), "a0"))
    head = struct.calcsize("<dI")
    if where == "vector":
        sealed[-20] ^= 0x01  # one bit of the last float
    elif where == "expiry":
        sealed[:8] = struct.pack("<d", fake_clock() + 10**6)  # lives on a million seconds longer
    elif where == "metadata":
        sealed[head + sealed[head:].index(b"r0") + 1] ^= 0x01  # "r0" becomes "r1"
    else:
        sealed[-1] ^= 0x80
    admin.hset(entries_key(A), "a0", bytes(sealed))
    replica = replicas()
    assert ids(replica.search(A, vecs[:1], 2)) == [["a1"]]
    assert replica.get(A, "a0") is None and replica.stats().forged == 1
    assert admin.hget(entries_key(A), "a0") == bytes(sealed)  # skipped, left as it is


def test_bookkeeping_that_is_not_utf8_is_skipped_on_load_and_on_sweep(replicas, admin):
    def plant() -> None:
        admin.sadd("evc-sem:#ns", b"\xff\xfe")  # a namespace no replica writes
        digest = hashlib.sha256(A.boundary.encode()).hexdigest()
        admin.hset(f"evc-sem:{A.namespace}:#scopes", b"\xff" + digest.encode()[1:], b"\xff")
        admin.zadd("evc-sem:#due", {b"\xff\xfe:" + b"0" * 64: 0, b"short": 0})

    replica, vecs = loaded_with(replicas, admin, plant)
    assert sorted(ids(replica.search(A, vecs[:1], 5))[0]) == ["a0", "a1", "a2"]
    assert replica.stats().corrupt == 2 and replica.stats().forged == 0
    replica.sweep()
    assert replica.stats().corrupt == 4
    assert admin.zscore("evc-sem:#due", b"short") is None and admin.zscore("evc-sem:#due", b"\xff\xfe:" + b"0" * 64) is None


# -- stream messages ---------------------------------------------------------------------------------------


def test_forged_stream_messages_are_skipped_and_counted(replicas, admin):
    writer, follower = replicas(), replicas()
    vecs = random_unit(2, seed=3)
    writer.add(A, ["a0"], vecs[:1])
    assert follower.follow_once() == 1
    [(_, [(_, fields)])] = admin.xread({"evc-sem:#stream": "0-0"})
    signed = fields[b"rec"]
    forged = [
        # a record made without the secret, matching the query exactly
        {"op": "add", "ns": "tenant-a", "bd": A.boundary, "id": "planted", "rec": encode_record(vecs[1], {}, None)},
        # signed under another secret
        {"op": "add", "ns": "tenant-a", "bd": A.boundary, "id": "other",
         "rec": IndexSigner(OTHER_SECRET).seal(A, "other", encode_record(vecs[1], {}, None))},
        # the writer's own sealed record, replayed for another tenant, another scope, another id
        {"op": "add", "ns": "tenant-b", "bd": B.boundary, "id": "a0", "rec": signed},
        {"op": "add", "ns": "tenant-a", "bd": A2.boundary, "id": "a0", "rec": signed},
        {"op": "add", "ns": "tenant-a", "bd": A.boundary, "id": "a-copy", "rec": signed},
        # removals without a tag, with another scope's tag, with a tag for other ids
        {"op": "del", "ns": "tenant-a", "bd": A.boundary, "ids": json.dumps(["a0"])},
        {"op": "del", "ns": "tenant-a", "bd": A.boundary, "ids": json.dumps(["a0"]),
         "tag": IndexSigner(SECRET).removal(B, json.dumps(["a0"]).encode())},
        {"op": "del", "ns": "tenant-a", "bd": A.boundary, "ids": json.dumps(["a0"]),
         "tag": IndexSigner(SECRET).removal(A, json.dumps(["a1"]).encode())},
    ]
    for message in forged:
        admin.xadd("evc-sem:#stream", message)
    writer.add(A, ["a1"], vecs[1:])  # and the replicas go on
    assert follower.follow_once() == len(forged) + 1
    assert follower.stats().forged == len(forged) and follower.stats().applied == 2
    assert ids(follower.search(A, vecs[1:], 5)) == [["a1", "a0"]]  # the forged neighbours are not there
    assert follower.scopes() == [A] and follower.get(A, "a-copy") is None
    assert writer.follow_once() == len(forged) + 2 and writer.stats().forged == len(forged)
    assert ids(writer.search(A, vecs[1:], 5)) == [["a1", "a0"]]


def test_a_removal_message_replayed_into_another_scope_removes_nothing(replicas, admin):
    writer, follower = replicas(), replicas()
    vecs = random_unit(1, seed=4)
    writer.add(A, ["same"], vecs)
    writer.add(B, ["same"], vecs)
    follower.follow_once()
    writer.remove(A, ["same"])
    *_, (_, fields) = admin.xrange("evc-sem:#stream")
    admin.xadd("evc-sem:#stream", {**fields, b"ns": b"tenant-b"})
    assert follower.follow_once() == 2
    assert follower.search(A, vecs, 1) == [[]] and ids(follower.search(B, vecs, 1)) == [["same"]]
    assert follower.stats().forged == 1


# -- the sweep ---------------------------------------------------------------------------------------------


def test_the_sweep_removes_only_entries_whose_signed_expiry_passed(replicas, admin, fake_clock):
    writer, follower = replicas(), replicas()
    vecs = random_unit(3, seed=5)
    t0 = fake_clock()
    writer.add(A, ["soon", "later", "never"], vecs, expires_at=[t0 + 1, t0 + 100, None])
    follower.follow_once()
    x_key = entries_key(A)[:-1] + "x"
    # Someone who can write to Redis marks every entry due now (the zset is not signed)...
    admin.zadd(x_key, {"later": int(t0 * 1000), "never": int(t0 * 1000)})
    # ...and plants a record that is due too.
    admin.hset(entries_key(A), "planted", encode_record(vecs[0], {}, t0))
    admin.zadd(x_key, {"planted": int(t0 * 1000)})
    fake_clock.advance(2)
    assert writer.sweep() == 2  # the expired one and the planted one
    assert writer.stats().forged == 1
    assert sorted(admin.hkeys(entries_key(A))) == [b"later", b"never"]
    assert admin.zrange(x_key, 0, -1, withscores=True) == [(b"later", float(int((t0 + 100) * 1000)))]
    assert follower.follow_once() == 1 and follower.stats().forged == 0
    assert sorted(ids(follower.search(A, vecs, 3))[0]) == ["later", "never"]
    assert writer.sweep() == 0


def test_a_sweep_that_meets_a_write_to_its_entries_leaves_them_for_the_next(replicas, admin, fake_clock):
    sweeper, writer, follower = replicas(), replicas(), replicas()
    vecs = random_unit(1, seed=8)
    t0 = fake_clock()
    writer.add(A, ["k"], vecs, expires_at=[t0 + 1])
    fake_clock.advance(2)
    real_hmget = sweeper._reader.hmget

    def hmget_then_a_write(*args, **kwargs):  # the entry is stored again between the sweep's reads and its step
        rows = real_hmget(*args, **kwargs)
        writer.add(A, ["k"], vecs, expires_at=[fake_clock() + 100])
        return rows

    sweeper._reader.hmget = hmget_then_a_write
    assert sweeper.sweep() == 0
    sweeper._reader.hmget = real_hmget
    assert sweeper.sweep() == 0  # the new deadline is ahead: nothing is due
    assert admin.hkeys(entries_key(A)) == [b"k"]
    assert follower.follow_once() == 2 and ids(follower.search(A, vecs, 1)) == [["k"]]  # two adds, no removal


# -- replicas that hold the secret -------------------------------------------------------------------------


def test_two_replicas_holding_the_secret_share_adds_removals_and_expiry(replicas, fake_clock):
    writer = replicas()
    follower = replicas(follow=True, block_ms=20)
    assert follower.wait_synced(15)
    vecs = random_unit(3, seed=6)
    writer.add(A, ["a0", "a1"], vecs[:2], metas=[{"answer": "r0"}, {}], expires_at=[None, fake_clock() + 5])
    writer.add(B, ["b0"], vecs[2:])
    eventually(lambda: follower.get(B, "b0") is not None, timeout=15, message="the follower to apply the adds")
    assert ids(follower.search(A, vecs[:1], 2)) == [["a0", "a1"]]
    assert follower.get(A, "a0") == SharedEntry({"answer": "r0"}, None)
    writer.remove(A, ["a0"])
    eventually(lambda: follower.get(A, "a0") is None, timeout=15, message="the follower to apply the removal")
    fake_clock.advance(6)
    assert writer.sweep() == 1
    eventually(lambda: follower.scopes() == [B], timeout=15, message="the follower to apply the expiry")
    # The follower may drop the expired entry on its own clock before the sweep's message arrives: wait for it.
    eventually(lambda: follower.stats().applied == 5, timeout=15, message="the follower to apply the sweep")
    assert follower.stats().forged == 0 and follower.stats().corrupt == 0


def test_a_replica_under_another_secret_finds_nothing(replicas):
    vecs = random_unit(2, seed=7)
    replicas().add(A, ["a0", "a1"], vecs)
    stranger = replicas(secret=OTHER_SECRET)
    assert stranger.search(A, vecs, 2) == [[], []] and stranger.stats().forged == 2
    # The stranger deleted nothing: a replica with the right secret still finds both.
    assert [sorted(found) for found in ids(replicas().search(A, vecs, 2))] == [["a0", "a1"], ["a0", "a1"]]


# -- the secret --------------------------------------------------------------------------------------------


def test_a_shared_index_in_redis_requires_the_secret(redis_url):
    with pytest.raises(TypeError, match="secret="):
        SharedIndex(redis_url, follow=False)
    with pytest.raises(ValueError, match="at least 16"):
        SharedIndex(redis_url, secret=b"short", follow=False)
    with pytest.raises(TypeError, match="must be bytes"):
        SharedIndex(redis_url, secret="a text, not bytes at all", follow=False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="SharedRedis.secret is 5 bytes"):
        SharedRedis(redis_url, "p", secret=b"short")
    assert "secret" not in repr(SharedRedis(redis_url, "p", secret=SECRET))


def test_the_runtime_signs_its_semantic_index_with_the_entry_secret(redis_url):
    runtime = build_runtime(StoreConfig(redis=RedisConfig(url=redis_url, secret=SECRET.decode())))
    try:
        assert runtime.semantic._redis == SharedRedis(redis_url, "evc-sem", 0.05, 1.0, secret=SECRET)
    finally:
        runtime.close()
