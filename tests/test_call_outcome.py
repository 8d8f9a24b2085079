"""A caller gets what the cache did for its call (``CallOutcome``) from the call itself, for every kind of
function: the resolved decision, outcome, tier, key, sizes, the stored tiers or why not, and the engine's KV
report, which also becomes the call's ``kv`` event."""

from __future__ import annotations

import asyncio

import pytest

from evocache.controller import (
    CallHandle,
    CallOutcome,
    DiskConfig,
    KvReport,
    StoreConfig,
    build_runtime,
    cache_if,
    tenant_scope,
)
from evocache.dsl import Decision, parse_policy

POLICY = """
policy: p
version: 3
defaults: {ttl: 10m, tiers: [l1, l3]}
rules:
  - name: small
    when: len(prompt) < 40
    kv: {reuse: prefix, min_tokens: 4}
  - name: big
    when: true
    cache: bypass
"""


@pytest.fixture
def rt(tmp_path):
    runtime = build_runtime(StoreConfig(disk=DiskConfig(path=str(tmp_path / "l3"))), policy=parse_policy(POLICY))
    yield runtime
    runtime.close()


def test_a_sync_call_hands_back_its_miss_then_its_hit(rt):
    @cache_if("true", store=rt)
    def answer(prompt: str) -> str:
        return prompt.upper()

    value, miss = answer.call("hello")
    assert value == "HELLO"
    assert isinstance(miss, CallOutcome)
    assert (miss.outcome, miss.rule, miss.policy, miss.tier, miss.reason) == ("miss", "small", "p@3", None, "")
    assert miss.stored == ("l1", "l3") and miss.rejected == ""
    assert miss.size > 0 and miss.key is not None
    assert isinstance(miss.decision, Decision) and miss.decision.rule == "small"
    assert miss.decision.kv is not None and miss.decision.kv.min_tokens == 4

    value, hit = answer.call("hello")
    assert value == "HELLO"
    assert (hit.outcome, hit.tier, hit.key, hit.size) == ("hit", "l1", miss.key, miss.size)
    assert hit.stored == () and hit.call_id != miss.call_id
    # A plain call of the same function is the same cache: it hits what .call stored.
    assert answer("hello") == "HELLO"
    assert answer.cache_info().hits == 2


def test_a_bypass_names_its_reason_and_still_carries_the_decision(rt):
    @cache_if("true", store=rt)
    def answer(prompt: str) -> str:
        return "x"

    long = "a prompt far too long for the small rule to take it"
    value, outcome = answer.call(long)
    assert value == "x"
    assert (outcome.outcome, outcome.rule, outcome.stored) == ("bypass", "big", ())
    assert outcome.reason == "rule"
    assert outcome.decision is not None and outcome.decision.cache is False
    # The key it would have if its rule cached it, and what its result would weigh: so the policy loop can
    # judge caching such calls. Nothing was looked up or stored under it.
    again = answer.call(long).outcome
    assert outcome.key is not None and again.key == outcome.key and again.outcome == "bypass"
    assert outcome.size == again.size > 0
    events = rt.events.events()
    assert [(e.outcome, e.key, e.size) for e in events] == [("bypass", outcome.key, outcome.size)] * 2


def test_a_contract_bypass_has_no_decision_to_carry(rt):
    @cache_if("len(prompt) < 3", store=rt)
    def answer(prompt: str) -> str:
        return "x"

    _, outcome = answer.call("longer")
    assert (outcome.outcome, outcome.reason, outcome.key, outcome.size) == ("bypass", "contract", None, 0)


def test_a_result_too_large_to_store_says_why(tmp_path):
    policy = parse_policy(POLICY.replace("defaults: {ttl: 10m, tiers: [l1, l3]}",
                                         "defaults: {ttl: 10m, tiers: [l1], max_entry_bytes: 16}"))
    runtime = build_runtime(StoreConfig(), policy=policy)
    try:
        @cache_if("true", store=runtime)
        def answer(prompt: str) -> str:
            return "y" * 100

        _, outcome = answer.call("hi")
        assert (outcome.outcome, outcome.stored, outcome.rejected) == ("miss", (), "too-large")
        assert outcome.size > 16
        assert answer.call("hi").outcome.outcome == "miss"
    finally:
        runtime.close()


def test_an_async_call_hands_back_its_outcome(rt):
    @cache_if("true", store=rt)
    async def answer(prompt: str) -> str:
        await asyncio.sleep(0)
        return prompt[::-1]

    async def twice():
        return await answer.call("abc"), await answer.call("abc")

    (v1, first), (v2, second) = asyncio.run(twice())
    assert v1 == v2 == "cba"
    assert (first.outcome, second.outcome, second.tier) == ("miss", "hit", "l1")


def test_a_stream_is_decided_at_its_first_piece_and_has_its_outcome_after_its_last(rt):
    @cache_if("true", store=rt)
    def answer(prompt: str):
        yield from ("a", "b", "c")

    stream = answer.call("p")
    assert stream.handle.decided is None and stream.handle.outcome is None
    assert next(stream) == "a"
    assert stream.handle.decided is not None and stream.handle.decided.outcome == "miss"
    assert stream.handle.outcome is None  # not yet stored: the stream is not over
    assert list(stream) == ["b", "c"]
    assert stream.handle.outcome.stored == ("l1", "l3")

    again = answer.call("p")
    assert list(again) == ["a", "b", "c"]
    assert (again.handle.outcome.outcome, again.handle.outcome.tier) == ("hit", "l1")


def test_a_stream_closed_early_is_incomplete_and_stores_nothing(rt):
    @cache_if("true", store=rt)
    def answer(prompt: str):
        yield from ("a", "b", "c")

    stream = answer.call("p")
    assert next(stream) == "a"
    stream.close()
    assert stream.handle.decided.outcome == "miss"
    assert (stream.handle.outcome.rejected, stream.handle.outcome.stored) == ("incomplete", ())
    again = answer.call("p")
    assert list(again) == ["a", "b", "c"]
    assert again.handle.outcome.outcome == "miss"  # the closed stream left nothing to hit
    events = rt.events.events()
    assert [(e.outcome, e.rejected, e.stored) for e in events] == [("miss", "incomplete", ""),
                                                                   ("miss", "", "l1,l3")]
    assert [e.call for e in events] == [stream.handle.call_id, again.handle.call_id]


def test_a_function_that_raises_is_one_incomplete_event(rt):
    @cache_if("true", store=rt)
    def answer(prompt: str) -> str:
        raise RuntimeError("model down")

    with pytest.raises(RuntimeError):
        answer("p")
    with pytest.raises(RuntimeError):
        answer.call("p")
    events = rt.events.events()
    assert [(e.outcome, e.rejected, e.size) for e in events] == [("miss", "incomplete", 0)] * 2
    assert events[0].call != events[1].call


def test_each_call_is_one_event_carrying_what_its_outcome_says(rt):
    @cache_if("true", store=rt)
    def answer(prompt: str) -> str:
        return prompt * 3

    first = answer.call("hi").outcome
    second = answer.call("hi").outcome
    assert answer("hi") == "hihihi"  # the L1 hit path records its event too
    answer("a prompt far too long for the small rule to take it")
    events = rt.events.events()
    assert [(e.outcome, e.tier, e.stored, e.rejected, e.v) for e in events] == [
        ("miss", None, "l1,l3", "", 2), ("hit", "l1", "", "", 2), ("hit", "l1", "", "", 2),
        ("bypass", None, "", "", 2)]
    assert [e.call for e in events[:2]] == [first.call_id, second.call_id]
    assert len({e.call for e in events}) == 4 and all(e.call for e in events)
    assert events[0].size == first.size > 0 and events[0].saved_ms == first.saved_ms
    assert events[0].t == first.at and events[1].size == first.size


def test_an_async_stream_hands_back_its_outcome(rt):
    @cache_if("true", store=rt)
    async def answer(prompt: str):
        for piece in ("x", "y"):
            yield piece

    async def play():
        stream = answer.call("q")
        pieces = [piece async for piece in stream]
        return pieces, stream.handle.outcome

    pieces, first = asyncio.run(play())
    assert pieces == ["x", "y"] and first.outcome == "miss" and first.stored == ("l1", "l3")
    pieces, second = asyncio.run(play())
    assert pieces == ["x", "y"] and (second.outcome, second.tier) == ("hit", "l1")


def test_the_function_reads_its_decision_and_reports_its_kv_usage(rt):
    seen: list[CallHandle] = []

    @cache_if("true", store=rt, call_param="call")
    def answer(prompt: str, call: CallHandle) -> str:
        seen.append(call)
        call.report_kv(KvReport(prompt_tokens=20, cached_tokens=16, tier="l1", load_ms=0.5, miss="",
                                detail={"tiers": {"l1": 16}}))
        return "ok"

    value, outcome = answer.call("hello")
    assert value == "ok"
    (handle,) = seen
    assert handle.decided is not None and handle.decided.decision.kv.min_tokens == 4  # known before the run
    assert outcome.call_id == handle.call_id
    assert outcome.kv == KvReport(20, 16, "l1", 0.5, "", {"tiers": {"l1": 16}})
    (event,) = rt.events.events()  # the call's one event carries the engine's report
    assert (event.outcome, event.call, event.kv) == ("miss", outcome.call_id, {"tiers": {"l1": 16}})
    # The handle is never part of the key: a second call hits.
    assert answer.call("hello").outcome.outcome == "hit"


def test_report_kv_takes_only_a_kv_report():
    with pytest.raises(TypeError, match="KvReport"):
        CallHandle().report_kv({"cached_tokens": 3})  # type: ignore[arg-type]


def test_call_ids_are_unique_and_outcomes_are_frozen(rt):
    @cache_if("true", store=rt)
    def answer(prompt: str) -> str:
        return prompt

    outcomes = [answer.call(str(i)).outcome for i in range(50)]
    assert len({o.call_id for o in outcomes}) == 50
    with pytest.raises(AttributeError):
        outcomes[0].outcome = "hit"  # type: ignore[misc]


def test_a_tenant_scope_shows_in_the_outcomes_namespace(rt):
    @cache_if("true", store=rt)
    def answer(prompt: str) -> str:
        return prompt

    with tenant_scope("acme"):
        a = answer.call("same").outcome
    with tenant_scope("globex"):
        b = answer.call("same").outcome
    assert a.ns != b.ns and (a.outcome, b.outcome) == ("miss", "miss")


def test_a_rollout_arm_is_named_in_the_outcome(rt):
    @cache_if("true", store=rt)
    def answer(prompt: str) -> str:
        return prompt

    assert answer.call("a").outcome.arm == ""
    canary = rt.with_rules(rt.policy, arm="canary")
    on_canary = cache_if("true", store=canary)(lambda prompt: prompt)
    assert on_canary.call("a").outcome.arm == "canary"
    assert on_canary("a") == "a"  # an L1 hit names its arm too
    assert [e.arm for e in canary.events.events()][-2:] == ["canary", "canary"]


def test_the_call_parameter_is_not_the_callers(rt):
    @cache_if("true", store=rt, call_param="call")
    def answer(prompt: str, *, call: CallHandle) -> str:
        return f"{prompt}:{call.decided.outcome}"

    assert answer("a") == "a:miss"
    assert answer("a") == "a:miss"  # the hit serves what the miss computed
    assert answer.bypass("a") == "a:bypass"
    with pytest.raises(TypeError):
        answer("a", call=CallHandle())


def test_a_call_parameter_must_be_one_the_cache_can_pass():
    from evocache.controller import ContractError

    with pytest.raises(ContractError, match="call_param 'handle' is not a named parameter"):
        cache_if("true", call_param="handle")(lambda prompt, call=None: prompt)
    with pytest.raises(ContractError, match="keyword-only"):
        cache_if("true", call_param="call")(lambda call, prompt: prompt)
