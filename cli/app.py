"""The `evocache` command. Each room's commands live beside the code they drive; this module composes them into
command groups of its own, and changes nothing in the rooms (importing it leaves every other module as it was).

Heavy imports stay inside the commands that need them, so `evocache policy check` starts fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from evocache.agents.commands import add_commands as add_agent_commands
from evocache.agents.commands import add_proposal_commands, demo_command, resume_waiting_review
from evocache.controller.commands import add_commands as add_policy_store_commands
from evocache.controller.stats_command import stats as stats_command
from evocache.controller.replay.commands import eviction as bench_eviction
from evocache.controller.semantic.commands import semantic as bench_semantic
from evocache.dsl.commands import make_app as make_policy_app
from evocache.serving.commands import serve

from ._demo import LocalDeployment

if TYPE_CHECKING:
    from evocache.dsl import Policy


def controller_can_enforce(policy: Policy) -> None:
    """`policy check`'s question to the controller: raises ``ValueError`` (a ``StoreConfigError``) for a document
    it cannot enforce, such as one naming an eviction policy it does not know."""
    from evocache.controller import check_policy

    check_policy(policy)


def make_app() -> typer.Typer:
    """A new `evocache` command: `policy` (the dsl room's commands, its `check` asking the controller too, and
    the controller's policy store commands),
    `bench` (replay's `eviction` and the semantic layer's `semantic`), `serve` (serving's embedded app), `agent`
    and `proposals` (the policy loop), `demo` (the loop on the embedded app: agents' demo handed serving's
    local deployment, ``_demo``) and `version`."""
    root = typer.Typer(
        name="evocache",
        help="evocache: a cache controller for LLM serving.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )
    policy = make_policy_app(checks=(controller_can_enforce,))
    add_policy_store_commands(policy)
    root.add_typer(policy, name="policy",
                   help="Check, compare and show policy documents; apply, promote and roll them back in a store.")
    bench = typer.Typer(no_args_is_help=True, add_completion=False,
                        help="Replay traces and prompt streams against the cache's policies.")
    bench.command("eviction")(bench_eviction)
    bench.command("semantic")(bench_semantic)
    root.add_typer(bench, name="bench")
    root.command("stats")(stats_command)
    agent = typer.Typer(no_args_is_help=True, add_completion=False,
                        help="The policy loop: diagnose traffic, propose and roll out policy changes.")
    add_agent_commands(agent)
    root.add_typer(agent, name="agent")
    proposals = typer.Typer(no_args_is_help=True, add_completion=False,
                            help="Review the policy loop's proposals: list, show, approve, reject.")
    add_proposal_commands(proposals, on_review=resume_waiting_review)
    root.add_typer(proposals, name="proposals")
    root.command()(serve)
    root.command()(demo_command(LocalDeployment()))
    root.command()(version)
    return root


def version() -> None:
    """Print the installed evocache version."""
    from importlib.metadata import version as dist_version

    typer.echo(dist_version("evocache"))


app = make_app()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
