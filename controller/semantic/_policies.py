"""The decision policies: ``BoundedPolicy`` serves a neighbour's answer only while the error it costs stays
within the rule's bound; ``StaticPolicy`` (the comparison baseline) serves at a fixed similarity.
``POLICIES`` builds one by mode name from ``PolicyOptions``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Protocol

from ._error_model import ErrorModel
from ._index import Neighbour
from ._neighbourhood import Candidate, neighbourhood
from ._pacing import Calibration, Pacer, PacerOptions
from ._prior import SHIPPED_PRIOR, ErrorPrior, load_prior

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "POLICIES",
    "AnswerClusters",
    "BoundedPolicy",
    "DecisionPolicy",
    "PolicyOptions",
    "Readings",
    "SemanticDecision",
    "StaticPolicy",
]


class SemanticDecision(NamedTuple):
    """One semantic lookup's decision; also the explanation recorded in its access event.

    ``serve``: the neighbour's answer is served. ``explore``: it would have been served, but the model is
    called instead to measure the error (the lookup counts as a miss). ``neighbour``: the candidate entry (None
    when the scope held nothing). ``similarity``: its cosine similarity to the prompt. ``threshold``: what the
    decision compared against: the cut-off on ``est_error`` in bounded mode, the similarity threshold in static
    mode. ``est_error``: the estimated probability that the candidate's answer is wrong for this prompt (1.0
    before the model has learnt anything; 0.0 for an exact match; NaN in static mode, which estimates nothing).
    ``token``: which lookup this was, for ``SemanticCache.judge_miss``/``feedback`` to find what it remembers
    of it (None for an exact match and for decisions a policy makes before the cache numbers them).
    """

    serve: bool
    explore: bool
    neighbour: str | None
    similarity: float
    threshold: float
    est_error: float
    token: int | None = None


class StaticPolicy:
    """Serve the nearest entry when its cosine similarity is at least ``threshold``: the comparison baseline
    (GPTCache, RedisVL and LiteLLM decide this way). It learns nothing and explores nothing."""

    mode = "static"
    reads_shares = False
    learns = False

    def __init__(self, *, threshold: float) -> None:
        if not 0 < threshold <= 1:
            raise ValueError(f"threshold must be in (0, 1], got {threshold!r}")
        self.threshold = threshold

    def decide(
        self,
        neighbours: Sequence[Neighbour],
        max_error: float,
        explore_draw: float,
        clusters: AnswerClusters,
        scope: Hashable = None,
        prompt: str | None = None,
        shares: Mapping[str, float] | None = None,
    ) -> tuple[SemanticDecision, Candidate | None]:
        if not neighbours:
            return SemanticDecision(False, False, None, 0.0, self.threshold, math.nan), None
        top = neighbours[0]
        serve = top.similarity >= self.threshold
        return SemanticDecision(serve, False, top.entry_id, top.similarity, self.threshold, math.nan), None

    def exact(self, scope: Hashable, entry_id: str) -> SemanticDecision:
        return SemanticDecision(True, False, entry_id, 1.0, self.threshold, 0.0)

    def prepare(self) -> None:
        """Static mode fits nothing."""

    def observe(self, candidate: Candidate, wrong: bool, est_error: float, *, explored: bool) -> None:
        """Static mode learns nothing."""

    def readings(self, scope: Hashable | None = None) -> Readings:
        return Readings(self.threshold, 1.0)


class Readings(NamedTuple):
    """What ``SemanticStats`` reports of a policy: the cut-off a scope decides against, the calibration, and
    whether that calibration is the confidence sequence's own bound (False while the prior's cap binds, and for
    a policy without one)."""

    cutoff: float
    calibration: float
    bounded: bool = False


class DecisionPolicy(Protocol):
    """Decides each semantic lookup of one rule and learns from the verdicts on them.

    ``mode`` names it (``bounded``, ``static``); ``reads_shares`` says whether ``decide`` reads the answer
    classifier's ``shares`` (the cache keeps a classifier only then); ``learns`` whether verdicts teach it
    anything (the cache judges no miss for a policy that does not learn). ``decide`` picks the candidate among
    ``neighbours`` and says whether to serve or explore it; ``exact`` is told of an exact hit (which costs no
    error) and returns its decision; ``prepare`` is called outside the cache's lock before ``observe``, which
    records one verdict on a candidate; ``readings`` is what ``SemanticStats`` reports of ``scope``.
    """

    mode: str
    reads_shares: bool
    learns: bool

    def decide(
        self,
        neighbours: Sequence[Neighbour],
        max_error: float,
        explore_draw: float,
        clusters: AnswerClusters,
        scope: Hashable = None,
        prompt: str | None = None,
        shares: Mapping[str, float] | None = None,
    ) -> tuple[SemanticDecision, Candidate | None]: ...

    def exact(self, scope: Hashable, entry_id: str) -> SemanticDecision: ...

    def prepare(self) -> None: ...

    def observe(self, candidate: Candidate, wrong: bool, est_error: float, *, explored: bool) -> None: ...

    def readings(self, scope: Hashable | None = None) -> Readings: ...


class AnswerClusters(Protocol):
    """What a policy reads of the cache: the answer clusters (judge links) and each entry's own verdicts."""

    @property
    def evidence(self) -> Mapping[str, tuple[int, int]]: ...  # entry -> (wrong, right) as a candidate

    def cluster_of(self, entry_id: str) -> str: ...

    def cluster_size(self, root: str) -> int: ...

    def prompt_of(self, entry_id: str, scope: Hashable = None) -> str | None: ...  # its stored prompt, if known


_NONE, _EXACT, _CANDIDATE = 0, 1, 2  # what a remembered lookup had: no candidate, an exact hit, a candidate
_SCOPES = 1024  # pacers kept (LRU): about 112 KB each with a full window, so about 115 MB at most


class _Pace:
    """One scope's pacer and the features of its last lookups, re-estimated when the shared error model has
    been refitted since (``fit``: the model's fit count then). The features are kept in a ring of rows
    (``kinds``: 0 no candidate, 1 an exact hit, 2 a candidate whose features are the row), about 80 KB per
    scope at the default window, so many scopes stay affordable."""

    __slots__ = ("fit", "kinds", "n", "pacer", "pos", "rows")

    def __init__(self, pacer: Pacer, fit: int) -> None:
        import numpy as np

        self.pacer = pacer
        self.fit = fit
        self.kinds = np.zeros(pacer.window, dtype=np.int8)
        self.rows: np.ndarray | None = None  # (window, features), made at the first candidate
        self.n = self.pos = 0

    def append(self, features: np.ndarray | None, *, exact: bool = False) -> None:
        import numpy as np

        if features is not None:
            if self.rows is None:
                self.rows = np.empty((len(self.kinds), len(features)))
            self.rows[self.pos] = features
        self.kinds[self.pos] = _CANDIDATE if features is not None else _EXACT if exact else _NONE
        self.pos = (self.pos + 1) % len(self.kinds)
        self.n = min(self.n + 1, len(self.kinds))

    def order(self) -> np.ndarray:
        """Positions of the remembered lookups, oldest first."""
        import numpy as np

        return (self.pos - self.n + np.arange(self.n)) % len(self.kinds)


class BoundedPolicy:
    """Serve a would-be hit when its estimated error is within the paced cut-off; explore a fraction
    ``explore`` of would-be hits (the caller draws uniformly in [0, 1) for each lookup), a fraction
    ``explore_first[1]`` of the first would-be hits until ``explore_first[0]`` of them were explored
    (``explore_chance``); each explored verdict weighs the inverse of the chance it had.

    One policy per rule (the bound is the rule's). The error model and its calibration (the exploration
    sample) are shared by all the scopes the rule serves: what makes a neighbour wrong is learnt from all of
    them. The budget is not: each scope (tenant namespace + boundary) has its own ``Pacer``, so one tenant's
    lookups without a candidate never buy another tenant's risky hits, and each scope's own error per lookup is
    held within the bound. The ``max_scopes`` most recently used pacers are kept; a scope whose pacer was
    dropped starts again cold (it serves nothing until its first cut-off), which errs on the safe side.
    ``pacer`` (a ``PacerOptions``) configures every ``Pacer``.

    ``item_cap``: a would-be hit whose own estimate (the model's, before calibration) exceeds ``item_cap`` x
    the bound is never served, whatever the budget left (None: the pacer alone decides). The calibration is an
    upper confidence bound over the whole exploration sample, right for pacing a budget and pessimistic for
    judging one answer, so the cap reads the model's own estimate (a cap on the calibrated one acts like a much
    tighter cap and costs hit rate). The pacer holds the *average* error per lookup within the bound, so a
    scope whose lookups are mostly safe could otherwise spend its budget on a few answers that are individually
    likely wrong: estimates of several times the bound serve negation traps ("without a prescription" for "do I
    need a prescription"). The default of 5 stops them at little cost in hits (see docs/semantic.md,
    'Pacing').

    A scope first seen after the early exploration schedule is done is a newcomer (``Pacer(newcomer=)``): the
    model was checked on other scopes' traffic, not its. Its first ``trust`` would-be hits are all explored
    (verdicts for its own calibration; only those the draw picked join the shared sample), and its pacer reads
    its own pessimistic calibration until its verdicts earn it the shared one. A founding scope is unaffected.

    ``prior``: what the error model starts from when no ``model`` is given: an ``ErrorPrior`` or the path of a
    prior file (``SHIPPED_PRIOR``, the one shipped with the package, is what a rule's ``PolicyOptions`` gives
    by default): the model serves from its first lookups, still paced by the calibration, which checks it
    with explorations from the start (see docs/semantic.md, 'Prior'). None (the default here): the model
    starts knowing nothing and serves nothing until it has seen ``ErrorModel.min_each`` wrong and right
    verdicts.
    """

    mode = "bounded"
    reads_shares = True
    learns = True

    def __init__(
        self,
        *,
        explore: float = 0.05,
        explore_first: tuple[int, float] = (100, 0.25),
        model: ErrorModel | None = None,
        pacer: PacerOptions = PacerOptions(),
        max_scopes: int = _SCOPES,
        trust: int = 10,
        item_cap: float | None = 5.0,
        prior: ErrorPrior | str | Path | None = None,
    ) -> None:
        if not 0 <= explore < 1:
            raise ValueError(f"explore must be in [0, 1), got {explore!r}")
        if max_scopes < 1:
            raise ValueError(f"max_scopes must be positive, got {max_scopes!r}")
        if explore_first[0] < 0 or not 0 <= explore_first[1] < 1:
            raise ValueError(f"explore_first must be (count >= 0, fraction in [0, 1)), got {explore_first!r}")
        if trust < 0:
            raise ValueError(f"trust must be >= 0, got {trust!r}")
        if item_cap is not None and (isinstance(item_cap, bool) or not isinstance(item_cap, int | float)
                                     or not item_cap > 0):
            raise ValueError(f"item_cap must be a number > 0 or None, got {item_cap!r}")
        self.explore = explore
        self.explore_first = explore_first
        self.trust = trust
        self.item_cap = item_cap
        self.explorations = 0  # would-be hits explored so far, all scopes (they check one model)
        if model is None:
            model = ErrorModel(prior=load_prior(prior) if isinstance(prior, str | Path) else prior)
        self.model = model
        if not isinstance(pacer, PacerOptions):
            raise TypeError(f"pacer must be a PacerOptions, got {type(pacer).__name__}")
        self._pacer_options = pacer
        self.calibration = Calibration(prior=pacer.prior, confidence=pacer.confidence)
        self.max_scopes = max_scopes
        self._paces: OrderedDict[Hashable, _Pace] = OrderedDict()
        self._last: Pacer | None = None

    @property
    def pacer(self) -> Pacer:
        """The pacer used last (a fresh one before any lookup): what ``SemanticStats`` reports by default."""
        if self._last is None:
            self._last = self._new_pacer()
        return self._last

    def pacer_of(self, scope: Hashable) -> Pacer | None:
        """``scope``'s pacer, or None when it has none (never looked up, or dropped as least recently used)."""
        pace = self._paces.get(scope)
        return None if pace is None else pace.pacer

    def __len__(self) -> int:
        """The number of pacers held."""
        return len(self._paces)

    def _new_pacer(self) -> Pacer:
        # A scope first seen once the model was checked elsewhere (its early exploration schedule done) is a
        # newcomer: that check says nothing of its prompts.
        newcomer = self.explore > 0 and self.explorations >= self.explore_first[0]
        return Pacer(self._pacer_options, calibration=self.calibration, newcomer=newcomer, trust=self.trust)

    def _pace(self, scope: Hashable) -> _Pace:
        pace = self._paces.get(scope)
        if pace is None:
            pace = self._paces[scope] = _Pace(self._new_pacer(), self.model.fits)
            if len(self._paces) > self.max_scopes:
                self._paces.popitem(last=False)
        else:
            self._paces.move_to_end(scope)
            if pace.fit != self.model.fits:
                self._reestimate(pace)
        self._last = pace.pacer
        return pace

    def decide(
        self,
        neighbours: Sequence[Neighbour],
        max_error: float,
        explore_draw: float,
        clusters: AnswerClusters,
        scope: Hashable = None,
        prompt: str | None = None,
        shares: Mapping[str, float] | None = None,
    ) -> tuple[SemanticDecision, Candidate | None]:
        if not 0 < max_error <= 0.5:
            raise ValueError(f"max_error must be in (0, 0.5], got {max_error!r}")
        pace = self._pace(scope)
        pacer = pace.pacer
        cutoff = pacer.cutoff(max_error)
        if self.item_cap is not None:
            cutoff = min(cutoff, self.item_cap * max_error)
        candidate = neighbourhood(
            neighbours, clusters.cluster_of, clusters.cluster_size, clusters.evidence,
            query=prompt, prompt_of=lambda entry_id: clusters.prompt_of(entry_id, scope), shares=shares,
        )
        pace.append(None if candidate is None else candidate.features)
        if candidate is None:
            pacer.record(math.inf, False)
            return SemanticDecision(False, False, None, 0.0, cutoff, 1.0), None
        est = float(self.model.predict(candidate.features)[0])
        would = self.model.ready and est <= cutoff
        # Uniform exploration: its sample of would-be hits is unbiased, so observed / expected wrong answers in
        # it measures the model where it serves (a sample weighted towards high estimates checks the model where
        # it is pessimistic, and its calibration loosens the bound; see docs/semantic.md, 'Calibration').
        chance = self.explore_chance(self.explorations) if would else 0.0
        sampled = would and explore_draw < chance
        self.explorations += sampled
        # A scope earns trust: its first ``trust`` would-be hits are all explored, whatever the draw. The shared
        # model and calibration were learnt on other scopes' prompts; a tenant asking what they never asked
        # (minimal pairs, where the others asked paraphrases) can be served on estimates far too optimistic
        # before a 5 % sample of its hits refutes them (see docs/semantic.md, 'New tenants'). Only the drawn
        # ones enter the shared calibration, which stays a uniform sample of would-be hits.
        untrusted = would and chance > 0 and pacer.newcomer and pacer.explored_here < self.trust
        explore = sampled or untrusted
        pacer.explored_here += explore
        candidate = candidate._replace(explore_chance=1.0 if untrusted else chance, scope=scope, sampled=sampled)
        pacer.record(est, would and not explore)
        decision = SemanticDecision(
            would and not explore, explore, candidate.entry_id, candidate.similarity, cutoff, est
        )
        return decision, candidate

    def explore_chance(self, explored: int) -> float:
        """The chance that the next would-be hit is explored, when ``explored`` would-be hits have been:
        ``explore``, raised to ``explore_first[1]`` for the first ``explore_first[0]``. The model is checked
        where it serves before its estimates are trusted: with 5 % explored, the first few hundred served
        lookups would rest on a dozen verdicts, too few to see a model several times too optimistic."""
        count, chance = self.explore_first
        return max(self.explore, chance) if explored < count and self.explore > 0 else self.explore

    def exact(self, scope: Hashable, entry_id: str) -> SemanticDecision:
        """An exact hit in ``scope``: a lookup that costs no error (it still counts in the per-lookup rate)."""
        pace = self._pace(scope)
        pace.append(None, exact=True)
        pace.pacer.record(0.0, True)
        return SemanticDecision(True, False, entry_id, 1.0, 0.0, 0.0)

    def readings(self, scope: Hashable | None = None) -> Readings:
        """``scope``'s cut-off (by default the scope looked up last; 0.0 for a scope without a pacer) and the
        shared calibration."""
        pacer = self.pacer if scope is None else self.pacer_of(scope)
        return Readings(0.0 if pacer is None else pacer.current, self.calibration.value, self.calibration.bounded)

    def prepare(self) -> None:
        """Called before ``observe``, outside the caller's lock: loads what the model's fit needs."""
        self.model.prepare()

    def observe(self, candidate: Candidate, wrong: bool, est_error: float, *, explored: bool) -> None:
        """A verdict on a candidate: the judge on a miss or an exploration, or feedback on a served hit.

        Only explorations enter the calibration: they are the uniform sample of would-be hits. Served hits with
        feedback are not (users report what they choose to, mostly what was wrong); they still inform the
        model, whose features include everything that decided they were served.
        """
        if explored:
            if candidate.sampled:
                self.calibration.explored(est_error, wrong)
            pace = self._paces.get(candidate.scope)
            if pace is not None:
                pace.pacer.scope_explored(est_error, wrong)
        # Inverse propensity: an explored verdict stands for the 1/chance would-be hits like it that were served.
        weight = 1.0 / candidate.explore_chance if explored and candidate.explore_chance > 0 else 1.0
        self.model.observe(candidate.features, wrong, weight)  # the pacers re-estimate on their next lookup

    def _reestimate(self, pace: _Pace) -> None:
        """Re-estimate a scope's remembered lookups with the refitted model."""
        import numpy as np

        at = pace.order()
        kinds = pace.kinds[at]
        estimates = np.where(kinds == _NONE, math.inf, 0.0)
        candidates = kinds == _CANDIDATE
        if candidates.any():
            assert pace.rows is not None
            estimates[candidates] = self.model.predict(pace.rows[at[candidates]])
        pace.pacer.replace_recent(estimates)
        pace.fit = self.model.fits


@dataclass(frozen=True, slots=True)
class PolicyOptions:
    """A decision policy by mode name (``POLICIES``), as a rule's ``semantic:`` names it: ``explore`` for
    ``bounded``, ``threshold`` for ``static`` (and only there), ``prior`` (a prior file, or None) for
    ``bounded``. ``build()`` makes it."""

    mode: str = "bounded"
    explore: float = 0.05
    threshold: float | None = None
    prior: str | Path | None = SHIPPED_PRIOR  # ``bounded``: the error model's prior file (None: none)

    def __post_init__(self) -> None:
        if self.mode not in POLICIES:
            raise ValueError(f"unknown semantic mode {self.mode!r}; known: {', '.join(POLICIES)}")
        if self.mode == "static" and self.threshold is None:
            raise ValueError("mode 'static' needs a threshold")
        if self.mode != "static" and self.threshold is not None:
            raise ValueError(f"threshold applies only to mode 'static', not {self.mode!r}")

    def build(self) -> DecisionPolicy:
        return POLICIES[self.mode](self)


POLICIES: dict[str, Callable[[PolicyOptions], DecisionPolicy]] = {
    "bounded": lambda o: BoundedPolicy(explore=o.explore, prior=o.prior),
    "static": lambda o: StaticPolicy(threshold=o.threshold),  # type: ignore[arg-type]  # checked: not None
}
"""Semantic modes by name: each builds its ``DecisionPolicy`` from the ``PolicyOptions``."""
