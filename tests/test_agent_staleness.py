"""Evidence stops holding: a proposal judged under one context (policy, model, template, outputs) becomes
stale when the context moves, and an approved one is not rolled out on it."""

from __future__ import annotations

import random
from pathlib import Path

from evocache.agents._candidates import Edit, apply_edits
from evocache.agents._loop import Loop, LoopConfig
from evocache.agents._memory import Memory, empty_memory
from evocache.agents._proposals import ProposalStore
from evocache.agents._proposer import Candidate
from evocache.agents._types import Request
from evocache.controller.replay import PolicySimulator as Simulator
from evocache.controller import FilePolicyStore
from evocache.dsl import parse_policy

POLICY = """\
policy: chat
version: 1
defaults: {ttl: 1h}
rules:
  - {name: chat, when: 'true'}
"""


def _window(rng: random.Random, start: float, output_tokens: int) -> list[Request]:
    return [Request(t=start + i, kind="response", keys=(f"k{rng.randrange(40)}",), size=100, rule="chat",
                    output_tokens=max(1, int(rng.gauss(output_tokens, output_tokens / 5))))
            for i in range(200)]


class _Served:
    """The loop and the memory it has of the windows served so far."""

    def __init__(self, tmp_path: Path) -> None:
        policy = parse_policy(POLICY, "policy.yaml")
        policies = FilePolicyStore(tmp_path / "policies")
        policies.apply(policy)
        self.loop = Loop(policies, ProposalStore(tmp_path / "proposals.db"), capacity=3000,
                         config=LoopConfig(warmup=1, measure=1), model=("m", "r1", "t1"))
        self.sim = Simulator(policy, 3000)
        self.memory: Memory = empty_memory()

    def serve(self, requests: list[Request]) -> None:
        base = self.loop.active()
        self.memory, _ = self.loop.records.remember(self.memory, requests, self.sim.run(requests),
                                                    (base, None, 0.0), [False] * len(requests))

    def propose(self) -> str:
        loop, base = self.loop, self.loop.active()
        edit = Edit("ttl", "rules.chat.ttl", None, 7200.0, "test")
        cand = apply_edits(base, [edit], base.version + 1)
        judged = loop.judge.replay(loop.records.of(self.memory), base, cand)
        candidate = Candidate.of(base, cand, [edit], [], judged, "review")
        proposal, self.memory = loop.store(self.memory, candidate, None)
        return proposal.id

    def check_evidence(self) -> list[tuple[str, str]]:
        moved, self.memory = self.loop.check_evidence(self.memory)
        return moved


def test_outputs_of_another_shape_make_an_undecided_proposal_stale(tmp_path: Path) -> None:
    served = _Served(tmp_path)
    rng = random.Random(0)
    for i in range(2):
        served.serve(_window(rng, 200.0 * i, 100))
    waiting = served.propose()
    served.serve(_window(rng, 400.0, 100))
    assert served.check_evidence() == []  # the same traffic: the evidence holds
    for i in range(3, 5):
        served.serve(_window(rng, 200.0 * i, 1600))  # sixteen times longer answers
    ((pid, reason),) = served.check_evidence()
    assert pid == waiting and reason.startswith("output distribution changed")
    assert served.loop.proposals.get(waiting).status == "stale"


def test_a_new_model_revision_makes_an_approved_proposal_stale_before_its_canary(tmp_path: Path) -> None:
    served = _Served(tmp_path)
    rng = random.Random(1)
    for i in range(2):
        served.serve(_window(rng, 200.0 * i, 100))
    approved = served.propose()
    served.loop.proposals.review(approved, "approve", "person", "")
    served.loop.judge.model = ("m", "r2", "t1")
    ((pid, reason),) = served.check_evidence()
    assert pid == approved and reason == "model revision changed from r1 to r2"
    assert served.loop.proposals.get(approved).status == "stale"
    assert served.loop.policies.state().canary is None  # nothing was rolled out on the old evidence
    assert served.check_evidence() == []  # stale is left alone
