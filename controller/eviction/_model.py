"""The learned policy's model: an XGBoost classifier plus the metadata that says what it was trained on.

Saved as one JSON document, ``{"format": FORMAT, "version": FORMAT_VERSION, "features": [...], ...,
"booster": <xgboost's own JSON model>}``, so a model can be read back, checked against the features the
loading code computes, and inspected with any JSON tool. ``xgboost`` is imported only when a model is
trained or loaded: importing the eviction package stays cheap.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._files import read_bounded
from ..errors import LearnedModelError

if TYPE_CHECKING:
    import numpy as np

    from ._forest import Forest

FORMAT = "evocache-learned-eviction"
FORMAT_VERSION = 1
MAX_MODEL_BYTES = 64 * 1024 * 1024
"""The largest model file read: a few hundred shallow trees are well under a megabyte."""

_PARAMS: dict[str, Any] = {
    "objective": "binary:logistic",
    "tree_method": "hist",
    "max_depth": 6,
    "eta": 0.15,
    "subsample": 1.0,
    "min_child_weight": 20,
    "seed": 0,
}


@dataclass(frozen=True)
class TrainingWindow:
    """What a model was trained on: sample ids ``[first, last]``, the policy's access count when training
    started (``tick``), how many samples and how many of them were positive."""

    first: int
    last: int
    tick: int
    samples: int
    positives: int


@dataclass(frozen=True, eq=False)
class LearnedModel:
    """A trained booster and what it expects. ``predict`` maps feature rows (in ``features`` order) to the
    probability that the object is accessed again within the policy's horizon."""

    features: tuple[str, ...]
    window: TrainingWindow
    booster: Any = field(repr=False)
    forest: Forest = field(init=False, repr=False)

    def __post_init__(self) -> None:
        from ._forest import Forest

        object.__setattr__(self, "forest", Forest(json.loads(bytes(self.booster.save_raw("json")))))

    def predict(self, rows: np.ndarray) -> np.ndarray:
        """Probabilities for ``rows`` (n x len(features), float; NaN = unknown), as a float array."""
        return self.forest.predict(rows)

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT,
                "version": FORMAT_VERSION,
                "features": list(self.features),
                "window": self.window.__dict__,
                "booster": json.loads(bytes(self.booster.save_raw("json"))),
            }
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def from_json(cls, text: str, *, features: Sequence[str] | None = None, source: str = "model") -> LearnedModel:
        """Read a model written by ``to_json``. Raises ``LearnedModelError`` naming ``source`` for a document
        of another format or version, or (given ``features``) one trained on other features."""
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise LearnedModelError(f"{source}: not JSON ({exc})") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise LearnedModelError(f"{source}: not an evocache learned eviction model (no format {FORMAT!r})")
        if doc.get("version") != FORMAT_VERSION:
            raise LearnedModelError(
                f"{source}: model format version {doc.get('version')!r}; this evocache reads version {FORMAT_VERSION}"
            )
        raw_features, raw_window = doc.get("features"), doc.get("window")
        if not isinstance(raw_features, list) or not all(isinstance(f, str) for f in raw_features):
            raise LearnedModelError(f"{source}: features must be a list of names")
        saved = tuple(raw_features)
        if features is not None and saved != tuple(features):
            raise LearnedModelError(f"{source}: trained on features {list(saved)}, expected {list(features)}")
        try:
            window = TrainingWindow(**raw_window) if isinstance(raw_window, dict) else None
        except TypeError:
            window = None
        if window is None or not all(isinstance(v, int) for v in window.__dict__.values()):
            raise LearnedModelError(f"{source}: window must hold first, last, tick, samples and positives")
        import xgboost

        booster = xgboost.Booster()
        try:
            booster.load_model(bytearray(json.dumps(doc.get("booster")).encode()))
            return cls(saved, window, booster)
        except (xgboost.core.XGBoostError, ValueError, KeyError, TypeError) as exc:
            raise LearnedModelError(f"{source}: the booster cannot be read ({_first_line(exc)})") from None

    @classmethod
    def load(cls, path: str | Path, *, features: Sequence[str] | None = None) -> LearnedModel:
        """``from_json`` of the file at ``path``; errors name the file. A file over ``MAX_MODEL_BYTES`` is
        refused before it is read whole. Raises ``OSError`` when it cannot be read."""
        data, _ = read_bounded(path, MAX_MODEL_BYTES)  # a FIFO or device at the path is refused, not waited on
        if len(data) > MAX_MODEL_BYTES:
            raise LearnedModelError(f"{path}: larger than {MAX_MODEL_BYTES} bytes, not a model this policy reads")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise LearnedModelError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        return cls.from_json(text, features=features, source=str(path))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def train(
    rows: np.ndarray,
    labels: np.ndarray,
    *,
    features: Sequence[str],
    window: TrainingWindow,
    rounds: int,
    threads: int,
    depth: int = 6,
    monotone: dict[str, int] | None = None,
    objective: str = "binary:logistic",
) -> LearnedModel:
    """Fit a classifier of ``labels`` (0/1) on ``rows``. Deterministic for the same data, rounds and threads
    (histogram trees, fixed seed, no sampling)."""
    import xgboost

    data = xgboost.DMatrix(rows, label=labels, feature_names=list(features))
    params = {**_PARAMS, "nthread": threads, "max_depth": depth, "objective": objective}
    if monotone:
        params["monotone_constraints"] = "(" + ",".join(str(monotone.get(f, 0)) for f in features) + ")"
    booster = xgboost.train(params, data, num_boost_round=rounds)
    booster.feature_names = None  # inplace_predict on bare arrays: the order is fixed by ``features``
    return LearnedModel(tuple(features), window, booster)
