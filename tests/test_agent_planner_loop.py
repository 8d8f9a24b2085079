"""The planner inside the loop: its edits join the candidates and are judged by replay like the others, and
its rationale is stored with the proposal. The chat model is scripted (no hosted LLM here)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from langchain_core.messages import AIMessage
from langgraph.checkpoint.memory import InMemorySaver
from test_agent_planner import ScriptedChat

from evocache.agents._loop import LoopConfig, build_graph
from evocache.agents._planner import Planner
from evocache.agents._run import LoopRunner, default_capacity, open_loop
from evocache.agents._scenarios import kv_drift
from evocache.controller.replay import PolicySimulator as Simulator
from evocache.agents._workload import read_requests, windows
from evocache.controller import FilePolicyStore
from evocache.dsl import parse_policy

DATA = Path(__file__).parent / "data" / "agents_diag"
POLICY = """\
policy: kv-chat
version: 1
defaults: {ttl: 1d}
rules:
  - {name: chat, when: 'true', kv: {reuse: prefix}}
  - {name: batch, when: 'false', kv: {reuse: prefix}}
guardrails:
  auto_approve: {bypass: true}
  canary: {fraction: 0.3, windows: 1, max_windows: 2, min_requests: 20}
"""


def test_the_planners_edit_is_judged_by_replay_and_its_rationale_kept(tmp_path: Path) -> None:
    mooncake = tmp_path / "mooncake.jsonl"
    with gzip.open(DATA / "mooncake_head2400.jsonl.gz", "rt") as src:
        mooncake.write_text(src.read())
    requests = read_requests(kv_drift(mooncake, tmp_path / "drift.jsonl", requests=1600))
    answer = json.dumps({"rationale": "the batch documents never come back",
                         "edits": [{"path": "rules.batch.cache", "new": "bypass"}]})
    chat = ScriptedChat(reply=lambda n: AIMessage(answer), calls=[], offered=[])
    policy = parse_policy(POLICY, "policy.yaml")
    capacity = default_capacity(requests, 0.1)
    policies = FilePolicyStore(tmp_path / "policies")
    # no findings: the loop's own candidates are only its routine ttl and min-tokens ones; the bypass is the planner's
    ctx = open_loop(policies, tmp_path, policy, capacity=capacity, config=LoopConfig(retrain_every=0),
                    diagnose=lambda *a, **k: [])
    ctx.proposer.planner = Planner(chat)
    runner = LoopRunner(ctx, build_graph(ctx, InMemorySaver()))
    sim = Simulator(policy, capacity)
    for span in windows(requests, 200):
        state = policies.state()
        base = policies.load(state.active)
        canary = policies.load(state.canary) if state.canary else None
        if base != sim.policy:
            sim.use(base)
        outcomes = sim.run(span, canary=canary, fraction=state.fraction)
        runner.window(span, outcomes, (base, canary, state.fraction),
                      [canary is not None and sim.arm_of(r, state.fraction) for r in span])
    assert chat.calls, "the planner was asked"
    made = ctx.proposals.list()
    assert made, "the planner's bypass, judged by replay, made a proposal"
    for p in made:
        assert p.rationale == "the batch documents never come back"
        assert [e["path"] for e in p.edits] == ["rules.batch.cache"] and p.evidence is not None
        assert p.predicted_gain > 0  # proposed only because replay found it better
