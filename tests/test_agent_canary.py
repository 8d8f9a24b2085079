"""The canary's analysis over plain data: promote, roll back, continue or inconclusive, and nothing else."""

from __future__ import annotations

import pytest

from evocache.agents._canary import CanaryAnalysis, CanaryEvidence, CanaryRules, analyse_canary
from evocache.agents._evidence import ArmMetrics, Comparison

RULES = CanaryRules(windows=1, max_windows=3, max_drop=0.05, min_requests=50, max_error_rate=0.01)


def arm(hit_ratio: float, requests: int = 100, wrong_rate: float = 0.0) -> ArmMetrics:
    return ArmMetrics(requests, hit_ratio, hit_ratio, wrong_rate, 0.05, 10.0)


def replay(gain: float, low: float, high: float, wrong: float = 0.0) -> Comparison:
    return Comparison(arm(0.4), arm(0.4 + gain, wrong_rate=wrong), gain, (low, high), wrong, 400)


def evidence(
    *,
    canary: ArmMetrics | None = None,
    base: ArmMetrics | None = None,
    difference: tuple[float, float, float] = (0.0, -0.01, 0.01),
    fresh: Comparison | None = None,
    local: bool = True,
) -> CanaryEvidence:
    return CanaryEvidence(
        canary or arm(0.4), base or arm(0.4), difference, fresh or replay(0.02, 0.01, 0.03), local
    )


def test_too_few_windows_go_on_without_evidence() -> None:
    rules = CanaryRules(windows=2, max_windows=4, max_drop=0.05, min_requests=50, max_error_rate=None)
    verdict = analyse_canary(rules, 1, None)
    assert (verdict.phase, verdict.windows, verdict.reason) == ("continue", 1, "")


def test_a_gain_with_enough_canary_requests_is_promoted() -> None:
    assert analyse_canary(RULES, 1, evidence()).phase == "promote"


def test_a_low_end_within_the_tolerance_is_promoted() -> None:
    # the tolerance is 5 % of the base arm's 0.4: a low end of -0.019 is within it, -0.021 is not
    assert analyse_canary(RULES, 1, evidence(fresh=replay(0.01, -0.019, 0.03))).phase == "promote"
    assert analyse_canary(RULES, 1, evidence(fresh=replay(0.01, -0.021, 0.03))).phase == "continue"


def test_a_replayed_loss_beyond_the_tolerance_rolls_back() -> None:
    verdict = analyse_canary(RULES, 1, evidence(fresh=replay(-0.2, -0.3, -0.1)))
    assert verdict.phase == "rollback"
    assert verdict.reason == (
        "replayed over the canary's windows, the change loses hit ratio: -0.2000 (the interval ends at "
        "-0.1000, beyond the tolerance 0.0200)"
    )


def test_replayed_wrong_answers_rising_without_a_gain_roll_back() -> None:
    verdict = analyse_canary(RULES, 1, evidence(fresh=replay(-0.001, -0.01, 0.0, wrong=0.02)))
    assert (verdict.phase, verdict.reason) == (
        "rollback",
        "replayed over the canary's windows, wrong answers rise by +0.0200",
    )


def test_the_canary_arm_breaking_the_slo_rolls_back() -> None:
    verdict = analyse_canary(RULES, 1, evidence(canary=arm(0.4, wrong_rate=0.05)))
    assert (verdict.phase, verdict.reason) == ("rollback", "SLO breach: canary error rate 0.0500 > 0.01")


def test_a_live_loss_rolls_back_a_local_change_only() -> None:
    lower = {"canary": arm(0.2), "difference": (-0.2, -0.3, -0.1)}
    assert analyse_canary(RULES, 1, evidence(**lower, local=True)).phase == "rollback"
    # a cache-wide change: the arms differ in their traffic more than in their policy; the replay decides
    assert analyse_canary(RULES, 1, evidence(**lower, local=False)).phase == "promote"


def test_the_live_split_counts_only_with_enough_canary_requests() -> None:
    few = evidence(canary=arm(0.2, requests=10, wrong_rate=0.5), difference=(-0.2, -0.3, -0.1))
    # neither the SLO nor the hit ratio of ten requests says anything; nor is it promoted on them
    assert analyse_canary(RULES, 1, few).phase == "continue"


@pytest.mark.parametrize("windows", [1, 2])
def test_neither_a_breach_nor_a_pass_goes_on_before_max_windows(windows: int) -> None:
    assert analyse_canary(RULES, windows, evidence(fresh=replay(0.0, -0.01, 0.01))).phase == "continue"


def test_neither_a_breach_nor_a_pass_at_max_windows_is_inconclusive_never_a_pass() -> None:
    neither = evidence(fresh=replay(0.0, -0.01, 0.01), difference=(0.01, -0.02, 0.04))
    verdict = analyse_canary(RULES, 3, neither)
    assert verdict.phase == "inconclusive"
    assert verdict.reason == (
        "inconclusive after 3 windows: 100 canary requests, replayed gain +0.0000 [-0.0100, +0.0100], live "
        "difference +0.0100 [-0.0200, +0.0400]"
    )


def test_evidence_survives_its_plain_form() -> None:
    found = evidence(canary=arm(0.3, wrong_rate=0.001), difference=(-0.1, -0.2, 0.0), local=False)
    assert CanaryEvidence.from_dict(found.to_dict()) == found


def test_an_analysis_survives_its_plain_form_with_its_evidence_or_without() -> None:
    found = evidence(difference=(-0.15, -0.2, -0.1))
    judged = CanaryAnalysis("p-1", analyse_canary(RULES, 2, found), (4, 5), found)
    assert judged.verdict.phase == "rollback"
    assert CanaryAnalysis.from_dict(judged.to_dict()) == judged
    early = CanaryAnalysis("p-1", analyse_canary(RULES, 0, None), (5, 5), None)
    assert CanaryAnalysis.from_dict(early.to_dict()) == early
