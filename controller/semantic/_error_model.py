"""The error model: P(the candidate's answer is wrong | its features), learnt online from judge verdicts."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from ._neighbourhood import CLASSIFIED, FEATURES, UNCLASSIFIED

if TYPE_CHECKING:
    import numpy as np

    from ._prior import ErrorPrior

__all__ = ["ErrorModel", "fit_logistic"]


def _with_classifier_blanked(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each observation the answer classifier spoke for, twice at half its weight: as observed, and with the
    ``CLASSIFIED`` features at their no-model values. The fit's other weights then also stand on their own
    for lookups the classifier cannot speak for (a scope without a model, a cluster it never saw), instead of
    being learnt only next to a share such lookups do not have. Without it, a model fitted on classified
    lookups and then asked about minimal pairs the classifier has no share for serves more of those traps
    (see docs/semantic.md, 'Answer classifier')."""
    import numpy as np

    if x.shape[1] != len(FEATURES):
        return x, y, w
    spoke = x[:, FEATURES.index("classified")] != 0.0
    if not spoke.any():
        return x, y, w
    blank = x[spoke].copy()
    blank[:, [FEATURES.index(name) for name in CLASSIFIED]] = UNCLASSIFIED
    half = np.where(spoke, w / 2.0, w)
    return np.vstack([x, blank]), np.concatenate([y, y[spoke]]), np.concatenate([half, w[spoke] / 2.0])


# Differences between the prompt and the stored one that can only make the stored answer *less* likely to be
# right: a negation, a number, a name, word order, a minimal edit. Such pairs are rare in ordinary traffic, so a
# fit left free can give their weights the wrong sign by chance, and then serves entity swaps ("from London to
# Manchester" for "from Manchester to London"). Their weights are held >= 0 (see docs/semantic.md, 'Error model').
_RAISING_FEATURES = ("minimal_pair", "numbers_differ", "negation_differs", "reordered", "names_differ")
_RAISING = [FEATURES.index(name) for name in _RAISING_FEATURES]


def _fit_raising_nonnegative(
    xs: np.ndarray, y: np.ndarray, w: np.ndarray, coef: np.ndarray, intercept: float,
    prior: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, float]:
    """The same L2-penalised weighted logistic regression as scikit-learn's (C = 1, standardised ``xs``), with
    the ``_RAISING`` weights bounded below by 0 (L-BFGS-B from the free fit, clipped). With ``prior``
    (``(centre, precision)`` over the weights then the intercept), the penalty is the Gaussian prior's
    ``(theta - centre)' precision (theta - centre) / 2`` instead (``_map_fit``)."""
    import numpy as np
    from scipy.optimize import minimize

    n = xs.shape[1]

    def loss(theta: np.ndarray) -> tuple[float, np.ndarray]:
        z = xs @ theta[:n] + theta[n]
        # log(1 + e^z) - y z, stably; its gradient is (sigmoid(z) - y)
        value = float(np.sum(w * (np.logaddexp(0.0, z) - y * z)))
        r = w * (1.0 / (1.0 + np.exp(-z)) - y)
        grad = np.concatenate([xs.T @ r, [r.sum()]])
        if prior is None:
            return value + 0.5 * theta[:n] @ theta[:n], grad + np.concatenate([theta[:n], [0.0]])
        centre, precision = prior
        pulled = precision @ (theta - centre)
        return value + 0.5 * float((theta - centre) @ pulled), grad + pulled

    start = np.concatenate([coef, [intercept]])
    start[_RAISING] = np.maximum(start[_RAISING], 0.0)
    bounds = [(0.0, None) if i in _RAISING else (None, None) for i in range(n)] + [(None, None)]
    result = minimize(loss, start, jac=True, method="L-BFGS-B", bounds=bounds, options={"maxiter": 500})
    return result.x[:n].copy(), float(result.x[n])


def fit_logistic(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, float, np.ndarray, np.ndarray]:
    """The error model's fit without a prior: ``(coef, intercept, mean, scale)`` of the L2-penalised (C = 1)
    weighted logistic regression of ``y`` on ``x`` standardised by its own mean and scale, the ``_RAISING``
    weights held >= 0. Both classes must be present. The prior is fitted offline with it too."""
    from sklearn.linear_model import LogisticRegression

    mean, scale = x.mean(axis=0), x.std(axis=0)
    scale[scale == 0] = 1.0
    xs = (x - mean) / scale
    fit = LogisticRegression(C=1.0, solver="newton-cholesky", max_iter=100).fit(xs, y, sample_weight=w)
    coef, intercept = fit.coef_[0].copy(), float(fit.intercept_[0])
    if x.shape[1] == len(FEATURES) and (coef[_RAISING] < 0).any():
        coef, intercept = _fit_raising_nonnegative(xs, y, w, coef, intercept)
    return coef, intercept, mean, scale


def _map_fit(
    xs: np.ndarray, y: np.ndarray, w: np.ndarray, centre: np.ndarray, precision: np.ndarray, start: np.ndarray
) -> np.ndarray:
    """The weighted logistic regression's maximum a posteriori weights (then the intercept) under a Gaussian
    prior ``N(centre, precision^-1)``, over standardised ``xs``: Newton's method from ``start`` with a
    backtracking line search. The objective is strictly convex (``precision`` is positive definite), so the
    minimum is unique and the answer does not depend on ``start`` beyond the tolerance."""
    import numpy as np

    design = np.hstack([xs, np.ones((xs.shape[0], 1))])

    def objective(theta: np.ndarray) -> float:
        z = design @ theta
        d = theta - centre
        return float(np.sum(w * (np.logaddexp(0.0, z) - y * z)) + 0.5 * d @ precision @ d)

    theta = start.copy()
    value = objective(theta)
    for _ in range(50):
        z = design @ theta
        p = 1.0 / (1.0 + np.exp(-z))
        grad = design.T @ (w * (p - y)) + precision @ (theta - centre)
        hessian = design.T @ (design * (w * p * (1.0 - p))[:, None]) + precision
        step = np.linalg.solve(hessian, grad)
        decrease = float(grad @ step)
        if decrease < 1e-10 * (1.0 + abs(value)):
            break
        t = 1.0
        while t > 1e-8:
            trial = theta - t * step
            trial_value = objective(trial)
            if trial_value <= value - 1e-4 * t * decrease:
                break
            t /= 2.0
        else:
            break
        theta, value = trial, trial_value
    return theta


class ErrorModel:
    """P(the candidate's answer is wrong | features): one weighted logistic regression over the last ``memory``
    observations, refitted every ``refit_every`` new ones (sooner while few: every ``refit_growth`` of them).

    Observations are a biased sample (every judged miss, but only the explored share of would-be hits), so
    each carries the inverse of its chance of being observed as its weight: the fit then stands for all
    lookups, the served region included. Until it has seen ``min_each`` wrong and ``min_each`` right
    observations it knows nothing and predicts 1.0 (never serve); no estimate is below ``floor``.

    With a ``prior`` (an ``ErrorPrior``, fitted offline on other data), it starts as the prior's model and
    serves from its first lookup; each refit is then the maximum a posteriori fit of its observations under
    a Gaussian prior centred on the prior's weights, of precision ``prior.strength x prior.information`` (worth
    that many observations like the ones the prior was fitted on) plus the C = 1 ridge, in the prior's
    standardisation: a model with little evidence stays near the prior, one with much moves to its own fit
    (see docs/semantic.md, 'Prior').
    scikit-learn (about 0.9 s to import) is imported by ``prepare``, which the cache calls before it takes its
    lock to record a verdict, so the first fit, under that lock, does not hold other lookups up for it.
    """

    def __init__(
        self,
        *,
        min_each: int = 10,
        refit_growth: float = 0.25,
        refit_every: int = 500,
        memory: int = 3000,
        floor: float = 0.002,
        prior: ErrorPrior | None = None,
    ) -> None:
        self.min_each = min_each
        self.refit_growth = refit_growth
        self.refit_every = refit_every
        self.memory = memory
        self.floor = floor
        self._x: deque[np.ndarray] = deque(maxlen=memory)
        self._y: deque[int] = deque(maxlen=memory)
        self._w: deque[float] = deque(maxlen=memory)
        self._seen = 0
        self._wrong = 0
        self._fitted_at = 0
        self._weight_since = 0.0  # weight of the observations since the last fit
        self.fits = 0  # how many times it was fitted: a pacer re-estimates its lookups when this moved
        self._coef: np.ndarray | None = None
        self._intercept = 0.0
        self._mean: np.ndarray | None = None
        self._scale: np.ndarray | None = None
        self.prior = prior
        self._centre: np.ndarray | None = None
        self._precision: np.ndarray | None = None
        if prior is not None:
            import numpy as np

            if prior.features != FEATURES:
                raise ValueError(f"the prior was fitted on features {list(prior.features)}, expected {list(FEATURES)}")
            self._mean, self._scale = prior.mean, prior.scale
            self._coef, self._intercept = prior.coef.copy(), prior.intercept
            self._centre = np.concatenate([prior.coef, [prior.intercept]])
            # C = 1 on the weights' moves; a trace on the intercept keeps every Newton step solvable when the
            # prior is worth nothing and the fit saturates (p (1 - p) = 0 on every observation).
            ridge = np.diag(np.concatenate([np.ones(len(FEATURES)), [1e-6]]))
            self._precision = prior.strength * prior.information + ridge

    def __len__(self) -> int:
        return self._seen

    @property
    def ready(self) -> bool:
        return self._coef is not None

    @staticmethod
    def prepare() -> None:
        """Import what a fit needs (once per process; then a dictionary look-up)."""
        import sklearn.linear_model  # noqa: F401

    def observe(self, features: np.ndarray, wrong: bool, weight: float = 1.0) -> bool:
        """Record one observation; refit if due. Returns True when the model changed."""
        self._x.append(features)
        self._y.append(int(wrong))
        self._w.append(weight)
        self._seen += 1
        self._wrong += int(wrong)
        # An explored verdict weighs 1/chance: it moves the fit as much as that many plain ones, so it brings
        # the next refit as much nearer (a model wrong where it serves is corrected within a few of them).
        self._weight_since += weight
        # A prior makes every fit well posed (and the model ready from the start): no cold start to wait out.
        if self.prior is None and min(self._wrong, self._seen - self._wrong) < self.min_each:
            return False
        due = min(self.refit_every, max(1, int(self._fitted_at * self.refit_growth)))
        if self._coef is not None and self._weight_since < due:
            return False
        self._fit()
        return True

    def _fit(self) -> None:
        import numpy as np

        # Recent observations only (``memory``): neighbourhoods change as the clusters grow, and the cold
        # start's observations would keep the model pessimistic for the rest of the stream.
        x, y, w = np.asarray(self._x), np.asarray(self._y), np.asarray(self._w)
        if self._centre is not None:
            self._fit_with_prior(*_with_classifier_blanked(x, y, w.astype(float)))
            return
        if y.min() == y.max():
            return  # the window holds one class only: keep the last fit
        coef, intercept, mean, scale = fit_logistic(*_with_classifier_blanked(x, y, w))
        self._mean, self._scale = mean, scale
        self._coef, self._intercept = coef, intercept
        self._fitted_at = self._seen
        self._weight_since = 0.0
        self.fits += 1

    def _fit_with_prior(self, x: np.ndarray, y: np.ndarray, w: np.ndarray) -> None:
        """The maximum a posteriori fit under the prior, in its standardisation, signs held (``_RAISING``)."""
        import numpy as np

        assert self._centre is not None and self._precision is not None and self._coef is not None
        xs = (x - self._mean) / self._scale
        start = np.concatenate([self._coef, [self._intercept]])
        theta = _map_fit(xs, y.astype(float), w, self._centre, self._precision, start)
        coef, intercept = theta[:-1].copy(), float(theta[-1])
        if (coef[_RAISING] < 0).any():
            coef, intercept = _fit_raising_nonnegative(xs, y, w, coef, intercept, (self._centre, self._precision))
        self._coef, self._intercept = coef, intercept
        self._fitted_at = self._seen
        self._weight_since = 0.0
        self.fits += 1

    def predict(self, features: np.ndarray) -> np.ndarray:
        """P(wrong) for each row of ``features`` (n, len(FEATURES)); all 1.0 before the first fit."""
        import numpy as np

        features = np.atleast_2d(features)
        if self._coef is None:
            return np.ones(features.shape[0])
        z = ((features - self._mean) / self._scale) @ self._coef + self._intercept
        # A logistic tail falls faster than errors do: no neighbourhood is trusted beyond `floor`.
        return np.maximum(1.0 / (1.0 + np.exp(-z)), self.floor)
