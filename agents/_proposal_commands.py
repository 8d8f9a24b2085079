"""`evocache proposals list | show | approve | reject`: the loop's proposals, for the person who reviews them.

The store: ``--store PATH``, else ``$EVOCACHE_AGENT_STORE``, else ``.evocache/agent/proposals.db`` under the
working directory; these commands never make one. Exit codes: 0 done; 1 a proposal that is not there (or an id
prefix that begins more than one), or a move its status does not allow (approving without replay evidence
included); 2 a usage error, or a store that cannot be opened (missing, not a proposal store, another schema
version). Nothing heavy is imported here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from evocache.controller.cli_errors import EXIT_FAILED, EXIT_USAGE, error

from ._proposals import DEFAULT_STORE, STATUSES, STORE_ENV, ProposalStoreError
from .errors import ProposalError

if TYPE_CHECKING:
    from ._proposals import AuditEntry, Evidence, Proposal, ProposalStore

OnReview = Callable[["Proposal", str, Path], None]
"""Called after a review is recorded, with the proposal as stored, the verdict (``approve``/``reject``) and
the store's path:
where the `evocache` command resumes the loop's thread that waits on it. What it raises propagates: the review
is recorded already."""

_EPILOG = (
    f"The store: --store PATH, else ${STORE_ENV}, else {DEFAULT_STORE}. Exit codes: 0 done; {{one}}"
    "2 a usage error, or a store that cannot be opened (missing, not a proposal store, another schema "
    "version)."
)
_NOT_THERE = "1 a proposal that is not there (or an id prefix that begins more than one)"

StoreOption = Annotated[
    Path,
    typer.Option("--store", metavar="PATH", envvar=STORE_ENV, help="The proposal store (an SQLite file)."),
]
IdArgument = Annotated[str, typer.Argument(metavar="ID", help="A proposal id, or the start of one.")]
NoteOption = Annotated[str, typer.Option("--note", help="Why: kept with the review and in the audit log.")]
ReviewerOption = Annotated[
    str | None, typer.Option("--reviewer", help="Who reviews (default: the user name).")
]


def _open(path: Path) -> ProposalStore:
    from ._proposals import ProposalStore

    try:
        return ProposalStore(path, create=False)
    except ProposalStoreError as exc:
        raise error(f"error: {exc}", EXIT_USAGE) from None


def _when(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _gain(value: float | None) -> str:
    return "-" if value is None else f"{value:+.4g}"


def _console() -> Any:
    from rich.console import Console

    return Console(highlight=False, soft_wrap=False)


def list_proposals(
    store: StoreOption = Path(DEFAULT_STORE),
    status: Annotated[
        str | None, typer.Option("--status", help=f"Only these: {', '.join(STATUSES)}.")
    ] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, help="At most this many, newest first.")] = 50,
    as_json: Annotated[bool, typer.Option("--json", help="Print the proposals as a JSON list.")] = False,
) -> None:
    """List proposals, newest first, with their status, change, gains and first finding."""
    if status is not None and status not in STATUSES:
        known = ", ".join(STATUSES)
        raise error(f"error: --status: unknown proposal status {status!r} (known: {known})", EXIT_USAGE)
    with _open(store) as opened:
        proposals = _run(lambda: opened.list(status, limit))
    if as_json:
        typer.echo(json.dumps([p.to_dict() for p in proposals], indent=2, ensure_ascii=False))
        return
    if not proposals:
        typer.echo("no proposals" + (f" are {status}" if status else ""))
        return
    from rich.table import Table

    table = Table("id", "status", "change", "predicted", "realised", "created", "finding")
    for p in proposals:
        table.add_row(
            p.id,
            p.status,
            f"{p.base_policy} -> {p.new_ref}",
            _gain(p.predicted_gain),
            _gain(p.realised_gain),
            _when(p.created_at),
            p.summary or "-",
        )
    _console().print(table)


def show(id: IdArgument, store: StoreOption = Path(DEFAULT_STORE)) -> None:
    """Show one proposal: the change, its diff, the findings behind it, the replay evidence with its
    confidence intervals, its reviews and its audit log."""
    with _open(store) as opened:
        proposal = _run(lambda: opened.get(id))
        reviews = _run(lambda: opened.reviews(proposal.id))
        audit = _run(lambda: opened.audit(proposal.id))
    _print_header(proposal)
    if proposal.diff:
        from evocache.dsl.commands import print_diff

        typer.echo("")
        print_diff(proposal.diff)
    typer.echo("")
    _print_findings(proposal)
    _print_evidence(proposal.evidence)
    typer.echo("reviews:" if reviews else "reviews: none")
    for r in reviews:
        typer.echo(f"  {_when(r.at)} {r.reviewer} {r.verdict}" + (f": {r.note}" if r.note else ""))
    typer.echo("history:")
    for entry in audit:
        typer.echo(f"  {_when(entry.at)} {entry.actor} {_audit_line(entry)}")


def _print_header(p: Proposal) -> None:
    typer.echo(f"proposal {p.id}: {p.status}")
    typer.echo(f"change: {p.base_policy} ({p.base_hash[:12]}) -> {p.new_ref}")
    thread = f", thread {p.thread_id}" if p.thread_id else ""
    typer.echo(f"made: {_when(p.created_at)} from window {p.window}{thread}")
    typer.echo(f"gain: predicted {_gain(p.predicted_gain)}, realised {_gain(p.realised_gain)}")


def _print_findings(p: Proposal) -> None:
    typer.echo("findings:" if p.findings else "findings: none")
    for f in p.findings:
        p_value, score = f.get("p_value"), f.get("score")
        stats = [f"p={p_value:.3g}"] if isinstance(p_value, int | float) else []
        stats += [f"score {score:.2f}"] if isinstance(score, int | float) else []
        said = f" ({', '.join(stats)})" if stats else ""
        typer.echo(f"  {f.get('kind', '?')}: {f.get('summary', '')}{said}")


def _print_evidence(evidence: Evidence | None) -> None:
    if evidence is None:
        typer.echo("evidence: none (it cannot be approved before a replay)")
        return
    windows = evidence.windows
    span = (
        ""
        if not windows
        else f", window {windows[0]}"
        if len(windows) == 1
        else f", windows {windows[0]}-{windows[-1]}"
    )
    typer.echo(f"evidence: evaluated {_when(evidence.evaluated_at)}{span}")
    from rich.table import Table

    table = Table("metric", "base", "new", "delta", "CI")
    for name, m in evidence.metrics.items():
        unit = f" {m.unit}" if m.unit else ""
        ci = "-" if m.ci is None else f"[{m.ci[0]:+.4g}, {m.ci[1]:+.4g}] at {m.level:.0%}"
        table.add_row(name, f"{m.base:.4g}{unit}", f"{m.new:.4g}{unit}", f"{m.delta:+.4g}", ci)
    _console().print(table)
    context = evidence.evidence_context()
    if context is not None:
        typer.echo(
            f"context: {context.policy_ref}, model {context.model_id} {context.model_revision}, "
            f"template {context.template_hash[:12]}"
        )
    for plot in evidence.plots:
        typer.echo(f"plot: {plot}")


def _audit_line(entry: AuditEntry) -> str:
    detail = entry.detail
    if entry.action == "policy":
        return f"policy {detail.get('kind')} {detail.get('ref')} ({str(detail.get('hash', ''))[:12]})"
    moved = f"{entry.from_state} -> {entry.to_state}" if entry.from_state else f"{entry.to_state}"
    note = detail.get("note")
    return f"{entry.action} {moved}" + (f": {note}" if note else "")


def _run(operation: Callable[[], Any]) -> Any:
    """``operation()``, a proposal it cannot find or move exiting 1 and a store it cannot read exiting 2."""
    try:
        return operation()
    except ProposalStoreError as exc:
        raise error(f"error: {exc}", EXIT_USAGE) from None
    except ProposalError as exc:
        raise error(f"error: {exc}", EXIT_FAILED) from None


def _reviewer(given: str | None) -> str:
    if given:
        return given
    import getpass

    try:
        return getpass.getuser()
    except (OSError, KeyError):  # no login name and no $USER: an unnamed reviewer is still recorded
        return "unknown"


def _review(
    store: Path, id: str, verdict: str, reviewer: str | None, note: str, on_review: OnReview | None
) -> None:
    who = _reviewer(reviewer)
    with _open(store) as opened:
        proposal = _run(lambda: opened.review(id, verdict, who, note))
    typer.echo(f"{proposal.status} {proposal.id}: {proposal.base_policy} -> {proposal.new_ref} (by {who})")
    if on_review is not None:
        on_review(proposal, verdict, store)


def add_commands(group: typer.Typer, on_review: OnReview | None = None) -> None:
    """Add list, show, approve and reject to ``group``; ``on_review`` is called after each review is recorded
    (see ``OnReview``)."""
    move = "a move its status does not allow (approving without replay evidence included)"

    def approve(
        id: IdArgument,
        note: NoteOption = "",
        reviewer: ReviewerOption = None,
        store: StoreOption = Path(DEFAULT_STORE),
    ) -> None:
        """Approve a proposed or waiting proposal (it needs replay evidence): it goes on to the canary."""
        _review(store, id, "approve", reviewer, note, on_review)

    def reject(
        id: IdArgument,
        note: NoteOption = "",
        reviewer: ReviewerOption = None,
        store: StoreOption = Path(DEFAULT_STORE),
    ) -> None:
        """Reject a proposed, waiting or stale proposal: it is final."""
        _review(store, id, "reject", reviewer, note, on_review)

    group.command("list", epilog=_EPILOG.format(one=""))(list_proposals)
    group.command(epilog=_EPILOG.format(one=f"{_NOT_THERE}; "))(show)
    group.command(epilog=_EPILOG.format(one=f"{_NOT_THERE}, or {move}; "))(approve)
    group.command(epilog=_EPILOG.format(one=f"{_NOT_THERE}, or {move}; "))(reject)


def make_app(on_review: OnReview | None = None) -> typer.Typer:
    """A new `proposals` command group (see ``add_commands``)."""
    group = typer.Typer(
        no_args_is_help=True,
        add_completion=False,
        help="List, show, approve and reject the policy loop's proposals.",
    )
    add_commands(group, on_review)
    return group
