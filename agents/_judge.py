"""The loop's judge: replay evidence over the remembered windows, computed and returned, never written.

``Judge`` answers the loop's three questions of evidence, each from the windows the memory holds
(``agents._memory.WindowRecord``) and the policies named, through ``agents._evidence.compare``:

- ``replay``: would a candidate policy do better than the policy in force on the recent windows (a typed
  ``Judgement``), and ``acceptable``: is that better enough to propose;
- ``canary``: how a canary out since a window did, as the live split and a fresh replay see it
  (``CanaryEvidence``, for ``agents._canary.analyse_canary``);
- ``realised_gain``: what a promoted change gained over the windows after its promotion.

``context`` says what traffic the evidence is judged under (the policy, the model, the outputs' shape),
which a proposal's evidence is stored with and checked against later.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from evocache.dsl import Policy

from ._canary import CanaryEvidence
from ._config import LoopConfig
from ._evidence import Comparison, Judgement, Step, arm_difference, arm_metrics, compare
from ._fingerprint import EvidenceContext, OutputFingerprint
from ._memory import WindowRecord, span
from ._types import Outcome, Request

CACHE_WIDE = frozenset({"bypass", "tenant-share", "eviction"})
"""Edit kinds whose effect is on the whole cache, not on the requests they decide: their canary's hit ratio is
judged by the fresh replay alone."""


class Judge:
    """Replays with ``capacity`` of L1, ``config``'s windows and seed, ``vectors`` of the semantic prompts and
    the trained eviction models in ``model_dir``. ``model`` is what serves the traffic (model id, revision,
    prompt-template hash), part of the evidence's context."""

    def __init__(
        self,
        capacity: int,
        config: LoopConfig,
        *,
        vectors: Any = None,
        model_dir: Path | None = None,
        model: tuple[str, str, str] = ("", "", ""),
    ) -> None:
        self.capacity = capacity
        self.config = config
        self.vectors = vectors
        self.model_dir = model_dir
        self.model = model

    def replay(
        self,
        records: Sequence[WindowRecord],
        base: Policy,
        candidate: Policy,
        *,
        last: int | None = None,
        switch: bool = False,
    ) -> Judgement:
        """Replay evidence for ``candidate`` against ``base`` over the windows up to ``last`` (the newest by
        default), from the same cold cache, the last ``measure`` counted. Each policy is in force over all
        ``warmup + measure`` windows, so each arm's cache holds what its own policy kept and the gain is the
        change's lasting effect, the one its promotion is measured against (``realised_gain``). With
        ``switch`` (an eviction class: a new one takes over the cache as it is and learns from there), it is
        also judged taking over only for the measured windows, as it would in production, and the evidence is
        the less favourable of the two (the lower end of its interval): a class that only wins the transition
        after a drift, or only once it has the cache to itself, is not shown to be better."""
        cfg = self.config
        last = records[-1].index if last is None else last
        reqs = [w.requests for w in span(records, last, cfg.warmup + cfg.measure)]
        measure = min(cfg.measure, len(reqs))
        base_steps: list[Step] = [(base, None, 0.0)] * len(reqs)
        views: dict[str, list[Step]] = {"lasting": [(candidate, None, 0.0)] * len(reqs)}
        if switch:
            views["switch"] = base_steps[: len(reqs) - measure] + [(candidate, None, 0.0)] * measure
        judged = {name: self._compare(reqs, base_steps, steps, measure) for name, steps in views.items()}
        view = min(judged, key=lambda name: judged[name].ci[0])
        return Judgement(judged[view], view, (last - measure + 1, last), time.time())

    @staticmethod
    def acceptable(base: Policy, evidence: Comparison) -> bool:
        """Whether ``evidence`` is worth a proposal: a gain whose interval clears the floor of ``base``'s
        ``guardrails.auto_approve.min_gain`` (0 without one), with no more wrong answers than the base, or
        within its ``slo.max_error_rate``."""
        floor = base.guardrails.auto_approve.min_gain if base.guardrails.auto_approve else 0.0
        max_error = base.slo.max_error_rate
        wrong = evidence.candidate.wrong_rate
        within_error = wrong <= evidence.base.wrong_rate + 1e-12 or (
            max_error is not None and wrong <= max_error
        )
        return evidence.gain > floor and evidence.ci[0] > floor and within_error

    def context(self, records: Sequence[WindowRecord], policy: Policy) -> EvidenceContext:
        """What traffic is served by now: ``policy``, the model, and a fingerprint of the recent windows'
        output lengths (None with fewer than 64 known)."""
        recent = records[-(self.config.warmup + self.config.measure) :]
        lengths = [n for w in recent for n in w.stats.output_tokens if n >= 0]
        fingerprint = OutputFingerprint.of_lengths(lengths) if len(lengths) >= 64 else None
        model_id, revision, template = self.model
        return EvidenceContext(
            policy_ref=str(policy.ref),
            policy_hash=policy.content_hash,
            model_id=model_id,
            model_revision=revision,
            template_hash=template,
            output_fingerprint=fingerprint,
        )

    def canary(
        self,
        records: Sequence[WindowRecord],
        start: int,
        base: Policy,
        candidate: Policy,
        edits: Sequence[dict[str, Any]],
        windows: int,
    ) -> tuple[int, CanaryEvidence | None]:
        """The canary of ``candidate`` (made by ``edits``) over ``base`` as both views see it over the windows
        since ``start`` that ran a canary: how many, and the evidence (None with fewer than ``windows``,
        before it may be judged: no replay is run for it)."""
        recs = [w for w in records if w.index >= start and w.step[1] is not None]
        if len(recs) < windows:
            return len(recs), None
        arms: dict[bool, tuple[list[Request], list[Outcome]]] = {True: ([], []), False: ([], [])}
        for rec in recs:
            for req, out, arm in zip(rec.requests, rec.outcomes, rec.canary_arm, strict=True):
                arms[arm][0].append(req)
                arms[arm][1].append(out)
        difference = arm_difference(arms[True], arms[False], seed=self.config.seed)
        reqs = [w.requests for w in span(records, records[-1].index, self.config.warmup + len(recs))]
        measure = min(len(recs), len(reqs))
        steps = [(base, None, 0.0)] * len(reqs), [(candidate, None, 0.0)] * len(reqs)
        fresh = self._compare(reqs, *steps, measure)
        local = not any(e.get("kind") in CACHE_WIDE for e in edits)
        live = arm_metrics(*arms[True]), arm_metrics(*arms[False])
        return len(recs), CanaryEvidence(*live, difference, fresh, local)

    def realised_gain(self, records: Sequence[WindowRecord], start: int, promoted: int) -> float | None:
        """The gain of the change whose canary started at window ``start`` and was promoted at ``promoted``,
        over the ``realise`` windows after: the schedule that ran against the same schedule without it,
        replayed from the same cold start. None until those windows are served."""
        cfg = self.config
        last = promoted + cfg.realise
        if last > records[-1].index:
            return None
        first = max(0, start - cfg.warmup)
        recs = [r for r in records if first <= r.index <= last]
        old_base = next(r for r in recs if r.index == start).step[0]
        actual = [r.step for r in recs]
        without = [r.step if r.index < start else (old_base, None, 0.0) for r in recs]
        return float(self._compare([r.requests for r in recs], without, actual, cfg.realise).gain)

    def _compare(
        self, reqs: Sequence[Sequence[Request]], base: Sequence[Step], cand: Sequence[Step], measure: int
    ) -> Comparison:
        return compare(
            reqs,
            base,
            cand,
            measure=measure,
            capacity=self.capacity,
            vectors=self.vectors,
            seed=self.config.seed,
            models=self.model_dir,
        )
