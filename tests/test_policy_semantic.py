"""The rule field `semantic`: validation with positions, resolved decisions, diffs."""

from __future__ import annotations

import textwrap

import pytest
from evocache.dsl import Change, PolicyError, SemanticSpec, diff_policies, parse_policy, policy_to_yaml

VIEW = {"tenant": {"id": "t"}}


def _policy(semantic: str, *, version: int = 1) -> str:
    return textwrap.dedent(
        f"""\
        policy: p
        version: {version}
        rules:
          - name: r
            when: top_k == 1
            semantic: {semantic}
        """
    )


def _issues(text: str) -> list[tuple[int | None, int | None, str, str]]:
    with pytest.raises(PolicyError) as caught:
        parse_policy(text, "p.yaml")
    return [(i.line, i.column, i.field, i.message) for i in caught.value.issues]


def test_bare_max_error_resolves_to_bounded_with_default_exploration() -> None:
    decision = parse_policy(_policy("{max_error: 0.02}")).decide({"top_k": 1, **VIEW})
    assert decision.semantic == SemanticSpec(max_error=0.02, mode="bounded", explore=0.05, threshold=None)


def test_static_mode_and_explicit_exploration_resolve() -> None:
    policy = parse_policy(_policy("{max_error: 0.05, mode: static, threshold: 0.88}"))
    static = policy.decide({"top_k": 1, **VIEW})
    assert static.semantic == SemanticSpec(max_error=0.05, mode="static", explore=0.05, threshold=0.88)
    explore = parse_policy(_policy("{max_error: 0.01, explore: 0.2}")).decide({"top_k": 1, **VIEW})
    assert explore.semantic == SemanticSpec(max_error=0.01, mode="bounded", explore=0.2)


def test_max_error_zero_switches_semantic_off() -> None:
    decision = parse_policy(_policy("{max_error: 0, mode: static, threshold: 0.9}")).decide({"top_k": 1, **VIEW})
    assert decision.semantic is None


@pytest.mark.parametrize(
    ("semantic", "expected"),
    [
        ("{max_error: 0.7}", [(6, 27, "rules[0].semantic.max_error",
                               "must be less than or equal to 0.5; got float 0.7")]),
        ("{max_error: -0.1}", [(6, 27, "rules[0].semantic.max_error",
                                "must be greater than or equal to 0; got float -0.1")]),
        ("{max_error: '2%'}", [(6, 27, "rules[0].semantic.max_error", "expected a number; got str '2%'")]),
        ("{max_error: 0.02, mode: fuzzy}", [(6, 39, "rules[0].semantic.mode",
                                             "must be 'bounded' or 'static'; got str 'fuzzy'")]),
        ("{max_error: 0.02, explore: 0.9}", [(6, 42, "rules[0].semantic.explore",
                                              "must be less than or equal to 0.5; got float 0.9")]),
        ("{max_error: 0.02, threshold: 0.9}", [(6, 44, "rules[0].semantic.threshold",
                                                "threshold applies only to mode: static "
                                                "(mode: bounded learns its own cut-off)")]),
        ("{max_error: 0.02, mode: static}", [(6, 15, "rules[0].semantic",
                                              "mode: static needs a threshold (a cosine similarity in (0, 1])")]),
        ("{max_error: 0.02, mode: static, threshold: 1.5}", [(6, 58, "rules[0].semantic.threshold",
                                                              "must be less than or equal to 1; got float 1.5")]),
        ("{max_error: 0.02, explroe: 0.1}", [(6, 33, "rules[0].semantic.explroe",
                                              "unknown field 'explroe'; known fields: max_error, mode, explore, "
                                              "threshold")]),
        ("{mode: bounded}", [(6, 15, "rules[0].semantic.max_error", "required field is missing")]),
    ],
)
def test_invalid_semantic_fields_are_reported_with_line_column_and_path(
    semantic: str, expected: list[tuple[int, int, str, str]]
) -> None:
    assert _issues(_policy(semantic)) == [(line, col, path, msg) for line, col, path, msg in expected]


def test_several_semantic_errors_are_reported_together_in_document_order() -> None:
    text = textwrap.dedent(
        """\
        policy: p
        version: 1
        defaults:
          semantic: {max_error: 0.6}
        rules:
          - name: r
            when: top_k == 1
            semantic:
              max_error: 0.02
              mode: static
          - name: s
            when: top_k == 2
            semantic: {max_error: 0.02, explore: true}
        """
    )
    assert _issues(text) == [
        (4, 25, "defaults.semantic.max_error", "must be less than or equal to 0.5; got float 0.6"),
        (9, 7, "rules[0].semantic", "mode: static needs a threshold (a cosine similarity in (0, 1])"),
        (13, 42, "rules[1].semantic.explore", "expected a number; got bool True"),
    ]


def test_normalised_document_shows_only_what_was_written_and_round_trips() -> None:
    policy = parse_policy(_policy("{max_error: 0.02, mode: static, threshold: 0.9}"))
    text = policy_to_yaml(policy)
    assert "    semantic:\n      max_error: 0.02\n      mode: static\n      threshold: 0.9\n" in text
    assert parse_policy(text) == policy
    assert "semantic:\n      max_error: 0.02\n    " not in policy_to_yaml(parse_policy(_policy("{max_error: 0.02}")))


def test_policy_diff_names_each_semantic_setting() -> None:
    old = parse_policy(_policy("{max_error: 0.02}"))
    new = parse_policy(_policy("{max_error: 0.01, explore: 0.1}", version=2))
    assert diff_policies(old, new).changes == (
        Change("changed", "version", 1, 2),
        Change("changed", "rules[r].semantic.max_error", 0.02, 0.01),
        Change("added", "rules[r].semantic.explore", None, 0.1),
    )
    static = parse_policy(_policy("{max_error: 0.01, mode: static, threshold: 0.9}", version=3))
    assert diff_policies(new, static).changes == (
        Change("changed", "version", 2, 3),
        Change("added", "rules[r].semantic.mode", None, "static"),
        Change("removed", "rules[r].semantic.explore", 0.1, None),
        Change("added", "rules[r].semantic.threshold", None, 0.9),
    )
