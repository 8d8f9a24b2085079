"""The judge budget: a semantic cache makes at most ``judge_budget`` judge calls per lookup on average, the
candidate's verdict always and the link search with what is left, most similar cluster first."""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import pytest

from evocache.controller.semantic import Scope, SemanticCache
from evocache.controller.semantic._cache import JUDGE_BURST

SCOPE = Scope("tenant-a", "fn@model:rev")


class Vectors:
    """Prompt -> a fixed unit vector; prompts of one topic lie close together, topics apart."""

    name = "test:vectors"

    def __init__(self, topics: int, per_topic: int, dim: int = 32, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        centres = rng.normal(size=(topics, dim))
        self.table = {}
        for t in range(topics):
            for i in range(per_topic):
                v = centres[t] + 0.35 * rng.normal(size=dim)
                self.table[f"t{t} q{i}"] = (v / np.linalg.norm(v)).astype(np.float32)
        self.dim = dim

    def fits(self, text: str) -> bool:
        return True

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        return np.stack([self.table[t] for t in texts])


class CountingJudge:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, new: str, old: str) -> bool:
        self.calls += 1
        return new == old


def replay(budget: float | None, n: int = 600, seed: int = 0) -> tuple[SemanticCache, CountingJudge, int]:
    """``n`` lookups of prompts drawn from 12 topics, each topic with several answers (so neighbours are often
    other answers: the link search has much to judge); a miss is inserted and judged. Also returns how many
    misses had a candidate to judge."""
    vectors = Vectors(topics=12, per_topic=80)
    judge = CountingJudge()
    cache = SemanticCache(vectors, judge=judge, judge_budget=budget, rng=random.Random(seed))
    prompts = list(vectors.table)
    random.Random(seed).shuffle(prompts)
    judged = 0
    for i, prompt in enumerate(prompts[:n]):
        decision, entry = cache.lookup(SCOPE, prompt, max_error=0.05)
        if entry is None:
            answer = f"{prompt.split()[0]}-{i % 5}"
            cache.insert(SCOPE, f"e{i}", prompt, answer)
            cache.judge_miss(SCOPE, prompt, answer, decision)
            judged += decision.neighbour is not None
    return cache, judge, judged


def test_the_judge_calls_per_lookup_stay_within_the_budget_and_every_miss_is_judged() -> None:
    n = 600
    free, free_judge, _ = replay(None, n)
    assert free_judge.calls / n > 3  # unbounded, the link search judges most neighbouring clusters
    assert free.stats().links_unjudged == 0
    for budget in (1.0, 2.0, 2.5):
        cache, judge, judged = replay(budget, n)
        stats = cache.stats()
        assert judge.calls == stats.judge_calls <= budget * n
        # the candidate's verdict is never skipped: every miss with a candidate is an observation
        assert stats.observations == judged > 0
        assert stats.links_unjudged > 0


def test_the_candidates_verdict_is_made_with_no_credit_left_and_links_wait_for_credit() -> None:
    vectors = Vectors(topics=2, per_topic=20)
    judge = CountingJudge()
    cache = SemanticCache(vectors, judge=judge, judge_budget=1.0)
    prompts = [p for p in vectors.table if p.startswith("t0")]
    for i, prompt in enumerate(prompts[:5]):  # five entries of one answer, never linked: five clusters
        cache.insert(SCOPE, f"e{i}", prompt, f"answer {i}")
    decision, _ = cache.lookup(SCOPE, prompts[5], max_error=0.05)  # one lookup: credit for one call
    cache.judge_miss(SCOPE, prompts[5], "answer 0", decision)
    stats = cache.stats()
    assert (stats.observations, stats.judge_calls, stats.links_unjudged) == (1, 1, 1)
    for _ in range(3):  # three lookups of a stored prompt (exact hits) earn three calls
        cache.lookup(SCOPE, prompts[0], max_error=0.05)
    decision, _ = cache.lookup(SCOPE, prompts[6], max_error=0.05)
    cache.judge_miss(SCOPE, prompts[6], "answer 9", decision)
    assert cache.stats().judge_calls == 1 + 1 + 3  # the verdict, then three link tries on the credit


def test_unspent_credit_is_kept_up_to_the_burst() -> None:
    cache = SemanticCache(Vectors(topics=1, per_topic=2), judge=CountingJudge(), judge_budget=2.0)
    cache.insert(SCOPE, "e0", "t0 q0", "a")
    for _ in range(JUDGE_BURST + 500):
        cache.lookup(SCOPE, "t0 q0", max_error=0.05)
    assert cache._judge_credit == {SCOPE: 2.0 * JUDGE_BURST}


def test_one_tenants_unspent_credit_never_pays_for_anothers_link_search() -> None:
    vectors = Vectors(topics=2, per_topic=20)
    judge = CountingJudge()
    cache = SemanticCache(vectors, judge=judge, judge_budget=1.0)
    quiet, busy = SCOPE, Scope("tenant-b", SCOPE.boundary)
    prompts = [p for p in vectors.table if p.startswith("t0")]
    cache.insert(quiet, "q0", prompts[0], "a")
    for _ in range(50):  # the quiet tenant's exact hits earn it 50 calls
        cache.lookup(quiet, prompts[0], max_error=0.05)
    for i, prompt in enumerate(prompts[1:6]):  # the busy tenant: five clusters, never linked
        cache.insert(busy, f"b{i}", prompt, f"answer {i}")
    decision, _ = cache.lookup(busy, prompts[6], max_error=0.05)
    cache.judge_miss(busy, prompts[6], "answer 9", decision)
    stats = cache.stats()
    assert (stats.judge_calls, stats.links_unjudged) == (1, 1)  # its verdict, then no credit of its own


@pytest.mark.parametrize("budget", [0.5, 0, -1, True, float("inf"), float("nan"), "2"])
def test_a_budget_below_one_call_per_lookup_or_not_a_number_is_refused(budget: object) -> None:
    with pytest.raises(ValueError, match="judge_budget must be a number of judge calls per lookup >= 1"):
        SemanticCache(Vectors(topics=1, per_topic=2), judge_budget=budget)  # type: ignore[arg-type]
