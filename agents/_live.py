"""The loop over a live deployment: access events in, policy changes out, through the store serving reads.

    loop = LiveLoop(collector, policies, workdir, window=300, capacity=l1_bytes)
    rows = loop.pump()          # the windows completed since the last call, each with its graph pass run

Replicas write their access events (the JSONL sink, or the Redis stream); an ``EventsCollector`` turns them
into ``(request, outcome, policy)`` triples. Every ``window`` triples make a window: it is recorded as served
under the policy store's state when it closed (the active version, the canary and its fraction), a request
counted on the canary's arm when the version that decided it is the canary's. Then the graph runs one pass, as
``agent run`` does over a trace: what it promotes, canaries or rolls back goes to the policy store, and the
replicas' followers pick it up. Replay evidence replays the windows' requests (keys, sizes, rules, tenants)
against ``capacity``, the L1 size the replicas run with in bytes, each response entry weighed as L1 weighs it:
its payload (the event's ``size``: a miss's result, stored or not; a bypassed call's result, sized for what it
would weigh if its rule cached it) and its key (``weighed_as_l1``). A call with no key (one whose contract,
or whose arguments, keep it out of every cache) is replayed as it was: no policy can store it.

With ``signals`` (a ``SignalHub``: GPU through NVML, the host, torch.profiler traces, Nsight Compute exports),
each window also reads those series over its span: they join the cache's own for diagnosis, and their means
are in the window's row (``signals``); a collector that cannot run is reported once and left out.

``evocache agent watch`` runs ``LiveLoop.pump`` every ``interval`` seconds until stopped; ``evocache demo``
calls it after each window of traffic it sends.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from evocache.dsl import Policy

from ._loop import LoopConfig
from ._run import LoopRunner, open_loop
from ._types import Outcome, Request

log = logging.getLogger("evocache.agents")


def weighed_as_l1(request: Request) -> Request:
    """``request`` with the size its entry takes in L1: the payload and the key
    (``controller.MemoryTier``'s weight)."""
    if request.kind == "kv" or not request.keys or not request.size:
        return request
    return replace(request, size=request.size + len(request.keys[0]))


class LiveLoop:
    """The loop over ``collector``'s events, acting on ``policies`` (see the module docstring). ``policy`` is
    applied when the store has none in force. ``saver``: a LangGraph checkpointer (the caller's ``with``);
    None opens ``workdir/checkpoints.db`` and keeps it open until ``close``. ``model``: what the replicas
    serve (id, revision, prompt-template hash), part of the evidence's context."""

    def __init__(
        self,
        collector: Any,
        policies: Any,
        workdir: str | Path,
        *,
        window: int,
        capacity: int,
        policy: Policy | None = None,
        config: LoopConfig = LoopConfig(),
        diagnose: Callable[..., Any] | None = None,
        harmful_at: int | None = None,
        saver: Any = None,
        model: tuple[str, str, str] = ("", "", ""),
        signals: Any = None,
    ) -> None:
        from ._loop import build_graph

        if window < 10:
            raise ValueError(f"window must be at least 10 requests, got {window}")
        self.collector = collector
        self.policies = policies
        self.workdir = Path(workdir)
        self.window = window
        if policies.state().active is None and policy is None:
            raise ValueError("the policy store has no policy in force; give one to start with")
        start = policy if policy is not None else policies.load(policies.state().active)
        self.ctx = open_loop(
            policies,
            self.workdir,
            start,
            capacity=capacity,
            config=config,
            diagnose=diagnose,
            actor="agent watch",
            model=model,
        )
        self._owned = None
        if saver is None:
            from langgraph.checkpoint.sqlite import SqliteSaver

            self._owned = SqliteSaver.from_conn_string(str(self.workdir / "checkpoints.db"))
            saver = self._owned.__enter__()
        self.runner = LoopRunner(self.ctx, build_graph(self.ctx, saver), harmful_at=harmful_at)
        self._pending: list[tuple[Request, Outcome, str]] = []
        self.signals = signals  # a SignalHub (GPU, host, profiler, ncu) read over each window's span, or None

    @property
    def pending(self) -> int:
        """Requests seen that no window holds yet."""
        return len(self._pending)

    def pump(self, limit: int | None = None) -> list[dict[str, Any]]:
        """Read the new events; run a pass for every full window among them (at most ``limit``; the rest stay
        pending). The windows' report rows."""
        self._pending.extend(self.collector.poll_labelled())
        rows: list[dict[str, Any]] = []
        while len(self._pending) >= self.window and (limit is None or len(rows) < limit):
            chunk, self._pending = self._pending[: self.window], self._pending[self.window :]
            rows.append(self._run(chunk))
        return rows

    def flush(self, least: int = 10) -> dict[str, Any] | None:
        """Close a window on the requests pending now, when there are at least ``least``; its row, or None."""
        self._pending.extend(self.collector.poll_labelled())
        if len(self._pending) < least:
            return None
        chunk, self._pending = self._pending, []
        return self._run(chunk)

    def _run(self, chunk: list[tuple[Request, Outcome, str]]) -> dict[str, Any]:
        # several replicas' sources come one after another, and a replica's clock may step back: time order
        chunk = sorted(chunk, key=lambda item: item[0].t)
        state = self.policies.state()
        base = self.policies.load(state.active)
        canary = self.policies.load(state.canary) if state.canary else None
        requests = [weighed_as_l1(r) for r, _, _ in chunk]
        outcomes = [o for _, o, _ in chunk]
        arms = [canary is not None and ref == state.canary for _, _, ref in chunk]
        others = (
            self.signals.collect(chunk[0][0].t, chunk[-1][0].t + 1e-6) if self.signals is not None else []
        )
        step = (base, canary, state.fraction if canary else 0.0)
        return self.runner.window(requests, outcomes, step, arms, others)

    def report(self) -> dict[str, Any]:
        report = self.runner.report()
        if self.signals is not None:
            report["signals_unavailable"] = dict(self.signals.unavailable)
        return report

    def write_report(self, path: str | Path) -> Path:
        """The report so far as JSON at ``path`` (written whole, then renamed over the old one)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(self.report(), indent=1, default=str))
        tmp.replace(path)
        return path

    def close(self) -> None:
        """Close the checkpoint store the loop opened and its ``signals`` hub (which it takes over: sampling
        stops); its report stays readable."""
        if self._owned is not None:
            self._owned.__exit__(None, None, None)
            self._owned = None
        if self.signals is not None:
            self.signals.close()


def default_signals(
    *, profile_dir: str | Path | None = None, ncu_dir: str | Path | None = None, period_s: float = 1.0
) -> Any:
    """The signals a deployment offers besides its access events: the host and the GPUs (sampled every
    ``period_s`` on threads, started here; without a GPU or its driver, NVML is reported unavailable once),
    torch.profiler traces written under ``profile_dir`` and ``ncu --csv`` exports under ``ncu_dir``. A
    ``SignalHub``; ``LiveLoop.close`` (or the hub's ``close``) ends the sampling."""
    from .errors import SignalUnavailable
    from .signals import HostCollector, NcuCollector, NvmlCollector, ProfileCollector, SignalHub

    collectors: list[Any] = [HostCollector(period_s), NvmlCollector(period_s)]
    for sampled in collectors:
        try:
            sampled.start()
        except SignalUnavailable as exc:  # the hub says so once, from its first round
            log.info("signal %s: %s", sampled.name, exc.reason)
    if profile_dir is not None:
        collectors.append(ProfileCollector(profile_dir))
    if ncu_dir is not None:
        collectors.append(NcuCollector(directory=ncu_dir))
    return SignalHub(collectors)

