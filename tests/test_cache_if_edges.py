"""Edges of @cache_if: tenants, memoised plans, the lock-free hit path, invalidation races, odd signatures."""

from __future__ import annotations

import dataclasses
import sys
import threading

import pytest

from evocache.controller import (
    CacheMetrics,
    CacheRuntime,
    ContractError,
    Entry,
    RingSink,
    L1Config,
    StoreConfig,
    Tier,
    TieredStore,
    build_runtime,
    cache_if,
    tenant_scope,
)
from evocache.controller._keys import ANONYMOUS_NS


def test_a_scope_for_default_is_not_the_absence_of_a_scope(rt):
    @cache_if("true", store=rt)
    def g(prompt: str, tenant: str = "acme") -> str:
        return prompt

    g("q")  # no scope: the parameter's default names the tenant
    with tenant_scope("default"):
        g("q")  # a scope wins over a parameter default: another namespace, another plan
    assert [e.ns for e in rt.events.events() if e.outcome == "miss"] == ["acme", "default"]


@pytest.mark.parametrize("tenant", ["", 42, {"name": "acme"}, ("acme", "gold")])
def test_a_tenant_argument_the_cache_cannot_scope_is_served_uncached(rt, tenant):
    @cache_if("true", store=rt)
    def f(prompt: str, tenant=None) -> str:
        return f"{prompt}:{tenant}"

    assert f("q", tenant=tenant) == f"q:{tenant}"
    assert f.cache_key("q", tenant=tenant) is None
    assert [e.reason for e in rt.events.events()] == ["bad-tenant"]


def test_results_the_serializer_cannot_take_are_rejected_not_failed(rt):
    @cache_if("true", store=rt)
    def nested(x: int) -> list:
        deep: list = []
        for _ in range(sys.getrecursionlimit() + 10):
            deep = [deep]
        return deep

    class Refuses:
        def __reduce__(self):
            raise RuntimeError("no")

    @cache_if("true", serializer="pickle", store=rt)
    def odd(x: int) -> object:
        return Refuses()

    assert isinstance(nested(1), list)
    assert isinstance(odd(1), Refuses)
    assert [e.rejected for e in rt.events.events()] == ["unserializable"] * 2


def test_arguments_whose_export_fails_are_uncacheable_not_failed(rt):
    @dataclasses.dataclass
    class WithLock:
        lock: object

    class Tensorish:
        def tolist(self):
            raise RuntimeError("device lost")

    @cache_if("true", store=rt)
    def f(x) -> str:
        return "ok"

    assert f(WithLock(threading.Lock())) == "ok" and f(Tensorish()) == "ok"
    assert [e.reason for e in rt.events.events()] == ["uncacheable-args"] * 2


def test_nested_dataclasses_keep_their_type_in_the_key(rt):
    @dataclasses.dataclass
    class A:
        x: int

    @dataclasses.dataclass
    class Outer:
        inner: object

    @cache_if("true", store=rt)
    def f(o) -> str:
        return repr(o)

    assert f.cache_key(Outer(A(1))) != f.cache_key(Outer({"x": 1}))


def test_closures_from_one_factory_do_not_share_entries(rt):
    def make(n: int):
        @cache_if("true", store=rt)
        def add(x: int) -> int:
            return x + n

        return add

    add1, add2 = make(1), make(2)
    assert (add1(5), add2(5)) == (6, 7)


def test_a_closure_over_data_without_a_canonical_form_needs_a_name(rt):
    handle = threading.Lock()

    with pytest.raises(ContractError, match="name="):

        @cache_if("true", store=rt)
        def f(x: int) -> int:
            with handle:
                return x

    @cache_if("true", name="f-with-lock", store=rt)
    def g(x: int) -> int:
        with handle:
            return x

    assert g(1) == 1


def test_argument_types_are_part_of_the_memo(rt):
    @cache_if("true", store=rt)
    def f(x) -> str:
        return repr(x)

    for _ in range(2):  # the second round is served from L1 through the memoised plans
        assert [f(1), f(True), f(1.0)] == ["1", "True", "1.0"]


def test_l1_hits_take_the_lock_free_path(rt, monkeypatch):
    @cache_if("true", store=rt)
    def f(x: int) -> str:
        return "v"

    f(1)
    lookups = []
    original = rt.store.get
    monkeypatch.setattr(rt.store, "get", lambda *a, **k: lookups.append(a) or original(*a, **k))
    for _ in range(10):
        assert f(1) == "v"
    assert lookups == [] and f.cache_info().hits == 10
    assert rt.l1.stats.hits == 10  # the read buffer replayed every hit to the tier's books


def test_hits_on_the_lock_free_path_reach_the_eviction_policy(clock):
    runtime = build_runtime(StoreConfig(l1=L1Config(bytes=200)), clock=clock)  # 3 entries of 66 bytes

    @cache_if("true", store=runtime)
    def f(x: str) -> str:
        return x

    f("a"), f("b"), f("c")
    for _ in range(5):
        f("a")  # hot path hits: LRU must learn that "a" is recent
    f("d")  # evicts the least recently used: "b", not "a"
    held = {key for key in runtime.l1.keys(ANONYMOUS_NS)}
    assert f.cache_key("a") in held and f.cache_key("b") not in held


def test_hot_path_never_serves_a_stale_value(rt, clock):
    n = [0]

    @cache_if("true", ttl="10s", store=rt)
    def f(x: int) -> str:
        n[0] += 1
        return f"v{n[0]}"

    seen = [f(1), f(1), f(1)]
    seen += [f.refresh(1), f(1), f(1)]
    f.invalidate(1)
    seen += [f(1), f(1)]
    clock.now += 10
    seen += [f(1), f(1)]
    rt.store.set(ANONYMOUS_NS, f.cache_key(1), Entry(b"sX", clock() + 5, clock()))
    seen += [f(1)]
    assert seen == ["v1", "v1", "v1", "v2", "v2", "v2", "v3", "v3", "v4", "v4", "X"]


def test_an_invalidate_during_a_miss_is_not_undone(rt):
    db = {"k": "v1"}
    started, release = threading.Event(), threading.Event()

    @cache_if("true", name="read", store=rt)  # it captures events, which have no canonical form
    def read(k: str) -> str:
        value = db[k]
        if value == "v1":
            started.set()
            release.wait(10)
        return value

    slow = threading.Thread(target=read, args=("k",))
    slow.start()
    started.wait(10)
    db["k"] = "v2"
    read.invalidate("k")  # the writer changed the source, then invalidated
    release.set()
    slow.join(10)
    assert read("k") == "v2"
    assert [e.rejected for e in rt.events.events() if e.rejected] == ["invalidated"]


def test_a_stream_is_scoped_when_called_not_when_consumed(rt):
    @cache_if("true", store=rt)
    def stream(prompt: str):
        yield prompt

    with tenant_scope("acme"):
        chunks = stream("q")  # handed to a framework that iterates it later
    assert list(chunks) == ["q"]
    assert {e.ns for e in rt.events.events()} == {"acme"}


class DictTier(Tier):
    """An "l1" that is not a MemoryTier: the request path must not assume one."""

    name = "l1"

    def __init__(self) -> None:
        super().__init__()
        self.data: dict = {}

    def get_many(self, ns, keys):
        return [self.data.get((ns, k)) for k in keys]

    def set_many(self, ns, items):
        for k, e in items:
            self.data[(ns, k)] = e

    def delete(self, ns, keys):
        return sum(self.data.pop((ns, k), None) is not None for k in keys)

    def usage(self, ns=None):
        return 0


def test_a_custom_l1_tier_takes_the_full_path():
    runtime = CacheRuntime(store=TieredStore([DictTier()]), events=RingSink(), metrics=CacheMetrics())

    @cache_if("true", store=runtime)
    def f(x: int) -> str:
        return str(x)

    assert f(1) == f(1) == "1"
    assert f.cache_info().hits == 1


def test_two_lambdas_of_one_module_do_not_share_entries(rt):
    inc = cache_if("true", store=rt)(lambda x: x + 1)
    dbl = cache_if("true", store=rt)(lambda x: x * 2)
    assert (inc(5), dbl(5)) == (6, 10)


def test_closures_over_different_functions_do_not_share_entries(rt):
    def make(transform):
        @cache_if("true", store=rt)
        def apply(text: str) -> str:
            return transform(text)

        return apply

    upper, lower = make(str.upper), make(str.lower)
    assert (upper("MiXeD"), lower("MiXeD")) == ("MIXED", "mixed")

    def shout(text: str) -> str:
        return text.upper() + "!"

    def whisper(text: str) -> str:
        return text.lower() + "..."

    assert (make(shout)("Hi"), make(whisper)("Hi")) == ("HI!", "hi...")


def test_a_closure_over_a_bound_method_needs_a_name(rt):
    class Model:
        def generate(self, prompt: str) -> str:
            return prompt

    generate = Model().generate
    with pytest.raises(ContractError, match="bound method"):

        @cache_if("true", store=rt)
        def f(prompt: str) -> str:
            return generate(prompt)


class ArrayLike:
    """Compares element-wise, like a numpy array: `x == 1.0` has no single truth value."""

    def __eq__(self, other):
        raise ValueError("The truth value of an array with more than one element is ambiguous.")

    __hash__ = None

    def tolist(self):
        return [0.9, 0.8]


def test_an_array_generation_parameter_never_fails_the_call(rt):
    @cache_if("true", store=rt)
    def f(prompt: str, top_p=1.0) -> str:
        return prompt

    assert f("q", top_p=ArrayLike()) == "q"
    assert f("q", top_p=ArrayLike()) == "q"
    assert f.cache_info().hits == 1  # canonicalised through tolist(), so cacheable


def test_l1_hits_served_lock_free_still_count_as_recency_for_eviction(clock):
    """The hit path reads L1 without its lock and only buffers the read (MemoryTier.hot_read); the buffered
    reads must still reach the LRU policy, so that a key hit many times outlives one never hit since."""
    from evocache.controller import L1

    runtime = build_runtime(StoreConfig(l1=L1Config(bytes=2_000)), clock=clock)

    @cache_if("true", store=runtime)
    def model(prompt: str) -> str:
        return prompt * 40  # ~400 bytes an entry: four fit in L1

    for prompt in ("aaaaaaaaa1", "bbbbbbbbb2", "ccccccccc3", "ddddddddd4"):
        model(prompt)
    for _ in range(200):  # "a" is now the most recently used, through the lock-free path only
        model("aaaaaaaaa1")
    model("eeeeeeeee5")  # needs room: LRU evicts "b", the oldest never hit
    assert model.cache_info().misses == 5
    l1 = runtime.store.tiers[L1]
    assert len(l1) == 4
    before = model.cache_info().misses
    model("aaaaaaaaa1")
    assert model.cache_info().misses == before  # still cached
    model("bbbbbbbbb2")
    assert model.cache_info().misses == before + 1  # was evicted
    runtime.close()
