"""The loop's memory is graph state: a review resumed from another process sees the history the waiting pass
saw, and a pass resumed before its proposal is stored sees the candidate it planned; and the actuator keeps
the policy store's history and the proposal store's in step, a withdrawn canary and a reopened loop
included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from langgraph.checkpoint.sqlite import SqliteSaver

from evocache.agents._canary import CanaryEvidence, CanaryVerdict, Phase
from evocache.agents._evidence import ArmMetrics, Comparison, Judgement

from evocache.agents._loop import Loop, LoopConfig, build_graph, resume_review, thread_config
from evocache.agents._memory import empty_memory
from evocache.agents._proposals import ProposalStore
from evocache.agents._proposer import Candidate
from evocache.agents._run import LoopRunner, open_loop
from evocache.agents._types import Request
from evocache.controller.replay import PolicySimulator as Simulator
from evocache.controller import FilePolicyStore
from evocache.dsl import Policy, parse_policy

POLICY = """\
policy: chat
version: 1
defaults: {ttl: 60s}
rules:
  - {name: chat, when: 'true'}
guardrails:
  auto_approve: {ttl_change: 1.0}
  canary: {fraction: 0.5, windows: 1, max_windows: 1, min_requests: 50}
"""
CONFIG = LoopConfig(warmup=1, measure=1, retrain_every=0)
WINDOW = 200


def _requests(window: int) -> list[Request]:
    """A window of one request a second over 100 keys in turn: each key comes back after 100 s, so a ttl of
    60 s never hits and a doubled one does."""
    start = window * WINDOW
    return [
        Request(t=float(start + i), kind="response", keys=(f"k{(start + i) % 100}",), size=10, rule="chat")
        for i in range(WINDOW)
    ]


def _serve(runner: LoopRunner, policies: FilePolicyStore, sim: Simulator, window: int) -> None:
    state = policies.state()
    base = policies.load(state.active)
    canary = policies.load(state.canary) if state.canary else None
    if base != sim.policy:
        sim.use(base)
    span = _requests(window)
    outcomes = sim.run(span, canary=canary, fraction=state.fraction)
    runner.window(span, outcomes, (base, canary, state.fraction),
                  [canary is not None and sim.arm_of(r, state.fraction) for r in span])


def _open(tmp_path: Path, config: LoopConfig, text: str = POLICY) -> tuple[Loop, FilePolicyStore, Policy]:
    policy = parse_policy(text, "policy.yaml")
    policies = FilePolicyStore(tmp_path / "policies")
    loop = open_loop(policies, tmp_path, policy, capacity=10_000, config=config, diagnose=lambda *a, **k: [])
    return loop, policies, policy


def test_a_review_resumed_from_another_process_sees_the_memory_of_the_pass_that_waits(tmp_path: Path) -> None:
    interactive = LoopConfig(warmup=1, measure=1, retrain_every=0, interactive=True)
    loop, policies, policy = _open(tmp_path, interactive)
    sim = Simulator(policy, 10_000)
    with SqliteSaver.from_conn_string(str(tmp_path / "checkpoints.db")) as saver:
        runner = LoopRunner(loop, build_graph(loop, saver), run_id="run")
        for window in range(2):
            _serve(runner, policies, sim, window)
        (waiting,) = loop.proposals.list(status="proposed")
        assert waiting.thread_id == "run-w1"
        remembered = runner.memory
    assert [w["index"] for w in remembered["windows"]] == [0, 1] and remembered["served"] == 2
    assert remembered["series"]
    assert remembered["top_version"] == 2

    # another process: new stores, a new loop and graph over the same files
    with SqliteSaver.from_conn_string(str(tmp_path / "checkpoints.db")) as saver:
        policies_there = FilePolicyStore(tmp_path / "policies")
        there = Loop(policies_there, ProposalStore(tmp_path / "proposals.db"), capacity=10_000, config=CONFIG)
        graph = build_graph(there, saver)
        state = graph.get_state(thread_config("run-w1"))
        assert state.interrupts
        assert json.dumps(state.values["memory"], sort_keys=True) == json.dumps(remembered, sort_keys=True)
        records = there.records.of(state.values["memory"])
        assert [r.stats for r in records] == [r.stats for r in loop.records.of(remembered)]
        assert [list(r.requests) for r in records] == [_requests(0), _requests(1)]
        there.proposals.review(waiting.id, "approve", "alice", "")
        resumed = resume_review(graph, "run-w1", "approve", "alice")
    assert resumed["notes"] == ["rollout: canary"]
    # the canary starts at the window after the two the waiting pass remembered, not at an empty history's 0
    assert resumed["memory"]["canary_started"] == {waiting.id: 2}
    assert resumed["memory"]["windows"] == remembered["windows"]
    assert policies_there.state().canary == waiting.new_ref


def test_an_inconclusive_canary_is_withdrawn_in_both_histories(tmp_path: Path) -> None:
    # min_requests above any window's canary arm: the live split never counts, so the canary is never
    # promoted, and with max_windows 1 it is inconclusive at its first window
    text = POLICY.replace("min_requests: 50", "min_requests: 10000")
    loop, policies, policy = _open(tmp_path, CONFIG, text)
    sim = Simulator(policy, 10_000)
    with SqliteSaver.from_conn_string(str(tmp_path / "checkpoints.db")) as saver:
        runner = LoopRunner(loop, build_graph(loop, saver), run_id="run")
        for window in range(2):
            _serve(runner, policies, sim, window)
        (proposal,) = loop.proposals.list()
        assert proposal.status == "waiting"  # too little traffic to judge: a person decides
        loop.proposals.review(proposal.id, "approve", "alice", "")
        _serve(runner, policies, sim, 2)  # the next pass puts it on the canary
        assert loop.proposals.get(proposal.id).status == "canary"
        _serve(runner, policies, sim, 3)  # one window on the canary: inconclusive
    withdrawn = loop.proposals.get(proposal.id)
    assert withdrawn.status == "waiting"
    assert withdrawn.history[-1].note.startswith("inconclusive after 1 windows")
    assert policies.state().canary is None and policies.state().active == "chat@1"
    kinds = {"apply": "applied", "canary": "canary", "promote": "promoted", "rollback": "rolled_back"}
    theirs = [(kinds[h["action"]], h["ref"]) for h in policies.state().history]
    ours = [(r.kind, r.ref) for r in loop.proposals.policy_history()]
    assert theirs == [("applied", "chat@1"), ("canary", "chat@2"), ("rolled_back", "chat@2")]
    assert ours == theirs


def test_the_memory_stays_bounded_however_many_windows_are_served(tmp_path: Path) -> None:
    loop, policies, policy = _open(tmp_path, CONFIG)
    sim = Simulator(policy, 10_000)
    memory = empty_memory()
    for window in range(70):
        span = _requests(window)
        step = (policy, None, 0.0)
        memory, _ = loop.records.remember(memory, span, sim.run(span), step, [False] * len(span))
    assert memory["served"] == 70
    assert [w["index"] for w in memory["windows"]] == list(range(10, 70))  # what diagnosis reads: 60
    # requests for what replay reads: warmup 1 + realise 2 + the canary's max_windows 1 + 2
    assert [w["index"] for w in memory["windows"] if w["requests"]] == list(range(64, 70))
    # a process that has only the memory makes the same records
    stores = FilePolicyStore(tmp_path / "policies"), ProposalStore(tmp_path / "proposals.db")
    there = Loop(*stores, config=CONFIG)
    assert [r.stats for r in there.records.of(memory)] == [r.stats for r in loop.records.of(memory)]
    assert [r.requests for r in there.records.of(memory)][-1] == tuple(_requests(69))


def _on_canary(tmp_path: Path) -> tuple[Loop, FilePolicyStore, str, CanaryEvidence]:
    """A loop two windows in, its proposal on the canary, and canary evidence of a tie."""
    loop, policies, policy = _open(tmp_path, CONFIG)
    sim = Simulator(policy, 10_000)
    with SqliteSaver.from_conn_string(str(tmp_path / "checkpoints.db")) as saver:
        runner = LoopRunner(loop, build_graph(loop, saver), run_id="run")
        for window in range(2):
            _serve(runner, policies, sim, window)
    (proposal,) = loop.proposals.list(status="canary")
    arm = ArmMetrics(100, 0.4, 0.4, 0.0, 0.05, 10.0)
    replay = Comparison(arm, arm, 0.01, (0.0, 0.02), 0.0, 200)
    return loop, policies, proposal.id, CanaryEvidence(arm, arm, (0.0, -0.01, 0.01), replay, True)


@pytest.mark.parametrize(
    ("phase", "status", "last"),
    [
        ("promote", "promoted", ("promoted", "chat@2")),
        ("rollback", "rolled_back", ("rolled_back", "chat@2")),
        ("inconclusive", "waiting", ("rolled_back", "chat@2")),
        ("continue", "canary", ("canary", "chat@2")),
    ],
)
def test_every_verdict_moves_both_stores_together(
    tmp_path: Path, phase: Phase, status: str, last: tuple[str, str]
) -> None:
    loop, policies, proposal, evidence = _on_canary(tmp_path)
    done = loop.actuator.act(proposal, CanaryVerdict(phase, 1, f"{phase}: said so"), evidence)
    acted = {"promote": "promoted", "rollback": "rolled_back", "inconclusive": "waiting", "continue": "continue"}
    assert done == acted[phase]
    assert loop.proposals.get(proposal).status == status
    kinds = {"apply": "applied", "canary": "canary", "promote": "promoted", "rollback": "rolled_back"}
    theirs = [(kinds[h["action"]], h["ref"]) for h in policies.state().history]
    assert [(r.kind, r.ref) for r in loop.proposals.policy_history()] == theirs
    assert theirs[-1] == last


def test_a_promotions_realised_gain_is_written_by_the_actuator_as_its_actor(tmp_path: Path) -> None:
    loop, _, proposal, evidence = _on_canary(tmp_path)
    loop.actuator.act(proposal, CanaryVerdict("promote", 1, "promote: said so"), evidence)
    loop.actuator.realised(proposal, 0.042)
    assert loop.proposals.get(proposal).realised_gain == 0.042
    assert loop.proposals.audit(proposal)[-1].actor == loop.actuator.actor


def test_a_canary_no_running_replica_can_enforce_is_stale_in_both_stores_and_nothing_is_written(
        tmp_path: Path) -> None:
    from evocache.controller import PolicyFollower, RedisConfig, StoreConfig

    loop, policies, policy = _open(tmp_path, CONFIG)
    # a replica whose L2 has no l2_bytes: a policy giving a tenant an l2_share is one it cannot enforce
    PolicyFollower(policies, "model-a", lambda rollout: None).register(
        "run-1", StoreConfig(redis=RedisConfig(url="redis://10.0.0.5:6379/0")))
    cand = parse_policy(POLICY.replace("version: 1", "version: 2") + "tenants:\n  acme: {l2_share: 0.5}\n")
    span = _requests(0)
    memory, _ = loop.records.remember(empty_memory(), span, Simulator(policy, 10_000).run(span),
                                      (policy, None, 0.0), [False] * len(span))
    arm = ArmMetrics(100, 0.4, 0.4, 0.0, 0.05, 10.0)
    judged = Judgement(Comparison(arm, arm, 0.01, (0.0, 0.02), 0.0, 200), "lasting", (0, 0), 0.0)
    proposal, _ = loop.store(memory, Candidate.of(policy, cand, [], [], judged, "review"), None)
    loop.actuator.approve(proposal.id)
    before, history = policies.state(), loop.proposals.policy_history()
    assert loop.actuator.start_canary(proposal.id) == "stale"
    moved = loop.proposals.get(proposal.id)
    assert moved.status == "stale" and "replica model-a" in moved.history[-1].note
    assert policies.state() == before and loop.proposals.policy_history() == history


def test_the_candidate_is_graph_state_and_a_node_of_its_own_stores_it(tmp_path: Path) -> None:
    loop, policies, policy = _open(tmp_path, CONFIG)
    sim = Simulator(policy, 10_000)
    memory = empty_memory()
    for window in range(2):
        span = _requests(window)
        memory, _ = loop.records.remember(memory, span, sim.run(span), (policy, None, 0.0), [False] * WINDOW)
    with SqliteSaver.from_conn_string(str(tmp_path / "checkpoints.db")) as saver:
        graph = build_graph(loop, saver)
        start = {"run": "run", "thread": "run-w1", "window": 1, "memory": memory}
        graph.invoke(start, thread_config("run-w1"), interrupt_before=["store"], durability="sync")
        assert graph.get_state(thread_config("run-w1")).next == ("store",)
    assert loop.proposals.list() == []  # planned and judged: nothing written yet

    # another process: the candidate comes back from the checkpoint as the plain data it was left as
    with SqliteSaver.from_conn_string(str(tmp_path / "checkpoints.db")) as saver:
        there = Loop(FilePolicyStore(tmp_path / "policies"), ProposalStore(tmp_path / "proposals.db"),
                     capacity=10_000, config=CONFIG)
        graph = build_graph(there, saver)
        plain = graph.get_state(thread_config("run-w1")).values["candidate"]
        assert json.loads(json.dumps(plain)) == plain
        candidate = Candidate.from_dict(plain)
        assert Candidate.from_dict(candidate.to_dict()) == candidate
        assert candidate.base == "chat@1" and candidate.ref == "chat@2" and candidate.route == "approve"
        assert [(e.path, e.new) for e in candidate.edits] == [("rules.chat.ttl", 120.0)]
        assert candidate.judgement.comparison.gain > 0
        ended = graph.invoke(None, thread_config("run-w1"), durability="sync")
    (stored,) = there.proposals.list()
    assert ended["proposal"] == stored.id and ended["notes"] == ["rollout: canary"]
    assert stored.new_policy == candidate.document and candidate.policy().ref == stored.new_ref
    assert stored.predicted_gain == candidate.judgement.comparison.gain
    assert [dict(e) for e in stored.edits] == [e.to_dict() for e in candidate.edits]
    assert stored.status == "canary" and policies.state().canary == "chat@2"
    assert ended["memory"]["top_version"] == 2


def test_a_loop_opened_again_on_its_stores_records_the_policy_in_force_once(tmp_path: Path) -> None:
    kinds = {"apply": "applied", "canary": "canary", "promote": "promoted", "rollback": "rolled_back"}

    def histories(loop: Loop, policies: FilePolicyStore) -> tuple[list[tuple[str, str]], ...]:
        theirs = [(kinds[h["action"]], h["ref"]) for h in policies.state().history]
        return theirs, [(r.kind, r.ref) for r in loop.proposals.policy_history()]

    for _ in range(2):
        loop, policies, _ = _open(tmp_path, CONFIG)
        theirs, ours = histories(loop, policies)
        assert theirs == ours == [("applied", "chat@1")]
    # a newer version given over the one in force (as agent run does) is applied and recorded once
    newer = parse_policy(POLICY.replace("version: 1", "version: 2"), "policy.yaml")
    for _ in range(2):
        replace = policies.state().active != "chat@2"
        loop = open_loop(policies, tmp_path, newer, capacity=10_000, config=CONFIG,
                         diagnose=lambda *a, **k: [], replace=replace)
        theirs, ours = histories(loop, policies)
        assert theirs == ours == [("applied", "chat@1"), ("applied", "chat@2")]
