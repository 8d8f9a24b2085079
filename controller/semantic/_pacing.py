"""Pacing and calibration: the cut-off on estimated error that holds a scope's error per lookup within the
bound, and the exploration sample that checks the error model where it serves.

A ``Pacer`` per scope (tenant namespace + boundary) picks the cut-off from the scope's recent lookups'
estimated errors so that their expected error per lookup is within the bound. ``Calibration`` (shared like the
model) scales the estimates by an anytime-valid upper confidence bound on the exploration sample's ratio of
wrong answers to estimated ones; a scope whose own explored verdicts refute that shared bound uses its own
(``ScopeCalibration``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

__all__ = ["CONFIDENCE", "Calibration", "Pacer", "PacerOptions", "ScopeCalibration", "calibration_upper"]


# The level of the calibration's confidence sequence: 1 - CONFIDENCE bounds the chance that its upper end is
# ever below the ratio it bounds, over the whole life of the sample (see docs/semantic.md, 'Calibration').
# A scope's own checks read fixed-sample quantiles at the same level.
CONFIDENCE = 0.975

# The largest share of its wealth a bettor may stake on one verdict. Betting against "the ratio is at least
# r", it loses ``bet * (1 - r * est)`` of its wealth on a wrong answer; its Kelly stake for a model at ratio q
# is ``1 - q / r``, so the cap binds only for ratios over 4 q, which a few right answers reject anyway. A cap
# of 0.9 (a wrong answer costs 90 % of the wealth) gave no narrower a sequence on simulated streams.
_MAX_BET = 0.75


@functools.cache
def _ratios() -> np.ndarray:
    """The ratios the sequence tests, 2 % apart from 1/64 to 4096. Its upper bound is the next one above the
    largest one not rejected: conservative by at most 2 %, and valid for a true ratio between two of them (the
    one just below it is rejected no more often than the true one would be, and the bound is above it)."""
    import numpy as np

    return np.exp(np.arange(math.log(2.0**-6), math.log(2.0**12), math.log(1.02)))


def calibration_upper(wrong: int, expected: float, *, prior: float, confidence: float) -> float:
    """Upper ``confidence`` quantile of the ratio observed / expected wrong answers: a Gamma posterior (Poisson
    counts) whose prior, worth ``prior`` expected errors, says the model is calibrated (ratio 1). A
    fixed-sample bound: ``Calibration`` caps a young sequence with it; a scope's own checks read it
    (``ScopeCalibration``)."""
    from scipy.stats import gamma

    return float(gamma.ppf(confidence, prior + wrong, scale=1.0 / (prior + expected)))


class Calibration:
    """The exploration sample and an anytime-valid upper confidence sequence on its ratio of wrong answers to
    estimated ones, ``r = E[wrong] / E[est]`` over explored would-be hits; ``value`` is what the pacers scale
    the model's estimates by. It checks one error model, so the pacers that read that model share one.

    For each tested ratio r it keeps the wealth of a bettor against "the ratio is at least r",
    ``prod(1 + bet * (r * est - wrong))``, each bet in [0, 0.75] fixed before its verdict from the verdicts
    before it. While the ratio is at least r that wealth is a nonnegative supermartingale started at 1, so it
    ever reaches ``1 / (1 - confidence)`` with at most ``1 - confidence`` chance (Ville's inequality), however
    often it is read: ``upper``, the tested ratio just above the largest one whose wealth is below that level,
    is below the true ratio at some time with at most that chance. It is infinite until the verdicts bound the
    ratio. What this assumes (the exploration draw, drift) is in docs/semantic.md, 'Calibration'.

    ``value`` is ``upper`` once that is informative, and until then the fixed-sample bound the cache starts
    from: ``min(upper, max(start, calibration_upper(wrong, expected)))``, ``start`` being the prior's own
    bound (2.79 at the defaults). The cap keeps a young sample's cut-off open (an infinite ratio serves
    nothing, so nothing is explored and the sample never grows), and rises with the wrong answers seen.
    ``prior`` also sets the ratio the bets start from. ``explored`` costs one pass over the tested ratios
    (631 of them); reading ``value`` after it, one Gamma quantile.
    """

    def __init__(self, *, prior: float = 2.0, confidence: float = CONFIDENCE) -> None:
        import numpy as np

        self.prior = prior
        self.confidence = confidence
        self.start = calibration_upper(0, 0.0, prior=prior, confidence=confidence)
        self.expected = 0.0
        self.wrong = 0
        self.n = 0
        self.upper = math.inf
        self._value: float | None = self.start  # None: to be computed when next read
        self._level = math.log(1.0 / (1.0 - confidence))
        self._log_wealth = np.zeros(len(_ratios()))  # of each bettor against "the ratio is at least r"

    @property
    def value(self) -> float:
        """The ratio the pacers scale the model's estimates by (see the class)."""
        if self._value is None:
            fixed = calibration_upper(self.wrong, self.expected, prior=self.prior, confidence=self.confidence)
            self._value = min(self.upper, max(self.start, fixed))
        return self._value

    @property
    def bounded(self) -> bool:
        """Whether ``value`` is the sequence's own bound (the cap no longer binds)."""
        return self.upper <= self.value

    def explored(self, est_error: float, wrong: bool) -> None:
        """One explored would-be hit: the model's estimate when it was drawn, and the judge's verdict."""
        import numpy as np

        if not 0.0 <= est_error <= 1.0:
            raise ValueError(f"est_error must be in [0, 1], got {est_error!r}")
        ratios = _ratios()
        # The Kelly stake against "at least r" for a model at the plug-in ratio q (the prior's ratio 1, worth
        # ``prior`` expected wrong answers, pooled with the sample's): 1 - q / r, for estimates well below 1.
        plug_in = (self.wrong + self.prior) / (self.expected + self.prior)
        bets = np.clip(1.0 - plug_in / ratios, 0.0, _MAX_BET)
        self._log_wealth += np.log1p(bets * (ratios * est_error - float(wrong)))
        self.expected += est_error
        self.wrong += int(wrong)
        self.n += 1
        self.upper = _upper_end(ratios, self._log_wealth < self._level)
        self._value = None  # the cap's quantile is computed when read: pacers read it every ``every`` lookups


def _upper_end(ratios: np.ndarray, kept: np.ndarray) -> float:
    """The ratio above the largest one ``kept`` (not rejected); infinite when the largest tested is kept."""
    import numpy as np

    at = np.flatnonzero(kept)
    top = int(at[-1]) + 1 if at.size else 0
    return float(ratios[top]) if top < len(ratios) else math.inf


class ScopeCalibration:
    """One scope's share of the exploration sample: observed and expected wrong answers among its explored
    would-be hits, and ``value``, the upper ``confidence`` quantile of their ratio (``calibration_upper``, a
    Gamma posterior whose prior is worth ``prior`` expected errors at ratio 1). It only ever tightens what a
    scope reads (``Pacer`` takes the larger of it and the shared ``Calibration``), so a fixed-sample bound
    read at each verdict costs a scope hits, never the shared bound's guarantee."""

    def __init__(self, *, prior: float, confidence: float = CONFIDENCE) -> None:
        self.prior = prior
        self.confidence = confidence
        self.expected = 0.0
        self.wrong = 0
        self.n = 0
        self.value = calibration_upper(0, 0.0, prior=prior, confidence=confidence)

    def explored(self, est_error: float, wrong: bool) -> None:
        self.expected += est_error
        self.wrong += int(wrong)
        self.n += 1
        self.value = calibration_upper(self.wrong, self.expected, prior=self.prior,
                                       confidence=self.confidence)


_OWN_PRIOR = 0.1
# The tail probability below which a scope's explored verdicts refute the shared calibration. Reading the own
# value only ever tightens (the larger of the two is used), so a false refutation costs a scope hits, never the
# bound; a stricter level waits for a second wrong answer while a new tenant's budget goes on answers the model
# is wrong about (see docs/semantic.md, 'New tenants').
_REFUTED = 0.1
# The floor (``Pacer.floor``) waits for stronger evidence than the refutation: at the refutation's level, a couple
# of wrong answers among a dozen explored set a floor that closes a newcomer whose served hits are all right.
_FLOORED = 0.01


@dataclass(frozen=True, slots=True)
class PacerOptions:
    """How a ``Pacer`` paces (every ``Pacer`` of a ``BoundedPolicy`` is built with the same).

    ``window``: the lookups whose estimates the cut-off is picked from; ``safety``: the share of the bound
    those estimates may spend; ``every``: lookups between two cut-offs (a young pacer recomputes at each of its
    first ``every``); ``prior`` and ``confidence``: the calibration's prior, worth ``prior`` expected wrong
    answers at ratio 1 (its start and the ratio its bets start from), and the level of its confidence
    sequence (``Calibration``) and of the scopes' own checks. A misspelt option is a
    ``TypeError``, a value out of range a ``ValueError`` naming it.
    """

    window: int = 1000
    safety: float = 0.9
    every: int = 25
    prior: float = 2.0
    confidence: float = CONFIDENCE

    def __post_init__(self) -> None:
        for name, value in (("window", self.window), ("every", self.every)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PacerOptions.{name} must be an int >= 1, got {value!r}")
        if not 0 < self.safety <= 1:
            raise ValueError(f"PacerOptions.safety must be in (0, 1], got {self.safety!r}")
        if not self.prior > 0:
            raise ValueError(f"PacerOptions.prior must be > 0, got {self.prior!r}")
        if not 0 < self.confidence < 1:
            raise ValueError(f"PacerOptions.confidence must be in (0, 1), got {self.confidence!r}")


class Pacer:
    """The cut-off on estimated error that keeps the expected error per lookup within ``max_error``.

    Built from ``options`` (a ``PacerOptions``), it remembers the estimates of the last ``window`` lookups
    (``inf`` for lookups with no candidate, 0 for exact hits) and picks the largest cut-off whose served
    estimates, summed and scaled by ``calibration``, average at most ``safety * max_error`` per lookup: serving
    the lowest estimates first gives the most hits for a given expected error. Errors already spent above
    budget are paid back over the next window.
    ``calibration`` is an anytime-valid upper confidence bound (``confidence``) on the ratio of wrong to
    estimated answers among explored would-be hits (``Calibration``): when the model underestimates the error,
    the cut-off tightens; when it overestimates, it loosens as the evidence grows.
    """

    def __init__(
        self,
        options: PacerOptions = PacerOptions(),
        *,
        calibration: Calibration | None = None,
        newcomer: bool = False,
        trust: int = 10,
    ) -> None:
        if not isinstance(options, PacerOptions):
            raise TypeError(f"options must be a PacerOptions, got {type(options).__name__}")
        window, prior, confidence = options.window, options.prior, options.confidence
        self.window = window
        self.prior = prior
        self.safety = options.safety
        self.confidence = confidence
        self.every = options.every
        import numpy as np

        # The estimates of the last ``window`` lookups, a ring (order does not matter: they are sorted).
        self._recent = np.empty(window)
        self._n = self._pos = 0
        self._since = 0
        self._cutoff = 0.0
        self.lookups = 0
        self.spent = 0.0  # expected wrong answers served so far, by the model (uncalibrated)
        # The exploration sample may be shared between pacers (one per scope) that read the same error model.
        self._calibration = calibration if calibration is not None else Calibration(prior=prior, confidence=confidence)
        # This scope's own share of it: read only once it shows the shared value to be too low here.
        # Its prior is weak (worth a tenth of an expected error): it is read only once the shared value is refuted
        # here, and then it must be free to say how wrong the model is (a prior worth 2 expected errors kept a
        # model 90 times too optimistic at 6 times).
        self._own = ScopeCalibration(prior=_OWN_PRIOR, confidence=confidence) if calibration is not None else None
        # A newcomer: a scope first seen when the shared model had already been checked on other scopes' traffic
        # (BoundedPolicy). It must earn trust: its own calibration always counts (from its prior alone until its
        # first verdict: 2.8 times the model's estimates), its cut-off never splits a run of equal
        # estimates, and once its verdicts refute the shared calibration its hits cost at least its own wrong rate
        # (``floor``). A founding scope (the model learnt on its traffic) reads its own only when refuted.
        self.newcomer = newcomer and self._own is not None
        self.trust = trust  # the verdicts of its own a newcomer's floor waits for
        if self.newcomer:
            # Its own calibration has the shared one's prior (worth ``prior`` expected errors at ratio 1), not
            # the weak one a founder's refutation check reads: with that one, a single wrong answer where half
            # of one was expected reads a ratio near 7 and closes the tenant for hundreds of lookups.
            self._own = ScopeCalibration(prior=prior, confidence=confidence)
        self.explored_here = 0  # this scope's would-be hits explored so far (drawn at decision time)

    @property
    def calibration(self) -> float:
        """The shared calibration, or this scope's own when its explored verdicts refute the shared one: a
        model learnt on other tenants' prompts may be wrong on this one's (a new tenant asking minimal pairs
        the others never asked). The own value is read only on evidence, so a new scope is not held back
        for being new; in a scope that is the whole sample the two agree and the own one never applies."""
        shared = self._calibration.value
        own = self._own
        if own is not None and (self.newcomer or self.refuted):
            return max(shared, own.value)
        return shared

    @property
    def refuted(self) -> bool:
        """Whether this scope's explored verdicts refute the shared calibration: as many wrong answers as seen
        here, or more, would be unlikely (< _REFUTED) under the shared value."""
        return self._tail() < _REFUTED

    def _tail(self) -> float:
        """The chance of as many wrong answers as this scope's explorations saw, or more, under the shared value."""
        own = self._own
        if own is None or not own.wrong:
            return 1.0
        from scipy.stats import poisson

        return float(poisson.sf(own.wrong - 1, self._calibration.value * own.expected))

    @property
    def floor(self) -> float:
        """The least error a served hit is counted at here: 0 while the shared model holds in this scope; once
        refuted, the upper ``confidence`` bound on the wrong rate among the scope's explored would-be hits
        (Jeffreys prior). A model that put this scope's wrong answers at its floor ranks them among the right
        ones, so scaling its estimates cannot price them (answers wrong one time in two, estimated at the model's
        floor: even a calibration of 100 still serves them); the rate seen here can (see docs/semantic.md,
        'New tenants')."""
        own = self._own
        # Before ``trust`` verdicts the rate says little: one wrong answer in one reads an upper bound of 1.0, and
        # a newcomer whose every hit costs 1 serves nothing, explores nothing, and never learns otherwise.
        if not self.newcomer or own is None or own.n < self.trust or self._tail() >= _FLOORED:
            return 0.0
        from scipy.stats import beta

        return float(beta.ppf(self.confidence, own.wrong + 0.5, own.n - own.wrong + 0.5))

    def scope_explored(self, est_error: float, wrong: bool) -> None:
        """A verdict on one of this scope's explored would-be hits (the shared sample is told by its owner)."""
        if self._own is not None:
            self._own.explored(est_error, wrong)

    @property
    def current(self) -> float:
        """The cut-off as last computed."""
        return self._cutoff

    def cutoff(self, max_error: float) -> float:
        if self._since >= self.every:
            self._since = 0
            self._recompute(max_error)
        elif self.lookups < self.every:
            # A young pacer (a scope's first lookups) follows each one: a scope with little traffic would
            # otherwise serve nothing until its first scheduled cut-off. The schedule itself is unchanged.
            self._recompute(max_error)
        return self._cutoff

    def record(self, est_error: float, served: bool) -> None:
        """One lookup: its candidate's estimated error (``inf`` if none) and whether it was served."""
        self._recent[self._pos] = est_error
        self._pos = (self._pos + 1) % self.window
        self._n = min(self._n + 1, self.window)
        self.lookups += 1
        self._since += 1
        if served:
            self.spent += est_error

    def replace_recent(self, estimates: Sequence[float]) -> None:
        """Re-estimate the remembered lookups (after the model was refitted)."""
        import numpy as np

        kept = np.asarray(estimates, dtype=float)[-self.window :]
        self._recent[: len(kept)] = kept
        self._n, self._pos = len(kept), len(kept) % self.window
        self._since = self.every

    def _recompute(self, max_error: float) -> None:
        import numpy as np

        n = self._n
        if n == 0:
            return
        budget = self.safety * max_error
        # Over budget so far: pay the debt back over the next window. Under budget (the cold start serves
        # nothing): spend the saving over the next window, at most 1.5 times the rate, so the cumulative
        # expected error still stays within the budget.
        # Past spending is re-read with today's calibration: the cold start spent on an unchecked model.
        calibration = self.calibration
        floor = self.floor
        # The floor prices the hits to come, not those served: re-reading them all at an upper bound on the
        # wrong rate would run up a debt that closes a newcomer for a whole window of lookups.
        balance = (budget * self.lookups - self.spent * calibration) / self.window
        target = budget + min(balance, budget / 2)
        p = np.sort(self._recent[:n])
        p = p[np.isfinite(p)]
        if target <= 0 or p.size == 0:
            self._cutoff = 0.0
            return
        # Exact hits (estimate 0) cost nothing at any floor.
        spend = np.cumsum(np.where(p > 0, np.maximum(p * calibration, floor), 0.0)) / n
        k = int(np.searchsorted(spend, target, side="right"))
        if self.newcomer and 0 < k < p.size and p[k] == p[k - 1]:
            # The budget affords only part of a run of equal estimates (the model's floor): a cut-off serves all
            # of them or none, so none (serving all overspent a new tenant's budget ten times over).
            k = int(np.searchsorted(p, p[k], side="left"))
        self._cutoff = float(p[k - 1]) if k > 0 else 0.0
