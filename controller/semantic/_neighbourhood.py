"""Neighbourhood features: the candidate answer of a lookup and what the error model reads of it.

``neighbourhood`` turns a neighbour list and the answer clusters (built from judge links only) into a
candidate entry and its features: similarity, margin to the nearest other cluster, vote of the top-k, the
entry's own verdicts, the ``lexical`` difference of the prompt and the entry's stored prompt, and what the
scope's answer classifier says of the candidate's cluster.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

from ._index import Neighbour
from ._lexical import LEXICAL, lexical

if TYPE_CHECKING:
    import numpy as np

__all__ = ["CLASSIFIED", "FEATURES", "UNCLASSIFIED", "Candidate", "neighbourhood"]

# the scope has a model, the share it gives the candidate's cluster (and its log), the largest share of another.
CLASSIFIED = ("classified", "answer_share", "answer_log_share", "rival_share")
FEATURES = (
    "similarity", "gap_to_top", "margin", "vote", "share_of_k", "cluster_size", "similarity_sq", "entry_wrong",
    "entry_right", *LEXICAL, *CLASSIFIED,
)
_SHARE_FLOOR = 1e-4  # the log of a share is read from this up
_VOTE_TEMPERATURE = 0.02  # softmax temperature over similarities: 0.02 apart weighs e times less
_NO_RIVAL = 0.0  # the similarity assumed for "another answer" when none is among the neighbours
UNCLASSIFIED = (0.0, 0.0, math.log(_SHARE_FLOOR), 0.0)
"""The ``CLASSIFIED`` features of a lookup the answer classifier cannot speak for (no model, or no share for the
candidate's cluster)."""


class Candidate(NamedTuple):
    """The entry a lookup would serve and the features the error model reads. ``explore_chance``: the chance
    the lookup had of being explored (0 when it was not a would-be hit), the inverse weight of its verdict."""

    entry_id: str
    similarity: float
    features: np.ndarray  # float64, FEATURES order
    explore_chance: float = 0.0
    scope: Hashable = None  # where it was looked up: its explored verdict also checks the model there
    # Whether its exploration was drawn at the rule's chance (the uniform sample that calibrates the shared
    # model), not only because its scope had yet to earn trust (``BoundedPolicy(trust=)``).
    sampled: bool = True


def neighbourhood(
    neighbours: Sequence[Neighbour],
    cluster_of: Callable[[str], str],
    cluster_size: Callable[[str], int],
    evidence: Mapping[str, tuple[int, int]] | None = None,
    query: str | None = None,
    prompt_of: Callable[[str], str | None] | None = None,
    shares: Mapping[str, float] | None = None,
) -> Candidate | None:
    """The candidate answer for a lookup: the answer cluster with the largest similarity-weighted vote among
    ``neighbours`` (best first), represented by its most similar entry. None if there are no neighbours.

    Clusters are what the judge linked (``cluster_of(entry) -> root``); entries never linked are their own
    cluster, so an unlinked neighbour counts as a rival answer (the conservative reading). ``evidence`` gives
    an entry's own verdicts ``(wrong, right)`` as a candidate: features of the global model, so the model pools
    them with everything else it knows (and what decides whether a lookup is observed stays among the
    features, which keeps the model's fit free of selection bias). ``query`` is the prompt looked up and
    ``prompt_of(entry)`` the stored prompt of an entry (None if not known): the ``LEXICAL`` features compare
    the two (all 0 when either is missing). ``shares``: P(cluster | the prompt) by the scope's answer
    classifier (None when it has no model): the ``CLASSIFIED`` features read the candidate's cluster's share
    and the largest other one (all 0, the log at its floor, without a model).
    """
    if not neighbours:
        return None
    import numpy as np

    top = neighbours[0].similarity
    votes: dict[str, float] = {}
    best: dict[str, Neighbour] = {}
    counts: dict[str, int] = {}
    roots = []
    for n in neighbours:
        root = cluster_of(n.entry_id)
        roots.append(root)
        votes[root] = votes.get(root, 0.0) + math.exp((n.similarity - top) / _VOTE_TEMPERATURE)
        counts[root] = counts.get(root, 0) + 1
        best.setdefault(root, n)
    chosen = max(votes, key=votes.__getitem__)
    entry = best[chosen]
    wrong, right = (evidence or {}).get(entry.entry_id, (0, 0))
    rival = max(
        (n.similarity for n, r in zip(neighbours, roots, strict=True) if r != chosen), default=_NO_RIVAL
    )
    features = np.array(
        [
            entry.similarity,
            top - entry.similarity,
            max(entry.similarity - rival, 0.0),
            votes[chosen] / sum(votes.values()),
            counts[chosen] / len(neighbours),
            math.log1p(cluster_size(chosen)),
            entry.similarity**2,
            math.log1p(wrong),
            math.log1p(right),
            *lexical(query, None if prompt_of is None else prompt_of(entry.entry_id)),
            *_classified(shares, chosen),
        ]
    )
    return Candidate(entry.entry_id, entry.similarity, features)


def _classified(shares: Mapping[str, float] | None, chosen: str) -> tuple[float, float, float, float]:
    if shares is None or chosen not in shares:
        return UNCLASSIFIED
    share = shares[chosen]
    rival = max((v for cluster, v in shares.items() if cluster != chosen), default=0.0)
    return (1.0, share, math.log(max(share, _SHARE_FLOOR)), rival)
