"""Differences between two policies: a unified diff of the normalised documents for people, and a list of
structured changes for programs (the agent's guardrails, proposal records).

Both compare the normalised documents, so a change of spelling (``600`` vs ``10m``, tier order, tenant order)
is no change. Rules are identified by name, not position: ``rules[free-tier].ttl``; a rule whose place in the
order changed (which changes which rule wins) is reported as ``moved``.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from typing import Any, Literal

from ._policy import Policy, policy_to_yaml

ChangeKind = Literal["added", "removed", "changed", "moved"]


@dataclass(frozen=True, slots=True)
class Change:
    """One difference. ``old``/``new`` are values of the normalised document (durations as ``"10m"``; use
    ``parse_duration`` for seconds); ``None`` on the side where the value is absent. For ``moved``, they are
    the rule's old and new positions (0-based)."""

    kind: ChangeKind
    path: str
    old: Any = None
    new: Any = None

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": self.path, "old": self.old, "new": self.new}

    def __str__(self) -> str:
        if self.kind == "changed":
            return f"changed  {self.path}: {_short(self.old)} -> {_short(self.new)}"
        if self.kind == "moved":
            return f"moved    {self.path}: position {self.old} -> {self.new}"
        value = self.new if self.kind == "added" else self.old
        detail = "" if isinstance(value, dict) else f": {_short(value)}"
        return f"{self.kind:<8} {self.path}{detail}"


def _short(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


@dataclass(frozen=True, slots=True)
class PolicyDiff:
    """``text``: a unified diff of the normalised YAML (``a/<old ref>``, ``b/<new ref>``), empty when the
    documents are equal. ``changes``: the same differences, structured, in document order."""

    old_ref: str
    new_ref: str
    text: str
    changes: tuple[Change, ...]

    @property
    def empty(self) -> bool:
        return not self.changes

    def to_json(self) -> str:
        """The changes as a JSON list of ``{"kind", "path", "old", "new"}`` objects."""
        return json.dumps([c.to_dict() for c in self.changes], indent=2, ensure_ascii=False)


def diff_policies(old: Policy, new: Policy) -> PolicyDiff:
    """Compare two policies (any two: a version bump alone is a change of ``version``)."""
    a, b = policy_to_yaml(old), policy_to_yaml(new)
    text = "".join(
        difflib.unified_diff(
            a.splitlines(keepends=True), b.splitlines(keepends=True), f"a/{old.ref}", f"b/{new.ref}"
        )
    )
    changes: list[Change] = []
    _compare(_full(old), _full(new), "", changes)
    return PolicyDiff(old.ref, new.ref, text, tuple(changes))


def _full(policy: Policy) -> dict[str, Any]:
    return policy.model_dump(mode="json", by_alias=True)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _compare(old: Any, new: Any, path: str, out: list[Change]) -> None:
    """Compare full dumps (unset settings present as None), so keys line up in schema order."""
    if isinstance(old, dict) and isinstance(new, dict):
        # Model dumps share their key order; tenant and field maps are sorted, so their union is too.
        keys = list(old) if list(old) == list(new) else sorted(set(old) | set(new))
        for key in keys:
            a, b, sub = old.get(key), new.get(key), _join(path, key)
            if a is None and b is None:
                continue
            if a is None:
                out.append(Change("added", sub, new=_strip(b)))
            elif b is None:
                out.append(Change("removed", sub, old=_strip(a)))
            elif path == "" and key == "rules":
                _compare_rules(a, b, out)
            else:
                _compare(a, b, sub, out)
    elif old != new:
        out.append(Change("changed", path, _strip(old), _strip(new)))


def _strip(value: Any) -> Any:
    """The value as the normalised document shows it: unset (None) settings left out."""
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def _compare_rules(old: list[dict[str, Any]], new: list[dict[str, Any]], out: list[Change]) -> None:
    old_by_name = {rule["name"]: (i, rule) for i, rule in enumerate(old)}
    new_by_name = {rule["name"]: (i, rule) for i, rule in enumerate(new)}
    for name, (_, rule) in old_by_name.items():
        if name not in new_by_name:
            out.append(Change("removed", f"rules[{name}]", old=_strip(rule)))
    # Rules that keep their relative order are the longest common subsequence; the others moved.
    kept = _lcs(
        [r["name"] for r in old if r["name"] in new_by_name],
        [r["name"] for r in new if r["name"] in old_by_name],
    )
    for name, (i, rule) in new_by_name.items():
        path = f"rules[{name}]"
        if name not in old_by_name:
            out.append(Change("added", path, new=_strip(rule)))
            continue
        j, old_rule = old_by_name[name]
        if name not in kept:
            out.append(Change("moved", path, j, i))
        _compare(old_rule, rule, path, out)


def _lcs(a: list[str], b: list[str]) -> set[str]:
    # A policy has at most MAX_RULES (1000) rules: the quadratic table has at most a million cells (about 0.5 s).
    table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i in range(len(a) - 1, -1, -1):
        for j in range(len(b) - 1, -1, -1):
            table[i][j] = table[i + 1][j + 1] + 1 if a[i] == b[j] else max(table[i + 1][j], table[i][j + 1])
    out, i, j = set(), 0, 0
    while i < len(a) and j < len(b):
        if a[i] == b[j]:
            out.add(a[i])
            i, j = i + 1, j + 1
        elif table[i + 1][j] >= table[i][j + 1]:
            i += 1
        else:
            j += 1
    return out
