"""Calls a hostile or careless caller makes: served (uncached where they must be), counted, never failed."""

from __future__ import annotations

import asyncio
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest

from evocache.controller import cache_if, configure, current_runtime, set_policy, tenant_scope


def events(rt):
    """(outcome, why) of each call's event: a bypass's reason, or why a miss's result was not stored."""
    return [(e.outcome, e.reason or e.rejected) for e in rt.events.events()]


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
    assert events(rt) == [("miss", "unserializable")] * 3
    assert f.cache_info().rejects == 3


def test_an_async_result_with_a_lone_surrogate_is_served_uncached(rt):
    @cache_if("true", store=rt)
    async def f(x: int) -> str:
        return LONE

    assert asyncio.run(f(0)) == LONE
    assert events(rt) == [("miss", "unserializable")]


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
    assert events(rt) == [("miss", "unserializable")] * 2


def test_an_async_stream_chunk_with_a_lone_surrogate_is_still_yielded(rt):
    @cache_if("true", store=rt)
    async def stream(x: int):
        yield LONE

    async def collect():
        return [chunk async for chunk in stream(1)]

    assert asyncio.run(collect()) == [LONE]
    assert events(rt) == [("miss", "unserializable")]


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
    assert [outcome for outcome, _ in events(rt)] == ["miss", "hit"]


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
        ("miss", anonymous), ("miss", "default"), ("hit", "default"), ("hit", anonymous),
    ]
    assert whoami.cache_key("q") != whoami.cache_key("q", tenant="default")



# -- arguments whose inspection itself fails, or costs more than the argument is large --------------------


class _RaisingGetattr:
    def __getattr__(self, name):
        raise RuntimeError(f"no {name}")


class _RaisingClass:
    @property
    def __class__(self):  # isinstance() reads it
        raise RuntimeError("no class")


class _HostileStr(str):
    def __hash__(self):
        raise RuntimeError("no hash")


def _shared(depth: int) -> list:
    """A list of 2**depth leaves in depth + 1 objects: each level holds the one below twice."""
    node: list = []
    for _ in range(depth):
        node = [node, node]
    return node


@pytest.mark.parametrize(
    "make",
    [
        _RaisingGetattr,
        _RaisingClass,
        lambda: [_RaisingGetattr()],
        lambda: {"k": _RaisingClass()},
        lambda: _shared(40),  # 2**40 nodes to canonicalise: never finishes unbounded
    ],
    ids=["getattr", "class", "nested-getattr", "nested-class", "shared-sublists"],
)
def test_an_argument_that_defeats_canonicalisation_is_served_uncached(rt, make):
    calls = []

    @cache_if("true", store=rt)
    def f(x) -> str:
        calls.append(1)
        return "answer"

    assert f(make()) == "answer"
    assert calls == [1]
    assert events(rt) == [("bypass", "uncacheable-args")]
    assert f.cache_info().bypasses == 1


@pytest.mark.parametrize("make", [_RaisingGetattr, _RaisingClass, lambda: _HostileStr("0")],
                         ids=["getattr", "class", "hash"])
@pytest.mark.parametrize("param", ["temperature", "top_p", "seed"])
def test_a_generation_param_whose_inspection_raises_is_served_uncached(rt, param, make):
    @cache_if("true", store=rt)
    def gen(prompt: str, temperature=0.0, top_p=1.0, seed=None) -> str:
        return "answer"

    assert gen("p", **{param: make()}) == "answer"
    assert [outcome for outcome, _ in events(rt)] == ["bypass"]


def test_huge_integers_are_keys_like_any_integer(rt):
    # Past 4300 digits int -> str raises ValueError; the key must not depend on that conversion.
    calls = []

    @cache_if("true", store=rt)
    def f(x: int, seed: int = 0) -> str:
        calls.append(1)
        return "answer"

    big = 10**5000
    assert f(big) == "answer" and f(big) == "answer"
    assert f(big + 1) == "answer"
    assert f(1, seed=big) == "answer" and f(1, seed=big) == "answer"
    assert calls == [1, 1, 1]
    assert f.cache_key(big) != f.cache_key(big + 1) != f.cache_key(-big)
    assert f.cache_key(("x", big)) != f.cache_key(("x", hex(big)))


class _Impostor(str):
    """A tenant id that reads as one tenant and formats, encodes and compares as another."""

    def __str__(self):
        return "victim"

    def __format__(self, spec):
        return "victim"

    def encode(self, *args, **kwargs):
        return b"victim"

    def __eq__(self, other):
        return True

    def __hash__(self):
        return hash("victim")


def test_a_str_subclass_tenant_id_is_its_own_text_never_another_tenant(rt):
    calls = []

    @cache_if("true", store=rt)
    def f(prompt: str, tenant: str | None = None) -> str:
        calls.append(prompt)
        return f"answer for {prompt}"

    with tenant_scope("victim"):
        f("secret question")
    with tenant_scope(_Impostor("attacker")):
        f("secret question")
    f("secret question", tenant=_Impostor("attacker"))
    assert calls == ["secret question", "secret question"]  # the second, for "attacker", hit its own entry
    lookups = [e for e in rt.events.events() if e.outcome in ("hit", "miss")]
    assert [(e.outcome, e.ns) for e in lookups] == [("miss", "victim"), ("miss", "attacker"), ("hit", "attacker")]
    assert all(type(e.ns) is str for e in lookups)


@pytest.mark.parametrize("make", [_RaisingClass, lambda: {"id": _RaisingGetattr()}, lambda: 12],
                         ids=["class", "mapping", "int"])
def test_a_tenant_argument_the_cache_cannot_read_is_served_uncached(rt, make):
    @cache_if("true", store=rt)
    def f(prompt: str, tenant=None) -> str:
        return "answer"

    assert f("p", tenant=make()) == "answer"
    assert events(rt) == [("bypass", "bad-tenant")]
