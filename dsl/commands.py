"""`evocache policy ...`: check, compare and show policy documents.

Exit codes (also in each command's help and in docs/policy-language.md, "Commands and exit codes"): 0
success; 1 an invalid document (every issue printed; a document the enforcing rooms cannot enforce counts as
invalid), or, for ``diff --exit-code``, documents that differ; 2 a path that cannot be read (missing, not
permitted, not a regular file), which wins over 1 when both occur. Nothing heavy is imported here: the
commands start fast.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from ._policy import Policy

EXIT_INVALID = 1
EXIT_UNREADABLE = 2

_EXIT_CODES = (
    "Exit codes: 0 {ok}; 1 an invalid document (each issue is printed with file, line and column){more}; "
    "2 {unreadable} (missing, not permitted, not a regular file){wins}."
)
_UNREADABLE_OF_MANY = {"unreadable": "a file that cannot be read", "wins": ", even if another is invalid"}

Check = Callable[["Policy"], None]
"""What a room that enforces policies adds to `check`: raises ``ValueError`` with a message for a document it
cannot enforce (the controller: an eviction policy it does not know)."""


class _Failed(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


def _load(path: Path) -> Policy:
    """Load ``path``; print what is wrong and raise ``_Failed`` with the exit code if it cannot be."""
    from ._policy import load_policy
    from .errors import PolicyError

    try:
        return load_policy(path)
    except PolicyError as exc:
        for issue in exc.issues:
            typer.echo(str(issue))
        raise _Failed(EXIT_INVALID) from None
    except OSError as exc:
        typer.echo(f"error: {path}: {exc.strerror or exc}", err=True)
        raise _Failed(EXIT_UNREADABLE) from None


def check(files: Sequence[Path], checks: Sequence[Check] = ()) -> None:
    """`policy check`: each document of ``files`` loaded, then given to each of ``checks``; raises
    ``typer.Exit`` with the exit code."""
    code = 0
    for path in files:
        try:
            policy = _load(path)
        except _Failed as failed:
            code = max(code, failed.code)
            continue
        problems = []
        for enforce in checks:
            try:
                enforce(policy)
            except ValueError as exc:
                problems.append(str(exc))
        if problems:
            for problem in problems:
                typer.echo(f"{path}: {problem}")
            code = max(code, EXIT_INVALID)
            continue
        typer.echo(f"ok {policy.ref} {policy.content_hash[:12]}")
    raise typer.Exit(code)


def diff(
    old: Annotated[Path, typer.Argument(metavar="OLD", help="The policy document before the change.")],
    new: Annotated[Path, typer.Argument(metavar="NEW", help="The policy document after it.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print only the list of changes, as JSON.")] = False,
    exit_code: Annotated[
        bool, typer.Option("--exit-code", help="Exit with 1 when the policies differ.")
    ] = False,
) -> None:
    """Compare two policy documents: a unified diff of the normalised documents, then the list of changes.

    Prints nothing for equal documents (with --json, an empty list: []).
    """
    from ._diff import diff_policies

    code = 0
    loaded = []
    for path in (old, new):
        try:
            loaded.append(_load(path))
        except _Failed as failed:
            code = max(code, failed.code)
    if code:
        raise typer.Exit(code)
    result = diff_policies(*loaded)
    if as_json:
        typer.echo(result.to_json())
    elif not result.empty:
        print_diff(result.text)
        typer.echo("")
        for change in result.changes:
            typer.echo(str(change))
    raise typer.Exit(1 if exit_code and not result.empty else 0)


def show(file: Annotated[Path, typer.Argument(metavar="FILE", help="A policy document.")]) -> None:
    """Print the normalised document: key order fixed, defaults filled in, durations spelled one way."""
    from ._policy import policy_to_yaml

    try:
        policy = _load(file)
    except _Failed as failed:
        raise typer.Exit(failed.code) from None
    typer.echo(policy_to_yaml(policy), nl=False)


_DIFF_STYLES = (("+++", "bold"), ("---", "bold"), ("@@", "cyan"), ("+", "green"), ("-", "red"))


def print_diff(text: str) -> None:
    """A unified policy diff to stdout: coloured on a terminal, plain text when piped or captured."""
    if not sys.stdout.isatty():  # piped or captured: plain text, and rich stays unimported
        typer.echo(text, nl=False)
        return
    from rich.console import Console
    from rich.text import Text

    console = Console(highlight=False, soft_wrap=True)

    for line in text.splitlines():
        style = next((s for prefix, s in _DIFF_STYLES if line.startswith(prefix)), "")
        console.print(Text(line, style=style))


def make_app(checks: Sequence[Check] = ()) -> typer.Typer:
    """A new `policy` command group whose `check` also runs ``checks``, the rooms that enforce policies (the
    `evocache` command passes the controller's; the dsl room cannot import those rooms itself)."""
    checks = tuple(checks)
    group = typer.Typer(no_args_is_help=True, add_completion=False, help="Check, compare and show policy documents.")
    more = " or one the cache cannot enforce (an eviction policy it does not know)" if checks else ""

    check_codes = _EXIT_CODES.format(ok="every document is valid", more=more, **_UNREADABLE_OF_MANY)

    @group.command("check", epilog=check_codes)
    def check_command(
        files: Annotated[list[Path], typer.Argument(metavar="FILE", help="Policy documents.")],
    ) -> None:
        """Validate policy documents: print ok NAME@VERSION HASH for each valid one, every issue of the others."""
        check(files, checks)

    group.command(epilog=_EXIT_CODES.format(
        ok="both documents are valid (and, with --exit-code, equal)",
        more=", or, with --exit-code, documents that differ",
        **_UNREADABLE_OF_MANY,
    ))(diff)
    group.command(epilog=_EXIT_CODES.format(
        ok="the document is valid", more="", unreadable="the file cannot be read", wins=""
    ))(show)
    return group


app = make_app()
"""The `policy` commands of the dsl room alone: `check` validates the documents, and no room adds checks."""
