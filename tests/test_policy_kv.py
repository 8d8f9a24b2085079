"""The policy language's ``kv`` section: reuse ``prefix``, ``chunks`` or ``off`` (``none`` read as ``off``),
tiers, ``min_tokens``, ``shared_prefixes`` and the chunk-only recompute fields; a rule's kv over the defaults'
field by field; ``Decision.kv`` resolved with every field filled; errors at their field with line and column;
diffs; and the documents written before these fields, which load as they did."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from typer.testing import CliRunner

from evocache.dsl import (
    Change,
    KvSpec,
    PolicyError,
    diff_policies,
    load_policy,
    parse_policy,
    policy_to_dict,
    policy_to_yaml,
)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "policies"
HEAD = "policy: p\nversion: 1\n"


def _issue(text: str) -> tuple[int | None, int | None, str, str]:
    with pytest.raises(PolicyError) as info:
        parse_policy(HEAD + text)
    issues = info.value.issues
    assert len(issues) == 1, issues
    return issues[0].line, issues[0].column, issues[0].field, issues[0].message


def _kv(
    reuse: str = "prefix",
    tiers: tuple[str, ...] = ("l1",),
    min_tokens: int = 0,
    shared_prefixes: bool = False,
    recompute_tokens: int | None = None,
    recompute_fraction: float = 0.0,
) -> KvSpec:
    """A resolved spec, as Decision.kv carries it."""
    chunks = reuse == "chunks"
    if recompute_tokens is None:
        recompute_tokens = 16 if chunks else 0
    return KvSpec(
        reuse=reuse,
        rope_shift=chunks,
        tiers=tiers,
        min_tokens=min_tokens,
        shared_prefixes=shared_prefixes,
        recompute_tokens=recompute_tokens,
        recompute_fraction=recompute_fraction,
    )


RULES = """\
defaults:
  tiers: [l1, l2]
  kv: {reuse: chunks, min_tokens: 64, recompute_tokens: 8}
rules:
  - name: rag
    when: top_k == 1
    kv: {recompute_fraction: 0.25, tiers: [l3]}
  - name: exact
    when: top_k == 2
    tiers: [l1, l2, l3]
    kv: {reuse: prefix, shared_prefixes: true}
  - name: private
    when: top_k == 3
    kv: {reuse: off}
  - name: plain
    when: top_k == 4
"""


# --- documents written before these fields -----------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_policy_still_loads_and_round_trips(path: Path) -> None:
    policy = load_policy(path)
    assert parse_policy(policy_to_yaml(policy)) == policy


def test_chat_prod_kv_loads_as_written_and_resolves_to_prefix_reuse() -> None:
    policy = load_policy(EXAMPLES / "chat-prod.yaml")
    rule = next(r for r in policy.rules if r.name == "long-context-greedy")
    # rope_shift: false is kept as written beside the reuse it implies
    assert policy_to_dict(policy)["rules"][0]["kv"] == {"reuse": "prefix", "rope_shift": False}
    decision = policy.decide({"input_ids": [1] * 600, "top_k": 1, "temperature": 0.0})
    assert decision.rule == rule.name
    assert decision.kv == _kv(tiers=("l1", "l2", "l3"))
    assert policy.decide({"top_k": 1, "temperature": 0.0}).kv is None  # no kv in the defaults: off


def test_rope_shift_is_read_as_the_earlier_spelling_of_the_mode() -> None:
    def reuse_of(kv: str) -> str | None:
        return parse_policy(HEAD + f"defaults: {{kv: {kv}}}\n").defaults.kv.reuse  # type: ignore[union-attr]

    assert reuse_of("{reuse: prefix, rope_shift: true}") == "chunks"  # as older documents wrote it
    assert reuse_of("{rope_shift: true}") == "chunks"
    assert reuse_of("{rope_shift: false}") == "prefix"
    assert reuse_of("{reuse: chunks, rope_shift: true}") == "chunks"
    assert reuse_of("{reuse: none, rope_shift: true}") == "off"
    legacy = parse_policy(HEAD + "defaults: {kv: {reuse: prefix, rope_shift: true}}\n")
    assert legacy.decide({}).kv == _kv(reuse="chunks")


# --- reuse: off and its earlier spelling --------------------------------------------------------------------


@pytest.mark.parametrize("spelling", ["none", "off", "'off'", '"off"', "false"])
def test_none_and_off_switch_reuse_off_and_normalise_to_off(spelling: str) -> None:
    policy = parse_policy(HEAD + f"defaults: {{kv: {{reuse: {spelling}}}}}\n")
    assert policy.defaults.kv == KvSpec(reuse="off")
    assert policy_to_dict(policy)["defaults"]["kv"] == {"reuse": "off"}
    assert "    reuse: 'off'\n" in policy_to_yaml(policy)  # quoted: a bare off would read back as false
    assert policy.decide({}).kv is None
    assert policy == parse_policy(HEAD + "defaults: {kv: {reuse: 'off'}}\n")
    assert parse_policy(policy_to_yaml(policy)) == policy


def test_a_rule_switches_the_defaults_reuse_off_with_none() -> None:
    policy = parse_policy(
        HEAD + "defaults: {kv: {reuse: prefix}}\nrules:\n  - {name: r, when: top_k == 1, kv: {reuse: none}}\n"
    )
    assert policy.rules[0].kv == KvSpec(reuse="off")
    assert policy.decide({"top_k": 1}).kv is None
    assert policy.decide({"top_k": 2}).kv == _kv()


# --- defaults, rule override, resolution -------------------------------------------------------------------


def test_a_rules_kv_overrides_the_defaults_field_by_field() -> None:
    policy = parse_policy(HEAD + RULES)
    assert policy.decide({"top_k": 1}).kv == _kv(
        reuse="chunks", tiers=("l3",), min_tokens=64, recompute_tokens=8, recompute_fraction=0.25
    )
    # a rule's own reuse: prefix drops the defaults' recompute_tokens (chunks only) and keeps min_tokens
    assert policy.decide({"top_k": 2}).kv == _kv(
        tiers=("l1", "l2", "l3"), min_tokens=64, shared_prefixes=True
    )
    assert policy.decide({"top_k": 3}).kv is None
    # a rule without kv takes the defaults' kv whole
    assert policy.decide({"top_k": 4}).kv == _kv(
        reuse="chunks", tiers=("l1", "l2"), min_tokens=64, recompute_tokens=8
    )
    assert policy.decide({"top_k": 5}).rule == "default"
    assert policy.decide({"top_k": 5}).kv == policy.decide({"top_k": 4}).kv


def test_the_normalised_document_keeps_only_what_was_written() -> None:
    policy = parse_policy(HEAD + RULES)
    doc = policy_to_dict(policy)
    assert doc["defaults"]["kv"] == {"reuse": "chunks", "min_tokens": 64, "recompute_tokens": 8}
    assert [rule.get("kv") for rule in doc["rules"]] == [
        {"tiers": ["l3"], "recompute_fraction": 0.25},
        {"reuse": "prefix", "shared_prefixes": True},
        {"reuse": "off"},
        None,
    ]
    assert parse_policy(policy_to_yaml(policy)) == policy
    assert pickle.loads(pickle.dumps(policy)).decide({"top_k": 1}) == policy.decide({"top_k": 1})


def test_resolution_fills_every_field() -> None:
    assert parse_policy(HEAD).decide({}).kv is None  # no kv anywhere: off
    # an empty kv switches prefix reuse on, in the decision's tiers
    empty = parse_policy(HEAD + "defaults: {tiers: [l2, l1], kv: {}}\n")
    assert empty.decide({}).kv == _kv(tiers=("l1", "l2"))
    chunks = parse_policy(HEAD + "defaults: {kv: {reuse: chunks}}\n").decide({}).kv
    assert chunks == _kv(reuse="chunks", recompute_tokens=16)
    assert chunks is not None and chunks.rope_shift is True
    # a rule's kv over no kv in the defaults: prefix reuse, in the rule's tiers
    ruled = parse_policy(
        HEAD + "rules:\n  - {name: r, when: 'true', tiers: [l2], kv: {min_tokens: 10}}\n"
    )
    assert ruled.decide({}).kv == _kv(tiers=("l2",), min_tokens=10)
    zero = parse_policy(
        HEAD + "defaults: {kv: {reuse: chunks, recompute_tokens: 0, recompute_fraction: 1}}\n"
    )
    assert zero.decide({}).kv == _kv(reuse="chunks", recompute_tokens=0, recompute_fraction=1.0)


def test_kv_tiers_are_normalised_like_a_rules_tiers() -> None:
    policy = parse_policy(HEAD + "defaults: {kv: {tiers: [l3, l1]}}\n")
    assert policy.defaults.kv is not None and policy.defaults.kv.tiers == ("l1", "l3")
    assert policy == parse_policy(HEAD + "defaults: {kv: {tiers: [l1, l3]}}\n")


# --- errors at their field ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kv", "column", "path", "message"),
    [
        ("{reuse: bogus}", 24, "defaults.kv.reuse", "must be 'prefix', 'chunks' or 'off'; got str 'bogus'"),
        ("{reuse: on}", 24, "defaults.kv.reuse", "must be 'prefix', 'chunks' or 'off'; got bool True"),
        ("{tiers: [l4]}", 25, "defaults.kv.tiers[0]", "unknown tier 'l4'; known tiers: l1, l2, l3"),
        ("{tiers: []}", 24, "defaults.kv.tiers", "list at least one tier (l1, l2, l3)"),
        ("{tiers: [l1, l1]}", 24, "defaults.kv.tiers", "tier listed twice in ['l1', 'l1']"),
        ("{tiers: l1}", 24, "defaults.kv.tiers", "expected a list; got str 'l1'"),
        ("{min_tokens: -1}", 29, "defaults.kv.min_tokens", "must be greater than or equal to 0; got int -1"),
        ("{min_tokens: 1.5}", 29, "defaults.kv.min_tokens", "expected an integer; got float 1.5"),
        ("{min_tokens: 2147483648}", 29, "defaults.kv.min_tokens",
         "must be less than or equal to 2147483647"),
        ("{shared_prefixes: 1}", 34, "defaults.kv.shared_prefixes", "expected true or false; got int 1"),
        ("{reuse: chunks, recompute_tokens: -1}", 50, "defaults.kv.recompute_tokens",
         "must be greater than or equal to 0; got int -1"),
        ("{reuse: chunks, recompute_fraction: 1.5}", 52, "defaults.kv.recompute_fraction",
         "must be less than or equal to 1; got float 1.5"),
        ("{reuse: prefix, recompute_tokens: 4}", 50, "defaults.kv.recompute_tokens",
         "recompute_tokens applies only to reuse: chunks (it recomputes part of a reused chunk); "
         "reuse is prefix"),
        ("{reuse: off, recompute_fraction: 0.5}", 49, "defaults.kv.recompute_fraction",
         "recompute_fraction applies only to reuse: chunks (it recomputes part of a reused chunk); "
         "reuse is off"),
        ("{recompute_tokens: 4}", 35, "defaults.kv.recompute_tokens",
         "recompute_tokens applies only to reuse: chunks (it recomputes part of a reused chunk); "
         "reuse is prefix (not written)"),
        ("{reuse: chunks, rope_shift: false}", 44, "defaults.kv.rope_shift",
         "rope_shift: false contradicts reuse: chunks"),
        ("{rope_shift: false, recompute_tokens: 4}", 54, "defaults.kv.recompute_tokens",
         "recompute_tokens applies only to reuse: chunks"),
        ("{reuse: prefix, salt: x}", 32, "defaults.kv.salt",
         "unknown field 'salt'; known fields: reuse, rope_shift, tiers, min_tokens, shared_prefixes, "
         "recompute_tokens, recompute_fraction"),
        ("prefix", 16, "defaults.kv", "expected a mapping; got str 'prefix'"),
    ],
)
def test_each_invalid_value_is_reported_at_its_field(kv: str, column: int, path: str, message: str) -> None:
    line, col, where, said = _issue(f"defaults: {{kv: {kv}}}\n")
    assert (line, col, where) == (3, column, path)
    assert said.startswith(message), said


def test_a_rule_is_checked_against_the_reuse_it_inherits() -> None:
    text = (
        "defaults: {kv: {reuse: prefix}}\n"
        "rules:\n  - name: r\n    when: 'true'\n    kv: {recompute_tokens: 4}\n"
    )
    assert _issue(text) == (
        7,
        28,
        "rules[0].kv.recompute_tokens",
        "recompute_tokens applies only to reuse: chunks (it recomputes part of a reused chunk); "
        "reuse is prefix (the defaults')",
    )
    # the same rule over defaults that reuse chunks is valid
    policy = parse_policy(HEAD + text.replace("reuse: prefix", "reuse: chunks"))
    assert policy.decide({}).kv == _kv(reuse="chunks", recompute_tokens=4)


def test_a_rules_kv_errors_carry_the_rules_path() -> None:
    assert _issue("rules:\n  - name: r\n    when: 'true'\n    kv: {reuse: chunks, min_tokens: x}\n") == (
        6,
        37,
        "rules[0].kv.min_tokens",
        "expected an integer; got str 'x'",
    )


def test_an_invalid_reuse_is_reported_alone() -> None:
    # the recompute field is not blamed for a reuse that could not be read
    assert _issue("defaults: {kv: {reuse: bogus, recompute_tokens: 3}}\n")[2] == "defaults.kv.reuse"


# --- diff and check ----------------------------------------------------------------------------------------


def test_diff_shows_kv_changes_by_path() -> None:
    old = parse_policy(HEAD + RULES)
    new = parse_policy(
        HEAD.replace("1", "2")
        + RULES.replace("recompute_tokens: 8", "recompute_tokens: 32")
        .replace("kv: {reuse: off}", "kv: {reuse: none, min_tokens: 5}")
        .replace("kv: {reuse: prefix, shared_prefixes: true}", "kv: {reuse: prefix}")
    )
    diff = diff_policies(old, new)
    assert diff.changes == (
        Change("changed", "version", 1, 2),
        Change("changed", "defaults.kv.recompute_tokens", 8, 32),
        Change("removed", "rules[exact].kv.shared_prefixes", True, None),
        Change("added", "rules[private].kv.min_tokens", None, 5),
    )
    assert [str(c) for c in diff.changes][1:] == [
        "changed  defaults.kv.recompute_tokens: 8 -> 32",
        "removed  rules[exact].kv.shared_prefixes: true",
        "added    rules[private].kv.min_tokens: 5",
    ]
    assert "-    recompute_tokens: 8\n+    recompute_tokens: 32\n" in diff.text
    assert "-      shared_prefixes: true\n" in diff.text
    assert "+      min_tokens: 5\n" in diff.text
    # none and off are one setting: respelling it is no change
    assert diff_policies(
        parse_policy(HEAD + "defaults: {kv: {reuse: none}}\n"),
        parse_policy(HEAD + "defaults: {kv: {reuse: off}}\n"),
    ).empty


def test_policy_check_validates_kv(tmp_path: Path) -> None:
    from evocache.cli.app import app

    good = tmp_path / "good.yaml"
    good.write_text(HEAD + RULES)
    bad = tmp_path / "bad.yaml"
    bad.write_text(HEAD + "defaults:\n  kv: {reuse: prefix, recompute_fraction: 0.5, min_tokens: -3}\n")
    runner = CliRunner()
    ok = runner.invoke(app, ["policy", "check", str(good)])
    assert ok.exit_code == 0 and ok.output.startswith("ok p@1 "), ok.output
    failed = runner.invoke(app, ["policy", "check", str(bad)])
    assert failed.exit_code == 1
    assert (
        f"{bad}:4:43: defaults.kv.recompute_fraction: recompute_fraction applies only to reuse: chunks"
        in failed.output
    )
    said = failed.output
    assert f"{bad}:4:60: defaults.kv.min_tokens: must be greater than or equal to 0; got int -3" in said
