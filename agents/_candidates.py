"""Candidate edits: the policy changes the findings suggest, each a small, named change of one setting.

An ``Edit`` is plain data (``kind``, ``path`` in the document, ``old``, ``new``, ``why``), applied to the
policy document and validated back into a ``Policy`` (``apply_edits``), then checked by the controller as
``evocache policy check`` does: the loop never proposes a document that check rejects. The kinds:

- ``ttl``: a rule's ttl halved or doubled, and the confidence-based ttl ``base x confidence ^ alpha``
  (confidence: the share of the rule's hits that were right), within the guardrails' ``ttl_min``/``ttl_max``;
- ``bypass``: a rule whose traffic never hits stops being cached (``cache: bypass``);
- ``tenant-share``: a tenant that pushes others out gets a smaller ``l1_share``;
- ``eviction``: another L1 eviction policy;
- ``min-tokens``: a KV rule's ``min_tokens`` raised to a quantile of the recent prompt lengths;
- ``semantic``: a rule's error bound moved by a step, within ``max_semantic_error``, or a static threshold
  moved.

``Edit.auto_approvable`` says whether the policy's ``guardrails.auto_approve`` lets the loop roll it out
without a person.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from evocache.controller import check_policy
from evocache.dsl import Policy, parse_policy, policy_to_dict, policy_to_yaml

from ._types import Finding, WindowStats

EVICTION_CHOICES = ("lru", "s3fifo", "arc")
SEMANTIC_STEP = 0.01
THRESHOLD_STEP = 0.02
SHARES = (0.1, 0.25)


@dataclass(frozen=True, slots=True)
class Edit:
    """One change: ``kind`` (see the module docstring), ``path`` (``rules.faq.ttl``,
    ``tenants.batch.l1_share``, ``eviction.l1``; a section, ``eviction``, when ``new`` sets several of its
    fields together, as ``{"l1": "learned", "model": "..."}``), the value before and after (document
    spelling: seconds for ttls) and ``why`` (the finding or heuristic behind it)."""

    kind: str
    path: str
    old: Any
    new: Any
    why: str

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": self.path, "old": self.old, "new": self.new, "why": self.why}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Edit:
        return cls(data["kind"], data["path"], data["old"], data["new"], data["why"])

    def auto_approvable(self, policy: Policy) -> bool:
        """Whether ``policy.guardrails.auto_approve`` covers this edit."""
        auto = policy.guardrails.auto_approve
        if auto is None:
            return False
        if self.kind == "ttl":
            return auto.ttl_change is not None and _relative(self.old, self.new) <= auto.ttl_change + 1e-9
        if self.kind == "bypass":
            return auto.bypass
        if self.kind == "eviction":
            return auto.eviction
        if self.kind == "tenant-share":
            return (
                auto.tenant_share_change is not None
                and abs(self.new - self.old) <= auto.tenant_share_change + 1e-9
            )
        if self.kind == "min-tokens":
            return (
                auto.min_tokens_change is not None
                and _relative(self.old or 1, self.new) <= auto.min_tokens_change
            )
        if self.kind == "semantic":
            return (
                auto.semantic_error_change is not None
                and abs(float(self.new) - float(self.old)) <= auto.semantic_error_change + 1e-9
            )
        return False


def _relative(old: float, new: float) -> float:
    return abs(float(new) - float(old)) / abs(float(old)) if old else float("inf")


def apply_edits(base: Policy, edits: Sequence[Edit], version: int | None = None) -> Policy:
    """``base`` with ``edits`` applied, as ``version`` (default: one above ``base``'s; a store that saw a
    rolled-back version needs one above that), validated and checked. Raises the dsl's
    ``PolicyError`` or the controller's ``StoreConfigError`` for a result that would not pass ``policy
    check``."""
    doc = copy.deepcopy(policy_to_dict(base))
    for edit in edits:
        _set(doc, edit.path, edit.new)
    doc["version"] = base.version + 1 if version is None else version
    policy = parse_policy(policy_to_yaml(Policy.model_validate(doc)), f"<{base.name} proposal>")
    check_policy(policy)
    return policy


def _set(doc: dict[str, Any], path: str, value: Any) -> None:
    head, _, rest = path.partition(".")
    if not rest and isinstance(value, dict):  # a whole section's fields at once (``eviction``: class and model)
        doc.setdefault(head, {}).update(value)
        return
    if head == "rules" and rest:
        name, _, field = rest.partition(".")
        rule = next((r for r in doc.get("rules", ()) if r["name"] == name), None)
        if rule is None:
            raise ValueError(f"edit {path}: the policy has no rule {name!r}")
        target, key = _descend(rule, field)
    else:
        target, key = _descend(doc.setdefault(head, {}), rest)
    target[key] = value


def _descend(node: dict[str, Any], path: str) -> tuple[dict[str, Any], str]:
    parts = path.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    return node, parts[-1]


def candidate_edits(base: Policy, findings: Sequence[Finding], recent: Sequence[WindowStats]) -> list[Edit]:
    """The single edits worth replaying for ``base`` given the ``findings`` and the ``recent`` windows."""
    edits: list[Edit] = []
    rules = {r.name: r for r in base.rules}
    seen_rules = {name for w in recent for name in w.by_rule} & set(rules)
    for f in findings:
        if f.kind == "never-hits" and f.subject.get("rule") in rules:
            name = f.subject["rule"]
            if base.decision_for(name).cache:
                edits.append(Edit("bypass", f"rules.{name}.cache", "response", "bypass", f.summary))
        if f.kind == "push-out" and f.subject.get("tenant"):
            edits.extend(_share_edits(base, f.subject["tenant"], f.summary))
        if f.kind == "never-hits" and f.subject.get("tenant") and not f.subject.get("rule"):
            edits.extend(_share_edits(base, f.subject["tenant"], f.summary))
    current = base.eviction.l1 or "lru"
    drifted = any(f.kind in ("key-drift", "change-point") for f in findings)
    if drifted or any(f.kind == "push-out" for f in findings):
        edits.extend(
            Edit("eviction", "eviction.l1", current, name, "the traffic changed: another eviction order")
            for name in EVICTION_CHOICES
            if name != current
        )
    targets = [(name, f"rules.{name}") for name in sorted(seen_rules)]
    if any(name not in rules for w in recent for name in w.by_rule):
        targets.append(("", "defaults"))  # traffic no rule names runs on the defaults
    for name, where in targets:
        edits.extend(_ttl_edits(base, name, where, recent))
        edits.extend(_min_tokens_edits(base, name, where, recent))
        edits.extend(_semantic_edits(base, name, where, recent))
    return _unique(edits)


def _unique(edits: Iterable[Edit]) -> list[Edit]:
    out: dict[tuple[str, str], Edit] = {}
    for e in edits:
        out.setdefault((e.path, repr(e.new)), e)
    return list(out.values())


def _share_edits(base: Policy, tenant: str, why: str) -> list[Edit]:
    spec = base.tenant(tenant)  # its own entry, else the default one: the share it runs with now
    old = 1.0 if spec is None else float(spec.l1_share)
    return [
        Edit("tenant-share", f"tenants.{tenant}.l1_share", old, share, why) for share in SHARES if share < old
    ]


def _ttl_edits(base: Policy, rule: str, where: str, recent: Sequence[WindowStats]) -> list[Edit]:
    decision = base.decision_for(rule)
    if not decision.cache:
        return []
    g = base.guardrails
    low, high = g.ttl_min or 1.0, g.ttl_max or 30 * 86400.0
    old = float(decision.ttl)
    out = []
    hits = sum(w.by_rule[rule].hits for w in recent if rule in w.by_rule)
    wrong = sum(w.wrong for w in recent if rule in w.by_rule and len(w.by_rule) == 1)
    confidence = 1.0 - wrong / hits if hits else 1.0
    for new, why in (
        (old * confidence**g.alpha, f"confidence-based ttl: confidence {confidence:.3f}"),
        (old / 2, "shorter ttl"),
        (old * 2, "longer ttl"),
    ):
        new = float(round(min(high, max(low, new))))
        if abs(new - old) >= 1.0:
            out.append(Edit("ttl", f"{where}.ttl", old, new, why))
    return out


def _min_tokens_edits(base: Policy, rule: str, where: str, recent: Sequence[WindowStats]) -> list[Edit]:
    kv = base.decision_for(rule).kv
    if kv is None or kv.reuse == "off":
        return []
    lengths = np.array([t for w in recent for t in w.prompt_tokens], dtype=np.float64)
    if not len(lengths):
        return []
    old = int(kv.min_tokens or 0)
    out = []
    for q in (0.25, 0.5):
        new = int(np.quantile(lengths, q))
        if new > old:
            out.append(
                Edit(
                    "min-tokens",
                    f"{where}.kv.min_tokens",
                    old,
                    new,
                    f"cache only prompts of at least the {int(q * 100)}th percentile length",
                )
            )
    return out


def _semantic_edits(base: Policy, rule: str, where: str, recent: Sequence[WindowStats]) -> list[Edit]:
    sem = base.decision_for(rule).semantic
    if sem is None:
        return []
    ceiling = base.guardrails.max_semantic_error or float(sem.max_error)
    out = []
    old = float(sem.max_error)
    for new in (old - SEMANTIC_STEP, old + SEMANTIC_STEP) if sem.mode != "static" else ():
        new = round(new, 4)
        if 0 < new <= ceiling and new != old:
            out.append(Edit("semantic", f"{where}.semantic.max_error", old, new, "another error bound"))
    if sem.mode == "static" and sem.threshold is not None:
        t = float(sem.threshold)
        for new in (t - THRESHOLD_STEP, t + THRESHOLD_STEP, t + 2 * THRESHOLD_STEP):
            new = round(new, 3)
            if 0 < new <= 1:
                out.append(
                    Edit("semantic", f"{where}.semantic.threshold", t, new, "another static threshold")
                )
    return out
