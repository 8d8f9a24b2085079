"""The error model's prior: the same logistic model fitted offline on public data and shipped with the package
(``prior.json``), from which every rule's error model starts.

Saved as one JSON document, ``{"format": FORMAT, "version": FORMAT_VERSION, "features": [...], "coef": [...],
"intercept": ..., "mean": [...], "scale": [...], "information": [[...]], "strength": ..., "fitted_on": [...],
...}``, never a pickle, so a prior can be checked against the features the loading code computes and read with
any JSON tool. ``coef`` and ``intercept`` act on features standardised by ``mean`` and ``scale``;
``information`` is the fit's Fisher information per unit of observation weight (standardised coefficients,
then the intercept), so a Gaussian prior of precision ``strength x information`` is worth ``strength``
observations like the ones it was fitted on. ``bench/semantic_prior.py`` refits it (``make semantic-prior``);
docs/semantic.md ('Prior') says how and on what.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._files import read_bounded
from ..errors import SemanticError
from ._neighbourhood import FEATURES

if TYPE_CHECKING:
    import numpy as np

__all__ = ["FORMAT", "FORMAT_VERSION", "SHIPPED_PRIOR", "ErrorPrior", "load_prior", "shipped_prior"]

FORMAT = "evocache-semantic-error-prior"
FORMAT_VERSION = 1
SHIPPED_PRIOR = Path(__file__).with_name("prior.json")
"""The prior shipped with the package (package data): what a ``BoundedPolicy`` starts from by default."""
MAX_PRIOR_BYTES = 1024 * 1024
"""The largest prior file read: two dozen weights and their information matrix take a few kilobytes."""


@dataclass(frozen=True, eq=False)
class ErrorPrior:
    """A fitted error model and what it was fitted on. ``predict`` maps feature rows (``features`` order) to
    P(wrong). ``strength``: the pseudo-observations the prior is worth when an online fit pools it with a
    scope's own verdicts. ``fitted_on``: one record per data set (name, file, licence, source, observations);
    ``meta``: everything else the fit recorded (its settings, held-out evidence), kept as read."""

    features: tuple[str, ...]
    coef: np.ndarray
    intercept: float
    mean: np.ndarray
    scale: np.ndarray
    information: np.ndarray
    strength: float
    fitted_on: tuple[dict[str, Any], ...] = ()
    meta: dict[str, Any] = field(default_factory=dict)

    def predict(self, rows: np.ndarray) -> np.ndarray:
        """P(wrong) for each row of ``rows`` (n x len(features)), without the error model's floor."""
        import numpy as np

        z = ((np.atleast_2d(rows) - self.mean) / self.scale) @ self.coef + self.intercept
        return 1.0 / (1.0 + np.exp(-z))

    def with_strength(self, strength: float) -> ErrorPrior:
        """The same prior worth ``strength`` pseudo-observations."""
        _check_strength(strength, "strength")
        return ErrorPrior(self.features, self.coef, self.intercept, self.mean, self.scale, self.information,
                          float(strength), self.fitted_on, self.meta)

    def to_json(self) -> str:
        doc = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            **self.meta,
            "features": list(self.features),
            "coef": [float(v) for v in self.coef],
            "intercept": float(self.intercept),
            "mean": [float(v) for v in self.mean],
            "scale": [float(v) for v in self.scale],
            "information": [[float(v) for v in row] for row in self.information],
            "strength": float(self.strength),
            "fitted_on": list(self.fitted_on),
        }
        return json.dumps(doc, indent=1) + "\n"

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json(), encoding="utf-8")

    @classmethod
    def from_json(cls, text: str, *, source: str = "prior") -> ErrorPrior:
        """Read a prior written by ``to_json``. ``SemanticError`` naming ``source`` for a document that is not
        JSON, of another format or version, fitted on other features than ``FEATURES``, or whose numbers are
        not a usable model (wrong lengths, not finite, a scale that is not positive, a weight of a feature that
        can only raise the error below 0)."""
        import numpy as np

        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise SemanticError(f"{source}: not JSON ({exc})") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise SemanticError(f"{source}: not an evocache semantic error prior (no format {FORMAT!r})")
        if doc.get("version") != FORMAT_VERSION:
            raise SemanticError(
                f"{source}: prior format version {doc.get('version')!r}; this evocache reads version {FORMAT_VERSION}"
            )
        features = doc.get("features")
        if not isinstance(features, list) or tuple(features) != FEATURES:
            raise SemanticError(f"{source}: fitted on features {features!r}, expected {list(FEATURES)}")
        n = len(FEATURES)

        def array(name: str, shape: tuple[int, ...], what: str) -> np.ndarray:
            try:
                value = np.asarray(doc.get(name), dtype=float)
            except (TypeError, ValueError):
                value = None
            if value is None or value.shape != shape or not np.isfinite(value).all():
                raise SemanticError(f"{source}: {name} must be {what}")
            return value

        numbers = f"a list of {n} finite numbers"
        coef, mean, scale = (array(name, (n,), numbers) for name in ("coef", "mean", "scale"))
        intercept = doc.get("intercept")
        if isinstance(intercept, bool) or not isinstance(intercept, int | float) or not math.isfinite(intercept):
            raise SemanticError(f"{source}: intercept must be a finite number")
        if not (scale > 0).all():
            raise SemanticError(f"{source}: scale must be positive")
        matrix = f"a symmetric positive semi-definite {n + 1} x {n + 1} matrix of finite numbers"
        information = array("information", (n + 1, n + 1), matrix)
        # An information matrix is never negative: the online fit's penalty must be a convex bowl.
        if not np.allclose(information, information.T) or np.linalg.eigvalsh(information).min() < -1e-9:
            raise SemanticError(f"{source}: information must be {matrix}")
        from ._error_model import _RAISING_FEATURES

        negative = [name for name in _RAISING_FEATURES if coef[FEATURES.index(name)] < 0]
        if negative:
            raise SemanticError(f"{source}: weights of {negative} are below 0; they can only raise the error")
        strength = doc.get("strength")
        try:
            _check_strength(strength, "strength")
        except ValueError as exc:
            raise SemanticError(f"{source}: {exc}") from None
        fitted_on = doc.get("fitted_on", [])
        if not isinstance(fitted_on, list) or not all(isinstance(d, dict) for d in fitted_on):
            raise SemanticError(f"{source}: fitted_on must be a list of records")
        known = {"format", "version", "features", "coef", "intercept", "mean", "scale", "information", "strength",
                 "fitted_on"}
        meta = {key: value for key, value in doc.items() if key not in known}
        for array in (coef, mean, scale, information):
            array.setflags(write=False)  # one prior starts many models: none may change it
        return cls(FEATURES, coef, float(intercept), mean, scale, information, float(strength), tuple(fitted_on),
                   meta)

    @classmethod
    def load(cls, path: str | Path) -> ErrorPrior:
        """``from_json`` of the file at ``path``; errors name the file. A file over ``MAX_PRIOR_BYTES`` is
        refused before it is read whole. ``OSError`` when it cannot be read."""
        data, _ = read_bounded(path, MAX_PRIOR_BYTES)  # a FIFO or device at the path is refused, not waited on
        if len(data) > MAX_PRIOR_BYTES:
            raise SemanticError(f"{path}: larger than {MAX_PRIOR_BYTES} bytes, not a prior")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise SemanticError(f"{path}: not UTF-8 text") from None
        return cls.from_json(text, source=str(path))


def _check_strength(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


@functools.cache
def _load(path: str, mtime_ns: int, size: int) -> ErrorPrior:
    return ErrorPrior.load(path)


def load_prior(path: str | Path) -> ErrorPrior:
    """The prior in ``path``, read once per version of the file (every rule's policy shares it: it is read,
    never written, by the error models it starts)."""
    stat = Path(path).stat()
    return _load(str(Path(path).resolve()), stat.st_mtime_ns, stat.st_size)


def shipped_prior() -> ErrorPrior:
    """The prior shipped with the package (``SHIPPED_PRIOR``)."""
    return load_prior(SHIPPED_PRIOR)


def information_matrix(xs: np.ndarray, p: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The Fisher information of a logistic fit per unit of weight: ``[xs, 1]' diag(w p (1 - p)) [xs, 1] / sum w``,
    over standardised rows ``xs`` with fitted probabilities ``p`` and weights ``w``."""
    import numpy as np

    design = np.hstack([xs, np.ones((xs.shape[0], 1))])
    v = w * p * (1.0 - p)
    info = design.T @ (design * v[:, None]) / w.sum()
    return (info + info.T) / 2.0
