"""The semantic decision: serve a neighbour's answer only while the error it costs stays within the rule's bound.

The bound ``max_error`` is on the error rate per lookup (wrong served answers / lookups), the rate the rule's
user sees. A would-be hit is served when its estimated probability of being wrong is at most the current
cut-off ``threshold``; the cut-off is paced so that the estimated error of everything served stays within the
bound, inflated by a conservative calibration factor measured on the exploration sample.

One module per job, their public names gathered here:

- ``_lexical``: text features, how a prompt differs from a stored one word by word (``lexical``);
- ``_neighbourhood``: the candidate answer among the neighbours and its features (``neighbourhood``);
- ``_error_model``: one logistic model of P(wrong | features), refitted online from verdicts (``ErrorModel``);
- ``_pacing``: the cut-off per scope (``Pacer``) and the exploration sample that calibrates it
  (``Calibration``);
- ``_policies``: ``BoundedPolicy``, ``StaticPolicy`` (the comparison baseline: the nearest entry at cosine
  similarity >= threshold), the ``DecisionPolicy`` Protocol and the ``POLICIES`` registry.

docs/semantic.md describes the decision and the evidence behind each constant.
"""

from __future__ import annotations

from ._error_model import ErrorModel
from ._lexical import LEXICAL, lexical
from ._neighbourhood import CLASSIFIED, FEATURES, Candidate, neighbourhood
from ._pacing import CONFIDENCE, Calibration, Pacer, PacerOptions, calibration_upper
from ._policies import (
    POLICIES,
    AnswerClusters,
    BoundedPolicy,
    DecisionPolicy,
    PolicyOptions,
    Readings,
    SemanticDecision,
    StaticPolicy,
)

__all__ = [
    "CLASSIFIED",
    "CONFIDENCE",
    "FEATURES",
    "LEXICAL",
    "POLICIES",
    "AnswerClusters",
    "BoundedPolicy",
    "Calibration",
    "Candidate",
    "DecisionPolicy",
    "ErrorModel",
    "Pacer",
    "PacerOptions",
    "PolicyOptions",
    "Readings",
    "SemanticDecision",
    "StaticPolicy",
    "calibration_upper",
    "lexical",
    "neighbourhood",
]
