"""The policy store: the same exact-state suite over the file store and the Redis store (a real redis-server),
canary choice by request key, a follower that keeps its last good rollout, and the `evocache policy` commands."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from _helpers import FakeClock
from typer.testing import CliRunner

from evocache.controller import (
    DiskConfig,
    FilePolicyStore,
    PolicyFollower,
    PolicyState,
    PolicyStore,
    PolicyStoreConfig,
    PolicyStoreError,
    RedisConfig,
    RedisPolicyStore,
    Registration,
    Rollout,
    StoreConfig,
    StoreConfigError,
    StoreSummary,
    UnenforceablePolicy,
    canary_for,
)
from evocache.dsl import PolicyError, parse_policy

import evocache.controller._policy_store as policy_store_module


def doc(version: int, name: str = "chat", ttl: str = "5m", eviction: str = "lru") -> str:
    return (f"policy: {name}\nversion: {version}\ndefaults: {{ttl: {ttl}}}\nrules: []\n"
            f"eviction: {{l1: {eviction}}}\n")


T0 = 1_700_000_000.0


@pytest.fixture(params=["file", "redis"])
def open_store(request: pytest.FixtureRequest, tmp_path: Path,
               fake_clock: FakeClock) -> Iterator[Callable[[], PolicyStore]]:
    """A function that opens the test's store (again: same directory or same Redis), on ``fake_clock``."""
    opened: list[PolicyStore] = []

    def open_it() -> PolicyStore:
        if request.param == "file":
            store: PolicyStore = FilePolicyStore(tmp_path / "policies", clock=fake_clock, stale_after_s=30.0)
        else:
            url = request.getfixturevalue("redis_url")
            store = RedisPolicyStore(url, "t:policy", clock=fake_clock, stale_after_s=30.0)
        opened.append(store)
        return store

    yield open_it
    for store in opened:
        store.close()


def test_each_operation_leaves_the_exact_state(open_store: Callable[[], PolicyStore],
                                               fake_clock: FakeClock) -> None:
    store = open_store()
    assert store.state() == PolicyState()
    assert store.apply(doc(1)) == PolicyState(active="chat@1", serial=1,
                                              history=({"action": "apply", "ref": "chat@1", "at": T0},))
    fake_clock.advance(10)
    s2 = store.apply(doc(2, ttl="10m"), canary=0.25)
    assert s2 == PolicyState(active="chat@1", canary="chat@2", fraction=0.25, serial=2, history=(
        {"action": "apply", "ref": "chat@1", "at": T0},
        {"action": "canary", "ref": "chat@2", "fraction": 0.25, "at": T0 + 10}))
    assert store.state() == s2
    fake_clock.advance(10)
    s3 = store.promote()
    assert (s3.active, s3.canary, s3.fraction, s3.previous, s3.serial) == ("chat@2", None, 0.0, ("chat@1",), 3)
    assert s3.history[-1] == {"action": "promote", "ref": "chat@2", "at": T0 + 20}
    s4 = store.apply(doc(3), canary=0.5)
    s5 = store.rollback()  # drops the canary
    assert (s5.active, s5.canary, s5.previous, s5.serial) == ("chat@2", None, ("chat@1",), 5)
    assert s5.history[-1] == {"action": "rollback", "ref": "chat@3", "at": T0 + 20} and s4.canary == "chat@3"
    s6 = store.rollback()  # no canary: back to the version active before
    assert (s6.active, s6.canary, s6.previous, s6.serial) == ("chat@1", None, (), 6)
    assert s6.history[-1] == {"action": "rollback", "ref": "chat@2", "at": T0 + 20}
    assert len(s6.history) == 6
    assert store.load("chat@2") == parse_policy(doc(2, ttl="10m"))
    with pytest.raises(PolicyStoreError, match=r"^nothing to roll back to: no canary or shadow, and no "
                                               r"version was active before chat@1$"):
        store.rollback()
    with pytest.raises(PolicyStoreError, match=r"^nothing to promote: there is no canary$"):
        store.promote()
    assert store.state() == s6


def test_an_invalid_document_is_rejected_whole_and_nothing_changes(open_store: Callable[[], PolicyStore]) -> None:
    store = open_store()
    before = store.apply(doc(1))
    with pytest.raises(PolicyError):
        store.apply("policy: chat\nversion: 2\nrules: [{name: r, when: 'len(input_ids) >'}]\n")
    with pytest.raises(StoreConfigError, match="eviction.l1: unknown eviction policy 'clairvoyant'"):
        store.apply(doc(2, eviction="clairvoyant"))
    with pytest.raises(PolicyStoreError, match=r"canary fraction 1.5 must be above 0 and below 1"):
        store.apply(doc(2), canary=1.5)
    assert store.state() == before
    with pytest.raises(PolicyStoreError, match="no stored version chat@2"):
        store.load("chat@2")


def test_versions_must_increase(open_store: Callable[[], PolicyStore]) -> None:
    store = open_store()
    store.apply(doc(5))
    before = store.apply(doc(6), canary=0.1)
    with pytest.raises(PolicyStoreError, match=r"^policy chat@5: version 5 is not above the active chat@5$"):
        store.apply(doc(5, ttl="1m"))
    with pytest.raises(PolicyStoreError, match=r"^policy chat@6: version 6 is not above the canary chat@6$"):
        store.apply(doc(6))
    with pytest.raises(PolicyStoreError, match=r"^policy other@9: this store holds policy 'chat'"):
        store.apply(doc(9, name="other"))
    assert store.state() == before
    store.rollback()
    with pytest.raises(PolicyStoreError, match=r"^policy chat@6 was stored before with other content"):
        store.apply(doc(6, ttl="1h"))
    assert store.apply(doc(6)).active == "chat@6"  # the same document again is allowed


def test_a_canary_needs_an_active_policy(open_store: Callable[[], PolicyStore]) -> None:
    store = open_store()
    with pytest.raises(PolicyStoreError, match="no active policy for a canary"):
        store.apply(doc(1), canary=0.1)
    assert store.state() == PolicyState()


def test_state_history_and_reports_survive_reopening(open_store: Callable[[], PolicyStore]) -> None:
    store = open_store()
    store.apply(doc(1))
    state = store.apply(doc(2), canary=0.3)
    store.report("r1", "chat@1", True, canary="chat@2")
    store.close()
    again = open_store()
    assert again.state() == state
    assert again.load("chat@2") == parse_policy(doc(2))
    assert [(r.replica_id, r.ref, r.canary, r.ok) for r in again.status().replicas] == [
        ("r1", "chat@1", "chat@2", True)]
    assert again.promote().active == "chat@2"


def test_status_shows_each_replica_and_marks_stale_reports(open_store: Callable[[], PolicyStore],
                                                           fake_clock: FakeClock) -> None:
    store = open_store()
    store.apply(doc(1))
    store.report("b", "chat@1", True)
    fake_clock.advance(31)
    store.report("a", None, False, "chat@1: boom")
    status = store.status()
    assert [(r.replica_id, r.ref, r.ok, r.error, r.at, r.stale) for r in status.replicas] == [
        ("a", None, False, "chat@1: boom", T0 + 31, False),
        ("b", "chat@1", True, None, T0, True),
    ]
    with pytest.raises(PolicyStoreError, match="replica id 'a/b' must match"):
        store.report("a/b", None, True)


def test_a_follower_loads_changes_and_keeps_the_last_good_rollout(open_store: Callable[[], PolicyStore]) -> None:
    store = open_store()
    seen: list[Rollout] = []

    def on_policy(rollout: Rollout) -> None:
        if rollout.canary is not None and rollout.canary.defaults.ttl == 3600:
            raise ValueError("this replica cannot enforce a 1h ttl")
        seen.append(rollout)

    follower = PolicyFollower(store, "r1", on_policy)
    assert follower.poll() is None
    store.apply(doc(1))
    good = follower.poll()
    assert good == Rollout(parse_policy(doc(1))) and seen == [good]
    store.apply(doc(2, ttl="1h"), canary=0.2)
    assert follower.poll() is good and seen == [good]
    assert follower.poll() is good and seen == [good]  # not tried again until the state changes
    [report] = store.status().replicas
    assert (report.ref, report.canary, report.ok, report.error) == (
        "chat@1", None, False, "chat@2: this replica cannot enforce a 1h ttl")
    store.rollback()
    assert follower.poll() is good and seen == [good]  # the same rollout as before: on_policy not called again
    [report] = store.status().replicas
    assert (report.ref, report.ok, report.error) == ("chat@1", True, None)
    store.apply(doc(3), canary=0.2)
    rollout = follower.poll()
    assert rollout == Rollout(parse_policy(doc(1)), parse_policy(doc(3)), 0.2) and seen[-1] is rollout
    [report] = store.status().replicas
    assert (report.ref, report.canary, report.ok) == ("chat@1", "chat@3", True)


def shared_l2(version: int) -> str:
    """A policy whose tenant acme takes a share of L2: only a store with ``l2_bytes`` can enforce it."""
    return doc(version) + "tenants:\n  acme: {l2_share: 0.5}\n"


NO_QUOTA = StoreConfig(redis=RedisConfig(url="redis://:s3cret-password@10.0.0.5:6379/0"),
                       disk=DiskConfig(path="/var/cache/evocache"))
WITH_QUOTA = StoreConfig(redis=RedisConfig(url="redis://10.0.0.5:6379/0", l2_bytes=1 << 30))
NO_L2_BYTES = ("tenants ['acme'] set l2_share, but the store has no l2_bytes to share (RedisConfig.l2_bytes: "
               "evocache's part of Redis memory)")


def test_apply_refuses_what_a_current_replica_cannot_enforce_and_changes_nothing(
        open_store: Callable[[], PolicyStore]) -> None:
    store = open_store()
    before = store.apply(doc(1))
    PolicyFollower(store, "model-a", lambda rollout: None).register("run-1", NO_QUOTA)
    PolicyFollower(store, "model-b", lambda rollout: None).register("run-1", WITH_QUOTA)
    for canary, shadow in ((None, False), (0.5, False), (None, True)):
        with pytest.raises(UnenforceablePolicy) as refused:
            store.apply(shared_l2(2), canary, shadow=shadow)
        assert str(refused.value) == ("policy chat@2: replica model-a (tiers l1, l2, l3; l2_bytes none) "
                                      f"cannot enforce it: {NO_L2_BYTES}")
        assert refused.value.replica_id == "model-a"
    assert store.state() == before
    with pytest.raises(PolicyStoreError, match="no stored version chat@2"):
        store.load("chat@2")
    assert store.apply(doc(2)).active == "chat@2"  # what every replica can enforce goes through


def test_a_registration_keeps_what_the_check_reads_and_no_credentials(open_store: Callable[[], PolicyStore],
                                                                      fake_clock: FakeClock) -> None:
    store = open_store()
    PolicyFollower(store, "model-a", lambda rollout: None).register("run-1", NO_QUOTA)
    [report] = open_store().status().replicas
    summary = StoreSummary(l1_bytes=64 << 20, l1_eviction="lru", l2="redis://10.0.0.5:6379/0",
                           l3="/var/cache/evocache")
    assert report.registration == Registration("run-1", T0, summary)
    assert (report.ref, report.ok, report.at) == (None, True, T0)
    assert summary.config().redis.url == "redis://10.0.0.5:6379/0" and summary.config().redis.l2_bytes is None
    assert StoreSummary.of(WITH_QUOTA).describe() == "tiers l1, l2; l2_bytes 1073741824"
    assert StoreSummary.of(StoreConfig(redis=None)).describe() == "tiers l1"


def test_replicas_gone_or_of_an_earlier_run_are_marked_and_do_not_hold_back_a_policy(
        open_store: Callable[[], PolicyStore], fake_clock: FakeClock) -> None:
    store = open_store()
    store.apply(doc(1))
    old = PolicyFollower(store, "model-old", lambda rollout: None)
    old.register("run-1", NO_QUOTA)
    ingress = PolicyFollower(store, "ingress-old", lambda rollout: None)
    ingress.register("run-1", None)
    PolicyFollower(store, "plain", lambda rollout: None).poll()  # a follower that never registers
    fake_clock.advance(10)
    new = PolicyFollower(store, "model-new", lambda rollout: None)
    new.register("run-2", WITH_QUOTA)
    old.poll()  # an earlier run's replica still reporting: of an earlier run, not current
    status = store.status()
    assert status.run == "run-2"
    assert [(r.replica_id, r.stale, r.earlier_run, r.current) for r in status.replicas] == [
        ("ingress-old", False, True, False), ("model-new", False, False, True),
        ("model-old", False, True, False), ("plain", False, False, True)]
    assert store.apply(shared_l2(2)).active == "chat@2"  # model-old runs an earlier run: not asked

    fake_clock.advance(31)
    new.poll()
    status = store.status()
    assert [(r.replica_id, r.stale, r.earlier_run, r.current) for r in status.replicas] == [
        ("ingress-old", True, True, False), ("model-new", False, False, True),
        ("model-old", True, True, False), ("plain", True, False, False)]
    fake_clock.advance(31)
    assert [r.current for r in store.status().replicas] == [False] * 4  # every one gone


def test_a_gone_replica_does_not_hold_back_a_policy(open_store: Callable[[], PolicyStore],
                                                    fake_clock: FakeClock) -> None:
    store = open_store()
    store.apply(doc(1))
    PolicyFollower(store, "model-a", lambda rollout: None).register("run-1", NO_QUOTA)
    with pytest.raises(UnenforceablePolicy):
        store.apply(shared_l2(2))
    fake_clock.advance(31)  # no report within stale_after_s: gone
    assert store.apply(shared_l2(2)).active == "chat@2"


def test_cli_apply_names_the_replica_that_cannot_enforce_it_and_status_marks_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from evocache.cli.app import make_app

    app, runner = make_app(), CliRunner()
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("EVOCACHE_POLICY_STORE", raising=False)
    (tmp_path / "v1.yaml").write_text(doc(1))
    (tmp_path / "v2.yaml").write_text(shared_l2(2))
    clock = FakeClock(T0)

    def run(*args: str) -> tuple[int, str, str]:
        result = runner.invoke(app, ["policy", *args])
        return result.exit_code, result.stdout, result.stderr

    assert run("apply", "v1.yaml")[0] == 0
    store = FilePolicyStore(tmp_path / ".evocache" / "policies", clock=clock)
    PolicyFollower(store, "model-old", lambda rollout: None).register("run-1", WITH_QUOTA)
    clock.advance(5)
    PolicyFollower(store, "ingress-1", lambda rollout: None).register("run-2", None)
    PolicyFollower(store, "model-1", lambda rollout: None).register("run-2", NO_QUOTA)
    opened = policy_store_module.open_policy_store  # the CLI's store reads the test's clock
    monkeypatch.setattr(policy_store_module, "open_policy_store", lambda config: opened(config, clock=clock))
    assert run("apply", "v2.yaml") == (
        2, "", f"error: policy chat@2: replica model-1 (tiers l1, l2, l3; l2_bytes none) cannot enforce it: "
               f"{NO_L2_BYTES}\n")
    assert FilePolicyStore(tmp_path / ".evocache" / "policies").state().active == "chat@1"
    clock.advance(40)
    PolicyFollower(store, "model-2", lambda rollout: None).register("run-2", NO_QUOTA)
    code, out, _ = run("status")
    assert code == 0
    assert out.splitlines()[5:] == [
        "replicas:",
        "  model-2 none ok at 2023-11-14T22:14:05Z (run run-2; tiers l1, l2, l3; l2_bytes none)",
        "gone (no report within 30s):",
        "  ingress-1 none ok at 2023-11-14T22:13:25Z (run run-2)",
        "  model-1 none ok at 2023-11-14T22:13:25Z (run run-2; tiers l1, l2, l3; l2_bytes none)",
        "of earlier runs:",
        "  model-old none ok at 2023-11-14T22:13:20Z (run run-1; tiers l1, l2; l2_bytes 1073741824)",
    ]


def test_a_corrupt_stored_version_is_reported_and_the_old_one_kept(tmp_path: Path, fake_clock: FakeClock) -> None:
    store = FilePolicyStore(tmp_path, clock=fake_clock)
    store.apply(doc(1))
    follower = PolicyFollower(store, "r1", lambda rollout: None)
    good = follower.poll()
    store.apply(doc(2))
    (tmp_path / "versions" / "chat@2.yaml").write_text(doc(7))
    assert follower.poll() is good
    [report] = store.status().replicas
    assert report.ok is False and report.error == f"chat@2: {tmp_path}/versions/chat@2.yaml: holds chat@7, not chat@2"


def test_the_file_store_wait_sees_a_change_by_polling(tmp_path: Path) -> None:
    slept: list[float] = []
    store = FilePolicyStore(tmp_path, sleep=slept.append, interval=0.5)
    assert store.wait(2.0) is False and slept == [0.5, 0.5, 0.5, 0.5]
    other = FilePolicyStore(tmp_path)
    other.apply(doc(1))
    slept.clear()
    assert store.wait(2.0) is True and slept == []
    assert store.wait(0.0) is False


def test_the_redis_store_publishes_each_change(redis_url: str) -> None:
    follower_side = RedisPolicyStore(redis_url, "t:policy")
    writer = RedisPolicyStore(redis_url, "t:policy")
    try:
        assert follower_side.wait(0.01) is False  # subscribes
        writer.apply(doc(1))
        assert follower_side.wait(10.0) is True
        assert sorted(k.decode() for k in writer.client.keys("*")) == ["{t:policy}:state", "{t:policy}:v:chat@1"]
    finally:
        follower_side.close()
        writer.close()


def test_canary_for_is_the_hash_of_the_key_below_the_fraction() -> None:
    point = int.from_bytes(hashlib.sha256(b"conversation-17").digest()[:8], "big") / 2.0**64
    assert canary_for(b"conversation-17", math.nextafter(point, 1.0)) is True
    assert canary_for("conversation-17", point) is False
    assert canary_for("x", 0.0) is False and canary_for("x", 1.0) is True
    with pytest.raises(ValueError, match=r"canary fraction 1.1 is not between 0 and 1"):
        canary_for("x", 1.1)


def test_canary_fraction_over_10000_keys_is_within_the_binomial_bound() -> None:
    n, p = 10_000, 0.1
    bound = 5 * math.sqrt(n * p * (1 - p))  # 5 standard deviations: 150 keys
    chosen = sum(canary_for(f"conversation-{i}", p) for i in range(n))
    assert abs(chosen - n * p) <= bound
    # Stable: a key chosen at 0.1 stays chosen at any larger fraction, and the same key gets the same answer.
    assert all(canary_for(f"conversation-{i}", 0.3) for i in range(n) if canary_for(f"conversation-{i}", p))
    rollout = Rollout(parse_policy(doc(1)), parse_policy(doc(2)), p)
    assert {rollout.policy_for("conversation-1").version for _ in range(5)} == {
        2 if canary_for("conversation-1", p) else 1}


def test_the_config_takes_exactly_one_place() -> None:
    assert PolicyStoreConfig(directory="d").redis_url is None
    with pytest.raises(StoreConfigError, match=r"give directory or redis_url, exactly one"):
        PolicyStoreConfig(directory="d", redis_url="redis://localhost:6379/0")
    with pytest.raises(StoreConfigError, match=r"policy_store.stale_after_s"):
        PolicyStoreConfig(directory="d", stale_after_s=0)


def test_cli_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from evocache.cli.app import make_app

    app, runner = make_app(), CliRunner()
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("EVOCACHE_POLICY_STORE", raising=False)
    for version in (1, 2, 3):
        (tmp_path / f"v{version}.yaml").write_text(doc(version))
    (tmp_path / "bad.yaml").write_text(doc(4, eviction="clairvoyant"))

    def run(*args: str) -> tuple[int, str, str]:
        result = runner.invoke(app, ["policy", *args])
        return result.exit_code, result.stdout, result.stderr

    assert run("apply", "v1.yaml") == (0, "active: chat@1\ncanary: none\nshadow: none\n", "")
    assert (tmp_path / ".evocache" / "policies" / "versions" / "chat@1.yaml").is_file()
    assert run("apply", "v2.yaml", "--canary", "0.1") == (
        0, "active: chat@1\ncanary: chat@2 on 0.1 of requests\nshadow: none\n", "")
    code, out, err = run("apply", "bad.yaml")
    assert code == 1 and "eviction.l1: unknown eviction policy 'clairvoyant'" in err and out == ""
    assert run("apply", "v1.yaml") == (1, "", "error: policy chat@1: version 1 is not above the active chat@1\n")
    assert run("apply", "missing.yaml")[0] == 2
    assert run("apply", "v3.yaml", "--store", "a", "--redis", "redis://localhost:1/0") == (
        2, "", "error: --store/--redis: give one store, not both\n")
    assert run("promote") == (0, "active: chat@2\ncanary: none\nshadow: none\n", "")
    assert run("promote") == (1, "", "error: nothing to promote: there is no canary\n")
    assert run("rollback") == (0, "active: chat@1\ncanary: none\nshadow: none\n", "")
    FilePolicyStore(tmp_path / ".evocache" / "policies", clock=lambda: T0).report("r1", "chat@1", True)
    code, out, _ = run("status")
    assert code == 0
    assert out.splitlines()[:4] == ["active: chat@1", "canary: none", "shadow: none", "history:"]
    assert [line.split()[1:] for line in out.splitlines()[4:8]] == [
        ["apply", "chat@1"], ["canary", "chat@2"], ["promote", "chat@2"], ["rollback", "chat@2"]]
    assert out.splitlines()[8:] == ["replicas: none current", "gone (no report within 30s):",
                                    "  r1 chat@1 ok at 2023-11-14T22:13:20Z"]
    monkeypatch.setenv("EVOCACHE_POLICY_STORE", str(tmp_path / "elsewhere"))
    assert run("status") == (
        0, "active: none\ncanary: none\nshadow: none\nhistory: none\nreplicas: none reported\n", "")


def test_cli_against_redis(redis_url: str, tmp_path: Path) -> None:
    from evocache.cli.app import make_app

    (tmp_path / "v1.yaml").write_text(doc(1))
    result = CliRunner().invoke(make_app(), ["policy", "apply", str(tmp_path / "v1.yaml"), "--redis", redis_url])
    assert (result.exit_code, result.stdout) == (0, "active: chat@1\ncanary: none\nshadow: none\n")
    assert RedisPolicyStore(redis_url).state().active == "chat@1"
    result = CliRunner().invoke(make_app(), ["policy", "status", "--redis", "redis://127.0.0.1:1/0"])
    assert result.exit_code == 2 and result.stderr.startswith("error: the policy store: ")


def test_a_started_follower_picks_up_a_new_version(open_store: Callable[[], PolicyStore]) -> None:
    import threading

    store, writer = open_store(), open_store()
    writer.apply(doc(1))
    versions: list[int] = []
    second = threading.Event()

    def on_policy(rollout: Rollout) -> None:
        versions.append(rollout.active.version)
        if rollout.active.version == 2:
            second.set()

    follower = PolicyFollower(store, "r1", on_policy, interval=0.05).start()
    try:
        writer.apply(doc(2))
        assert second.wait(timeout=30)
    finally:
        follower.stop()
    assert versions[-1] == 2 and set(versions) <= {1, 2}
    assert [(r.replica_id, r.ref, r.ok) for r in writer.status().replicas] == [("r1", "chat@2", True)]


def test_a_write_that_fails_midway_leaves_the_old_state_and_no_temporary_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    store = FilePolicyStore(tmp_path)
    before = store.apply(doc(1))
    state_text = (tmp_path / "state.json").read_text()

    def crash(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError, match="No space left on device"):
        store.apply(doc(2))
    monkeypatch.undo()
    assert (tmp_path / "state.json").read_text() == state_text and store.state() == before
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == [".lock", "chat@1.yaml", "state.json"]
    assert FilePolicyStore(tmp_path).apply(doc(2)).active == "chat@2"


# --- the shadow ---------------------------------------------------------------------------------------------


def test_a_shadow_is_held_beside_the_active_and_the_canary(open_store: Callable[[], PolicyStore],
                                                            fake_clock: FakeClock) -> None:
    store = open_store()
    store.apply(doc(1))
    store.apply(doc(2), canary=0.2)
    fake_clock.advance(5)
    s3 = store.apply(doc(3, ttl="1h"), shadow=True)
    assert (s3.active, s3.canary, s3.fraction, s3.shadow, s3.serial) == ("chat@1", "chat@2", 0.2, "chat@3", 3)
    assert s3.history[-1] == {"action": "shadow", "ref": "chat@3", "at": T0 + 5}
    assert store.state() == s3 and store.status().state.shadow == "chat@3"
    assert store.load("chat@3") == parse_policy(doc(3, ttl="1h"))
    s4 = store.promote()  # the canary; the shadow, newer than both, stays
    assert (s4.active, s4.canary, s4.shadow, s4.previous) == ("chat@2", None, "chat@3", ("chat@1",))
    with pytest.raises(PolicyStoreError, match=r"^nothing to promote: there is no canary \(the shadow "
                                               r"chat@3 is put in force by applying its document again, as "
                                               r"the canary or the active\)$"):
        store.promote()
    s5 = store.apply(doc(3, ttl="1h"), canary=0.5)  # the shadow's own version, now as the canary
    assert (s5.active, s5.canary, s5.fraction, s5.shadow) == ("chat@2", "chat@3", 0.5, None)
    s6 = store.apply(doc(4), shadow=True)
    s7 = store.rollback()  # drops the canary and the shadow, one entry each
    assert (s6.canary, s6.shadow) == ("chat@3", "chat@4")
    assert (s7.active, s7.canary, s7.fraction, s7.shadow, s7.previous) == (
        "chat@2", None, 0.0, None, ("chat@1",))
    assert s7.history[-2:] == ({"action": "rollback", "ref": "chat@3", "at": T0 + 5},
                               {"action": "rollback", "ref": "chat@4", "at": T0 + 5})
    store.apply(doc(5), shadow=True)
    s9 = store.apply(doc(5))  # the shadow's version as the active
    assert (s9.active, s9.shadow, s9.previous) == ("chat@5", None, ("chat@1", "chat@2"))
    s10 = store.apply(doc(6), shadow=True)
    s11 = store.rollback()  # only a shadow: dropped; the active stays
    assert (s10.shadow, s11.active, s11.shadow, s11.history[-1]["ref"]) == (
        "chat@6", "chat@5", None, "chat@6")


def test_shadow_refusals_change_nothing(open_store: Callable[[], PolicyStore]) -> None:
    store = open_store()
    with pytest.raises(PolicyStoreError, match=r"^policy chat@1: no active policy for a shadow to run "
                                               r"beside; apply it first without a shadow$"):
        store.apply(doc(1), shadow=True)
    store.apply(doc(1))
    before = store.apply(doc(3), shadow=True)
    with pytest.raises(PolicyStoreError,
                       match=r"^a policy is applied as the canary or as the shadow, not both$"):
        store.apply(doc(4), canary=0.1, shadow=True)
    with pytest.raises(PolicyStoreError, match=r"^policy chat@2: version 2 is not above the shadow chat@3$"):
        store.apply(doc(2), canary=0.1)
    with pytest.raises(PolicyStoreError, match=r"^policy chat@3: version 3 is not above the shadow chat@3$"):
        store.apply(doc(3), shadow=True)
    with pytest.raises(PolicyStoreError, match=r"^policy chat@3 was stored before with other content"):
        store.apply(doc(3, ttl="1m"), canary=0.1)  # the shadow's version, but another document
    with pytest.raises(TypeError, match=r"^apply\(shadow=\) takes a bool, not str$"):
        store.apply(doc(4), shadow="yes")  # type: ignore[arg-type]
    assert store.state() == before


def test_state_and_reports_written_before_shadows_still_read(tmp_path: Path) -> None:
    store = FilePolicyStore(tmp_path)
    (tmp_path / "state.json").write_text('{"active": "chat@1", "canary": null, "fraction": 0.0, '
                                         '"previous": [], "history": [], "serial": 4}')
    (tmp_path / "replicas" / "r1.json").write_text('{"replica_id": "r1", "ref": "chat@1", "canary": null, '
                                                   '"ok": true, "error": null, "at": 1.0}')
    assert store.state() == PolicyState(active="chat@1", serial=4)
    [report] = store.status().replicas
    assert (report.ref, report.canary, report.shadow) == ("chat@1", None, None)
    (tmp_path / "state.json").write_text('{"active": "chat@1", "canary": null, "fraction": 0.0, '
                                         '"previous": [], "history": [], "serial": 4, "shadow": "chat 2"}')
    with pytest.raises(PolicyStoreError, match=r"state.json: 'chat 2' is not a policy ref \(name@version\)$"):
        store.state()


def test_a_follower_loads_the_shadow_and_reports_it(open_store: Callable[[], PolicyStore]) -> None:
    store = open_store()
    seen: list[Rollout] = []
    follower = PolicyFollower(store, "r1", seen.append)
    store.apply(doc(1))
    store.apply(doc(2), canary=0.1)
    store.apply(doc(3), shadow=True)
    rollout = follower.poll()
    assert rollout == Rollout(parse_policy(doc(1)), parse_policy(doc(2)), 0.1, parse_policy(doc(3)))
    assert seen == [rollout]
    [report] = store.status().replicas
    assert (report.ref, report.canary, report.shadow, report.ok) == ("chat@1", "chat@2", "chat@3", True)
    store.rollback()
    assert follower.poll() == Rollout(parse_policy(doc(1)))
    [report] = store.status().replicas
    assert (report.ref, report.canary, report.shadow) == ("chat@1", None, None)


def test_a_shadow_that_does_not_load_is_reported_and_the_last_rollout_kept(tmp_path: Path) -> None:
    store = FilePolicyStore(tmp_path)
    store.apply(doc(1))
    follower = PolicyFollower(store, "r1", lambda rollout: None)
    good = follower.poll()
    store.apply(doc(2), shadow=True)
    (tmp_path / "versions" / "chat@2.yaml").write_text(doc(7))
    assert follower.poll() is good
    [report] = store.status().replicas
    assert (report.ref, report.shadow, report.ok) == ("chat@1", None, False)
    assert report.error == f"chat@2: {tmp_path}/versions/chat@2.yaml: holds chat@7, not chat@2"


def test_cli_shadow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from evocache.cli.app import make_app

    app, runner = make_app(), CliRunner()
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("EVOCACHE_POLICY_STORE", raising=False)
    for version in (1, 2, 3):
        (tmp_path / f"v{version}.yaml").write_text(doc(version))

    def run(*args: str) -> tuple[int, str, str]:
        result = runner.invoke(app, ["policy", *args])
        return result.exit_code, result.stdout, result.stderr

    assert run("apply", "v1.yaml", "--shadow") == (
        1, "", "error: policy chat@1: no active policy for a shadow to run beside; apply it first without a "
               "shadow\n")
    assert run("apply", "v1.yaml")[0] == 0
    assert run("apply", "v2.yaml", "--canary", "0.1", "--shadow") == (
        2, "", "error: --canary/--shadow: apply a policy as the canary or as the shadow, not both\n")
    assert run("apply", "v3.yaml", "--shadow") == (0, "active: chat@1\ncanary: none\nshadow: chat@3\n", "")
    assert run("promote") == (1, "", "error: nothing to promote: there is no canary (the shadow chat@3 is "
                                     "put in force by applying its document again, as the canary or the "
                                     "active)\n")
    opened = FilePolicyStore(tmp_path / ".evocache" / "policies", clock=lambda: T0)
    opened.report("r1", "chat@1", True, shadow="chat@3")
    opened.report("r2", "chat@1", True)
    code, out, _ = run("status")
    assert code == 0 and out.splitlines()[:3] == ["active: chat@1", "canary: none", "shadow: chat@3"]
    assert out.splitlines()[-4:] == ["replicas: none current", "gone (no report within 30s):",
                                     "  r1 chat@1 + shadow chat@3 ok at 2023-11-14T22:13:20Z",
                                     "  r2 chat@1 ok at 2023-11-14T22:13:20Z"]
    assert run("apply", "v3.yaml", "--canary", "0.25") == (
        0, "active: chat@1\ncanary: chat@3 on 0.25 of requests\nshadow: none\n", "")
    assert run("rollback") == (0, "active: chat@1\ncanary: none\nshadow: none\n", "")
