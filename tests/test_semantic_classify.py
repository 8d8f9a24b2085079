"""The answer classifier: a softmax regression from a scope's entries to the judge's answer clusters, read by
the error model as a feature (controller/semantic/_classify.py)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from sklearn.linear_model import LogisticRegression
from test_semantic_decide import SCOPE, TableEmbedder, _unit

from evocache.controller.semantic import SemanticCache
from evocache.controller.semantic._classify import AnswerClassifier, fit_clusters
from evocache.controller.semantic._decide import CLASSIFIED, FEATURES, BoundedPolicy, StaticPolicy, neighbourhood
from evocache.controller.semantic._index import Neighbour, Scope


def _blobs(centres: dict[str, np.ndarray], per: int, seed: int = 0) -> tuple[np.ndarray, list[str]]:
    rng = np.random.default_rng(seed)
    rows, labels = [], []
    for label, centre in centres.items():
        for _ in range(per):
            rows.append(_unit(centre + rng.normal(0, 0.15, centre.shape)))
            labels.append(label)
    return np.asarray(rows), labels


def _held_all(_entry: str) -> bool:
    return True


def test_shares_follow_the_cluster_a_prompt_belongs_to() -> None:
    centres = {"c1": np.array([1.0, 0, 0, 0]), "c2": np.array([0, 1.0, 0, 0]), "c3": np.array([0, 0, 1.0, 0])}
    x, y = _blobs(centres, 20)
    classifier = AnswerClassifier(every=1)
    classifier.fit(SCOPE, x, y, {"c1": ("a",), "c2": ("b",), "c3": ("c",)})
    shares = classifier.shares(SCOPE, _unit(np.array([0.9, 0.1, 0, 0.1])), lambda e: {"a": "c1", "b": "c2", "c": "c3"}[e], _held_all)
    assert shares is not None and set(shares) == {"c1", "c2", "c3"}
    assert math.isclose(sum(shares.values()), 1.0)
    assert shares["c1"] > 0.8 > shares["c2"]
    # Clusters merged since the fit: the shares of their classes add up under the cluster they are in now.
    merged = classifier.shares(SCOPE, _unit(np.array([0, 0.7, 0.7, 0])), lambda e: {"a": "c1", "b": "m", "c": "m"}[e], _held_all)
    assert merged is not None and set(merged) == {"c1", "m"} and merged["m"] > 0.9
    # A class whose member has left is dropped.
    gone = classifier.shares(SCOPE, _unit(np.array([1.0, 0, 0, 0])), lambda e: e, lambda e: e != "a")
    assert gone is not None and set(gone) == {"b", "c"}
    # Another scope has no model: no shares.
    assert classifier.shares(Scope("tenant-b", SCOPE.boundary), x[0], lambda e: e, _held_all) is None


def test_two_clusters_give_the_probabilities_scikit_learn_gives() -> None:
    x, y = _blobs({"p": np.array([1.0, 0.2, 0]), "q": np.array([0.2, 1.0, 0])}, 15, seed=1)
    model = fit_clusters(x, y, {"p": ("e1",), "q": ("e2",)})
    assert model is not None and model.coef.shape == (3, 2) and model.members == (("e1",), ("e2",))
    reference = LogisticRegression(C=10.0, max_iter=200).fit(x, y).predict_proba(x[:5])
    z = x[:5] @ model.coef + model.intercept
    ours = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(ours, reference, atol=1e-5)  # float32 weights
    assert fit_clusters(x[:3], ["p"] * 3, {"p": ("e1",)}) is None  # one cluster: nothing to tell apart


def test_a_fit_is_due_every_n_inserts_of_a_scope_and_one_at_a_time() -> None:
    classifier = AnswerClassifier(every=3)
    other = Scope("tenant-b", SCOPE.boundary)
    assert [classifier.inserted(SCOPE) for _ in range(3)] == [False, False, True]
    assert classifier.inserted(other) is False  # counted per scope
    assert [classifier.inserted(SCOPE) for _ in range(4)] == [False, False, False, False]  # one is running
    classifier.abandon(SCOPE, soon=True)  # it could not start: the next insert asks again
    assert classifier.inserted(SCOPE) is True
    classifier.abandon(SCOPE, soon=False)  # it failed: asked again after `every` more
    assert [classifier.inserted(SCOPE) for _ in range(3)] == [False, False, True]


def test_the_training_set_keeps_the_latest_entries_of_clusters_large_enough() -> None:
    classifier = AnswerClassifier(min_cluster=2, max_entries=5)
    pairs = [("e0", "x"), ("e1", "x"), ("e2", "y"), ("e3", "x"), ("e4", "z"), ("e5", "y"), ("e6", "x")]
    ids, labels, members = classifier.training_set(pairs)
    # The latest 5 (e2..e6): y twice, x twice, z once (left out); each cluster's newest entries first.
    assert ids == ["e2", "e3", "e5", "e6"] and labels == ["y", "x", "y", "x"]
    assert members == {"y": ("e5", "e2"), "x": ("e6", "e3")}


def test_neighbourhood_reads_the_candidate_clusters_share() -> None:
    neighbours = [Neighbour("a1", 0.9), Neighbour("b1", 0.85)]
    cluster = {"a1": "A", "b1": "B"}.__getitem__
    with_model = neighbourhood(neighbours, cluster, lambda root: 1, shares={"A": 0.7, "B": 0.2, "C": 0.1})
    without = neighbourhood(neighbours, cluster, lambda root: 1)
    assert with_model is not None and without is not None
    at = {name: FEATURES.index(name) for name in CLASSIFIED}
    assert with_model.features[at["classified"]] == 1.0
    assert math.isclose(with_model.features[at["answer_share"]], 0.7)
    assert math.isclose(with_model.features[at["answer_log_share"]], math.log(0.7))
    assert math.isclose(with_model.features[at["rival_share"]], 0.2)
    assert [without.features[at[n]] for n in CLASSIFIED] == [0.0, 0.0, math.log(1e-4), 0.0]


class _Recording(BoundedPolicy):
    """A bounded policy that remembers the shares each lookup was decided with."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[dict[str, float] | None] = []

    def decide(self, neighbours, max_error, explore_draw, clusters, scope=None, prompt=None, shares=None):  # type: ignore[no-untyped-def]
        self.seen.append(None if shares is None else dict(shares))
        return super().decide(neighbours, max_error, explore_draw, clusters, scope=scope, prompt=prompt, shares=shares)


def _two_groups(n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    table = {}
    for i in range(n):
        centre = np.array([1.0, 0, 0, 0]) if i % 2 else np.array([0, 1.0, 0, 0])
        table[f"q{i}"] = _unit(centre + rng.normal(0, 0.2, 4))
    return table


def test_the_cache_fits_each_scopes_classifier_on_its_own_entries_only() -> None:
    table = _two_groups(40)
    policy = _Recording()
    other = Scope("tenant-b", SCOPE.boundary)
    cache = SemanticCache(
        TableEmbedder(table), policy=policy, classify=True, classifier=AnswerClassifier(every=10), rng=random.Random(0)
    )
    for i in range(12):  # scope A: 12 inserts, linked into two answers by the judge
        prompt = f"q{i}"
        decision, _ = cache.lookup(SCOPE, prompt, max_error=0.05)
        cache.insert(SCOPE, f"a{i}", prompt, i % 2)
        cache.judge_miss(SCOPE, prompt, i % 2, decision)
    classifier = cache._classifier
    assert classifier is not None and classifier.fits == 1
    model = classifier._models[SCOPE]
    assert {m for members in model.members for m in members} <= {f"a{i}" for i in range(12)}
    policy.seen.clear()
    cache.lookup(SCOPE, "q13", max_error=0.05)
    assert policy.seen[-1] is not None and math.isclose(sum(policy.seen[-1].values()), 1.0)
    # Tenant B's lookups never read A's model, even for the same prompts.
    cache.insert(other, "b0", "q0", 0)
    cache.lookup(other, "q13", max_error=0.05)
    assert policy.seen[-1] is None


def test_a_deferred_fit_runs_where_it_is_handed_and_a_refused_one_is_asked_again() -> None:
    table = _two_groups(20)
    handed: list = []
    accept = {"now": False}

    def later(work) -> bool:  # type: ignore[no-untyped-def]
        if accept["now"]:
            handed.append(work)
        return accept["now"]

    cache = SemanticCache(
        TableEmbedder(table), classify=True, classifier=AnswerClassifier(every=4), fit_later=later, rng=random.Random(0)
    )
    for i in range(4):
        decision, _ = cache.lookup(SCOPE, f"q{i}", max_error=0.05)
        cache.insert(SCOPE, f"a{i}", f"q{i}", i % 2)
        cache.judge_miss(SCOPE, f"q{i}", i % 2, decision)
    assert handed == []  # refused: nothing runs in the caller ...
    accept["now"] = True
    cache.insert(SCOPE, "a4", "q4", 0)  # ... and the next insert asks again
    assert len(handed) == 1
    classifier = cache._classifier
    assert classifier is not None and classifier.fits == 0
    handed[0]()
    assert classifier.fits == 1 and SCOPE in classifier._models


def test_the_classifier_is_on_unless_turned_off() -> None:
    assert SemanticCache(TableEmbedder(_two_groups(4)))._classifier is not None
    assert SemanticCache(TableEmbedder(_two_groups(4)), classify=False)._classifier is None


def test_the_error_model_also_learns_without_the_classifiers_features() -> None:
    """Observations the classifier spoke for also train the model as if it had not: a lookup it cannot speak
    for is estimated from weights learnt for that case, not next to a share it does not have."""
    from evocache.controller.semantic._error_model import _with_classifier_blanked

    at = FEATURES.index("classified")
    x = np.zeros((3, len(FEATURES)))
    x[1, at] = 1.0
    x[1, FEATURES.index("answer_share")] = 0.9
    y, w = np.array([0, 1, 0]), np.array([1.0, 4.0, 2.0])
    x2, y2, w2 = _with_classifier_blanked(x, y, w)
    assert x2.shape == (4, len(FEATURES)) and list(y2) == [0, 1, 0, 1]
    assert list(w2) == [1.0, 2.0, 2.0, 2.0]  # the classified one twice at half its weight
    assert [x2[3, FEATURES.index(n)] for n in CLASSIFIED] == [0.0, 0.0, math.log(1e-4), 0.0]
    x3, _, _ = _with_classifier_blanked(x[[0, 2]], y[[0, 2]], w[[0, 2]])
    assert x3.shape == (2, len(FEATURES))  # nothing classified: nothing added


def test_a_fit_tells_apart_at_most_the_largest_clusters() -> None:
    classifier = AnswerClassifier(max_classes=2)
    pairs = [("e0", "x"), ("e1", "x"), ("e2", "y"), ("e3", "y"), ("e4", "x"), ("e5", "z"), ("e6", "z"), ("e7", "y")]
    ids, labels, members = classifier.training_set(pairs)
    # x and y (3 each) are kept; z (2) is not.
    assert set(labels) == {"x", "y"} and "e5" not in ids and set(members) == {"x", "y"}
    # Of equal sizes, the most recently seen clusters win.
    pairs = [("a", "p"), ("b", "p"), ("c", "q"), ("d", "q"), ("e", "r"), ("f", "r")]
    ids, labels, _ = classifier.training_set(pairs)
    assert set(labels) == {"q", "r"}


@pytest.mark.parametrize("bad", [{"every": 0}, {"c": 0.0}, {"max_entries": 1}, {"max_classes": 1}])
def test_bad_classifier_options_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        AnswerClassifier(**bad)


def test_differences_that_can_only_raise_the_error_never_lower_it() -> None:
    """A negation, a number, a name, word order or a minimal edit between the prompts never makes the stored
    answer more likely right: their weights stay >= 0 even when the verdicts seen so far say otherwise."""
    from evocache.controller.semantic._error_model import _RAISING_FEATURES, ErrorModel

    rng = np.random.default_rng(0)
    model = ErrorModel(min_each=5, refit_every=10_000)
    at = {name: FEATURES.index(name) for name in (*_RAISING_FEATURES, "similarity")}
    for i in range(400):
        x = np.zeros(len(FEATURES))
        x[at["similarity"]] = rng.uniform(0.6, 1.0)
        wrong = bool(rng.random() < 1.2 - x[at["similarity"]])
        # By chance, every reordered prompt seen so far had the same answer.
        x[at["reordered"]] = float(not wrong and i % 3 == 0)
        x[at["negation_differs"]] = float(wrong and i % 4 == 0)  # and negations went with wrong answers
        model.observe(x, wrong)
    model._fit()
    assert model.ready
    coef = model._coef
    assert coef is not None
    assert coef[at["reordered"]] >= 0.0  # a free fit puts it well below 0
    assert coef[at["negation_differs"]] > 0.0
    assert coef[at["similarity"]] < 0.0
    from sklearn.linear_model import LogisticRegression

    x = np.asarray(model._x)
    xs = (x - model._mean) / model._scale
    free = LogisticRegression(C=1.0, solver="newton-cholesky").fit(xs, np.asarray(model._y)).coef_[0]
    assert free[at["reordered"]] < -0.1


def test_a_failing_refit_is_logged_and_never_fails_the_insert(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from evocache.controller.semantic import _classify

    def broken(*_args, **_kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("solver blew up")

    monkeypatch.setattr(_classify, "fit_clusters", broken)
    table = _two_groups(12)
    cache = SemanticCache(TableEmbedder(table), classifier=AnswerClassifier(every=4), rng=random.Random(0))
    for i in range(4):
        decision, _ = cache.lookup(SCOPE, f"q{i}", max_error=0.05)
        cache.insert(SCOPE, f"a{i}", f"q{i}", i % 2)  # the 4th insert refits, and the fit fails
        cache.judge_miss(SCOPE, f"q{i}", i % 2, decision)
    assert "refitting the answer classifier" in caplog.text and "solver blew up" in caplog.text
    classifier = cache._classifier
    assert classifier is not None and classifier.fits == 0 and SCOPE not in classifier._models
    assert cache.stats().fit_errors == 1
    # It is asked again after `every` more inserts, not at every insert.
    assert [classifier.inserted(SCOPE) for _ in range(4)] == [False, False, False, True]


def test_a_class_follows_its_newest_remaining_member_and_never_a_reused_id() -> None:
    """A class is found through its newest members, not its oldest (the first evicted); an id removed and
    inserted again with another answer does not take the old class's share."""
    x, y = _blobs({"c1": np.array([1.0, 0, 0]), "c2": np.array([0, 1.0, 0])}, 10)
    classifier = AnswerClassifier(every=1)
    classifier.fit(SCOPE, x, y, {"c1": ("n1", "o1"), "c2": ("n2",)})
    live = {"n1": "A", "o1": "A", "n2": "B"}
    at_a = _unit(np.array([1.0, 0.05, 0]))
    shares = classifier.shares(SCOPE, at_a, live.__getitem__, live.__contains__)
    assert shares is not None and shares["A"] > 0.9
    # The newest member leaves (evicted): the class still finds its cluster through the next one.
    classifier.forget(SCOPE, ["n1"])
    del live["n1"]
    shares = classifier.shares(SCOPE, at_a, live.__getitem__, live.__contains__)
    assert shares is not None and shares["A"] > 0.9
    # "n1" comes back, inserted again with another answer (cluster C): it no longer speaks for the class.
    live["n1"] = "C"
    shares = classifier.shares(SCOPE, at_a, live.__getitem__, live.__contains__)
    assert shares is not None and "C" not in shares and shares["A"] > 0.9


def test_an_empty_training_set_is_not_an_error(caplog: pytest.LogCaptureFixture) -> None:
    """A scope with no cluster of two yet has nothing to fit: the refit neither fails nor logs."""
    table = _two_groups(12)
    cache = SemanticCache(TableEmbedder(table), judge=lambda a, b: False, classifier=AnswerClassifier(every=3),
                          rng=random.Random(0))
    for i in range(9):
        decision, _ = cache.lookup(SCOPE, f"q{i}", max_error=0.05)
        cache.insert(SCOPE, f"a{i}", f"q{i}", i)
        cache.judge_miss(SCOPE, f"q{i}", i, decision)
    assert "refitting" not in caplog.text and cache._classifier is not None and cache._classifier.fits == 0
    assert cache.stats().fit_errors == 0


def test_static_mode_keeps_no_classifier_and_a_classifier_needs_classify() -> None:
    table = _two_groups(4)
    assert SemanticCache(TableEmbedder(table), policy=StaticPolicy(threshold=0.9))._classifier is None
    with pytest.raises(ValueError, match="classify=False"):
        SemanticCache(TableEmbedder(table), classify=False, classifier=AnswerClassifier())


def test_a_fit_later_that_raises_leaves_nothing_stuck() -> None:
    """A fit_later that raises (a thread pool shut down) fails neither the insert that stored the entry nor
    the scope's later refits (it is not left 'fitting')."""
    table = _two_groups(12)

    def shut(_work) -> bool:  # type: ignore[no-untyped-def]
        raise RuntimeError("cannot schedule new futures after shutdown")

    cache = SemanticCache(TableEmbedder(table), classifier=AnswerClassifier(every=2), fit_later=shut,
                          rng=random.Random(0))
    for i in range(2):
        cache.lookup(SCOPE, f"q{i}", max_error=0.05)
        cache.insert(SCOPE, f"a{i}", f"q{i}", 0)  # the second one asks for a fit: no exception here
    classifier = cache._classifier
    assert classifier is not None and not classifier._fitting and cache.stats().fit_errors == 1
    assert [classifier.inserted(SCOPE) for _ in range(2)] == [False, True]


def test_a_scope_whose_model_was_dropped_refits_at_its_next_insert() -> None:
    """A scope whose model was dropped refits at its next insert, not `every` inserts later."""
    x, y = _blobs({"c1": np.array([1.0, 0]), "c2": np.array([0, 1.0])}, 5)
    classifier = AnswerClassifier(every=100, max_scopes=1)
    other = Scope("tenant-b", SCOPE.boundary)
    classifier.fit(SCOPE, x, y, {"c1": ("a",), "c2": ("b",)})
    classifier.fit(other, x, y, {"c1": ("a",), "c2": ("b",)})  # drops SCOPE's model
    assert classifier.shares(SCOPE, x[0], lambda e: e, _held_all) is None
    assert classifier.inserted(SCOPE) is True


def test_an_entry_replaced_in_place_no_longer_speaks_for_its_class() -> None:
    table = _two_groups(12)
    cache = SemanticCache(TableEmbedder(table), classifier=AnswerClassifier(every=8), rng=random.Random(0))
    for i in range(8):
        decision, _ = cache.lookup(SCOPE, f"q{i}", max_error=0.05)
        cache.insert(SCOPE, f"a{i}", f"q{i}", i % 2)
        cache.judge_miss(SCOPE, f"q{i}", i % 2, decision)
    classifier = cache._classifier
    assert classifier is not None and classifier.fits == 1
    cache.insert(SCOPE, "a7", "q7", "another answer")  # the same id, replaced without a removal
    assert "a7" in classifier._gone[SCOPE]
