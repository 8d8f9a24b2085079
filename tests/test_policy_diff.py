"""Policy diffs: exact unified text and exact structured changes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from evocache.dsl import Change, PolicyDiff, diff_policies, load_policy, parse_policy

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "policies"

SMALL_OLD = "policy: small\nversion: 1\nrules:\n  - {name: greedy, when: top_k == 1, ttl: 10m}\n"
SMALL_NEW = (
    "policy: small\nversion: 2\nrules:\n  - {name: greedy, when: top_k == 1, ttl: 15m}\n"
    "  - {name: sampled, when: temperature > 0, cache: bypass}\n"
)

SMALL_DIFF = """\
--- a/small@1
+++ b/small@2
@@ -1,5 +1,5 @@
 policy: small
-version: 1
+version: 2
 fields: {}
 defaults:
   cache: response
@@ -10,7 +10,10 @@
 rules:
   - name: greedy
     when: top_k == 1
-    ttl: 10m
+    ttl: 15m
+  - name: sampled
+    when: temperature > 0
+    cache: bypass
 tenants: {}
 eviction:
   fallback: lru
"""


def test_small_pair_exact_text_and_changes() -> None:
    diff = diff_policies(parse_policy(SMALL_OLD), parse_policy(SMALL_NEW))
    assert diff.text == SMALL_DIFF
    assert diff.changes == (
        Change("changed", "version", 1, 2),
        Change("changed", "rules[greedy].ttl", "10m", "15m"),
        Change(
            "added", "rules[sampled]", None, {"name": "sampled", "when": "temperature > 0", "cache": "bypass"}
        ),
    )
    assert (diff.old_ref, diff.new_ref, diff.empty) == ("small@1", "small@2", False)
    assert json.loads(diff.to_json()) == [
        {"kind": "changed", "path": "version", "old": 1, "new": 2},
        {"kind": "changed", "path": "rules[greedy].ttl", "old": "10m", "new": "15m"},
        {
            "kind": "added",
            "path": "rules[sampled]",
            "old": None,
            "new": {"name": "sampled", "when": "temperature > 0", "cache": "bypass"},
        },
    ]


def test_chat_prod_v7_to_v8() -> None:
    diff = diff_policies(
        load_policy(EXAMPLES / "chat-prod.yaml"), load_policy(EXAMPLES / "chat-prod-v8.yaml")
    )
    assert diff.changes == (
        Change("changed", "version", 7, 8),
        Change("moved", "rules[sampled]", 2, 0),
        Change("changed", "rules[long-context-greedy].ttl", "10m", "15m"),
        Change("changed", "rules[long-context-greedy].semantic.max_error", 0.02, 0.015),
        Change(
            "added",
            "rules[summaries]",
            None,
            {
                "name": "summaries",
                "when": 'route == "summarise"',
                "ttl": "1h",
                "sliding": True,
                "tiers": ["l2", "l3"],
            },
        ),
        Change("changed", "tenants.acme.weight", 2.0, 3.0),
        Change("changed", "eviction.l1", "s3fifo", "weighted"),
        Change("changed", "eviction.fallback", "lru", "s3fifo"),
    )
    assert [str(c) for c in diff.changes] == [
        "changed  version: 7 -> 8",
        "moved    rules[sampled]: position 2 -> 0",
        'changed  rules[long-context-greedy].ttl: "10m" -> "15m"',
        "changed  rules[long-context-greedy].semantic.max_error: 0.02 -> 0.015",
        "added    rules[summaries]",
        "changed  tenants.acme.weight: 2.0 -> 3.0",
        'changed  eviction.l1: "s3fifo" -> "weighted"',
        'changed  eviction.fallback: "lru" -> "s3fifo"',
    ]
    assert diff.text.startswith(
        "--- a/chat-prod@7\n+++ b/chat-prod@8\n@@ -1,5 +1,5 @@\n policy: chat-prod\n-version: 7\n"
    )


def test_identical_policies_have_an_empty_diff() -> None:
    p = load_policy(EXAMPLES / "chat-prod.yaml")
    diff = diff_policies(p, load_policy(EXAMPLES / "chat-prod.yaml"))
    assert (diff.text, diff.changes, diff.empty, diff.to_json()) == ("", (), True, "[]")


def test_respelling_is_no_change() -> None:
    a = parse_policy("policy: p\nversion: 1\ndefaults: {ttl: 600, tiers: [l2, l1]}\n")
    b = parse_policy("policy: p\nversion: 1\ndefaults: {ttl: 10m, tiers: [l1, l2]}\n")
    assert diff_policies(a, b).empty


def test_version_bump_alone() -> None:
    a = parse_policy("policy: p\nversion: 1\n")
    b = parse_policy("policy: p\nversion: 2\n")
    diff = diff_policies(a, b)
    assert diff.changes == (Change("changed", "version", 1, 2),)
    assert diff.text == (
        "--- a/p@1\n+++ b/p@2\n@@ -1,5 +1,5 @@\n"
        " policy: p\n-version: 1\n+version: 2\n fields: {}\n defaults:\n   cache: response\n"
    )


def rules_doc(*rules: str, version: int = 1, extra: str = "") -> str:
    body = "".join(f"  - {{name: {r}, when: top_k == {i}}}\n" for i, r in enumerate(rules))
    return f"policy: p\nversion: {version}\nrules:\n{body}{extra}"


def changes(old: str, new: str) -> tuple[Change, ...]:
    return diff_policies(parse_policy(old), parse_policy(new)).changes


def test_rules_are_matched_by_name_not_position() -> None:
    # inserting a rule in front shifts every index but moves nothing
    old = "policy: p\nversion: 1\nrules:\n  - {name: a, when: top_k == 1}\n  - {name: b, when: top_k == 2}\n"
    new = (
        "policy: p\nversion: 1\nrules:\n  - {name: z, when: top_k == 0}\n  - {name: a, when: top_k == 1}\n"
        "  - {name: b, when: top_k == 2}\n"
    )
    assert changes(old, new) == (Change("added", "rules[z]", None, {"name": "z", "when": "top_k == 0"}),)
    assert changes(new, old) == (Change("removed", "rules[z]", {"name": "z", "when": "top_k == 0"}, None),)


def test_reordering_reports_only_the_rules_that_moved() -> None:
    old = "policy: p\nversion: 1\nrules:\n" + "".join(
        f"  - {{name: {n}, when: top_k == 1}}\n" for n in "abcd"
    )
    new = "policy: p\nversion: 1\nrules:\n" + "".join(
        f"  - {{name: {n}, when: top_k == 1}}\n" for n in "bcda"
    )
    assert changes(old, new) == (Change("moved", "rules[a]", 0, 3),)


def test_a_renamed_rule_is_removed_and_added() -> None:
    old = "policy: p\nversion: 1\nrules:\n  - {name: old-name, when: top_k == 1}\n"
    new = "policy: p\nversion: 1\nrules:\n  - {name: new-name, when: top_k == 1}\n"
    assert [(c.kind, c.path) for c in changes(old, new)] == [
        ("removed", "rules[old-name]"),
        ("added", "rules[new-name]"),
    ]


def test_settings_appearing_and_disappearing() -> None:
    old = "policy: p\nversion: 1\nrules:\n  - {name: a, when: top_k == 1, ttl: 1m}\neviction: {l1: lru}\n"
    new = (
        "policy: p\nversion: 1\nrules:\n  - {name: a, when: top_k == 1, tiers: [l3], semantic: {max_error: 0.1}}\n"
        "eviction: {l3: lru}\nslo: {p99_ms: 500}\n"
    )
    assert changes(old, new) == (
        Change("removed", "rules[a].ttl", "1m", None),
        Change("added", "rules[a].tiers", None, ["l3"]),
        Change("added", "rules[a].semantic", None, {"max_error": 0.1}),
        Change("removed", "eviction.l1", "lru", None),
        Change("added", "eviction.l3", None, "lru"),
        Change("added", "slo.p99_ms", None, 500.0),
    )


def test_rename_of_the_policy_is_a_change() -> None:
    assert changes("policy: a\nversion: 1\n", "policy: b\nversion: 1\n") == (
        Change("changed", "policy", "a", "b"),
    )


def test_change_and_diff_are_frozen() -> None:
    diff = diff_policies(parse_policy(SMALL_OLD), parse_policy(SMALL_NEW))
    assert isinstance(diff, PolicyDiff)
    with pytest.raises(AttributeError):
        diff.text = ""  # type: ignore[misc]
    with pytest.raises(AttributeError):
        diff.changes[0].path = "x"  # type: ignore[misc]
