"""Which answer a prompt asks for, learnt from the judge's answer clusters.

The nearest neighbours of a prompt say which stored answers are *near* it; a classifier trained on all of a
scope's entries says which answer cluster its embedding *belongs to*: a softmax (multinomial logistic)
regression from an entry's embedding to its cluster, the clusters being what the judge linked (never labels).
With MiniLM embeddings, such a classifier ranks "this stored answer is right" far better than the cosine of
the nearest neighbour (docs/semantic.md, 'Answer classifier', gives by how much on Banking77 and CLINC150
and the command that measures it). The cache's error model reads the share the classifier gives
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


_MEMBERS = 4  # the newest entries of a class through which its share finds the cluster they are in now
# threadpoolctl's limit is process-wide, and two overlapping limits restore each other's saved value: fits run
# one at a time (and BLAS is single-threaded in the process while one runs).
_FIT_LOCK = threading.Lock()


class ClusterModel(NamedTuple):
    """A fitted softmax regression: ``coef`` (dim, classes), ``intercept`` (classes,), float32, and for each
    class the ids of its newest entries when fitted (``_MEMBERS`` at most)."""

    coef: np.ndarray
    intercept: np.ndarray
    members: tuple[tuple[str, ...], ...]


def fit_clusters(
    vectors: np.ndarray, labels: Sequence[str], members: dict[str, tuple[str, ...]], *, c: float = 10.0,
    max_iter: int = 200,
) -> ClusterModel | None:
    """Fit the softmax regression of ``labels`` (a cluster per row of ``vectors``) on ``vectors``; None when
    there are fewer than two clusters. ``members``: cluster -> entry ids in it. One BLAS thread: a replay's
    decisions must not depend on the order in which threads add up a dot product."""
    import numpy as np
    from sklearn.linear_model import LogisticRegression
    from threadpoolctl import threadpool_limits

    classes = sorted(set(labels))
    if len(classes) < 2:
        return None
    with _FIT_LOCK, threadpool_limits(1):
        fit = LogisticRegression(C=c, max_iter=max_iter).fit(np.asarray(vectors, dtype=np.float64), list(labels))
    coef, intercept = fit.coef_.T, fit.intercept_
    if len(fit.classes_) == 2:  # scikit-learn keeps one row for two classes: P(second) = sigmoid(x w + b)
        coef = np.hstack([-coef, coef]) / 2.0
        intercept = np.array([-intercept[0], intercept[0]]) / 2.0
    return ClusterModel(
        np.ascontiguousarray(coef, dtype=np.float32), np.asarray(intercept, dtype=np.float32),
        tuple(tuple(members[str(label)]) for label in fit.classes_),
    )


class AnswerClassifier:
    """The per-scope cluster models of one ``SemanticCache`` and when to refit them.

    ``every``: a scope's model is refitted after this many inserts in it (the first fit too). ``min_cluster``:
    clusters with fewer entries are left out of the training set (a lone entry the judge never linked is a
    class of one example). ``max_entries``: the most recent entries of a scope a fit reads; ``max_classes``: the
    largest clusters among them a fit tells apart (a fit's memory and time grow with entries x classes: 20,000 x
    512 probabilities is 80 MB; the others are left out, and their lookups read the neighbours alone). ``c``:
    the inverse L2 penalty. ``max_scopes``: the models kept, least recently used dropped (a dropped scope refits
    at its next insert; meanwhile its lookups read the neighbours alone). Thread-safe.

    A class finds its cluster through its newest entries at the fit (``_MEMBERS``); entries the cache forgets
    (``forget``: evicted, expired, removed) no longer count for the model they were fitted in, even if their id
    comes back with another answer.
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
        self._gone: dict[Hashable, set[str]] = {}  # per model: its members forgotten since the fit
        # Inserts since the last fit, per scope; the least recently inserted-into scopes are forgotten beyond a
        # bound (a scope forgotten here just waits ``every`` inserts again).
        self._since: OrderedDict[Hashable, int] = OrderedDict()
        self._fitting: set[Hashable] = set()

    def inserted(self, scope: Hashable) -> bool:
        """Count an insert in ``scope``; True when a fit is due there (and none is running): the caller then
        calls ``fit`` (now, or on another thread) and this scope's count starts again."""
        with self._lock:
            since = self._since.pop(scope, 0) + 1
            due = since >= self.every and scope not in self._fitting
            self._since[scope] = 0 if due else since
            while len(self._since) > 16 * self.max_scopes:
                self._since.popitem(last=False)
            if due:
                self._fitting.add(scope)
            return due

    def training_set(
        self, entries: Sequence[tuple[str, str]]
    ) -> tuple[list[str], list[str], dict[str, tuple[str, ...]]]:
        """From a scope's ``(entry id, cluster)`` pairs, oldest first: the ids and clusters to train on (the
        latest ``max_entries``, in the ``max_classes`` largest clusters of at least ``min_cluster`` of them; of
        equal sizes, the most recently seen), and each cluster's newest entries (``_MEMBERS``)."""
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
        members: dict[str, list[str]] = {}
        for entry_id, cluster in reversed(kept):
            newest = members.setdefault(cluster, [])
            if len(newest) < _MEMBERS:
                newest.append(entry_id)
        return [e for e, _ in kept], [cl for _, cl in kept], {cl: tuple(ids) for cl, ids in members.items()}

    def fit(
        self, scope: Hashable, vectors: np.ndarray, labels: Sequence[str], members: dict[str, tuple[str, ...]]
    ) -> None:
        """Fit ``scope``'s model (see ``fit_clusters``) and install it; ends the fit ``inserted`` started, also
        when fitting fails (the exception propagates, the old model stays)."""
        try:
            model = fit_clusters(vectors, labels, members, c=self.c, max_iter=self.max_iter)
        finally:
            with self._lock:
                self._fitting.discard(scope)
        if model is None:
            return
        with self._lock:
            self._models[scope] = model
            self._models.move_to_end(scope)
            self._gone[scope] = set()
            while len(self._models) > self.max_scopes:
                dropped, _ = self._models.popitem(last=False)
                self._gone.pop(dropped, None)
                self._since[dropped] = self.every - 1  # its next insert refits it
            self.fits += 1

    def abandon(self, scope: Hashable, *, soon: bool) -> None:
        """A fit ``inserted`` asked for did not run: ``soon`` when it could not start (a full thread queue; the
        next insert asks again), else it failed (asked again after ``every`` more inserts)."""
        with self._lock:
            self._fitting.discard(scope)
            if soon:
                self._since[scope] = self.every - 1

    def forget(self, scope: Hashable, entry_ids: Sequence[str]) -> None:
        """Entries of ``scope`` left the cache: they no longer lead a class to a cluster."""
        with self._lock:
            gone = self._gone.get(scope)
            if gone is not None:
                gone.update(entry_ids)

    def probabilities(self, scope: Hashable, vec: np.ndarray) -> tuple[ClusterModel, np.ndarray] | None:
        """P(each class | the prompt's embedding ``vec``) by ``scope``'s model, with the model; None when the
        scope has none. Reads no cache state: callers compute it outside their lock."""
        import numpy as np

        with self._lock:
            model = self._models.get(scope)
            if model is None:
                return None
            self._models.move_to_end(scope)
        z = np.asarray(vec, dtype=np.float32) @ model.coef + model.intercept
        z = z.astype(np.float64)
        z -= z.max()
        p = np.exp(z)
        return model, p / p.sum()

    def by_cluster(
        self, scope: Hashable, model: ClusterModel, p: np.ndarray, cluster_of: Callable[[str], str],
        held: Callable[[str], bool],
    ) -> dict[str, float]:
        """``probabilities`` by the cluster each class's newest remaining member is in now (``cluster_of``);
        classes with no member left (forgotten, or no longer ``held``) are left out."""
        with self._lock:
            # The set itself, not a copy: ``forget`` only adds to it, and a membership test needs no lock. A
            # model replaced meanwhile: its members are checked against the live entries only.
            gone = self._gone.get(scope, set()) if self._models.get(scope) is model else set()
        out: dict[str, float] = {}
        for members, share in zip(model.members, p.tolist(), strict=True):
            for member in members:
                if member not in gone and held(member):
                    cluster = cluster_of(member)
                    out[cluster] = out.get(cluster, 0.0) + share
                    break
        return out

    def shares(
        self, scope: Hashable, vec: np.ndarray, cluster_of: Callable[[str], str], held: Callable[[str], bool]
    ) -> dict[str, float] | None:
        """P(each cluster | the prompt's embedding ``vec``): ``probabilities`` then ``by_cluster``; None when the
        scope has no model."""
        found = self.probabilities(scope, vec)
        return None if found is None else self.by_cluster(scope, found[0], found[1], cluster_of, held)
