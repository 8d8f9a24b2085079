"""The one place the loop writes: the policy store serving reads and the proposal store, together.

Every move of a rollout changes both stores: the policy store's state (and its history) and the proposal's
status (and the proposal store's policy history). ``Actuator`` makes each move in one method, so the two
histories agree after every one:

    start_canary   apply the new version as the canary     record canary       proposal -> canary
    promote        promote the canary                      record promoted     proposal -> promoted
    roll_back      roll the canary back (a breach)         record rolled_back  proposal -> rolled_back
    withdraw       roll the canary back (inconclusive)     record rolled_back  proposal -> waiting

and ``adopt``, which starts the loop on the policy store: the policy in force is recorded as applied in the
proposal store's history once, whether the loop applied it or found it there, and not again when the loop is
opened anew on the same stores. Then the writes that touch the proposal store alone: ``add`` (a new
proposal), ``review`` (a person's verdict), ``approve`` (inside the guardrails), ``hold`` (too little traffic
to judge: a person decides), ``invalidate`` (evidence that no longer holds), ``stale``, ``supersede`` and
``realised`` (what a promotion gained once it ran). The analysis that chooses a move is elsewhere
(``agents._canary``); what the loop remembers of it (the window a canary started at) is the caller's state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from evocache.controller import PolicyStore, UnenforceablePolicy
from evocache.dsl import Policy, parse_policy, policy_to_yaml

from ._canary import CanaryEvidence, CanaryVerdict

HOLD_NOTE = "inconclusive evidence: too little traffic to judge"


class Actuator:
    """Acts on ``policies`` (a ``PolicyStore``) and ``proposals`` (a ``ProposalStore``) as ``actor``."""

    def __init__(self, policies: PolicyStore, proposals: Any, actor: str) -> None:
        self.policies = policies
        self.proposals = proposals
        self.actor = actor

    def adopt(self, policy: Policy, *, replace: bool = False) -> Policy:
        """Put ``policy`` in force when the policy store has none (with ``replace``, over the one in force),
        and record the policy in force as applied in the proposal store's history unless that history has it
        in force already; the policy in force."""
        if replace or self.policies.state().active is None:
            self.policies.apply(policy)
        active = self.policies.load(self.policies.state().active)
        if _in_force(self.proposals.policy_history()) != str(active.ref):
            self.proposals.record_policy(
                str(active.ref), policy_to_yaml(active), kind="applied", actor=self.actor
            )
        return active

    def start_canary(self, proposal_id: str) -> str:
        """Put an approved proposal on the canary at its base's ``guardrails.canary.fraction``: ``canary``.
        ``stale`` (and the proposal moved there) when its base is no longer the policy in force or a canary
        is out: its evidence is older than the policy it would replace; also when the policy store refuses it
        because a running replica cannot enforce it (``UnenforceablePolicy``: nothing was written to either
        store, and the note names the replica and why)."""
        proposal = self.proposals.get(proposal_id)
        state = self.policies.state()
        if state.active != proposal.base_policy or state.canary is not None:
            self.stale(proposal.id, f"the policy in force is {state.active}, not {proposal.base_policy}")
            return "stale"
        fraction = self.policies.load(state.active).guardrails.rollout.fraction
        try:
            self.policies.apply(parse_policy(proposal.new_policy, proposal.new_ref), canary=fraction)
        except UnenforceablePolicy as exc:
            self.stale(proposal.id, f"refused by the policy store: {exc}")
            return "stale"
        self._record(proposal, "canary")
        self.proposals.transition(proposal.id, "canary", actor=self.actor, note=f"canary on {fraction:.0%}")
        return "canary"

    def act(self, proposal_id: str, verdict: CanaryVerdict, evidence: CanaryEvidence | None) -> str:
        """Carry out ``verdict`` on the canary of ``proposal_id``; what it did: ``promoted``, ``rolled_back``,
        ``waiting`` (withdrawn, inconclusive) or ``continue`` (nothing)."""
        if verdict.phase == "continue":
            return "continue"
        proposal = self.proposals.get(proposal_id)
        if verdict.phase == "promote":
            assert evidence is not None, "a canary is promoted on evidence"
            replay, can, bas = evidence.replay, evidence.canary, evidence.base
            self.policies.promote()
            self._record(proposal, "promoted")
            self.proposals.transition(
                proposal.id,
                "promoted",
                actor=self.actor,
                note=f"replayed gain over the canary's windows {replay.gain:+.4f} [{replay.ci[0]:+.4f}, "
                f"{replay.ci[1]:+.4f}]; canary arm hit ratio {can.hit_ratio:.3f} against {bas.hit_ratio:.3f}",
            )
            return "promoted"
        self.policies.rollback()
        self._record(proposal, "rolled_back")
        if verdict.phase == "rollback":
            self.proposals.transition(proposal.id, "rolled_back", actor=self.actor, note=verdict.reason)
            return "rolled_back"
        # inconclusive never passes: the canary is withdrawn and the proposal waits for a person
        self.proposals.transition(proposal.id, "waiting", actor=self.actor, note=verdict.reason)
        return "waiting"

    def add(self, proposal: Any) -> Any:
        """Store a new proposal; it as stored."""
        return self.proposals.add(proposal, actor=self.actor)

    def review(self, proposal_id: str, verdict: str, reviewer: str, note: str = "") -> Any:
        """Record ``reviewer``'s ``verdict`` (approve or reject); the proposal as moved."""
        return self.proposals.review(proposal_id, verdict, reviewer, note)

    def approve(self, proposal_id: str, note: str = "inside the policy's guardrails.auto_approve") -> None:
        """Approve a proposal every edit of which the guardrails allow."""
        self.review(proposal_id, "approve", "guardrails", note)

    def invalidate(self, proposal_id: str, now: Any) -> str | None:
        """Move an undecided proposal whose evidence the context ``now`` invalidates to stale; the reason, or
        None when its evidence holds."""
        return self.proposals.invalidate(proposal_id, now, actor=self.actor)

    def hold(self, proposal_id: str) -> None:
        """A proposal whose evidence counted too few requests waits for a person."""
        self.proposals.transition(proposal_id, "waiting", actor=self.actor, note=HOLD_NOTE)

    def stale(self, proposal_id: str, note: str) -> None:
        self.proposals.transition(proposal_id, "stale", actor=self.actor, note=note)

    def supersede(self, newer: str) -> list[str]:
        """Move every proposal still waiting for a decision (``proposed``, ``waiting``) other than ``newer``
        to stale: its evidence is older than ``newer``'s, judged on the same policy or an older one."""
        moved = []
        for p in self.proposals.list():
            if p.id != newer and p.status in ("proposed", "waiting"):
                self.stale(p.id, f"superseded by {newer}, judged on newer windows")
                moved.append(p.id)
        return moved

    def realised(self, proposal_id: str, gain: float) -> None:
        """Record what a promoted proposal gained once it ran (no status move)."""
        self.proposals.set_realised_gain(proposal_id, gain, actor=self.actor)

    def _record(self, proposal: Any, kind: str) -> None:
        self.proposals.record_policy(
            proposal.new_ref, proposal.new_policy, kind=kind, actor=self.actor, proposal_id=proposal.id
        )


def _in_force(history: Sequence[Any]) -> str | None:
    """The ref a proposal store's policy history has in force: the newest applied or promoted (a canary
    rolled back leaves the one before it in force)."""
    return next((r.ref for r in reversed(history) if r.kind in ("applied", "promoted")), None)
