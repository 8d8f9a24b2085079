"""A replica's rollout: per-call runtimes (use_runtime), rules of another version on the same store
(CacheRuntime.with_rules), and the arms a replica serves (RolloutRuntimes: active, canary by request key, a
shadow that is planned beside each call and never acts)."""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from evocache.controller import (
    CacheRuntime,
    FilePolicyStore,
    PolicyFollower,
    Rollout,
    RolloutRuntimes,
    ShadowComparison,
    StoreConfig,
    StoreConfigError,
    build_runtime,
    cache_if,
    canary_for,
    current_runtime,
    default_runtime,
    use_runtime,
)
from evocache.dsl import Policy, parse_policy, policy_to_yaml


def policy(version: int, *, ttl: str = "10m", rules: str = "", l1: str = "lru") -> Policy:
    """Version ``version`` of policy ``chat``: ``rules`` (YAML list items) before a catch-all rule ``all``."""
    return parse_policy(f"""
policy: chat
version: {version}
defaults: {{ttl: {ttl}, tiers: [l1]}}
rules:
{rules}  - name: all
    when: true
eviction: {{l1: {l1}}}
""")


WIDE = "  - name: wide\n    when: top_k > 5\n    cache: bypass\n"
LONG = "  - name: long\n    when: top_k == 3\n    ttl: 1h\n"


@pytest.fixture
def base() -> Iterator[CacheRuntime]:
    runtime = build_runtime(StoreConfig(), policy=policy(1))
    yield runtime
    runtime.close()


# --- use_runtime -------------------------------------------------------------------------------------------


def test_use_runtime_runs_sync_calls_on_its_runtime_and_ends_with_the_block(base: CacheRuntime) -> None:
    calls: list[int] = []

    @cache_if("true")
    def f(x: int) -> str:
        calls.append(x)
        return f"v{x}"

    with use_runtime(base) as entered:
        assert entered is base and current_runtime() is base
        assert f(1) == "v1" and f(1) == "v1"
    assert calls == [1]
    assert [(e.outcome, e.policy) for e in base.events.events()] == [("miss", "chat@1"), ("hit", "chat@1")]
    assert current_runtime() is default_runtime()
    assert f(1) == "v1" and calls == [1, 1]  # outside the block: the process runtime, which never held it
    assert len(base.events.events()) == 2


def test_use_runtime_nests_and_is_restored_after_an_exception(base: CacheRuntime) -> None:
    other = base.with_rules(policy(2))
    with use_runtime(base):
        with use_runtime(other):
            assert current_runtime() is other
        assert current_runtime() is base
        with pytest.raises(RuntimeError, match="boom"), use_runtime(other):
            raise RuntimeError("boom")
        assert current_runtime() is base
    assert current_runtime() is default_runtime()
    with pytest.raises(TypeError, match=r"^use_runtime\(\) takes a CacheRuntime, got StoreConfig$"):
        with use_runtime(StoreConfig()):  # type: ignore[arg-type]
            pass


def test_use_runtime_reaches_async_calls_and_the_tasks_started_in_the_block(base: CacheRuntime) -> None:
    @cache_if("true")
    async def f(x: int) -> str:
        await asyncio.sleep(0)
        return f"v{x}"

    async def main() -> tuple[str, str, str]:
        with use_runtime(base):
            first = await f(1)
            task = asyncio.create_task(f(2))  # the task copies the context it was created in
            in_thread = await asyncio.to_thread(lambda: current_runtime() is base)
        assert in_thread
        second = await task
        assert current_runtime() is not base
        return first, second, await f(3)

    assert asyncio.run(main()) == ("v1", "v2", "v3")
    stored = {(e.outcome, e.policy, e.stored) for e in base.events.events()}
    assert stored == {("miss", "chat@1", "l1")}
    assert len(base.events.events()) == 2  # f(1) and f(2); f(3) ran outside the block


def test_use_runtime_reaches_a_stream_created_in_the_block_even_if_read_after_it(base: CacheRuntime) -> None:
    @cache_if("true")
    def tokens(n: int) -> Iterator[str]:
        yield from (f"t{i}" for i in range(n))

    with use_runtime(base):
        stream = tokens(3)
        assert list(tokens(2)) == ["t0", "t1"]
    assert list(stream) == ["t0", "t1", "t2"]
    assert [(e.outcome, e.policy, e.stored) for e in base.events.events()] == [
        ("miss", "chat@1", "l1"), ("miss", "chat@1", "l1")]
    with use_runtime(base):
        assert list(tokens(3)) == ["t0", "t1", "t2"]
    assert base.events.events()[-1].outcome == "hit"


def test_use_runtime_does_not_reach_another_thread_or_a_pinned_function(base: CacheRuntime) -> None:
    pinned = build_runtime(StoreConfig())

    @cache_if("true", store=pinned)
    def own(x: int) -> int:
        return x

    seen: list[CacheRuntime] = []
    with use_runtime(base):
        thread = threading.Thread(target=lambda: seen.append(current_runtime()))
        thread.start()
        thread.join()
        assert own(1) == 1
    assert seen == [default_runtime()]
    assert [e.outcome for e in pinned.events.events()] == ["miss"] and base.events.events() == []
    pinned.close()


# --- with_rules --------------------------------------------------------------------------------------------


def test_with_rules_shares_the_store_and_decides_by_the_other_version(base: CacheRuntime) -> None:
    canary = base.with_rules(policy(2, ttl="1m", rules=WIDE))
    assert (canary.store, canary.events, canary.metrics, canary.semantic, canary.tenants) == (
        base.store, base.events, base.metrics, base.semantic, base.tenants)
    assert canary.policy_ref == "chat@2" and canary.generation != base.generation
    assert base.policy_ref == "chat@1" and base.tenants.policy is base.policy  # quotas: still the active's

    @cache_if("true")
    def f(top_k: int) -> str:
        return f"v{top_k}"

    with use_runtime(canary):
        f(1), f(9)
    with use_runtime(base):
        f(1), f(9)  # the canary stored f(1): served from the shared store
    assert [(e.outcome, e.rule, e.policy, e.reason) for e in base.events.events()] == [
        ("miss", "all", "chat@2", ""), ("bypass", "wide", "chat@2", "rule"),
        ("hit", "all", "chat@1", ""), ("miss", "all", "chat@1", "")]
    plan = f.cached_function.contract.plan(base, (1,), {})
    entry = base.store.get(plan.ns, plan.key).entry
    assert entry is not None and entry.expires_at - entry.created_at == 60.0  # the canary's ttl decided


def test_with_rules_checks_the_policy_and_builds_nothing_for_one_it_cannot_enforce(
        base: CacheRuntime) -> None:
    with pytest.raises(StoreConfigError, match=r"policy chat@2: eviction.l1: unknown eviction policy"):
        base.with_rules(policy(2, l1="clairvoyant"))
    with pytest.raises(TypeError, match=r"^with_rules\(\) takes a Policy"):
        base.with_rules("chat@2")  # type: ignore[arg-type]
    assert base.with_rules(None).policy is None and base.with_rules(None).policy_ref == ""


# --- RolloutRuntimes ---------------------------------------------------------------------------------------

def keys(arms: RolloutRuntimes, name: str, n: int) -> list[str]:
    """The first ``n`` request keys ``conversation-<i>`` whose arm is ``name``."""
    found = [key for key in (f"conversation-{i}" for i in range(10_000)) if arms.arm_for(key).name == name]
    return found[:n]


def test_the_canary_arm_is_stable_by_key_and_takes_about_its_fraction(base: CacheRuntime) -> None:
    arms = RolloutRuntimes(base)
    assert arms.arm_for("conversation-1") == ("active", base) and arms.rollout is None
    rollout = Rollout(policy(1), policy(2), 0.1)
    arms.apply(rollout)
    n, p = 10_000, 0.1
    chosen = [arms.arm_for(f"conversation-{i}") for i in range(n)]
    on_canary = sum(arm.name == "canary" for arm in chosen)
    assert abs(on_canary - n * p) <= 5 * math.sqrt(n * p * (1 - p))  # 5 standard deviations: 150 keys
    assert all(arm.runtime is (arms.canary if arm.name == "canary" else arms.active) for arm in chosen)
    for i in range(0, n, 97):  # stable: the same key, the same arm; the one the Rollout itself names
        key = f"conversation-{i}"
        assert {arms.arm_for(key).name for _ in range(3)} == {"canary" if canary_for(key, p) else "active"}
        assert arms.arm_for(key).runtime.policy == rollout.policy_for(key)
    assert (arms.active.policy_ref, arms.canary.policy_ref) == ("chat@1", "chat@2")


def test_access_events_carry_the_version_of_the_arm_that_decided(base: CacheRuntime) -> None:
    arms = RolloutRuntimes(base)
    arms.apply(Rollout(policy(1), policy(2, rules=WIDE), 0.3))

    @cache_if("true")
    def f(prompt: str, top_k: int = 0) -> str:
        return prompt.upper()

    on_canary, on_active = keys(arms, "canary", 2), keys(arms, "active", 2)
    for key in (*on_canary, *on_active):
        with arms.use(key) as arm:
            assert current_runtime() is arm.runtime
            f(key, top_k=9)
    assert current_runtime() is default_runtime()
    assert [(e.outcome, e.rule, e.policy) for e in base.events.events()] == [
        ("bypass", "wide", "chat@2"), ("bypass", "wide", "chat@2"),
        ("miss", "all", "chat@1"), ("miss", "all", "chat@1")]


def test_the_shadow_is_planned_beside_each_call_and_counted_where_it_decides_otherwise(
        base: CacheRuntime) -> None:
    arms = RolloutRuntimes(base)
    assert arms.shadow_tally() == {"shadow": None, "compared": 0, "agreed": 0, "differed": {}, "pairs": []}
    arms.apply(Rollout(policy(1), shadow=policy(3, rules=WIDE + LONG)))

    @cache_if("true")
    def f(prompt: str, top_k: int = 0) -> str:
        return prompt.upper()

    with arms.use("conversation-1") as arm:
        assert arm.name == "active"
        assert f("a", top_k=1) == "A"
        same = arms.compare(f, ("a",), {"top_k": 1})
        bypassed = arms.compare(f, ("b",), {"top_k": 9})
        longer = arms.compare(f, ("c",), {"top_k": 3})
        again = arms.compare(f, ("b",), {"top_k": 9})
    assert same == ShadowComparison("all", "all", ()) and same.agree
    assert bypassed == again == ShadowComparison("all", "wide", ("cache", "rule")) and not bypassed.agree
    assert longer == ShadowComparison("all", "long", ("rule", "ttl"))
    # Nothing ran, was stored or was emitted for the compared calls: only f("a")'s own miss, stored.
    assert [(e.outcome, e.policy, e.key == f.cache_key("a", top_k=1), e.stored)
            for e in base.events.events()] == [("miss", "chat@1", True, "l1")]
    assert base.l1.usage(f.cached_function.contract.plan(base, ("a",), {"top_k": 1}).ns) > 0
    assert f.cache_info().misses == 1 and f.cache_info().stores == 1
    for prompt in ("b", "c"):
        plan = f.cached_function.contract.plan(base, (prompt,), {"top_k": 0})
        assert base.store.get(plan.ns, plan.key).entry is None
    assert arms.shadow_tally() == {
        "shadow": "chat@3", "compared": 4, "agreed": 1, "differed": {"cache": 2, "rule": 3, "ttl": 1},
        "pairs": [{"base_rule": "all", "shadow_rule": "all", "agreed": 1, "differed": 0},
                  {"base_rule": "all", "shadow_rule": "long", "agreed": 0, "differed": 1},
                  {"base_rule": "all", "shadow_rule": "wide", "agreed": 0, "differed": 2}]}
    value = base.metrics.value
    assert value("evocache_shadow_decisions_total", base_rule="all", shadow_rule="wide", agree="false") == 2
    assert value("evocache_shadow_decisions_total", base_rule="all", shadow_rule="all", agree="true") == 1
    # The served metrics count what served: no series of the shadow's rules.
    assert sorted({rule for rule, _, _ in base.metrics.decisions}) == ["all"]


def test_the_shadow_compares_against_the_arm_that_served(base: CacheRuntime) -> None:
    arms = RolloutRuntimes(base)
    arms.apply(Rollout(policy(1), policy(2, rules=WIDE), 0.5, shadow=policy(3, rules=WIDE)))

    @cache_if("true")
    def f(prompt: str, top_k: int = 0) -> str:
        return prompt

    [on_canary], [on_active] = keys(arms, "canary", 1), keys(arms, "active", 1)
    with arms.use(on_canary):
        assert arms.compare(f, ("x",), {"top_k": 9}) == ShadowComparison("wide", "wide", ())
    with arms.use(on_active):
        assert arms.compare(f, ("x",), {"top_k": 9}) == ShadowComparison("all", "wide", ("cache", "rule"))
    assert arms.compare(f, ("x",), {"top_k": 9}, base=arms.canary).agree


def test_compare_without_a_shadow_or_for_a_pinned_function_counts_nothing(base: CacheRuntime) -> None:
    arms = RolloutRuntimes(base)
    arms.apply(Rollout(policy(1)))
    pinned = build_runtime(StoreConfig())

    @cache_if("true")
    def f(top_k: int) -> int:
        return top_k

    @cache_if("true", store=pinned)
    def own(top_k: int) -> int:
        return top_k

    assert arms.compare(f, (9,)) is None
    arms.apply(Rollout(policy(1), shadow=policy(3, rules=WIDE)))
    assert arms.compare(own, (9,)) is None
    with pytest.raises(TypeError,
                       match=r"^compare\(\) takes a @cache_if function, got <built-in function len>$"):
        arms.compare(len, ("x",))
    assert arms.shadow_tally()["compared"] == 0
    pinned.close()


def test_a_policy_that_cannot_be_enforced_leaves_the_previous_arms_in_force(base: CacheRuntime) -> None:
    arms = RolloutRuntimes(base)
    good = Rollout(policy(1), policy(2), 0.2, shadow=policy(3))
    arms.apply(good)
    before = (arms.rollout, arms.active, arms.canary, arms.shadow)
    eviction = type(base.l1.policy)
    for bad in (Rollout(policy(4, l1="s3fifo"), policy(5, l1="clairvoyant"), 0.2),
                Rollout(policy(4, l1="s3fifo"), shadow=policy(5, l1="clairvoyant")),
                Rollout(policy(5, l1="clairvoyant"))):
        with pytest.raises(StoreConfigError, match=r"policy chat@5: eviction.l1: unknown eviction policy"):
            arms.apply(bad)
        assert (arms.rollout, arms.active, arms.canary, arms.shadow) == before
        assert type(base.l1.policy) is eviction and base.tenants.policy == policy(1)  # nothing activated
    with pytest.raises(TypeError, match=r"^apply\(\) takes a Rollout, got Policy$"):
        arms.apply(policy(4))  # type: ignore[arg-type]


def test_an_arm_whose_policy_did_not_change_keeps_its_runtime_and_memoised_plans(base: CacheRuntime) -> None:
    arms = RolloutRuntimes(base)
    arms.apply(Rollout(policy(1), policy(2), 0.2))
    active, canary = arms.active, arms.canary
    arms.apply(Rollout(policy(1), policy(2), 0.4, shadow=policy(3)))
    assert arms.active is active and arms.canary is canary and arms.shadow.policy_ref == "chat@3"
    arms.apply(Rollout(policy(2, l1="s3fifo"), shadow=policy(3)))  # the canary promoted
    assert arms.active is not active and arms.active.policy_ref == "chat@2" and arms.canary is None
    assert type(base.l1.policy).__name__ == "S3FIFOPolicy" and base.tenants.policy == policy(2, l1="s3fifo")
    assert arms.arm_for("conversation-1").runtime is arms.active


def test_a_follower_drives_the_arms(tmp_path: Path, base: CacheRuntime) -> None:
    store = FilePolicyStore(tmp_path)
    arms = RolloutRuntimes(base)
    follower = PolicyFollower(store, "r1", arms.apply)
    store.apply(policy_to_yaml(policy(1)))
    store.apply(policy_to_yaml(policy(2)), canary=0.25)
    store.apply(policy_to_yaml(policy(3, rules=WIDE)), shadow=True)
    follower.poll()
    assert (arms.active.policy_ref, arms.canary.policy_ref, arms.shadow.policy_ref) == (
        "chat@1", "chat@2", "chat@3")
    assert arms.rollout == Rollout(policy(1), policy(2), 0.25, policy(3, rules=WIDE))
    [report] = store.status().replicas
    assert (report.ref, report.canary, report.shadow, report.ok) == ("chat@1", "chat@2", "chat@3", True)
    store.rollback()
    follower.poll()
    assert (arms.active.policy_ref, arms.canary, arms.shadow) == ("chat@1", None, None)
    assert arms.shadow_tally()["shadow"] is None
