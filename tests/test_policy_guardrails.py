"""The guardrails a policy gives the policy loop, and the rule lookup replay uses."""

from __future__ import annotations

import pytest

from evocache.dsl import PolicyError, parse_policy

DOC = """\
policy: p
version: 1
defaults: {ttl: 10m}
rules:
  - name: faq
    when: true
    ttl: 1h
guardrails:
  auto_approve: {ttl_change: 0.2, bypass: true, semantic_error_change: 0.01, min_gain: 0.005}
  canary: {fraction: 0.1, windows: 2, max_windows: 3}
  max_semantic_error: 0.05
  ttl_min: 1m
  ttl_max: 1d
  confidence_alpha: 2
"""


def test_guardrails_are_read() -> None:
    g = parse_policy(DOC).guardrails
    assert g.auto_approve is not None
    assert (g.auto_approve.ttl_change, g.auto_approve.bypass, g.auto_approve.eviction) == (0.2, True, False)
    assert (g.auto_approve.semantic_error_change, g.auto_approve.min_gain) == (0.01, 0.005)
    assert (g.rollout.fraction, g.rollout.windows, g.rollout.max_windows) == (0.1, 2, 3)
    assert (g.max_semantic_error, g.ttl_min, g.ttl_max, g.alpha) == (0.05, 60.0, 86400.0, 2.0)


def test_unset_guardrails_have_defaults_and_do_not_change_the_document() -> None:
    p = parse_policy("policy: p\nversion: 1\n")
    assert p.guardrails.canary is None and p.guardrails.rollout.fraction == 0.2 and p.guardrails.alpha == 1.0
    assert p.guardrails.auto_approve is None


@pytest.mark.parametrize(
    ("fragment", "message"),
    [
        ("canary: {windows: 5, max_windows: 2}", "max_windows (2) must be >= windows (5)"),
        ("ttl_min: 1h\n  ttl_max: 1m", "ttl_min (3600 s) must not exceed ttl_max (60 s)"),
        ("canary: {fraction: 0}", "guardrails.canary.fraction"),
        ("max_semantic_error: 0.9", "guardrails.max_semantic_error"),
    ],
)
def test_bad_guardrails_are_refused_with_their_place(fragment: str, message: str) -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy(f"policy: p\nversion: 1\nguardrails:\n  {fragment}\n")
    assert message in str(info.value)


def test_decision_for_names_a_rule_or_gives_the_defaults() -> None:
    p = parse_policy(DOC)
    assert (p.decision_for("faq").rule, p.decision_for("faq").ttl) == ("faq", 3600.0)
    assert (p.decision_for("nope").rule, p.decision_for("nope").ttl) == ("default", 600.0)
