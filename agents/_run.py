"""``evocache agent run --trace``: the loop over a recorded trace, as if the trace were a deployment's
traffic.

The trace is cut into windows of ``window`` requests. A ``PolicySimulator`` stands for the deployment: before
each window it reads the policy store (the policy in force, the canary and its fraction) as a replica would,
serves the window, and the loop's graph runs one pass on what it saw. Proposals, reviews and policy history go
to the proposal store; the graph's threads to a SQLite checkpointer beside it, so a review left waiting can be
approved from another process (``evocache proposals approve``). ``harmful_at`` injects, at that window (or
the first after it with no other change on its way out), a proposal meant to hurt (every ttl cut to one
second), approved by a person against its evidence, to show the canary catch it and roll it back.

The result (``LoopRunner.report``) is the document ``--json`` writes:
``{"windows": [{"index", "start", "end", "requests", "policy", "hit_ratio", "findings": [{"kind", "score",
"p_value"}]}], "drift_detected_at", "proposals": [{"id", "window", "status", "predicted_gain",
"realised_gain"}]}``.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evocache.controller import FilePolicyStore
from evocache.dsl import Policy

from ._candidates import Edit, apply_edits
from ._loop import Loop, LoopConfig, build_graph, embed_prompts, record_policy_store, run_pass
from ._memory import Memory, WindowRecord, empty_memory
from ._proposer import DRIFT_KINDS, Candidate
from ._types import Request
from evocache.controller.replay import PolicySimulator
from ._workload import read_requests, windows
from .errors import AgentError, WorkloadError


@dataclass(frozen=True, slots=True)
class RunOptions:
    """``window`` requests per window; ``capacity`` of the simulated L1 in the trace's size unit (None:
    ``capacity_fraction`` of the trace's distinct keys times their size); ``harmful_at`` the window from which
    to
    inject a harmful proposal, once no other change is on its way out (None: none)."""

    window: int = 300
    capacity: int | None = None
    capacity_fraction: float = 0.1
    harmful_at: int | None = None
    loop: LoopConfig = LoopConfig()


def default_capacity(requests: list[Request], fraction: float) -> int:
    seen: dict[tuple[str, str], int] = {}
    for r in requests:
        for k in r.keys:
            seen.setdefault((r.ns, k), r.size)
    return max(1, math.floor(fraction * sum(seen.values())))


def harmful_edits(policy: Policy) -> list[Edit]:
    """Every ttl cut to one second: a change no replay would back, to be caught by the canary."""
    edits = [Edit("ttl", "defaults.ttl", policy.defaults.ttl, 1.0, "injected: harmful on purpose")]
    edits += [
        Edit("ttl", f"rules.{r.name}.ttl", r.ttl, 1.0, "injected: harmful on purpose")
        for r in policy.rules
        if r.ttl is not None
    ]
    return edits


class LoopRunner:
    """The per-window work every driver shares (a trace, a live deployment): remember the window, inject the
    harmful proposal when asked, run one pass of the graph on the memory, fill in realised gains, keep the
    report's rows. ``memory`` is what the last pass handed back (``agents._memory.Memory``)."""

    def __init__(
        self, loop: Loop, graph: Any, *, run_id: str | None = None, harmful_at: int | None = None
    ) -> None:
        self.ctx = loop
        self.graph = graph
        self.run_id = run_id or uuid.uuid4().hex[:8]
        self.harmful_at = harmful_at
        self.memory: Memory = empty_memory()
        self.rows: list[dict[str, Any]] = []
        self.breaches: list[dict[str, Any]] = []
        self.retrains: list[dict[str, Any]] = []

    @property
    def windows(self) -> list[WindowRecord]:
        """The windows served so far, as the loop remembers them."""
        return self.ctx.records.of(self.memory)

    def window(
        self, requests: list[Request], outcomes: list[Any], step: Any, arms: list[bool], signals: Any = ()
    ) -> dict[str, Any]:
        loop = self.ctx
        memory, rec = loop.records.remember(self.memory, requests, outcomes, step, arms, signals)
        if self.harmful_at is not None and rec.index >= self.harmful_at and not loop.busy():
            # at the first window from ``harmful_at`` on with no other change on its way out
            _, memory = inject_harmful(loop, memory, step[0])
            self.harmful_at = None
        ended = run_pass(self.graph, memory, self.run_id, rec.index)
        self.memory = ended["memory"]
        self.breaches += [ended["breach"]] if ended.get("breach") else []
        self.retrains += [ended["retrained"]] if ended.get("retrained") else []
        newest = loop.records.of(self.memory)[-1]
        assert newest.index == rec.index
        row = _row(newest, rec.requests)
        self.rows.append(row)
        for p in loop.proposals.list(status="promoted"):
            if p.realised_gain is None:
                gain = loop.realised_gain(self.memory, p.id)
                if gain is not None:
                    loop.actuator.realised(p.id, gain)
        return row

    def report(self) -> dict[str, Any]:
        rows = self.rows
        proposals = sorted(self.ctx.proposals.list(), key=lambda p: p.created_at)
        return {
            "windows": rows,
            "drift_detected_at": next(
                (r["index"] for r in rows if any(f["kind"] in DRIFT_KINDS for f in r["findings"])), None
            ),
            "proposals": [
                {
                    "id": p.id,
                    "window": p.window,
                    "status": p.status,
                    "predicted_gain": p.predicted_gain,
                    "realised_gain": p.realised_gain,
                }
                for p in proposals
            ],
            "breaches": self.breaches,
            "retrains": self.retrains,
            "capacity": self.ctx.judge.capacity,
        }


def open_loop(
    policies: Any,
    workdir: Path,
    policy: Policy,
    *,
    capacity: int,
    config: LoopConfig,
    vectors: Any = None,
    diagnose: Callable[..., Any] | None = None,
    actor: str = "agent run",
    model: tuple[str, str, str] = ("", "", ""),
    replace: bool = False,
) -> Loop:
    """The loop's context over ``policies`` (the store serving reads), with its proposal store and plots
    under ``workdir``; ``policy`` applied when the store has none in force, or with ``replace`` over the one
    in force (``Actuator.adopt``). ``model``: what serves the traffic (id, revision, prompt-template hash),
    part of the evidence's context."""
    from ._proposals import ProposalStore

    workdir.mkdir(parents=True, exist_ok=True)
    record_policy_store(workdir, policies, capacity=capacity, config=config)  # for a review resumed elsewhere
    if diagnose is None:
        from .diagnosis import diagnose as default_diagnose

        diagnose = default_diagnose
    from ._planner import planner_from_env

    loop = Loop(
        policies,
        ProposalStore(workdir / "proposals.db"),
        capacity=capacity,
        config=config,
        vectors=vectors,
        diagnose=diagnose,
        plots_dir=workdir / "plots",
        model_dir=workdir / "models",
        planner=planner_from_env(),
        model=model,
        actor=actor,
    )
    loop.actuator.adopt(policy, replace=replace)
    return loop


def run_trace(
    trace: str | Path,
    policy: Policy,
    workdir: str | Path,
    *,
    options: RunOptions = RunOptions(),
    diagnose: Callable[..., Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Run the loop over ``trace`` under ``policy``; state under ``workdir`` (policy store, proposals, the
    checkpointer). Returns the report document."""
    from langgraph.checkpoint.sqlite import SqliteSaver

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    requests = sorted(read_requests(trace), key=lambda r: r.t)  # stable: a trace's ties keep their order
    if not requests:
        raise WorkloadError(f"{trace}: no requests")
    spans = list(windows(requests, options.window))
    capacity = options.capacity or default_capacity(requests, options.capacity_fraction)
    vectors = embed_prompts(requests, workdir / "embeddings")
    policies = FilePolicyStore(workdir / "policies")
    active = policies.state().active
    newer = active is not None and policies.load(active).content_hash != policy.content_hash
    if newer and policy.version <= policies.load(active).version:
        raise AgentError(
            f"{workdir} already runs {active}, not the policy given ({policy.ref}): give a "
            f"fresh --workdir, that policy, or a newer version"
        )
    ctx = open_loop(
        policies,
        workdir,
        policy,
        capacity=capacity,
        config=options.loop,
        vectors=vectors,
        diagnose=diagnose,
        replace=newer,  # a newer version: in force from the first window on
    )
    live = PolicySimulator(
        ctx.active(), capacity, seed=options.loop.seed, vectors=vectors, models=ctx.judge.model_dir
    )
    with SqliteSaver.from_conn_string(str(workdir / "checkpoints.db")) as saver:
        runner = LoopRunner(ctx, build_graph(ctx, saver), harmful_at=options.harmful_at)
        for i, span in enumerate(spans):
            state = policies.state()
            base = policies.load(state.active)
            canary = policies.load(state.canary) if state.canary else None
            if base != live.policy:
                live.use(base)
            outcomes = live.run(span, canary=canary, fraction=state.fraction)
            arms = [canary is not None and live.arm_of(r, state.fraction) for r in span]
            runner.window(span, outcomes, (base, canary, state.fraction), arms)
            if progress is not None:
                progress(i + 1, len(spans))
    return runner.report()


def inject_harmful(loop: Loop, memory: Memory, base: Policy) -> tuple[str, Memory]:
    """A harmful proposal with its (unfavourable) replay evidence, approved by a person and put on the
    canary; its id, and the memory after."""
    edits = harmful_edits(base)
    cand = apply_edits(base, edits, max(memory["top_version"], base.version) + 1)
    judged = loop.judge.replay(loop.records.of(memory), base, cand)
    harmful = Candidate.of(base, cand, edits, [], judged, loop.proposer.route(base, edits, judged))
    proposal, memory = loop.store(memory, harmful, None)
    loop.actuator.review(
        proposal.id, "approve", "injected", "approved against its evidence, to test the canary"
    )
    _, memory = loop.start_canary(memory, proposal.id)
    return proposal.id, memory


def _row(rec: WindowRecord, requests: Any) -> dict[str, Any]:
    s = rec.stats
    return {
        "index": s.index,
        "start": s.start,
        "end": s.end,
        "requests": s.requests,
        "policy": s.policy,
        "hit_ratio": s.hit_ratio,
        "wrong": s.wrong,
        "canary": None if rec.step[1] is None else str(rec.step[1].ref),
        "phases": sorted({r.phase for r in requests if r.phase}),
        "signals": dict(rec.signals),
        "findings": [
            {"kind": f.kind, "score": f.score, "p_value": f.p_value, "summary": f.summary}
            for f in rec.findings
        ],
    }
