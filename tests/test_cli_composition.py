"""The `evocache` command composes the rooms' commands into groups of its own: importing it changes no other
module, so what a room's commands do never depends on what was imported before."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

DOC = "policy: x\nversion: 1\nrules: []\neviction: {l1: clairvoyant}\n"

# Runs in a fresh interpreter: the room's modules first, their state noted, then the `evocache` command; then
# `policy check` through the dsl room's own app and through the command, on a document naming an eviction
# policy the controller does not know.
PROBE = """
import json, sys
from typer.testing import CliRunner
first = sys.argv[1]

def state():
    import evocache.dsl.commands as dsl
    import evocache.controller.replay.commands as replay
    return {
        "dsl": sorted((name, id(value)) for name, value in vars(dsl).items()),
        "dsl_app": [c.name or c.callback.__name__ for c in dsl.app.registered_commands],
        "replay_app": [c.callback.__name__ for c in replay.app.registered_commands],
        "replay_groups": len(replay.app.registered_groups),
    }

if first == "cli":
    import evocache.cli.app
before = state()
import evocache.cli.app as cli
after = state()
import evocache.dsl.commands as dsl
room = CliRunner().invoke(dsl.app, ["check", sys.argv[2]])
whole = CliRunner().invoke(cli.app, ["policy", "check", sys.argv[2]])
print(json.dumps({"same": before == after, "state": after, "has_checks_list": hasattr(dsl, "ENFORCEMENT_CHECKS"),
                  "room": [room.exit_code, room.output], "whole": [whole.exit_code, whole.output]}))
"""


def _probe(first: str, doc: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, first, str(doc)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_importing_the_command_changes_no_room_and_check_does_not_depend_on_import_order(tmp_path: Path) -> None:
    from evocache.controller import EVICTION_POLICIES

    doc = tmp_path / "clairvoyant.yaml"
    doc.write_text(DOC)
    rooms_first, cli_first = _probe("rooms", doc), _probe("cli", doc)
    assert rooms_first["same"] is True and rooms_first["has_checks_list"] is False
    assert rooms_first["state"]["dsl_app"] == ["check", "diff", "show"]
    assert rooms_first["state"]["replay_app"] == ["eviction"] and rooms_first["state"]["replay_groups"] == 0
    for probe in (rooms_first, cli_first):
        # The dsl room alone validates the document; the command also asks the controller, which refuses it.
        assert probe["room"][0] == 0 and probe["room"][1].startswith("ok x@1 ")
        assert probe["whole"] == [1, f"{doc}: policy x@1: eviction.l1: unknown eviction policy 'clairvoyant'; "
                                     f"known: {', '.join(sorted(EVICTION_POLICIES))}\n"]
    assert rooms_first["room"] == cli_first["room"] and rooms_first["whole"] == cli_first["whole"]


def test_policy_check_runs_the_checks_it_is_given(tmp_path: Path) -> None:
    from evocache.dsl.commands import make_app

    doc = tmp_path / "p.yaml"
    doc.write_text("policy: p\nversion: 2\nrules: []\n")
    seen: list[str] = []

    def refuse(policy) -> None:  # noqa: ANN001 - a dsl Policy
        seen.append(policy.ref)
        raise ValueError("not here")

    result = CliRunner().invoke(make_app(checks=(refuse,)), ["check", str(doc)])
    assert (result.exit_code, result.output, seen) == (1, f"{doc}: not here\n", ["p@2"])
    result = CliRunner().invoke(make_app(), ["check", str(doc)])
    assert result.exit_code == 0 and result.output.startswith("ok p@2 ")


def test_the_command_mounts_every_room_command() -> None:
    from evocache.cli.app import make_app

    runner = CliRunner()
    for args, expected in ((["bench", "--help"], ("eviction", "semantic")),
                           (["policy", "--help"], ("check", "diff", "show"))):
        result = runner.invoke(make_app(), args)
        assert result.exit_code == 0, result.output
        assert all(name in result.output for name in expected)


def test_a_mode_outside_its_choices_exits_2_naming_them(tmp_path: Path) -> None:
    from evocache.cli.app import app
    from evocache.controller.semantic.commands import Mode

    data = tmp_path / "s.jsonl"
    data.write_text('{"prompt": "a", "group": 1}\n')
    result = CliRunner().invoke(app, ["bench", "semantic", "--data", str(data), "--mode", "fuzzy"])
    assert result.exit_code == 2
    assert ("Invalid value for '--mode': Value error, 'fuzzy' is not one of 'bounded', 'static'."
            in " ".join(result.stderr.replace("│", " ").split()))
    assert [m.value for m in Mode] == ["bounded", "static"]
