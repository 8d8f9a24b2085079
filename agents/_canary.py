"""The canary's analysis: evidence in, one verdict out, nothing written.

A rollout is a small state machine driven by analysis results (Argo Rollouts, Flagger). Each pass with a
canary out, the loop gathers ``CanaryEvidence`` over the windows since the canary started, and
``analyse_canary`` turns it into one of four phases:

- ``promote``: the canary arm has ``min_requests`` requests, and the fresh replay's gain is positive with its
  interval's low end within the tolerance;
- ``rollback``: either view shows a breach (below);
- ``continue``: neither yet, and fewer than ``max_windows`` windows on the canary;
- ``inconclusive``: neither after ``max_windows`` windows. Inconclusive is a phase of its own, never a pass:
  the canary is withdrawn and a person decides.

Two views judge the same windows. The live split (the canary arm's requests against the base arm's) shows an
SLO the canary breaks, and, for a change that acts on the requests it decides (``local``), a hit ratio lower
than the base's by more than the tolerance over the whole interval of the difference. It counts only once the
canary arm has ``min_requests`` requests. The fresh replay (the change in force against the base over the same
windows, each from a cold cache) shows a loss beyond the tolerance, or wrong answers that rise while its
interval sits at or below zero. The tolerance is ``max_drop`` times the base arm's hit ratio.

The actuator (``agents._actuator``) acts on the verdict; this module only decides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ._evidence import ArmMetrics, Comparison

if TYPE_CHECKING:
    from evocache.dsl import Policy

Phase = Literal["promote", "rollback", "continue", "inconclusive"]


@dataclass(frozen=True, slots=True)
class CanaryRules:
    """What the analysis reads of the policy in force: its ``guardrails.canary`` (``windows`` before the
    canary is judged, ``max_windows`` before it is inconclusive, ``max_drop``, ``min_requests``) and its
    ``slo.max_error_rate`` (None: no objective)."""

    windows: int
    max_windows: int
    max_drop: float
    min_requests: int
    max_error_rate: float | None

    @classmethod
    def of(cls, policy: Policy) -> CanaryRules:
        """The rules ``policy`` (the policy in force) sets."""
        spec = policy.guardrails.rollout
        slo = policy.slo.max_error_rate
        return cls(spec.windows, spec.max_windows, spec.max_drop, spec.min_requests, slo)


@dataclass(frozen=True, slots=True)
class CanaryEvidence:
    """The canary's windows as both views saw them: ``canary`` and ``base`` the live arms, ``difference`` the
    canary's hit ratio minus the base's with its interval ``(difference, low, high)``, ``replay`` the fresh
    replay of the change against the base, ``local``: whether the change acts on the requests it decides
    (a ttl, a KV ``min_tokens``, a semantic bound) rather than on the whole cache."""

    canary: ArmMetrics
    base: ArmMetrics
    difference: tuple[float, float, float]
    replay: Comparison
    local: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "canary": self.canary.to_dict(),
            "base": self.base.to_dict(),
            "difference": list(self.difference),
            "replay": self.replay.to_dict(),
            "local": self.local,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CanaryEvidence:
        diff, low, high = data["difference"]
        return cls(
            ArmMetrics.from_dict(data["canary"]),
            ArmMetrics.from_dict(data["base"]),
            (diff, low, high),
            Comparison.from_dict(data["replay"]),
            bool(data["local"]),
        )


@dataclass(frozen=True, slots=True)
class CanaryVerdict:
    """One analysis: its ``phase``, the ``windows`` the canary has been judged over, and ``reason``, one
    sentence for a person (the breach, or why it is inconclusive; empty otherwise)."""

    phase: Phase
    windows: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class CanaryAnalysis:
    """One pass's analysis of the canary of ``proposal``: the ``verdict``, the windows it covers (``span``:
    the window the canary started at and the newest) and the ``evidence`` it was reached on (None before the
    canary may be judged). The loop's graph carries it from the node that analyses to the node that acts as
    plain data (``to_dict``)."""

    proposal: str
    verdict: CanaryVerdict
    span: tuple[int, int]
    evidence: CanaryEvidence | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "proposal": self.proposal,
            "phase": self.verdict.phase,
            "reason": self.verdict.reason,
            "windows": self.verdict.windows,
            "span": list(self.span),
            "evidence": None if self.evidence is None else self.evidence.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CanaryAnalysis:
        first, last = data["span"]
        plain = data["evidence"]
        return cls(
            data["proposal"],
            CanaryVerdict(data["phase"], data["windows"], data["reason"]),
            (first, last),
            None if plain is None else CanaryEvidence.from_dict(plain),
        )


def analyse_canary(rules: CanaryRules, windows: int, evidence: CanaryEvidence | None) -> CanaryVerdict:
    """The verdict on a canary out for ``windows`` windows. ``evidence`` is None while ``windows`` is below
    ``rules.windows`` (the loop gathers none before the canary may be judged): the canary goes on."""
    if windows < rules.windows or evidence is None:
        return CanaryVerdict("continue", windows)
    base = evidence.base
    tolerance = rules.max_drop * base.hit_ratio  # a share of the base's hit ratio
    counted = evidence.canary.requests >= rules.min_requests
    breach = (_live_breach(rules, evidence, tolerance) if counted else "") or _replay_breach(
        evidence.replay, tolerance
    )
    if breach:
        return CanaryVerdict("rollback", windows, breach)
    replay = evidence.replay
    low = replay.ci[0]
    if counted and replay.gain > 0 and low >= -tolerance:
        return CanaryVerdict("promote", windows)
    if windows < rules.max_windows:
        return CanaryVerdict("continue", windows)
    diff, d_low, d_high = evidence.difference
    return CanaryVerdict(
        "inconclusive",
        windows,
        f"inconclusive after {windows} windows: {evidence.canary.requests} canary requests, replayed gain "
        f"{replay.gain:+.4f} [{replay.ci[0]:+.4f}, {replay.ci[1]:+.4f}], live difference {diff:+.4f} "
        f"[{d_low:+.4f}, {d_high:+.4f}]",
    )


def _live_breach(rules: CanaryRules, evidence: CanaryEvidence, tolerance: float) -> str:
    """An SLO the canary arm breaks, or (for a ``local`` change) its hit ratio shown (the whole interval of
    the difference) to be more than ``tolerance`` below the base's. "" when neither."""
    can, bas = evidence.canary, evidence.base
    max_error = rules.max_error_rate
    if max_error is not None and can.wrong_rate > max_error and can.wrong_rate > bas.wrong_rate:
        return f"SLO breach: canary error rate {can.wrong_rate:.4f} > {max_error:g}"
    high = evidence.difference[2]
    if evidence.local and high < -tolerance:
        return (
            f"canary hit ratio {can.hit_ratio:.3f} is below the base's {bas.hit_ratio:.3f} by more "
            f"than {tolerance:.4f} (the interval of the difference ends at {high:+.4f})"
        )
    return ""


def _replay_breach(replay: Comparison, tolerance: float) -> str:
    """The fresh replay's interval ending below minus ``tolerance``, or wrong answers rising while it sits at
    or below zero. "" when neither."""
    high = replay.ci[1]
    if high < -tolerance:
        return (
            f"replayed over the canary's windows, the change loses hit ratio: {replay.gain:+.4f} "
            f"(the interval ends at {high:+.4f}, beyond the tolerance {tolerance:.4f})"
        )
    if replay.candidate.wrong_rate > replay.base.wrong_rate and replay.wrong_change > 0 and high <= 0:
        return f"replayed over the canary's windows, wrong answers rise by {replay.wrong_change:+.4f}"
    return ""
