"""The loop's proposer: edits of the policy in force, each judged by replay; the best as plain data.

``Proposer.plan`` gathers the edits the findings suggest (``agents._candidates``), the retrained model kept
since the last proposal, and the planner's, replays each against the policy in force (``agents._judge``),
tries the two best of different settings together, and returns the best whose interval clears the floor as a
``Candidate``, with the route it takes once stored. ``Proposer.rejudge`` judges a stale proposal's edits again
on the policy in force now. Neither writes anything: a ``Candidate`` is plain data (``to_dict``) that the
loop's graph keeps in its state, checkpointed, until the node that stores it through the actuator.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from evocache.dsl import Policy, parse_policy, policy_to_dict, policy_to_yaml

from ._candidates import Edit, apply_edits, candidate_edits
from ._evidence import Judgement
from ._judge import Judge
from ._memory import WindowRecord, history
from ._types import Finding

log = logging.getLogger("evocache.agents")

DRIFT_KINDS = ("key-drift", "mix-drift")
"""What reports a drift: the workload moved (its keys, its mix). A change point of the hit ratio is a finding
of its own: the cache's answer to a drift, a warm-up or a policy change, not the workload."""

Route = Literal["hold", "approve", "review"]
"""Where a stored proposal goes: it waits for a person (its evidence counted too little traffic), it is
approved inside the guardrails, or a person reviews it."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """A change planned and judged, not yet stored: the ``base`` policy's ref, the new policy (``ref`` and its
    ``document``), the ``edits`` that make it, the ``findings`` behind them, the replay ``judgement``, the
    ``route`` it takes once stored and the planner's ``rationale``."""

    base: str
    ref: str
    document: str
    edits: tuple[Edit, ...]
    findings: tuple[Finding, ...]
    judgement: Judgement
    route: Route
    rationale: str = ""

    @classmethod
    def of(
        cls,
        base: Policy,
        policy: Policy,
        edits: Sequence[Edit],
        findings: Sequence[Finding],
        judgement: Judgement,
        route: Route,
        rationale: str = "",
    ) -> Candidate:
        return cls(
            str(base.ref),
            str(policy.ref),
            policy_to_yaml(policy),
            tuple(edits),
            tuple(findings),
            judgement,
            route,
            rationale,
        )

    def policy(self) -> Policy:
        """The new policy, validated again from its document."""
        return parse_policy(self.document, self.ref)

    def to_dict(self) -> dict[str, Any]:
        """JSON values only: what the graph's state holds and its checkpointer keeps."""
        return {
            "base": self.base,
            "ref": self.ref,
            "document": self.document,
            "edits": [e.to_dict() for e in self.edits],
            "findings": [f.to_dict() for f in self.findings],
            "judgement": self.judgement.to_dict(),
            "route": self.route,
            "rationale": self.rationale,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Candidate:
        return cls(
            data["base"],
            data["ref"],
            data["document"],
            tuple(Edit.from_dict(e) for e in data["edits"]),
            tuple(Finding.from_dict(f) for f in data["findings"]),
            Judgement.from_dict(data["judgement"]),
            data["route"],
            data["rationale"],
        )


class Proposer:
    """Plans and judges candidates with ``judge``; ``planner`` (an ``agents._planner.Planner``, or None)
    suggests edits of its own, judged like the others."""

    def __init__(self, judge: Judge, planner: Any = None) -> None:
        self.judge = judge
        self.planner = planner

    def plan(
        self,
        records: Sequence[WindowRecord],
        base: Policy,
        findings: Sequence[Finding],
        *,
        version: int,
        kept_model: Mapping[str, Any] | None = None,
        last_retrain: Mapping[str, Any] | None = None,
    ) -> Candidate | None:
        """The best change of ``base`` (the policy in force) as new ``version``, or None when no edit gains
        enough. ``kept_model``: a retraining kept since the last proposal (its edit joins the candidates while
        it still edits ``base``); ``last_retrain``: what the planner's ``retrain`` tool says."""
        cfg = self.judge.config
        recent = history(records)[-(cfg.warmup + cfg.measure) :]
        edits = candidate_edits(base, findings, recent)[: cfg.max_candidates]
        kept = None if kept_model is None else _kept_edit(base, kept_model)
        if kept is not None:
            edits.append(kept)
        if any(f.kind in DRIFT_KINDS for w in records[-(cfg.warmup + cfg.measure) :] for f in w.findings):
            # replayed across a drift, an eviction class is judged on how it weathers the transition, which
            # says little about how it does in the new regime: judged once the span is past the drift
            edits = [e for e in edits if e.kind != "eviction"]
        rationale = ""
        if self.planner is not None:
            planned = self._ask_planner(records, last_retrain, base, findings, edits, version)
            rationale = planned.rationale
            known = {(e.path, e.new) for e in edits}
            edits += [e for e in planned.edits if (e.path, e.new) not in known]
        scored: list[tuple[float, list[Edit], Policy, Judgement]] = []
        for edit in edits:
            try:
                cand = apply_edits(base, [edit], version)
            except ValueError as exc:  # PolicyError, StoreConfigError: never propose what check rejects
                log.info("edit %s refused by policy check: %s", edit.path, exc)
                continue
            judged = self.judge.replay(records, base, cand, switch=edit.kind == "eviction")
            c = judged.comparison
            log.info(
                "window %d: %s %s -> %s: gain %+.4f [%+.4f, %+.4f]",
                records[-1].index, edit.kind, edit.path, edit.new, c.gain, *c.ci,
            )
            if self.judge.acceptable(base, c):
                scored.append((c.ci[0], [edit], cand, judged))
        if len(scored) >= 2:  # the two best edits of different settings together
            scored.sort(key=lambda s: s[0], reverse=True)
            a, b = scored[0], scored[1]
            if a[1][0].path != b[1][0].path:
                try:
                    cand = apply_edits(base, a[1] + b[1], version)
                    switch = any(e.kind == "eviction" for e in a[1] + b[1])
                    judged = self.judge.replay(records, base, cand, switch=switch)
                    if self.judge.acceptable(base, judged.comparison) and judged.comparison.ci[0] > a[0]:
                        scored.append((judged.comparison.ci[0], a[1] + b[1], cand, judged))
                except ValueError as exc:
                    log.info("combined edit refused by policy check: %s", exc)
        if not scored:
            return None
        scored.sort(key=lambda s: s[0], reverse=True)
        _, chosen, cand, judged = scored[0]
        return Candidate.of(base, cand, chosen, findings, judged, self.route(base, chosen, judged), rationale)

    def rejudge(
        self,
        records: Sequence[WindowRecord],
        base: Policy,
        edits: Sequence[Edit],
        findings: Sequence[Finding],
        *,
        version: int,
    ) -> Candidate | None:
        """A stale proposal's ``edits`` judged again on ``base`` (the policy in force now) and the newest
        windows, each starting from the value ``base`` has: the candidate when they still apply and still
        gain, else None."""
        if not edits:
            return None
        try:
            cand = apply_edits(base, [replace(e, old=_current(base, e.path, e.old)) for e in edits], version)
        except (ValueError, KeyError) as exc:
            log.info("stale edits no longer apply to %s: %s", base.ref, exc)
            return None
        judged = self.judge.replay(records, base, cand, switch=any(e.kind == "eviction" for e in edits))
        if not self.judge.acceptable(base, judged.comparison):
            return None
        return Candidate.of(base, cand, edits, findings, judged, self.route(base, edits, judged))

    def route(self, base: Policy, edits: Sequence[Edit], judged: Judgement) -> Route:
        """``hold`` when the evidence counted fewer requests than the canary's ``min_requests``; ``approve``
        when every edit is inside ``guardrails.auto_approve`` and the loop is not interactive; ``review``
        otherwise."""
        if judged.comparison.requests < base.guardrails.rollout.min_requests:
            return "hold"
        if not self.judge.config.interactive and all(e.auto_approvable(base) for e in edits):
            return "approve"
        return "review"

    def _ask_planner(
        self,
        records: Sequence[WindowRecord],
        last_retrain: Mapping[str, Any] | None,
        base: Policy,
        findings: Sequence[Finding],
        edits: Sequence[Edit],
        version: int,
    ) -> Any:
        """Ask the planner (its tools: this pass's findings, replay and diff of a candidate, the last
        retrain); its edits join the candidates, judged by replay like the others."""
        from evocache.dsl import diff_policies

        from ._planner import PlannerTools, summarise_evidence, summarise_findings

        tools = PlannerTools(
            base=base,
            diagnose=lambda: summarise_findings(findings),
            replay=lambda e: summarise_evidence(
                self.judge.replay(records, base, apply_edits(base, e, version)).comparison
            ),
            diff=lambda e: diff_policies(base, apply_edits(base, e, version)).text,
            retrain=(lambda: last_retrain if last_retrain is not None else {"ran": False}),
        )
        return self.planner.plan(tools, findings, edits)


def _kept_edit(base: Policy, kept_model: Mapping[str, Any]) -> Edit | None:
    """The edit to a retrained model, with why, while it still edits ``base`` (the policy in force was not
    replaced since the model was trained); else None."""
    kept = Edit.from_dict(kept_model["edit"])
    if kept.old != {"l1": base.eviction.l1 or "lru", "model": base.eviction.model}:
        return None
    model = f" ({base.eviction.model})" if base.eviction.model else ""
    was = f"{base.eviction.l1 or 'lru'}{model}"
    why = (
        f"a retrained model beat {was} on held-back traffic: "
        f"{kept_model['new_hit_ratio']:.3f} against {kept_model['base_hit_ratio']:.3f}"
    )
    return Edit(kept.kind, kept.path, kept.old, kept.new, why)


def _current(policy: Policy, path: str, default: Any) -> Any:
    """The value at ``path`` (``rules.chat.ttl``) in ``policy``'s document, ``default`` when it has none."""
    node: Any = policy_to_dict(policy)
    for part in path.split("."):
        if isinstance(node, list):
            node = next((r for r in node if isinstance(r, dict) and r.get("name") == part), None)
        elif isinstance(node, dict):
            node = node.get(part)
        if node is None:
            return default
    return node
