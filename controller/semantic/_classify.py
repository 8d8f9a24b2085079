"""Which answer a prompt asks for, learnt from the judge's answer clusters.

The nearest neighbours of a prompt say which stored answers are *near* it; a classifier trained on all of a
scope's entries says which answer cluster its embedding *belongs to*: a softmax (multinomial logistic)
regression from an entry's embedding to its cluster, the clusters being what the judge linked (never labels).
On the development streams, with MiniLM embeddings, such a classifier ranks "this stored answer is right" far
better than the cosine of the nearest neighbour (the share of queries served at 98 % precision: 0.79 against
0.46 on Banking77, 0.94 against 0.60 on CLINC150, trained on the true groups of the first half:
docs/notes/semantic-session5-2026-11-29.md). The cache's error model reads the share the classifier gives
the candidate's cluster as one more feature (``neighbourhood(..., shares=)``), and learns from the verdicts
how far to trust it: clusters built by the judge are fragments of the true answers, and the classifier is
refitted only every ``every`` inserts.

One model per scope (tenant namespace + contract boundary), trained on that scope's entries only: no tenant's
prompts shape another's features. A model outlives the clusters it was fitted on (links merge clusters,
entries leave): each class keeps one member entry, and a class's share goes to the cluster that member is in
now (classes whose member has left are dropped).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import numpy as np


class ClusterModel(NamedTuple):
    """A fitted softmax regression: ``coef`` (dim, classes), ``intercept`` (classes,), and for each class one
    entry id that was in its cluster when fitted."""

    coef: np.ndarray
    intercept: np.ndarray
    members: tuple[str, ...]


def fit_clusters(
    vectors: np.ndarray, labels: Sequence[str], members: dict[str, str], *, c: float = 10.0, max_iter: int = 200
) -> ClusterModel | None:
    """Fit the softmax regression of ``labels`` (a cluster per row of ``vectors``) on ``vectors``; None when
    there are fewer than two clusters. ``members``: cluster -> one entry id in it. One BLAS thread: a replay's
    decisions must not depend on the order in which threads add up a dot product."""
    import numpy as np
    from sklearn.linear_model import LogisticRegression
    from threadpoolctl import threadpool_limits

    classes = sorted(set(labels))
    if len(classes) < 2:
        return None
    with threadpool_limits(1):
        fit = LogisticRegression(C=c, max_iter=max_iter).fit(np.asarray(vectors, dtype=np.float64), list(labels))
    coef, intercept = fit.coef_.T, fit.intercept_
    if len(fit.classes_) == 2:  # scikit-learn keeps one row for two classes: P(second) = sigmoid(x w + b)
        coef = np.hstack([-coef, coef]) / 2.0
        intercept = np.array([-intercept[0], intercept[0]]) / 2.0
    return ClusterModel(
        np.ascontiguousarray(coef, dtype=np.float64), np.asarray(intercept, dtype=np.float64),
        tuple(members[str(label)] for label in fit.classes_),
    )


class AnswerClassifier:
    """The per-scope cluster models of one ``SemanticCache`` and when to refit them.

    ``every``: a scope's model is refitted after this many inserts in it (the first fit too). ``min_cluster``:
    clusters with fewer entries are left out of the training set (a lone entry the judge never linked is a
    class of one example). ``max_entries``: the most recent entries of a scope a fit reads; ``max_classes``: the
    largest clusters among them a fit tells apart (a fit's memory and time grow with entries x classes: 20,000 x
    512 probabilities is 80 MB; the others are left out, and their lookups read the neighbours alone). ``c``: the inverse
    L2 penalty. ``max_scopes``: the models kept, least recently used dropped (a dropped scope starts again from
    no model: its lookups then read the neighbours alone). Thread-safe.
    """

    def __init__(
        self,
        *,
        every: int = 1000,
        min_cluster: int = 2,
        max_entries: int = 20_000,
        max_classes: int = 512,
        c: float = 10.0,
        max_iter: int = 200,
        max_scopes: int = 256,
    ) -> None:
        if every < 1 or min_cluster < 1 or max_entries < 2 or max_classes < 2 or max_scopes < 1 or max_iter < 1:
            raise ValueError("every, min_cluster, max_iter and max_scopes must be >= 1, max_entries and max_classes >= 2")
        if not c > 0:
            raise ValueError(f"c must be > 0, got {c!r}")
        self.every = every
        self.min_cluster = min_cluster
        self.max_entries = max_entries
        self.max_classes = max_classes
        self.c = c
        self.max_iter = max_iter
        self.max_scopes = max_scopes
        self.fits = 0
        self._lock = threading.Lock()
        self._models: OrderedDict[Hashable, ClusterModel] = OrderedDict()
        self._since: dict[Hashable, int] = {}
        self._fitting: set[Hashable] = set()

    def inserted(self, scope: Hashable) -> bool:
        """Count an insert in ``scope``; True when a fit is due there (and none is running): the caller then
        calls ``fit`` (now, or on another thread) and this scope's count starts again."""
        with self._lock:
            since = self._since.get(scope, 0) + 1
            if since < self.every or scope in self._fitting:
                self._since[scope] = since
                return False
            self._since[scope] = 0
            self._fitting.add(scope)
            return True

    def training_set(self, entries: Sequence[tuple[str, str]]) -> tuple[list[str], list[str], dict[str, str]]:
        """From a scope's ``(entry id, cluster)`` pairs, oldest first: the ids and clusters to train on (the
        latest ``max_entries``, in the ``max_classes`` largest clusters of at least ``min_cluster`` of them; of
        equal sizes, the most recently seen), and a member per cluster."""
        entries = list(entries)[-self.max_entries :]
        sizes: dict[str, int] = {}
        for _, cluster in entries:
            sizes[cluster] = sizes.get(cluster, 0) + 1
        large = [cl for cl, n in sizes.items() if n >= self.min_cluster]
        if len(large) > self.max_classes:
            last = {cl: i for i, (_, cl) in enumerate(entries)}
            large = sorted(large, key=lambda cl: (sizes[cl], last[cl]), reverse=True)[: self.max_classes]
        chosen = set(large)
        kept = [(e, cl) for e, cl in entries if cl in chosen]
        members: dict[str, str] = {}
        for entry_id, cluster in kept:
            members.setdefault(cluster, entry_id)
        return [e for e, _ in kept], [cl for _, cl in kept], members

    def fit(self, scope: Hashable, vectors: np.ndarray, labels: Sequence[str], members: dict[str, str]) -> None:
        """Fit ``scope``'s model (see ``fit_clusters``) and install it; ends the fit ``inserted`` started, also
        when fitting fails (the exception propagates, the old model stays)."""
        try:
            model = fit_clusters(vectors, labels, members, c=self.c, max_iter=self.max_iter) if len(labels) else None
        finally:
            with self._lock:
                self._fitting.discard(scope)
        if model is None:
            return
        with self._lock:
            self._models[scope] = model
            self._models.move_to_end(scope)
            while len(self._models) > self.max_scopes:
                dropped, _ = self._models.popitem(last=False)
                self._since.pop(dropped, None)
            self.fits += 1

    def abandon(self, scope: Hashable, *, soon: bool) -> None:
        """A fit ``inserted`` asked for did not run: ``soon`` when it could not start (a full thread queue; the
        next insert asks again), else it failed (asked again after ``every`` more inserts)."""
        with self._lock:
            self._fitting.discard(scope)
            if soon:
                self._since[scope] = self.every - 1

    def shares(
        self, scope: Hashable, vec: np.ndarray, cluster_of: Callable[[str], str], held: Callable[[str], bool]
    ) -> dict[str, float] | None:
        """P(each cluster | the prompt's embedding ``vec``) by ``scope``'s model, by the clusters the classes'
        members are in now (``cluster_of``), classes whose member is no longer ``held`` left out; None when the
        scope has no model."""
        import numpy as np

        with self._lock:
            model = self._models.get(scope)
            if model is None:
                return None
            self._models.move_to_end(scope)
        z = np.asarray(vec, dtype=np.float64) @ model.coef + model.intercept
        z -= z.max()
        p = np.exp(z)
        p /= p.sum()
        out: dict[str, float] = {}
        for member, share in zip(model.members, p.tolist(), strict=True):
            if held(member):
                cluster = cluster_of(member)
                out[cluster] = out.get(cluster, 0.0) + share
        return out
