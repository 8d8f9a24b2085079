"""The loop as a LangGraph graph: one pass per window of traffic.

    START ── reconcile ── observe ── diagnose ─┬─ analyse ── act ── END         (a canary is out)
                                               └─ retrain ── propose ─┬─ END     (nothing worth it)
                                                                      ├─ hold ── END
                                                                      ├─ approve ── canary ── END
                                                                      └─ review ── decide ─┬─ canary ── END
                                                                                           └─ END

Every window is diagnosed, a canary out or not, so a drift during a canary is seen when it comes. A route is
named after the node it leads to.

State is plain data (``LoopState``): the window's index, the findings, the proposal id, a person's verdict,
the canary's analysis, this pass's breach and retraining (for the report), and the loop's memory
(``agents._memory.Memory``: the newest windows served, the series, when each canary started and each promotion
came, the kept model). The memory is handed in with each pass and handed back by it, and the SQLite
checkpointer keeps it with the pass, so a review resumed from another process (``resume_review``) sees the
history the waiting pass saw.

Each node is a function of the state that returns an update. The nodes that only read and compute
(``observe``, ``diagnose``, ``analyse``) write nothing; every write to the policy store and the proposal store
goes through the ``Actuator`` (``agents._actuator``), from the nodes ``reconcile`` (evidence that no longer
holds; approved proposals with no pass waiting on them), ``act`` (the canary's verdict), ``propose`` (the new
proposal, superseding older ones), ``hold``, ``approve``, ``decide`` and ``canary``. ``retrain`` writes the
model file it keeps. ``review`` holds nothing but its ``interrupt``: the thread waits in the SQLite
checkpointer, and any process that builds the graph over the same stores and checkpointer resumes it, as
``evocache proposals approve`` does. ``canary`` refuses a proposal whose base is no longer the policy in force
(its evidence is stale) and judges its edits again.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypedDict
from urllib.parse import urlsplit, urlunsplit

from evocache.controller import PolicyStore
from evocache.dsl import Policy, parse_policy

from ._actuator import Actuator
from ._candidates import Edit, apply_edits, candidate_edits
from ._canary import CanaryEvidence, CanaryRules, CanaryVerdict, analyse_canary
from ._evidence import Comparison, Judgement, Step, arm_difference, arm_metrics, compare
from ._memory import Memory, WindowRecord, series_from_dict, series_to_dict
from ._types import Finding, Outcome, Request, Series, WindowStats, step_series, window_stats

log = logging.getLogger("evocache.agents")

DRIFT_KINDS = ("key-drift", "mix-drift")
"""What reports a drift: the workload moved (its keys, its mix). A change point of the hit ratio is a finding
of its own: the cache's answer to a drift, a warm-up or a policy change, not the workload."""

HISTORY = 60
"""Windows whose key counts the loop keeps (the drift tests read the newest 30)."""

CACHE_WIDE = frozenset({"bypass", "tenant-share", "eviction"})
"""Edit kinds whose effect is on the whole cache, not on the requests they decide: their canary's hit ratio is
judged by the fresh replay alone."""


class LoopState(TypedDict, total=False):
    run: str
    thread: str
    window: int
    memory: Memory
    policy: str
    route: str
    findings: list[dict[str, Any]]
    proposal: str | None
    verdict: dict[str, Any] | None  # a person's, from the review
    canary: dict[str, Any] | None  # the canary's analysis: proposal, phase, reason, windows, evidence, span
    breach: dict[str, Any] | None  # this pass's rollback, for the report
    retrained: dict[str, Any] | None  # this pass's retraining, for the report
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


class Loop:
    """What the graph's nodes work with: the stores (``policies``, the one serving reads; ``proposals``, a
    ``ProposalStore``), the ``Actuator`` that writes them, and how to judge (``capacity`` of the replayed L1,
    ``config``, ``vectors`` of semantic prompts, ``diagnose``, the optional ``planner``, ``model_dir`` of the
    trained eviction models). ``model`` is what serves the traffic (model id, revision, prompt-template hash):
    with the policy in force and a fingerprint of the recent output lengths, it is the context every
    proposal's evidence is stored under, and a change of any of them makes undecided proposals stale.

    It holds no memory of its own: every method that reads the history takes the ``Memory`` (or the windows
    made from it), and every one that changes it returns the new one. It only keeps, per process, the typed
    records it made from the memory's plain windows, so that they are made once."""

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
        self.actuator = Actuator(policies, proposals, actor)
        self.capacity = capacity
        self.config = config
        self.vectors = vectors
        self._diagnose = diagnose
        self.plots_dir = plots_dir
        self.actor = actor
        self.planner = planner  # an ``agents._planner.Planner`` or None
        self.model = model
        self.model_dir = model_dir
        self._records: dict[int, tuple[dict[str, Any], WindowRecord]] = {}
        self._series: tuple[list[dict[str, Any]], list[Series]] | None = None
        self._loaded: dict[str, Policy] = {}

    # -- the memory's windows ------------------------------------------------------------------------------

    def load(self, ref: str) -> Policy:
        policy = self._loaded.get(ref)
        if policy is None:
            policy = self._loaded[ref] = self.policies.load(ref)
        return policy

    def records(self, memory: Memory) -> list[WindowRecord]:
        """The memory's windows as typed records, oldest first."""
        return [self._record(plain) for plain in memory["windows"]]

    def _record(self, plain: dict[str, Any]) -> WindowRecord:
        cached = self._records.get(plain["index"])
        if cached is not None and cached[0] is plain:
            return cached[1]
        rec = WindowRecord.from_dict(plain, self.load)
        self._records[rec.index] = (plain, rec)
        return rec

    def _keep(self, rec: WindowRecord) -> dict[str, Any]:
        plain = rec.to_dict()
        self._records[rec.index] = (plain, rec)
        return plain

    def series(self, memory: Memory) -> list[Series]:
        plain = memory["series"]
        if self._series is None or self._series[0] is not plain:
            self._series = (plain, [series_from_dict(s) for s in plain])
        return self._series[1]

    def remember(
        self,
        memory: Memory,
        requests: Sequence[Request],
        outcomes: list[Outcome],
        step: Step,
        canary_arm: list[bool],
        signals: Sequence[Series] = (),
    ) -> tuple[Memory, WindowRecord]:
        """The memory with one more served window, and its record: the window with the other ``signals``
        read over its span (GPU, host, profiler and Nsight Compute series: kept with the cache's own series
        for diagnosis, and their means in the window's record). Only the newest windows keep their requests
        (what replay needs); older ones keep their summary, and only the newest ``HISTORY`` windows their key
        counts, so a loop that runs for days holds a bounded amount."""
        windows = list(memory["windows"])
        index = memory["served"]
        stats = window_stats(index, str(step[0].ref), requests, outcomes)
        means = {_series_name(s): float(sum(s.v) / len(s.v)) for s in signals if s.v}
        rec = WindowRecord(
            index, tuple(requests), tuple(outcomes), step, tuple(canary_arm), stats, signals=means
        )
        windows.append(self._keep(rec))
        series = memory["series"]
        if requests:
            first, last = min(r.t for r in requests), max(r.t for r in requests)
            step_s = self.config.step_s or max(last - first, 1e-6) / 20
            own = step_series(requests, outcomes, start=first, end=last, step_s=step_s)
            merged = _merge_series([*self.series(memory), *own, *signals])
            series = [series_to_dict(s) for s in merged]
            self._series = (series, merged)
        oldest = self._forget(windows, step[0].guardrails.rollout.max_windows)
        # a promotion's realised gain replays from ``warmup`` windows before its canary: kept while those are
        promoted = {
            p: at for p, at in memory["promoted_at"].items() if max(0, at[0] - self.config.warmup) >= oldest
        }
        update = {"windows": windows, "series": series, "served": index + 1, "promoted_at": promoted}
        return {**memory, **update}, rec

    def _forget(self, windows: list[dict[str, Any]], canary_windows: int) -> int:
        """Drop the requests of the windows older than replay reads (a canary's, a realised gain's, a
        judgement's) and the windows older than diagnosis reads, in place; the oldest index kept."""
        cfg = self.config
        keep = cfg.warmup + max(cfg.measure, cfg.realise) + canary_windows + 2
        if len(windows) > keep and windows[-keep - 1]["requests"]:
            rec = self._record(windows[-keep - 1])
            windows[-keep - 1] = self._keep(rec.forgotten(requests=True, keys=False))
        del windows[: -max(HISTORY, keep + 1)]
        oldest = windows[0]["index"]
        for index in [i for i in self._records if i < oldest]:
            del self._records[index]
        return oldest

    def history(self, records: Sequence[WindowRecord]) -> list[WindowStats]:
        """The newest ``HISTORY`` windows' summaries, oldest first: what diagnosis reads."""
        return [w.stats for w in records[-HISTORY:]]

    def active(self) -> Policy:
        from .errors import AgentError

        state = self.policies.state()
        if state.active is None:
            raise AgentError("the policy store has no policy in force")
        return self.load(state.active)

    # -- diagnosis -----------------------------------------------------------------------------------------

    def diagnose(self, memory: Memory) -> tuple[list[Finding], Memory]:
        """This pass's findings, and the memory with them on the newest window."""
        records = self.records(memory)
        if self._diagnose is None or not records:
            return [], memory
        findings = self._diagnose(self.history(records), self.series(memory), plots_dir=self.plots_dir)
        windows = list(memory["windows"])
        windows[-1] = self._keep(replace(records[-1], findings=tuple(findings)))
        return findings, {**memory, "windows": windows}

    # -- the evidence's context ---------------------------------------------------------------------------

    def evidence_context(self, records: Sequence[WindowRecord], policy: Policy) -> Any:
        """What traffic is served by now (``agents._fingerprint.EvidenceContext``): ``policy``, the model, and
        a fingerprint of the recent windows' output lengths (None with fewer than 64 known)."""
        from ._fingerprint import EvidenceContext, OutputFingerprint

        span = records[-(self.config.warmup + self.config.measure) :]
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

    def check_evidence(self, memory: Memory) -> tuple[list[tuple[str, str]], Memory]:
        """Every proposal still to be decided or rolled out (proposed, waiting, approved) whose evidence no
        longer holds under the context now (another policy in force, another model or template, outputs of
        another shape) becomes stale; an approved one is judged again (``reevaluate``). ``(id, reason)`` of
        each, and the memory after."""
        records = self.records(memory)
        if not records:
            return [], memory
        now = self.evidence_context(records, self.active())
        moved = []
        for p in self.proposals.list():
            if p.status not in ("proposed", "waiting", "approved"):
                continue
            was = p.status
            reason = self.actuator.invalidate(p.id, now)
            if reason is not None:
                moved.append((p.id, reason))
                if was == "approved":
                    _, _, memory = self.reevaluate(memory, p.id)
        return moved, memory

    # -- retraining ----------------------------------------------------------------------------------------

    def retrain(self, memory: Memory) -> tuple[dict[str, Any] | None, Memory]:
        """Every ``retrain_every`` windows: train the learned eviction model on the recent windows' head and
        keep it only when it beats the policy in force on their held-back tail (``agents._retrain``). A kept
        model makes ``eviction: {l1: learned, model: <its file>}`` a candidate of the next proposal, judged by
        replay like any edit (over a learned policy in force, the newer model is the candidate).
        What it found (None when it did not run), and the memory after."""
        every = self.config.retrain_every
        records = self.records(memory)
        if every <= 0 or self.model_dir is None or not records or (memory["served"] % every):
            return None, memory
        from ._retrain import retrain

        base = self.active()
        reqs = _span(records, records[-1].index, self.config.warmup + self.config.measure)
        result = retrain(
            [r for w in reqs for r in w.requests],
            base,
            capacity=self.capacity,
            model_dir=self.model_dir,
            seed=self.config.seed,
            vectors=self.vectors,
        )
        found = {"window": records[-1].index, **result.to_dict()}
        memory = {**memory, "last_retrain": found}
        if result.kept:
            memory["kept_model"] = found
        return found, memory

    # -- proposing -----------------------------------------------------------------------------------------

    def busy(self) -> bool:
        """Whether a change is on its way out (approved, or on the canary): one change at a time. A proposal
        waiting for a person does not hold the loop up; a newer one supersedes it."""
        return any(p.status in ("approved", "canary") for p in self.proposals.list())

    def reevaluate(self, memory: Memory, proposal_id: str) -> tuple[Any | None, str, Memory]:
        """A stale proposal's edits judged again, on the policy in force and the newest windows: a new
        proposal and its route (as ``propose`` gives) when the edits still apply and still gain, else
        ``(None, "end")``; and the memory after."""
        old = self.proposals.get(proposal_id)
        records = self.records(memory)
        if not records or not old.edits:
            return None, "end", memory
        base = self.active()
        edits = [Edit.from_dict(e) for e in old.edits]
        try:
            cand = apply_edits(
                base,
                [replace(e, old=_current(base, e.path, e.old)) for e in edits],
                max(memory["top_version"], base.version) + 1,
            )
        except (ValueError, KeyError) as exc:
            log.info("stale proposal %s no longer applies to %s: %s", old.id, base.ref, exc)
            return None, "end", memory
        judged = self.judge(records, base, cand, switch=any(e.kind == "eviction" for e in edits))
        if not self._acceptable(base, judged.comparison):
            return None, "end", memory
        findings = [Finding.from_dict(f) for f in old.findings]
        proposal = self.store_proposal(records, base, cand, edits, findings, judged, None)
        return proposal, self._route(base, edits, judged.comparison), {**memory, "top_version": cand.version}

    def judge(
        self,
        records: Sequence[WindowRecord],
        base: Policy,
        candidate: Policy,
        *,
        last: int | None = None,
        switch: bool = False,
    ) -> Judgement:
        """Replay evidence for ``candidate`` against ``base`` over the windows up to ``last`` (the newest by
        default), from the same cold cache, the last ``measure`` counted. Each policy is in force over all
        ``warmup + measure`` windows, so each arm's cache holds what its own policy kept and the gain is the
        change's lasting effect, the one its promotion is measured against (``realised_gain``). With
        ``switch`` (an eviction class: a new one takes over the cache as it is and learns from there), it is
        also judged taking over only for the measured windows, as it would in production, and the evidence is
        the less favourable of the two (the lower end of its interval): a class that only wins the transition
        after a drift, or only once it has the cache to itself, is not shown to be better."""
        cfg = self.config
        last = records[-1].index if last is None else last
        reqs = [w.requests for w in _span(records, last, cfg.warmup + cfg.measure)]
        measure = min(cfg.measure, len(reqs))
        base_steps: list[Step] = [(base, None, 0.0)] * len(reqs)
        views: dict[str, list[Step]] = {"lasting": [(candidate, None, 0.0)] * len(reqs)}
        if switch:
            views["switch"] = base_steps[: len(reqs) - measure] + [(candidate, None, 0.0)] * measure
        judged = {name: self._compare(reqs, base_steps, steps, measure) for name, steps in views.items()}
        view = min(judged, key=lambda name: judged[name].ci[0])
        return Judgement(judged[view], view, (last - measure + 1, last), time.time())

    def _compare(
        self, reqs: Sequence[Sequence[Request]], base: Sequence[Step], cand: Sequence[Step], measure: int
    ) -> Comparison:
        return compare(
            reqs,
            base,
            cand,
            measure=measure,
            capacity=self.capacity,
            vectors=self.vectors,
            seed=self.config.seed,
            models=self.model_dir,
        )

    def propose(
        self, memory: Memory, findings: Sequence[Finding], thread: str | None = None
    ) -> tuple[Any | None, str, Memory]:
        """The best candidate as a stored proposal and its route (``end``, ``hold``, ``approve``,
        ``review``), older undecided proposals superseded; and the memory after."""
        records = self.records(memory)
        if self.busy() or memory["served"] < 2:
            return None, "end", memory
        base = self.active()
        recent = self.history(records)[-(self.config.warmup + self.config.measure) :]
        edits = candidate_edits(base, findings, recent)[: self.config.max_candidates]
        version = max(memory["top_version"], base.version) + 1
        kept_model = memory["kept_model"]
        if kept_model is not None:
            kept = Edit.from_dict(kept_model["edit"])
            if kept.old == {"l1": base.eviction.l1 or "lru", "model": base.eviction.model}:
                # still an edit of the policy in force (it was not replaced since the model was trained)
                model = f" ({base.eviction.model})" if base.eviction.model else ""
                was = f"{base.eviction.l1 or 'lru'}{model}"
                why = (
                    f"a retrained model beat {was} on held-back traffic: "
                    f"{kept_model['new_hit_ratio']:.3f} against {kept_model['base_hit_ratio']:.3f}"
                )
                edits.append(Edit(kept.kind, kept.path, kept.old, kept.new, why))
            memory = {**memory, "kept_model": None}
        span = records[-(self.config.warmup + self.config.measure) :]
        if any(f.kind in DRIFT_KINDS for w in span for f in w.findings):
            # replayed across a drift, an eviction class is judged on how it weathers the transition, which
            # says little about how it does in the new regime: judged once the span is past the drift
            edits = [e for e in edits if e.kind != "eviction"]
        rationale = ""
        if self.planner is not None:
            planned = self._plan(records, memory["last_retrain"], base, findings, edits, version)
            rationale = planned.rationale
            known = {(e.path, e.new) for e in edits}
            edits += [e for e in planned.edits if (e.path, e.new) not in known]
        if not edits:
            return None, "end", memory
        scored: list[tuple[float, list[Edit], Policy, Judgement]] = []
        for edit in edits:
            try:
                cand = apply_edits(base, [edit], version)
            except ValueError as exc:  # PolicyError, StoreConfigError: never propose what check rejects
                log.info("edit %s refused by policy check: %s", edit.path, exc)
                continue
            judged = self.judge(records, base, cand, switch=edit.kind == "eviction")
            c = judged.comparison
            log.info(
                "window %d: %s %s -> %s: gain %+.4f [%+.4f, %+.4f]",
                records[-1].index, edit.kind, edit.path, edit.new, c.gain, *c.ci,
            )
            if self._acceptable(base, c):
                scored.append((c.ci[0], [edit], cand, judged))
        if len(scored) >= 2:  # the two best edits of different settings together
            scored.sort(key=lambda s: s[0], reverse=True)
            a, b = scored[0], scored[1]
            if a[1][0].path != b[1][0].path:
                try:
                    cand = apply_edits(base, a[1] + b[1], version)
                    switch = any(e.kind == "eviction" for e in a[1] + b[1])
                    judged = self.judge(records, base, cand, switch=switch)
                    if self._acceptable(base, judged.comparison) and judged.comparison.ci[0] > a[0]:
                        scored.append((judged.comparison.ci[0], a[1] + b[1], cand, judged))
                except ValueError as exc:
                    log.info("combined edit refused by policy check: %s", exc)
        if not scored:
            return None, "end", memory
        scored.sort(key=lambda s: s[0], reverse=True)
        _, chosen, cand, judged = scored[0]
        proposal = self.store_proposal(records, base, cand, chosen, findings, judged, thread, rationale)
        self.actuator.supersede(proposal.id)
        return proposal, self._route(base, chosen, judged.comparison), {**memory, "top_version": cand.version}

    @staticmethod
    def _acceptable(base: Policy, evidence: Comparison) -> bool:
        floor = base.guardrails.auto_approve.min_gain if base.guardrails.auto_approve else 0.0
        max_error = base.slo.max_error_rate
        wrong = evidence.candidate.wrong_rate
        within_error = wrong <= evidence.base.wrong_rate + 1e-12 or (
            max_error is not None and wrong <= max_error
        )
        return evidence.gain > floor and evidence.ci[0] > floor and within_error

    def _route(self, base: Policy, edits: Sequence[Edit], evidence: Comparison) -> str:
        if evidence.requests < base.guardrails.rollout.min_requests:
            return "hold"
        if not self.config.interactive and all(e.auto_approvable(base) for e in edits):
            return "approve"
        return "review"

    def _plan(
        self,
        records: Sequence[WindowRecord],
        last_retrain: dict[str, Any] | None,
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
                self.judge(records, base, apply_edits(base, e, version)).comparison
            ),
            diff=lambda e: diff_policies(base, apply_edits(base, e, version)).text,
            retrain=(lambda: last_retrain if last_retrain is not None else {"ran": False}),
        )
        return self.planner.plan(tools, findings, edits)

    def store_proposal(
        self,
        records: Sequence[WindowRecord],
        base: Policy,
        cand: Policy,
        edits: Sequence[Edit],
        findings: Sequence[Finding],
        judged: Judgement,
        thread: str | None,
        rationale: str = "",
    ) -> Any:
        """Store ``cand`` as a new proposal with its evidence, under the context of the traffic now."""
        from ._proposals import Evidence, Proposal

        replay = Evidence.from_replay(
            judged.to_dict(),
            evaluated_at=judged.evaluated_at,
            windows=judged.windows,
            context=self.evidence_context(records, base),
        )
        proposal = Proposal.create(
            base,
            cand,
            at=time.time(),
            edits=[e.to_dict() for e in edits],
            findings=list(findings[:20]),
            evidence=replay,
            predicted_gain=judged.comparison.gain,
            window=records[-1].index,
            thread_id=thread,
            rationale=rationale,
        )
        return self.actuator.add(proposal)

    # -- rolling out ---------------------------------------------------------------------------------------

    def start_canary(self, memory: Memory, proposal_id: str) -> tuple[str, Memory]:
        """Put an approved proposal on the canary (``Actuator.start_canary``), remembering the window it
        starts at; ``stale`` when its base is no longer in force."""
        outcome = self.actuator.start_canary(proposal_id)
        if outcome == "canary":
            started = {**memory["canary_started"], proposal_id: memory["served"]}
            memory = {**memory, "canary_started": started}
        return outcome, memory

    def roll_out(self, memory: Memory, proposal_id: str, *, approve_fresh: bool) -> tuple[list[str], Memory]:
        """An approved proposal to the canary; one found stale there has its edits judged again, and a fresh
        proposal that still gains is held for a person when its evidence counted too little traffic, or, with
        ``approve_fresh``, approved and canaried in the same pass when the guardrails allow it. What happened,
        as notes, and the memory after."""
        outcome, memory = self.start_canary(memory, proposal_id)
        notes = [f"rollout: {outcome}"]
        if outcome != "stale":
            return notes, memory
        fresh, route, memory = self.reevaluate(memory, proposal_id)
        if fresh is None:
            return notes, memory
        notes.append(f"re-evaluated as {fresh.id}")
        if route == "approve" and approve_fresh:
            self.actuator.approve(fresh.id, "re-evaluated; inside the policy's guardrails.auto_approve")
            outcome, memory = self.start_canary(memory, fresh.id)
            notes.append(f"rollout: {outcome}")
        elif route == "hold":
            self.actuator.hold(fresh.id)
        return notes, memory

    def canary_evidence(
        self, memory: Memory, proposal: Any
    ) -> tuple[int, int, CanaryRules, CanaryEvidence | None]:
        """The canary of ``proposal`` as both views see it over the windows since it started: the window it
        started at, the windows on it, the rules it is judged by, and the evidence (None before it may be
        judged: no replay is run for it)."""
        records = self.records(memory)
        state = self.policies.state()
        base = self.load(state.active)
        spec = base.guardrails.rollout
        rules = CanaryRules(
            spec.windows, spec.max_windows, spec.max_drop, spec.min_requests, base.slo.max_error_rate
        )
        start = memory["canary_started"].get(proposal.id, records[-1].index)
        recs = [w for w in records if w.index >= start and w.step[1] is not None]
        if len(recs) < spec.windows:
            return start, len(recs), rules, None
        arms: dict[bool, tuple[list[Request], list[Outcome]]] = {True: ([], []), False: ([], [])}
        for rec in recs:
            for req, out, arm in zip(rec.requests, rec.outcomes, rec.canary_arm, strict=True):
                arms[arm][0].append(req)
                arms[arm][1].append(out)
        difference = arm_difference(arms[True], arms[False], seed=self.config.seed)
        candidate = parse_policy(proposal.new_policy, proposal.new_ref)
        reqs = [w.requests for w in _span(records, records[-1].index, self.config.warmup + len(recs))]
        measure = min(len(recs), len(reqs))
        steps = [(base, None, 0.0)] * len(reqs), [(candidate, None, 0.0)] * len(reqs)
        fresh = self._compare(reqs, *steps, measure)
        local = not any(e.get("kind") in CACHE_WIDE for e in proposal.edits)
        live = arm_metrics(*arms[True]), arm_metrics(*arms[False])
        evidence = CanaryEvidence(*live, difference, fresh, local)
        return start, len(recs), rules, evidence

    def realised_gain(self, memory: Memory, proposal_id: str) -> float | None:
        """The promoted change's gain over the ``realise`` windows after its promotion: the schedule that ran
        against the same schedule without it, replayed from the same cold start. None until those windows."""
        if proposal_id not in memory["promoted_at"]:
            return None
        start, promoted = memory["promoted_at"][proposal_id]
        cfg = self.config
        last = promoted + cfg.realise
        records = self.records(memory)
        if last > records[-1].index:
            return None
        first = max(0, start - cfg.warmup)
        recs = [r for r in records if first <= r.index <= last]
        old_base = next(r for r in recs if r.index == start).step[0]
        actual = [r.step for r in recs]
        without = [r.step if r.index < start else (old_base, None, 0.0) for r in recs]
        return float(self._compare([r.requests for r in recs], without, actual, cfg.realise).gain)


def _span(records: Sequence[WindowRecord], last: int, count: int) -> list[WindowRecord]:
    """The ``count`` windows up to the one of index ``last``."""
    return [w for w in records if last - count < w.index <= last]


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


def build_graph(loop: Loop, checkpointer: Any) -> Any:
    """The loop's graph over ``loop``, compiled with ``checkpointer`` (a LangGraph ``SqliteSaver``)."""
    from langgraph.graph import END, START, StateGraph
    from langgraph.types import interrupt

    def reconcile(state: LoopState) -> LoopState:
        _, memory = loop.check_evidence(state["memory"])
        for approved in loop.proposals.list(status="approved"):  # approved with no pass waiting on it
            _, memory = loop.roll_out(memory, approved.id, approve_fresh=False)
        return {"memory": memory}

    def observe(state: LoopState) -> LoopState:
        memory = state["memory"]
        rollout = loop.policies.state()
        out = None
        if rollout.canary is not None:
            out = next(iter(loop.proposals.list(status="canary")), None)
        if out is not None and out.id not in memory["canary_started"]:
            # put on the canary by another process (a review resumed there): judged from this window on
            started = {**memory["canary_started"], out.id: memory["served"] - 1}
            memory = {**memory, "canary_started": started}
        return {
            "memory": memory,
            "policy": rollout.active or "",
            "findings": [],
            "proposal": None if out is None else out.id,
            "verdict": None,
            "canary": None,
            "route": "analyse" if rollout.canary is not None else "retrain",
        }

    def diagnose(state: LoopState) -> LoopState:
        findings, memory = loop.diagnose(state["memory"])
        return {"findings": [f.to_dict() for f in findings], "memory": memory}

    def analyse(state: LoopState) -> LoopState:
        if state.get("proposal") is None:  # a canary no proposal of the loop's put out
            return {"canary": None}
        memory = state["memory"]
        proposal = loop.proposals.get(state["proposal"])
        start, windows, rules, evidence = loop.canary_evidence(memory, proposal)
        verdict = analyse_canary(rules, windows, evidence)
        return {
            "canary": {
                "proposal": proposal.id,
                "phase": verdict.phase,
                "reason": verdict.reason,
                "windows": verdict.windows,
                "span": [start, memory["served"] - 1],
                "evidence": None if evidence is None else evidence.to_dict(),
            }
        }

    def act(state: LoopState) -> LoopState:
        analysis = state.get("canary")
        if analysis is None:
            return {"notes": ["canary: none"]}
        plain = analysis["evidence"]
        evidence = None if plain is None else CanaryEvidence.from_dict(plain)
        verdict = CanaryVerdict(analysis["phase"], analysis["windows"], analysis["reason"])
        outcome = loop.actuator.act(analysis["proposal"], verdict, evidence)
        memory = state["memory"]
        update: LoopState = {"notes": [f"canary: {outcome}"]}
        if outcome in ("promoted", "rolled_back", "waiting"):  # the canary is over
            started = {p: at for p, at in memory["canary_started"].items() if p != analysis["proposal"]}
            memory = {**memory, "canary_started": started}
        if outcome == "rolled_back":
            assert plain is not None
            replay = plain["replay"]
            breach = {
                "canary": plain["canary"],
                "base": plain["base"],
                "difference": plain["difference"],
                "replay": [replay["gain"], *replay["ci"]],
                "windows": analysis["span"],
                "proposal": analysis["proposal"],
                "reason": verdict.reason,
                "canary_windows": verdict.windows,
            }
            update["breach"] = breach
        elif outcome == "promoted":
            start, last = analysis["span"]
            memory = {**memory, "promoted_at": {**memory["promoted_at"], analysis["proposal"]: [start, last]}}
        return {**update, "memory": memory}

    def retrain(state: LoopState) -> LoopState:
        found, memory = loop.retrain(state["memory"])
        if found is None:
            return {"memory": memory, "notes": []}
        notes = [f"retrain: {'kept' if found['kept'] else 'not kept'}: {found['reason']}"]
        return {"memory": memory, "notes": notes, "retrained": found}

    def propose(state: LoopState) -> LoopState:
        findings = [Finding.from_dict(f) for f in state.get("findings", [])]
        proposal, route, memory = loop.propose(state["memory"], findings, state.get("thread"))
        return {"proposal": None if proposal is None else proposal.id, "route": route, "memory": memory}

    def hold(state: LoopState) -> LoopState:
        loop.actuator.hold(state["proposal"])
        return {"notes": [f"{state['proposal']}: waiting for a person"]}

    def approve(state: LoopState) -> LoopState:
        loop.actuator.approve(state["proposal"])
        return {}

    def review(state: LoopState) -> LoopState:
        return {"verdict": interrupt({"proposal": state["proposal"], "policy": state.get("policy", "")})}

    def decide(state: LoopState) -> LoopState:
        verdict = state.get("verdict") or {}
        proposal = loop.proposals.get(state["proposal"])
        if proposal.status in ("proposed", "waiting"):  # the CLI records the review before it resumes
            proposal = loop.actuator.review(
                proposal.id,
                verdict.get("verdict", "reject"),
                verdict.get("reviewer", "person"),
                verdict.get("note", ""),
            )
        return {"route": "canary" if proposal.status == "approved" else "end"}

    def canary(state: LoopState) -> LoopState:
        notes, memory = loop.roll_out(state["memory"], state["proposal"], approve_fresh=True)
        return {"notes": notes, "memory": memory}

    graph = StateGraph(LoopState)
    for name, fn in (
        ("reconcile", reconcile),
        ("observe", observe),
        ("diagnose", diagnose),
        ("analyse", analyse),
        ("act", act),
        ("retrain", retrain),
        ("propose", propose),
        ("hold", hold),
        ("approve", approve),
        ("review", review),
        ("decide", decide),
        ("canary", canary),
    ):
        graph.add_node(name, fn)
    graph.add_edge(START, "reconcile")
    graph.add_edge("reconcile", "observe")
    graph.add_edge("observe", "diagnose")  # every window is diagnosed, a canary out or not
    graph.add_conditional_edges("diagnose", _route, {"analyse": "analyse", "retrain": "retrain"})
    graph.add_edge("analyse", "act")
    graph.add_edge("act", END)
    graph.add_edge("retrain", "propose")
    graph.add_conditional_edges(
        "propose", _route, {"end": END, "hold": "hold", "approve": "approve", "review": "review"}
    )
    graph.add_edge("hold", END)
    graph.add_edge("approve", "canary")
    graph.add_edge("review", "decide")
    graph.add_conditional_edges("decide", _route, {"canary": "canary", "end": END})
    graph.add_edge("canary", END)
    return graph.compile(checkpointer=checkpointer)


def _route(state: LoopState) -> str:
    return state["route"]


def thread_config(thread_id: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": thread_id}}


def run_pass(graph: Any, memory: Memory, run: str, window: int) -> LoopState:
    """One pass of the loop over the memory that holds window ``window`` as its newest: the state it ended
    in (or waits in, for a person: its thread is kept; a pass that ran to its end is deleted). Its
    ``memory`` is the next pass's."""
    thread = f"{run}-w{window}"
    result: LoopState = graph.invoke(
        {"run": run, "thread": thread, "window": window, "memory": memory},
        thread_config(thread),
        durability="sync",
    )
    if not graph.get_state(thread_config(thread)).interrupts:
        graph.checkpointer.delete_thread(thread)
    return result


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


def record_policy_store(
    workdir: Path, policies: Any, *, capacity: int | None = None, config: LoopConfig | None = None
) -> None:
    """Write down in ``workdir`` where ``policies`` lives (a directory, or a Redis URL with any password left
    out) and how the loop judges (``capacity``, ``config``), so that ``resume_waiting`` opens the same store
    and judges as the loop does."""
    from dataclasses import asdict

    from evocache.controller import FilePolicyStore, RedisPolicyStore

    if isinstance(policies, FilePolicyStore):
        where: dict[str, Any] = {"directory": str(policies.directory.resolve())}
    elif isinstance(policies, RedisPolicyStore):
        url = policies.url
        parts = urlsplit(url)
        netloc = parts.netloc.rpartition("@")[2]
        where = {
            "redis_url": urlunsplit(parts._replace(netloc=netloc)),
            "prefix": policies.prefix,
            "credentials": "@" in parts.netloc,
        }
    else:  # a store of the caller's own making: nothing another process could open
        return
    record: dict[str, Any] = {"policy_store": where}
    if capacity is not None:
        record["capacity"] = capacity
    if config is not None:
        record["config"] = asdict(config)
    path = Path(workdir) / LOOP_FILE
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def recorded_judging(workdir: Path) -> tuple[int, LoopConfig]:
    """The capacity and config the loop in ``workdir`` judges with (``record_policy_store``); the defaults
    where it wrote none."""
    from .errors import AgentError

    path = Path(workdir) / LOOP_FILE
    if not path.exists():
        return 1, LoopConfig()
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        return int(record.get("capacity", 1)), LoopConfig(**record.get("config", {}))
    except (TypeError, ValueError) as exc:
        raise AgentError(f"{path}: not a loop record ({type(exc).__name__}: {exc})") from None


def recorded_policy_store(workdir: Path) -> Any | None:
    """The policy store the loop in ``workdir`` acts on (``record_policy_store``); ``policies/`` beside it for
    a workdir from before any record (``agent run`` keeps its store there); None when there is neither. A
    Redis store whose URL carried a password takes its URL from ``$EVOCACHE_POLICY_STORE``. Raises
    ``AgentError`` for a record it cannot read."""
    from evocache.controller import FilePolicyStore, PolicyStoreConfig, open_policy_store
    from evocache.controller import POLICY_STORE_ENV

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
    capacity, config = recorded_judging(workdir)
    with SqliteSaver.from_conn_string(str(checkpoints)) as saver:
        loop = Loop(
            policies, ProposalStore(store), capacity=capacity, config=config, model_dir=workdir / "models"
        )
        graph = build_graph(loop, saver)
        waiting = graph.get_state(thread_config(thread))
        if not waiting.interrupts:
            return ""
        loop.vectors = _vectors(loop.records(waiting.values["memory"]), workdir / "embeddings")
        result = resume_review(graph, thread, verdict, reviewer)
    return "; ".join(result.get("notes") or []) or f"resumed {thread}"


def _vectors(records: Sequence[WindowRecord], cache_dir: Path) -> Any:
    """The embeddings of the remembered semantic prompts (from the loop's cache on disk), or None when the
    windows hold none: what judging them again needs."""
    return embed_prompts([r for w in records for r in w.requests], cache_dir)


def embed_prompts(requests: Sequence[Request], cache_dir: Path | None) -> Any:
    """The semantic requests' prompts embedded once (the packaged MiniLM; cached on disk), or None."""
    prompts = sorted({r.prompt for r in requests if r.kind == "semantic" and r.prompt})
    if not prompts:
        return None
    from evocache.controller.semantic import default_embedder, precomputed_embedder

    return precomputed_embedder(prompts, default_embedder(), cache_dir)
