"""SemanticLayer: the runtime's semantic side, here its injected exploration coin (also via build_runtime)."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest
from evocache.controller import StoreConfig, build_runtime, cache_if
from evocache.controller._semantic import SemanticLayer, SemanticPlan
from evocache.controller.semantic import SemanticConfig
from evocache.dsl import SemanticSpec


class HashEmbedder:
    """Unit vectors drawn from each text's digest: the same vector for the same text, no model."""

    name = "hash"
    dim = 8

    def fits(self, text: str) -> bool:
        return True

    def embed(self, texts: list[str]) -> np.ndarray:
        rows = [np.random.default_rng(int(hashlib.sha256(t.encode()).hexdigest()[:8], 16)).normal(size=self.dim)
                for t in texts]
        vecs = np.stack(rows).astype(np.float32)
        return vecs / np.linalg.norm(vecs, axis=1, keepdims=True)


class CountedDraws(random.Random):
    """A seeded coin that counts its draws."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.draws = 0

    def random(self) -> float:
        self.draws += 1
        return super().random()


def plan(text: str) -> SemanticPlan:
    spec = SemanticSpec(max_error=0.05).resolved()
    assert spec is not None
    return SemanticPlan(text, "boundary", spec)


def test_an_injected_rng_draws_every_caches_exploration_coin():
    coin = CountedDraws()
    layer = SemanticLayer(SemanticConfig(shared=False), embedder=HashEmbedder(), rng=coin)
    try:
        first = layer.cache_for("f", plan("p1"), lambda a, b: a == b)
        second = layer.cache_for("g", plan("p1"), lambda a, b: a == b)
        assert first is not second
        scope = layer.scope("tenant", plan("p1"))
        first.lookup(scope, "p1", max_error=0.05)  # empty scope: still one draw
        first.insert(scope, "k1", "p1", "answer")
        first.lookup(scope, "p2", max_error=0.05)
        second.lookup(scope, "p3", max_error=0.05)
        assert coin.draws == 3
        first.lookup(scope, "p1", max_error=0.05)  # an exact match draws nothing
        assert coin.draws == 3
    finally:
        layer.close()


def test_the_rng_must_be_a_random_random():
    with pytest.raises(TypeError, match="rng must be a random.Random, got function"):
        SemanticLayer(SemanticConfig(), rng=lambda: 0.5)  # type: ignore[arg-type]


def test_background_work_that_fails_is_told_to_on_error_and_the_thread_goes_on():
    told: list[tuple[str, str]] = []
    layer = SemanticLayer(SemanticConfig(), on_error=lambda op, exc: told.append((op, str(exc))))
    ran: list[int] = []

    def broken() -> None:
        raise RuntimeError("judge service down")

    try:
        assert layer.later(broken) and layer.later(lambda: ran.append(1))
        layer.drain()
        assert told == [("learn", "judge service down")] and ran == [1]
    finally:
        layer.close()


CALLS = 300


class TopicEmbedder:
    """Texts "topic#variant": one direction per topic, each variant off it by noise of norm ``spread``: 0.01 for
    an even topic (similarity about 0.9999), 0.3 for an odd one (about 0.95)."""

    name = "topic"
    dim = 16

    def fits(self, text: str) -> bool:
        return True

    def embed(self, texts: list[str]) -> np.ndarray:
        rows = []
        for text in texts:
            topic = text.partition("#")[0]
            base, noise = (
                np.random.default_rng(int(hashlib.sha256(t.encode()).hexdigest()[:8], 16)).normal(size=self.dim)
                for t in (topic, text)
            )
            spread = 0.01 if int(topic[5:]) % 2 == 0 else 0.3
            rows.append(base / np.linalg.norm(base) + spread * noise / np.linalg.norm(noise))
        vecs = np.stack(rows).astype(np.float32)
        return vecs / np.linalg.norm(vecs, axis=1, keepdims=True)


def _decisions(rng: random.Random, calls: int = CALLS) -> list[tuple[str, str, bool | None]]:
    """What a runtime built with ``rng`` decides for one stream of calls through ``@cache_if``: each call's
    outcome, reason and whether its neighbour was explored. An even topic has one answer, an odd one an answer
    per variant: the judge's verdicts teach the error model both kinds, and its would-be hits are explored."""
    # A clock that stands still: nothing expires, and no decision reads the time of day.
    runtime = build_runtime(StoreConfig(), clock=lambda: 1_700_000_000.0, embedder=TopicEmbedder(), rng=rng)
    try:

        @cache_if("true", semantic={"max_error": 0.05}, store=runtime)
        def answer(prompt: str) -> str:
            topic, _, variant = prompt.partition("#")
            return f"about {topic}" if int(topic[5:]) % 2 == 0 else f"about {prompt}"

        for i in range(calls):
            answer(f"topic{i % 8}#{i}")
            runtime.semantic.drain()  # the link searches run before the next call, as in a serial replay
        return [
            (e.outcome, e.reason, None if e.semantic is None else e.semantic["explore"])
            for e in runtime.events.events()
        ]
    finally:
        runtime.close()


def test_two_runtimes_built_with_the_same_rng_explore_the_same_calls():
    first, second = _decisions(random.Random(7)), _decisions(random.Random(7))
    assert first == second
    reasons = {(outcome, reason) for outcome, reason, _ in first}
    assert {("hit", "semantic"), ("miss", "semantic-explore")} <= reasons  # would-be hits served and explored
    assert _decisions(random.Random(8)) != first  # another seed explores other calls


def test_build_runtime_refuses_an_rng_that_is_not_a_random_random():
    with pytest.raises(TypeError, match=r"build_runtime\(rng=\) takes a random.Random or None, got int"):
        build_runtime(StoreConfig(), rng=7)  # type: ignore[arg-type]


def test_the_shipped_prior_starts_a_rule_only_on_the_embedder_it_was_fitted_on():
    # the prior's weights read MiniLM similarities; another embedder's scale would start the model miscalibrated
    other = SemanticLayer(SemanticConfig(shared=False), embedder=HashEmbedder())
    minilm = SemanticLayer(SemanticConfig(shared=False))
    try:
        assert other.cache_for("f", plan("p1"), lambda a, b: a == b)._policy.model.prior is None
        started = minilm.cache_for("f", plan("p1"), lambda a, b: a == b)._policy.model.prior
        assert started is not None and started.meta["fit"]["embedder"] == minilm.embedder.name
    finally:
        other.close()
        minilm.close()
