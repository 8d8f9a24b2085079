"""The learned eviction policy: determinism in replay, the model's JSON round trip and version check, the
heuristic fallback, retraining cadence, the background trainer, admission, and the access context the
simulator hands to policies that ask for it. (The shared contract suite, tests/test_eviction.py, runs it too,
untrained and trained.)"""

from __future__ import annotations

import functools
import json
import random
import threading
from collections.abc import Hashable

import numpy as np
import pytest

from evocache.controller.eviction import (
    EVICTION_POLICIES,
    BuildContext,
    EntryInfo,
    LearnedModel,
    LearnedModelError,
    LearnedPolicy,
    LearnedRankPolicy,
    LearnedTraining,
    LFUPolicy,
    TrainingWindow,
    LRUPolicy,
    make_eviction_policy,
)
from evocache.controller.eviction._features import FEATURES
from evocache.controller.eviction._model import train
from evocache.controller.replay import read_trace, replay
from evocache.controller.replay._access import Access


def chain_trace(requests: int = 400, seed: int = 1) -> list[Access]:
    """KV-block-like accesses: each request walks a prefix chain; a few chains come back often, most once."""
    rng = random.Random(seed)
    out: list[Access] = []
    t = 0.0
    for req in range(requests):
        head = rng.randrange(12) if rng.random() < 0.6 else 1000 + req
        length = 1 + rng.randrange(10)
        for pos in range(length):
            out.append(Access(t, f"{head}:{pos}", 1, "", "", req, pos))
        t += 1.0
    return out


TRACE = chain_trace()


class Recording(LearnedPolicy):
    """Records the keys the owner removes: in replay every removal is an eviction."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.removed: list[Hashable] = []

    def on_remove(self, key: Hashable) -> None:
        super().on_remove(key)
        self.removed.append(key)


def run(factory, capacity: int = 20, trace: list[Access] = TRACE):
    built = []

    def make(**kw):
        built.append(factory(**kw))
        return built[0]

    return replay(trace, make, capacity_objects=capacity), built[0]


def serve(policy: LearnedPolicy, key: str, info: EntryInfo, held: list[str], capacity: int = 20) -> None:
    """One access through a small owner of ``capacity`` objects (``held``, its keys): a hit, or, if the policy
    admits the miss, the least wanted key out and ``key`` in. The caller announces the access (``on_access``)
    when it has context to give."""
    if key in held:
        policy.on_hit(key)
        return
    if not policy.admit(key, info):
        return
    if len(held) == capacity:
        victim = policy.victim()
        policy.on_remove(victim)
        held.remove(victim)
    policy.on_insert(key, info)
    held.append(key)


@functools.cache
def trained_model() -> LearnedModel:
    _, policy = run(functools.partial(LearnedPolicy, capacity=20, training=LearnedTraining(retrain_every=300)))
    assert policy.model is not None
    return policy.model


# -- replay ------------------------------------------------------------------------------------------------


def test_replay_is_deterministic_and_the_model_decides() -> None:
    factory = functools.partial(Recording, capacity=20, training=LearnedTraining(retrain_every=300))
    first, p1 = run(factory)
    second, p2 = run(factory)
    assert first == second
    assert p1.removed == p2.removed and len(p1.removed) > 500
    assert p1.stats == p2.stats
    assert p1.stats.trained == len(TRACE) // 300
    # the model changed decisions: the victims are not LRU's
    lru_victims = run(functools.partial(Recording, capacity=20, training=LearnedTraining(retrain_every=10**9)))[1].removed
    assert p1.removed != lru_victims


def recording(cls: type) -> type:
    """``cls`` with a ``removed`` list of the keys the owner removed."""

    def on_remove(self, key: Hashable) -> None:
        cls.on_remove(self, key)
        self.__dict__.setdefault("removed", []).append(key)

    return type(f"Recording{cls.__name__}", (cls,), {"on_remove": on_remove})


@pytest.mark.parametrize(("fallback", "heuristic"), [("lru", LRUPolicy), ("lfu", LFUPolicy)])
def test_untrained_policy_is_its_heuristic_exactly(fallback: str, heuristic: type) -> None:
    def by_name(**owner):  # the fallback built by name, as the registry builds it
        return Recording.build(BuildContext(EVICTION_POLICIES, capacity=20, **owner), fallback=fallback,
                               training=LearnedTraining(retrain_every=10**9))

    learned_result, learned = run(by_name)
    plain_result, plain = run(recording(heuristic))
    assert learned.model is None and learned.stats.trained == 0 and learned.stats.bypassed == 0
    assert learned.removed == plain.removed and len(plain.removed) > 500
    assert learned_result.hits == plain_result.hits
    assert learned_result.prefix_hits == plain_result.prefix_hits


def test_retrains_every_n_accesses() -> None:
    policy = LearnedPolicy(capacity=20, training=LearnedTraining(retrain_every=250))
    trained = []
    held: list[str] = []
    for i, a in enumerate(TRACE[:1000], start=1):
        info = EntryInfo(1, req=a.req, pos=a.pos, req_len=10)
        policy.on_access(a.key, info)
        serve(policy, a.key, info, held)
        if i % 250 == 0:
            trained.append((policy.stats.accesses, policy.stats.trained, policy.stats.model_tick))
    assert trained == [(250, 1, 250), (500, 2, 500), (750, 3, 750), (1000, 4, 1000)]


def test_bypassed_misses_count_as_misses() -> None:
    """The simulator honours admission: a bypassed key is never stored, so every access to it misses, and
    admitting nothing evicts nothing."""

    class NoX(LRUPolicy):
        uses_context = True

        def admit(self, key: Hashable, info: EntryInfo) -> bool:
            return not str(key).startswith("x")

    trace = [Access(float(i), key, 1) for i, key in enumerate("x1 a x1 a x1 b a".split())]
    result = replay(trace, NoX, capacity_objects=1)
    # x1 never stored; a, hit a, b evicts a, a misses
    assert (result.requests, result.hits) == (7, 1)


def test_learned_admission_bypasses_and_replay_counts_it() -> None:
    result, policy = run(functools.partial(LearnedPolicy, capacity=20, training=LearnedTraining(retrain_every=300), admission=True))
    assert policy.stats.bypassed > 0
    off, _ = run(functools.partial(LearnedPolicy, capacity=20, training=LearnedTraining(retrain_every=300)))
    assert result.hits != off.hits and result.requests == off.requests == len(TRACE)


def test_context_reaches_policies_that_ask(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [7, 8]}\n'
        '{"timestamp": 5, "input_length": 512, "output_length": 1, "hash_ids": [7]}\n'
    )
    seen: list[tuple[Hashable, EntryInfo]] = []

    class Listening(LRUPolicy):
        uses_context = True

        def on_access(self, key: Hashable, info: EntryInfo) -> None:
            seen.append((key, info))

    replay(read_trace(path), Listening, capacity_objects=4)
    budgets = []
    Listening.on_access = lambda self, key, info: budgets.append(info.req_out)  # type: ignore[method-assign]
    replay(read_trace(path, output_lengths=True), Listening, capacity_objects=4)
    assert budgets == [1, 1, 1]
    assert seen == [
        ("7", EntryInfo(1, req=0, pos=0, req_len=2, parent=None)),
        ("8", EntryInfo(1, req=0, pos=1, req_len=2, parent="7")),
        ("7", EntryInfo(1, req=1, pos=0, req_len=1, parent=None)),
    ]


def test_leaves_go_first() -> None:
    """With a model, a block that a cached block has as parent is not evicted while leaves remain."""
    policy = LearnedPolicy(model=trained_model())
    policy.on_insert("h", EntryInfo(1, req=0, pos=0, req_len=3))
    policy.on_insert("h1", EntryInfo(1, req=0, pos=1, req_len=3, parent="h"))
    policy.on_insert("h2", EntryInfo(1, req=0, pos=2, req_len=3, parent="h1"))
    order = []
    while len(policy):
        victim = policy.victim()
        order.append(victim)
        policy.on_remove(victim)
    assert order == ["h2", "h1", "h"]


# -- the model file ----------------------------------------------------------------------------------------


def test_model_round_trip(tmp_path) -> None:
    model = trained_model()
    path = tmp_path / "model.json"
    model.save(path)
    loaded = LearnedModel.load(path, features=FEATURES)
    assert loaded.features == FEATURES and loaded.window == model.window
    rows = np.random.default_rng(0).random((200, len(FEATURES))) * 50
    rows[::7, 1] = np.nan
    assert np.array_equal(loaded.predict(rows), model.predict(rows))
    # the numpy evaluator reproduces xgboost's own prediction
    np.testing.assert_allclose(model.predict(rows), model.booster.inplace_predict(rows), atol=1e-6)
    doc = json.loads(path.read_text())
    assert (doc["format"], doc["version"], doc["features"]) == ("evocache-learned-eviction", 1, list(FEATURES))

    # a policy given the file decides as the policy given the model
    def victims(policy: LearnedPolicy) -> list[Hashable]:
        for i in range(30):
            policy.on_insert(f"k{i}", EntryInfo(1))
            if i % 3 == 0:
                policy.on_hit(f"k{i}")
        out = []
        while len(policy):
            out.append(policy.victim())
            policy.on_remove(out[-1])
        return out

    from_file = LearnedPolicy()
    from_file.load_model(path)
    assert victims(from_file) == victims(LearnedPolicy(model=model))


def test_wrong_model_version_is_refused(tmp_path) -> None:
    path = tmp_path / "model.json"
    trained_model().save(path)
    doc = json.loads(path.read_text())
    doc["version"] = 99
    path.write_text(json.dumps(doc))
    policy = LearnedPolicy()
    with pytest.raises(LearnedModelError, match=r"model\.json: model format version 99; this evocache reads version 1"):
        policy.load_model(path)
    assert policy.model is None
    path.write_text('{"format": "something else"}')
    with pytest.raises(LearnedModelError, match="not an evocache learned eviction model"):
        LearnedModel.load(path)
    doc["version"] = 1
    doc["features"] = ["age"]
    path.write_text(json.dumps(doc))
    with pytest.raises(LearnedModelError, match=r"trained on features \['age'\]"):
        LearnedModel.load(path, features=FEATURES)


def test_save_before_training_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="no model to save"):
        LearnedPolicy().save_model(tmp_path / "m.json")


# -- production: the background trainer --------------------------------------------------------------------


class Gated(LearnedPolicy):
    """Training waits for ``release``; ``started`` says it began."""

    def __init__(self, **kwargs) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        super().__init__(**kwargs)

    def _fit(self, rows, labels, window):
        self.started.set()
        assert self.release.wait(30)
        return super()._fit(rows, labels, window)


def test_background_training_does_not_block_and_swaps_the_model() -> None:
    policy = Gated(background=True, training=LearnedTraining(retrain_every=300))
    try:
        keys = [a.key for a in TRACE]
        held: list[str] = []
        for key in keys[:300]:
            serve(policy, key, EntryInfo(1), held)
        assert policy.started.wait(30)  # the trainer took the job ...
        for key in keys[300:900]:  # ... and the request path goes on while it trains
            serve(policy, key, EntryInfo(1), held)
        assert policy.model is None and policy.stats.trained == 0
        assert policy.stats.skipped == 2  # retrainings at 600 and 900 found the trainer busy
        policy.release.set()
        assert policy.wait_trained(1, timeout=60)
        assert policy.model is not None and policy.model.window.tick == 300
        for key in keys[900:1200]:
            serve(policy, key, EntryInfo(1), held)
        assert policy.wait_trained(2, timeout=60)
        assert policy.stats.model_tick == 1200
    finally:
        policy.release.set()
        policy.close()


@functools.cache
def frequency_model() -> LearnedModel:
    """A model that learned one rule: an object accessed at least twice returns, one accessed once does not."""
    rng = np.random.default_rng(0)
    rows = rng.random((2000, len(FEATURES))) * 100
    count = FEATURES.index("count")
    rows[:, count] = rng.integers(1, 6, size=2000)
    labels = (rows[:, count] >= 2).astype(float)
    return train(rows, labels, features=FEATURES, window=TrainingWindow(0, 1999, 0, 2000, int(labels.sum())),
                 rounds=5, threads=1)


@functools.cache
def budget_model() -> LearnedModel:
    """A model that learned one rule: blocks of requests with an output budget over 100 tokens do not return."""
    rng = np.random.default_rng(0)
    rows = rng.random((2000, len(FEATURES))) * 100
    out = FEATURES.index("req_out")
    rows[:, out] = rng.choice([8, 400], size=2000)
    labels = (rows[:, out] < 100).astype(float)
    return train(rows, labels, features=FEATURES, window=TrainingWindow(0, 1999, 0, 2000, int(labels.sum())),
                 rounds=5, threads=1)


def test_model_decides_and_a_stale_one_falls_back() -> None:
    def policy(stale_after: int) -> LearnedPolicy:
        p = LearnedPolicy(model=frequency_model(), training=LearnedTraining(retrain_every=10**6, stale_after=stale_after))
        p.on_insert("a", EntryInfo(1))
        p.on_hit("a")
        for key in "bcd":
            p.on_insert(key, EntryInfo(1))
        return p

    fresh, stale = policy(10**6), policy(4)  # 5 accesses: the model (fresh at 0) is stale after 4
    assert fresh.victim() == "b"  # the model keeps the twice-accessed a; of the rest b is the oldest
    assert fresh.fallback.victim() == "a"  # where LRU would evict a
    assert stale.victim() == "a"


def two_kinds_trace(requests: int = 600, seed: int = 3) -> list[Access]:
    """Chains of two kinds of request: 8 documents that come back again and again, asked with short answers
    (``req_out`` 8), and one-off chains asked for long generations (``req_out`` 400), half of the requests.
    What returns is told by the request, not by the block's history: a one-off block is new like the first
    access of a document's block."""
    rng = random.Random(seed)
    out: list[Access] = []
    for req in range(requests):
        if rng.random() < 0.5:
            head, length, budget = f"doc{rng.randrange(8)}", 6, 8
        else:
            head, length, budget = f"once{req}", 1 + rng.randrange(8), 400
        out += [Access(float(req), f"{head}:{pos}", 1, "", "", req, pos, budget) for pos in range(length)]
    return out


def test_classify_learns_which_requests_leave_chains_that_never_return() -> None:
    """With the request's output budget as a feature the model learns that long generations do not come back:
    their blocks are classified averse and evicted first, and the cache keeps the documents (more hits than
    LRU, which lets each one-off chain push documents out)."""
    trace = two_kinds_trace()
    classes: dict[str, list[int]] = {"doc": [], "once": []}

    class Watching(LearnedPolicy):
        """Records the class each held block of a request gets when the request completes."""

        def _complete(self) -> None:
            finished = [k for k in self._in_flight if k in self._class]
            decided = self.model is not None
            super()._complete()
            if decided:
                for key in finished:
                    classes["once" if str(key).startswith("once") else "doc"].append(self._class[key])

    result, policy = run(functools.partial(Watching, capacity=30, training=LearnedTraining(retrain_every=300)), capacity=30, trace=trace)
    lru, _ = run(LRUPolicy, capacity=30, trace=trace)
    assert policy.stats.trained == len(trace) // 300 and policy.stats.averse > 0
    once_averse = 1 - sum(classes["once"]) / len(classes["once"])
    doc_averse = 1 - sum(classes["doc"]) / len(classes["doc"])
    assert once_averse > 0.8 and doc_averse < 0.1, (once_averse, doc_averse)
    assert result.hits > 1.2 * lru.hits, (result.hits, lru.hits)
    assert policy.stats.averse == len(classes["doc"]) + len(classes["once"]) - sum(classes["doc"]) - sum(
        classes["once"])


def test_a_request_is_classified_when_it_completes() -> None:
    """With an output length (known at completion) a request's blocks stay friendly while it is in flight and
    are classified together when the next request begins; the one-off request's blocks then go first."""
    policy = LearnedPolicy(model=budget_model(), training=LearnedTraining(retrain_every=10**6))
    for pos, key in enumerate(["long0", "long1"]):
        info = EntryInfo(1, req=0, pos=pos, req_len=2, req_out=400, parent="long0" if pos else None)
        policy.on_access(key, info)
        policy.on_insert(key, info)
    assert policy.stats.averse == 0 and policy._class == {"long0": 1, "long1": 1}  # in flight: friendly
    info = EntryInfo(1, req=1, pos=0, req_len=1, req_out=8)
    policy.on_access("short", info)  # request 0 completed
    policy.on_insert("short", info)
    assert policy.stats.averse == 2 and policy._class == {"long0": 0, "long1": 0, "short": 1}
    assert policy.victim() == "long1"  # the averse leaf (long0 is its parent)
    policy.on_remove("long1")
    assert policy.victim() == "long0"
    policy.on_remove("long0")
    assert policy.victim() == "short"  # still in flight (friendly): the only key left


def test_classify_namespace_victims_and_admission() -> None:
    """Within a namespace the least recently used averse leaf goes first; with ``admission`` an averse miss is
    not stored when the cache is full (and counted), a friendly one is."""
    policy = LearnedPolicy(model=frequency_model(), training=LearnedTraining(retrain_every=10**6), capacity=4, admission=True)
    held = []
    for key, ns in (("a", "x"), ("b", "x"), ("c", "y"), ("d", "x")):
        info = EntryInfo(1, ns)
        policy.on_access(key, info)
        assert policy.admit(key, info)  # room left: admitted whatever its class
        policy.on_insert(key, info)
        held.append(key)
    policy.on_hit("a")  # accessed twice: friendly (the model's rule)
    policy.on_hit("d")
    assert policy.victim("x") == "b"  # the only averse key of x
    assert policy.victim("y") == "c"
    assert policy.victim() == "b"
    policy.on_access("e", EntryInfo(1, "x"))
    assert not policy.admit("e", EntryInfo(1, "x")) and policy.stats.bypassed == 1
    policy.on_access("b", EntryInfo(1, "x"))
    policy.on_hit("b")  # b is friendly now: c is the only averse key left
    assert policy.victim() == "c" and policy.victim("x") == "a"  # x's least recently used, all friendly


def test_request_features_req_out_and_req_new() -> None:
    """``req_out`` is the request's output budget (NaN when unknown); ``req_new`` counts the request's blocks
    from its first never-seen block to the end, known at that block (chained hashes), and is 0 for the blocks
    of the known prefix before it."""
    from evocache.controller.eviction._history import History

    hist = History()
    tick = 0

    def request(keys: list[str], out: int) -> dict[str, list[float]]:
        nonlocal tick
        got = {}
        for pos, key in enumerate(keys):
            tick += 1
            if pos == 0:
                hist.start_request(key, tick)
            slot = hist.touch(key, tick, EntryInfo(1, req=0, pos=pos, req_len=len(keys), req_out=out))
            row = hist.rows([slot], tick)[0]
            got[key] = [row[FEATURES.index("req_out")], row[FEATURES.index("req_new")]]
        return got

    assert request(["a", "b", "c"], 7) == {"a": [7, 3], "b": [7, 3], "c": [7, 3]}  # all new
    assert request(["a", "b", "d", "e"], 300) == {"a": [300, 0], "b": [300, 0], "d": [300, 2], "e": [300, 2]}
    assert request(["a", "b", "c"], 7) == {"a": [7, 0], "b": [7, 0], "c": [7, 0]}  # all known
    tick += 1
    slot = hist.touch("z", tick, EntryInfo(1))  # no request context (an L1 entry): both unknown
    row = hist.rows([slot], tick)[0]
    assert np.isnan(row[FEATURES.index("req_out")]) and np.isnan(row[FEATURES.index("req_new")])


def test_request_state_is_kept_per_request_when_blocks_interleave() -> None:
    """Two requests whose blocks arrive interleaved (an owner serving them at once) each get their own
    ``req_new`` and head counts; a request whose first block is never reported starts fresh."""
    from evocache.controller.eviction._history import History

    hist = History()
    hist.touch("k", 1, EntryInfo(1, req=9, pos=0, req_len=1))  # "k" known from an earlier request
    col = FEATURES.index("req_new")
    hist.start_request("n0", 2, req=1)
    hist.start_request("k", 3, req=2)
    got = {}
    for tick, (key, req, pos) in enumerate([("n0", 1, 0), ("k", 2, 0), ("n1", 1, 1), ("k1", 2, 1)], start=4):
        slot = hist.touch(key, tick, EntryInfo(1, req=req, pos=pos, req_len=2))
        got[key] = hist.rows([slot], tick)[0][col]
    assert got == {"n0": 2, "n1": 2, "k": 0, "k1": 1}
    slot = hist.touch("x1", 9, EntryInfo(1, req=3, pos=1, req_len=2))  # request 3's block 0 never reported
    assert hist.rows([slot], 9)[0][col] == 1
    assert np.isnan(hist.rows([slot], 9)[0][FEATURES.index("head_requests")])


def test_head_counts_are_bounded() -> None:
    from evocache.controller.eviction._history import History

    hist = History()
    for tick, head in enumerate("abcab", start=1):
        hist.start_request(head, tick)
    hist.forget_heads(keep=2)  # the two first blocks requested most recently stay: a (tick 4) and b (tick 5)
    hist.start_request("a", 6, req=7)
    hist.start_request("c", 7, req=8)
    assert hist._requests[7][0] == 3 and hist._requests[8][0] == 1  # a's count kept, c's started again


def test_classify_victim_passes_averse_parents_of_friendly_children() -> None:
    """An averse block whose child is friendly cannot go before the child; the least recently used averse
    *leaf* goes, however many such parents come first (found through a heap, not a scan)."""
    policy = LearnedPolicy(model=frequency_model(), training=LearnedTraining(retrain_every=10**6))
    for i in range(300):  # each chain: an averse head (one access) under a friendly child (two accesses)
        policy.on_access(f"p{i}", EntryInfo(1, req=i, pos=0, req_len=2))
        policy.on_insert(f"p{i}", EntryInfo(1, req=i, pos=0, req_len=2))
        policy.on_access(f"c{i}", EntryInfo(1, req=i, pos=1, req_len=2, parent=f"p{i}"))
        policy.on_insert(f"c{i}", EntryInfo(1, req=i, pos=1, req_len=2, parent=f"p{i}"))
        policy.on_hit(f"c{i}")
    policy.on_access("lone", EntryInfo(1))
    policy.on_insert("lone", EntryInfo(1))
    assert policy.victim() == "lone"  # the only averse leaf
    policy.on_remove("lone")
    assert policy.victim() == "c0"  # no averse leaf left: the least recently used friendly leaf
    policy.on_remove("c0")
    assert policy.victim() == "p0"  # its parent is a leaf again, averse, and goes next


def test_classify_without_leaves_first_takes_the_least_recently_used_averse_key() -> None:
    policy = LearnedPolicy(model=frequency_model(), training=LearnedTraining(retrain_every=10**6), leaves_first=False)
    policy.on_insert("a", EntryInfo(1, req=0, pos=0, req_len=2))
    policy.on_insert("b", EntryInfo(1, req=0, pos=1, req_len=2, parent="a"))
    assert policy.victim() == "a"


def test_admission_without_an_announced_access_admits() -> None:
    """The L1 tier asks ``admit`` without ``on_access``: nothing was classified for the key, so it is admitted
    (LearnedPolicy), and LearnedRankPolicy finds no history instead of raising."""
    for cls in (LearnedPolicy, LearnedRankPolicy):
        policy = cls(model=frequency_model(), training=LearnedTraining(retrain_every=10**6), capacity=1,
                     admission=True)
        policy.on_insert("a", EntryInfo(1))
        assert policy.admit("new", EntryInfo(1)) and policy.stats.bypassed == 0


def test_a_regression_model_cannot_classify(tmp_path) -> None:
    _, ranked = run(functools.partial(LearnedRankPolicy, capacity=20, training=LearnedTraining(retrain_every=300),
                                      target="distance"))
    ranked.save_model(tmp_path / "m.json")
    with pytest.raises(LearnedModelError, match="regression"):
        LearnedPolicy().load_model(tmp_path / "m.json")
    LearnedRankPolicy(target="distance").load_model(tmp_path / "m.json")


def test_a_failed_training_is_counted_and_the_trainer_goes_on() -> None:
    class FailsOnce(LearnedPolicy):
        calls = 0

        def _fit(self, rows, labels, window):
            FailsOnce.calls += 1
            if FailsOnce.calls == 1:
                raise RuntimeError("injected")
            return super()._fit(rows, labels, window)

    policy = FailsOnce(background=True, training=LearnedTraining(retrain_every=300), capacity=20)
    try:
        held: list[str] = []
        for i, a in enumerate(TRACE):
            info = EntryInfo(1, req=a.req, pos=a.pos, req_len=10)
            policy.on_access(a.key, info)
            serve(policy, a.key, info, held)
            if i % 300 == 299:
                assert policy.wait_trained(0, timeout=1)
                with policy._cond:  # let each job finish before the next retraining, so none is skipped
                    policy._cond.wait_for(lambda: policy._job is None and not policy._busy, timeout=60)
        assert policy.stats.failed == 1 and policy.stats.trained == len(TRACE) // 300 - 1
    finally:
        policy.close()


def test_a_feature_subset_trains_on_those_columns_only(tmp_path) -> None:
    chosen = ("age", "count", "edc16384", "head_requests")
    _, policy = run(functools.partial(LearnedPolicy, capacity=20, training=LearnedTraining(retrain_every=300, features=chosen)))
    assert policy.model is not None and policy.model.features == chosen
    assert policy.model.booster.num_features() == 4
    policy.save_model(tmp_path / "m.json")
    with pytest.raises(LearnedModelError, match="expected"):
        LearnedPolicy().load_model(tmp_path / "m.json")  # all features expected
    LearnedPolicy(training=LearnedTraining(features=chosen)).load_model(tmp_path / "m.json")
    with pytest.raises(ValueError, match=r"unknown features \['colour'\]; known: age, gap1"):
        LearnedTraining(features=("age", "colour"))


def test_distance_target_learns_a_regression_that_round_trips(tmp_path) -> None:
    result, policy = run(functools.partial(LearnedRankPolicy, capacity=20, training=LearnedTraining(retrain_every=300),
                                              target="distance"))
    model = policy.model
    assert model is not None and policy.stats.trained == len(TRACE) // 300
    rows = np.random.default_rng(1).random((100, len(FEATURES))) * 30
    scores = model.predict(rows)
    assert (scores <= 0).all()  # minus a log distance
    np.testing.assert_allclose(scores, model.booster.inplace_predict(rows), atol=1e-5)
    model.save(tmp_path / "m.json")
    assert np.array_equal(LearnedModel.load(tmp_path / "m.json").predict(rows), scores)
    assert result == run(functools.partial(LearnedRankPolicy, capacity=20, training=LearnedTraining(retrain_every=300),
                                              target="distance"))[0]


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="retrain_every"):
        LearnedTraining(retrain_every=0)
    with pytest.raises(ValueError, match="horizon"):
        LearnedTraining(horizon=float("inf"))
    with pytest.raises(ValueError, match="target must be"):
        LearnedRankPolicy(target="soon")
    with pytest.raises(ValueError, match="fallback must be a heuristic"):
        LearnedPolicy(fallback=LearnedRankPolicy())
    with pytest.raises(ValueError, match="fallback must be a heuristic"):
        make_eviction_policy("learned", fallback="learned-rank")
    with pytest.raises(TypeError, match="fallback must be an EvictionPolicy"):
        LearnedPolicy(fallback="lfu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="averse_below"):
        LearnedPolicy(averse_below=-1)
    with pytest.raises(TypeError, match="training must be a LearnedTraining"):
        LearnedPolicy(training={"retrain_every": 10})  # type: ignore[arg-type]
    assert isinstance(make_eviction_policy("learned", capacity=10), LearnedPolicy)
    assert isinstance(make_eviction_policy("learned-rank", capacity=10), LearnedRankPolicy)


@pytest.mark.parametrize("option", ["decide", "target", "retrain_every", "horizon", "features", "retrain_evry"])
def test_a_misspelt_or_misplaced_option_is_a_type_error(option: str) -> None:
    """One decision per class (no ``decide``; ``target`` belongs to the ranking policy) and the training
    options in ``LearnedTraining``: anything else given to the classifying policy is a TypeError."""
    with pytest.raises(TypeError, match=option):
        make_eviction_policy("learned", **{option: 1})
    with pytest.raises(TypeError, match=option):
        LearnedPolicy(**{option: 1})


def test_training_options_keep_their_values() -> None:
    training = LearnedTraining(horizon=3, retrain_every=50, features=["age", "count"])
    assert training.horizon == 3.0 and isinstance(training.horizon, float)
    assert training.features == ("age", "count") and training.staleness == 200
    assert LearnedTraining(stale_after=7).staleness == 7
    policy = make_eviction_policy("learned", training=training)
    assert policy.training is training and policy.features == ("age", "count")
