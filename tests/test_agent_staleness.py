"""Evidence stops holding: a proposal judged under one context (policy, model, template, outputs) becomes
stale when the context moves, and an approved one is not rolled out on it."""

from __future__ import annotations

import random
from pathlib import Path

from evocache.agents._candidates import Edit, apply_edits
from evocache.agents._loop import LoopConfig, LoopContext
from evocache.agents._proposals import ProposalStore
from evocache.agents._types import Request
from evocache.agents._whatif import Simulator
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


def _loop(tmp_path: Path) -> tuple[LoopContext, Simulator]:
    policy = parse_policy(POLICY, "policy.yaml")
    policies = FilePolicyStore(tmp_path / "policies")
    policies.apply(policy)
    ctx = LoopContext(policies, ProposalStore(tmp_path / "proposals.db"), capacity=3000,
                      config=LoopConfig(warmup=1, measure=1), model=("m", "r1", "t1"))
    return ctx, Simulator(policy, 3000)


def _serve(ctx: LoopContext, sim: Simulator, requests: list[Request]) -> None:
    base = ctx.active()
    ctx.record(requests, sim.run(requests), (base, None, 0.0), [False] * len(requests))


def _propose(ctx: LoopContext) -> str:
    base = ctx.active()
    cand = apply_edits(base, [Edit("ttl", "rules.chat.ttl", None, 7200.0, "test")], base.version + 1)
    proposal = ctx._store_proposal(base, cand, [Edit("ttl", "rules.chat.ttl", None, 7200.0, "test")], [],
                                   ctx.judge(base, cand), None)
    return proposal.id


def test_outputs_of_another_shape_make_an_undecided_proposal_stale(tmp_path: Path) -> None:
    ctx, sim = _loop(tmp_path)
    rng = random.Random(0)
    for i in range(2):
        _serve(ctx, sim, _window(rng, 200.0 * i, 100))
    waiting = _propose(ctx)
    _serve(ctx, sim, _window(rng, 400.0, 100))
    assert ctx.check_evidence() == []  # the same traffic: the evidence holds
    for i in range(3, 5):
        _serve(ctx, sim, _window(rng, 200.0 * i, 1600))  # sixteen times longer answers
    ((pid, reason),) = ctx.check_evidence()
    assert pid == waiting and reason.startswith("output distribution changed")
    assert ctx.proposals.get(waiting).status == "stale"


def test_a_new_model_revision_makes_an_approved_proposal_stale_before_its_canary(tmp_path: Path) -> None:
    ctx, sim = _loop(tmp_path)
    rng = random.Random(1)
    for i in range(2):
        _serve(ctx, sim, _window(rng, 200.0 * i, 100))
    approved = _propose(ctx)
    ctx.proposals.review(approved, "approve", "person", "")
    ctx.model = ("m", "r2", "t1")
    ((pid, reason),) = ctx.check_evidence()
    assert pid == approved and reason == "model revision changed from r1 to r2"
    assert ctx.proposals.get(approved).status == "stale"
    assert ctx.policies.state().canary is None  # nothing was rolled out on the old evidence
    assert ctx.check_evidence() == []  # stale is left alone
