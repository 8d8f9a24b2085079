"""The loop as a LangGraph graph, and the driver that runs it over a trace.

One pass per window of traffic:

    observe ── diagnose ─┬─ (a canary is out) ── watch ── END          promote, roll back, go on, or wait
                         └─ retrain ── propose ─┬─ (nothing worth it) ── END
                                                ├─ (inconclusive) ── waits for a person ── END
                                                ├─ (inside the guardrails) ── approve ── canary ── END
                                                └─ review (interrupt) ── decide ── canary ── END

Every window is diagnosed, a canary out or not, so a drift during a canary is seen when it comes.

State is plain data (the window, the findings, the proposal id, the verdict); what the nodes act on (the
policy store, the proposal store, the windows seen) is the ``LoopContext`` the graph was built with.
``review`` holds nothing but its ``interrupt``: the thread waits in the SQLite checkpointer, and any process
that builds the graph over the same stores and checkpointer resumes it (``resume_review``), as ``evocache
proposals approve`` does. The canary is the policy store's canary fraction, the one serving reads; ``canary``
refuses a proposal whose base is no longer the policy in force (its evidence is stale) and marks it so.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypedDict
from urllib.parse import urlsplit, urlunsplit

from evocache.controller import PolicyStore
from evocache.dsl import Policy

from ._candidates import Edit, apply_edits, candidate_edits
from ._evidence import Step, arm_difference, arm_metrics, compare
from ._types import Finding, Outcome, Request, Series, WindowStats, step_series, window_stats

log = logging.getLogger("evocache.agents")

DRIFT_KINDS = ("key-drift", "mix-drift")
"""What reports a drift: the workload moved (its keys, its mix). A change point of the hit ratio is a finding
of
its own: the cache's answer to a drift, a warm-up or a policy change, not the workload."""

HISTORY = 60
"""Windows whose key counts the loop keeps (the drift tests read the newest 30)."""

CACHE_WIDE = frozenset({"bypass", "tenant-share", "eviction"})
"""Edit kinds whose effect is on the whole cache, not on the requests they decide: their canary's hit ratio is
judged by the fresh replay alone."""


class LoopState(TypedDict, total=False):
    run: str
    thread: str
    window: int
    policy: str
    route: str
    findings: list[dict[str, Any]]
    proposal: str | None
    verdict: dict[str, Any] | None
    notes: list[str]


@dataclass(frozen=True, slots=True)
class LoopConfig:
    """How the loop judges: ``warmup`` windows fill the replay cache before the ``measure`` windows are
    counted; ``realise`` windows after a promotion measure its realised gain; ``interactive``: every proposal
    waits for a person, whatever the guardrails allow; ``max_candidates`` single edits replayed per pass;
    ``step_s`` the series' step (None: a twentieth of the window); ``retrain_every``: the learned eviction
    model is retrained every that many windows (0: never)."""

    warmup: int = 3
    measure: int = 1
    realise: int = 2
    interactive: bool = False
    max_candidates: int = 12
    seed: int = 0
    step_s: float | None = None
    retrain_every: int = 4


@dataclass
class WindowRecord:
    """A window as it was served: its requests, outcomes, the schedule step, and which requests ran the
    canary."""

    index: int
    requests: Sequence[Request]
    outcomes: list[Outcome]
    step: Step
    canary_arm: list[bool]
    stats: WindowStats
    findings: list[Finding] = field(default_factory=list)
    signals: dict[str, float] = field(default_factory=dict)  # the mean of each other signal over the window


class LoopContext:
    """What the graph's nodes act on. ``proposals`` is a ``ProposalStore``; ``policies`` the policy store
    serving reads; ``windows`` the windows served so far (empty in a process that only resumes reviews).
    ``model`` is what serves the traffic (model id, revision, prompt-template hash): with the policy in force
    and a fingerprint of the recent output lengths, it is the context every proposal's evidence is stored
    under, and a
    change of any of them makes undecided proposals stale (``check_evidence``)."""

    def __init__(
        self,
        policies: PolicyStore,
        proposals: Any,
        *,
        capacity: int = 1,
        config: LoopConfig = LoopConfig(),
        vectors: Any = None,
        diagnose: Callable[..., list[Finding]] | None = None,
        plots_dir: Path | None = None,
        actor: str = "evocache-agent",
        planner: Any = None,
        model_dir: Path | None = None,
        model: tuple[str, str, str] = ("", "", ""),
    ) -> None:
        self.policies = policies
        self.proposals = proposals
        self.capacity = capacity
        self.config = config
        self.vectors = vectors
        self.windows: list[WindowRecord] = []
        self.series: list[Series] = []
        self._diagnose = diagnose
        self.plots_dir = plots_dir
        self.actor = actor
        self.top_version = 0
        self.canary_started: dict[str, int] = {}
        self.promoted_at: dict[str, tuple[int, int]] = {}  # proposal -> (canary start, promotion window)
        self.breaches: list[dict[str, Any]] = []
        self.planner = planner  # an ``agents._planner.Planner`` or None
        self.model = model  # what serves the traffic: (model id, revision, prompt template hash)
        self.model_dir = model_dir
        self.retrains: list[dict[str, Any]] = []
        self._kept_model: dict[str, Any] | None = None  # the newest kept retrain, until proposed

    # -- observing -------------------------------------------------------------------------------------------

    def record(
        self,
        requests: Sequence[Request],
        outcomes: list[Outcome],
        step: Step,
        canary_arm: list[bool],
        signals: Sequence[Series] = (),
    ) -> WindowRecord:
        """Keep one served window, with the other ``signals`` read over its span (GPU, host, profiler and
        Nsight Compute series: kept with the cache's own series for diagnosis, and their means in the
        window's record). Only the newest windows keep their requests (what replay needs); older ones keep
        their summary, and only the newest ``HISTORY`` windows their key counts, so a loop that runs for days
        holds a bounded amount."""
        index = len(self.windows)
        stats = window_stats(index, str(step[0].ref), requests, outcomes)
        means = {_series_name(s): float(sum(s.v) / len(s.v)) for s in signals if s.v}
        rec = WindowRecord(index, requests, outcomes, step, canary_arm, stats, signals=means)
        self.windows.append(rec)
        if requests:
            first, last = min(r.t for r in requests), max(r.t for r in requests)
            step_s = self.config.step_s or max(last - first, 1e-6) / 20
            own = step_series(requests, outcomes, start=first, end=last, step_s=step_s)
            self.series = _merge_series([*self.series, *own, *signals])
        self._forget(step[0].guardrails.rollout.max_windows)
        return rec

    def _forget(self, canary_windows: int) -> None:
        cfg = self.config
        keep = cfg.warmup + max(cfg.measure, cfg.realise) + canary_windows + 2
        if len(self.windows) > keep:
            old = self.windows[-keep - 1]
            if old.requests:
                old.requests, old.outcomes, old.canary_arm = (), [], []
        if len(self.windows) > HISTORY:
            old = self.windows[-HISTORY - 1]
            if old.stats.keys:
                old.stats = replace(old.stats, keys={})

    def history(self) -> list[WindowStats]:
        """The newest ``HISTORY`` windows' summaries, oldest first: what diagnosis reads."""
        return [w.stats for w in self.windows[-HISTORY:]]

    def active(self) -> Policy:
        from .errors import AgentError

        state = self.policies.state()
        if state.active is None:
            raise AgentError("the policy store has no policy in force")
        return self.policies.load(state.active)

    # -- diagnosis -----------------------------------------------------------------------------------------

    def diagnose(self) -> list[Finding]:
        if self._diagnose is None or not self.windows:
            return []
        findings = self._diagnose(self.history(), self.series, plots_dir=self.plots_dir)
        self.windows[-1].findings = findings
        return findings

    # -- the evidence's context ---------------------------------------------------------------------------

    def evidence_context(self, policy: Policy) -> Any:
        """What traffic is served by now (``agents._fingerprint.EvidenceContext``): ``policy``, the model, and
        a fingerprint of the recent windows' output lengths (None with fewer than 64 known)."""
        from ._fingerprint import EvidenceContext, OutputFingerprint

        span = self.windows[-(self.config.warmup + self.config.measure) :]
        lengths = [n for w in span for n in w.stats.output_tokens if n >= 0]
        fingerprint = OutputFingerprint.of_lengths(lengths) if len(lengths) >= 64 else None
        model_id, revision, template = self.model
        return EvidenceContext(
            policy_ref=str(policy.ref),
            policy_hash=policy.content_hash,
            model_id=model_id,
            model_revision=revision,
            template_hash=template,
            output_fingerprint=fingerprint,
        )

    def check_evidence(self) -> list[tuple[str, str]]:
        """Every proposal still to be decided or rolled out (proposed, waiting, approved) whose evidence no
        longer holds under the context now (another policy in force, another model or template, outputs of
        another shape) becomes stale; an approved one is judged again (``reevaluate``). ``(id, reason)`` of
        each."""
        if not self.windows:
            return []
        now = self.evidence_context(self.active())
        moved = []
        for p in self.proposals.list():
            if p.status not in ("proposed", "waiting", "approved"):
                continue
            was = p.status
            reason = self.proposals.invalidate(p.id, now, actor=self.actor)
            if reason is not None:
                moved.append((p.id, reason))
                if was == "approved":
                    self.reevaluate(p.id)
        return moved

    # -- retraining ----------------------------------------------------------------------------------------

    def retrain(self) -> dict[str, Any] | None:
        """Every ``retrain_every`` windows: train the learned eviction model on the recent windows' head and
        keep it only when it beats the policy in force on their held-back tail (``agents._retrain``). A kept
        model makes ``eviction: {l1: learned, model: <its file>}`` a candidate of the next proposal, judged by
        replay like any edit (over a learned policy in force, the newer model is the candidate).
        What it found, or None when it did not run."""
        every = self.config.retrain_every
        if every <= 0 or self.model_dir is None or not self.windows or (len(self.windows) % every):
            return None
        from ._retrain import retrain

        base = self.active()
        reqs, _ = self.schedule_span(len(self.windows) - 1, self.config.warmup + self.config.measure)
        result = retrain(
            [r for w in reqs for r in w],
            base,
            capacity=self.capacity,
            model_dir=self.model_dir,
            seed=self.config.seed,
            vectors=self.vectors,
        )
        found = {"window": len(self.windows) - 1, **result.to_dict()}
        self.retrains.append(found)
        if result.kept:
            self._kept_model = found
        return found

    # -- proposing -----------------------------------------------------------------------------------------

    def busy(self) -> bool:
        """Whether a change is on its way out (approved, or on the canary): one change at a time. A proposal
        waiting for a person does not hold the loop up; a newer one supersedes it (``supersede``)."""
        return any(p.status in ("approved", "canary") for p in self.proposals.list())

    def supersede(self, newer: str) -> list[str]:
        """Move every proposal still waiting for a decision (``proposed``, ``waiting``) other than ``newer``
        to
        stale: its evidence is older than ``newer``'s, judged on the same policy or an older one."""
        moved = []
        for p in self.proposals.list():
            if p.id != newer and p.status in ("proposed", "waiting"):
                self.proposals.transition(
                    p.id, "stale", actor=self.actor, note=f"superseded by {newer}, judged on newer windows"
                )
                moved.append(p.id)
        return moved

    def reevaluate(self, proposal_id: str) -> tuple[Any | None, str]:
        """A stale proposal's edits judged again, on the policy in force and the newest windows: a new
        proposal (its route, as ``propose`` gives) when the edits still apply and still gain, else ``(None,
        "end")``."""
        old = self.proposals.get(proposal_id)
        if not self.windows or not old.edits:
            return None, "end"
        base = self.active()
        edits = [Edit.from_dict(e) for e in old.edits]
        try:
            cand = apply_edits(
                base,
                [replace(e, old=_current(base, e.path, e.old)) for e in edits],
                max(self.top_version, base.version) + 1,
            )
        except (ValueError, KeyError) as exc:
            log.info("stale proposal %s no longer applies to %s: %s", old.id, base.ref, exc)
            return None, "end"
        evidence = self.judge(base, cand, switch=any(e.kind == "eviction" for e in edits))
        if not self._acceptable(base, evidence):
            return None, "end"
        findings = [Finding.from_dict(f) for f in old.findings]
        proposal = self._store_proposal(base, cand, edits, findings, evidence, None)
        self.top_version = cand.version
        return proposal, self._route(base, edits, evidence)

    def schedule_span(self, last: int, count: int) -> tuple[list[Sequence[Request]], list[Step]]:
        first = max(0, last - count + 1)
        recs = self.windows[first : last + 1]
        return [r.requests for r in recs], [r.step for r in recs]

    def judge(
        self, base: Policy, candidate: Policy, *, last: int | None = None, switch: bool = False
    ) -> dict[str, Any]:
        """Replay evidence for ``candidate`` against ``base`` over the windows up to ``last`` (the newest by
        default), from the same cold cache, the last ``measure`` counted. Each policy is in force over all
        ``warmup + measure`` windows, so each arm's cache holds what its own policy kept and the gain is the
        change's lasting effect, the one its promotion is measured against (``realised_gain``). With
        ``switch`` (an eviction class: a new one takes over the cache as it is and learns from there), it is
        also judged taking over only for the measured windows, as it would in production, and the evidence is
        the less favourable of the two (the lower end of its interval): a class that only wins the transition
        after a drift, or only once it has the cache to itself, is not shown to be better."""
        cfg = self.config
        last = len(self.windows) - 1 if last is None else last
        reqs, _ = self.schedule_span(last, cfg.warmup + cfg.measure)
        measure = min(cfg.measure, len(reqs))
        base_steps = [(base, None, 0.0)] * len(reqs)
        views = {"lasting": [(candidate, None, 0.0)] * len(reqs)}
        if switch:
            views["switch"] = base_steps[: len(reqs) - measure] + [(candidate, None, 0.0)] * measure
        judged = {
            name: compare(
                reqs,
                base_steps,
                steps,
                measure=measure,
                capacity=self.capacity,
                vectors=self.vectors,
                seed=cfg.seed,
                models=self.model_dir,
            )
            for name, steps in views.items()
        }
        view = min(judged, key=lambda name: judged[name]["ci"][0])
        evidence = judged[view]
        evidence["view"] = view
        evidence["windows"] = [last - measure + 1, last]
        evidence["evaluated_at"] = time.time()
        return evidence

    def propose(self, findings: Sequence[Finding], thread: str | None = None) -> tuple[Any | None, str]:
        """The best candidate as a stored proposal and its route (``end``, ``wait``, ``auto``, ``review``)."""
        if self.busy() or len(self.windows) < 2:
            return None, "end"
        base = self.active()
        recent = self.history()[-(self.config.warmup + self.config.measure) :]
        edits = candidate_edits(base, findings, recent)[: self.config.max_candidates]
        version = max(self.top_version, base.version) + 1
        if self._kept_model is not None:
            kept = Edit.from_dict(self._kept_model["edit"])
            if kept.old == {"l1": base.eviction.l1 or "lru", "model": base.eviction.model}:
                # still an edit of the policy in force (it was not replaced since the model was trained)
                was = f"{base.eviction.l1 or 'lru'}" + (f" ({base.eviction.model})" if base.eviction.model else "")
                why = (
                    f"a retrained model beat {was} on held-back traffic: "
                    f"{self._kept_model['new_hit_ratio']:.3f} against {self._kept_model['base_hit_ratio']:.3f}"
                )
                edits.append(Edit(kept.kind, kept.path, kept.old, kept.new, why))
            self._kept_model = None
        span = self.windows[-(self.config.warmup + self.config.measure) :]
        if any(f.kind in DRIFT_KINDS for w in span for f in w.findings):
            # replayed across a drift, an eviction class is judged on how it weathers the transition, which
            # says little about how it does in the new regime: judged once the span is past the drift
            edits = [e for e in edits if e.kind != "eviction"]
        rationale = ""
        if self.planner is not None:
            planned = self._plan(base, findings, edits, version)
            rationale = planned.rationale
            known = {(e.path, e.new) for e in edits}
            edits += [e for e in planned.edits if (e.path, e.new) not in known]
        if not edits:
            return None, "end"
        scored: list[tuple[float, list[Edit], Policy, dict[str, Any]]] = []
        for edit in edits:
            try:
                cand = apply_edits(base, [edit], version)
            except (
                ValueError
            ) as exc:  # PolicyError / StoreConfigError: the loop never proposes what check rejects
                log.info("edit %s refused by policy check: %s", edit.path, exc)
                continue
            evidence = self.judge(base, cand, switch=edit.kind == "eviction")
            log.info(
                "window %d: %s %s -> %s: gain %+.4f [%+.4f, %+.4f]",
                len(self.windows) - 1,
                edit.kind,
                edit.path,
                edit.new,
                evidence["gain"],
                *evidence["ci"],
            )
            if self._acceptable(base, evidence):
                scored.append((evidence["ci"][0], [edit], cand, evidence))
        if len(scored) >= 2:  # the two best edits of different settings together
            scored.sort(key=lambda s: s[0], reverse=True)
            a, b = scored[0], scored[1]
            if a[1][0].path != b[1][0].path:
                try:
                    cand = apply_edits(base, a[1] + b[1], version)
                    evidence = self.judge(base, cand, switch=any(e.kind == "eviction" for e in a[1] + b[1]))
                    if self._acceptable(base, evidence) and evidence["ci"][0] > a[0]:
                        scored.append((evidence["ci"][0], a[1] + b[1], cand, evidence))
                except ValueError as exc:
                    log.info("combined edit refused by policy check: %s", exc)
        if not scored:
            return None, "end"
        scored.sort(key=lambda s: s[0], reverse=True)
        _, chosen, cand, evidence = scored[0]
        proposal = self._store_proposal(base, cand, chosen, findings, evidence, thread, rationale)
        self.top_version = cand.version
        self.supersede(proposal.id)
        return proposal, self._route(base, chosen, evidence)

    def _acceptable(self, base: Policy, evidence: dict[str, Any]) -> bool:
        floor = base.guardrails.auto_approve.min_gain if base.guardrails.auto_approve else 0.0
        max_error = base.slo.max_error_rate
        wrong = evidence["candidate"]["wrong_rate"]
        within_error = wrong <= evidence["base"]["wrong_rate"] + 1e-12 or (
            max_error is not None and wrong <= max_error
        )
        return evidence["gain"] > floor and evidence["ci"][0] > floor and within_error

    def _route(self, base: Policy, edits: Sequence[Edit], evidence: dict[str, Any]) -> str:
        if evidence["requests"] < base.guardrails.rollout.min_requests:
            return "wait"
        if not self.config.interactive and all(e.auto_approvable(base) for e in edits):
            return "auto"
        return "review"

    def _plan(self, base: Policy, findings: Sequence[Finding], edits: Sequence[Edit], version: int) -> Any:
        """Ask the planner (its tools: this pass's findings, replay and diff of a candidate, the last
        retrain); its edits join the candidates, judged by replay like the others."""
        from evocache.dsl import diff_policies

        from ._planner import PlannerTools, summarise_evidence, summarise_findings

        tools = PlannerTools(
            base=base,
            diagnose=lambda: summarise_findings(findings),
            replay=lambda e: summarise_evidence(self.judge(base, apply_edits(base, e, version))),
            diff=lambda e: diff_policies(base, apply_edits(base, e, version)).text,
            retrain=(lambda: self.retrains[-1] if self.retrains else {"ran": False}),
        )
        return self.planner.plan(tools, findings, edits)

    def _store_proposal(
        self,
        base: Policy,
        cand: Policy,
        edits: Sequence[Edit],
        findings: Sequence[Finding],
        evidence: dict[str, Any],
        thread: str | None,
        rationale: str = "",
    ) -> Any:
        from ._proposals import Evidence, Proposal

        replay = Evidence.from_replay(
            evidence,
            evaluated_at=evidence["evaluated_at"],
            windows=evidence["windows"],
            context=self.evidence_context(base),
        )
        proposal = Proposal.create(
            base,
            cand,
            at=time.time(),
            edits=[e.to_dict() for e in edits],
            findings=list(findings[:20]),
            evidence=replay,
            predicted_gain=evidence["gain"],
            window=len(self.windows) - 1,
            thread_id=thread,
            rationale=rationale,
        )
        return self.proposals.add(proposal, actor=self.actor)

    # -- rolling out ---------------------------------------------------------------------------------------

    def start_canary(self, proposal_id: str) -> str:
        """Put an approved proposal on the canary; ``stale`` when its base is no longer in force (its evidence
        is older than the policy it would replace: ``reevaluate`` judges its edits again)."""
        from evocache.dsl import parse_policy

        proposal = self.proposals.get(proposal_id)
        state = self.policies.state()
        if state.active != proposal.base_policy or state.canary is not None:
            self.proposals.transition(
                proposal.id,
                "stale",
                actor=self.actor,
                note=f"the policy in force is {state.active}, not {proposal.base_policy}",
            )
            return "stale"
        base = self.policies.load(state.active)
        fraction = base.guardrails.rollout.fraction
        self.policies.apply(parse_policy(proposal.new_policy, proposal.new_ref), canary=fraction)
        self.proposals.record_policy(
            proposal.new_ref, proposal.new_policy, kind="canary", actor=self.actor, proposal_id=proposal.id
        )
        self.proposals.transition(proposal.id, "canary", actor=self.actor, note=f"canary on {fraction:.0%}")
        self.canary_started[proposal.id] = len(self.windows)
        return "canary"

    def watch(self) -> str:
        """Judge the canary out now over the windows since it started: promote, roll back, go on, or wait.

        Two views, over the same windows. The live split (canary requests against base requests) shows what
        the change does to the requests it serves: an SLO the canary arm breaks, or a hit ratio shown to be
        lower. But the two arms share one cache, so a change whose effect is cache-wide (a bypass that stops
        one rule's traffic from pushing the others' out, a tenant quota, an eviction class) helps both arms
        alike and the split cannot see it. The second view is a fresh replay: the change in force against the
        base over the canary's windows, traffic the proposal was not chosen on. Either view showing a loss
        beyond the tolerance rolls the canary back; it is promoted when the fresh replay's gain is positive
        and its interval's low end within the tolerance; anything else goes on until ``max_windows``, then
        waits
        for a person."""
        from evocache.dsl import parse_policy

        state = self.policies.state()
        proposal = next((p for p in self.proposals.list(status="canary")), None)
        if proposal is None or state.canary is None:
            return "none"
        base = self.policies.load(state.active)
        spec = base.guardrails.rollout
        start = self.canary_started.get(proposal.id, len(self.windows) - 1)
        recs = [w for w in self.windows[start:] if w.step[1] is not None]
        if len(recs) < spec.windows:
            return "continue"
        arms: dict[bool, tuple[list[Request], list[Outcome]]] = {True: ([], []), False: ([], [])}
        for rec in recs:
            for req, out, arm in zip(rec.requests, rec.outcomes, rec.canary_arm, strict=True):
                arms[arm][0].append(req)
                arms[arm][1].append(out)
        can, bas = arm_metrics(*arms[True]), arm_metrics(*arms[False])
        diff, low, high = arm_difference(arms[True], arms[False], seed=self.config.seed)
        fresh = self._fresh_replay(base, parse_policy(proposal.new_policy, proposal.new_ref), len(recs))
        f_gain, (f_low, f_high) = fresh["gain"], fresh["ci"]
        verdict = {
            "canary": can,
            "base": bas,
            "difference": [diff, low, high],
            "replay": [f_gain, f_low, f_high],
            "windows": [start, len(self.windows) - 1],
        }
        tolerance = spec.max_drop * bas["hit_ratio"]  # a share of the base's hit ratio
        # The live split counts only with enough canary requests (an arm of a handful shows nothing either
        # way), and its hit ratio only for a change that acts on the requests it decides: a cache-wide one (a
        # bypass, a quota, an eviction class) changes what both arms find, and the arms differ in their
        # traffic.
        local = not any(e.get("kind") in CACHE_WIDE for e in proposal.edits)
        live = (
            self._breach(base, can, bas, high, tolerance, hit_ratio=local)
            if can["requests"] >= spec.min_requests
            else ""
        )
        breach = live or self._replay_breach(fresh, tolerance)
        if breach:
            self.policies.rollback()
            self.proposals.record_policy(
                proposal.new_ref,
                proposal.new_policy,
                kind="rolled_back",
                actor=self.actor,
                proposal_id=proposal.id,
            )
            self.proposals.transition(
                proposal.id, "rolled_back", actor=self.actor, note=breach, evidence=None
            )
            self.breaches.append(
                {**verdict, "proposal": proposal.id, "reason": breach, "canary_windows": len(recs)}
            )
            return "rolled_back"
        if can["requests"] < spec.min_requests or f_gain <= 0 or f_low < -tolerance:
            if len(recs) >= spec.max_windows:  # inconclusive never passes: withdraw it, a person decides
                self.policies.rollback()
                self.proposals.transition(
                    proposal.id,
                    "waiting",
                    actor=self.actor,
                    note=f"inconclusive after {len(recs)} windows: {can['requests']} canary requests, "
                    f"replayed gain {f_gain:+.4f} [{f_low:+.4f}, {f_high:+.4f}], live difference {diff:+.4f} "
                    f"[{low:+.4f}, {high:+.4f}]",
                )
                return "waiting"
            return "continue"
        self.policies.promote()
        self.proposals.record_policy(
            proposal.new_ref, proposal.new_policy, kind="promoted", actor=self.actor, proposal_id=proposal.id
        )
        self.proposals.transition(
            proposal.id,
            "promoted",
            actor=self.actor,
            note=f"replayed gain over the canary's windows {f_gain:+.4f} [{f_low:+.4f}, {f_high:+.4f}]; "
            f"canary arm hit ratio {can['hit_ratio']:.3f} against {bas['hit_ratio']:.3f}",
        )
        self.promoted_at[proposal.id] = (start, len(self.windows) - 1)
        return "promoted"

    def _fresh_replay(self, base: Policy, candidate: Policy, windows: int) -> dict[str, Any]:
        """``candidate`` against ``base``, each in force from a cold cache over ``warmup`` windows and the
        newest ``windows``, those counted."""
        cfg = self.config
        last = len(self.windows) - 1
        reqs, _ = self.schedule_span(last, cfg.warmup + windows)
        return compare(
            reqs,
            [(base, None, 0.0)] * len(reqs),
            [(candidate, None, 0.0)] * len(reqs),
            measure=min(windows, len(reqs)),
            capacity=self.capacity,
            vectors=self.vectors,
            seed=cfg.seed,
            models=self.model_dir,
        )

    @staticmethod
    def _replay_breach(fresh: dict[str, Any], tolerance: float) -> str:
        max_wrong = fresh["base"]["wrong_rate"]
        high = fresh["ci"][1]
        if high < -tolerance:
            return (
                f"replayed over the canary's windows, the change loses hit ratio: {fresh['gain']:+.4f} "
                f"(the interval ends at {high:+.4f}, beyond the tolerance {tolerance:.4f})"
            )
        if fresh["candidate"]["wrong_rate"] > max_wrong and fresh["wrong_change"] > 0 and fresh["ci"][1] <= 0:
            return f"replayed over the canary's windows, wrong answers rise by {fresh['wrong_change']:+.4f}"
        return ""

    @staticmethod
    def _breach(
        base: Policy,
        can: dict[str, float],
        bas: dict[str, float],
        high: float,
        tolerance: float,
        *,
        hit_ratio: bool = True,
    ) -> str:
        """Why the canary must go: an SLO it breaks, or (with ``hit_ratio``) a hit ratio shown (the whole
        interval of the difference) to be more than ``tolerance`` below the base's. "" when neither."""
        max_error = base.slo.max_error_rate
        if max_error is not None and can["wrong_rate"] > max_error and can["wrong_rate"] > bas["wrong_rate"]:
            return f"SLO breach: canary error rate {can['wrong_rate']:.4f} > {max_error:g}"
        if hit_ratio and high < -tolerance:
            return (
                f"canary hit ratio {can['hit_ratio']:.3f} is below the base's {bas['hit_ratio']:.3f} by more "
                f"than {tolerance:.4f} (the interval of the difference ends at {high:+.4f})"
            )
        return ""

    def realised_gain(self, proposal_id: str) -> float | None:
        """The promoted change's gain over the ``realise`` windows after its promotion: the schedule that ran
        against the same schedule without it, replayed from the same cold start. None until those windows."""
        if proposal_id not in self.promoted_at:
            return None
        start, promoted = self.promoted_at[proposal_id]
        cfg = self.config
        last = promoted + cfg.realise
        if last >= len(self.windows):
            return None
        first = max(0, start - cfg.warmup)
        recs = self.windows[first : last + 1]
        old_base = recs[start - first].step[0]
        actual = [r.step for r in recs]
        without = [r.step if r.index < start else (old_base, None, 0.0) for r in recs]
        evidence = compare(
            [r.requests for r in recs],
            without,
            actual,
            measure=cfg.realise,
            capacity=self.capacity,
            vectors=self.vectors,
            seed=cfg.seed,
            models=self.model_dir,
        )
        return float(evidence["gain"])


def _series_name(s: Series) -> str:
    return s.name + "".join(f"[{k}={v}]" for k, v in s.labels)


def _current(policy: Policy, path: str, default: Any) -> Any:
    """The value at ``path`` (``rules.chat.ttl``) in ``policy``'s document, ``default`` when it has none."""
    from evocache.dsl import policy_to_dict

    node: Any = policy_to_dict(policy)
    for part in path.split("."):
        if isinstance(node, list):
            node = next((r for r in node if isinstance(r, dict) and r.get("name") == part), None)
        elif isinstance(node, dict):
            node = node.get(part)
        if node is None:
            return default
    return node


def _merge_series(series: Sequence[Series], keep: int = 400) -> list[Series]:
    """Series of one name and labels joined in time order, the newest ``keep`` points of each."""
    joined: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[list[float], list[float], str]] = {}
    for s in series:
        t, v, _ = joined.setdefault((s.name, s.labels), ([], [], s.unit))
        t.extend(s.t)
        v.extend(s.v)
    return [
        Series(name, labels, tuple(t[-keep:]), tuple(v[-keep:]), unit)
        for (name, labels), (t, v, unit) in joined.items()
    ]


# -- the graph -----------------------------------------------------------------------------------------------


def build_graph(ctx: LoopContext, checkpointer: Any) -> Any:
    """The loop's graph over ``ctx``, compiled with ``checkpointer`` (a LangGraph ``SqliteSaver``)."""
    from langgraph.graph import END, START, StateGraph
    from langgraph.types import interrupt

    def observe(state: LoopState) -> LoopState:
        ctx.check_evidence()
        for approved in ctx.proposals.list(status="approved"):  # approved with no pass waiting on it
            if ctx.start_canary(approved.id) == "stale":
                fresh, route = ctx.reevaluate(approved.id)
                if fresh is not None and route == "wait":
                    ctx.proposals.transition(
                        fresh.id,
                        "waiting",
                        actor=ctx.actor,
                        note="inconclusive evidence: too little traffic to judge",
                    )
        return {
            "policy": ctx.policies.state().active or "",
            "findings": [],
            "proposal": None,
            "verdict": None,
            "route": "watch" if ctx.policies.state().canary is not None else "diagnose",
        }

    def watch(state: LoopState) -> LoopState:
        return {"route": "end", "notes": [f"canary: {ctx.watch()}"]}

    def diagnose(state: LoopState) -> LoopState:
        return {"findings": [f.to_dict() for f in ctx.diagnose()]}

    def retrain(state: LoopState) -> LoopState:
        found = ctx.retrain()
        if found is None:
            return {"notes": []}
        return {"notes": [f"retrain: {'kept' if found['kept'] else 'not kept'}: {found['reason']}"]}

    def propose(state: LoopState) -> LoopState:
        findings = [Finding.from_dict(f) for f in state.get("findings", [])]
        proposal, route = ctx.propose(findings, state.get("thread"))
        if proposal is not None and route == "wait":
            ctx.proposals.transition(
                proposal.id,
                "waiting",
                actor=ctx.actor,
                note="inconclusive evidence: too little traffic to judge",
            )
        return {"proposal": None if proposal is None else proposal.id, "route": route}

    def approve(state: LoopState) -> LoopState:
        ctx.proposals.review(
            state["proposal"], "approve", "guardrails", "inside the policy's guardrails.auto_approve"
        )
        return {"route": "canary"}

    def review(state: LoopState) -> LoopState:
        return {"verdict": interrupt({"proposal": state["proposal"], "policy": state.get("policy", "")})}

    def decide(state: LoopState) -> LoopState:
        verdict = state.get("verdict") or {}
        proposal = ctx.proposals.get(state["proposal"])
        if proposal.status in ("proposed", "waiting"):  # the CLI records the review before it resumes
            ctx.proposals.review(
                proposal.id,
                verdict.get("verdict", "reject"),
                verdict.get("reviewer", "person"),
                verdict.get("note", ""),
            )
            proposal = ctx.proposals.get(proposal.id)
        return {"route": "canary" if proposal.status == "approved" else "end"}

    def canary(state: LoopState) -> LoopState:
        outcome = ctx.start_canary(state["proposal"])
        notes = [f"rollout: {outcome}"]
        if outcome == "stale":  # judged against a policy no longer in force: its edits judged again
            fresh, route = ctx.reevaluate(state["proposal"])
            if fresh is not None:
                notes.append(f"re-evaluated as {fresh.id}")
                if route == "auto":
                    ctx.proposals.review(
                        fresh.id,
                        "approve",
                        "guardrails",
                        "re-evaluated; inside the policy's guardrails.auto_approve",
                    )
                    notes.append(f"rollout: {ctx.start_canary(fresh.id)}")
                elif route == "wait":
                    ctx.proposals.transition(
                        fresh.id,
                        "waiting",
                        actor=ctx.actor,
                        note="inconclusive evidence: too little traffic to judge",
                    )
        return {"notes": notes}

    graph = StateGraph(LoopState)
    for name, fn in (
        ("observe", observe),
        ("watch", watch),
        ("diagnose", diagnose),
        ("retrain", retrain),
        ("propose", propose),
        ("approve", approve),
        ("review", review),
        ("decide", decide),
        ("canary", canary),
    ):
        graph.add_node(name, fn)
    graph.add_edge(START, "observe")
    graph.add_edge("observe", "diagnose")  # every window is diagnosed, a canary out or not
    graph.add_conditional_edges("diagnose", lambda s: s["route"], {"watch": "watch", "diagnose": "retrain"})
    graph.add_edge("watch", END)
    graph.add_edge("retrain", "propose")
    graph.add_conditional_edges(
        "propose", lambda s: s["route"], {"end": END, "wait": END, "auto": "approve", "review": "review"}
    )
    graph.add_edge("approve", "canary")
    graph.add_edge("review", "decide")
    graph.add_conditional_edges("decide", lambda s: s["route"], {"canary": "canary", "end": END})
    graph.add_edge("canary", END)
    return graph.compile(checkpointer=checkpointer)


def thread_config(thread_id: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": thread_id}}


def resume_review(graph: Any, thread_id: str, verdict: str, reviewer: str, note: str = "") -> dict[str, Any]:
    """Resume the pass waiting in ``review`` on ``thread_id`` with a person's ``verdict`` (approve/reject)."""
    from langgraph.types import Command

    return graph.invoke(
        Command(resume={"verdict": verdict, "reviewer": reviewer, "note": note}),
        thread_config(thread_id),
        durability="sync",
    )


LOOP_FILE = "loop.json"
"""In the loop's workdir: which policy store the loop acts on, for a review resumed from another process."""


def record_policy_store(workdir: Path, policies: Any) -> None:
    """Write down in ``workdir`` where ``policies`` lives (a directory, or a Redis URL with any password left
    out), so that ``resume_waiting`` opens the same store."""
    from evocache.controller import FilePolicyStore

    if isinstance(policies, FilePolicyStore):
        where: dict[str, Any] = {"directory": str(policies.directory.resolve())}
    else:
        url = getattr(policies, "url", None)
        if url is None:
            return
        parts = urlsplit(url)
        netloc = parts.netloc.rpartition("@")[2]
        where = {
            "redis_url": urlunsplit(parts._replace(netloc=netloc)),
            "prefix": policies.prefix,
            "credentials": "@" in parts.netloc,
        }
    path = Path(workdir) / LOOP_FILE
    path.write_text(json.dumps({"policy_store": where}, indent=2) + "\n", encoding="utf-8")


def recorded_policy_store(workdir: Path) -> Any | None:
    """The policy store the loop in ``workdir`` acts on (``record_policy_store``); ``policies/`` beside it for
    a workdir from before any record (``agent run`` keeps its store there); None when there is neither. A
    Redis store whose URL carried a password takes its URL from ``$EVOCACHE_POLICY_STORE``. Raises
    ``AgentError`` for a record it cannot read."""
    from evocache.controller import FilePolicyStore, PolicyStoreConfig, open_policy_store
    from evocache.controller._policy_store import POLICY_STORE_ENV

    from .errors import AgentError

    workdir = Path(workdir)
    path = workdir / LOOP_FILE
    if not path.exists():
        return FilePolicyStore(workdir / "policies") if (workdir / "policies").exists() else None
    try:
        where = json.loads(path.read_text(encoding="utf-8"))["policy_store"]
        if "directory" in where:
            return FilePolicyStore(where["directory"])
        url = where["redis_url"]
        if where.get("credentials"):
            url = os.environ.get(POLICY_STORE_ENV) or ""
            if not url.startswith(("redis", "rediss", "unix")):
                raise AgentError(
                    f"{path}: the loop's policy store is {where['redis_url']} with a password: set "
                    f"${POLICY_STORE_ENV} to its full URL to resume the review"
                )
        return open_policy_store(PolicyStoreConfig(redis_url=url, prefix=where.get("prefix", "evc:policy")))
    except (KeyError, TypeError, ValueError) as exc:
        raise AgentError(f"{path}: not a loop record ({type(exc).__name__}: {exc})") from None


def resume_waiting(store: Path, thread: str, verdict: str, reviewer: str = "person") -> str:
    """Resume ``thread`` when it waits in ``review``, over the workdir that holds the proposal store ``store``
    (its ``checkpoints.db``, the policy store it recorded, its ``models``); what the rollout did, or "" when
    nothing waited."""
    from langgraph.checkpoint.sqlite import SqliteSaver

    from ._proposals import ProposalStore

    workdir = Path(store).parent
    checkpoints = workdir / "checkpoints.db"
    if not checkpoints.exists():
        return ""
    policies = recorded_policy_store(workdir)
    if policies is None:
        return ""
    with SqliteSaver.from_conn_string(str(checkpoints)) as saver:
        ctx = LoopContext(policies, ProposalStore(store), model_dir=workdir / "models")
        graph = build_graph(ctx, saver)
        if not graph.get_state(thread_config(thread)).interrupts:
            return ""
        result = resume_review(graph, thread, verdict, reviewer)
    return "; ".join(result.get("notes") or []) or f"resumed {thread}"
