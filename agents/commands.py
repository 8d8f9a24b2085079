"""``evocache agent``: the policy loop's commands. ``run`` makes one pass over a trace.

    evocache agent run --trace FILE --policy FILE [--window N] [--json OUT] [--workdir DIR]

Exit codes: 0 done; 1 the trace, the policy or the loop's state could not be used (the message names which);
2 bad usage.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer


def run(
    trace: Annotated[Path, typer.Option("--trace", help="A trace replay reads, or a semantic stream.")],
    policy: Annotated[Path, typer.Option("--policy", help="The policy in force at the start.")],
    window: Annotated[int, typer.Option("--window", min=10, help="Requests per window.")] = 300,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the run's report here.")] = None,
    workdir: Annotated[Path, typer.Option("--workdir", help="Policy store, proposals, checkpoints.")] = Path(
        ".evocache/agent"),
    capacity: Annotated[int | None, typer.Option("--capacity", min=1, help="Simulated L1 capacity (the trace's "
                                                 "size unit); default a tenth of its distinct keys.")] = None,
    interactive: Annotated[bool, typer.Option("--interactive", help="Every proposal waits for a person.")] = False,
    inject_harmful: Annotated[int | None, typer.Option("--inject-harmful", metavar="WINDOW",
                                                       help="Inject a harmful proposal at this window.")] = None,
) -> None:
    """Run the loop over a recorded trace: diagnose each window, propose, replay, review, canary, promote or
    roll back; print the windows and the proposals."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from evocache.dsl import PolicyError, load_policy

    from ._loop import LoopConfig
    from ._run import RunOptions, run_trace
    from .errors import AgentError

    try:
        base = load_policy(policy)
    except (PolicyError, OSError) as exc:
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(1) from None
    console, err = Console(), Console(stderr=True)
    options = RunOptions(window=window, capacity=capacity, harmful_at=inject_harmful,
                         loop=LoopConfig(interactive=interactive))
    with Progress(TextColumn("[bold]agent"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True) as bar:
        task = bar.add_task("windows", total=None)
        try:
            report = run_trace(trace, base, workdir, options=options,
                               progress=lambda done, total: bar.update(task, completed=done, total=total))
        except (AgentError, ValueError, OSError) as exc:
            err.print(f"[red]error:[/] {exc}")
            raise typer.Exit(1) from None
    _print(console, report)
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(report, indent=1, default=str))
        console.print(f"report: {json_out}")


def _print(console: Any, report: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title="windows")
    for col in ("window", "requests", "policy", "canary", "hit ratio", "findings"):
        table.add_column(col)
    for w in report["windows"]:
        kinds = sorted({f["kind"] for f in w["findings"] if f["kind"] != "not-testable"})
        table.add_row(str(w["index"]), str(w["requests"]), w["policy"], w["canary"] or "-", f"{w['hit_ratio']:.3f}",
                      ", ".join(kinds) or "-")
    console.print(table)
    drift = report["drift_detected_at"]
    console.print(f"drift detected at window {drift}" if drift is not None else "no drift detected")
    props = Table(title="proposals")
    for col in ("id", "window", "status", "predicted gain", "realised gain"):
        props.add_column(col)
    for p in report["proposals"]:
        props.add_row(p["id"], str(p["window"]), p["status"], _gain(p["predicted_gain"]), _gain(p["realised_gain"]))
    console.print(props)


def _gain(value: float | None) -> str:
    return "-" if value is None else f"{value:+.4f}"


def resume_waiting_review(proposal: object, verdict: str, store: Path) -> None:
    """After ``evocache proposals approve/reject``: resume the loop's pass that waits on this proposal, from this
    process (the graph over the stores beside ``store``, its SQLite checkpointer). Nothing waits: nothing to do
    (the next pass starts an approved proposal's canary)."""
    from ._loop import resume_waiting

    thread = getattr(proposal, "thread_id", None)
    if thread:
        note = resume_waiting(store, thread, verdict)
        if note:
            typer.echo(note)


def add_commands(group: typer.Typer) -> None:
    group.command("run")(run)
