"""SemanticLayer: the runtime's semantic side, here its injected exploration coin."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest
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
