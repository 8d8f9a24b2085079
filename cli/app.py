"""The `evocache` command. Each room's commands live beside the code they drive; this module only mounts them.

Heavy imports stay inside the commands that need them, so `evocache policy check` starts fast.
"""

from __future__ import annotations

import typer

from evocache.controller.replay.commands import app as bench_app
from evocache.controller.semantic.commands import semantic as bench_semantic
from evocache.dsl.commands import ENFORCEMENT_CHECKS
from evocache.dsl.commands import app as policy_app

app = typer.Typer(
    name="evocache",
    help="evocache: a cache controller for LLM serving.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(policy_app, name="policy", help="Check and compare policy documents.")
app.add_typer(bench_app, name="bench", help="Replay traces against the cache's policies.")
bench_app.command("semantic")(bench_semantic)


def _controller_can_enforce(policy) -> None:  # noqa: ANN001 - a dsl Policy; imported lazily
    from evocache.controller import check_policy

    check_policy(policy)  # StoreConfigError is a ValueError


ENFORCEMENT_CHECKS.append(_controller_can_enforce)


@app.command()
def version() -> None:
    """Print the installed evocache version."""
    from importlib.metadata import version as dist_version

    typer.echo(dist_version("evocache"))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
