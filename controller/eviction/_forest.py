"""Fast prediction for the learned policy's model (numpy; imported only with a model)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import LearnedModelError


class Forest:
    """An XGBoost tree ensemble (binary logistic) evaluated with numpy, all trees at once, level by level.

    Exists because eviction asks for a few dozen predictions at a time, hundreds of thousands of times:
    ``Booster.inplace_predict`` costs a fixed ~0.1-1 ms per call (configuration, threads), this ~50 us for 64
    rows. It reads the booster's own JSON model and reproduces ``inplace_predict`` (float32 comparisons,
    ``x < split`` goes left, NaN takes the default branch), which the tests check.
    """

    def __init__(self, model: dict[str, Any]) -> None:
        learner = model["learner"]
        trees = learner["gradient_booster"]["model"]["trees"]
        objective = learner["objective"]["name"]
        if objective not in ("binary:logistic", "reg:squarederror") or any(t["categories"] for t in trees):
            raise LearnedModelError("only numerical binary:logistic or reg:squarederror boosters can be evaluated")
        self.logistic = objective == "binary:logistic"
        offsets = np.cumsum([0] + [len(t["left_children"]) for t in trees])
        self.roots = offsets[:-1]
        left, right, feature, split, default_left = [], [], [], [], []
        for offset, t in zip(self.roots, trees, strict=True):
            n = len(t["left_children"])
            own = np.arange(n) + offset
            lc, rc = np.array(t["left_children"]), np.array(t["right_children"])
            leaf = lc < 0
            left.append(np.where(leaf, own, lc + offset))  # a leaf points to itself: the walk stays there
            right.append(np.where(leaf, own, rc + offset))
            feature.append(np.where(leaf, 0, t["split_indices"]))
            split.append(t["split_conditions"])
            default_left.append(np.array(t["default_left"], dtype=bool) | leaf)
        self.left = np.concatenate(left)
        self.right = np.concatenate(right)
        self.feature = np.concatenate(feature)
        self.split = np.concatenate(split).astype(np.float32)
        self.default_left = np.concatenate(default_left)
        self.leaf_value = self.split  # a leaf's split condition holds its value
        self.depth = max(_depth(t) for t in trees) if trees else 0
        base = float(learner["learner_model_param"]["base_score"].strip("[]"))
        self.base_margin = float(np.log(base / (1 - base))) if self.logistic else base

    def predict(self, rows: np.ndarray) -> np.ndarray:
        x = rows.astype(np.float32)
        node = np.broadcast_to(self.roots, (len(x), len(self.roots)))
        row = np.arange(len(x))[:, None]
        for _ in range(self.depth):
            value = x[row, self.feature[node]]
            go_left = np.where(np.isnan(value), self.default_left[node], value < self.split[node])
            node = np.where(go_left, self.left[node], self.right[node])
        margin = self.leaf_value[node].sum(axis=1, dtype=np.float64) + self.base_margin
        return 1.0 / (1.0 + np.exp(-margin)) if self.logistic else margin


def _depth(tree: dict[str, Any]) -> int:
    left, right = tree["left_children"], tree["right_children"]
    deepest, stack = 0, [(0, 0)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if left[node] >= 0:
            stack += [(left[node], depth + 1), (right[node], depth + 1)]
    return deepest
