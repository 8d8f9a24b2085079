"""Calls a hostile or careless caller makes: served (uncached where they must be), counted, never failed."""

from __future__ import annotations

import asyncio
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest

from evocache.controller import cache_if, configure, current_runtime, set_policy, tenant_scope


def events(rt):
    return [(e.outcome, e.reason) for e in rt.events.events()]


class Opaque:
    """An argument with no canonical form."""


@pytest.mark.parametrize("param", ["temperature", "top_p", "max_tokens"])
@pytest.mark.parametrize("value", [Decimal("0"), Opaque()], ids=["decimal", "object"])
def test_a_generation_param_without_a_canonical_form_is_served_uncached(rt, param, value):
    calls = []

    @cache_if("true", store=rt)
    def gen(prompt: str, temperature=0.0, top_p=1.0, max_tokens=16) -> str:
        calls.append(prompt)
        return "answer"

    assert gen("p", **{param: value}) == "answer"
    assert gen("p", **{param: value}) == "answer"
    assert calls == ["p", "p"]
    expected = "sampling" if param == "temperature" and isinstance(value, Opaque) else "uncacheable-args"
    assert events(rt) == [("bypass", expected), ("bypass", expected)]
    assert gen.cache_info().bypasses == 2
    assert gen.cache_key("p", **{param: value}) is None


def test_cache_key_and_invalidate_of_an_uncacheable_call_do_not_raise(rt):
    @cache_if("true", store=rt)
    def gen(prompt: str, max_tokens=16) -> str:
        return prompt

    assert gen.cache_key("p", max_tokens=Decimal(3)) is None
    assert gen.invalidate("p", max_tokens=Decimal(3)) is False


LONE = "\ud800"


def test_a_result_with_a_lone_surrogate_is_served_uncached(rt):
    calls = []

    @cache_if("true", store=rt)
    def f(x: int):
        calls.append(x)
        return LONE if x == 0 else {"text": "a" + LONE}

    assert f(0) == LONE and f(0) == LONE
    assert f(1) == {"text": "a" + LONE}
    assert calls == [0, 0, 1]
    assert events(rt) == [("miss", ""), ("reject", "unserializable")] * 3
    assert f.cache_info().rejects == 3


def test_an_async_result_with_a_lone_surrogate_is_served_uncached(rt):
    @cache_if("true", store=rt)
    async def f(x: int) -> str:
        return LONE

    assert asyncio.run(f(0)) == LONE
    assert events(rt) == [("miss", ""), ("reject", "unserializable")]


def test_a_stream_chunk_with_a_lone_surrogate_is_still_yielded_and_not_stored(rt):
    runs = []

    @cache_if("true", store=rt)
    def stream(x: int):
        runs.append(x)
        yield "a"
        yield LONE

    assert list(stream(1)) == ["a", LONE]
    assert list(stream(1)) == ["a", LONE]
    assert runs == [1, 1]
    assert events(rt) == [("miss", ""), ("reject", "unserializable")] * 2


def test_an_async_stream_chunk_with_a_lone_surrogate_is_still_yielded(rt):
    @cache_if("true", store=rt)
    async def stream(x: int):
        yield LONE

    async def collect():
        return [chunk async for chunk in stream(1)]

    assert asyncio.run(collect()) == [LONE]
    assert events(rt) == [("miss", ""), ("reject", "unserializable")]


def test_an_argument_with_a_lone_surrogate_is_cached_under_its_own_key(rt):
    @cache_if("true", store=rt)
    def f(prompt: str, model: str = "m") -> str:
        return "ok"

    assert f(LONE, model=LONE) == "ok" and f(LONE, model=LONE) == "ok"
    assert f.cache_info().hits == 1
    assert f.cache_key("\udc00") != f.cache_key(LONE)


SAMPLED = [
    np.float32(0.7), np.float16(0.7), np.float64(0.7), np.array(0.7), np.array(0.7, dtype=np.float32), "0.7",
    Decimal("0.7"), Fraction(7, 10), 1, True, np.int64(1), float("nan"), float("inf"), "hot", Opaque(),
    np.array([0.0, 0.7]),
]


@pytest.mark.parametrize("temperature", SAMPLED, ids=repr)
def test_a_temperature_that_is_not_provably_greedy_is_not_cached(rt, temperature):
    calls = []

    @cache_if("true", store=rt)
    def gen(prompt: str, temperature=0.0, seed=None) -> str:
        calls.append(prompt)
        return "sampled"

    gen("p", temperature=temperature), gen("p", temperature=temperature)
    assert calls == ["p", "p"]
    assert events(rt) == [("bypass", "sampling"), ("bypass", "sampling")]


GREEDY = [0, 0.0, -0.0, np.float32(0.0), np.float16(0), np.array(0.0), np.int64(0), "0", "0.0", None, False, -1]


@pytest.mark.parametrize("temperature", GREEDY, ids=repr)
def test_a_greedy_temperature_is_cached(rt, temperature):
    calls = []

    @cache_if("true", store=rt)
    def gen(prompt: str, temperature=0.0, seed=None) -> str:
        calls.append(prompt)
        return "greedy"

    gen("p", temperature=temperature), gen("p", temperature=temperature)
    assert calls == ["p"]
    assert [outcome for outcome, _ in events(rt)] == ["miss", "store", "hit"]


def test_a_seeded_numpy_temperature_is_cached(rt):
    calls = []

    @cache_if("true", store=rt)
    def gen(prompt: str, temperature=0.0, seed=None) -> str:
        calls.append(prompt)
        return "seeded"

    gen("p", temperature=np.float32(0.7), seed=3), gen("p", temperature=np.float32(0.7), seed=3)
    assert calls == ["p"]


@pytest.mark.parametrize("bad", ["default: {}", 42, {"rules": []}])
def test_set_policy_names_what_it_takes(bad):
    with pytest.raises(TypeError, match=r"set_policy\(\) takes a Policy .*or None, got "):
        set_policy(bad)


@pytest.mark.parametrize("bad", ["default: {}", 42, {"rules": []}])
def test_configure_names_what_its_policy_takes(bad):
    before = current_runtime()
    with pytest.raises(TypeError, match=r"configure\(\) takes a Policy .*or None, got "):
        configure(policy=bad)
    assert current_runtime() is before


def test_the_anonymous_caller_and_tenant_default_never_share_an_entry(rt):
    @cache_if("true", store=rt)
    def whoami(prompt: str, tenant: str | None = None) -> str:
        return f"{tenant}:{prompt}"

    assert whoami("q") == "None:q"
    assert whoami("q", tenant="default") == "default:q"
    with tenant_scope("default"):
        assert whoami("q") == "default:q"  # the scope names tenant "default": its entry, not the anonymous one
    assert whoami("q") == "None:q"
    seen = [(e.outcome, e.ns) for e in rt.events.events()]
    anonymous = seen[0][1]
    assert anonymous != "default"
    assert seen == [
        ("miss", anonymous), ("store", anonymous), ("miss", "default"), ("store", "default"),
        ("hit", "default"), ("hit", anonymous),
    ]
    assert whoami.cache_key("q") != whoami.cache_key("q", tenant="default")

