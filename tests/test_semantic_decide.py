"""The semantic decision: error bound on streams with known ground truth, static mode, exploration, judge links."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import numpy as np
import pytest
from evocache.controller.semantic import Scope
from evocache.controller.semantic._cache import SemanticCache
from evocache.controller.semantic._decide import (
    FEATURES,
    LEXICAL,
    BoundedPolicy,
    Calibration,
    ErrorModel,
    Pacer,
    PacerOptions,
    PolicyOptions,
    SemanticDecision,
    StaticPolicy,
    lexical,
    neighbourhood,
)
from evocache.controller.semantic._index import Neighbour

SCOPE = Scope("tenant-a", "fn@model:rev")


class TableEmbedder:
    """Constructed vectors: prompt text -> a fixed unit vector."""

    name = "test:table"

    def __init__(self, table: dict[str, np.ndarray]) -> None:
        self.table = table
        self.dim = len(next(iter(table.values())))
        self.calls = 0

    def fits(self, text: str) -> bool:
        return True

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        self.calls += 1
        return np.asarray([self.table[t] for t in texts], dtype=np.float32)


def _unit(v: np.ndarray) -> np.ndarray:
    return (v / np.linalg.norm(v)).astype(np.float32)


def synthetic_stream(seed: int, n: int = 3000, groups: int = 40, dim: int = 24) -> tuple[list[tuple[str, str]], dict]:
    """Prompts around group centres; pairs of groups share a nearby centre, so a neighbour can be close and
    still wrong: the ground truth (group) is known, the cache sees it only through the judge."""
    rng = np.random.default_rng(seed)
    bases = rng.normal(size=(groups // 2, dim))
    centres = []
    for b in bases:  # two groups per base: confusable
        centres.append(_unit(b + 0.35 * rng.normal(size=dim)))
        centres.append(_unit(b + 0.35 * rng.normal(size=dim)))
    weights = rng.dirichlet(np.ones(groups))
    stream, table = [], {}
    for i in range(n):
        g = int(rng.choice(groups, p=weights))
        prompt = f"q{i}"
        table[prompt] = _unit(centres[g] + rng.normal(scale=0.09, size=dim))
        stream.append((prompt, f"g{g}"))
    return stream, table


def replay(cache: SemanticCache, stream: list[tuple[str, str]], delta: float) -> tuple[int, int, list]:
    hits = wrong = 0
    decisions = []
    for i, (prompt, group) in enumerate(stream):
        decision, entry = cache.lookup(SCOPE, prompt, max_error=delta)
        decisions.append(decision)
        if entry is not None:
            hits += 1
            wrong += cache.answer_ref(entry) != group
            continue
        cache.insert(SCOPE, f"e{i}", prompt, group)
        cache.judge_miss(SCOPE, prompt, group, decision)
    return hits, wrong, decisions


@pytest.mark.parametrize(("delta", "seed"), [(0.02, 0), (0.02, 1), (0.05, 2), (0.01, 3)])
def test_error_bound_holds_on_a_synthetic_stream_with_known_ground_truth(delta: float, seed: int) -> None:
    stream, table = synthetic_stream(seed)
    cache = SemanticCache(TableEmbedder(table), rng=random.Random(seed))
    hits, wrong, decisions = replay(cache, stream, delta)
    n = len(stream)
    assert wrong / n <= delta
    # ...and it is not met by serving nothing: most queries find their group cached and many are served
    assert hits / n >= 0.3
    served = [d for d in decisions if d.serve]
    assert all(d.est_error <= d.threshold for d in served)
    stats = cache.stats()
    assert stats.served == hits and stats.lookups == n
    assert stats.judge_calls >= n - hits - 1  # every miss with a neighbour was judged


def test_static_mode_serves_exactly_at_or_above_the_threshold() -> None:
    e0 = np.zeros(4, dtype=np.float32)
    e0[0] = 1
    table = {"stored": e0}
    # similarities exactly representable in float32, so "at" is exactly at the threshold
    for name, sim in (("at", 0.75), ("above", 0.875), ("below", 0.7499)):
        table[name] = np.array([sim, math.sqrt(1 - sim * sim), 0, 0], dtype=np.float32)
    cache = SemanticCache(TableEmbedder(table), policy=StaticPolicy(threshold=0.75))
    empty, entry = cache.lookup(SCOPE, "stored", max_error=0.02)
    assert (empty.serve, empty.explore, empty.neighbour, empty.threshold, entry) == (False, False, None, 0.75, None)
    cache.insert(SCOPE, "s", "stored", "answer")
    results = {}
    for name in ("at", "above", "below"):
        decision, entry = cache.lookup(SCOPE, name, max_error=0.02)
        results[name] = (decision.serve, decision.explore, decision.neighbour, round(decision.similarity, 4),
                         decision.threshold, entry)
        assert math.isnan(decision.est_error)  # static mode estimates nothing
    assert results == {
        "at": (True, False, "s", 0.75, 0.75, "s"),
        "above": (True, False, "s", 0.875, 0.75, "s"),
        "below": (False, False, "s", 0.7499, 0.75, None),
    }
    assert cache.stats().judge_calls == 0


def test_exact_match_is_served_first_without_embedding() -> None:
    stream, table = synthetic_stream(0, n=10)
    embedder = TableEmbedder(table)
    cache = SemanticCache(embedder)
    cache.insert(SCOPE, "e0", "q0", "g")
    calls = embedder.calls
    decision, entry = cache.lookup(SCOPE, "q0", max_error=0.02)
    assert (decision.serve, decision.neighbour, decision.similarity, decision.est_error, entry) == (
        True, "e0", 1.0, 0.0, "e0"
    )
    assert embedder.calls == calls
    assert cache.stats().exact_hits == 1


def test_no_entry_of_another_tenant_or_boundary_is_ever_served() -> None:
    stream, table = synthetic_stream(0, n=400)
    cache = SemanticCache(TableEmbedder(table), policy=StaticPolicy(threshold=0.01))
    other_tenant, other_model = Scope("tenant-b", SCOPE.boundary), Scope(SCOPE.namespace, "fn@model:rev2")
    for i, (prompt, group) in enumerate(stream[:200]):
        cache.insert(SCOPE, f"a{i}", prompt, group)
    for scope in (other_tenant, other_model):
        for prompt, _ in stream[:200]:  # identical prompts: no exact hit across scopes either
            decision, entry = cache.lookup(scope, prompt, max_error=0.02)
            assert (decision.serve, decision.neighbour, entry) == (False, None, None)
    decision, entry = cache.lookup(SCOPE, stream[300][0], max_error=0.02)
    assert entry is not None and entry.startswith("a")


def test_exploration_fraction_follows_the_seeded_draws() -> None:
    stream, table = synthetic_stream(5, n=2500)
    explore, (first, first_chance) = 0.2, (30, 0.5)
    policy = BoundedPolicy(explore=explore, explore_first=(first, first_chance))
    cache = SemanticCache(TableEmbedder(table), policy=policy, rng=random.Random(11))
    _, _, decisions = replay(cache, stream, 0.05)
    draws = random.Random(11)
    would = explored = later = later_explored = 0
    for decision in decisions:
        draw = draws.random()  # one draw per lookup that searched (no exact hits in this stream)
        if decision.serve or decision.explore:
            # the scope's first `first` explorations at `first_chance`, then `explore`
            chance = first_chance if explored < first else explore
            assert decision.explore == (draw < chance)
            would += 1
            explored += decision.explore
            if chance == explore:
                later += 1
                later_explored += decision.explore
        assert not (decision.serve and decision.explore)
    assert later > 500 and explored > first
    assert explored == cache.stats().explored
    assert abs(later_explored / later - explore) < 3 * math.sqrt(explore * (1 - explore) / later)


@pytest.mark.parametrize("stream_seed", [0, 1, 2])
@pytest.mark.parametrize("rng_seed", [100, 101, 102])
def test_error_bound_holds_whatever_the_exploration_draws(stream_seed: int, rng_seed: int) -> None:
    # The exploration coin is seeded apart from the stream: the bound must not rest on lucky draws.
    stream, table = synthetic_stream(stream_seed)
    cache = SemanticCache(TableEmbedder(table), rng=random.Random(rng_seed))
    hits, wrong, _ = replay(cache, stream, 0.02)
    assert wrong / len(stream) <= 0.02
    assert hits / len(stream) >= 0.3


def test_a_new_scope_explores_its_first_would_be_hits_more() -> None:
    policy = BoundedPolicy(explore=0.05, explore_first=(2, 0.5))
    assert policy.explore_chance(0) == policy.explore_chance(1) == 0.5
    assert policy.explore_chance(2) == 0.05
    assert BoundedPolicy(explore=0.0).explore_chance(0) == 0.0  # no exploration asked: none at all
    with pytest.raises(ValueError, match=r"explore_first must be \(count >= 0, fraction in \[0, 1\)\)"):
        BoundedPolicy(explore_first=(10, 1.0))


def test_the_model_loads_what_it_fits_with_outside_the_cache_lock() -> None:
    import threading

    seen: list[bool] = []

    class Watching(BoundedPolicy):
        def prepare(self) -> None:
            free: list[bool] = []

            def try_lock() -> None:  # from another thread: the lock is free unless some thread holds it
                free.append(cache._lock.acquire(timeout=0))
                if free[0]:
                    cache._lock.release()

            probe = threading.Thread(target=try_lock)
            probe.start()
            probe.join()
            seen.append(free[0])
            super().prepare()

    stream, table = synthetic_stream(0, n=50)
    cache = SemanticCache(TableEmbedder(table), policy=Watching())
    replay(cache, stream, 0.02)
    verdicts = cache.stats().observations  # one per judged lookup: each prepared first
    cache.feedback("e0", correct=False)
    assert verdicts > 10 and len(seen) == verdicts + 1
    assert all(seen)  # never with the lock held


def test_answer_clusters_come_only_from_the_judge() -> None:
    # Every prompt has the same label, but the judge says no two answers are equal: nothing gets linked.
    stream, table = synthetic_stream(0, n=300)
    never = SemanticCache(TableEmbedder(table), judge=lambda new, old: False)
    same_label = [(p, "one-answer") for p, _ in stream]
    replay(never, same_label, 0.02)
    roots = {never.cluster_of(f"e{i}") for i in range(len(stream)) if f"e{i}" in never._entries}
    assert len(roots) == len(never._entries)
    assert never.stats().served == 0  # no verdict ever said right: nothing can be served
    # Labels all differ, but the judge says everything is equal: entries get linked anyway.
    always = SemanticCache(TableEmbedder(table), judge=lambda new, old: True, policy=BoundedPolicy(explore=0.0))
    distinct = [(p, f"label{i}") for i, (p, _) in enumerate(stream)]
    replay(always, distinct, 0.02)
    entries = list(always._entries)
    assert len({always.cluster_of(e) for e in entries}) == 1


def test_judge_before_insert_links_on_insert() -> None:
    e = np.eye(4, dtype=np.float32)
    table = {"a": e[0], "b": _unit(e[0] + 0.1 * e[1])}
    cache = SemanticCache(TableEmbedder(table), judge=lambda new, old: new == old)
    cache.insert(SCOPE, "ea", "a", "answer")
    decision, entry = cache.lookup(SCOPE, "b", max_error=0.02)  # the model knows nothing yet: a miss
    assert (entry, decision.neighbour, decision.est_error) == (None, "ea", 1.0)
    cache.judge_miss(SCOPE, "b", "answer", decision)
    cache.insert(SCOPE, "eb", "b", "answer")
    assert cache.cluster_of("eb") == cache.cluster_of("ea")
    assert cache.evidence["ea"] == (0, 1)
    assert cache.stats().judge_calls == 1


def _fragments() -> tuple[SemanticCache, SemanticCache, SemanticDecision]:
    """Two caches holding "x" (cluster of ex1) and "y" (cluster of ey) that the judge has not linked, though
    both answers are "answer"; a lookup of "z" near both, not served (nothing learnt yet)."""
    e = np.eye(4, dtype=np.float32)
    table = {"x": e[0], "y": _unit(e[0] + 0.3 * e[1]), "w": _unit(e[0] + 0.2 * e[2]),
             "z": _unit(e[0] + 0.1 * e[1])}
    caches = []
    for merge in (True, False):
        cache = SemanticCache(TableEmbedder(table), judge=lambda new, old: new == old, merge=merge)
        for entry, prompt, answer in (("ex", "x", "answer"), ("ey", "y", "answer"), ("ew", "w", "other")):
            cache.insert(SCOPE, entry, prompt, answer)
        caches.append(cache)
    decision, entry = caches[0].lookup(SCOPE, "z", max_error=0.02)
    assert entry is None and decision.neighbour == "ex"
    return caches[0], caches[1], decision


def test_a_judged_miss_merges_every_neighbouring_cluster_with_its_answer() -> None:
    merging, first_only, _ = _fragments()
    for cache in (merging, first_only):
        decision, _ = cache.lookup(SCOPE, "z", max_error=0.02)
        cache.judge_miss(SCOPE, "z", "answer", decision)
        cache.insert(SCOPE, "ez", "z", "answer")
    # With merge (the default), the new entry joins the candidate's cluster and the other one with its
    # answer: two fragments of one answer become one; "w" (another answer) stays apart.
    assert merging.cluster_of("ez") == merging.cluster_of("ex") == merging.cluster_of("ey")
    assert merging.cluster_of("ew") != merging.cluster_of("ex")
    # The candidate; ey, then ey against the candidate's answer (a second cluster joins only if the two answers
    # are equal too); ew (another answer).
    assert merging.stats().judge_calls == 4
    # Without, the candidate's verdict was "same" and no other cluster is judged.
    assert first_only.cluster_of("ez") == first_only.cluster_of("ex") != first_only.cluster_of("ey")
    assert first_only.stats().judge_calls == 1


def test_link_tries_bounds_the_clusters_judged_for_a_link() -> None:
    e = np.eye(4, dtype=np.float32)
    table = {"x": e[0], "y": _unit(e[0] + 0.3 * e[1]), "w": _unit(e[0] + 0.2 * e[2]), "z": _unit(e[0] + 0.1 * e[1])}
    cache = SemanticCache(TableEmbedder(table), judge=lambda new, old: new == old, link_tries=1)
    for entry, prompt, answer in (("ex", "x", "other"), ("ew", "w", "third"), ("ey", "y", "answer")):
        cache.insert(SCOPE, entry, prompt, answer)
    decision, _ = cache.lookup(SCOPE, "z", max_error=0.02)
    cache.judge_miss(SCOPE, "z", "answer", decision)  # ex differs; one more cluster may be judged
    cache.insert(SCOPE, "ez", "z", "answer")
    assert cache.stats().judge_calls == 2
    with pytest.raises(ValueError, match="link_tries must be an int >= 0 or None, got -1"):
        SemanticCache(TableEmbedder(table), link_tries=-1)


def _near_table() -> dict[str, np.ndarray]:
    e = np.eye(4, dtype=np.float32)
    return {"a": e[0], "b": _unit(e[0] + 0.5 * e[1]), "p": _unit(e[0] + 0.2 * e[1]), "q": _unit(e[0] + 0.25 * e[1])}


def test_links_judged_for_an_answer_that_is_not_stored_are_never_applied() -> None:
    cache = SemanticCache(TableEmbedder(_near_table()), judge=lambda new, old: new == old)
    cache.insert(SCOPE, "ea", "a", "old answer")
    cache.insert(SCOPE, "eb", "b", "new answer")
    decision, _ = cache.lookup(SCOPE, "p", max_error=0.05)
    cache.judge_miss(SCOPE, "p", "old answer", decision, link=False)  # the owner did not store this answer
    assert cache.stats().observations == 1 and not cache._links  # a verdict, no link kept
    decision, _ = cache.lookup(SCOPE, "p", max_error=0.05)
    cache.judge_miss(SCOPE, "p", "old answer", decision)  # judged before its insert: kept for that answer
    cache.insert(SCOPE, "ep", "p", "new answer")  # ... but another answer is what gets stored
    assert cache.cluster_of("ep") != cache.cluster_of("ea")
    assert cache.cluster_of("ea") != cache.cluster_of("eb")


def test_a_failing_link_judge_keeps_the_candidates_verdict() -> None:
    calls: list[str] = []

    def judge(new: str, old: str) -> bool:
        calls.append(old)
        if len(calls) > 1:
            raise TimeoutError("judge model timed out")  # the link comparisons fail, the candidate's did not
        return new == old

    cache = SemanticCache(TableEmbedder(_near_table()), judge=judge)
    cache.insert(SCOPE, "ea", "a", "wrong")
    cache.insert(SCOPE, "eb", "b", "other")
    decision, _ = cache.lookup(SCOPE, "p", max_error=0.05)
    cache.judge_miss(SCOPE, "p", "right", decision)  # no exception: the verdict stands
    stats = cache.stats()
    assert (stats.observations, stats.link_errors, cache.evidence["ea"]) == (1, 1, (1, 0))
    assert len(calls) == 2


def test_a_judge_that_is_not_transitive_does_not_merge_two_answers() -> None:
    # "reset or change" shares a word with both "reset" and "change": the lenient judge calls it equal to each,
    # but not those two to each other, so the two clusters stay apart (the new entry joins the first).
    def lenient(new: str, old: str) -> bool:
        return bool(set(new.split()) & set(old.split()))

    cache = SemanticCache(TableEmbedder(_near_table()), judge=lenient, judge_budget=None)
    cache.insert(SCOPE, "ea", "a", "reset")
    cache.insert(SCOPE, "eb", "b", "change")
    decision, _ = cache.lookup(SCOPE, "p", max_error=0.05)
    cache.insert(SCOPE, "ep", "p", "reset or change")
    cache.judge_miss(SCOPE, "p", "reset or change", decision)
    assert cache.cluster_of("ep") == cache.cluster_of("ea") != cache.cluster_of("eb")
    assert cache.stats().judge_calls == 3  # ea, eb, then eb against ea's answer


def test_a_link_judged_before_insert_never_crosses_scopes() -> None:
    other = Scope("tenant-b", SCOPE.boundary)
    table = _near_table()
    cache = SemanticCache(TableEmbedder(table), judge=lambda new, old: new == old)
    cache.insert(SCOPE, "e1", "a", "answer")
    decision, _ = cache.lookup(SCOPE, "p", max_error=0.05)
    cache.judge_miss(SCOPE, "p", "answer", decision)  # a link p -> e1, kept until p's entry is inserted
    cache.remove(SCOPE, ["e1"])
    cache.insert(other, "e1", "b", "answer")  # the id now names another tenant's entry
    cache.insert(SCOPE, "ep", "p", "answer")
    assert cache.cluster_of("ep") != cache.cluster_of("e1")


def test_a_removal_racing_an_insert_leaves_no_entry_behind() -> None:
    from evocache.controller.semantic._index import SemanticIndex

    class Racy(SemanticIndex):  # another thread's removal lands between the index's add and the cache's record
        def add(self, scope, ids, vecs, **kwargs):  # type: ignore[no-untyped-def]
            super().add(scope, ids, vecs, **kwargs)
            cache.remove(scope, ids)

    cache = SemanticCache(TableEmbedder(_near_table()), index=Racy())
    cache.insert(SCOPE, "ea", "a", "answer")
    assert "ea" not in cache._entries
    assert cache.lookup(SCOPE, "a", max_error=0.05)[1] is None


def test_feedback_counts_against_the_entry() -> None:
    cache = SemanticCache(TableEmbedder({"a": np.eye(3, dtype=np.float32)[0]}))
    cache.insert(SCOPE, "ea", "a", "x")
    cache.feedback("ea", correct=False)
    cache.feedback("ea", correct=True)
    cache.feedback("unknown", correct=False)
    stats = cache.stats()
    assert (cache.evidence["ea"], stats.feedback, stats.feedback_wrong, stats.realised_error) == ((1, 1), 2, 1, 0.5)


@pytest.mark.parametrize("bad", [0.0, 0.51, -0.1, math.nan])
def test_max_error_out_of_range_is_refused(bad: float) -> None:
    cache = SemanticCache(TableEmbedder({"a": np.eye(3, dtype=np.float32)[0]}))
    with pytest.raises(ValueError, match="max_error must be in"):
        cache.lookup(SCOPE, "a", max_error=bad)


def test_bad_construction_and_input_name_what_is_wrong() -> None:
    embedder = TableEmbedder({"a": np.eye(3, dtype=np.float32)[0]})
    with pytest.raises(ValueError, match="k must be a positive int, got 0"):
        SemanticCache(embedder, k=0)
    with pytest.raises(TypeError, match="'mode'"):
        SemanticCache(embedder, mode="static")  # type: ignore[call-arg]  # a policy is given as one: policy=
    cache = SemanticCache(embedder)
    with pytest.raises(TypeError, match="prompt must be a str"):
        cache.lookup(SCOPE, b"a", max_error=0.02)  # type: ignore[arg-type]
    cache.insert(SCOPE, "ea", "a", "x")
    with pytest.raises(ValueError, match="already belongs to another scope"):
        cache.insert(Scope("tenant-b", "x"), "ea", "a", "x")


def test_neighbourhood_votes_by_cluster_and_measures_the_margin() -> None:
    clusters = {"a1": "A", "a2": "A", "b1": "B"}
    neighbours = [Neighbour("b1", 0.90), Neighbour("a1", 0.895), Neighbour("a2", 0.89)]
    candidate = neighbourhood(neighbours, clusters.__getitem__, {"A": 2, "B": 1}.__getitem__, {"a1": (0, 3)})
    assert candidate is not None
    features = dict(zip(FEATURES, candidate.features.tolist(), strict=True))
    # A's two entries (weights e^-0.25 + e^-0.5) outvote B's single nearer one (1); A is served through its
    # nearest entry
    assert (candidate.entry_id, candidate.similarity) == ("a1", 0.895)
    assert features["gap_to_top"] == pytest.approx(0.005)
    assert features["margin"] == pytest.approx(0.0)  # the rival (0.90) is nearer than the candidate
    assert features["share_of_k"] == pytest.approx(2 / 3)
    assert features["entry_right"] == pytest.approx(math.log1p(3))
    assert neighbourhood([], clusters.__getitem__, len) is None


@pytest.mark.parametrize(
    ("query", "stored", "expected"),
    [
        # a negation trap: "don't" is "do not", two words inserted, one of them ("not") a content word
        ("Don't cancel my subscription", "Cancel my subscription",
         {"token_jaccard": 0.6, "word_edits": 2, "content_edits": 1, "typo_edits": 0, "minimal_pair": 1,
          "numbers_differ": 0, "negation_differs": 1, "reordered": 0, "names_differ": 0}),
        # typos only: a near-repeat, no whole-word edit (a swap of two letters is one typo)
        ("How do I chnage the email adress on my acount?", "How do I change the email address on my account?",
         {"token_jaccard": 7 / 13, "word_edits": 0, "content_edits": 0, "typo_edits": 3, "minimal_pair": 0,
          "numbers_differ": 0, "negation_differs": 0, "reordered": 0, "names_differ": 0}),
        # function words changed only: the same request
        ("How can I top up the card?", "How do I top up my card?",
         {"token_jaccard": 5 / 9, "word_edits": 2, "content_edits": 0, "typo_edits": 0, "minimal_pair": 0,
          "numbers_differ": 0, "negation_differs": 0, "reordered": 0, "names_differ": 0}),
        # a number changed (never a typo); the same words in another order, names swapped
        ("Who won the World Cup in 2014?", "Who won the World Cup in 2018?",
         {"token_jaccard": 6 / 8, "word_edits": 1, "content_edits": 1, "typo_edits": 0, "minimal_pair": 1,
          "numbers_differ": 1, "negation_differs": 0, "reordered": 0, "names_differ": 0}),
        ("from MySQL to Postgres", "from Postgres to MySQL",
         {"token_jaccard": 1.0, "word_edits": 4, "content_edits": 2, "typo_edits": 0, "minimal_pair": 1,
          "numbers_differ": 0, "negation_differs": 0, "reordered": 1, "names_differ": 1}),
    ],
)
def test_lexical_features_tell_a_minimal_pair_from_typos_and_rewording(
    query: str, stored: str, expected: dict[str, float]
) -> None:
    got = dict(zip(LEXICAL, lexical(query, stored), strict=True))
    assert got.pop("prompt_known") == 1.0
    counts = ("word_edits", "content_edits", "typo_edits")
    assert {k: round(math.expm1(v)) if k in counts else v for k, v in got.items()} == pytest.approx(expected)
    assert lexical(query, None) == lexical(None, stored) == (0.0,) * len(LEXICAL)  # an entry without its prompt


def test_the_error_model_reads_the_candidates_stored_prompt() -> None:
    e = np.eye(4, dtype=np.float32)
    table = {"Cancel my subscription": e[0], "Don't cancel my subscription": _unit(e[0] + 0.05 * e[1])}
    cache = SemanticCache(TableEmbedder(table))
    cache.insert(SCOPE, "a", "Cancel my subscription", "x")
    assert cache.prompt_of("a") == cache.prompt_of("a", SCOPE) == "Cancel my subscription"
    assert cache.prompt_of("a", Scope("tenant-b", SCOPE.boundary)) is None  # never across scopes
    decision, _ = cache.lookup(SCOPE, "Don't cancel my subscription", max_error=0.02)
    pending = cache._pending[decision.token]
    assert pending.candidate is not None
    features = dict(zip(FEATURES, pending.candidate.features.tolist(), strict=True))
    assert (features["prompt_known"], features["minimal_pair"], features["negation_differs"]) == (1.0, 1.0, 1.0)


def test_error_model_knows_nothing_until_it_has_seen_both_outcomes() -> None:
    model = ErrorModel(min_each=3)
    x = np.zeros(len(FEATURES))
    for _ in range(10):
        model.observe(x, wrong=False)
    assert not model.ready and model.predict(x).tolist() == [1.0]
    for i in range(3):
        model.observe(x + i, wrong=True)
    assert model.ready
    assert 0 < model.predict(x)[0] < model.predict(x + 2)[0] < 1


def test_a_heavy_verdict_brings_the_refit_nearer() -> None:
    model = ErrorModel(min_each=3, refit_every=50, refit_growth=1.0)
    x = np.zeros(len(FEATURES))
    for i in range(6):
        model.observe(x + i, wrong=i % 2 == 0)
    assert model.fits == 1  # first fit as soon as both outcomes were seen 3 times
    # next refit after observations weighing as much as those fitted (6): one explored verdict at 1/20 does it
    assert model.observe(x + 1, wrong=True, weight=20.0) and model.fits == 2
    for _ in range(6):  # now 7 fitted: six plain verdicts weigh 6, one short
        assert not model.observe(x, wrong=False)
    assert model.observe(x, wrong=False) and model.fits == 3


def test_pacer_serves_the_lowest_estimates_first_within_the_budget() -> None:
    estimates = (0.01, 0.02, 0.03, 0.5, 0.5, math.inf, 0.0, 0.04, 0.045, 0.3)
    calibrated = Calibration(prior=1e9)  # a prior this strong reads ratio 1: the budget is the estimates'
    pacer = Pacer(PacerOptions(window=10, safety=1.0, every=1), calibration=calibrated)
    for p in estimates:
        pacer.record(p, served=False)
    # Budget 0.01 per lookup. Nothing spent in 10 lookups: the saving lets the next window spend 1.5 times the
    # rate, 0.15 in all. Lowest first: 0 + .01 + .02 + .03 + .04 + .045 = 0.145 fits; adding 0.3 does not.
    assert pacer.cutoff(0.01) == 0.045
    spender = Pacer(PacerOptions(window=10, safety=1.0, every=1), calibration=calibrated)
    for p in estimates:
        spender.record(p, served=math.isfinite(p))
    # 1.445 expected wrong answers served against a budget of 0.1: the debt closes the tap.
    assert spender.cutoff(0.01) == 0.0


class _FixedModel:
    """An error model that is ready and estimates every candidate at ``est``; learns nothing."""

    ready, fits = True, 1

    def __init__(self, est: float) -> None:
        self.est = est

    def __len__(self) -> int:
        return 1

    def predict(self, features: np.ndarray) -> np.ndarray:
        return np.full(len(np.atleast_2d(features)), self.est)

    def prepare(self) -> None:
        pass

    def observe(self, features: np.ndarray, wrong: bool, weight: float) -> None:
        pass


@pytest.mark.parametrize(("cap", "est", "served"), [(5.0, 0.09, True), (5.0, 0.11, False), (None, 0.11, True)])
def test_no_answer_is_served_whose_own_estimate_passes_the_item_cap(
    cap: float | None, est: float, served: bool
) -> None:
    e = np.eye(4, dtype=np.float32)
    table = {f"x{i}": e[0] for i in range(40)} | {"a": e[1], "p": _unit(e[1] + 0.3 * e[3]),
                                                   "q": _unit(e[1] + 0.2 * e[2])}
    policy = BoundedPolicy(model=_FixedModel(est), explore=0.0, explore_first=(0, 0.0), item_cap=cap,
                           pacer=PacerOptions(every=1))
    cache = SemanticCache(TableEmbedder(table), policy=policy)
    for i in range(40):  # lookups with no candidate spend nothing: the pacer's budget is then ample
        cache.lookup(SCOPE, f"x{i}", max_error=0.02)
    cache.insert(SCOPE, "ea", "a", "answer")
    assert cache.lookup(SCOPE, "p", max_error=0.02)[1] is None  # no estimate seen yet: the cut-off is 0
    # One estimate of `est` among 41 lookups costs est / 41 per lookup, within 0.9 x 0.02: the pacer alone
    # would serve the next lookup at that estimate.
    decision, entry = cache.lookup(SCOPE, "q", max_error=0.02)
    assert (entry == "ea") is served and decision.serve is served
    assert decision.est_error == est
    if cap is not None:  # the decision explains the cut-off it applied
        assert decision.threshold <= cap * 0.02
    for bad in (0, -1.0, True, "5"):
        with pytest.raises(ValueError, match=f"item_cap must be a number > 0 or None, got {bad!r}"):
            BoundedPolicy(item_cap=bad)  # type: ignore[arg-type]


def _checked_elsewhere() -> Calibration:
    """A shared calibration after 2,000 explored verdicts of a calibrated model (100 wrong at 0.05 each)."""
    shared = Calibration()
    for i in range(2000):
        shared.explored(0.05, wrong=i % 20 == 0)
    assert shared.bounded and shared.value < 1.5
    return shared


def test_a_scope_whose_explorations_refute_the_shared_calibration_uses_its_own() -> None:
    from evocache.controller.semantic._decide import calibration_upper

    shared = _checked_elsewhere()  # elsewhere the model is calibrated: 100 wrong where it expected 100
    here, new = Pacer(calibration=shared), Pacer(calibration=shared)
    assert here.calibration == new.calibration == shared.value
    here.scope_explored(0.002, wrong=False)
    assert here.calibration == shared.value  # no wrong answer here: nothing refutes the shared value
    for _ in range(3):  # here the model said 0.2 % and was wrong three times in four
        shared.explored(0.002, wrong=True)
        here.scope_explored(0.002, wrong=True)
    own = calibration_upper(3, 0.008, prior=0.1, confidence=0.975)
    assert own > 30 * shared.value
    assert here.calibration == pytest.approx(own)
    assert new.calibration == shared.value  # a scope without evidence of its own is not held back
    # a wrong answer where the shared value expected some is no refutation
    calm = Pacer(calibration=shared)
    calm.scope_explored(0.3, wrong=True)
    assert calm.calibration == shared.value


def test_real_model_end_to_end_on_a_small_stream() -> None:
    import json
    from pathlib import Path

    from evocache.controller.semantic import SentenceTransformerEmbedder

    path = Path(__file__).resolve().parent.parent / "examples" / "data" / "banking77_train.jsonl"
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for _, line in zip(range(80), f, strict=False)]
    stream = [(r["prompt"], r["group"]) for r in rows]
    cache = SemanticCache(SentenceTransformerEmbedder(), rng=random.Random(0))
    hits, wrong, decisions = replay(cache, stream, 0.05)
    assert wrong / len(stream) <= 0.05
    assert cache.stats().judge_calls > 0 and cache.stats().observations > 0
    # the real embedder's vectors: a prompt asked again is an exact hit, a paraphrase finds its neighbour
    again, entry = cache.lookup(SCOPE, stream[0][0], max_error=0.05)
    assert (again.serve, again.similarity, entry) == (True, 1.0, "e0")
    decision, _ = cache.lookup(SCOPE, stream[0][0] + "?!", max_error=0.05)
    assert decision.neighbour == "e0" and decision.similarity > 0.9


def test_the_decision_explains_itself_with_the_agreed_fields() -> None:
    stream, table = synthetic_stream(0, n=5)
    cache = SemanticCache(TableEmbedder(table))
    cache.insert(SCOPE, "e0", "q0", "g")
    decision, _ = cache.lookup(SCOPE, "q1", max_error=0.02)
    assert isinstance(decision, SemanticDecision)
    assert list(decision._asdict())[:6] == ["serve", "explore", "neighbour", "similarity", "threshold", "est_error"]
    assert (decision.neighbour, decision.est_error) == ("e0", 1.0)  # the model has seen nothing yet


def test_a_newcomer_scope_earns_trust_before_the_shared_model_serves_it() -> None:
    from evocache.controller.semantic._decide import calibration_upper

    shared = _checked_elsewhere()  # the model was checked on other scopes' traffic: calibrated there
    founder, newcomer = Pacer(calibration=shared), Pacer(calibration=shared, newcomer=True)
    assert not founder.newcomer and newcomer.newcomer
    # Without a verdict of its own, a newcomer reads its prior alone, not the shared sample's ratio.
    assert founder.calibration == shared.value
    assert newcomer.calibration == pytest.approx(calibration_upper(0, 0.0, prior=2.0, confidence=0.975))
    assert newcomer.calibration > 1.5 * shared.value
    # Its own verdicts move it (one wrong where the model expected 0.5: the upper bound rises).
    before = newcomer.calibration
    newcomer.scope_explored(0.5, wrong=True)
    assert newcomer.calibration == pytest.approx(calibration_upper(1, 0.5, prior=2.0, confidence=0.975))
    assert newcomer.calibration > before and founder.calibration == shared.value
    # Equal estimates (the model's floor): the budget affords 2 of the 4, so a newcomer serves none of them
    # (a cut-off serves all of a run or none), while a founder's cut-off admits the run.
    for pacer in (founder, newcomer):
        for p in (0.002, 0.002, 0.002, 0.002, math.inf, math.inf, math.inf, math.inf):
            pacer.record(p, served=False)
    founder._calibration = newcomer._calibration = Calibration(prior=1e9)  # ratio 1 for both, to compare
    newcomer._own = None
    budget_two = 2 * 0.002 / 8 / 1.5  # the saving allows 1.5 times the rate: two estimates of 0.002 in 8
    assert founder.cutoff(budget_two / 0.9) == 0.002
    assert newcomer.cutoff(budget_two / 0.9) == 0.0


def test_a_refuted_newcomer_counts_each_hit_at_its_own_wrong_rate() -> None:
    from scipy.stats import beta

    shared = _checked_elsewhere()
    newcomer, founder = Pacer(calibration=shared, newcomer=True), Pacer(calibration=shared)
    for pacer in (newcomer, founder):
        assert pacer.floor == 0.0
        for wrong in (True, False, True, False):  # the model said 0.2 % and was wrong one time in two
            pacer.scope_explored(0.002, wrong=wrong)
        assert pacer.refuted
        assert pacer.floor == 0.0  # 4 verdicts: too few to price a hit by (``trust``, 10)
        for wrong in (True, False, True, False, True, False):
            pacer.scope_explored(0.002, wrong=wrong)
    assert newcomer.floor == pytest.approx(beta.ppf(0.975, 5.5, 5.5))
    # A mild refutation (2 wrong of 11 where about 0.3 were expected) tightens the calibration, not the floor.
    mild = Pacer(calibration=shared, newcomer=True)
    for i in range(11):
        mild.scope_explored(0.018, wrong=i < 2)
    assert mild.refuted and 0.01 <= mild._tail() < 0.1
    assert mild.floor == 0.0
    assert founder.floor == 0.0  # a founding scope keeps the calibrated estimates
    for p in (0.002,) * 10 + (math.inf,) * 90:
        newcomer.record(p, served=False)
    # Ten candidates at 0.002: calibrated alone they would fit 0.02 x 0.9 per lookup; at the floor
    # (about 0.85 each) not one of them does.
    assert newcomer.calibration * 0.002 * 10 / 100 < 0.018
    assert newcomer.cutoff(0.02) == 0.0


def test_a_newcomer_explores_its_first_would_be_hits_whatever_the_draw() -> None:
    stream, table = synthetic_stream(2, n=1500)
    cache = SemanticCache(TableEmbedder(table), rng=random.Random(2))
    replay(cache, stream[:1200], 0.05)
    policy = cache._policy
    assert policy.explorations >= policy.explore_first[0]  # the model was checked in SCOPE
    assert not policy.pacer_of(SCOPE).newcomer
    fresh = Scope("tenant-c", "fn@model:rev")
    for i, (prompt, group) in enumerate(stream[:1200]):  # the same traffic again, in a new tenant
        cache.insert(fresh, f"c{i}", prompt, group)
    draws = random.Random(2)
    draws.setstate(cache._rng.getstate())
    sampled_before = policy.calibration.n
    outcomes, sampled = [], 0
    for i, (prompt, group) in enumerate(stream[1200:]):
        decision, entry = cache.lookup(fresh, prompt, max_error=0.05)
        draw = draws.random()
        if decision.serve or decision.explore:
            outcomes.append(decision.explore)
            sampled += draw < policy.explore  # past the early schedule: the rule's chance
        if entry is None:
            cache.insert(fresh, f"n{i}", prompt, group)
            cache.judge_miss(fresh, prompt, group, decision)
        if len(outcomes) == policy.trust:
            break
    assert policy.pacer_of(fresh).newcomer
    assert outcomes == [True] * policy.trust  # explored whatever the draw
    # Only the drawn ones joined the shared sample, which stays a uniform sample of would-be hits.
    assert policy.calibration.n - sampled_before == sampled < policy.trust


def test_a_misspelt_or_misplaced_policy_option_is_refused() -> None:

    with pytest.raises(TypeError, match="explor"):
        BoundedPolicy(explor=0.1)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="'k'"):
        StaticPolicy(threshold=0.9, k=3)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="pacer must be a PacerOptions, got dict"):
        BoundedPolicy(pacer={"every": 1})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="windw"):
        PacerOptions(windw=10)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="threshold applies only to mode 'static', not 'bounded'"):
        PolicyOptions(mode="bounded", threshold=0.9)
    with pytest.raises(ValueError, match="unknown semantic mode 'fuzzy'; known: bounded, static"):
        PolicyOptions(mode="fuzzy")
    with pytest.raises(ValueError, match="mode 'static' needs a threshold"):
        PolicyOptions(mode="static")
    with pytest.raises(TypeError, match="'k'"):
        PolicyOptions(k=3)  # type: ignore[call-arg]  # the neighbours read per lookup are SemanticCache(k=)
    with pytest.raises(ValueError, match=r"PacerOptions.window must be an int >= 1, got 0"):
        PacerOptions(window=0)
    with pytest.raises(ValueError, match=r"PacerOptions.confidence must be in \(0, 1\), got 1.0"):
        PacerOptions(confidence=1.0)
    with pytest.raises(TypeError, match="options must be a PacerOptions, got dict"):
        Pacer({"window": 10})  # type: ignore[arg-type]
    assert PolicyOptions(mode="static", threshold=0.9).build().readings() == (0.9, 1.0, False)


def test_each_policy_explains_an_exact_hit_and_its_readings() -> None:
    from evocache.controller.semantic._decide import Readings

    static, bounded = StaticPolicy(threshold=0.9), BoundedPolicy()
    assert static.exact(SCOPE, "e1") == SemanticDecision(True, False, "e1", 1.0, 0.9, 0.0)
    assert static.readings(SCOPE) == Readings(0.9, 1.0)
    # no pacer for the scope yet; no verdict yet: the calibration is the prior's alone
    assert bounded.readings(SCOPE) == Readings(0.0, bounded.calibration.start, False)
    assert bounded.exact(SCOPE, "e1") == SemanticDecision(True, False, "e1", 1.0, 0.0, 0.0)
    assert bounded.pacer_of(SCOPE).lookups == 1  # the exact hit counts in the scope's per-lookup rate
    assert (static.reads_shares, static.learns, bounded.reads_shares, bounded.learns) == (False, False, True, True)
    # a calibrated model explored long enough: the sequence's own bound replaces the prior's cap
    for i in range(1, 5001):
        bounded.calibration.explored(0.02, i % 50 == 0)
    readings = bounded.readings(SCOPE)
    assert readings.bounded and readings.calibration == bounded.calibration.upper < bounded.calibration.start
