"""The calibration's confidence sequence: it covers the true ratio of wrong to estimated answers at its level
uniformly over time, it narrows as verdicts arrive, and the error it paces stays within the bound at every
point of a stream."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
from evocache.controller.semantic import Scope
from evocache.controller.semantic._cache import SemanticCache
from evocache.controller.semantic._decide import Calibration, calibration_upper
from test_semantic_decide import TableEmbedder, synthetic_stream

SCOPE = Scope("tenant-a", "fn@model:rev")


def _bernoulli(seed: int, ratio: float, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Estimates, and verdicts wrong with chance ``ratio`` x the estimate: the true ratio is ``ratio``."""
    rng = np.random.default_rng(seed)
    est = rng.uniform(0.02, 0.3, size=n)
    return est, rng.random(n) < ratio * est


@pytest.mark.parametrize(("ratio", "confidence"), [(0.5, 0.9), (1.0, 0.9), (3.0, 0.9), (1.0, 0.975)])
def test_the_upper_end_is_below_the_true_ratio_at_some_time_at_most_at_its_level(
    ratio: float, confidence: float
) -> None:
    streams, n = 200, 300
    crossed = 0
    for seed in range(streams):
        calibration = Calibration(confidence=confidence)
        below = False
        for est, wrong in zip(*_bernoulli(seed, ratio, n), strict=True):
            calibration.explored(float(est), bool(wrong))
            below = below or calibration.upper < ratio
        crossed += below
    # Ville's inequality bounds the chance of ever crossing by 1 - confidence, however often it is read.
    assert crossed <= (1 - confidence) * streams


def test_a_fixed_sample_bound_read_after_every_verdict_crosses_more_often_than_its_level() -> None:
    # Why the calibration is a sequence: the Gamma quantile it replaces holds at one fixed sample size, and
    # a pacer reads it after every verdict, so over a stream it is below the true ratio far more often.
    from scipy.stats import gamma

    streams, n, confidence = 200, 300, 0.9
    fixed = sequence = 0
    for seed in range(streams):
        est, wrong = _bernoulli(seed, 1.0, n)
        quantiles = gamma.ppf(confidence, 2.0 + np.cumsum(wrong), scale=1.0 / (2.0 + np.cumsum(est)))
        fixed += bool((quantiles < 1.0).any())
        calibration = Calibration(confidence=confidence)
        below = False
        for e, w in zip(est, wrong, strict=True):
            calibration.explored(float(e), bool(w))
            below = below or calibration.upper < 1.0
        sequence += below
    assert fixed > 2 * (1 - confidence) * streams > sequence


def test_the_sequence_narrows_as_verdicts_arrive() -> None:
    est, wrong = _bernoulli(7, 1.0, 5000)
    calibration = Calibration()
    uppers = {}
    for i, (e, w) in enumerate(zip(est, wrong, strict=True), 1):
        calibration.explored(float(e), bool(w))
        if i in (100, 300, 1000, 5000):
            uppers[i] = calibration.upper
    assert uppers[100] > uppers[300] > uppers[1000] > uppers[5000] >= 1.0
    assert uppers[5000] < 1.2  # some 800 expected wrong answers: within 20 % of the true ratio
    # Once the sequence is below the cap it is the value read, so the unused budget shrinks with it.
    assert calibration.bounded and calibration.value == uppers[5000]


def test_no_exploration_reads_the_prior_alone() -> None:
    calibration = Calibration()
    assert calibration.upper == math.inf and not calibration.bounded
    assert calibration.value == calibration.start == pytest.approx(calibration_upper(0, 0.0, prior=2.0,
                                                                                     confidence=0.975))
    assert calibration.n == calibration.wrong == 0 and calibration.expected == 0.0


def test_a_young_sequence_is_capped_by_the_fixed_sample_bound_which_rises_with_wrong_answers() -> None:
    # All wrong: only ratios that would make a wrong answer likelier than certain (above 1 / 0.05) are
    # rejected; the cap follows the wrong answers up, so the pacer tightens while the sequence says nothing.
    calibration = Calibration()
    values = []
    for _ in range(20):
        calibration.explored(0.05, wrong=True)
        values.append(calibration.value)
    assert calibration.upper >= 1 / 0.05 and not calibration.bounded
    assert values == sorted(values) and values[0] > calibration.start
    assert calibration.value == pytest.approx(calibration_upper(20, 1.0, prior=2.0, confidence=0.975))


def test_tiny_estimates_bound_nothing_for_long_and_never_overflow() -> None:
    calibration = Calibration()
    for i in range(5000):
        calibration.explored(1e-6, wrong=i == 2500)
    # 0.005 expected wrong answers in all: the sequence cannot bound the ratio near 1, the cap holds
    assert math.isfinite(calibration.value) and calibration.value >= calibration.start
    assert calibration.upper > 100
    zero = Calibration()
    zero.explored(0.0, wrong=True)  # an estimate of 0 that was wrong: no bet is lost past the stake
    assert zero.upper == math.inf and math.isfinite(zero.value)
    for bad in (-0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match="est_error must be in"):
            Calibration().explored(bad, wrong=False)


def test_a_model_that_is_right_more_often_than_it_says_is_read_below_one() -> None:
    est, wrong = _bernoulli(3, 0.3, 4000)
    calibration = Calibration()
    for e, w in zip(est, wrong, strict=True):
        calibration.explored(float(e), bool(w))
    assert calibration.bounded and 0.3 <= calibration.value < 0.5


def _prefix_errors(cache: SemanticCache, stream: list[tuple[str, str]], delta: float) -> list[float]:
    """The realised error per lookup after each lookup of ``stream``."""
    wrong, errors = 0, []
    for i, (prompt, group) in enumerate(stream):
        decision, entry = cache.lookup(SCOPE, prompt, max_error=delta)
        if entry is not None:
            wrong += cache.answer_ref(entry) != group
        else:
            cache.insert(SCOPE, f"e{i}", prompt, group)
            cache.judge_miss(SCOPE, prompt, group, decision)
        errors.append(wrong / (i + 1))
    return errors


@pytest.mark.parametrize("rng_seed", range(6))
def test_the_error_stays_within_the_bound_at_every_point_of_a_synthetic_stream(rng_seed: int) -> None:
    stream, table = synthetic_stream(rng_seed % 3)
    cache = SemanticCache(TableEmbedder(table), rng=random.Random(200 + rng_seed))
    errors = _prefix_errors(cache, stream, 0.02)
    assert max(errors[999:]) <= 0.02  # from the 1,000th lookup on: the cold start is paid back by then
    assert cache.stats().served >= 0.3 * len(stream)


@pytest.fixture(scope="module")
def banking() -> tuple[list[tuple[str, str]], dict[str, np.ndarray]]:
    from evocache.controller.semantic import SentenceTransformerEmbedder

    path = Path(__file__).resolve().parent.parent / "examples" / "data" / "banking77_train.jsonl"
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for _, line in zip(range(600), f, strict=False)]
    stream = [(r["prompt"], r["group"]) for r in rows]
    texts = list(dict.fromkeys(p for p, _ in stream))
    vecs = SentenceTransformerEmbedder().embed(texts)
    return stream, dict(zip(texts, vecs, strict=True))


@pytest.mark.parametrize(("delta", "seed"), [(0.02, 0), (0.02, 1), (0.05, 0), (0.05, 1)])
def test_the_error_stays_within_the_bound_at_every_point_of_a_real_stream(
    banking: tuple[list[tuple[str, str]], dict[str, np.ndarray]], delta: float, seed: int
) -> None:
    stream, table = banking
    cache = SemanticCache(TableEmbedder(table), rng=random.Random(seed))
    errors = _prefix_errors(cache, stream, delta)
    assert max(errors[199:]) <= delta
    assert cache.stats().served >= 0.1 * len(stream)
