"""bench/loop.py's figures: the static choice, detection, the post-drift share, gain errors, the harmful window,
the targets computed from them, and the policy grid over the scenario policies."""

from __future__ import annotations

from types import ModuleType

import pytest
from _bench_scripts import load_bench_script

from evocache.agents._types import Outcome, Request
from evocache.dsl import load_policy


@pytest.fixture
def loop(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_bench_script("loop", monkeypatch)


def test_tallies_count_keys_hits_and_wrong_answers_per_phase(loop: ModuleType) -> None:
    requests = [Request(t=0.0, kind="kv", keys=("a", "b", "c"), phase="A"),
                Request(t=1.0, kind="kv", keys=("d",), phase="B"),
                Request(t=2.0, kind="semantic", keys=("q",), phase="B")]
    outcomes = [Outcome(3, 2), Outcome(0, 0, bypass=True), Outcome(1, 1, wrong=True)]
    assert loop.tally(requests, outcomes) == loop.Tally(3, 5, 3, 1)
    assert loop.tally(requests, outcomes, "B") == loop.Tally(2, 2, 1, 1)
    both = loop.pooled([loop.Tally(1, 4, 1, 0), loop.Tally(3, 4, 3, 1)])
    assert (both, both.hit_ratio, both.wrong_rate) == (loop.Tally(4, 8, 4, 1), 0.5, 0.25)
    assert loop.Tally().hit_ratio == 0.0 and loop.Tally().wrong_rate == 0.0


def test_the_best_static_policy_is_eligible_and_the_earliest_on_a_tie(loop: ModuleType) -> None:
    T = loop.Tally
    scores = [T(10, 10, 5, 0), T(10, 10, 9, 2), T(10, 10, 5, 0), T(10, 10, 7, 0)]
    assert loop.best_of(scores, None) == 1
    assert loop.best_of(scores, 0.1) == 3  # the second serves 0.2 wrong answers per request
    assert loop.best_of(scores[:1] + scores[2:3], 0.1) == 0
    assert loop.best_of([T(10, 10, 9, 5)], 0.1) is None


def test_detection_counts_from_the_first_window_of_the_new_phase(loop: ModuleType) -> None:
    phases = [["A"], ["A"], ["A", "B"], ["B"], ["B"]]
    assert loop.first_window_of(phases, "B") == 2 and loop.first_window_of(phases, "C") is None
    assert loop.detection([False, True, False, False, True], 2) == {
        "drift_window": 2, "detected_at": 4, "delay_windows": 2, "false_alarms": [1]}
    assert loop.detection([False, False, False], 1) == {
        "drift_window": 1, "detected_at": None, "delay_windows": None, "false_alarms": []}
    assert loop.detection([False, True, True], None) == {
        "drift_window": None, "detected_at": None, "delay_windows": None, "false_alarms": [1, 2]}


def test_the_post_drift_share_pools_the_windows_after_detection(loop: ModuleType) -> None:
    T = loop.Tally
    ours = [T(1, 10, 5), T(1, 10, 1), T(1, 10, 4), T(1, 10, 8), T(1, 10, 9), T(1, 10, 9)]
    best = [T(1, 10, 5), T(1, 10, 8), T(1, 10, 8), T(1, 10, 8), T(1, 10, 0), T(1, 10, 9)]
    post = loop.post_drift(ours, best, 1)
    assert post == {"windows": [2, 3, 4], "loop": 21 / 30, "hindsight": 16 / 30, "share": 21 / 16,
                    "per_window": [0.5, 1.0, None]}
    assert loop.post_drift(ours, best, 4)["windows"] == [5]  # the trace ends first
    assert loop.post_drift(ours, best, 5) == {"windows": [], "loop": None, "hindsight": None, "share": None,
                                              "per_window": []}
    assert loop.post_drift(ours, best, None)["share"] is None


def test_gain_errors_judge_promoted_proposals_only(loop: ModuleType) -> None:
    proposals = [
        {"id": "p1", "window": 3, "status": "promoted", "predicted_gain": 0.05, "realised_gain": 0.055},
        {"id": "p2", "window": 6, "status": "promoted", "predicted_gain": 0.04, "realised_gain": 0.09},
        {"id": "p3", "window": 8, "status": "promoted", "predicted_gain": 0.02, "realised_gain": None},
        {"id": "p4", "window": 9, "status": "rolled_back", "predicted_gain": -0.1, "realised_gain": None},
    ]
    gains = loop.gain_errors(proposals)
    assert [(g["id"], g["within"]) for g in gains] == [("p1", True), ("p2", False), ("p3", None)]
    assert gains[0]["relative_error"] == pytest.approx(0.1) and gains[1]["relative_error"] == pytest.approx(1.25)


def test_the_harmful_change_goes_where_no_canary_is_out_and_it_can_be_judged(loop: ModuleType) -> None:
    canaries = [None, None, "p@2", "p@2", None, None, None]
    assert loop.harmful_window(canaries, 2, 2) == 4
    assert loop.harmful_window(canaries, 5, 2) is None
    assert loop.harmful_window(canaries, -3, 2) == 0


def test_targets_pass_or_fail_on_the_figures(loop: ModuleType) -> None:
    found = {"drift_window": 4, "detected_at": 5, "delay_windows": 1, "false_alarms": []}
    gains = [{"relative_error": 0.1, "within": True}, {"relative_error": None, "within": None}]
    rows = loop.drift_targets(found, {"share": 0.95}, gains, {"status": "rolled_back", "rolled_back": True})
    assert [(r["name"], r["passed"]) for r in rows] == [
        ("drift reported", True), ("no false drift", True), ("post-drift hit ratio", True),
        ("predicted gains come true", True), ("harmful change rolled back", True)]
    missed = {"drift_window": 4, "detected_at": None, "delay_windows": None, "false_alarms": [2]}
    rows = loop.drift_targets(missed, {"share": None}, [{"relative_error": -0.5, "within": False}], None)
    assert [(r["name"], r["passed"]) for r in rows] == [
        ("drift reported", False), ("no false drift", False), ("post-drift hit ratio", None),
        ("predicted gains come true", False)]
    assert loop.drift_targets(found, {"share": 0.89}, [], None)[2:] == [
        loop.target("post-drift hit ratio", ">= 90% of hindsight's over the 3 windows after detection", 0.89, False),
        loop.target("predicted gains come true", "every promoted proposal's realised gain within 20% of its "
                    "prediction", [], None)]


def test_the_grid_is_every_combination_of_the_loops_own_edit_kinds(loop: ModuleType) -> None:
    base = load_policy(loop.POLICIES / "kv-chat.yaml")
    kv = loop.grid(base, loop.kv_axes())
    assert [label for label, _ in kv][:4] == ["as written", "batchco l1_share 0.25", "batchco l1_share 0.1",
                                              "batch bypassed"]
    assert len(kv) == 12  # 3 eviction orders x (3 shares + a bypassed batch rule, whose share is moot)
    assert kv[0][1] == base
    bypassed = dict(kv)["eviction arc, batch bypassed"]
    assert bypassed.eviction.l1 == "arc" and not bypassed.decision_for("batch").cache
    assert dict(kv)["batchco l1_share 0.1"].tenants["batchco"].l1_share == 0.1
    faq = load_policy(loop.POLICIES / "faq.yaml")
    semantic = dict(loop.grid(faq, loop.semantic_axes()))
    assert len(semantic) == 15
    assert semantic["exact only, eviction s3fifo"].decision_for("faq").semantic is None
    assert semantic["max_error 0.05"].decision_for("faq").semantic.max_error == 0.05


def test_unknown_scenarios_are_refused(loop: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    assert loop.options(["--scenarios", "stationary,kv"]).scenarios == ["kv", "stationary"]
    with pytest.raises(SystemExit):
        loop.options(["--scenarios", "kv,tides"])
    assert "unknown tides; known: kv, semantic, stationary" in capsys.readouterr().err
