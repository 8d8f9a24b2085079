"""Policy documents: loading, validation with exact error positions, normalisation, decisions."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import pytest
import yaml
from evocache.dsl import (
    STANDARD_SCHEMA,
    Decision,
    KvSpec,
    Policy,
    PolicyError,
    PolicyIssue,
    SemanticSpec,
    format_duration,
    load_policy,
    parse_duration,
    parse_policy,
    policy_to_dict,
    policy_to_yaml,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "policies"
BROKEN = EXAMPLES / "broken"

KNOWN = (
    "input_ids, max_tokens, model, model_revision, prompt, seed, stream, temperature, tenant, top_k, top_p"
)
UNKNOWN_NOPE = f"unknown name 'nope' (known fields: {KNOWN})"


def issues_of(text: str, source: str = "p.yaml") -> list[PolicyIssue]:
    with pytest.raises(PolicyError) as info:
        parse_policy(textwrap.dedent(text), source)
    return info.value.issues


def brief(issues: list[PolicyIssue]) -> list[tuple[int | None, int | None, str, str]]:
    """(line, column, field, first line of the message) of each issue."""
    return [(i.line, i.column, i.field, i.message.splitlines()[0]) for i in issues]


# --- durations ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "seconds", "normal"),
    [
        (30, 30.0, "30s"),
        (90, 90.0, "1m30s"),
        ("90s", 90.0, "1m30s"),
        ("5m", 300.0, "5m"),
        ("2h", 7200.0, "2h"),
        ("1d", 86400.0, "1d"),
        ("1h30m", 5400.0, "1h30m"),
        ("1.5h", 5400.0, "1h30m"),
        ("1d2h3m4s", 93784.0, "1d2h3m4s"),
        ("600", 600.0, "10m"),
        (2.5, 2.5, "2.5s"),
        (1e-05, 1e-05, "0.00001s"),
    ],
)
def test_durations_parse_and_normalise(value: object, seconds: float, normal: str) -> None:
    assert parse_duration(value) == seconds
    assert format_duration(seconds) == normal


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            "10x",
            "invalid duration '10x': expected a number of seconds or a duration such as 30s, 5m, 2h, 1d, 1h30m",
        ),
        ("30m1h", "invalid duration '30m1h': use each unit once, largest first (like 1h30m)"),
        ("1m1m", "invalid duration '1m1m': use each unit once, largest first (like 1h30m)"),
        (True, "expected a number of seconds or a duration such as 30s, 5m, 2h, 1d, 1h30m; got a boolean"),
        (None, "expected a number of seconds or a duration such as 30s, 5m, 2h, 1d, 1h30m; got NoneType"),
        (math.inf, "expected a finite duration; got inf"),
        ("nan", "expected a finite duration; got 'nan'"),
    ],
)
def test_bad_durations_name_the_accepted_forms(value: object, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_duration(value)
    assert str(info.value) == message


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.integers(0, 10**9), st.floats(0, 1e9, allow_nan=False, allow_infinity=False)))
def test_format_duration_round_trips_exactly(seconds: float) -> None:
    assert parse_duration(format_duration(seconds)) == seconds


# --- valid documents ------------------------------------------------------------------------------------


def test_chat_prod_loads_with_every_section() -> None:
    p = load_policy(EXAMPLES / "chat-prod.yaml")
    assert (p.name, p.version, p.ref) == ("chat-prod", 7, "chat-prod@7")
    assert [r.name for r in p.rules] == ["long-context-greedy", "free-tier", "sampled"]
    assert dict(p.fields) == {"route": "str"}
    assert p.schema == STANDARD_SCHEMA.extend({"route": STANDARD_SCHEMA.fields["prompt"]})
    assert p.defaults.ttl == 300.0 and p.defaults.tiers == ("l1", "l2")
    assert list(p.tenants) == ["acme", "default"]
    assert (p.tenants["acme"].l1_share, p.tenants["acme"].weight) == (0.3, 2.0)
    assert p.eviction.per_tier() == {"l1": "s3fifo", "l2": "lru"}
    assert p.eviction.fallback == "lru"
    assert (p.slo.p99_ms, p.slo.max_error_rate) == (800.0, 0.01)
    assert p.guardrails.auto_approve is not None and p.guardrails.auto_approve.ttl_change == 0.2
    assert len(p.content_hash) == 64 and int(p.content_hash, 16) >= 0


def test_minimal_document_gets_every_default() -> None:
    p = load_policy(EXAMPLES / "minimal.yaml")
    assert policy_to_yaml(p) == textwrap.dedent(
        """\
        policy: minimal
        version: 1
        fields: {}
        defaults:
          cache: response
          ttl: 5m
          tiers: [l1]
          allow_sampling: false
          stream: true
        rules: []
        tenants: {}
        eviction:
          fallback: lru
        slo: {}
        guardrails: {}
        """
    )
    assert p.decide({}) == Decision(
        rule="default",
        cache=True,
        ttl=300.0,
        sliding=False,
        tiers=("l1",),
        max_entry_bytes=None,
        allow_sampling=False,
        stream=True,
        semantic=None,
        kv=None,
    )


def test_normalised_yaml_has_fixed_order_and_spelling() -> None:
    p = parse_policy(
        textwrap.dedent(
            """\
            version: 3
            tenants: {zeta: {weight: 2}, alpha: {l1_share: 0.25}}
            rules:
              - ttl: 5400
                when: temperature == 0
                name: greedy
                tiers: [l3, l1]
                kv: {reuse: prefix}
            policy: tidy
            defaults: {ttl: 90}
            """
        )
    )
    assert policy_to_yaml(p) == textwrap.dedent(
        """\
        policy: tidy
        version: 3
        fields: {}
        defaults:
          cache: response
          ttl: 1m30s
          tiers: [l1]
          allow_sampling: false
          stream: true
        rules:
          - name: greedy
            when: temperature == 0
            ttl: 1h30m
            tiers: [l1, l3]
            kv:
              reuse: prefix
        tenants:
          alpha:
            l1_share: 0.25
            l2_share: 1.0
            weight: 1.0
          zeta:
            l1_share: 1.0
            l2_share: 1.0
            weight: 2.0
        eviction:
          fallback: lru
        slo: {}
        guardrails: {}
        """
    )


def test_spelling_does_not_change_the_content_hash() -> None:
    a = parse_policy(
        "policy: p\nversion: 1\ndefaults: {ttl: 600, tiers: [l2, l1]}\ntenants: {b: {}, a: {}}\n"
    )
    b = parse_policy(
        "policy: p\nversion: 1\ndefaults: {ttl: 10m, tiers: [l1, l2]}\ntenants: {a: {}, b: {}}\n"
    )
    c = parse_policy(
        "policy: p\nversion: 2\ndefaults: {ttl: 10m, tiers: [l1, l2]}\ntenants: {a: {}, b: {}}\n"
    )
    assert a.content_hash == b.content_hash and a == b and hash(a) == hash(b)
    assert c.content_hash != a.content_hash and c != a


@pytest.mark.parametrize("name", ["chat-prod.yaml", "chat-prod-v8.yaml", "minimal.yaml"])
def test_normalised_document_parses_back_to_an_equal_policy(name: str) -> None:
    p = load_policy(EXAMPLES / name)
    again = parse_policy(policy_to_yaml(p))
    assert again == p
    assert policy_to_dict(again) == policy_to_dict(p)
    assert policy_to_yaml(again) == policy_to_yaml(p)


def test_policy_is_immutable() -> None:
    p = load_policy(EXAMPLES / "chat-prod.yaml")
    with pytest.raises(ValidationError):
        p.version = 8  # type: ignore[misc]
    with pytest.raises(TypeError):
        p.tenants["evil"] = p.tenants["acme"]  # type: ignore[index]
    with pytest.raises(ValidationError):
        p.rules[0].ttl = 1  # type: ignore[misc]


def test_model_validate_checks_expressions_and_names_too() -> None:
    data = {
        "policy": "direct",
        "version": 1,
        "rules": [{"name": "a", "when": "temperature == 0"}, {"name": "a", "when": "nope > 1"}],
    }
    with pytest.raises(ValidationError) as info:
        Policy.model_validate(data)
    errors = info.value.errors()
    assert [(e["loc"], e["type"]) for e in errors] == [
        (("rules", 1, "name"), "value_error"),
        (("rules", 1, "when"), "expression"),
    ]
    assert errors[0]["msg"] == "duplicate rule name 'a' (first used by rules[0])"
    ok = Policy.model_validate(
        {
            "policy": "direct",
            "version": 1,
            "fields": {"route": "str"},
            "rules": [{"name": "r", "when": 'route == "x"'}],
        }
    )
    assert ok.decide({"route": "x"}).rule == "r"


# --- decisions ------------------------------------------------------------------------------------------


def view(**fields: object) -> dict[str, object]:
    base: dict[str, object] = {
        "input_ids": [1] * 10,
        "prompt": "hi",
        "model": "m",
        "model_revision": "r",
        "temperature": 0.0,
        "top_k": 1,
        "top_p": 1.0,
        "max_tokens": 16,
        "seed": None,
        "stream": False,
        "tenant": {"id": "t1", "tier": "pro"},
        "route": "chat",
    }
    base.update(fields)
    return base


@pytest.fixture(scope="module")
def chat_prod() -> Policy:
    return load_policy(EXAMPLES / "chat-prod.yaml")


def test_first_matching_rule_decides_with_rule_values_over_defaults(chat_prod: Policy) -> None:
    assert chat_prod.decide(view(input_ids=[7] * 600, top_k=5)) == Decision(
        rule="long-context-greedy",
        cache=True,
        ttl=600.0,
        sliding=False,
        tiers=("l1", "l2", "l3"),
        max_entry_bytes=1048576,
        allow_sampling=False,
        stream=True,
        semantic=SemanticSpec(max_error=0.02, mode="bounded", explore=0.05),
        kv=KvSpec(
            reuse="prefix",
            rope_shift=False,
            tiers=("l1", "l2", "l3"),
            min_tokens=0,
            shared_prefixes=False,
            recompute_tokens=0,
            recompute_fraction=0.0,
        ),
    )
    # long and greedy AND free tier: the first rule wins
    assert chat_prod.decide(view(input_ids=[7] * 600, tenant={"id": "f", "tier": "free"})).rule == (
        "long-context-greedy"
    )
    assert chat_prod.decide(view(tenant={"id": "f", "tier": "free"}, temperature=0.7)) == Decision(
        rule="free-tier",
        cache=True,
        ttl=60.0,
        sliding=False,
        tiers=("l1", "l2"),
        max_entry_bytes=None,
        allow_sampling=False,
        stream=True,
        semantic=None,
        kv=None,
    )
    sampled = chat_prod.decide(view(temperature=0.7))
    assert (sampled.rule, sampled.cache, sampled.ttl) == ("sampled", False, 300.0)
    assert chat_prod.decide(view()) == Decision(
        rule="default",
        cache=True,
        ttl=300.0,
        sliding=False,
        tiers=("l1", "l2"),
        max_entry_bytes=None,
        allow_sampling=False,
        stream=True,
        semantic=None,
        kv=None,
    )


def test_a_rule_that_fails_to_evaluate_is_skipped_and_reported(chat_prod: Policy) -> None:
    # `len(input_ids)` on a string is a type mismatch at request time: the rule does not match, the next
    # rule that holds decides, and the failing rule is named.
    decision = chat_prod.decide(view(input_ids="not a list", tenant={"id": "f", "tier": "free"}))
    assert (decision.rule, decision.skipped) == ("free-tier", ("long-context-greedy",))
    fallthrough = chat_prod.decide(view(input_ids="not a list"))
    assert (fallthrough.rule, fallthrough.skipped) == ("default", ("long-context-greedy",))
    assert chat_prod.decide(view()).skipped == ()


def test_overrides_switch_semantic_and_kv_off() -> None:
    p = parse_policy(
        textwrap.dedent(
            """\
            policy: p
            version: 1
            defaults:
              {semantic: {max_error: 0.05}, kv: {reuse: prefix, rope_shift: true}, max_entry_bytes: 100}
            rules:
              - name: exact-only
                when: top_k == 1
                semantic: {max_error: 0}
                kv: {reuse: none}
                sliding: true
            """
        )
    )
    exact = p.decide(view(top_k=1))
    assert (exact.semantic, exact.kv, exact.sliding) == (None, None, True)
    assert exact.max_entry_bytes == 100
    other = p.decide(view(top_k=3))
    assert (other.semantic, other.kv, other.sliding) == (
        SemanticSpec(max_error=0.05, mode="bounded", explore=0.05),
        # `rope_shift: true` is the earlier spelling of chunk reuse, also beside `reuse: prefix`
        KvSpec(
            reuse="chunks",
            rope_shift=True,
            tiers=("l1",),
            min_tokens=0,
            shared_prefixes=False,
            recompute_tokens=16,
            recompute_fraction=0.0,
        ),
        False,
    )


# --- broken documents: one per kind of error, exact positions -------------------------------------------

BROKEN_EXPECTED = {
    "yaml-syntax.yaml": [
        (
            5,
            1,
            "",
            "YAML syntax: expected ',' or '}', but got '<scalar>' (while parsing a flow mapping "
            "started at line 4, column 11)",
        ),
    ],
    "unknown-field.yaml": [
        (
            6,
            5,
            "rules[0].tll",
            "unknown field 'tll'; known fields: name, when, cache, ttl, sliding, tiers, "
            "max_entry_bytes, allow_sampling, stream, semantic, kv, slo, client_controls",
        ),
    ],
    "unknown-name.yaml": [
        (
            5,
            32,
            "rules[0].when",
            f"unknown name 'tenant_tier'; did you mean 'tenant'? (known fields: {KNOWN})",
        ),
    ],
    "expression-syntax.yaml": [
        (5, 44, "rules[0].when", "expected ')' to close '(', found end of expression"),
    ],
    "bad-ttl.yaml": [
        (
            7,
            10,
            "rules[0].ttl",
            "invalid duration '10 minutes': expected a number of seconds or a duration "
            "such as 30s, 5m, 2h, 1d, 1h30m",
        ),
    ],
    "duplicate-rule.yaml": [
        (6, 11, "rules[1].name", "duplicate rule name 'greedy' (first used by rules[0])")
    ],
    "wrong-type.yaml": [(6, 22, "rules[0].max_entry_bytes", "expected an integer; got str 'one megabyte'")],
    "unknown-tier.yaml": [(3, 24, "defaults.tiers[1]", "unknown tier 'l4'; known tiers: l1, l2, l3")],
}


@pytest.mark.parametrize("name", sorted(BROKEN_EXPECTED))
def test_each_broken_example_fails_at_the_exact_spot(name: str) -> None:
    path = BROKEN / name
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    assert {i.file for i in info.value.issues} == {str(path)}
    assert brief(info.value.issues) == BROKEN_EXPECTED[name]


def test_every_broken_example_is_covered() -> None:
    assert sorted(p.name for p in BROKEN.glob("*.yaml")) == sorted(BROKEN_EXPECTED)


def test_expression_issue_keeps_the_caret() -> None:
    with pytest.raises(PolicyError) as info:
        load_policy(BROKEN / "unknown-name.yaml")
    message = info.value.issues[0].message
    assert message.splitlines()[1:] == [
        '  temperature == 0 and tenant_tier == "pro"',
        "                       ^",
    ]
    assert str(info.value).startswith(f"{BROKEN / 'unknown-name.yaml'}:5:32: rules[0].when: ")


def test_all_issues_are_collected_in_document_order() -> None:
    issues = issues_of(
        """\
        policy: many
        version: "7"
        fields: {route: strr, temperature: int}
        defaults: {ttl: 0, cache: resp, sliding: true}
        rules:
          - name: a
            when: nope == 1
            max_entry_bytes: -3
          - name: a
            when: route == "x"
          - {when: top_k == 1}
          - name: default
            when: top_k == 2
        tenants: {acme: {l1_share: 1.5, weight: 0}}
        eviction: {l1: s3-fifo}
        slo: {max_error_rate: "low"}
        """
    )
    assert brief(issues) == [
        (2, 10, "version", "expected an integer; got str '7'"),
        (
            3,
            17,
            "fields.route",
            "unknown type 'strr'; known types: int, float, number, str, bool, list, "
            "list[int], list[str], any",
        ),
        (3, 23, "fields.temperature", "'temperature' is a standard request field; declare only extra fields"),
        (4, 17, "defaults.ttl", "a ttl must be positive; got 0"),
        (4, 27, "defaults.cache", "must be 'response' or 'bypass'; got str 'resp'"),
        (
            4,
            33,
            "defaults.sliding",
            "unknown field 'sliding'; known fields: cache, ttl, tiers, max_entry_bytes, "
            "allow_sampling, stream, semantic, kv, client_controls",
        ),
        (7, 11, "rules[0].when", UNKNOWN_NOPE.replace("prompt, ", "prompt, route, ")),
        (8, 22, "rules[0].max_entry_bytes", "must be greater than 0; got int -3"),
        (9, 11, "rules[1].name", "duplicate rule name 'a' (first used by rules[0])"),
        (11, 5, "rules[2].name", "required field is missing"),
        (12, 11, "rules[3].name", "'default' is reserved: it names the defaults in decisions"),
        (14, 28, "tenants.acme.l1_share", "must be less than or equal to 1; got float 1.5"),
        (14, 41, "tenants.acme.weight", "must be greater than 0; got int 0"),
        (15, 16, "eviction.l1", "invalid name 's3-fifo': expected an identifier such as lru or s3fifo"),
        (16, 23, "slo.max_error_rate", "expected a number; got str 'low'"),
    ]


@pytest.mark.parametrize(
    ("when", "line", "column"),
    [
        # plain scalar on the key's line: exact
        ("when: top_k == 1 and nope", 6, 26),
        # single-quoted: the quote shifts by one, '' is one character of the value
        ("when: 'prompt == ''it'' and nope'", 6, 33),
        # double-quoted with an escape before the error: the escape is 6 characters in the file, 1 in value
        ('when: "prompt == \\"\\u00e9\\" and nope"', 6, 37),
        # folded block: second line of the file text
        ("when: >\n      top_k == 1 and\n      nope > 2", 8, 7),
        # literal block, expression line 2
        ("when: |\n      top_k == 1\n      and nope > 2", 8, 11),
        # plain scalar folded over two lines
        ("when: top_k == 1\n      and nope > 2", 7, 11),
    ],
)
def test_expression_errors_point_inside_the_file(when: str, line: int, column: int) -> None:
    text = f"policy: p\nversion: 1\nrules:\n  - name: r\n\n    {when}\n"
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "w.yaml")
    [issue] = info.value.issues
    assert (issue.line, issue.column, issue.field) == (line, column, "rules[0].when")
    assert issue.message.splitlines()[0] == UNKNOWN_NOPE
    # the file really has the offending name at that spot
    assert text.splitlines()[line - 1][column - 1 :].startswith("nope")


# --- YAML-level problems --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "policy: a\npolicy: b\nversion: 1\n",
            [(2, 1, "policy", "duplicate key 'policy' (first set on line 1)")],
        ),
        (
            "",
            [
                (
                    None,
                    None,
                    "",
                    "a policy document is a mapping with `policy` and `version`; got an empty document",
                )
            ],
        ),
        (
            "- a\n- b\n",
            [(1, 1, "", "a policy document is a mapping with `policy` and `version`; got a list")],
        ),
        (
            "policy: a\n---\npolicy: b\n",
            [(2, 1, "", "YAML syntax: expected a single YAML document, found more than one")],
        ),
        (
            "policy: a\nversion: 1\nyes: 2\n",
            [(3, 1, "", "mapping keys must be strings; 'yes' reads as bool (quote it)")],
        ),
        ("policy: a\n[x]: 1\n", [(2, 1, "", "mapping keys must be plain strings, not lists or mappings")]),
        ("a: &x [1, *x]\n", [(1, 4, "a[1]", "recursive alias: a value may not contain itself")]),
        (
            "policy: p\nversion: 1\ndefaults: {ttl: 2001-13-45}\n",
            [(3, 17, "defaults.ttl", "cannot read '2001-13-45' as !!timestamp: month must be in 1..12")],
        ),
        (
            "policy: p\nversion: !!set {a, b}\n",
            [(2, 10, "version", "tag !!set is not allowed: use a plain mapping")],
        ),
        (
            "policy: p\nversion: !local 1\n",
            [(2, 10, "version", "tag !local is not allowed: policies are plain YAML")],
        ),
        ("policy: \x07\n", [(1, 9, "", "character '\\x07' is not allowed in a YAML document")]),
    ],
)
def test_yaml_problems_are_policy_issues(text: str, expected: list[tuple]) -> None:
    assert brief(issues_of(text)) == expected


@pytest.mark.parametrize(
    "text",
    [
        "policy: !!python/object:os.system {}\nversion: 1\n",
        "policy: !!python/object/apply:os.system ['echo pwned']\nversion: 1\n",
        "policy: !!python/name:os.system\nversion: 1\n",
        "policy: x\nversion: 1\nrules: [!!python/object/new:builtins.dict {}]\n",
    ],
)
def test_python_tags_are_rejected(text: str) -> None:
    issues = issues_of(text)
    assert len(issues) == 1
    assert "!!python/" in issues[0].message and "is not allowed" in issues[0].message


def test_merge_keys_fill_in_and_explicit_keys_win() -> None:
    p = parse_policy(
        textwrap.dedent(
            """\
            policy: merged
            version: 1
            rules:
              - &greedy {name: greedy, when: top_k == 1, ttl: 10m, tiers: [l2]}
              - {<<: *greedy, name: also, ttl: 20m}
            """
        )
    )
    assert [(r.name, r.ttl, r.tiers) for r in p.rules] == [
        ("greedy", 600.0, ("l2",)),
        ("also", 1200.0, ("l2",)),
    ]


def test_ttl_and_version_are_bounded_with_their_position() -> None:
    ok = parse_policy("policy: p\nversion: 2147483647\ndefaults: {ttl: 3650d}\n")
    assert (ok.version, ok.defaults.ttl) == (2**31 - 1, 3650 * 86_400.0)
    # Redis fails every write whose expiry is past its range; 10 years is the documented maximum.
    issues = issues_of(
        """\
        policy: p
        version: 2147483648
        defaults: {ttl: 3651d}
        rules:
          - {name: r, when: 'true', ttl: 1e300}
        """
    )
    assert [str(i) for i in issues] == [
        "p.yaml:2:10: version: must be less than or equal to 2147483647; got int 2147483648",
        "p.yaml:3:17: defaults.ttl: a ttl may be at most 3650d (10 years); got '3651d'",
        "p.yaml:5:34: rules[0].ttl: a ttl may be at most 3650d (10 years); got '1e300'",
    ]


def test_alias_bomb_and_deep_nesting_fail_cleanly() -> None:
    bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(6)
    )
    [issue] = issues_of(bomb)
    assert issue.message == "document has more than 50000 values (an alias bomb?)"
    # The issue points at the bracket that opens the 65th level, however deep the document goes on.
    for depth in (65, 70, 5000):
        [deep] = issues_of("a: " + "[" * depth + "]" * depth)
        assert (deep.line, deep.column, deep.message) == (1, 68, "document is nested more than 64 levels deep")
    [block] = issues_of("".join("  " * i + f"k{i}:\n" for i in range(100)))
    assert (block.line, block.column, block.message) == (65, 129, "document is nested more than 64 levels deep")
    # Through an alias the text is shallow: the builder finds the depth on the path it builds.
    [alias] = issues_of("a: &x " + "[" * 60 + "]" * 60 + "\nb: " + "[" * 10 + "*x" + "]" * 10 + "\n")
    assert (alias.line, alias.column, alias.field) == (1, 61, "b" + "[0]" * 64)  # x's 55th bracket
    assert alias.message == "document is nested more than 64 levels deep"


def test_load_policy_file_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_policy(tmp_path / "missing.yaml")
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"policy: caf\xe9\nversion: 1\n")
    with pytest.raises(PolicyError) as info:
        load_policy(latin)
    [issue] = info.value.issues
    assert (issue.file, issue.line, issue.column, issue.field) == (str(latin), 1, 12, "")
    assert issue.message == "not UTF-8 text: byte 0xe9 cannot be decoded (invalid continuation byte)"
    # The column counts characters: the two-byte 'é' before the bad byte is one column.
    later = tmp_path / "later.yaml"
    later.write_bytes(b"policy: p\nversion: 1\n# caf\xc3\xa9 \xff\n")
    with pytest.raises(PolicyError) as info:
        load_policy(later)
    assert str(info.value) == f"{later}:3:8: <document>: not UTF-8 text: byte 0xff cannot be decoded (invalid start byte)"


def test_parse_policy_wants_text() -> None:
    with pytest.raises(TypeError):
        parse_policy(b"policy: p\nversion: 1\n")  # type: ignore[arg-type]


# --- nothing but PolicyError, whatever the input --------------------------------------------------------

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.sampled_from(
        ["5m", "1h30m", "l1", "l4", "response", "bypass", "temperature > 0", "len(", "@@", "str"]
    ),
)
_keys = st.one_of(
    st.text(max_size=10),
    st.sampled_from(
        [
            "policy",
            "version",
            "fields",
            "defaults",
            "rules",
            "tenants",
            "eviction",
            "slo",
            "guardrails",
            "name",
            "when",
            "ttl",
            "tiers",
            "cache",
            "semantic",
            "kv",
            "max_error",
        ]
    ),
)
_documents = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_keys, inner, max_size=5)),
    max_leaves=25,
)


def _parse_only_policy_errors(text: str) -> None:
    try:
        policy = parse_policy(text)
    except PolicyError as exc:
        assert exc.issues and all(isinstance(i, PolicyIssue) for i in exc.issues)
    else:
        assert isinstance(policy, Policy)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_documents)
def test_random_yaml_documents_raise_only_policy_error(document: object) -> None:
    _parse_only_policy_errors(yaml.safe_dump(document))


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_random_text_raises_only_policy_error(text: str) -> None:
    _parse_only_policy_errors(text)


_rule = st.fixed_dictionaries(
    {
        "name": st.one_of(st.text(max_size=8), st.sampled_from(["a", "b", "default"])),
        "when": st.one_of(
            st.text(max_size=30), st.sampled_from(["top_k == 1", "len(prompt) > 3", "route == 1"])
        ),
    },
    optional={
        "ttl": _scalars,
        "tiers": st.lists(_scalars, max_size=3),
        "cache": _scalars,
        "semantic": st.dictionaries(_keys, _scalars, max_size=2),
        "max_entry_bytes": _scalars,
    },
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.fixed_dictionaries(
        {"policy": _scalars, "version": _scalars, "rules": st.lists(_rule, max_size=4)},
        optional={"fields": st.dictionaries(_keys, _scalars, max_size=3), "defaults": _documents},
    )
)
def test_policy_shaped_documents_raise_only_policy_error(document: dict[str, object]) -> None:
    _parse_only_policy_errors(yaml.safe_dump(document))


def test_policy_pickles_and_copies_as_an_equal_working_policy() -> None:
    import copy
    import pickle

    p = load_policy(EXAMPLES / "chat-prod.yaml")
    q = pickle.loads(pickle.dumps(p))
    assert q == p and q is not p
    assert q.decide(view(temperature=0.7)).rule == "sampled"
    assert dict(q.tenants) == dict(p.tenants) and q.schema == p.schema
    assert copy.deepcopy(p) is p and copy.copy(p) is p


def test_a_yaml_boolean_condition_is_the_expression_true_or_false() -> None:
    p = parse_policy(
        "policy: p\nversion: 1\nrules:\n"
        "  - {name: never, when: false, ttl: 1m}\n"
        "  - {name: all, when: true, ttl: 1h}\n"
    )
    assert [r.when for r in p.rules] == ["false", "true"]
    assert (p.decide(view()).rule, p.decide(view()).ttl) == ("all", 3600.0)
    assert parse_policy(policy_to_yaml(p)) == p


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_policy_is_valid(path: Path) -> None:
    policy = load_policy(path)
    assert parse_policy(policy_to_yaml(policy)) == policy


def test_a_tenant_without_an_entry_gets_the_default_entry_and_none_without_one() -> None:
    from evocache.dsl import parse_policy

    policy = parse_policy(
        "policy: p\nversion: 1\ntenants:\n  default: {l1_share: 0.5}\n  batch: {l1_share: 0.1}\n", "p.yaml"
    )
    assert policy.tenant("batch").l1_share == 0.1
    assert policy.tenant("acme") is policy.tenants["default"]
    assert policy.tenant(None) is policy.tenants["default"]
    bare = parse_policy("policy: p\nversion: 1\ntenants:\n  batch: {l1_share: 0.1}\n", "p.yaml")
    assert bare.tenant("acme") is None and bare.tenant("batch").l1_share == 0.1
