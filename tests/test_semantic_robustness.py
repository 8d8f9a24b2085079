"""Semantic caching under many tenants and long runs: budgets per scope, feedback that teaches, bounded state,
concurrent identical prompts (the review's F5, F7, F11, F15)."""

from __future__ import annotations

import random

import numpy as np
from evocache.controller.semantic import Scope
from evocache.controller.semantic._cache import SemanticCache
from evocache.controller.semantic._decide import BoundedPolicy
from test_semantic_decide import TableEmbedder, synthetic_stream

A, B = Scope("tenant-a", "fn"), Scope("tenant-b", "fn")


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
