"""The policy language's per-rule service objectives (``slo``) and tenant request rates (``rate``, ``burst``):
defaults that keep older documents valid, a rule's slo over the policy's field by field, and errors that name
the field, with line and column, for every value out of bounds."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from evocache.dsl import PolicyError, SloSpec, parse_policy, policy_to_dict, policy_to_yaml

HEAD = "policy: p\nversion: 1\n"


def _issue(text: str) -> tuple[int | None, int | None, str, str]:
    with pytest.raises(PolicyError) as info:
        parse_policy(HEAD + text)
    issues = info.value.issues
    assert len(issues) == 1, issues
    return issues[0].line, issues[0].column, issues[0].field, issues[0].message


def test_a_document_without_the_new_fields_loads_as_before() -> None:
    p = parse_policy(HEAD + "slo: {p99_ms: 800, max_error_rate: 0.01}\ntenants: {acme: {weight: 2}}\n")
    assert policy_to_dict(p)["slo"] == {"p99_ms": 800.0, "max_error_rate": 0.01}  # nothing filled in
    assert policy_to_dict(p)["tenants"]["acme"] == {"l1_share": 1.0, "l2_share": 1.0, "weight": 2.0}
    assert p.tenants["acme"].rate is None and p.tenants["acme"].burst is None
    assert dict(parse_policy(HEAD).slos) == {}  # no objective: nothing to enforce


def test_the_policy_slo_applies_to_every_rule_resolved_with_the_defaults() -> None:
    p = parse_policy(
        HEAD + "rules:\n  - {name: a, when: 'top_k == 1'}\n  - {name: b, when: 'true'}\n"
        "slo: {max_error_rate: 0.05}\n"
    )
    expected = SloSpec(
        max_error_rate=0.05, window=60.0, min_samples=20, cool_down=30.0, trip_to="semantic-off", probe=0.1,
        rule_wide_tenants=3,
    )
    assert dict(p.slos) == {"default": expected, "a": expected, "b": expected}


def test_a_rules_own_slo_overrides_the_policys_field_by_field() -> None:
    p = parse_policy(
        HEAD
        + "rules:\n"
        "  - name: strict\n    when: 'top_k == 1'\n"
        "    slo: {max_error_rate: 0.01, trip_to: bypass, cool_down: 2m}\n"
        "  - {name: plain, when: 'true'}\n"
        "slo: {p99_ms: 250, max_error_rate: 0.1, window: 5m, min_samples: 50}\n"
    )
    strict, plain = p.slos["strict"], p.slos["plain"]
    assert (strict.p99_ms, strict.max_error_rate) == (250.0, 0.01)
    assert (strict.window, strict.min_samples) == (300.0, 50)
    assert (strict.trip_to, strict.cool_down) == ("bypass", 120.0)
    assert (plain.max_error_rate, plain.trip_to, plain.cool_down) == (0.1, "semantic-off", 30.0)
    assert strict.rule_wide_tenants == plain.rule_wide_tenants == 3
    # The normalised document keeps what was written, where it was written.
    written = {"max_error_rate": 0.01, "cool_down": "2m", "trip_to": "bypass"}
    assert policy_to_dict(p)["rules"][0]["slo"] == written
    assert parse_policy(policy_to_yaml(p)) == p


def test_a_rule_may_set_an_objective_the_policy_does_not() -> None:
    p = parse_policy(
        HEAD + "rules:\n  - {name: slow, when: 'true', slo: {p99_ms: 40}}\n  - {name: x, when: 'false'}\n"
    )
    assert set(p.slos) == {"slow"} and p.slos["slow"].p99_ms == 40.0


def test_rule_wide_tenants_is_written_like_any_slo_field_and_a_rule_overrides_it() -> None:
    p = parse_policy(
        HEAD + "rules:\n  - {name: shared, when: 'true', slo: {rule_wide_tenants: 5}}\n"
        "slo: {max_error_rate: 0.1, rule_wide_tenants: 2}\n"
    )
    assert (p.slos["shared"].rule_wide_tenants, p.slos["default"].rule_wide_tenants) == (5, 2)
    assert policy_to_dict(p)["rules"][0]["slo"] == {"rule_wide_tenants": 5}
    assert parse_policy(policy_to_yaml(p)) == p


def test_durations_take_every_spelling_and_normalise() -> None:
    p = parse_policy(HEAD + "slo: {p99_ms: 1, window: 90, cool_down: '1m30s'}\n")
    assert (p.slo.window, p.slo.cool_down) == (90.0, 90.0)
    assert policy_to_dict(p)["slo"]["window"] == "1m30s"


@pytest.mark.parametrize(
    ("text", "column", "path", "message"),
    [
        ("slo: {window: 0}", 15, "slo.window", "must be a positive duration; got 0"),
        ("slo: {window: 2d}", 15, "slo.window", "may be at most 1d; got '2d'"),
        ("slo: {window: soon}", 15, "slo.window", "invalid duration 'soon'"),
        ("slo: {cool_down: 0s}", 18, "slo.cool_down", "must be a positive duration; got '0s'"),
        ("slo: {min_samples: 0}", 20, "slo.min_samples", "must be greater than or equal to 1"),
        ("slo: {min_samples: 2.5}", 20, "slo.min_samples", "expected an integer; got float 2.5"),
        ("slo: {trip_to: degrade}", 16, "slo.trip_to", "must be 'semantic-off' or 'bypass'; got str"),
        ("slo: {probe: 0}", 14, "slo.probe", "must be greater than 0; got int 0"),
        ("slo: {probe: 1.5}", 14, "slo.probe", "must be less than or equal to 1; got float 1.5"),
        ("slo: {rule_wide_tenants: 0}", 26, "slo.rule_wide_tenants", "must be greater than or equal to 1"),
        ("slo: {rule_wide_tenants: 1001}", 26, "slo.rule_wide_tenants", "must be less than or equal to 1000"),
        ("slo: {rule_wide_tenants: 2.5}", 26, "slo.rule_wide_tenants", "expected an integer; got float 2.5"),
        ("slo: {p99_ms: .inf}", 15, "slo.p99_ms", "must be a finite number"),
        ("slo: {max_error_rate: 2}", 23, "slo.max_error_rate", "must be less than or equal to 1"),
        ("slo: {p95_ms: 10}", 7, "slo.p95_ms", "unknown field 'p95_ms'; known fields: p99_ms"),
        ("tenants: {a: {rate: 0}}", 21, "tenants.a.rate", "must be greater than 0; got int 0"),
        ("tenants: {a: {rate: -5}}", 21, "tenants.a.rate", "must be greater than 0; got int -5"),
        ("tenants: {a: {rate: fast}}", 21, "tenants.a.rate", "expected a number; got str 'fast'"),
        ("tenants: {a: {rate: .inf}}", 21, "tenants.a.rate", "must be a finite number"),
        ("tenants: {a: {rate: 5, burst: 0.5}}", 31, "tenants.a.burst", "must be greater than or equal to 1"),
        ("tenants: {a: {burst: 5}}", 22, "tenants.a.burst", "burst needs a rate"),
        ("tenants: {a: {max_prompt_tokens: 0}}", 34, "tenants.a.max_prompt_tokens",
         "must be greater than or equal to 1; got int 0"),
        ("tenants: {a: {max_prompt_tokens: 2.5}}", 34, "tenants.a.max_prompt_tokens",
         "expected an integer; got float 2.5"),
        ("tenants: {a: {max_prompt_tokens: '100'}}", 34, "tenants.a.max_prompt_tokens",
         "expected an integer; got str '100'"),
        ("tenants: {a: {max_prompt_tokens: true}}", 34, "tenants.a.max_prompt_tokens",
         "expected an integer; got bool True"),
    ],
)
def test_out_of_bounds_values_are_reported_at_their_field(
    text: str, column: int, path: str, message: str
) -> None:
    line, col, where, said = _issue(text + "\n")
    assert (line, col, where) == (3, column, path)
    assert said.startswith(message), said


def test_a_rules_slo_is_checked_at_its_own_path() -> None:
    line, column, path, message = _issue(
        "rules:\n  - name: r\n    when: 'true'\n    slo: {trip_to: off, window: 1m}\n"
    )
    assert (line, column, path) == (6, 20, "rules[0].slo.trip_to")
    assert message == "must be 'semantic-off' or 'bypass'; got bool False"


def test_an_invalid_rate_alone_is_reported_not_the_burst_that_depends_on_it() -> None:
    line, column, path, _ = _issue("tenants: {a: {rate: x, burst: 2}}\n")
    assert (line, column, path) == (3, 21, "tenants.a.rate")


def test_a_tenant_rate_fills_in_its_burst() -> None:
    p = parse_policy(
        HEAD + "tenants:\n  busy: {rate: 50}\n  slow: {rate: 0.2}\n  spiky: {rate: 5, burst: 40}\n"
    )
    assert (p.tenants["busy"].rate, p.tenants["busy"].burst) == (50.0, 50.0)
    assert p.tenants["slow"].burst == 1.0  # at least one request can always pass
    assert p.tenants["spiky"].burst == 40.0
    assert policy_to_dict(p)["tenants"]["slow"] == {
        "l1_share": 1.0, "l2_share": 1.0, "weight": 1.0, "rate": 0.2, "burst": 1.0,
    }
    assert parse_policy(policy_to_yaml(p)) == p


def test_a_tenant_prompt_bound_is_its_own_else_the_default_entrys() -> None:
    p = parse_policy(
        HEAD + "tenants:\n  default: {max_prompt_tokens: 4096}\n  acme: {max_prompt_tokens: 32000}\n"
        "  free: {rate: 2}\n"
    )
    assert p.tenant("acme").max_prompt_tokens == 32000
    assert p.tenant("initech").max_prompt_tokens == 4096  # no entry of its own: the default entry's
    assert p.tenant(None).max_prompt_tokens == 4096
    assert p.tenant("free").max_prompt_tokens is None  # an entry of its own replaces the default whole
    assert policy_to_dict(p)["tenants"]["acme"] == {
        "l1_share": 1.0, "l2_share": 1.0, "weight": 1.0, "max_prompt_tokens": 32000,
    }
    assert "max_prompt_tokens" not in policy_to_dict(p)["tenants"]["free"]
    assert parse_policy(policy_to_yaml(p)) == p
    assert parse_policy(HEAD + "tenants: {acme: {weight: 2}}\n").tenant("acme").max_prompt_tokens is None


def test_policy_check_reports_the_new_fields(tmp_path) -> None:
    from evocache.cli.app import app

    good = tmp_path / "good.yaml"
    good.write_text(HEAD + "rules:\n  - {name: r, when: 'true', slo: {p99_ms: 20, trip_to: bypass}}\n"
                    "tenants: {a: {rate: 10}}\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        HEAD + "rules:\n  - {name: r, when: 'true', slo: {min_samples: -1}}\ntenants: {a: {burst: 3}}\n"
    )
    bounds = tmp_path / "bounds.yaml"
    bounds.write_text(HEAD + "tenants:\n  default: {max_prompt_tokens: 0}\n")
    runner = CliRunner()
    ok = runner.invoke(app, ["policy", "check", str(good)])
    assert ok.exit_code == 0 and ok.output.startswith("ok p@1 ")
    failed = runner.invoke(app, ["policy", "check", str(bad)])
    assert failed.exit_code == 1
    said = failed.output
    assert f"{bad}:4:48: rules[0].slo.min_samples: must be greater than or equal to 1; got int -1" in said
    assert f"{bad}:5:22: tenants.a.burst: burst needs a rate" in said
    refused = runner.invoke(app, ["policy", "check", str(bounds)])
    assert refused.exit_code == 1
    assert (f"{bounds}:4:32: tenants.default.max_prompt_tokens: must be greater than or equal to 1; got int 0"
            in refused.output)
