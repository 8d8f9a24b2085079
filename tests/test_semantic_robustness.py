"""Semantic caching under many tenants and long runs: budgets per scope, feedback that teaches, bounded state,
concurrent identical prompts (the review's F5, F7, F11, F15)."""

from __future__ import annotations

import math
import random

import numpy as np
from evocache.controller.semantic import Scope
from evocache.controller.semantic._cache import SemanticCache
from evocache.controller.semantic._decide import BoundedPolicy, PacerOptions
from test_semantic_decide import TableEmbedder, synthetic_stream

A, B = Scope("tenant-a", "fn"), Scope("tenant-b", "fn")
SECRET = b"the deployment secret of these replicas"


def test_one_tenants_lookups_without_candidates_buy_no_budget_for_another() -> None:
    # Tenant B sends three new prompts per tenant-A lookup into a scope that holds nothing: with one pooled
    # budget, B's candidate-free lookups raised the budget per lookup that A's risky would-be hits spent
    # (A's error rate 0.056 at a bound of 0.02 on this stream).
    delta = 0.02
    stream, table = synthetic_stream(0, n=4000)
    table = dict(table)
    rng = np.random.default_rng(9)
    cache = SemanticCache(TableEmbedder(table), rng=random.Random(0))
    wrong = 0
    for i, (prompt, group) in enumerate(stream):
        for j in range(3):
            other = f"b{i}.{j}"
            v = rng.normal(size=24)
            table[other] = (v / np.linalg.norm(v)).astype(np.float32)
            cache.lookup(B, other, max_error=delta)
        decision, entry = cache.lookup(A, prompt, max_error=delta)
        if entry is not None:
            wrong += cache.answer_ref(entry) != group
            continue
        cache.insert(A, f"e{i}", prompt, group)
        cache.judge_miss(A, prompt, group, decision)
    assert wrong / len(stream) <= delta
    policy = cache._policy
    assert isinstance(policy, BoundedPolicy)
    # each scope's pacer counted its own lookups; the error model is one for both
    assert policy.pacer_of(A).lookups == len(stream)
    assert policy.pacer_of(B).lookups == 3 * len(stream)
    assert policy.pacer_of(B).current == 0.0  # B never had a candidate: nothing to spend its budget on
    assert cache.stats(B).cutoff == 0.0
    assert cache.stats(A).cutoff == policy.pacer_of(A).current > 0.0


def test_pacers_are_kept_for_the_most_recently_used_scopes_only() -> None:
    policy = BoundedPolicy(max_scopes=2)
    cache = SemanticCache(TableEmbedder({"p": np.array([1.0, 0.0], dtype=np.float32)}), policy=policy)
    scopes = [Scope("t", f"fn|{i}") for i in range(3)]
    for scope in scopes:
        cache.lookup(scope, "p", max_error=0.05)
    cache.lookup(scopes[1], "p", max_error=0.05)
    assert len(policy) == 2
    assert policy.pacer_of(scopes[0]) is None  # least recently used: dropped (starts cold if it returns)
    assert policy.pacer_of(scopes[1]).lookups == 2
    assert policy.pacer_of(scopes[2]).lookups == 1


class _Recording(BoundedPolicy):
    """The real bounded policy, recording what it is told to observe."""

    def __init__(self) -> None:
        super().__init__()
        self.observed: list[tuple[np.ndarray, bool, float, bool]] = []

    def observe(self, candidate, wrong, est_error, *, explored):  # type: ignore[no-untyped-def]
        self.observed.append((candidate.features, wrong, est_error, explored))
        super().observe(candidate, wrong, est_error, explored=explored)


def _served_replay(cache: SemanticCache, stream: list[tuple[str, str]]) -> list[tuple[int, object, str]]:
    """Replay ``stream`` in scope A; the served non-exact hits as (position, decision, entry)."""
    served = []
    for i, (prompt, group) in enumerate(stream):
        decision, entry = cache.lookup(A, prompt, max_error=0.05)
        if entry is not None:
            served.append((i, decision, entry))
            continue
        cache.insert(A, f"e{i}", prompt, group)
        cache.judge_miss(A, prompt, group, decision)
    return served


def test_feedback_on_a_served_hit_is_an_observation_with_the_features_that_served_it() -> None:
    stream, table = synthetic_stream(1, n=1500)
    policy = _Recording()
    cache = SemanticCache(TableEmbedder(table), policy=policy, rng=random.Random(1))
    served = _served_replay(cache, stream)
    assert len(served) > 100
    _, decision, entry = served[-1]
    before = len(policy.observed)
    model_seen, calibration = len(policy.model), (policy.calibration.wrong, policy.calibration.expected)
    stats = cache.stats()
    evidence = cache.evidence.get(entry, (0, 0))

    cache.feedback(entry, correct=False)

    assert len(policy.observed) == before + 1
    features, wrong, est, explored = policy.observed[-1]
    assert wrong is True and explored is False
    assert est == decision.est_error
    assert features[0] == decision.similarity  # the candidate's features as they were at that lookup
    assert len(policy.model) == model_seen + 1
    # served hits are not the uniform sample: the calibration stays the explorations' own
    assert (policy.calibration.wrong, policy.calibration.expected) == calibration
    after = cache.stats()
    assert (after.feedback, after.feedback_wrong, after.observations) == (1, 1, stats.observations + 1)
    assert after.realised_error == (stats.explored_wrong + 1) / (stats.explored + 1)
    assert cache.evidence[entry] == (evidence[0] + 1, evidence[1])

    # one lookup gives one observation: a second verdict on it is evidence and a count, not a second observation
    served_from_entry = sum(1 for _, _, e in served if e == entry)
    for _ in range(served_from_entry + 3):
        cache.feedback(entry, correct=True)
    assert len(policy.observed) == before + served_from_entry
    assert cache.stats().feedback == served_from_entry + 4


# -- F11: state follows the live entries -------------------------------------------------------------------


def _unit_rows(n: int, dim: int = 4, seed: int = 0) -> np.ndarray:
    rows = np.random.default_rng(seed).normal(size=(n, dim))
    return (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float32)


def test_a_scope_left_empty_is_dropped_and_can_come_back() -> None:
    from evocache.controller.semantic import SemanticIndex

    index = SemanticIndex()
    scopes = [Scope("t", f"fn|user{i}") for i in range(3)]
    for i, scope in enumerate(scopes):
        index.add(scope, [f"a{i}", f"b{i}"], _unit_rows(2, seed=i))
    index.remove(scopes[0], ["a0"])
    assert index.index(scopes[0]) is not None  # still holds b0
    index.remove(scopes[0], ["b0"])
    assert index.index(scopes[0]) is None
    assert len(index._indexes) == 2 and sorted(index.scopes()) == sorted(scopes[1:])
    assert index.search(scopes[0], _unit_rows(1), 3) == [[]]
    index.add(scopes[0], ["c0"], _unit_rows(1, dim=6))  # a fresh index: any dimension
    assert [n.entry_id for n in index.search(scopes[0], _unit_rows(1, dim=6), 3)[0]] == ["c0"]


def test_removed_entries_leave_no_trace_in_the_cache() -> None:
    rows = _unit_rows(2000, dim=8, seed=3)
    table = {f"p{i}": rows[i] for i in range(2000)}
    cache = SemanticCache(TableEmbedder(table), judge=lambda a, b: True, rng=random.Random(0))
    for i in range(2000):
        decision, _ = cache.lookup(A, f"p{i}", max_error=0.05)
        cache.insert(A, f"e{i}", f"p{i}", "same")
        cache.judge_miss(A, f"p{i}", "same", decision)
        cache.feedback(f"e{i}", correct=True)
        if i >= 10:
            cache.remove(A, [f"e{i - 10}"])  # at most 10 live entries
    assert len(cache._entries) == len(cache._exact) == 10
    assert set(cache.evidence) <= set(cache._entries)
    assert len(cache._clusters) <= 10
    cache.remove(A, [f"e{i}" for i in range(1990, 2000)])
    assert (len(cache._entries), len(cache._exact), len(cache.evidence), len(cache._clusters)) == (0, 0, 0, 0)
    assert cache._index.scopes() == []


def test_answer_clusters_keep_their_members_together_when_one_leaves() -> None:
    from evocache.controller.semantic._cache import _Clusters

    clusters = _Clusters()
    clusters.union("a", "b")
    clusters.union("c", "b")
    clusters.union("d", "e")
    assert clusters.find("a") == clusters.find("c") != clusters.find("d")
    clusters.discard("b")  # the link it carried stays: a and c were judged equal through it
    assert clusters.find("a") == clusters.find("c") and clusters.size(clusters.find("a")) == 2
    clusters.discard("a")
    assert clusters.find("c") == "c" and clusters.size("c") == 1  # alone again: its own cluster
    clusters.union("c", "d")
    assert clusters.find("c") == clusters.find("e") and clusters.size(clusters.find("e")) == 3
    assert len(clusters) == 3


def test_expired_entries_leave_the_embedded_index_and_the_cache(fake_clock) -> None:
    from evocache.controller.semantic import SharedIndex

    index = SharedIndex(clock=fake_clock, sweep_interval=1.0)
    rows = _unit_rows(60, dim=8, seed=5)
    table = {f"p{i}": rows[i] for i in range(60)}
    cache = SemanticCache(TableEmbedder(table), index=index, judge=lambda a, b: True, rng=random.Random(0))
    for i in range(50):  # one scope per user; each entry expires in 5 s
        scope = Scope("t", f"fn|user{i}")
        decision, _ = cache.lookup(scope, f"p{i}", max_error=0.05)
        cache.insert(scope, f"e{i}", f"p{i}", "answer", expires_at=fake_clock() + 5)
        cache.feedback(f"e{i}", correct=False)
    assert len(cache._entries) == len(index) == 50
    fake_clock.advance(6)
    # no search meets them: the next write frees them all, and the cache hears of it
    cache.insert(Scope("t", "fn|late"), "late", "p59", "answer")
    assert len(index) == 1 and index.scopes() == [Scope("t", "fn|late")]
    assert len(index._entries) == 1 and len(index._index._indexes) == 1
    assert list(cache._entries) == ["late"] and list(cache._exact.values()) == ["late"]
    assert cache.evidence == {}
    index.close()


def test_redis_unregisters_a_scope_when_the_sweep_empties_it(redis_url, fake_clock) -> None:
    import redis
    from evocache.controller.semantic import SharedIndex

    index = SharedIndex(
        redis_url, secret=SECRET, follow=False, clock=fake_clock, socket_timeout=1, connect_timeout=1
    )
    client = redis.Redis.from_url(redis_url)
    try:
        row = _unit_rows(1)
        for i in range(40):
            index.add(Scope("t", f"fn|user{i}"), [f"k{i}"], row, expires_at=[fake_clock() + 1])
        index.add(Scope("u", "fn|kept"), ["kept"], row)  # no expiry
        index.add(Scope("v", "fn|removed"), ["gone"], row)
        index.remove(Scope("v", "fn|removed"), ["gone"])  # emptied by a removal: unregistered by the sweep
        assert client.hlen("evc-sem:t:#scopes") == 40
        fake_clock.advance(2)
        assert index.sweep() == 40
        assert client.hlen("evc-sem:t:#scopes") == 0 and client.hlen("evc-sem:v:#scopes") == 0
        assert client.smembers("evc-sem:#ns") == {b"u"}
        assert sorted(k.decode() for k in client.scan_iter("evc-sem:t:*")) == []
        client.config_resetstat()
        index.sweep()
        assert "cmdstat_evalsha" not in client.info("commandstats")  # nothing is due: no scope is visited
        # a scope that comes back registers again, and a new replica loads it
        index.add(Scope("t", "fn|user3"), ["k3"], row)
        other = SharedIndex(
            redis_url, secret=SECRET, follow=False, clock=fake_clock, socket_timeout=1, connect_timeout=1
        )
        assert sorted(other.scopes()) == [Scope("t", "fn|user3"), Scope("u", "fn|kept")]
        other.close()
        index.follow_once(10)  # the sweep's messages: this replica forgets the expired entries too
        assert len(index) == 2 and len(index._index._indexes) == 2 and len(index._entries) == 2
    finally:
        client.close()
        index.close()


# -- F15: concurrent lookups of one prompt ---------------------------------------------------------------


class _Toy:
    name, dim = "toy", 2

    def fits(self, text):  # type: ignore[no-untyped-def]
        return True

    def embed(self, texts):  # type: ignore[no-untyped-def]
        return np.tile(np.array([[1.0, 0.0]], dtype=np.float32), (len(texts), 1))


class _Scripted:
    """A policy whose decisions are given: the first lookup explores, the others are plain misses."""

    mode = "bounded"
    reads_shares = False
    learns = True

    def __init__(self) -> None:
        self.calls = 0
        self.observed: list[tuple[bool, bool, float]] = []

    def decide(self, neighbours, max_error, draw, clusters, scope=None, prompt=None, shares=None):  # type: ignore[no-untyped-def]
        from evocache.controller.semantic._decide import Candidate, SemanticDecision

        self.calls += 1
        explore = self.calls == 1
        est = 0.05 if explore else 0.3
        top = neighbours[0]
        candidate = Candidate(top.entry_id, top.similarity, np.zeros(9))
        return SemanticDecision(False, explore, top.entry_id, top.similarity, 0.1, est), candidate

    def observe(self, candidate, wrong, est_error, *, explored):  # type: ignore[no-untyped-def]
        self.observed.append((wrong, explored, est_error))

    def exact(self, scope, entry_id):  # type: ignore[no-untyped-def]
        from evocache.controller.semantic._decide import SemanticDecision

        return SemanticDecision(True, False, entry_id, 1.0, 0.0, 0.0)

    def prepare(self) -> None:
        pass

    def readings(self, scope=None):  # type: ignore[no-untyped-def]
        from evocache.controller.semantic._decide import Readings

        return Readings(0.0, 1.0)


def test_concurrent_lookups_of_one_prompt_are_judged_each_on_its_own() -> None:
    policy = _Scripted()
    cache = SemanticCache(_Toy(), policy=policy)
    cache.insert(A, "e0", "stored prompt", "A")
    first, _ = cache.lookup(A, "same prompt", max_error=0.02)  # explored
    second, _ = cache.lookup(A, "same prompt", max_error=0.02)  # a plain miss, before the first is judged
    assert (first.explore, second.explore) == (True, False)
    assert first[:6] == (False, True, "e0", first.similarity, 0.1, 0.05)  # the agreed six fields, first
    cache.judge_miss(A, "same prompt", "B", second)  # the second's model answered first
    cache.judge_miss(A, "same prompt", "B", first)
    assert policy.observed == [(True, False, 0.3), (True, True, 0.05)]
    assert cache.stats().explored_wrong == 1
    cache.judge_miss(A, "same prompt", "B", first)  # a verdict per lookup: judging it again does nothing
    cache.judge_miss(B, "same prompt", "B", second)  # nor another scope's name for it
    assert len(policy.observed) == 2 and cache.stats().judge_calls == 2
    assert first.token != second.token


def test_feedback_names_the_lookup_it_is_about() -> None:
    stream, table = synthetic_stream(1, n=1500)
    policy = _Recording()
    cache = SemanticCache(TableEmbedder(table), policy=policy, rng=random.Random(1))
    served = _served_replay(cache, stream)
    entry = max({e for _, _, e in served}, key=[e for _, _, e in served].count)
    mine = [d for _, d, e in served if e == entry]
    assert len(mine) >= 2 and mine[0].est_error != mine[-1].est_error
    before = len(policy.observed)
    cache.feedback(entry, correct=False, decision=mine[0])  # the older lookup, not the latest
    assert policy.observed[-1][2] == mine[0].est_error and len(policy.observed) == before + 1
    cache.feedback(entry, correct=False, decision=mine[0])  # already observed: evidence and counts only
    cache.feedback("e0", correct=False, decision=mine[1])  # a decision that did not serve that entry
    assert len(policy.observed) == before + 1


def test_a_neighbour_removed_before_its_verdict_keeps_no_evidence_or_link() -> None:
    policy = _Scripted()
    # answer_ref_of: any id may be another replica's, so the judge still reads the removed neighbour's answer
    cache = SemanticCache(_Toy(), policy=policy, answer_ref_of=lambda scope, entry_id: "A")
    cache.insert(A, "e0", "stored prompt", "A")
    decision, _ = cache.lookup(A, "new prompt", max_error=0.02)
    cache.remove(A, ["e0"])
    cache.insert(A, "e1", "new prompt", "A")
    cache.judge_miss(A, "new prompt", "A", decision)  # same answer: would link e1 to the removed e0
    assert len(policy.observed) == 1  # the verdict is still an observation of the model
    assert cache.evidence == {} and len(cache._clusters) == 0
    cache.feedback("e0", correct=False)  # counted, but nothing is kept of an entry no longer held
    assert cache.evidence == {} and cache.stats().feedback == 1


def test_a_scope_re_estimates_its_last_window_of_lookups_after_a_refit() -> None:
    from evocache.controller.semantic._decide import ErrorModel

    model = ErrorModel(min_each=1)
    policy = BoundedPolicy(model=model, pacer=PacerOptions(window=4, every=1))
    pace = policy._pace(A)
    rng = np.random.default_rng(0)
    feats = [rng.normal(size=9) for _ in range(4)]
    pace.append(feats[0])
    pace.append(None)
    pace.append(None, exact=True)
    pace.append(feats[1])
    pace.append(feats[2])  # the window is 4: the first lookup has left it
    for i in range(20):
        model.observe(rng.normal(size=9), wrong=i % 2 == 0)
    assert model.fits >= 1 and pace.fit != model.fits
    policy._pace(A)  # the next lookup of the scope re-estimates what it remembers
    assert pace.fit == model.fits
    expected = [math.inf, 0.0, *model.predict(np.asarray(feats[1:3])).tolist()]
    assert pace.pacer._recent[: pace.pacer._n].tolist() == expected


def test_the_sweep_visits_only_scopes_with_an_expiry_due(redis_url, fake_clock) -> None:
    import redis
    from evocache.controller.semantic import SharedIndex
    from evocache.controller.semantic._shared import boundary_digest

    index = SharedIndex(
        redis_url, secret=SECRET, follow=False, clock=fake_clock, socket_timeout=1, connect_timeout=1
    )
    client = redis.Redis.from_url(redis_url)
    try:
        row = _unit_rows(1)
        t0 = fake_clock()
        for i in range(30):  # not due for a long time
            index.add(Scope("t", f"fn|later{i}"), [f"l{i}"], row, expires_at=[t0 + 100])
        scope = Scope("t", "fn|two")
        index.add(scope, ["soon"], row, expires_at=[t0 + 1])
        index.add(scope, ["then"], row, expires_at=[t0 + 5])
        member = f"t:{boundary_digest(scope.boundary)}"
        assert client.zscore("evc-sem:#due", member) == int((t0 + 1) * 1000)
        fake_clock.advance(2)
        client.config_resetstat()
        assert index.sweep() == 1
        assert client.info("commandstats")["cmdstat_evalsha"]["calls"] == 1  # one scope was due, not 31
        assert client.zscore("evc-sem:#due", member) == int((t0 + 5) * 1000)  # its next expiry
        fake_clock.advance(4)
        assert index.sweep() == 1
        assert client.zscore("evc-sem:#due", member) is None
        assert client.hexists("evc-sem:t:#scopes", boundary_digest(scope.boundary)) is False
        assert client.hlen("evc-sem:t:#scopes") == 30
        # a scope registered by a writer that kept no due time (an older version) is still swept: a replica's
        # load marks every registered scope for one check
        client.zrem("evc-sem:#due", f"t:{boundary_digest('fn|later0')}")
        fake_clock.advance(100)
        other = SharedIndex(
            redis_url, secret=SECRET, follow=False, clock=fake_clock, socket_timeout=1, connect_timeout=1
        )
        assert other.sweep() == 30
        assert client.hlen("evc-sem:t:#scopes") == 0 and client.zcard("evc-sem:#due") == 0
        other.close()
    finally:
        client.close()
        index.close()


def test_a_new_scope_serves_once_its_own_verdicts_back_the_model() -> None:
    from evocache.controller.semantic._decide import Pacer

    pacer = Pacer(PacerOptions(every=25, safety=1.0))
    pacer.record(0.004, served=False)
    pacer.record(math.inf, served=False)
    # young: the cut-off follows each lookup (2 lookups, estimates 0.004 and none: 0.002 per lookup <= 0.02)
    assert pacer.cutoff(0.02) == 0.004

    # Through the cache: a scope first seen after the error model was checked on scope A's traffic (a newcomer
    # tenant) earns trust before it is served. Its first would-be hits are explored: the model runs, and each
    # verdict checks the shared model in this scope. Once they agree with it, the scope serves near-duplicates.
    stream, table = synthetic_stream(2, n=1500)
    table = dict(table)
    cache = SemanticCache(TableEmbedder(table), rng=random.Random(2))
    _served_replay(cache, stream)
    fresh = Scope("tenant-c", "fn")
    prompt, group = stream[0]
    cache.insert(fresh, "c0", prompt, group)
    first = None
    decisions = []
    for i in range(40):
        text = f"again{i}"
        table[text] = table[prompt]  # same vector, other text: similarity 1, not exact
        decision, entry = cache.lookup(fresh, text, max_error=0.05)
        first = first or decision
        decisions.append((decision, entry))
        if entry is None or decision.explore:
            cache.judge_miss(fresh, text, group, decision)  # the model answers as c0 did: a right verdict
    assert first.threshold == 0.0  # nothing is known of the scope's lookups yet: nothing to pace
    pacer = cache._policy.pacer_of(fresh)
    assert pacer.newcomer and pacer.explored_here >= cache._policy.trust
    explored = [d.explore for d, _ in decisions]
    served = [i for i, (d, e) in enumerate(decisions) if d.serve and not d.explore and e == "c0"]
    assert served, "a newcomer scope whose verdicts back the model is served in the end"
    assert sum(explored[: served[0]]) >= cache._policy.trust  # ... and only after its trust explorations
