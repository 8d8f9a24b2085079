"""SLO circuit breakers per rule and tenant (``controller._slo``), through ``@cache_if`` on real runtimes.

A tenant whose semantic answers of a rule turn out wrong (``feedback(correct=False)`` on served hits, or a
judge that finds an exploration's answers different) or whose lookups grow slow trips its breaker of the rule:
for its ``cool_down`` its calls of the rule run in safe mode (``semantic-off``: exact caching only;
``bypass``: no cache), then half-open probes decide whether it closes or opens again. Other tenants' calls run
as before, unless ``rule_wide_tenants`` tenants' breakers are open at once: then the rule runs in safe mode
for every tenant. Every transition is an access event naming the tenant and a metric. Time is the runtime's injected
clock: nothing sleeps, except the slow tier that makes lookups slow. The calls here are made for no tenant
(namespace ``.anonymous``) unless a test says otherwise.
"""

from __future__ import annotations

import hashlib
import random
import time
from dataclasses import replace

import numpy as np
import pytest
from _helpers import FakeClock

from evocache.controller import (
    SloBreaker,
    SloBreakers,
    StoreConfig,
    Tier,
    TieredStore,
    build_runtime,
    cache_if,
    tenant_scope,
    use_runtime,
)
from evocache.dsl import SloSpec, parse_policy

T0 = 1_700_000_000.0
ANON = ".anonymous"  # the namespace of calls made for no tenant


class TopicEmbedder:
    """Texts ``topicN#variant``: the variants of an even topic lie next to each other (cosine about 0.9999),
    an odd topic's are spread out (about 0.95); topics are far apart. No model to load."""

    name = "topic"
    dim = 16

    def fits(self, text: str) -> bool:
        return True

    def embed(self, texts: list[str]) -> np.ndarray:
        rows = []
        for text in texts:
            topic = text.partition("#")[0]
            base, noise = (
                np.random.default_rng(int(hashlib.sha256(t.encode()).hexdigest()[:8], 16)).normal(size=16)
                for t in (topic, text)
            )
            spread = 0.01 if int(topic[5:]) % 2 == 0 else 0.3
            rows.append(base / np.linalg.norm(base) + spread * noise / np.linalg.norm(noise))
        vecs = np.stack(rows).astype(np.float32)
        return vecs / np.linalg.norm(vecs, axis=1, keepdims=True)


STATIC = "semantic: {max_error: 0.05, mode: static, threshold: 0.99}"


def policy(rules: str, slo: str = "", version: int = 1) -> str:
    return f"policy: p\nversion: {version}\nrules:\n{rules}" + (f"slo: {slo}\n" if slo else "")


def faq(slo: str, version: int = 1) -> str:
    return policy(f"  - name: faq\n    when: 'true'\n    {STATIC}\n    slo: {slo}\n", version=version)


def runtime_for(text: str, clock: FakeClock, **kwargs):
    return build_runtime(StoreConfig(), policy=parse_policy(text), clock=clock, embedder=TopicEmbedder(),
                         **kwargs)


def slo_events(rt) -> list[tuple[str, str, str, str]]:
    events = rt.events.events()
    return [(e.outcome, e.rule, e.reason, e.policy) for e in events if e.outcome.startswith("slo-")]


def state_of(rt, rule: str, policy_ref: str = "p@1", ns: str = ANON) -> float | None:
    labels = {"policy": policy_ref, "rule": rule, "ns": ns}
    return rt.metrics.registry.get_sample_value("evocache_slo_state", labels)


def transitions(rt, rule: str, state: str, policy_ref: str = "p@1", scope: str = "tenant") -> float:
    return rt.metrics.value("evocache_slo_transitions_total", policy=policy_ref, rule=rule, scope=scope,
                            state=state)


def answering(calls: list[str]):
    def answer(prompt: str) -> str:
        calls.append(prompt)
        return f"answer to {prompt}"

    return answer


def serve_wrong(answer, prompts: list[str]) -> None:
    """Each prompt is served semantically (a variant of topic0#a), and its answer reported wrong."""
    for prompt in prompts:
        assert answer(prompt) == "answer to topic0#a"
        assert answer.feedback(prompt, correct=False) is True


# --- tripping on wrong answers ------------------------------------------------------------------------------


def test_wrong_answers_trip_the_rule_to_semantic_off_and_exact_caching_goes_on(clock):
    rt = runtime_for(faq("{max_error_rate: 0.5, min_samples: 3}"), clock)
    calls: list[str] = []
    answer = cache_if("true", store=rt)(answering(calls))
    answer("topic0#a")
    serve_wrong(answer, ["topic0#b", "topic0#c"])
    assert rt.slo.states(ANON) == {"faq": "closed"}
    assert slo_events(rt) == []  # 2 verdicts: fewer than min_samples
    assert state_of(rt, "faq") is None  # a rule's series appear at its first transition
    serve_wrong(answer, ["topic0#d"])
    assert rt.slo.states(ANON) == {"faq": "open"}
    assert slo_events(rt) == [("slo-open", "faq", "error-rate", "p@1")]
    assert state_of(rt, "faq") == 2 and transitions(rt, "faq", "open") == 1

    before = len(rt.events.events())
    assert answer("topic0#b") == "answer to topic0#b"  # no semantic lookup: the function runs
    assert answer("topic0#b") == "answer to topic0#b"  # and its answer is cached exactly
    assert answer("topic0#a") == "answer to topic0#a"  # an exact hit as before
    assert answer("topic0#e") == "answer to topic0#e"
    assert calls == ["topic0#a", "topic0#b", "topic0#e"]
    events = rt.events.events()[before:]
    assert [(e.outcome, e.reason, e.stored) for e in events] == [
        ("miss", "slo-breaker", "l1"), ("hit", "", ""), ("hit", "", ""), ("miss", "slo-breaker", "l1"),
    ]
    assert all(e.semantic is None for e in events)  # no neighbour was even looked for
    assert answer.feedback("topic0#b", correct=False) is False  # no semantic hit was served


def test_after_the_cool_down_probes_that_hold_close_the_rule(clock):
    rt = runtime_for(faq("{max_error_rate: 0.5, min_samples: 3, cool_down: 30s, probe: 1}"), clock)
    calls: list[str] = []
    answer = cache_if("true", store=rt)(answering(calls))
    answer("topic0#a")
    serve_wrong(answer, ["topic0#b", "topic0#c", "topic0#d"])
    clock.advance(29)
    assert answer("topic0#e") == "answer to topic0#e"  # still cooling down: safe mode
    clock.advance(1)
    for prompt in ("topic0#f", "topic0#g", "topic0#h"):
        assert answer(prompt) == "answer to topic0#a"  # half-open: the probes are served semantically
        assert rt.slo.states(ANON) == {"faq": "half-open"}
        assert answer.feedback(prompt, correct=True) is True
    assert rt.slo.states(ANON) == {"faq": "closed"}
    assert slo_events(rt) == [
        ("slo-open", "faq", "error-rate", "p@1"),
        ("slo-half-open", "faq", "cool-down", "p@1"),
        ("slo-closed", "faq", "probes-held", "p@1"),
    ]
    assert state_of(rt, "faq") == 0
    assert [transitions(rt, "faq", s) for s in ("open", "half-open", "closed")] == [1, 1, 1]
    assert answer("topic0#i") == "answer to topic0#a"  # closed: semantic matching as before
    assert calls == ["topic0#a", "topic0#e"]


def test_probes_that_fail_open_the_rule_again_for_another_cool_down(clock):
    rt = runtime_for(faq("{max_error_rate: 0.5, min_samples: 2, cool_down: 10s, probe: 1}"), clock)
    answer = cache_if("true", store=rt)(answering([]))
    answer("topic0#a")
    serve_wrong(answer, ["topic0#b", "topic0#c"])
    clock.advance(10)
    serve_wrong(answer, ["topic0#d"])
    assert rt.slo.states(ANON) == {"faq": "half-open"}  # one probe verdict: not enough to judge
    serve_wrong(answer, ["topic0#e"])
    assert rt.slo.states(ANON) == {"faq": "open"}
    assert [outcome for outcome, *_ in slo_events(rt)] == ["slo-open", "slo-half-open", "slo-open"]
    assert state_of(rt, "faq") == 2 and transitions(rt, "faq", "open") == 2
    assert answer("topic0#f") == "answer to topic0#f"  # safe mode again
    clock.advance(10)
    assert answer("topic0#g") == "answer to topic0#a"  # and probed again after the new cool-down


def test_only_the_probe_fraction_of_a_half_open_rules_calls_run_normally(clock):
    rt = runtime_for(faq("{max_error_rate: 0.5, min_samples: 2, cool_down: 10s, probe: 0.25}"), clock)
    answer = cache_if("true", store=rt)(answering([]))
    answer("topic0#a")
    serve_wrong(answer, ["topic0#b", "topic0#c"])
    clock.advance(10)
    served = [answer(f"topic0#p{i}") == "answer to topic0#a" for i in range(8)]
    assert served == [True, False, False, False, True, False, False, False]  # every 4th, the first included
    assert rt.slo.states(ANON) == {"faq": "half-open"}  # nothing judged the probes yet


def test_a_verdict_on_an_answer_served_before_the_trip_does_not_judge_the_probes(clock):
    rt = runtime_for(faq("{max_error_rate: 0.4, min_samples: 2, cool_down: 10s, probe: 1}"), clock)
    answer = cache_if("true", store=rt)(answering([]))
    answer("topic0#a")
    serve_wrong(answer, ["topic0#b"])
    assert answer("topic0#c") == "answer to topic0#a"  # served while closed; its verdict comes later
    serve_wrong(answer, ["topic0#d"])
    assert rt.slo.states(ANON) == {"faq": "open"}
    clock.advance(10)
    for prompt in ("topic0#e", "topic0#f"):
        assert answer(prompt) == "answer to topic0#a"
        assert answer.feedback(prompt, correct=True)
        if prompt == "topic0#e":
            # It judges the rule as it ran before the trip: counted, 1 wrong of 2 would open it again.
            assert answer.feedback("topic0#c", correct=False)
    assert rt.slo.states(ANON) == {"faq": "closed"}


def test_exploration_verdicts_of_a_judge_that_finds_answers_different_trip_the_rule():
    """The semantic layer learns first (a judge that tells the truth, no objective); then, under a policy with
    one, the judge finds every explored answer different from its neighbour's: the rule trips."""
    rules = "  - name: faq\n    when: 'true'\n    semantic: {max_error: 0.05, explore: 0.5}\n"
    learning = parse_policy(policy(rules))
    watched = parse_policy(policy(rules + "    slo: {max_error_rate: 0.5, min_samples: 3}\n", version=2))
    rt = build_runtime(StoreConfig(), policy=learning, clock=lambda: T0, embedder=TopicEmbedder(),
                       rng=random.Random(7))
    honest = True

    @cache_if("true", semantic={"judge": lambda new, cached: honest and new == cached})
    def answer(prompt: str) -> str:
        topic = prompt.partition("#")[0]
        return f"about {topic}" if int(topic[5:]) % 2 == 0 else f"about {prompt}"

    with use_runtime(rt):
        for i in range(300):
            answer(f"topic{i % 8}#{i}")
            rt.semantic.drain()
    assert any(e.reason == "semantic-explore" for e in rt.events.events())  # it explores would-be hits
    rt = rt.activate(watched)
    honest = False
    before = len(rt.events.events())
    with use_runtime(rt):
        for i in range(300, 600):
            answer(f"topic{i % 8}#{i}")
            rt.semantic.drain()
            if rt.slo.tripped:
                break
    assert rt.slo.states(ANON) == {"faq": "open"}
    explored = sum(e.reason == "semantic-explore" for e in rt.events.events()[before:])
    assert explored == 3  # min_samples of them
    assert slo_events(rt) == [("slo-open", "faq", "error-rate", "p@2")]
    with use_runtime(rt):
        answer("topic0#600")
    assert rt.events.events()[-1].reason == "slo-breaker" and rt.events.events()[-1].semantic is None


# --- tripping on latency, and bypass ------------------------------------------------------------------------


class SlowTier(Tier):
    """An L2 that takes ``delay`` seconds a read: lookups that reach it are slow."""

    name = "l2"

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay
        self.data: dict = {}

    def get_many(self, ns, keys):
        time.sleep(self.delay)
        return [self.data.get((ns, k)) for k in keys]

    def set_many(self, ns, items):
        for k, e in items:
            self.data[(ns, k)] = e

    def delete(self, ns, keys):
        return sum(self.data.pop((ns, k), None) is not None for k in keys)

    def usage(self, ns=None):
        return 0


def slow_runtime(text: str, clock: FakeClock):
    rt = build_runtime(StoreConfig(), policy=parse_policy(text), clock=clock)
    return replace(rt, store=TieredStore([rt.store.tiers["l1"], SlowTier(0.005)], clock=clock))


def test_slow_lookups_trip_the_rule_to_bypass_even_for_what_l1_holds(clock):
    rt = slow_runtime(
        policy("  - name: tools\n    when: 'true'\n    tiers: [l1, l2]\n"
               "    slo: {p99_ms: 1, min_samples: 5, trip_to: bypass, cool_down: 1m}\n"),
        clock,
    )
    calls: list[int] = []

    @cache_if("true", store=rt)
    def tool(x: int) -> int:
        calls.append(x)
        return x * 10

    assert tool(0) == 0 and tool(0) == 0  # an L1 hit on the hit path
    for _ in range(100):
        tool(0)  # fast L1 hits: a p99 is judged on at least 100 lookups
    tool(1)  # a miss: its lookup waits on the slow L2, like the first one (2 of 103 lookups slow)
    assert rt.slo.states(ANON) == {"tools": "open"}
    assert slo_events(rt) == [("slo-open", "tools", "p99", "p@1")]
    before = len(rt.events.events())
    assert tool(0) == 0 and tool(0) == 0  # bypassed: L1 holds it, but nothing is read or written
    assert calls == [0, 1, 0, 0]
    assert [(e.outcome, e.reason) for e in rt.events.events()[before:]] == [("bypass", "slo-breaker")] * 2
    assert tool.cache_info().bypasses == 2


def test_fast_l1_hits_keep_an_occasional_slow_lookup_within_the_p99(clock):
    rt = slow_runtime(
        policy("  - name: tools\n    when: 'true'\n    tiers: [l1, l2]\n"
               "    slo: {p99_ms: 1, min_samples: 2}\n"),
        clock,
    )

    @cache_if("true", store=rt)
    def tool(x: int) -> int:
        return x

    tool(0)  # one slow lookup (the miss)
    for _ in range(400):
        tool(0)  # L1 hits, counted from the histogram the hit path fills
    tool(1)  # a second slow lookup: 2 of 402 lookups are slow, under 1 % (of 2 alone, all)
    assert rt.slo.states(ANON) == {"tools": "closed"}
    for x in (2, 3, 4):
        tool(x)  # 5 of 405: over 1 %
    assert rt.slo.states(ANON) == {"tools": "open"}


def test_an_async_function_is_bypassed_too(clock):
    import asyncio

    rt = slow_runtime(
        policy("  - name: tools\n    when: 'true'\n    tiers: [l1, l2]\n"
               "    slo: {p99_ms: 1, min_samples: 2, trip_to: bypass}\n"),
        clock,
    )
    calls: list[int] = []

    @cache_if("true", store=rt)
    async def tool(x: int) -> int:
        calls.append(x)
        return x

    async def run() -> None:
        for x in (1, *[1] * 100, 2, 1, 1):  # a slow miss, 100 fast hits (a p99 needs 100), a slow miss
            await tool(x)

    asyncio.run(run())
    assert calls == [1, 2, 1, 1]  # tripped after two slow misses: the later calls bypass what L1 holds
    assert [e.reason for e in rt.events.events() if e.outcome == "bypass"] == ["slo-breaker"] * 2


# --- rules, overrides and policy swaps ----------------------------------------------------------------------


def test_each_rule_is_measured_on_its_own_and_its_slo_overrides_the_policys(clock):
    text = policy(
        f"  - name: strict\n    when: 'startswith(prompt, \"topic0\")'\n    {STATIC}\n"
        "    slo: {max_error_rate: 0.2, trip_to: bypass}\n"
        f"  - name: lenient\n    when: 'true'\n    {STATIC}\n",
        slo="{max_error_rate: 0.9, min_samples: 3}",
    )
    rt = runtime_for(text, clock)
    assert rt.slo.by_rule["strict"].spec == SloSpec(
        max_error_rate=0.2, window=60.0, min_samples=3, cool_down=30.0, trip_to="bypass", probe=0.1,
        rule_wide_tenants=3,
    )
    assert rt.slo.by_rule["lenient"].spec.max_error_rate == 0.9
    calls: list[str] = []
    answer = cache_if("true", store=rt)(answering(calls))
    answer("topic0#a")
    answer("topic2#a")
    for prompt in ("topic0#b", "topic0#c", "topic0#d"):
        answer(prompt)
        answer.feedback(prompt, correct=False)
    for prompt in ("topic2#b", "topic2#c", "topic2#d"):
        assert answer(prompt) == "answer to topic2#a"
        answer.feedback(prompt, correct=prompt != "topic2#b")  # 1 of 3 wrong: within 0.9, beyond 0.2
    assert rt.slo.states(ANON) == {"default": "closed", "strict": "open", "lenient": "closed"}
    assert answer("topic0#a") == "answer to topic0#a" and calls[-1] == "topic0#a"  # bypass: computed again
    assert answer("topic2#e") == "answer to topic2#a"  # the other rule still matches semantically


def test_a_policy_swap_builds_closed_breakers_for_the_new_rules(clock):
    rt = runtime_for(faq("{max_error_rate: 0.5, min_samples: 2}"), clock)
    answer = cache_if("true")(answering([]))
    with use_runtime(rt):
        answer("topic0#a")
        serve_wrong(answer, ["topic0#b", "topic0#c"])
    assert rt.slo.states(ANON) == {"faq": "open"} and state_of(rt, "faq") == 2
    swapped = rt.activate(parse_policy(faq("{max_error_rate: 0.4, min_samples: 2}", version=2)))
    assert swapped.slo.states(ANON) == {"faq": "closed"}
    assert swapped.slo.by_rule["faq"].spec.max_error_rate == 0.4
    assert rt.slo.tripped == {} and not rt.slo.bypassing  # the old breakers are retired
    assert state_of(rt, "faq") is None  # and their state series gone
    with use_runtime(swapped):
        assert answer("topic0#d") == "answer to topic0#a"  # the new rule matches semantically again
    with use_runtime(rt):
        assert answer("topic0#e") == "answer to topic0#a"  # a retired breaker decides nothing
        with tenant_scope("late"):
            answer("topic0#a")
            serve_wrong(answer, ["topic0#f", "topic0#g"])  # and a retired set makes no new one
    assert "late" not in rt.slo.by_rule["faq"].breakers and rt.slo.states("late") == {"faq": "closed"}
    assert slo_events(swapped) == [("slo-open", "faq", "error-rate", "p@1")]  # one sink: no event since

    unwatched = swapped.activate(parse_policy(policy("  - {name: other, when: 'true'}\n", version=3)))
    assert not unwatched.slo and unwatched.slo.states(ANON) == {}


def test_a_policy_without_objectives_has_no_breakers(clock):
    rt = runtime_for(policy(f"  - name: faq\n    when: 'true'\n    {STATIC}\n", slo="{window: 5m}"), clock)
    assert not rt.slo and rt.slo.by_rule == {} and rt.hot[-1] == set()
    answer = cache_if("true", store=rt)(answering([]))
    answer("topic0#a")
    serve_wrong(answer, [f"topic0#{i}" for i in range(30)])
    assert slo_events(rt) == []
    assert "evocache_slo_state{" not in rt.metrics.exposition().decode()


def test_the_metrics_are_exposed_for_prometheus(clock):
    rt = runtime_for(faq("{max_error_rate: 0.5, min_samples: 1}"), clock)
    answer = cache_if("true", store=rt)(answering([]))
    answer("topic0#a")
    serve_wrong(answer, ["topic0#b"])
    text = rt.metrics.exposition().decode()
    assert 'evocache_slo_state{ns=".anonymous",policy="p@1",rule="faq"} 2.0' in text
    assert 'evocache_slo_transitions_total{policy="p@1",rule="faq",scope="tenant",state="open"} 1.0' in text


def test_an_event_log_with_transitions_replays(clock, tmp_path):
    from evocache.controller import EventsConfig
    from evocache.controller.replay import read_trace

    path = tmp_path / "events.jsonl"
    config = StoreConfig(events=EventsConfig(sink="jsonl", path=str(path)))
    rt = build_runtime(config, policy=parse_policy(faq("{max_error_rate: 0.5, min_samples: 1}")), clock=clock,
                       embedder=TopicEmbedder())
    answer = cache_if("true", store=rt)(answering([]))
    answer("topic0#a")
    serve_wrong(answer, ["topic0#b"])
    answer("topic0#c")
    rt.close()
    assert '"outcome":"slo-open"' in path.read_text()
    accesses = list(read_trace(str(path), "events"))  # the transition is no access, and no error
    assert [a.rule for a in accesses] == ["faq"] * 3 and accesses[0].size > 0


# --- one breaker per tenant -------------------------------------------------------------------------------


def tenant_events(rt, since: int = 0) -> list[tuple[str, str, str]]:
    """``(outcome, ns, reason)`` of every breaker transition since event ``since``."""
    return [(e.outcome, e.ns, e.reason) for e in rt.events.events()[since:] if e.outcome.startswith("slo-")]


def as_tenant(tenant: str, answer, prompts: list[str]) -> list[str]:
    with tenant_scope(tenant):
        return [answer(prompt) for prompt in prompts]


def trip(answer, tenant: str, topic: str = "topic0") -> None:
    """``tenant`` is served three variants of ``topic``'s first prompt semantically, and says each was
    wrong."""
    with tenant_scope(tenant):
        answer(f"{topic}#a")
        serve_wrong_in(answer, topic, ["b", "c", "d"])


def serve_wrong_in(answer, topic: str, variants: list[str]) -> None:
    for variant in variants:
        assert answer(f"{topic}#{variant}") == f"answer to {topic}#a"
        assert answer.feedback(f"{topic}#{variant}", correct=False) is True


def what_acme_sees(others_trip: bool, slo: str = "{max_error_rate: 0.5, min_samples: 3}"):
    """Tenant acme's answers and events for the same calls, after globex tripped its breaker of the rule, or
    after globex only asked once."""
    clock = FakeClock()
    rt = runtime_for(faq(slo), clock)
    answer = cache_if("true", store=rt)(answering([]))
    as_tenant("acme", answer, ["topic0#a"])
    if others_trip:
        trip(answer, "globex")
    else:
        as_tenant("globex", answer, ["topic0#a"])
    before = len(rt.events.events())
    prompts = [f"topic0#q{i}" for i in range(20)] + ["topic0#a", "topic1#a", "topic1#a"]
    served = as_tenant("acme", answer, prompts)
    seen = [(e.outcome, e.tier, e.reason, e.semantic is not None)
            for e in rt.events.events()[before:] if e.ns == "acme"]
    return rt, answer, served, seen


def test_one_tenants_wrong_verdicts_open_its_own_breaker_and_no_other_tenants_hits_fall():
    quiet, _, served_quiet, seen_quiet = what_acme_sees(others_trip=False)
    rt, answer, served, seen = what_acme_sees(others_trip=True)
    assert rt.slo.states("globex") == {"faq": "open"}
    assert rt.slo.states("acme") == {"faq": "closed"} and rt.slo.states() == {"faq": "closed"}
    # acme is served as if globex had done nothing: every look-alike prompt a semantic hit, the same events.
    assert served == served_quiet and seen == seen_quiet
    assert served[:20] == ["answer to topic0#a"] * 20
    assert sum(outcome == "hit" and semantic for outcome, _, _, semantic in seen) == 20
    assert not any(reason == "slo-breaker" for *_, reason, _ in seen)
    # globex's own calls run in safe mode: its look-alike prompt is computed, not matched.
    assert as_tenant("globex", answer, ["topic0#e"]) == ["answer to topic0#e"]
    assert rt.events.events()[-1].reason == "slo-breaker"


def test_a_tenants_verdicts_count_only_in_its_own_breaker(clock):
    rt = runtime_for(faq("{max_error_rate: 0.5, min_samples: 3}"), clock)
    answer = cache_if("true", store=rt)(answering([]))
    for tenant in ("t1", "t2"):
        with tenant_scope(tenant):
            answer("topic0#a")
            serve_wrong_in(answer, "topic0", ["b", "c"])  # two wrong each: four in all, two per tenant
    assert rt.slo.states("t1") == rt.slo.states("t2") == {"faq": "closed"} and tenant_events(rt) == []


def test_slow_lookups_of_one_tenant_trip_its_breaker_only_and_the_others_l1_hits_stay_on_the_hit_path(clock):
    rt = slow_runtime(
        policy("  - name: tools\n    when: 'true'\n    tiers: [l1, l2]\n"
               "    slo: {p99_ms: 1, min_samples: 5, trip_to: bypass, cool_down: 1m}\n"),
        clock,
    )
    calls: list[tuple[str, int]] = []

    @cache_if("true", store=rt)
    def tool(x: int, tenant: str = "default") -> int:
        calls.append((tenant, x))
        return x * 10

    for _ in range(300):
        tool(0, tenant="acme")  # one slow miss, then fast L1 hits: acme's own lookups
    tool(0, tenant="globex")  # globex's first lookup, slow, then 99 fast hits and a second slow one
    for _ in range(99):
        tool(0, tenant="globex")
    tool(1, tenant="globex")  # 2 of 101 of globex's lookups slow: over 1 % (acme's hits do not dilute them)
    assert rt.slo.states("globex") == {"tools": "open"} and rt.slo.states("acme") == {"tools": "closed"}
    assert tenant_events(rt) == [("slo-open", "globex", "p99")]
    assert rt.slo.bypassing == {("tools", "globex")}
    before = len(rt.events.events())
    assert tool(0, tenant="acme") == 0 and tool(0, tenant="globex") == 0
    tool(2, tenant="acme")  # a second slow lookup of acme's: 2 of 302, within its p99
    assert rt.slo.states("acme") == {"tools": "closed"}
    events = [(e.ns, e.outcome, e.tier, e.reason, e.stored) for e in rt.events.events()[before:]]
    assert events == [("acme", "hit", "l1", "", ""), ("globex", "bypass", None, "slo-breaker", ""),
                      ("acme", "miss", None, "", "l1,l2")]
    assert calls == [("acme", 0), ("globex", 0), ("globex", 1), ("globex", 0), ("acme", 2)]


# --- rule-wide ----------------------------------------------------------------------------------------------

RULE_WIDE_AT_TWO = "{max_error_rate: 0.5, min_samples: 3, cool_down: 30s, rule_wide_tenants: 2, probe: 1}"


def test_the_rule_trips_for_every_tenant_while_enough_tenants_breakers_are_open(clock):
    rt = runtime_for(faq(RULE_WIDE_AT_TWO), clock)
    answer = cache_if("true", store=rt)(answering([]))
    as_tenant("bystander", answer, ["topic0#a"])
    trip(answer, "t1")
    assert rt.slo.states() == {"faq": "closed"}  # one tenant's breaker: the others run normally
    assert as_tenant("bystander", answer, ["topic0#b"]) == ["answer to topic0#a"]
    clock.advance(10)
    trip(answer, "t2")  # a second tenant's: the rule trips for every tenant
    assert rt.slo.states() == {"faq": "open"} and rt.slo.states("bystander") == {"faq": "closed"}
    assert tenant_events(rt) == [("slo-open", "t1", "error-rate"), ("slo-open", "t2", "error-rate"),
                                 ("slo-open", "", "tenants")]
    assert state_of(rt, "faq", ns="") == 2 and transitions(rt, "faq", "open", scope="rule") == 1
    before = len(rt.events.events())
    assert as_tenant("bystander", answer, ["topic0#c"]) == ["answer to topic0#c"]  # semantic off for it too
    assert [(e.outcome, e.reason) for e in rt.events.events()[before:]] == [("miss", "slo-breaker")]

    clock.advance(20)  # t1's cool-down is over: only t2's breaker is open, fewer than two
    before = len(rt.events.events())
    assert as_tenant("bystander", answer, ["topic0#d"]) == ["answer to topic0#a"]
    assert tenant_events(rt, before) == [("slo-closed", "", "cool-down")]
    assert rt.slo.states() == {"faq": "closed"} and state_of(rt, "faq", ns="") == 0
    assert rt.slo.states("t1") == {"faq": "open"}  # its next call makes it half-open
    assert as_tenant("t1", answer, ["topic0#e"]) == ["answer to topic0#a"]  # a probe
    assert rt.slo.states("t1") == {"faq": "half-open"}


def test_a_tripped_tenant_probes_while_the_rule_is_tripped_rule_wide(clock):
    rt = runtime_for(faq(RULE_WIDE_AT_TWO), clock)
    answer = cache_if("true", store=rt)(answering([]))
    as_tenant("bystander", answer, ["topic0#a"])
    trip(answer, "t1")  # open until 30 s from now
    clock.advance(35)
    trip(answer, "t2")  # t1 has not called since its cool-down ended: one breaker in its cool-down
    assert rt.slo.states() == {"faq": "closed"}
    clock.advance(5)
    trip(answer, "t3")  # two: the rule is tripped until the earlier of their cool-downs ends
    assert rt.slo.states() == {"faq": "open"} and rules_until(rt) == T0 + 65
    clock.advance(1)
    assert as_tenant("t1", answer, ["topic0#p"]) == ["answer to topic0#a"]  # t1's own probe runs normally
    assert rt.slo.states("t1") == {"faq": "half-open"} and rt.slo.states() == {"faq": "open"}
    assert as_tenant("bystander", answer, ["topic0#q"]) == ["answer to topic0#q"]  # safe mode
    assert rt.events.events()[-1].reason == "slo-breaker"


def rules_until(rt) -> float:
    return rt.slo.by_rule["faq"].wide_until


def test_fewer_tenants_than_rule_wide_tenants_never_trip_the_rule(clock):
    rt = runtime_for(faq("{max_error_rate: 0.5, min_samples: 3}"), clock)  # rule_wide_tenants: 3
    answer = cache_if("true", store=rt)(answering([]))
    as_tenant("bystander", answer, ["topic0#a"])
    for tenant in ("t1", "t2"):
        trip(answer, tenant)
    assert rt.slo.states() == {"faq": "closed"}
    assert as_tenant("bystander", answer, ["topic0#z"]) == ["answer to topic0#a"]
    trip(answer, "t3")
    assert rt.slo.states() == {"faq": "open"}


# --- bounded memory -----------------------------------------------------------------------------------------


def test_a_rule_keeps_a_bounded_number_of_tenants_breakers_dropping_closed_ones_first(clock):
    rt = runtime_for(faq("{max_error_rate: 0.5, min_samples: 1, rule_wide_tenants: 10}"), clock)
    slo = SloBreakers(rt.policy, clock=clock, metrics=rt.metrics, events=rt.events, max_tenants=3)
    rt = replace(rt, slo=slo)
    assert rt.slo is slo
    slo.verdict("faq", "t0", True)
    for i in range(200):
        slo.verdict("faq", f"n{i}", False)  # closed breakers come and go
    rules = slo.by_rule["faq"]
    assert list(rules.breakers) == ["t0", "n198", "n199"]  # the open one stays; the oldest closed ones go
    assert slo.states("t0") == {"faq": "open"} and slo.tripped == {"faq": rules}
    slo.verdict("faq", "t1", True)
    slo.verdict("faq", "t2", True)
    assert list(rules.breakers) == ["t0", "t1", "t2"]
    before = len(rt.events.events())
    slo.verdict("faq", "t3", False)  # every breaker kept is open: the least recently used one goes
    assert list(rules.breakers) == ["t1", "t2", "t3"]
    assert tenant_events(rt, before) == [("slo-closed", "t0", "evicted")]
    assert state_of(rt, "faq", ns="t0") is None and state_of(rt, "faq", ns="t1") == 2
    assert slo.states("t0") == {"faq": "closed"} and rules.tripped == {"t1", "t2"}
    exposed = rt.metrics.exposition().decode()
    assert exposed.count("evocache_slo_state{") == 2  # one series per breaker kept that has moved


def test_l1_tallies_live_only_as_long_as_a_plan_or_a_breaker_holds_them(clock):
    rt = slow_runtime(policy("  - name: tools\n    when: 'true'\n    slo: {p99_ms: 5}\n"), clock)
    tally = rt.slo.l1_tally("tools", "acme")
    assert tally == [0.0] and rt.slo.l1_tally("tools", "acme") is tally
    assert rt.slo.l1_tally("other", "acme") is None  # no breaker, no tally
    del tally
    assert len(rt.slo._tallies) == 0


# --- one breaker on a clock ---------------------------------------------------------------------------------


class Breaker:
    """A ``SloBreaker`` with its transitions and the L1 hits its histogram would count."""

    def __init__(self, clock: FakeClock, **spec: object) -> None:
        self.changes: list[tuple[str, str]] = []
        self.hits = 0.0
        self.breaker = SloBreaker(
            "r", SloSpec.model_validate(spec).resolved(), clock=clock,
            notify=lambda breaker, state, reason: self.changes.append((state, reason)),
            l1_hits=lambda: self.hits,
        )


def test_measurements_older_than_the_window_expire(clock):
    b = Breaker(clock, max_error_rate=0.5, min_samples=4, window=60)
    for _ in range(3):
        b.breaker.verdict(True)
    clock.advance(60)  # the slices holding those three have left the window
    b.breaker.verdict(True)
    b.breaker.verdict(False)
    b.breaker.verdict(False)
    assert b.changes == []  # 1 wrong of 3 in the window
    clock.advance(54)
    b.breaker.verdict(True)  # 2 of 4, not over 0.5
    b.breaker.verdict(True)  # 3 of 5
    assert b.changes == [("open", "error-rate")]


def test_l1_hits_counted_before_the_breaker_existed_are_not_in_its_window(clock):
    changes: list[tuple[str, str]] = []
    breaker = SloBreaker(
        "r", SloSpec(p99_ms=10, min_samples=2).resolved(), clock=clock,
        notify=lambda breaker, state, reason: changes.append((state, reason)), l1_hits=lambda: 1000.0,
    )
    for _ in range(100):
        breaker.observe(0.5)  # 100 slow of 100: the 1000 earlier hits do not dilute them
    assert changes == [("open", "p99")]


def test_a_p99_is_not_judged_on_fewer_than_100_lookups(clock):
    """One slow lookup among a few (an embedder loading on the first semantic lookup) is not a p99 breach."""
    changes: list[tuple[str, str]] = []
    breaker = SloBreaker("r", SloSpec(p99_ms=10, min_samples=20).resolved(), clock=clock,
                         notify=lambda breaker, state, reason: changes.append((state, reason)))
    breaker.observe(5.0)
    for _ in range(98):
        breaker.observe(0.001)
    assert changes == []  # 1 slow of 99: too few lookups to say anything of the p99
    breaker.observe(0.001)
    breaker.observe(0.001)
    assert changes == []  # 1 of 101: within the p99
    breaker.observe(5.0)
    assert changes == [("open", "p99")]  # 2 of 102: over 1 %


def test_half_open_closes_only_on_enough_of_the_measurement_that_tripped_it(clock):
    b = Breaker(clock, max_error_rate=0.1, p99_ms=10, min_samples=3, cool_down=5, probe=1)
    for _ in range(3):
        b.breaker.verdict(True)
    clock.advance(5)
    assert b.breaker.admit() and b.changes[-1] == ("half-open", "cool-down")
    for _ in range(10):
        b.breaker.observe(0.001)  # fast lookups say nothing of the error rate that tripped it
    assert b.breaker.state == "half-open"
    for _ in range(3):
        b.breaker.verdict(False)
    assert b.changes[-1] == ("closed", "probes-held")
    assert b.breaker.admit() is True


def test_a_breaker_needs_a_resolved_spec(clock):
    with pytest.raises(ValueError, match="takes a resolved SloSpec"):
        SloBreaker("r", SloSpec(p99_ms=1), clock=clock, notify=lambda *a: None, l1_hits=lambda: 0.0)
