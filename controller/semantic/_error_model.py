"""The error model: P(the candidate's answer is wrong | its features), learnt online from judge verdicts."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from ._neighbourhood import CLASSIFIED, FEATURES, UNCLASSIFIED

if TYPE_CHECKING:
    import numpy as np

__all__ = ["ErrorModel"]


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
    xs: np.ndarray, y: np.ndarray, w: np.ndarray, coef: np.ndarray, intercept: float
) -> tuple[np.ndarray, float]:
    """The same L2-penalised weighted logistic regression as scikit-learn's (C = 1, standardised ``xs``), with
    the ``_RAISING`` weights bounded below by 0 (L-BFGS-B from the free fit, clipped)."""
    import numpy as np
    from scipy.optimize import minimize

    n = xs.shape[1]

    def loss(theta: np.ndarray) -> tuple[float, np.ndarray]:
        z = xs @ theta[:n] + theta[n]
        # log(1 + e^z) - y z, stably; its gradient is (sigmoid(z) - y)
        value = float(np.sum(w * (np.logaddexp(0.0, z) - y * z)) + 0.5 * theta[:n] @ theta[:n])
        r = w * (1.0 / (1.0 + np.exp(-z)) - y)
        return value, np.concatenate([xs.T @ r + theta[:n], [r.sum()]])

    start = np.concatenate([coef, [intercept]])
    start[_RAISING] = np.maximum(start[_RAISING], 0.0)
    bounds = [(0.0, None) if i in _RAISING else (None, None) for i in range(n)] + [(None, None)]
    result = minimize(loss, start, jac=True, method="L-BFGS-B", bounds=bounds, options={"maxiter": 500})
    return result.x[:n].copy(), float(result.x[n])


class ErrorModel:
    """P(the candidate's answer is wrong | features): one weighted logistic regression over the last ``memory``
    observations, refitted every ``refit_every`` new ones (sooner while few: every ``refit_growth`` of them).

    Observations are a biased sample (every judged miss, but only the explored share of would-be hits), so
    each carries the inverse of its chance of being observed as its weight: the fit then stands for all
    lookups, the served region included. Until it has seen ``min_each`` wrong and ``min_each`` right
    observations it knows nothing and predicts 1.0 (never serve); no estimate is below ``floor``.
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
        if min(self._wrong, self._seen - self._wrong) < self.min_each:
            return False
        due = min(self.refit_every, max(1, int(self._fitted_at * self.refit_growth)))
        if self._coef is not None and self._weight_since < due:
            return False
        self._fit()
        return True

    def _fit(self) -> None:
        import numpy as np
        from sklearn.linear_model import LogisticRegression

        # Recent observations only (``memory``): neighbourhoods change as the clusters grow, and the cold
        # start's observations would keep the model pessimistic for the rest of the stream.
        x, y, w = np.asarray(self._x), np.asarray(self._y), np.asarray(self._w)
        if y.min() == y.max():
            return  # the window holds one class only: keep the last fit
        x, y, w = _with_classifier_blanked(x, y, w)
        mean, scale = x.mean(axis=0), x.std(axis=0)
        scale[scale == 0] = 1.0
        xs = (x - mean) / scale
        fit = LogisticRegression(C=1.0, solver="newton-cholesky", max_iter=100).fit(xs, y, sample_weight=w)
        coef, intercept = fit.coef_[0].copy(), float(fit.intercept_[0])
        if x.shape[1] == len(FEATURES) and (coef[_RAISING] < 0).any():
            coef, intercept = _fit_raising_nonnegative(xs, y, w, coef, intercept)
        self._mean, self._scale = mean, scale
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
