"""``evocache agent``: the policy loop's commands, and ``evocache demo``.

    evocache agent run --trace FILE --policy FILE [--window N] [--json OUT] [--workdir DIR]
    evocache agent watch (--events FILE... | --redis URL) [--store DIR] [--window N] [--capacity BYTES]
    evocache agent scenario kv|semantic --out FILE
    evocache demo [--interactive] [--workdir DIR]

``run`` makes one pass over a recorded trace (``scenario`` writes drifting ones from the shipped data);
``watch`` follows a deployment's access events and acts on the policy store its replicas read, until stopped;
``demo`` deploys the example model on a local Ray Serve, sends a drifting workload and runs the loop over it
to ``report.html`` (``demo_command``: the `evocache` command hands it the deployment, as agents never import
serving). ``add_proposal_commands`` adds `evocache proposals list | show | approve | reject`.

Exit codes: 0 done; 1 the trace, the policy or the loop's state could not be used (the message names which);
2 bad usage.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from evocache.controller.cli_errors import EXIT_FAILED, EXIT_USAGE, error

from ._proposal_commands import add_commands as add_proposal_commands  # noqa: F401 - `evocache proposals`

if TYPE_CHECKING:
    from ._proposals import Proposal
    from .demo import DemoDeployment


def _escape(text: str) -> str:
    """``text`` as literal text in a rich message (its brackets are not markup); rich loads only when a
    command prints, so that importing the commands stays cheap."""
    from rich.markup import escape as rich_escape

    return rich_escape(text)


def _check_planner() -> None:
    """Fail at once, naming the variable, when the environment configures the optional planner wrongly (an
    unknown provider, a missing model, its extra not installed): before any trace is read or replica started."""
    from ._planner import planner_from_env
    from .errors import PlannerError

    try:
        planner_from_env()
    except PlannerError as exc:
        raise error(f"error: {exc}", EXIT_USAGE) from None


def run(
    trace: Annotated[Path, typer.Option("--trace", help="A trace replay reads, or a semantic stream.")],
    policy: Annotated[Path, typer.Option("--policy", help="The policy in force at the start.")],
    window: Annotated[int, typer.Option("--window", min=10, help="Requests per window.")] = 300,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the run's report here.")] = None,
    workdir: Annotated[Path, typer.Option("--workdir", help="Policy store, proposals, checkpoints.")] = Path(
        ".evocache/agent"
    ),
    capacity: Annotated[
        int | None,
        typer.Option(
            "--capacity",
            min=1,
            help="Simulated L1 capacity (the trace's size unit); default a tenth of its distinct keys.",
        ),
    ] = None,
    interactive: Annotated[
        bool, typer.Option("--interactive", help="Every proposal waits for a person.")
    ] = False,
    inject_harmful: Annotated[
        int | None,
        typer.Option("--inject-harmful", metavar="WINDOW", help="Inject a harmful proposal at this window."),
    ] = None,
) -> None:
    """Run the loop over a recorded trace: diagnose each window, propose, replay, review, canary, promote or
    roll back; print the windows and the proposals."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from evocache.dsl import PolicyError, load_policy

    from ._loop import LoopConfig
    from ._run import RunOptions, run_trace
    from .errors import AgentError

    console, err = Console(), Console(stderr=True)
    _check_planner()
    try:
        base = load_policy(policy)
    except (PolicyError, OSError) as exc:
        raise error(f"error: {exc}", EXIT_FAILED) from None
    options = RunOptions(
        window=window, capacity=capacity, harmful_at=inject_harmful, loop=LoopConfig(interactive=interactive)
    )
    with Progress(
        TextColumn("[bold]agent"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    ) as bar:
        task = bar.add_task("windows", total=None)
        try:
            report = run_trace(
                trace,
                base,
                workdir,
                options=options,
                progress=lambda done, total: bar.update(task, completed=done, total=total),
            )
        except (AgentError, ValueError, OSError) as exc:
            raise error(f"error: {exc}", EXIT_FAILED) from None
    _print(console, report)
    if json_out is not None:
        try:
            json_out.parent.mkdir(parents=True, exist_ok=True)
            json_out.write_text(json.dumps(report, indent=1, default=str))
        except OSError as exc:
            raise error(f"error: --json {json_out}: {exc}", EXIT_FAILED) from None
        console.print(f"report: {json_out}")


def _print(console: Any, report: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title="windows")
    for col in ("window", "requests", "policy", "canary", "hit ratio", "findings"):
        table.add_column(col)
    for w in report["windows"]:
        kinds = sorted({f["kind"] for f in w["findings"] if f["kind"] != "not-testable"})
        table.add_row(
            str(w["index"]),
            str(w["requests"]),
            w["policy"],
            w["canary"] or "-",
            f"{w['hit_ratio']:.3f}",
            ", ".join(kinds) or "-",
        )
    console.print(table)
    drift = report["drift_detected_at"]
    console.print(f"drift detected at window {drift}" if drift is not None else "no drift detected")
    props = Table(title="proposals")
    for col in ("id", "window", "status", "predicted gain", "realised gain"):
        props.add_column(col)
    for p in report["proposals"]:
        props.add_row(
            p["id"], str(p["window"]), p["status"], _gain(p["predicted_gain"]), _gain(p["realised_gain"])
        )
    console.print(props)


def _gain(value: float | None) -> str:
    return "-" if value is None else f"{value:+.4f}"


def resume_waiting_review(proposal: Proposal, verdict: str, store: Path) -> None:
    """After ``evocache proposals approve/reject``: resume the loop's pass that waits on this proposal, from
    this process (the graph over the stores beside ``store``, its SQLite checkpointer). Nothing waits: nothing
    to do (the next pass starts an approved proposal's canary)."""
    from ._loop import resume_waiting

    if proposal.thread_id:
        note = resume_waiting(store, proposal.thread_id, verdict)
        if note:
            typer.echo(note)


MAX_FAILED_PASSES = 5
"""``agent watch`` stops after this many passes in a row fail (a store away for good, a broken workdir)."""


def watch(
    events: Annotated[
        list[Path] | None,
        typer.Option("--events", help="A replica's JSONL access-event file (repeat for several)."),
    ] = None,
    redis_url: Annotated[
        str | None, typer.Option("--redis", metavar="URL", help="Read the events' Redis stream instead.")
    ] = None,
    store: Annotated[
        Path | None,
        typer.Option(
            "--store",
            metavar="DIR",
            help="The policy store the replicas follow (default: the one `evocache serve` uses).",
        ),
    ] = None,
    policy: Annotated[
        Path | None, typer.Option("--policy", help="Applied when the store has none in force.")
    ] = None,
    window: Annotated[int, typer.Option("--window", min=10, help="Requests per window.")] = 300,
    capacity: Annotated[
        int, typer.Option("--capacity", min=1, help="The replicas' L1 size in bytes, for replay evidence.")
    ] = 64 * 1024 * 1024,
    workdir: Annotated[Path, typer.Option("--workdir", help="Proposals, checkpoints, plots.")] = Path(
        ".evocache/agent"
    ),
    interval: Annotated[float, typer.Option("--interval", min=0.05, help="Seconds between reads.")] = 2.0,
    max_windows: Annotated[
        int | None, typer.Option("--max-windows", min=1, help="Stop after this many windows.")
    ] = None,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Keep the report here, rewritten after each window.")
    ] = None,
    interactive: Annotated[
        bool, typer.Option("--interactive", help="Every proposal waits for a person.")
    ] = False,
    profile: Annotated[
        Path | None, typer.Option("--profile", metavar="DIR", help="torch.profiler traces written here.")
    ] = None,
    ncu: Annotated[
        Path | None, typer.Option("--ncu", metavar="DIR", help="Nsight Compute CSV exports written here.")
    ] = None,
) -> None:
    """Follow a deployment: read its access events, run a pass of the loop per window of requests, and act on
    the policy store its replicas follow. Runs until Ctrl-C (or --max-windows)."""
    from rich.console import Console

    from evocache.controller import FilePolicyStore, PolicyStoreError, default_policy_store, open_policy_store
    from evocache.dsl import PolicyError, load_policy

    from ._live import LiveLoop, default_signals
    from ._loop import LoopConfig
    from .errors import AgentError, SignalUnavailable
    from .signals import EventsCollector

    console, err = Console(), Console(stderr=True)
    _check_planner()
    if (not events) == (redis_url is None):
        raise error("error: give --events FILE (one or more) or --redis URL, exactly one", EXIT_USAGE)
    try:
        start = load_policy(policy) if policy is not None else None
        if redis_url is not None:
            from evocache.controller import PolicyStoreConfig

            policies = open_policy_store(PolicyStoreConfig(redis_url=redis_url))
            collector = EventsCollector.from_redis(redis_url)
        else:
            policies = FilePolicyStore(store or Path(default_policy_store()))
            collector = EventsCollector.from_files(events or [])
        loop = LiveLoop(
            collector,
            policies,
            workdir,
            window=window,
            capacity=capacity,
            policy=start,
            config=LoopConfig(interactive=interactive),
            signals=default_signals(profile_dir=profile, ncu_dir=ncu),
        )
    except (PolicyError, PolicyStoreError, AgentError, ValueError, OSError) as exc:
        raise error(f"error: {exc}", EXIT_FAILED) from None
    except Exception as exc:  # noqa: BLE001 - a client library's own error (Redis refusing the connection)
        where = redis_url or store or "the policy store"
        raise error(f"error: {where}: cannot be read: {type(exc).__name__}: {exc}", EXIT_FAILED) from None
    import time

    done = failures = 0
    err.print(f"watching for windows of {window} requests (Ctrl-C stops)")
    for path in events or []:
        if not path.exists():
            err.print(f"[yellow]note:[/] {path} does not exist yet; waiting for a replica to write it")
    try:
        while max_windows is None or done < max_windows:
            try:
                rows = loop.pump(None if max_windows is None else max_windows - done)
                failures = 0
            except SignalUnavailable as exc:  # Redis away: said once per outage, the loop goes on
                err.print("[yellow]events unavailable:[/]", _escape(str(exc)))
                rows = []
            except Exception as exc:  # noqa: BLE001 - one failed pass (a store busy or away) must not stop a daemon
                failures += 1
                err.print(f"[yellow]pass failed ({failures} in a row):[/]", _escape(f"{type(exc).__name__}: {exc}"))
                if failures >= MAX_FAILED_PASSES:
                    raise error(f"error: {failures} passes failed in a row; stopping", EXIT_FAILED) from None
                rows = []
            for row in rows:
                kinds = sorted({f["kind"] for f in row["findings"] if f["kind"] != "not-testable"})
                console.print(
                    f"window {row['index']}: {row['requests']} requests, {row['policy']}"
                    f"{', canary ' + row['canary'] if row['canary'] else ''}, hit ratio "
                    f"{row['hit_ratio']:.3f}, {', '.join(kinds) or 'no findings'}"
                )
                done += 1
            if rows and json_out is not None:
                loop.write_report(json_out)
            if max_windows is None or done < max_windows:
                time.sleep(interval)
    except KeyboardInterrupt:
        pass
    finally:
        loop.close()  # its signals too
    report = loop.report()
    for name, reason in (report.get("signals_unavailable") or {}).items():
        err.print(_escape(f"signal {name} unavailable: {reason}"))
    _print(console, report)


def demo_command(deployment: DemoDeployment) -> Callable[..., None]:
    """The `demo` command, running on ``deployment`` (the serving side, which the `evocache` command hands
    in)."""

    def demo(
        workdir: Annotated[
            Path, typer.Option("--workdir", help="Where the demo keeps everything (emptied first).")
        ] = Path(".evocache/demo"),
        root: Annotated[
            Path, typer.Option("--root", help="The repository (its examples/ and bench/data/).")
        ] = Path("."),
        interactive: Annotated[
            bool,
            typer.Option(
                "--interactive", help="Proposals wait for `evocache proposals approve` from another terminal."
            ),
        ] = False,
        windows: Annotated[
            int,
            typer.Option(
                "--windows",
                min=10,
                help="Windows of traffic (the drift after the fifth, or five fourteenths of them).",
            ),
        ] = 14,
        per_window: Annotated[int, typer.Option("--per-window", min=50, help="Requests per window.")] = 200,
        seed: Annotated[int, typer.Option("--seed", help="The workload's seed.")] = 0,
    ) -> None:
        """The whole loop on a local Ray Serve deployment: a drifting workload from the shipped data, drift
        detected, a diff proposed and promoted, a harmful change rolled back, and report.html."""
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        from .demo import DemoOptions, run_demo

        console, err = Console(), Console(stderr=True)
        _check_planner()
        options = DemoOptions(
            workdir=workdir,
            root=root,
            windows=windows,
            per_window=per_window,
            interactive=interactive,
            seed=seed,
            drift_at=max(5, windows * 5 // 14),
        )
        with Progress(
            TextColumn("[bold]demo[/] {task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=err,
            transient=not interactive,
        ) as bar:
            task = bar.add_task("starting", total=windows)
            try:
                report = run_demo(
                    options,
                    deployment,
                    say=bar.console.print,
                    progress=lambda what, done, total: bar.update(task, description=what, completed=done),
                )
            except (OSError, ValueError, RuntimeError) as exc:
                raise error(f"error: {exc}", EXIT_FAILED) from None
            bar.update(task, completed=windows, description="done")
        _print(console, report)
        if report.get("requests_failed"):
            console.print(f"[yellow]{report['requests_failed']} requests failed[/]: {report['errors'][:3]}")
        console.print(f"report: {report['report_html']}")

    return demo


def scenario(
    kind: Annotated[
        str, typer.Argument(help="kv (a Mooncake trace in two phases) or semantic (two question streams).")
    ],
    out: Annotated[Path, typer.Option("--out", help="Where to write the drifting trace (JSONL).")],
    root: Annotated[
        Path, typer.Option("--root", help="The repository (its bench/data and examples/data).")
    ] = Path("."),
    seed: Annotated[int, typer.Option("--seed")] = 0,
) -> None:
    """Write a drifting workload built from the shipped data, for `evocache agent run`: `kv`, the Mooncake
    trace whose second half moves to a new system prompt and a new tenant while a batch tenant's one-off
    documents push its prefixes out; `semantic`, Banking77 questions then CLINC150 ones."""
    from ._scenarios import kv_drift, semantic_drift

    sources = {
        "kv": [root / "bench/data/mooncake_synthetic_trace.jsonl"],
        "semantic": [root / "examples/data/banking77_train.jsonl", root / "bench/data/clinc150_train.jsonl"],
    }
    if kind not in sources:
        raise error(f"error: unknown scenario {kind!r}: kv or semantic", EXIT_USAGE)
    missing = [str(p) for p in sources[kind] if not p.is_file()]
    if missing:
        raise error(
            f"error: {', '.join(missing)}: not found (run from the repository root or give --root)", EXIT_FAILED
        )
    try:
        path = (
            kv_drift(*sources[kind], out, seed=seed)
            if kind == "kv"
            else semantic_drift(*sources[kind], out, seed=seed)
        )
    except (OSError, ValueError, KeyError) as exc:
        raise error(f"error: {out}: {exc}", EXIT_FAILED) from None
    lines = sum(1 for _ in open(path, encoding="utf-8"))
    typer.echo(f"wrote {path}: {lines} requests, phase A then phase B")


def add_commands(group: typer.Typer) -> None:
    group.command("run")(run)
    group.command("watch")(watch)
    group.command("scenario")(scenario)
