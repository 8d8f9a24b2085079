"""@cache_if end to end on real tiers: contracts, keys, tenants, sampling, TTLs, streams, events."""

from __future__ import annotations

import asyncio

import pytest

from evocache.controller import (
    Admission,
    ContractError,
    DiskConfig,
    Entry,
    StoreConfig,
    build_runtime,
    cache_if,
    configure,
    default_runtime,
    tenant_scope,
)
from evocache.controller.errors import TierUnavailable
from evocache.controller._keys import ANONYMOUS_NS
from evocache.controller.tiers import MemoryTier, TieredStore
from evocache.dsl import parse_policy


def outcomes(runtime):
    return [(e.outcome, e.tier) for e in runtime.events.events()]


def test_plain_script_caches_in_memory_with_no_setup():
    calls = []

    @cache_if("len(prompt) < 100")
    def echo(prompt: str) -> str:
        calls.append(prompt)
        return prompt.upper()

    assert echo("hello") == "HELLO"
    assert echo("hello") == "HELLO"
    assert calls == ["hello"]
    assert echo.cache_info().hits == 1
    assert list(default_runtime().store.tiers) == ["l1"]


def test_contract_decides_what_is_cached(rt):
    calls = []

    @cache_if("512 <= len(input_ids) <= 2048 and top_k <= 10", store=rt)
    def gen(input_ids: list[int], top_k: int = 0) -> str:
        calls.append(len(input_ids))
        return "x"

    long, short = list(range(600)), [1, 2, 3]
    gen(long, top_k=5), gen(long, top_k=5)
    gen(short), gen(short)
    gen(long, top_k=50), gen(long, top_k=50)
    assert calls == [600, 3, 3, 600, 600]
    assert outcomes(rt) == [
        ("miss", None), ("hit", "l1"),
        ("bypass", None), ("bypass", None), ("bypass", None), ("bypass", None),
    ]
    assert [e.stored for e in rt.events.events()][:2] == ["l1", ""]  # the miss's event says where it went
    assert {e.reason for e in rt.events.events() if e.outcome == "bypass"} == {"contract"}


def test_a_tuple_and_a_list_argument_are_two_entries(rt):
    # The function can tell them apart (here it returns its argument), so the cache must too.
    @cache_if("len(input_ids) >= 2", store=rt)
    def echo(input_ids: list[int]):
        return input_ids

    assert echo([1, 2, 3]) == [1, 2, 3]
    assert echo((1, 2, 3)) == (1, 2, 3)
    assert echo([1, 2, 3]) == [1, 2, 3] and echo((1, 2, 3)) == (1, 2, 3)
    info = echo.cache_info()
    assert (info.hits, info.misses, info.stores) == (2, 2, 2)


def test_unknown_field_fails_at_decoration_with_a_caret():
    with pytest.raises(ContractError) as err:

        @cache_if("len(input_ids) < 10 and top_k <= 10")
        def gen(input_ids: list[int]) -> str:
            return ""

    text = str(err.value)
    assert "top_k" in text and "^" in text and "gen" in text


@pytest.mark.parametrize(
    "options",
    [{"ttl": "ten minutes"}, {"admission": {"tiers": ["l4"]}}, {"admission": {"tiers": []}},
     {"admission": {"max_entry_bytes": 0}}, {"serializer": "yaml"}],
)
def test_bad_options_fail_at_decoration(options):
    with pytest.raises(ContractError):
        cache_if("true", **options)(lambda prompt: prompt)


def test_callable_predicate_sees_the_view(rt):
    seen = []

    def only_acme(view):
        seen.append(view)
        return view["tenant"]["id"] == "acme"

    @cache_if(only_acme, store=rt)
    def f(prompt: str) -> str:
        return prompt

    with tenant_scope("acme"):
        f("a"), f("a")
    f("a"), f("a")
    assert f.cache_info().hits == 1 and f.cache_info().bypasses == 2
    assert seen[0] == {"prompt": "a", "tenant": {"id": "acme", "tier": "default"}, "model": "", "model_revision": ""}


def test_key_binds_model_revision_and_template(rt):
    def make(**kw):
        @cache_if("true", name="gen", store=rt, **kw)
        def gen(prompt: str) -> str:
            return repr(kw)

        return gen

    variants = [make(model="a"), make(model="b"), make(model="a", model_revision="2"),
                make(model="a", prompt_template="Q: {prompt}")]
    answers = [g("same prompt") for g in variants]
    assert len(set(answers)) == 4
    assert len({g.cache_key("same prompt") for g in variants}) == 4
    assert all(g.cache_info().misses == 1 for g in variants)


def test_two_tenants_never_share_an_entry(rt):
    @cache_if("true", store=rt)
    def answer(prompt: str, tenant: str = "default") -> str:
        return f"{tenant}:{prompt}"

    assert answer("cancel my plan", tenant="acme") == "acme:cancel my plan"
    assert answer("cancel my plan", tenant="globex") == "globex:cancel my plan"
    assert answer("cancel my plan") == "default:cancel my plan"
    assert answer.cache_info().misses == 3
    # An explicit `tenant` argument and a tenant scope name the same namespace.
    with tenant_scope("acme"):
        assert answer("cancel my plan") == "acme:cancel my plan"
    assert answer.cache_info().hits == 1
    assert [e.ns for e in rt.events.events() if e.outcome == "miss"] == ["acme", "globex", "default"]


def test_tenant_scope_isolates_identical_calls(rt):
    @cache_if("true", store=rt)
    def answer(prompt: str) -> str:
        return prompt

    for tenant in ("acme", "globex", "acme", "globex"):
        with tenant_scope(tenant):
            answer("p")
    assert answer.cache_info().misses == 2 and answer.cache_info().hits == 2
    hits = [e for e in rt.events.events() if e.outcome == "hit"]
    assert [e.ns for e in hits] == ["acme", "globex"]


def test_sampling_calls_bypass_unless_allowed_or_seeded(rt):
    calls = []

    @cache_if("true", store=rt)
    def gen(prompt: str, temperature: float = 0.0, seed: int | None = None) -> str:
        calls.append((temperature, seed))
        return "z"

    gen("p", temperature=0.7), gen("p", temperature=0.7)
    gen("p", temperature=0.7, seed=1), gen("p", temperature=0.7, seed=1)
    gen("p"), gen("p")
    assert calls == [(0.7, None), (0.7, None), (0.7, 1), (0.0, None)]

    @cache_if("true", admission=Admission(allow_sampling=True), store=rt)
    def free(prompt: str, temperature: float = 0.0) -> str:
        calls.append("free")
        return "z"

    free("p", temperature=1.0), free("p", temperature=1.0)
    assert calls.count("free") == 1


def test_ttl_expires_and_sliding_renews(rt, clock):
    @cache_if("true", ttl="10s", store=rt)
    def fixed(x: int) -> int:
        return x

    @cache_if("true", ttl=10, admission=Admission(sliding=True), store=rt)
    def sliding(x: int) -> int:
        return x

    fixed(1), sliding(1)
    for _ in range(3):
        clock.now += 6
        fixed(1), sliding(1)
    assert fixed.cache_info().misses == 2  # expired at +10, recomputed at +12, hit at +18
    assert sliding.cache_info().misses == 1  # each hit moved the expiry


def test_async_function(rt):
    calls = []

    @cache_if("true", store=rt)
    async def gen(prompt: str) -> str:
        calls.append(prompt)
        await asyncio.sleep(0)
        return prompt[::-1]

    async def run():
        return [await gen("abc"), await gen("abc")]

    assert asyncio.run(run()) == ["cba", "cba"]
    assert calls == ["abc"]


def test_stream_replayed_chunk_by_chunk(rt):
    produced = []

    @cache_if("true", store=rt)
    def stream(prompt: str):
        for chunk in ["Hel", "lo", " wörld", b"\x00raw"]:
            produced.append(chunk)
            yield chunk

    first = list(stream("p"))
    second = list(stream("p"))
    assert first == second == ["Hel", "lo", " wörld", b"\x00raw"]
    assert [type(c) for c in second] == [str, str, str, bytes]
    assert len(produced) == 4


def test_stream_that_fails_midway_is_never_stored(rt):
    attempts = []

    @cache_if("true", store=rt)
    def stream(prompt: str):
        attempts.append(1)
        yield "part"
        if len(attempts) == 1:
            raise RuntimeError("model crashed")
        yield "rest"

    with pytest.raises(RuntimeError):
        list(stream("p"))
    assert list(stream("p")) == ["part", "rest"]
    assert list(stream("p")) == ["part", "rest"]
    assert len(attempts) == 2
    assert stream.cache_info().stores == 1


def test_stream_closed_early_is_never_stored(rt):
    @cache_if("true", store=rt)
    def stream(prompt: str):
        yield from ["a", "b", "c"]

    g = stream("p")
    assert next(g) == "a"
    g.close()
    assert stream.cache_info().stores == 0
    assert list(stream("p")) == ["a", "b", "c"]
    assert list(stream("p")) == ["a", "b", "c"]
    assert stream.cache_info().hits == 1


def test_async_generator_stream(rt):
    @cache_if("true", store=rt)
    async def stream(prompt: str):
        for chunk in ("x", "y"):
            yield chunk

    async def collect():
        return [[c async for c in stream("p")] for _ in range(2)]

    assert asyncio.run(collect()) == [["x", "y"], ["x", "y"]]
    assert stream.cache_info().hits == 1


def test_bypass_refresh_invalidate(rt):
    n = []

    @cache_if("true", store=rt)
    def f(x: int) -> int:
        n.append(x)
        return len(n)

    assert f(1) == 1 and f(1) == 1
    assert f.bypass(1) == 2 and f(1) == 1
    assert f.refresh(1) == 3 and f(1) == 3
    assert f.invalidate(1) is True and f.invalidate(1) is False
    assert f(1) == 4
    info = f.cache_info()
    assert (info.hits, info.misses, info.bypasses) == (3, 2, 1)


def test_unserializable_and_oversize_results_are_rejected_not_failed(rt):
    @cache_if("true", store=rt)
    def obj(x: int) -> object:
        return {1: "int keys do not survive JSON"}

    @cache_if("true", admission=Admission(max_entry_bytes=10), store=rt)
    def big(x: int) -> str:
        return "y" * 100

    assert obj(1) == obj(1) == {1: "int keys do not survive JSON"}
    assert big(1) == big(1) == "y" * 100
    rejects = [e.rejected for e in rt.events.events()]
    assert rejects == ["unserializable", "unserializable", "too-large", "too-large"]


def test_unhashable_and_uncanonical_arguments(rt):
    @cache_if("true", store=rt)
    def f(x) -> str:
        return "r"

    f({"a": [1, 2]}), f({"a": [1, 2]})
    assert f.cache_info().hits == 1
    f(object())
    assert [e.reason for e in rt.events.events()][-1] == "uncacheable-args"


def test_undecodable_payload_is_dropped_and_recomputed(rt, clock):
    @cache_if("true", store=rt)
    def f(x: int) -> str:
        return "fresh"

    key = f.cache_key(1)
    rt.store.set(ANONYMOUS_NS, key, Entry(value=b"?garbage", expires_at=clock() + 60, created_at=clock()))
    assert f(1) == "fresh"
    assert f(1) == "fresh"
    assert f.cache_info().misses == 1 and f.cache_info().hits == 1
    assert rt.metrics.value("evocache_tier_faults_total", tier="l1", kind="undecodable") == 1


class BrokenTier(MemoryTier):
    def get_many(self, ns, keys):
        raise TierUnavailable("l1", "down")

    def set_many(self, ns, items):
        raise TierUnavailable("l1", "down")


def test_a_failing_tier_never_fails_the_call(clock):
    runtime = build_runtime(StoreConfig(), clock=clock)
    broken = TieredStore([BrokenTier(1 << 20, clock=clock)], clock=clock, on_error=runtime.metrics.tier_error)
    from dataclasses import replace

    runtime = replace(runtime, store=broken)

    @cache_if("true", store=runtime)
    def f(x: int) -> int:
        return x * 2

    assert [f(i % 3) for i in range(9)] == [0, 2, 4] * 3
    assert f.cache_info().misses == 9
    assert runtime.metrics.value("evocache_tier_errors_total", tier="l1", op="get") == 9
    assert runtime.metrics.value("evocache_tier_errors_total", tier="l1", op="set") == 9


POLICY = """
policy: p
version: 3
defaults: {ttl: 1m, tiers: [l1]}
rules:
  - name: sampled
    when: temperature > 0
    cache: bypass
  - name: long
    when: len(prompt) > 10
    ttl: 10s
  - name: sampling-ok
    when: prompt == "roll"
    allow_sampling: true
"""


def test_policy_rules_decide_and_label_events(rt, clock):
    policy = parse_policy(POLICY)
    runtime = rt.activate(policy)

    @cache_if("true", store=runtime)
    def gen(prompt: str, temperature: float = 0.0) -> str:
        return prompt

    gen("a long prompt here"), gen("a long prompt here")
    gen("short"), gen("short", temperature=0.5)
    clock.now += 11
    gen("a long prompt here"), gen("short")
    events = [(e.rule, e.outcome) for e in runtime.events.events()]
    assert events == [
        ("long", "miss"), ("long", "hit"),
        ("default", "miss"), ("sampled", "bypass"),
        ("long", "miss"), ("default", "hit"),
    ]
    assert {e.policy for e in runtime.events.events()} == {"p@3"}


def test_configure_swaps_the_process_runtime(tmp_path, clock):
    new = configure(StoreConfig(disk=DiskConfig(path=str(tmp_path / "l3"))))
    try:
        @cache_if("true")
        def f(x: int) -> int:
            return x

        f(1), f(1)
        assert list(new.store.tiers) == ["l1", "l3"]
        assert new.store.tiers["l3"].usage() > 0
    finally:
        configure(StoreConfig())


def test_metrics_per_rule_tier_and_outcome(rt):
    @cache_if("true", name="metered", store=rt)
    def f(x: int) -> int:
        return x

    f(1), f(1), f(1)
    assert rt.metrics.value("evocache_requests_total", rule="metered", tier="l1", outcome="hit") == 2
    assert rt.metrics.value("evocache_requests_total", rule="metered", tier="", outcome="miss") == 1
    assert b"evocache_lookup_seconds_bucket" in rt.metrics.exposition()


def test_a_store_configuration_gives_the_function_its_own_tiers(tmp_path):
    @cache_if("true", store=StoreConfig(disk=DiskConfig(path=str(tmp_path / "own-l3"))))
    def f(x: int) -> int:
        return x

    f(1), f(1)
    runtime = f.cached_function.runtime
    assert list(runtime.store.tiers) == ["l1", "l3"] and runtime.store.tiers["l3"].usage() > 0
    assert f.cache_info().hits == 1
    runtime.close()


@pytest.mark.parametrize(
    ("seconds", "first_bucket"),
    [(0.0, "1e-05"), (0.00001, "1e-05"), (0.00002, "5e-05"), (0.3, "0.5"), (10.0, "+Inf")],
)
def test_lookup_latency_lands_in_the_prometheus_bucket_it_belongs_to(rt, seconds, first_bucket):
    """The request path updates the histogram cells itself (CacheMetrics.record, inlined): each observation
    must count in the first bucket whose bound is >= it (Prometheus `le`), and in every bucket above."""

    @cache_if("true", name="timed", store=rt)
    def f(x: int) -> int:
        return x

    cf = f.cached_function
    cf._observe(rt, cf.contract.plan(rt, (1,), {}), "miss", None, seconds)
    bounds = ["1e-05", "5e-05", "0.0001", "0.0005", "0.001", "0.005", "0.01", "0.05", "0.1", "0.5", "1.0", "5.0",
              "+Inf"]
    counts = [
        rt.metrics.value("evocache_lookup_seconds_bucket", rule="timed", tier="", outcome="miss", le=b)
        for b in bounds
    ]
    first = bounds.index(first_bucket)
    assert counts == [0.0] * first + [1.0] * (len(bounds) - first)
    assert rt.metrics.value("evocache_lookup_seconds_sum", rule="timed", tier="", outcome="miss") == seconds
