"""A replica's rollout: per-call runtimes (use_runtime), rules of another version on the same store
(CacheRuntime.with_rules), and the arms a replica serves (RolloutRuntimes: active, canary by request key, a
shadow that is planned beside each call and never acts)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from evocache.controller import (
    CacheRuntime,
    StoreConfig,
    StoreConfigError,
    build_runtime,
    cache_if,
    current_runtime,
    default_runtime,
    use_runtime,
)
from evocache.dsl import Policy, parse_policy


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
    assert [(e.outcome, e.policy) for e in base.events.events()] == [("miss", "chat@1"), ("store", "chat@1"),
                                                                     ("hit", "chat@1")]
    assert current_runtime() is default_runtime()
    assert f(1) == "v1" and calls == [1, 1]  # outside the block: the process runtime, which never held it
    assert len(base.events.events()) == 3


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
    stored = {(e.outcome, e.policy) for e in base.events.events()}
    assert stored == {("miss", "chat@1"), ("store", "chat@1")}
    assert len(base.events.events()) == 4  # f(1) and f(2); f(3) ran outside the block


def test_use_runtime_reaches_a_stream_created_in_the_block_even_if_read_after_it(base: CacheRuntime) -> None:
    @cache_if("true")
    def tokens(n: int) -> Iterator[str]:
        yield from (f"t{i}" for i in range(n))

    with use_runtime(base):
        stream = tokens(3)
        assert list(tokens(2)) == ["t0", "t1"]
    assert list(stream) == ["t0", "t1", "t2"]
    assert [(e.outcome, e.policy) for e in base.events.events()] == [
        ("miss", "chat@1"), ("store", "chat@1"), ("miss", "chat@1"), ("store", "chat@1")]
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
    assert [e.outcome for e in pinned.events.events()] == ["miss", "store"] and base.events.events() == []
    pinned.close()


# --- with_rules --------------------------------------------------------------------------------------------


def test_with_rules_shares_the_store_and_decides_by_the_other_version(base: CacheRuntime) -> None:
    canary = base.with_rules(policy(2, ttl="1m", rules="  - name: wide\n    when: top_k > 5\n    cache: bypass\n"))
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
        ("miss", "all", "chat@2", ""), ("store", "all", "chat@2", ""), ("bypass", "wide", "chat@2", "rule"),
        ("hit", "all", "chat@1", ""), ("miss", "all", "chat@1", ""), ("store", "all", "chat@1", "")]
    plan = f.cached_function.contract.plan(base, (1,), {})
    entry = base.store.get(plan.ns, plan.key).entry
    assert entry is not None and entry.expires_at - entry.created_at == 60.0  # the canary's ttl decided


def test_with_rules_checks_the_policy_and_builds_nothing_for_one_it_cannot_enforce(base: CacheRuntime) -> None:
    with pytest.raises(StoreConfigError, match=r"policy chat@2: eviction.l1: unknown eviction policy"):
        base.with_rules(policy(2, l1="clairvoyant"))
    with pytest.raises(TypeError, match=r"^with_rules\(\) takes a Policy"):
        base.with_rules("chat@2")  # type: ignore[arg-type]
    assert base.with_rules(None).policy is None and base.with_rules(None).policy_ref == ""
