"""The policy loop closed over drifting traffic, against static policies: how soon it sees the drift, how
close it comes to the best policy chosen in hindsight, whether its predicted gains come true, and whether it
catches a harmful change.

    make bench-loop     (or: .venv/bin/python bench/loop.py [--quick] [--scenarios kv,semantic,stationary]
                                                            [--results DIR] [--json FILE])

Scenarios (``agents._scenarios``): ``kv``, the Mooncake trace whose second half moves to new prefixes while a
batch tenant's one-off documents push the chat prefixes out; ``semantic``, a Banking77 question stream
followed by a CLINC150 one; ``stationary``, phase A of both alone (the whole Mooncake trace as one tenant, and
Banking77 for the length of the drifting stream), where no drift should be reported.

Every policy is replayed by ``controller.replay.PolicySimulator`` with the capacity ``run_trace`` would choose (a
tenth of the trace's distinct keys), cut into the loop's windows (``agents._workload.windows``):

- static A: the best of a small grid of policies (the scenario's starting policy, bench/data/policies/, under
  each combination of edits of the kinds the loop itself proposes) on phase A alone, from a cold cache; a
  policy whose wrong answers per request exceed the policy's ``slo.max_error_rate`` is not eligible, and ties
  go to the earlier grid entry (the unedited policy first). It then serves the whole trace.
- loop: ``agents._run.run_trace`` from static A. Reviews the loop leaves waiting are answered after each
  window by a stand-in reviewer: a proposal waiting in its review is approved (the loop stores only proposals
  whose replayed interval clears its floor), one withdrawn or held as inconclusive is rejected; without an
  answer the loop would hold every later proposal behind it (one change at a time).
- hindsight: static A until the first request of phase B, then the grid's best on phase B (same warm cache:
  the one replay switches policy at that request, ``Simulator.use``); so it knows both when the drift comes
  and what suits phase B.

Measured per drifting scenario: hit ratio per window of the three; the detection delay (windows from the first
window holding phase B to the first with a finding of a drift kind, ``agents._run.DRIFT_KINDS``) and drift
findings before it; the loop's hit ratio over the three windows after detection as a share of hindsight's
(target >= 90 %); predicted against realised gain of every promoted proposal (target within 20 % of the
prediction); and a second run with a harmful proposal injected (``RunOptions.harmful_at``, the first window
after detection with no canary out and room left to judge one): the windows its canary served, the hit-ratio
cost against the clean run over them, the breach the loop reported, and whether it was rolled back. On the
stationary workloads: drift findings (target none). Targets pass or fail on the figures measured.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import product
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
MOONCAKE = BENCH / "data" / "mooncake_synthetic_trace.jsonl"
BANKING77 = ROOT / "examples" / "data" / "banking77_train.jsonl"
CLINC150 = BENCH / "data" / "clinc150_train.jsonl"
POLICIES = BENCH / "data" / "policies"

POST_DRIFT_WINDOWS = 3
TARGET_SHARE = 0.9  # the loop's hit ratio over the windows after detection, as a share of hindsight's
TARGET_GAIN_ERROR = 0.2  # |realised - predicted| / |predicted| of a promoted proposal
REVIEWER = "bench-reviewer"
INJECTED = "injected"  # the reviewer agents._run.inject_harmful records


# -- counting ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Tally:
    """Keys asked for, hits and wrong hits over some requests (bypassed calls' keys count as asked, as in
    ``WindowStats``)."""

    requests: int = 0
    keys: int = 0
    hits: int = 0
    wrong: int = 0

    def __add__(self, other: Tally) -> Tally:
        return Tally(
            self.requests + other.requests,
            self.keys + other.keys,
            self.hits + other.hits,
            self.wrong + other.wrong,
        )

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.keys if self.keys else 0.0

    @property
    def wrong_rate(self) -> float:
        """Wrong hits per request, as the loop's evidence and SLO read it."""
        return self.wrong / self.requests if self.requests else 0.0


def pooled(tallies: Iterable[Tally]) -> Tally:
    total = Tally()
    for t in tallies:
        total = total + t
    return total


def tally(requests: Sequence[Any], outcomes: Sequence[Any], phase: str | None = None) -> Tally:
    """The tally of ``requests`` (``Request``) and their ``outcomes``; of those of ``phase`` only, when
    given."""
    total = Tally()
    for req, out in zip(requests, outcomes, strict=True):
        if phase is None or req.phase == phase:
            total = total + Tally(1, len(req.keys), out.hits, int(out.wrong))
    return total


# -- the figures ---------------------------------------------------------------------------------------------


def best_of(scores: Sequence[Tally], max_wrong_rate: float | None) -> int | None:
    """The index of the highest hit ratio among ``scores`` whose wrong rate is within ``max_wrong_rate``
    (None:
    any); the earliest on a tie; None when none is eligible."""
    best: int | None = None
    for i, s in enumerate(scores):
        if max_wrong_rate is not None and s.wrong_rate > max_wrong_rate:
            continue
        if best is None or s.hit_ratio > scores[best].hit_ratio:
            best = i
    return best


def first_window_of(phases: Sequence[Sequence[str]], phase: str) -> int | None:
    """The first window (``phases``: each window's phases) holding a request of ``phase``."""
    return next((i for i, p in enumerate(phases) if phase in p), None)


def detection(drift_flags: Sequence[bool], drift_window: int | None) -> dict[str, Any]:
    """When a drift was reported (``drift_flags``: per window, whether it had a drift finding) against when it
    came (``drift_window``; None: never, a stationary workload). Findings before it are false alarms."""
    start = len(drift_flags) if drift_window is None else drift_window
    false_alarms = [i for i, flag in enumerate(drift_flags[:start]) if flag]
    detected = next((i for i in range(start, len(drift_flags)) if drift_flags[i]), None)
    return {
        "drift_window": drift_window,
        "detected_at": detected,
        "delay_windows": None if detected is None or drift_window is None else detected - drift_window,
        "false_alarms": false_alarms,
    }


def post_drift(
    loop: Sequence[Tally], hindsight: Sequence[Tally], detected: int | None, count: int = POST_DRIFT_WINDOWS
) -> dict[str, Any]:
    """The loop's hit ratio over the ``count`` windows after ``detected`` (fewer when the trace ends first),
    as
    a share of hindsight's over the same windows (None when hindsight hit nothing or nothing was detected)."""
    if detected is None:
        return {"windows": [], "loop": None, "hindsight": None, "share": None, "per_window": []}
    span = list(range(detected + 1, min(detected + 1 + count, len(loop), len(hindsight))))
    ours, best = pooled(loop[i] for i in span), pooled(hindsight[i] for i in span)
    return {
        "windows": span,
        "loop": ours.hit_ratio if span else None,
        "hindsight": best.hit_ratio if span else None,
        "share": ours.hit_ratio / best.hit_ratio if span and best.hit_ratio > 0 else None,
        "per_window": [
            loop[i].hit_ratio / hindsight[i].hit_ratio if hindsight[i].hit_ratio > 0 else None for i in span
        ],
    }


def gain_errors(
    proposals: Sequence[Mapping[str, Any]], tolerance: float = TARGET_GAIN_ERROR
) -> list[dict[str, Any]]:
    """Each promoted proposal with its realised gain's relative error against the predicted one and whether it
    is within ``tolerance`` (None while its realised gain is not measured, or for a zero prediction)."""
    out = []
    for p in proposals:
        if p["status"] != "promoted":
            continue
        predicted, realised = p["predicted_gain"], p["realised_gain"]
        error = None
        if realised is not None and predicted:
            error = (realised - predicted) / abs(predicted)
        out.append(
            {
                "id": p["id"],
                "window": p["window"],
                "edits": p.get("edits", []),
                "predicted_gain": predicted,
                "predicted_ci": p.get("predicted_ci"),
                "realised_gain": realised,
                "relative_error": error,
                "within": None if error is None else abs(error) <= tolerance,
            }
        )
    return out


def harmful_window(canaries: Sequence[str | None], after: int, margin: int) -> int | None:
    """The first window from ``after`` on with no canary out (``canaries``: per window, the canary serving it)
    that leaves ``margin`` windows after it for the canary to be judged; None when there is none."""
    for i in range(max(after, 0), len(canaries) - margin):
        if canaries[i] is None:
            return i
    return None


def target(name: str, goal: str, measured: Any, passed: bool | None) -> dict[str, Any]:
    """A target row: ``passed`` None when the figure could not be measured."""
    return {"name": name, "target": goal, "measured": measured, "passed": passed}


def drift_targets(
    found: Mapping[str, Any],
    post: Mapping[str, Any],
    gains: Sequence[Mapping[str, Any]],
    harmful: Mapping[str, Any] | None,
) -> list[dict[str, Any]]:
    """The drifting scenario's targets, computed from its figures."""
    share = post["share"]
    measured = [g for g in gains if g["within"] is not None]
    rows = [
        target(
            "drift reported",
            "a drift finding at or after the first window of phase B",
            found["detected_at"],
            found["detected_at"] is not None,
        ),
        target(
            "no false drift",
            "no drift finding before phase B",
            found["false_alarms"],
            not found["false_alarms"],
        ),
        target(
            "post-drift hit ratio",
            f">= {TARGET_SHARE:.0%} of hindsight's over the {POST_DRIFT_WINDOWS} windows after detection",
            share,
            None if share is None else share >= TARGET_SHARE,
        ),
        target(
            "predicted gains come true",
            f"every promoted proposal's realised gain within {TARGET_GAIN_ERROR:.0%} of its prediction",
            [g["relative_error"] for g in gains],
            all(g["within"] for g in measured) if measured else None,
        ),
    ]
    if harmful is not None:
        rows.append(
            target(
                "harmful change rolled back",
                "the injected proposal rolled back",
                harmful.get("status"),
                harmful.get("rolled_back"),
            )
        )
    return rows


# -- replaying policies ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Workload:
    """A trace read into the loop's windows, with what every replay of it shares."""

    name: str
    trace: Path
    spans: list[Sequence[Any]]
    capacity: int
    vectors: Any
    seed: int = 0

    @property
    def phases(self) -> list[list[str]]:
        return [sorted({r.phase for r in span if r.phase}) for span in self.spans]

    def switch_point(self, phase: str) -> tuple[int, int] | None:
        """(window, offset) of the first request of ``phase``."""
        for i, span in enumerate(self.spans):
            for j, r in enumerate(span):
                if r.phase == phase:
                    return i, j
        return None


def load_workload(name: str, trace: Path, work: Path, seed: int = 0, window: int = 300) -> Workload:
    from evocache.agents._run import default_capacity, embed_prompts
    from evocache.agents._workload import read_requests, windows

    requests = read_requests(trace)
    return Workload(
        name,
        trace,
        list(windows(requests, window)),
        default_capacity(requests, 0.1),
        embed_prompts(requests, work / "embeddings"),
        seed,
    )


def replay(
    w: Workload, policy: Any, *, then: Any = None, at: tuple[int, int] | None = None, upto: int | None = None
) -> list[list[Any]]:
    """The outcomes per window of ``policy`` over ``w`` from a cold cache; with ``then``, switched to it at
    ``at`` (window, offset); only the first ``upto`` windows when given."""
    from evocache.controller.replay import PolicySimulator as Simulator

    sim = Simulator(policy, w.capacity, seed=w.seed, vectors=w.vectors)
    out = []
    for i, span in enumerate(w.spans[:upto]):
        if then is not None and at is not None and at[0] == i:
            outcomes = sim.run(span[: at[1]])
            sim.use(then)
            outcomes += sim.run(span[at[1] :])
        else:
            outcomes = sim.run(span)
        out.append(outcomes)
    return out


def window_tallies(w: Workload, outcomes: Sequence[Sequence[Any]]) -> list[Tally]:
    return [tally(span, outs) for span, outs in zip(w.spans, outcomes, strict=True)]


def phase_tally(w: Workload, outcomes: Sequence[Sequence[Any]], phase: str) -> Tally:
    return pooled(tally(span, outs, phase) for span, outs in zip(w.spans, outcomes, strict=False))


# -- the grid ----------------------------------------------------------------------------------------------

Axis = list[tuple[str, list[Any]]]  # (label, the edits it makes) per setting
Done = tuple[list[dict[str, Any]], dict[str, Any]]  # a part's rows and context


def kv_axes() -> list[Axis]:
    from evocache.agents._candidates import Edit

    return [
        [
            (f"eviction {e}", [] if e == "lru" else [Edit("eviction", "eviction.l1", None, e, "grid")])
            for e in ("lru", "s3fifo", "arc")
        ],
        [
            ("batch cached", []),
            ("batch bypassed", [Edit("bypass", "rules.batch.cache", "response", "bypass", "grid")]),
        ],
        [
            (
                f"batchco l1_share {s:g}",
                [] if s == 1.0 else [Edit("tenant-share", "tenants.batchco.l1_share", 1.0, s, "grid")],
            )
            for s in (1.0, 0.25, 0.1)
        ],
    ]


def semantic_axes() -> list[Axis]:
    from evocache.agents._candidates import Edit

    bounds = [
        (
            f"max_error {m:g}",
            [] if m == 0.02 else [Edit("semantic", "rules.faq.semantic.max_error", 0.02, m, "grid")],
        )
        for m in (0.02, 0.01, 0.03, 0.05)
    ]
    return [
        [*bounds, ("exact only", [Edit("semantic", "rules.faq.semantic.max_error", 0.02, 0, "grid")])],
        [
            (f"eviction {e}", [] if e == "lru" else [Edit("eviction", "eviction.l1", None, e, "grid")])
            for e in ("lru", "s3fifo", "arc")
        ],
    ]


def grid(base: Any, axes: Sequence[Axis]) -> list[tuple[str, Any]]:
    """Every combination of one choice per axis applied to ``base`` (the first choices, no edit, first); a
    combination that a choice makes moot (a bypassed rule's tenant share) is kept once."""
    from evocache.agents._candidates import apply_edits

    out: list[tuple[str, Any]] = []
    seen: set[str] = set()
    for choice in product(*axes):
        labels = [label for label, edits in choice if edits]
        edits = [e for _, es in choice for e in es]
        policy = apply_edits(base, edits, base.version)
        if "batch bypassed" in labels and any(lbl.startswith("batchco") for lbl in labels):
            continue
        key = json.dumps(sorted(labels))
        if key not in seen:
            seen.add(key)
            out.append((", ".join(labels) or "as written", policy))
    return out


# -- the loop ----------------------------------------------------------------------------------------------


@dataclass
class StandInReviewer:
    """Answers, after each window of ``run_trace``, the reviews the loop left waiting in ``workdir`` (see the
    module docstring); counts its verdicts."""

    workdir: Path
    approved: list[str] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)

    def __call__(self, done: int, total: int) -> None:
        from evocache.agents._loop import resume_waiting
        from evocache.agents._proposals import ProposalStore

        path = self.workdir / "proposals.db"
        store = ProposalStore(path)
        for p in store.list(status="proposed"):
            if p.thread_id:
                resume_waiting(path, p.thread_id, "approve", REVIEWER)
            if store.get(p.id).status == "proposed":
                store.review(p.id, "approve", REVIEWER, "the replayed interval clears the loop's floor")
            self.approved.append(p.id)
        for p in store.list(status="waiting"):
            store.review(p.id, "reject", REVIEWER, "inconclusive: declined")
            self.rejected.append(p.id)


def run_loop(
    w: Workload, policy: Any, work: Path, harmful_at: int | None = None
) -> tuple[dict[str, Any], StandInReviewer]:
    """``run_trace`` over ``w`` from ``policy`` in ``work`` (emptied first), with the stand-in reviewer; each
    proposal of the report gains its edits and the note of its last move."""
    from evocache.agents._loop import LoopConfig
    from evocache.agents._proposals import ProposalStore
    from evocache.agents._run import RunOptions, run_trace

    if work.exists():
        shutil.rmtree(work)
    reviewer = StandInReviewer(work)
    window = len(w.spans[0])
    options = RunOptions(
        window=window, capacity=w.capacity, harmful_at=harmful_at, loop=LoopConfig(seed=w.seed)
    )
    report = run_trace(w.trace, policy, work, options=options, progress=reviewer)
    store = ProposalStore(work / "proposals.db")
    for p in report["proposals"]:
        stored = store.get(p["id"])
        p["edits"] = [f"{e['path']}: {e['old']} -> {e['new']}" for e in stored.edits]
        p["note"] = stored.history[-1].note if stored.history else ""
        hit = stored.evidence.metrics.get("hit_ratio") if stored.evidence is not None else None
        p["predicted_ci"] = None if hit is None or hit.ci is None else list(hit.ci)
    return report, reviewer


def loop_tallies(report: Mapping[str, Any], w: Workload) -> list[Tally]:
    """Per window, the loop's tally: its hit ratio from the report, its keys from the workload (the same
    windows)."""
    out = []
    for row, span in zip(report["windows"], w.spans, strict=True):
        keys = sum(len(r.keys) for r in span)
        out.append(Tally(row["requests"], keys, round(row["hit_ratio"] * keys), row.get("wrong", 0)))
    return out


def drift_flags(report: Mapping[str, Any]) -> list[bool]:
    from evocache.agents._run import DRIFT_KINDS

    return [any(f["kind"] in DRIFT_KINDS for f in row["findings"]) for row in report["windows"]]


def injected_proposal(work: Path) -> Any:
    """The proposal ``inject_harmful`` stored in ``work`` (the one its reviewer approved), or None."""
    from evocache.agents._proposals import ProposalStore

    store = ProposalStore(work / "proposals.db")
    ids = [r.proposal_id for r in store.reviews() if r.reviewer == INJECTED]
    return store.get(ids[0]) if ids else None


def harmful_figures(
    clean: Sequence[Tally], harmed: Mapping[str, Any], w: Workload, at: int, work: Path
) -> dict[str, Any]:
    proposal = injected_proposal(work)
    if proposal is None:
        return {"at": at, "proposal": None, "status": None, "rolled_back": None, "note": "nothing injected"}
    ours = loop_tallies(harmed, w)
    served = [row["index"] for row in harmed["windows"] if row["canary"] == proposal.new_ref]
    breach = next((b for b in harmed["breaches"] if b["proposal"] == proposal.id), None)
    before, during = pooled(clean[i] for i in served), pooled(ours[i] for i in served)
    # the loop's own verdict: the last move that was not the stand-in reviewer's answer to it
    status = next((m.to for m in reversed(proposal.history) if m.actor != REVIEWER), proposal.status)
    return {
        "at": at,
        "proposal": proposal.id,
        "status": status,
        "final_status": proposal.status,
        "rolled_back": status == "rolled_back",
        "predicted_gain": proposal.predicted_gain,
        "canary_windows": served,
        "clean_hit_ratio": before.hit_ratio if served else None,
        "harmed_hit_ratio": during.hit_ratio if served else None,
        "hit_ratio_drop": before.hit_ratio - during.hit_ratio if served else None,
        "breach": None
        if breach is None
        else {
            "reason": breach["reason"],
            "windows": breach["windows"],
            "canary_windows": breach.get("canary_windows"),
            "canary_hit_ratio": breach["canary"]["hit_ratio"],
            "base_hit_ratio": breach["base"]["hit_ratio"],
            "difference": breach["difference"],
            "replay": breach.get("replay"),
        },
    }


# -- the scenarios -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sizes:
    kv_requests: int | None  # Mooncake rows (None: all 3,993)
    kv_window: int
    semantic_per_phase: int
    semantic_popular: int
    semantic_window: int


FULL = Sizes(None, 300, 1500, 300, 250)
QUICK = Sizes(1200, 150, 450, 150, 150)


def choose(w: Workload, candidates: Sequence[tuple[str, Any]], max_wrong: float | None) -> dict[str, Any]:
    """Static A (best on phase A from cold) and hindsight B (best on phase B after static A's phase A), with
    every candidate's scores."""
    at = w.switch_point("B")
    upto = None if at is None else at[0] + 1
    scores_a = []
    for _, policy in candidates:
        outcomes = replay(w, policy, upto=upto)
        scores_a.append(phase_tally(w, outcomes, "A"))
    a = best_of(scores_a, max_wrong)
    if a is None:
        raise RuntimeError(f"{w.name}: no grid policy keeps wrong answers within {max_wrong} on phase A")
    static = candidates[a][1]
    rows = [
        {"label": label, "phase_a_hit_ratio": s.hit_ratio, "phase_a_wrong_rate": s.wrong_rate}
        for (label, _), s in zip(candidates, scores_a, strict=True)
    ]
    b = None
    if at is not None:
        scores_b = [phase_tally(w, replay(w, static, then=policy, at=at), "B") for _, policy in candidates]
        for row, s in zip(rows, scores_b, strict=True):
            row.update(phase_b_hit_ratio=s.hit_ratio, phase_b_wrong_rate=s.wrong_rate)
        b = best_of(scores_b, max_wrong)
    return {"static_a": a, "hindsight_b": b, "grid": rows, "switch": at}


def drift_scenario(name: str, w: Workload, base: Any, axes: Sequence[Axis], work: Path) -> Done:
    t0 = time.perf_counter()
    candidates = grid(base, axes)
    picked = choose(w, candidates, base.slo.max_error_rate)
    static = candidates[picked["static_a"]][1]
    static_t = window_tallies(w, replay(w, static))
    b = picked["hindsight_b"]
    hind_t = (
        static_t
        if b is None
        else window_tallies(w, replay(w, static, then=candidates[b][1], at=picked["switch"]))
    )
    print(
        f"  {name}: grid of {len(candidates)} replayed in {time.perf_counter() - t0:.0f} s",
        file=sys.stderr,
        flush=True,
    )
    report, reviewer = run_loop(w, static, work / "loop")
    loop_t = loop_tallies(report, w)
    flags = drift_flags(report)
    found = detection(flags, first_window_of(w.phases, "B"))
    post = post_drift(loop_t, hind_t, found["detected_at"])
    gains = gain_errors(report["proposals"])
    print(f"  {name}: loop run in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    after = (found["detected_at"] if found["detected_at"] is not None else found["drift_window"] or 0) + 1
    margin = static.guardrails.rollout.max_windows + 1
    at = harmful_window([row["canary"] for row in report["windows"]], after, margin)
    harmful = None
    harmed_rows: list[dict[str, Any]] = []
    if at is not None:
        harmed, _ = run_loop(w, static, work / "harmful", harmful_at=at)
        harmful = harmful_figures(loop_t, harmed, w, at, work / "harmful")
        harmed_rows = harmed["windows"]
    print(f"  {name}: harmful run in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    phase_b = [i for i, p in enumerate(w.phases) if "B" in p]
    rows = []
    for i, span in enumerate(w.spans):
        loop_row = report["windows"][i]
        rows.append(
            {
                "window": i,
                "phases": w.phases[i],
                "requests": len(span),
                "static_a": static_t[i].hit_ratio,
                "loop": loop_t[i].hit_ratio,
                "hindsight": hind_t[i].hit_ratio,
                "loop_policy": loop_row["policy"],
                "canary": loop_row["canary"],
                "drift": flags[i],
                "findings": sorted({f["kind"] for f in loop_row["findings"] if f["kind"] != "not-testable"}),
                "harmful_run": harmed_rows[i]["hit_ratio"] if harmed_rows else None,
                "harmful_canary": harmed_rows[i]["canary"] if harmed_rows else None,
            }
        )
    context = {
        "scenario": name,
        "trace": w.name,
        "requests": sum(len(s) for s in w.spans),
        "windows": len(w.spans),
        "window": len(w.spans[0]),
        "capacity": w.capacity,
        "policy": _shown(POLICIES / f"{base.name}.yaml"),
        "grid": picked["grid"],
        "static_a": candidates[picked["static_a"]][0],
        "hindsight_b": None if b is None else candidates[b][0],
        "phase_b": {
            "windows": phase_b,
            "static_a": pooled(static_t[i] for i in phase_b).hit_ratio,
            "loop": pooled(loop_t[i] for i in phase_b).hit_ratio,
            "hindsight": pooled(hind_t[i] for i in phase_b).hit_ratio,
        },
        "detection": found,
        "post_drift_windows": POST_DRIFT_WINDOWS,
        "post_drift": post,
        "proposals": report["proposals"],
        "gains": gains,
        "reviews": {"approved": reviewer.approved, "rejected": reviewer.rejected},
        "breaches": [{"proposal": b_["proposal"], "reason": b_["reason"]} for b_ in report["breaches"]],
        "harmful": harmful,
        "targets": drift_targets(found, post, gains, harmful),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    return rows, context


def stationary_part(workloads: Sequence[tuple[Workload, Any, Sequence[Axis]]], work: Path) -> Done:
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    runs: dict[str, Any] = {}
    targets = []
    for w, base, axes in workloads:
        candidates = grid(base, axes)
        picked = choose(w, candidates, base.slo.max_error_rate)
        static = candidates[picked["static_a"]][1]
        static_t = window_tallies(w, replay(w, static))
        report, reviewer = run_loop(w, static, work / f"stationary-{w.name}")
        loop_t = loop_tallies(report, w)
        flags = drift_flags(report)
        found = detection(flags, None)
        for i, row in enumerate(report["windows"]):
            rows.append(
                {
                    "workload": w.name,
                    "window": i,
                    "requests": row["requests"],
                    "static_a": static_t[i].hit_ratio,
                    "loop": loop_t[i].hit_ratio,
                    "loop_policy": row["policy"],
                    "canary": row["canary"],
                    "drift": flags[i],
                    "findings": sorted({f["kind"] for f in row["findings"] if f["kind"] != "not-testable"}),
                }
            )
        runs[w.name] = {
            "requests": sum(len(s) for s in w.spans),
            "windows": len(w.spans),
            "window": len(w.spans[0]),
            "capacity": w.capacity,
            "static_a": candidates[picked["static_a"]][0],
            "static_hit_ratio": pooled(static_t).hit_ratio,
            "loop_hit_ratio": pooled(loop_t).hit_ratio,
            "false_alarms": found["false_alarms"],
            "proposals": report["proposals"],
            "reviews": {"approved": reviewer.approved, "rejected": reviewer.rejected},
        }
        targets.append(
            target(
                f"no false drift ({w.name})",
                "no drift finding on a stationary workload",
                found["false_alarms"],
                not found["false_alarms"],
            )
        )
        print(f"  stationary {w.name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return rows, {"workloads": runs, "targets": targets, "seconds": round(time.perf_counter() - t0, 1)}


def _shown(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


# -- the command -------------------------------------------------------------------------------------------

SCENARIOS = ("kv", "semantic", "stationary")


def options(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help="which scenarios to run, comma-separated (default: all)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"short traces and windows: {QUICK.kv_requests} Mooncake rows in windows of "
        f"{QUICK.kv_window}, {QUICK.semantic_per_phase} questions a phase in windows of "
        f"{QUICK.semantic_window}",
    )
    parser.add_argument(
        "--results",
        type=Path,
        metavar="DIR",
        help="write loop-<scenario>.json here, for bench/report.py (make bench-loop passes bench/results)",
    )
    parser.add_argument("--json", type=Path, help="also write every scenario's rows and context here")
    args = parser.parse_args(argv)
    chosen = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SCENARIOS]
    if unknown or not chosen:
        parser.error(
            f"--scenarios: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(SCENARIOS)}"
        )
    args.scenarios = [s for s in SCENARIOS if s in chosen]
    return args


def run(args: argparse.Namespace, finished: Callable[[str, Done], None]) -> None:
    from evocache.agents._scenarios import kv_drift, semantic_drift
    from evocache.dsl import load_policy

    sizes = QUICK if args.quick else FULL
    kv_policy, faq_policy = load_policy(POLICIES / "kv-chat.yaml"), load_policy(POLICIES / "faq.yaml")
    with tempfile.TemporaryDirectory(prefix="evc-bench-loop-") as tmp:
        work = Path(tmp)

        def semantic_trace(out: Path, per_phase: int) -> Path:
            return semantic_drift(
                BANKING77, CLINC150, out, per_phase=per_phase, popular=sizes.semantic_popular
            )

        for name in args.scenarios:
            t0 = time.perf_counter()
            print(f"scenario {name}", file=sys.stderr, flush=True)
            if name == "kv":
                trace = kv_drift(MOONCAKE, work / "kv.jsonl", requests=sizes.kv_requests)
                w = load_workload("kv", trace, work, window=sizes.kv_window)
                done = drift_scenario(name, w, kv_policy, kv_axes(), work / "kv")
            elif name == "semantic":
                trace = semantic_trace(work / "semantic.jsonl", sizes.semantic_per_phase)
                w = load_workload("semantic", trace, work, window=sizes.semantic_window)
                done = drift_scenario(name, w, faq_policy, semantic_axes(), work / "semantic")
            else:
                kv = kv_drift(MOONCAKE, work / "kv-a.jsonl", requests=sizes.kv_requests, split=1.0)
                both = semantic_trace(work / "semantic-aa.jsonl", 2 * sizes.semantic_per_phase)
                sem = work / "semantic-a.jsonl"
                sem.write_text(
                    "".join(
                        line
                        for line in both.read_text().splitlines(keepends=True)
                        if json.loads(line)["phase"] == "A"
                    )
                )
                done = stationary_part(
                    [
                        (load_workload("kv", kv, work, window=sizes.kv_window), kv_policy, kv_axes()),
                        (
                            load_workload("semantic", sem, work, window=sizes.semantic_window),
                            faq_policy,
                            semantic_axes(),
                        ),
                    ],
                    work,
                )
            done[1]["quick"] = args.quick
            print(f"scenario {name} took {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
            finished(f"loop-{name}", done)


def main(argv: Sequence[str] | None = None) -> None:
    from _results import part_sink  # bench/_results.py: this script's directory is on sys.path

    args = options(argv)
    run(args, part_sink(args.results, args.json, argv))


if __name__ == "__main__":
    main()
