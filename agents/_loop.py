"""The loop as a LangGraph graph: one pass per window of traffic.

    START ── reconcile ── observe ── diagnose ─┬─ analyse ── act ── END         (a canary is out)
                                               └─ retrain ── propose ─┬─ END     (nothing worth it)
                                                                      └─ store   (below)

    store ─┬─ hold ── END                                                        (too little traffic)
           ├─ approve ── canary ── END
           └─ review ── decide ─┬─ canary ── END
                                └─ END                                           (rejected)

Every window is diagnosed, a canary out or not, so a drift during a canary is seen when it comes. A route is
named after the node it leads to.

State is plain data (``LoopState``): the window's index, the findings, the candidate planned and judged, the
proposal id, a person's verdict, the canary's analysis, this pass's breach and retraining (for the report),
and the loop's memory (``agents._memory.Memory``: the newest windows served, the series, when each canary
started and each promotion came, the kept model). The memory is handed in with each pass and handed back by
it, and the SQLite checkpointer keeps it with the pass, so a review resumed from another process
(``resume_review``) sees the history the waiting pass saw.

Each node is a function of the state that returns an update. The nodes that only read and compute
(``observe``, ``diagnose``, ``analyse``, ``propose``) write nothing: ``analyse`` hands ``act`` the canary's
analysis (``agents._canary.CanaryAnalysis``) and ``propose`` hands ``store`` the best candidate
(``agents._proposer.Candidate``, with its typed replay judgement and its route), both as plain data in the
state. Every write to the policy store and the proposal store goes through the ``Actuator``
(``agents._actuator``), from the nodes ``reconcile`` (evidence that no longer holds; approved proposals with
no pass waiting on them), ``act`` (the canary's verdict), ``store`` (the candidate as a new proposal,
superseding older ones), ``hold``, ``approve``, ``decide`` and ``canary``. ``retrain`` writes the model file
it keeps. ``review`` holds nothing but its ``interrupt``: the thread waits in the SQLite checkpointer, and any
process that builds the graph over the same stores and checkpointer resumes it, as ``evocache proposals
approve`` does. ``canary`` refuses a proposal whose base is no longer the policy in force (its evidence is
stale) and judges its edits again.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypedDict
from urllib.parse import urlsplit, urlunsplit

from evocache.controller import PolicyStore
from evocache.dsl import Policy, parse_policy

from ._actuator import Actuator
from ._canary import CanaryAnalysis, CanaryRules, analyse_canary
from ._candidates import Edit
from ._config import LoopConfig
from ._judge import Judge
from ._memory import Memory, Records, WindowRecord, history, span
from ._proposer import Candidate, Proposer
from ._types import Finding, Request


class LoopState(TypedDict, total=False):
    run: str
    thread: str
    window: int
    memory: Memory
    policy: str
    route: str
    findings: list[dict[str, Any]]
    candidate: dict[str, Any] | None  # the proposer's, from ``propose`` to ``store`` (``Candidate.to_dict``)
    proposal: str | None
    verdict: dict[str, Any] | None  # a person's, from the review
    canary: dict[str, Any] | None  # the canary's analysis, from ``analyse`` to ``act`` (``CanaryAnalysis``)
    breach: dict[str, Any] | None  # this pass's rollback, for the report
    retrained: dict[str, Any] | None  # this pass's retraining, for the report
    notes: list[str]


class Loop:
    """What the graph's nodes work with: the stores (``policies``, the one serving reads; ``proposals``, a
    ``ProposalStore``) and one piece per job over them:

    - ``records`` (``agents._memory.Records``): the memory's typed view, and how it grows by a window;
    - ``judge`` (``agents._judge.Judge``): replay evidence with ``capacity`` of L1, ``config``, the
      ``vectors`` of semantic prompts and the trained eviction models in ``model_dir``, under the context of
      ``model`` (model id, revision, prompt-template hash), computed and returned;
    - ``proposer`` (``agents._proposer.Proposer``): candidates planned (with the optional ``planner``) and
      judged, as plain data;
    - ``actuator`` (``agents._actuator.Actuator``): every write to the two stores, as ``actor``.

    Its own methods join them for the graph's nodes, plus ``diagnose`` (the findings; ``plots_dir`` for their
    plots) and ``retrain`` (the learned eviction model, into ``model_dir``). It holds no memory of its own:
    each method that reads the history takes the ``Memory``, and each that changes it returns the new one."""

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
        self.config = config
        self.records = Records(policies.load, config)
        self.judge = Judge(capacity, config, vectors=vectors, model_dir=model_dir, model=model)
        self.proposer = Proposer(self.judge, planner)
        self.actuator = Actuator(policies, proposals, actor)
        self._diagnose = diagnose
        self.plots_dir = plots_dir

    def active(self) -> Policy:
        from .errors import AgentError

        state = self.policies.state()
        if state.active is None:
            raise AgentError("the policy store has no policy in force")
        return self.records.policy(state.active)

    def busy(self) -> bool:
        """Whether a change is on its way out (approved, or on the canary): one change at a time. A proposal
        waiting for a person does not hold the loop up; a newer one supersedes it."""
        return any(p.status in ("approved", "canary") for p in self.proposals.list())

    # -- reading and computing -----------------------------------------------------------------------------

    def diagnose(self, memory: Memory) -> tuple[list[Finding], Memory]:
        """This pass's findings, and the memory with them on the newest window."""
        records = self.records.of(memory)
        if self._diagnose is None or not records:
            return [], memory
        findings = self._diagnose(history(records), self.records.series(memory), plots_dir=self.plots_dir)
        return findings, self.records.with_findings(memory, findings)

    def plan(self, memory: Memory, findings: Sequence[Finding]) -> tuple[Candidate | None, Memory]:
        """The best candidate change of the policy in force (``Proposer.plan``), or None when a change is on
        its way out, too few windows were served or nothing gains enough; and the memory after (a kept
        retrained model is offered once). Writes nothing."""
        if self.busy() or memory["served"] < 2:
            return None, memory
        base = self.active()
        candidate = self.proposer.plan(
            self.records.of(memory),
            base,
            findings,
            version=max(memory["top_version"], base.version) + 1,
            kept_model=memory["kept_model"],
            last_retrain=memory["last_retrain"],
        )
        if memory["kept_model"] is not None:
            memory = {**memory, "kept_model": None}
        return candidate, memory

    def canary_analysis(self, memory: Memory, proposal: Any) -> CanaryAnalysis:
        """The verdict on the canary of ``proposal`` over the windows since it started, judged by the rules of
        the policy in force (``agents._canary.analyse_canary``), with the evidence it was reached on."""
        records = self.records.of(memory)
        base = self.active()
        rules = CanaryRules.of(base)
        start = memory["canary_started"].get(proposal.id, records[-1].index)
        candidate = parse_policy(proposal.new_policy, proposal.new_ref)
        windows, evidence = self.judge.canary(records, start, base, candidate, proposal.edits, rules.windows)
        verdict = analyse_canary(rules, windows, evidence)
        return CanaryAnalysis(proposal.id, verdict, (start, memory["served"] - 1), evidence)

    def realised_gain(self, memory: Memory, proposal_id: str) -> float | None:
        """The promoted change's gain over the ``realise`` windows after its promotion
        (``Judge.realised_gain``); None until those windows, or when the memory no longer holds it."""
        if proposal_id not in memory["promoted_at"]:
            return None
        start, promoted = memory["promoted_at"][proposal_id]
        return self.judge.realised_gain(self.records.of(memory), start, promoted)

    # -- acting: each of these writes -----------------------------------------------------------------------

    def retrain(self, memory: Memory) -> tuple[dict[str, Any] | None, Memory]:
        """Every ``retrain_every`` windows: train the learned eviction model on the recent windows' head and
        keep it only when it beats the policy in force on their held-back tail (``agents._retrain``; a kept
        model's file is written into ``model_dir``). A kept model makes ``eviction: {l1: learned, model: <its
        file>}`` a candidate of the next proposal, judged by replay like any edit (over a learned policy in
        force, the newer model is the candidate). What it found (None when it did not run), and the memory
        after."""
        every, judge = self.config.retrain_every, self.judge
        records = self.records.of(memory)
        if every <= 0 or judge.model_dir is None or not records or (memory["served"] % every):
            return None, memory
        from ._retrain import retrain

        base = self.active()
        reqs = span(records, records[-1].index, self.config.warmup + self.config.measure)
        result = retrain(
            [r for w in reqs for r in w.requests],
            base,
            capacity=judge.capacity,
            model_dir=judge.model_dir,
            seed=self.config.seed,
            vectors=judge.vectors,
        )
        found = {"window": records[-1].index, **result.to_dict()}
        memory = {**memory, "last_retrain": found}
        if result.kept:
            memory["kept_model"] = found
        return found, memory

    def store(self, memory: Memory, candidate: Candidate, thread: str | None) -> tuple[Any, Memory]:
        """Store ``candidate`` as a new proposal (``thread``: the pass that may wait on its review) with its
        evidence, under the context of the traffic the memory holds; the proposal as stored, and the memory
        after (the candidate's version made)."""
        from ._proposals import Evidence, Proposal

        records = self.records.of(memory)
        base = self.records.policy(candidate.base)
        policy = candidate.policy()
        judged = candidate.judgement
        replay = Evidence.from_replay(
            judged.to_dict(),
            evaluated_at=judged.evaluated_at,
            windows=judged.windows,
            context=self.judge.context(records, base),
        )
        proposal = Proposal.create(
            base,
            policy,
            at=time.time(),
            edits=[e.to_dict() for e in candidate.edits],
            findings=list(candidate.findings[:20]),
            evidence=replay,
            predicted_gain=judged.comparison.gain,
            window=records[-1].index,
            thread_id=thread,
            rationale=candidate.rationale,
        )
        stored = self.actuator.add(proposal)
        return stored, {**memory, "top_version": max(memory["top_version"], policy.version)}

    def check_evidence(self, memory: Memory) -> tuple[list[tuple[str, str]], Memory]:
        """Every proposal still to be decided or rolled out (proposed, waiting, approved) whose evidence no
        longer holds under the context now (another policy in force, another model or template, outputs of
        another shape) becomes stale; an approved one is judged again (``reevaluate``). ``(id, reason)`` of
        each, and the memory after."""
        records = self.records.of(memory)
        if not records:
            return [], memory
        now = self.judge.context(records, self.active())
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

    def reevaluate(self, memory: Memory, proposal_id: str) -> tuple[Any | None, str, Memory]:
        """A stale proposal's edits judged again, on the policy in force and the newest windows, and stored as
        a new proposal with its route (as ``store`` after ``plan``) when they still apply and still gain,
        else ``(None, "end")``; and the memory after."""
        old = self.proposals.get(proposal_id)
        records = self.records.of(memory)
        if not records:
            return None, "end", memory
        base = self.active()
        candidate = self.proposer.rejudge(
            records,
            base,
            [Edit.from_dict(e) for e in old.edits],
            [Finding.from_dict(f) for f in old.findings],
            version=max(memory["top_version"], base.version) + 1,
        )
        if candidate is None:
            return None, "end", memory
        proposal, memory = self.store(memory, candidate, None)
        return proposal, candidate.route, memory

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
            "candidate": None,
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
        analysis = loop.canary_analysis(state["memory"], loop.proposals.get(state["proposal"]))
        return {"canary": analysis.to_dict()}

    def act(state: LoopState) -> LoopState:
        plain = state.get("canary")
        if plain is None:
            return {"notes": ["canary: none"]}
        analysis = CanaryAnalysis.from_dict(plain)
        outcome = loop.actuator.act(analysis.proposal, analysis.verdict, analysis.evidence)
        memory = state["memory"]
        update: LoopState = {"notes": [f"canary: {outcome}"]}
        if outcome in ("promoted", "rolled_back", "waiting"):  # the canary is over
            started = {p: at for p, at in memory["canary_started"].items() if p != analysis.proposal}
            memory = {**memory, "canary_started": started}
        if outcome == "rolled_back":
            update["breach"] = _breach(analysis)
        elif outcome == "promoted":
            promoted = {**memory["promoted_at"], analysis.proposal: list(analysis.span)}
            memory = {**memory, "promoted_at": promoted}
        return {**update, "memory": memory}

    def retrain(state: LoopState) -> LoopState:
        found, memory = loop.retrain(state["memory"])
        if found is None:
            return {"memory": memory, "notes": []}
        notes = [f"retrain: {'kept' if found['kept'] else 'not kept'}: {found['reason']}"]
        return {"memory": memory, "notes": notes, "retrained": found}

    def propose(state: LoopState) -> LoopState:
        findings = [Finding.from_dict(f) for f in state.get("findings", [])]
        candidate, memory = loop.plan(state["memory"], findings)
        if candidate is None:
            return {"candidate": None, "route": "end", "memory": memory}
        return {"candidate": candidate.to_dict(), "route": "store", "memory": memory}

    def store(state: LoopState) -> LoopState:
        candidate = Candidate.from_dict(state["candidate"])
        proposal, memory = loop.store(state["memory"], candidate, state.get("thread"))
        loop.actuator.supersede(proposal.id)
        return {"proposal": proposal.id, "route": candidate.route, "memory": memory}

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
        ("store", store),
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
    graph.add_conditional_edges("propose", _route, {"end": END, "store": "store"})
    graph.add_conditional_edges("store", _route, {"hold": "hold", "approve": "approve", "review": "review"})
    graph.add_edge("hold", END)
    graph.add_edge("approve", "canary")
    graph.add_edge("review", "decide")
    graph.add_conditional_edges("decide", _route, {"canary": "canary", "end": END})
    graph.add_edge("canary", END)
    return graph.compile(checkpointer=checkpointer)


def _route(state: LoopState) -> str:
    return state["route"]


def _breach(analysis: CanaryAnalysis) -> dict[str, Any]:
    """The report's row of a canary rolled back: both arms, their difference, the fresh replay's gain and
    interval, the windows it ran over and why."""
    evidence = analysis.evidence
    assert evidence is not None, "a canary is rolled back on evidence"
    replay = evidence.replay
    return {
        "canary": evidence.canary.to_dict(),
        "base": evidence.base.to_dict(),
        "difference": list(evidence.difference),
        "replay": [replay.gain, *replay.ci],
        "windows": list(analysis.span),
        "proposal": analysis.proposal,
        "reason": analysis.verdict.reason,
        "canary_windows": analysis.verdict.windows,
    }


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
        loop.judge.vectors = _vectors(loop.records.of(waiting.values["memory"]), workdir / "embeddings")
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
