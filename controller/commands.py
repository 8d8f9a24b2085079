"""`evocache policy apply | status | promote | rollback`: the policy store's commands.

The store: ``--redis URL``, else ``--store DIR``, else ``$EVOCACHE_POLICY_STORE`` (a directory, or a
``redis://``, ``rediss://`` or ``unix://`` URL), else ``.evocache/policies`` under the working directory.
Exit codes: 0 done; 1 an invalid document (each issue printed) or an operation the store refuses (a version
not above the active one, nothing to promote or roll back); 2 a usage error, a file or store that cannot be
read, or a policy that a running replica cannot enforce with its store (`apply`, naming the replica and why).
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer

from .cli_errors import EXIT_FAILED, EXIT_USAGE, Failed, error, usage

if TYPE_CHECKING:
    from ._policy_store import PolicyState, PolicyStore, ReplicaReport

T = TypeVar("T")
_URL_SCHEMES = ("redis://", "rediss://", "unix://")
_EPILOG = ("The store: --redis URL, else --store DIR, else $EVOCACHE_POLICY_STORE (a directory or a redis:// "
           "URL), else .evocache/policies under the working directory. Exit codes: 0 done; 1 {one}; 2 a "
           "usage error, or a file or store that cannot be read.")
_REFUSED = "an operation the store refuses"

StoreOption = Annotated[Path | None,
                        typer.Option("--store", metavar="DIR", help="An embedded store's directory.")]
RedisOption = Annotated[str | None,
                        typer.Option("--redis", metavar="URL", help="A Redis policy store's URL.")]
PrefixOption = Annotated[str, typer.Option("--prefix", help="The Redis store's key prefix.")]


def _open(store: Path | None, redis_url: str | None, prefix: str) -> PolicyStore:
    from ._policy_store import PolicyStoreConfig, default_policy_store, open_policy_store
    from .errors import StoreConfigError

    if store is not None and redis_url is not None:
        raise usage("--store/--redis", "give one store, not both")
    if store is None and redis_url is None:
        named = default_policy_store()
        redis_url, store = (named, None) if named.startswith(_URL_SCHEMES) else (None, Path(named))
    try:
        config = PolicyStoreConfig(directory=None if store is None else str(store), redis_url=redis_url,
                                   prefix=prefix)
    except StoreConfigError as exc:
        raise usage("--store/--redis", str(exc)) from None
    try:
        return open_policy_store(config)
    except OSError as exc:
        raise error(f"error: {store}: {exc.strerror or exc}", EXIT_USAGE) from None


def _run(store: PolicyStore, operation: Callable[[PolicyStore], T]) -> T:
    """``operation(store)``, its refusal exiting 1, and a store it cannot reach or a policy a running replica
    cannot enforce exiting 2; the store closed."""
    import redis

    from ._policy_store import PolicyStoreError, UnenforceablePolicy

    try:
        return operation(store)
    except UnenforceablePolicy as exc:
        raise error(f"error: {exc}", EXIT_USAGE) from None
    except PolicyStoreError as exc:
        raise error(f"error: {exc}", EXIT_FAILED) from None
    except (OSError, redis.RedisError) as exc:
        raise error(f"error: the policy store: {exc}", EXIT_USAGE) from None
    finally:
        store.close()


def _when(at: float) -> str:
    return datetime.fromtimestamp(at, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _print_state(state: PolicyState) -> None:
    typer.echo(f"active: {state.active or 'none'}")
    canary = f"{state.canary} on {state.fraction:g} of requests" if state.canary else "none"
    typer.echo(f"canary: {canary}")
    typer.echo(f"shadow: {state.shadow or 'none'}")


def apply(
    file: Annotated[Path, typer.Argument(metavar="FILE", help="The policy document to put in force.")],
    canary: Annotated[float | None, typer.Option(
        "--canary", min=0.0, max=1.0,
        help="Run it as the canary on this fraction of requests (0 < f < 1).")] = None,
    shadow: Annotated[bool, typer.Option(
        "--shadow", help="Make it the shadow: planned beside every call and counted where it would decide "
                         "otherwise, never acted on.")] = False,
    store: StoreOption = None,
    redis_url: RedisOption = None,
    prefix: PrefixOption = "evc:policy",
) -> None:
    """Validate FILE whole and put it in force: as the active policy, with --canary beside it, or with
    --shadow as the shadow (applying the shadow's FILE again puts it in force, as canary or active). It is
    refused, and nothing changes, when a running replica cannot enforce it with the store it runs with."""
    from ..dsl import PolicyError, load_policy
    from ._runtime import check_policy
    from .errors import StoreConfigError

    try:
        policy = load_policy(file)
    except PolicyError as exc:
        for issue in exc.issues:
            typer.echo(str(issue))
        raise Failed(EXIT_FAILED) from None
    except OSError as exc:
        raise error(f"error: {file}: {exc.strerror or exc}", EXIT_USAGE) from None
    try:
        check_policy(policy)
    except StoreConfigError as exc:
        raise error(f"{file}: {exc}", EXIT_FAILED) from None
    if canary is not None and not 0.0 < canary < 1.0:
        raise usage("--canary", f"{canary:g} must be above 0 and below 1")
    if canary is not None and shadow:
        raise usage("--canary/--shadow", "apply a policy as the canary or as the shadow, not both")
    state = _run(_open(store, redis_url, prefix), lambda s: s.apply(policy, canary, shadow=shadow))
    _print_state(state)


def promote(
    store: StoreOption = None, redis_url: RedisOption = None, prefix: PrefixOption = "evc:policy"
) -> None:
    """Make the canary the active policy (a shadow is put in force by applying its FILE again)."""
    _change_and_print(store, redis_url, prefix, lambda s: s.promote())


def rollback(
    store: StoreOption = None, redis_url: RedisOption = None, prefix: PrefixOption = "evc:policy"
) -> None:
    """Drop the canary and the shadow; with neither, go back to the version active before this one."""
    _change_and_print(store, redis_url, prefix, lambda s: s.rollback())


def _change_and_print(store: Path | None, redis_url: str | None, prefix: str,
                      operation: Callable[[PolicyStore], PolicyState]) -> None:
    """Run one state change on the store the options name and print the state after it; a failure exits."""
    _print_state(_run(_open(store, redis_url, prefix), operation))


def status(
    store: StoreOption = None, redis_url: RedisOption = None, prefix: PrefixOption = "evc:policy"
) -> None:
    """Print the active policy, the canary, the shadow, the history, and the versions each replica reports
    running: the current replicas, then those gone (no report within the store's stale_after_s) and those of
    earlier runs."""
    opened = _open(store, redis_url, prefix)
    stale_after_s = opened.stale_after_s
    result = _run(opened, lambda s: s.status())
    _print_state(result.state)
    typer.echo("history:" if result.state.history else "history: none")
    for entry in result.state.history:
        typer.echo(f"  {_when(entry['at'])} {entry['action']} {entry['ref']}")
    if not result.replicas:
        typer.echo("replicas: none reported")
        return
    earlier = [r for r in result.replicas if r.earlier_run]
    gone = [r for r in result.replicas if r.stale and not r.earlier_run]
    current = [r for r in result.replicas if r.current]
    typer.echo("replicas:" if current else "replicas: none current")
    for header, reports in ((None, current),
                            (f"gone (no report within {stale_after_s:g}s):", gone),
                            ("of earlier runs:", earlier)):
        if header is not None and reports:
            typer.echo(header)
        for report in reports:
            typer.echo(f"  {_replica_line(report)}")


def _replica_line(report: ReplicaReport) -> str:
    runs = report.ref or "none"
    runs += f" + canary {report.canary}" if report.canary is not None else ""
    runs += f" + shadow {report.shadow}" if report.shadow is not None else ""
    health = "ok" if report.ok else f"failed: {report.error}"
    line = f"{report.replica_id} {runs} {health} at {_when(report.at)}"
    registration = report.registration
    if registration is not None:
        line += f" (run {registration.run}" + (
            f"; {registration.store.describe()})" if registration.store is not None else ")")
    return line


def add_commands(group: typer.Typer) -> None:
    """Add apply, status, promote and rollback to the `policy` command ``group``."""
    group.command(epilog=_EPILOG.format(one="an invalid document (each issue printed) or " + _REFUSED
                                        + " (a version not above the active one)")
                  + " Exit 2 also when a running replica cannot enforce FILE with its store.")(apply)
    group.command(epilog=_EPILOG.format(one="a store whose contents cannot be read"))(status)
    group.command(epilog=_EPILOG.format(one=_REFUSED + " (no canary)"))(promote)
    group.command(epilog=_EPILOG.format(one=_REFUSED + " (nothing to roll back to)"))(rollback)
