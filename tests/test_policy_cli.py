"""`evocache policy check | diff | show`, through typer's runner and once through the installed command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from evocache.dsl import diff_policies, load_policy, policy_to_yaml
from evocache.dsl.commands import app
from typer.testing import CliRunner

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "policies"
V7 = EXAMPLES / "chat-prod.yaml"
V8 = EXAMPLES / "chat-prod-v8.yaml"
MINIMAL = EXAMPLES / "minimal.yaml"
BROKEN = EXAMPLES / "broken"

runner = CliRunner()


def ok_line(path: Path) -> str:
    p = load_policy(path)
    return f"ok {p.ref} {p.content_hash[:12]}"


def test_check_valid_files() -> None:
    result = runner.invoke(app, ["check", str(V7), str(MINIMAL)])
    assert (result.exit_code, result.stdout, result.stderr) == (0, f"{ok_line(V7)}\n{ok_line(MINIMAL)}\n", "")
    assert ok_line(MINIMAL).startswith("ok minimal@1 ") and len(ok_line(MINIMAL)) == len("ok minimal@1 ") + 12


def test_check_invalid_file_prints_every_issue_with_carets() -> None:
    path = BROKEN / "unknown-name.yaml"
    result = runner.invoke(app, ["check", str(V7), str(path)])
    assert result.exit_code == 1
    assert result.stdout.splitlines() == [
        ok_line(V7),
        f"{path}:5:32: rules[0].when: unknown name 'tenant_tier'; did you mean 'tenant'? (known fields: input_ids, "
        "max_tokens, model, model_revision, prompt, seed, stream, temperature, tenant, top_k, top_p)",
        '  temperature == 0 and tenant_tier == "pro"',
        "                       ^",
    ]


def test_check_reports_all_issues_of_a_document(tmp_path: Path) -> None:
    doc = tmp_path / "two.yaml"
    doc.write_text("policy: two\nversion: 0\ndefaults: {tiers: [l9]}\n")
    result = runner.invoke(app, ["check", str(doc)])
    assert result.exit_code == 1
    assert result.stdout.splitlines() == [
        f"{doc}:2:10: version: must be greater than or equal to 1; got int 0",
        f"{doc}:3:20: defaults.tiers[0]: unknown tier 'l9'; known tiers: l1, l2, l3",
    ]


def test_check_missing_file_exits_2_after_checking_the_rest(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    result = runner.invoke(app, ["check", str(missing), str(BROKEN / "bad-ttl.yaml"), str(V7)])
    assert result.exit_code == 2
    assert result.stderr == f"error: {missing}: No such file or directory\n"
    assert result.stdout.splitlines()[0].startswith(f"{BROKEN / 'bad-ttl.yaml'}:7:10: rules[0].ttl: ")
    assert result.stdout.splitlines()[-1] == ok_line(V7)


def test_diff_identical_prints_nothing() -> None:
    result = runner.invoke(app, ["diff", str(V7), str(V7)])
    assert (result.exit_code, result.stdout) == (0, "")
    assert runner.invoke(app, ["diff", "--exit-code", str(V7), str(V7)]).exit_code == 0


def test_diff_prints_unified_text_then_changes() -> None:
    expected = diff_policies(load_policy(V7), load_policy(V8))
    result = runner.invoke(app, ["diff", str(V7), str(V8)])
    assert result.exit_code == 0
    assert result.stdout == expected.text + "\n" + "".join(f"{c}\n" for c in expected.changes)
    assert "\x1b[" not in result.stdout  # not a terminal: no colour codes
    assert runner.invoke(app, ["diff", "--exit-code", str(V7), str(V8)]).exit_code == 1


def test_diff_json_prints_only_the_changes() -> None:
    result = runner.invoke(app, ["diff", "--json", str(V7), str(V8)])
    assert result.exit_code == 0
    changes = json.loads(result.stdout)
    assert changes[0] == {"kind": "changed", "path": "version", "old": 7, "new": 8}
    assert [c["path"] for c in changes] == [
        c.path for c in diff_policies(load_policy(V7), load_policy(V8)).changes
    ]
    assert json.loads(runner.invoke(app, ["diff", "--json", str(V7), str(V7)]).stdout) == []


def test_diff_of_an_invalid_document_prints_issues_and_exits_1(tmp_path: Path) -> None:
    result = runner.invoke(app, ["diff", str(V7), str(BROKEN / "duplicate-rule.yaml")])
    assert result.exit_code == 1
    assert result.stdout == (
        f"{BROKEN / 'duplicate-rule.yaml'}:6:11: rules[1].name: "
        "duplicate rule name 'greedy' (first used by rules[0])\n"
    )
    assert runner.invoke(app, ["diff", str(V7), str(tmp_path / "gone.yaml")]).exit_code == 2


def test_show_prints_the_normalised_document() -> None:
    result = runner.invoke(app, ["show", str(V8)])
    assert (result.exit_code, result.stdout) == (0, policy_to_yaml(load_policy(V8)))
    assert runner.invoke(app, ["show", str(BROKEN / "wrong-type.yaml")]).exit_code == 1


def evocache_command() -> str:
    script = Path(sys.executable).parent / "evocache"
    assert script.exists(), f"the console script is not installed at {script}"
    return str(script)


@pytest.mark.slow
def test_installed_entry_point_checks_files() -> None:
    done = subprocess.run(
        [evocache_command(), "policy", "check", str(V7), str(BROKEN / "unknown-tier.yaml")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert done.stdout.splitlines() == [
        ok_line(V7),
        f"{BROKEN / 'unknown-tier.yaml'}:3:24: defaults.tiers[1]: unknown tier 'l4'; known tiers: l1, l2, l3",
    ]
    missing = subprocess.run(
        [evocache_command(), "policy", "check", "/nonexistent/p.yaml"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 2


@pytest.mark.parametrize("module", ["evocache.dsl.commands", "evocache.cli.app"])
def test_commands_import_nothing_heavy(module: str) -> None:
    code = (
        f"import sys, {module}\n"
        "heavy = sorted(m for m in ('torch', 'ray', 'numpy', 'sentence_transformers', 'langgraph', 'rich')"
        " if m in sys.modules)\n"
        "print(heavy)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.slow
def test_check_refuses_what_the_controller_cannot_enforce(tmp_path):
    from evocache.cli.app import app as evocache

    from evocache.controller import EVICTION_POLICIES

    path = tmp_path / "clairvoyant.yaml"
    path.write_text("policy: x\nversion: 1\nrules: []\neviction: {l1: clairvoyant}\n")
    result = CliRunner().invoke(evocache, ["policy", "check", str(path)])
    assert result.exit_code == 1
    assert result.output == (
        f"{path}: policy x@1: eviction.l1: unknown eviction policy 'clairvoyant'; "
        f"known: {', '.join(sorted(EVICTION_POLICIES))}\n"
    )


def test_check_rejects_a_pattern_re2_cannot_compile_with_its_position(tmp_path: Path) -> None:
    # RE2 has no comment groups: '(?#)' cannot hide the '+' after it, the pattern is refused where it is written.
    doc = tmp_path / "pattern.yaml"
    doc.write_text("policy: p\nversion: 1\nrules:\n  - name: r\n    when: \"matches(prompt, '(a+)(?#)+$')\"\n")
    result = runner.invoke(app, ["check", str(doc)])
    assert result.exit_code == 1
    assert result.stdout.splitlines() == [
        f"{doc}:5:28: rules[0].when: invalid pattern: invalid perl operator: (?# "
        "(patterns use RE2 syntax: no backreferences, lookaround or comments)",
        "  matches(prompt, '(a+)(?#)+$')",
        "                  ^",
    ]


@pytest.mark.parametrize(
    ("command", "codes"),
    [
        ("check", "Exit codes: 0 every document is valid; 1 an invalid document"),
        ("diff", "Exit codes: 0 both documents are valid (and, with --exit-code, equal); 1 an invalid document"),
        ("show", "Exit codes: 0 the document is valid; 1 an invalid document"),
    ],
)
def test_help_lists_the_exit_codes(command: str, codes: str) -> None:
    result = runner.invoke(app, [command, "--help"])
    text = " ".join(result.stdout.split())  # the help is wrapped to the terminal's width
    assert result.exit_code == 0
    assert codes in text
    unreadable = (
        "2 the file cannot be read (missing, not permitted, not a regular file)."
        if command == "show"  # one file: nothing else to be invalid
        else "2 a file that cannot be read (missing, not permitted, not a regular file), even if another is invalid."
    )
    assert unreadable in text


@pytest.mark.parametrize(
    ("command", "arguments"),
    [
        ("check", ["Policy documents."]),
        ("diff", ["The policy document before the change.", "The policy document after it."]),
        ("show", ["A policy document."]),
    ],
)
def test_help_is_plain_text_and_explains_each_argument(command: str, arguments: list[str]) -> None:
    # Read in a terminal: no reStructuredText or Markdown quotes, and a list of files named once in the usage.
    text = runner.invoke(app, [command, "--help"], terminal_width=200).stdout
    assert "`" not in text
    assert "FILE..." not in text
    for help_text in arguments:
        assert help_text in text


@pytest.mark.slow
def test_installed_entry_point_applies_a_shadow_and_shows_it(tmp_path: Path) -> None:
    store = tmp_path / "policies"
    docs = []
    for version in (1, 2):
        doc = tmp_path / f"v{version}.yaml"
        doc.write_text(f"policy: chat\nversion: {version}\nrules: []\n")
        docs.append(str(doc))

    def evocache(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([evocache_command(), "policy", *args, "--store", str(store)],
                              capture_output=True, text=True, timeout=120)

    assert evocache("apply", docs[0]).returncode == 0
    shadowed = evocache("apply", docs[1], "--shadow")
    assert (shadowed.returncode, shadowed.stdout) == (0, "active: chat@1\ncanary: none\nshadow: chat@2\n")
    both = evocache("apply", docs[1], "--shadow", "--canary", "0.5")
    assert both.returncode == 2
    assert both.stderr == ("error: --canary/--shadow: apply a policy as the canary or as the shadow, "
                           "not both\n")
    status = evocache("status")
    assert status.returncode == 0
    assert status.stdout.splitlines()[:3] == ["active: chat@1", "canary: none", "shadow: chat@2"]
    assert [line.split()[1:] for line in status.stdout.splitlines()[4:6]] == [
        ["apply", "chat@1"], ["shadow", "chat@2"]]


@pytest.mark.slow
def test_apply_help_explains_the_shadow() -> None:
    from evocache.cli.app import app as evocache

    result = CliRunner().invoke(evocache, ["policy", "apply", "--help"], terminal_width=200)
    text = " ".join(result.stdout.replace("\u2502", " ").split())  # the help is boxed and wrapped
    assert result.exit_code == 0 and "`" not in text
    assert ("Make it the shadow: planned beside every call and counted where it would decide otherwise, "
            "never acted on.") in text
    assert "with --shadow as the shadow (applying the shadow's FILE again puts it in force, as canary or " \
           "active)." in text
