"""``SemanticCache``: the facade a rule uses for semantic hits: embedder + scoped index + the decision policy.

The lifecycle of one prompt, as the caller drives it::

    decision, entry = cache.lookup(scope, prompt, max_error=0.02)
    if entry is not None:                      # served: exact match, or a neighbour within the bound
        return stored_answer(entry)
    answer = model(prompt)                     # a miss (or an exploration: decision.explore)
    cache.insert(scope, new_entry_id, prompt, answer_ref)
    cache.judge_miss(scope, prompt, answer_ref, decision)   # the judge compares answers; before or after insert
    ...
    cache.feedback(entry, correct=False)       # a user or evaluator says a served answer was wrong

Which entries share an answer is learnt only from the judge: each verdict "equal" links the new entry to the
neighbour's answer cluster (union-find); nothing else (no label, no prompt text) ever links two entries.
An entry is only ever searched for, linked or served within its own ``Scope``.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import operator
import random
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from ._classify import AnswerClassifier
from ._config import DEFAULT_JUDGE_BUDGET
from ._embed import Embedder
from ._index import Neighbour, Scope, ScopedIndex, SemanticIndex, check_scope
from ._neighbourhood import Candidate
from ._policies import BoundedPolicy, DecisionPolicy, SemanticDecision

log = logging.getLogger("evocache.controller.semantic.cache")

if TYPE_CHECKING:
    import numpy as np

__all__ = ["DEFAULT_JUDGE_BUDGET", "JUDGE_BURST", "Judge", "SemanticCache", "SemanticStats"]

Judge = Callable[[Any, Any], bool]
"""``judge(new_answer_ref, cached_answer_ref) -> bool``: do the two answers say the same thing? Before two
answer clusters merge it is also asked about two cached answers (the first linked one's, then the other's)."""

_PENDING = (
    4096  # lookups awaiting their judge verdict; older ones are forgotten (their miss was never judged)
)
JUDGE_BURST = 1000
CREDIT_SCOPES = 4096
"""Scopes whose judge credit is kept; one looked up after being forgotten starts again from nothing."""
"""Unspent judge credit is kept up to this many lookups' worth: a quiet stretch (exact hits, lookups with no
neighbour) pays for the link search of a burst of new prompts after it, never for more than that."""


@dataclass(frozen=True, slots=True)
class SemanticStats:
    """Counters since the cache was built. ``realised_error`` is the wrong share among checked would-be hits
    (explorations) and served hits with feedback: the online measurement of the error the bound is about."""

    lookups: int
    exact_hits: int
    served: int
    explored: int
    judge_calls: int
    observations: int
    explored_wrong: int
    feedback: int
    feedback_wrong: int
    cutoff: float
    calibration: float
    link_errors: int = 0  # judge calls for links (not the candidate's verdict) that raised: no link, logged
    links_dropped: int = 0  # link judging a full background queue could not take (judge_miss's ``defer``)
    links_unjudged: int = 0  # link searches the judge budget stopped (``judge_budget``)
    fit_errors: int = 0  # answer classifier refits that failed or could not be handed over: logged, model kept
    calibration_bounded: bool = False  # ``calibration`` is the confidence sequence's bound, not the prior's cap

    @property
    def realised_error(self) -> float:
        checked = self.explored + self.feedback
        return (self.explored_wrong + self.feedback_wrong) / checked if checked else 0.0


class _Pending(NamedTuple):
    """A lookup that was not served, awaiting the judge's verdict on its candidate (by the lookup's token)."""

    scope: Scope
    candidate: Candidate | None
    est_error: float
    explored: bool
    neighbours: tuple[Neighbour, ...]


class _Served(NamedTuple):
    """A served (non-exact) hit, remembered so that feedback on it is an observation for the error model."""

    scope: Scope
    entry_id: str
    candidate: Candidate
    est_error: float


class _Entry(NamedTuple):
    scope: Scope
    prompt: str
    answer_ref: Any


class _Clusters:
    """Answer clusters: entries the judge found equal, transitively. Only linked entries are held (an entry
    never linked is its own cluster of one); the smaller cluster joins the larger on a link. An entry removed
    leaves its cluster (which keeps its other members together) and is forgotten, so memory follows the live
    entries."""

    def __init__(self) -> None:
        self._label: dict[str, str] = {}
        self._members: dict[str, set[str]] = {}
        self._labels = itertools.count()

    def __len__(self) -> int:
        return len(self._label)

    def find(self, x: str) -> str:
        return self._label.get(x, x)

    def size(self, root: str) -> int:
        return len(self._members.get(root, ())) or 1

    def union(self, a: str, b: str) -> None:
        la, lb = self._label.get(a), self._label.get(b)
        if la is not None and la == lb or a == b:
            return
        if la is None and lb is None:
            # A label no entry id can be (NUL first), so a cluster never shares a name with an unlinked entry.
            label = f"\0{next(self._labels)}"
            self._members[label] = {a, b}
            self._label[a] = self._label[b] = label
            return
        if la is None or (lb is not None and len(self._members[la]) < len(self._members[lb])):
            a, b, la, lb = b, a, lb, la
        moving = {b} if lb is None else self._members.pop(lb)
        self._members[la] |= moving
        for x in moving:
            self._label[x] = la

    def ids(self) -> list[str]:
        return list(self._label)

    def discard(self, x: str) -> None:
        label = self._label.pop(x, None)
        if label is None:
            return
        members = self._members[label]
        members.discard(x)
        if len(members) < 2:  # one left: it is its own cluster again
            del self._members[label]
            for rest in members:
                del self._label[rest]


class SemanticCache:
    """Semantic lookups for one rule: embed, search the scope's index, decide within the error bound.

    ``embedder`` defaults to the process's shared one (``default_embedder()``, built on first use); ``judge``
    defaults to equality of answer refs, right when the refs are the answers themselves (a strict judge: only
    identical answers count as equal). ``policy`` decides each lookup: a ``BoundedPolicy()`` by default
    (``StaticPolicy(threshold=)`` is the baseline; ``PolicyOptions(mode=...).build()`` makes one by mode name).
    ``rng`` draws the exploration coin; seed it for reproducible runs. ``k`` neighbours are read per lookup.
    After a miss the judge compares the model's answer with the candidate's, and then with one entry of each
    other answer cluster among the neighbours (at most ``link_tries`` clusters; None: all), linking the new
    entry to each cluster whose answer it finds equal: so fragments of one answer, never linked before, merge.
    With ``merge=False`` the judging stops at the first equal answer (the candidate's included): fewer judge
    calls, less complete clusters.

    ``judge_budget`` bounds the judge calls per lookup on average (None: no bound), per scope: every lookup
    earns its scope that many, a judged miss spends one on the candidate's verdict (always made: the error bound learns from it)
    and the link search spends what is left, most similar cluster first, stopping when the credit runs out;
    unspent credit is kept up to ``JUDGE_BURST`` lookups' worth. So a costly judge (a model call) costs a
    known share of the traffic; the default, 2, keeps most links (docs/semantic.md, 'Judge budget').

    ``classify`` (on by default) also keeps an answer classifier per scope (``classifier``, an
    ``AnswerClassifier``): a softmax regression from the scope's entries' embeddings to their answer clusters,
    refitted every ``AnswerClassifier.every`` inserts in the scope, whose share for the candidate's cluster the
    error model reads as a feature. A refit takes seconds: it runs in the insert that makes it due, or is
    handed to ``fit_later`` (a callable that runs it on another thread and returns False when it cannot take
    it). It raises the hit rate at tight bounds (see docs/semantic.md, 'Answer classifier').

    Bad input (a scope that is not a ``Scope``, a prompt that is not a ``str``, an entry id used in another
    scope) raises ``TypeError``/``ValueError``; embedder failures (``EmbeddingError``) propagate, and the
    caller treats them as a miss. Safe to share between threads.
    """

    def __init__(
        self,
        embedder: Embedder | None = None,
        *,
        index: ScopedIndex | None = None,
        judge: Judge = operator.eq,
        policy: DecisionPolicy | None = None,
        k: int = 10,
        link_tries: int | None = None,
        judge_budget: float | None = DEFAULT_JUDGE_BUDGET,
        merge: bool = True,
        rng: random.Random | None = None,
        answer_ref_of: Callable[[Scope, str], Any] | None = None,
        classifier: AnswerClassifier | None = None,
        classify: bool = True,
        fit_later: Callable[[Callable[[], None]], bool] | None = None,
    ) -> None:
        if policy is None:
            policy = BoundedPolicy()
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be a positive int, got {k!r}")
        self._embedder = embedder
        self._index = index if index is not None else SemanticIndex()
        self._judge = judge
        # For neighbours this process did not insert (another replica's, found through a shared index): the
        # answer ref of an entry id in a scope, or None when the caller cannot know it.
        self._answer_ref_of = answer_ref_of
        self._policy = policy
        if classifier is not None and not classify:
            raise ValueError("a classifier was given with classify=False")
        # A policy that does not read the shares (static mode) gets no classifier: nothing to fit.
        self._classifier = (
            (classifier if classifier is not None else AnswerClassifier()) if classify and policy.reads_shares
            else None
        )
        self._fit_later = fit_later
        self._k = k
        if link_tries is not None and (isinstance(link_tries, bool) or not isinstance(link_tries, int)
                                       or link_tries < 0):
            raise ValueError(f"link_tries must be an int >= 0 or None, got {link_tries!r}")
        self._link_tries = link_tries
        if judge_budget is not None and (
            isinstance(judge_budget, bool) or not isinstance(judge_budget, int | float)
            or not 1.0 <= judge_budget < math.inf
        ):
            raise ValueError(
                f"judge_budget must be a number of judge calls per lookup >= 1 (a miss's own verdict), or None, "
                f"got {judge_budget!r}"
            )
        self._judge_budget = None if judge_budget is None else float(judge_budget)
        # Per scope, judge calls earned and not spent (``judge_budget``), under the lock: one tenant's quiet
        # stretch never pays for another's link search. The least recently looked-up scopes are forgotten.
        self._judge_credit: OrderedDict[Scope, float] = OrderedDict()
        self._merge = merge
        self._rng = rng if rng is not None else random.Random()
        self._lock = threading.RLock()
        self._entries: dict[str, _Entry] = {}
        self._scope_ids: dict[Scope, dict[str, None]] = {}  # each scope's entry ids, oldest insert first
        self._exact: dict[tuple[Scope, str], str] = {}
        self._clusters = _Clusters()
        self._evidence: dict[
            str, tuple[int, int]
        ] = {}  # entry -> (wrong, right) verdicts with it as candidate
        self._pending: OrderedDict[int, _Pending] = OrderedDict()  # by the lookup's token
        # The last served hits by lookup (a token per lookup), so feedback can be an observation.
        self._served: OrderedDict[int, _Served] = OrderedDict()
        self._tokens = itertools.count(1)
        self._links: OrderedDict[tuple[Scope, str], tuple[Any, tuple[str, ...]]] = (
            OrderedDict()
        )  # judged before insert: link on insert
        self._vectors: OrderedDict[tuple[Scope, str], np.ndarray] = (
            OrderedDict()
        )  # embedded, not yet inserted
        # An index that forgets entries by itself (expiry, other replicas: ``SharedIndex``) says so.
        self._index.listen(_weak_listener(self))
        self._counts = dict.fromkeys(
            (
                "lookups",
                "exact_hits",
                "served",
                "explored",
                "judge_calls",
                "observations",
                "explored_wrong",
                "feedback",
                "feedback_wrong",
                "link_errors",
                "links_dropped",
                "links_unjudged",
                "fit_errors",
            ),
            0,
        )

    # -- the parts the policy reads ---------------------------------------------------------------------------

    def cluster_of(self, entry_id: str) -> str:
        return self._clusters.find(entry_id)

    def cluster_size(self, root: str) -> int:
        return self._clusters.size(root)

    def prompt_of(self, entry_id: str, scope: Scope | None = None) -> str | None:
        """The prompt stored with ``entry_id``: this cache's own entry's, or (an entry another replica inserted
        into a shared index) the one in the index's metadata for ``scope``; None when not known."""
        entry = self._entries.get(entry_id)
        if entry is not None:
            return entry.prompt if scope is None or entry.scope == scope else None
        if scope is None:
            return None
        held = self._index.get(scope, entry_id)
        prompt = None if held is None else held.meta.get("prompt")
        return prompt if isinstance(prompt, str) else None

    @property
    def evidence(self) -> dict[str, tuple[int, int]]:
        return self._evidence

    @property
    def embedder(self) -> Embedder:
        if self._embedder is None:
            from ._embed import default_embedder

            self._embedder = default_embedder()
        return self._embedder

    # -- the request path -------------------------------------------------------------------------------------

    def lookup(self, scope: Scope, prompt: str, *, max_error: float) -> tuple[SemanticDecision, str | None]:
        """Decide one lookup: ``(decision, entry id to serve or None)``. An exact match of the prompt in the
        scope is served first (similarity 1, estimated error 0). ``ValueError`` if ``max_error`` is not in
        (0, 0.5]."""
        check_scope(scope)
        _check_prompt(prompt)
        if not 0 < max_error <= 0.5:
            raise ValueError(f"max_error must be in (0, 0.5], got {max_error!r}")
        with self._lock:
            self._counts["lookups"] += 1
            if self._judge_budget is not None:
                credit = self._judge_credit.pop(scope, 0.0) + self._judge_budget
                self._judge_credit[scope] = min(credit, self._judge_budget * JUDGE_BURST)
                if len(self._judge_credit) > CREDIT_SCOPES:
                    self._judge_credit.popitem(last=False)
            exact = self._exact.get((scope, prompt))
            if exact is not None:
                self._counts["exact_hits"] += 1
                return self._policy.exact(scope, exact), exact
        vec = self.embedder.embed([prompt])  # outside the lock: concurrent lookups batch their embeddings
        neighbours = self._index.search(scope, vec, self._k)[0]
        classifier = self._classifier
        classes = classifier.probabilities(scope, vec[0]) if classifier is not None and neighbours else None
        with self._lock:
            _remember(self._vectors, (scope, prompt), vec[0])
            shares = None if classifier is None or classes is None else classifier.by_cluster(
                scope, *classes, self.cluster_of, lambda entry_id: self._held(scope, entry_id)
            )
            decision, candidate = self._policy.decide(
                neighbours, max_error, self._rng.random(), self, scope=scope, prompt=prompt, shares=shares
            )
            # Each lookup's own token: concurrent lookups of one prompt keep apart what each is judged on.
            token = next(self._tokens)
            decision = decision._replace(token=token)
            if decision.serve:
                self._counts["served"] += 1
                if candidate is not None:
                    _remember(self._served, token, _Served(scope, decision.neighbour, candidate, decision.est_error))
                return decision, decision.neighbour
            self._counts["explored"] += decision.explore
            if decision.neighbour is not None:
                _remember(
                    self._pending,
                    token,
                    _Pending(scope, candidate, decision.est_error, decision.explore, tuple(neighbours)),
                )
            return decision, None

    def insert(
        self, scope: Scope, entry_id: str, prompt: str, answer_ref: Any, *, expires_at: float | None = None
    ) -> None:
        """Store a new entry (the model's answer to ``prompt``, referenced by ``answer_ref``) in ``scope``.

        Re-inserting an id in the same scope replaces it; an id held by another scope is a ``ValueError``.
        ``expires_at`` (absolute, on the index's clock) goes to an index that keeps expiries (``SharedIndex``:
        the entry then leaves Redis and every replica's index when its answer's exact entry expires)."""
        check_scope(scope)
        _check_prompt(prompt)
        if not isinstance(entry_id, str) or not entry_id or entry_id[0] == "\0":
            raise ValueError(f"entry_id must be a non-empty str not starting with NUL, got {entry_id!r}")
        with self._lock:
            held = self._entries.get(entry_id)
            if held is not None and held.scope != scope:
                raise ValueError(f"entry {entry_id!r} already belongs to another scope")
            vec = self._vectors.pop((scope, prompt), None)
        vecs = self.embedder.embed([prompt]) if vec is None else vec[None, :]
        # The prompt goes with the entry, so another replica's cache (through a shared index) has it too.
        self._index.add(
            scope, [entry_id], vecs, metas=[{"prompt": prompt}],
            expires_at=None if expires_at is None else [expires_at],
        )
        with self._lock:
            # A remove() between the add and here took the entry out of the index (remove updates the index
            # before this cache): recording it now would leave an entry no index holds, served by exact match.
            if not self._holds(scope, entry_id):
                return
            self._entries[entry_id] = _Entry(scope, prompt, answer_ref)
            if held is not None and self._classifier is not None:
                self._classifier.forget(scope, [entry_id])  # replaced: its answer may be another now
            ids = self._scope_ids.setdefault(scope, {})
            ids.pop(entry_id, None)
            ids[entry_id] = None
            self._exact[(scope, prompt)] = entry_id
            # Links judged before this insert belong to the answer that was judged: another answer to the same
            # prompt (a model that is not deterministic) has not been compared with anything.
            judged_ref, links = self._links.pop((scope, prompt), (None, ()))
            if links and _same_ref(judged_ref, answer_ref):
                for link in links:
                    if self._held(scope, link):
                        self._clusters.union(entry_id, link)
            due = self._classifier is not None and self._classifier.inserted(scope)
        if due:
            self._refit(scope)

    def _refit(self, scope: Scope) -> None:
        """Refit ``scope``'s answer classifier on its entries and their clusters now: here, or handed to
        ``fit_later`` (another thread: a fit takes seconds). Its clusters are read when the fit runs, so links
        judged meanwhile count."""
        classifier = self._classifier
        assert classifier is not None

        def fit() -> None:
            import numpy as np

            try:
                with self._lock:
                    latest = list(self._scope_ids.get(scope, ()))[-classifier.max_entries :]
                    pairs = [(i, self._clusters.find(i)) for i in latest]
                ids, labels, members = classifier.training_set(pairs)
                rows, kept = [], []
                for entry_id, label in zip(ids, labels, strict=True):
                    try:
                        rows.append(self._index.vector(scope, entry_id))
                    except KeyError:
                        continue  # left the index since
                    kept.append(label)
                if not rows:  # nothing to learn from yet (no cluster of two, or all gone): not a failure
                    classifier.abandon(scope, soon=False)
                    return
                held = set(kept)
                classifier.fit(
                    scope, np.asarray(rows).reshape(len(rows), -1), kept,
                    {cluster: m for cluster, m in members.items() if cluster in held},
                )
            except Exception:  # noqa: BLE001 - a refit is never worth a failed call: logged, counted, model kept
                classifier.abandon(scope, soon=False)
                self._count("fit_errors")
                log.exception("semantic: refitting the answer classifier of %s failed; it keeps its last model", scope)

        if self._fit_later is None:
            fit()
            return
        try:
            taken = self._fit_later(fit)
        except Exception:  # noqa: BLE001 - a refit is never worth a failed insert: logged, counted, model kept
            log.warning("semantic: could not hand the answer classifier's refit of %s to its thread", scope,
                        exc_info=True)
            self._count("fit_errors")
            classifier.abandon(scope, soon=False)
            return
        if not taken:
            classifier.abandon(scope, soon=True)

    def remove(self, scope: Scope, entry_ids: Sequence[str]) -> None:
        """Forget entries (evicted or expired): they are no longer searched, matched or served."""
        check_scope(scope)
        with self._lock:
            # Ids this cache never inserted (another replica's, found through a shared index) are removed from
            # the index too; only an id known to belong to another scope is left alone.
            ids = [e for e in entry_ids if e not in self._entries or self._entries[e].scope == scope]
        # The index first: an insert() of one of these ids racing with this call then either finds it gone
        # and records nothing, or records it before the _forget below drops it.
        self._index.remove(scope, ids)
        with self._lock:
            self._forget(scope, ids)

    def _forget(self, scope: Scope, ids: Sequence[str]) -> None:
        """Drop what this cache keeps of entries that left ``scope`` (its entry, exact prompt, evidence and
        cluster membership), so its state follows the live entries. Caller holds the lock."""
        for entry_id in ids:
            entry = self._entries.get(entry_id)
            if entry is not None:
                if entry.scope != scope:
                    continue  # an id of another scope: not this removal's
                del self._entries[entry_id]
                if self._exact.get((scope, entry.prompt)) == entry_id:
                    del self._exact[(scope, entry.prompt)]
                scope_ids = self._scope_ids.get(scope)
                if scope_ids is not None:
                    scope_ids.pop(entry_id, None)
                    if not scope_ids:
                        del self._scope_ids[scope]
            self._evidence.pop(entry_id, None)
            self._clusters.discard(entry_id)
        if self._classifier is not None:
            self._classifier.forget(scope, ids)

    def _changed(self, change: Any) -> None:
        """A change the index made without this cache (an expiry, another replica's removal, a rebuild)."""
        with self._lock:
            if change.kind == "remove" and change.scope is not None:
                self._forget(change.scope, change.ids)
            elif change.kind == "reset":
                # The index was reloaded: keep only the entries it still holds. What is known of ids this
                # cache did not insert (evidence, links) is dropped with them: their scope is not known here.
                gone = [(e.scope, i) for i, e in self._entries.items() if not self._holds(e.scope, i)]
                for scope, entry_id in gone:
                    self._forget(scope, [entry_id])
                for entry_id in [i for i in self._evidence if i not in self._entries]:
                    del self._evidence[entry_id]
                for entry_id in [i for i in self._clusters.ids() if i not in self._entries]:
                    self._clusters.discard(entry_id)

    def _held(self, scope: Scope, entry_id: str) -> bool:
        """``entry_id`` is a live entry of ``scope``: this cache's, or (through a shared index) another's."""
        entry = self._entries.get(entry_id)
        return entry.scope == scope if entry is not None else self._holds(scope, entry_id)

    def _holds(self, scope: Scope, entry_id: str) -> bool:
        try:
            self._index.vector(scope, entry_id)
        except KeyError:
            return False
        return True

    def judge_miss(
        self,
        scope: Scope,
        prompt: str,
        new_answer_ref: Any,
        decision: SemanticDecision,
        *,
        link: bool = True,
        defer: Callable[[Callable[[], None]], bool] | None = None,
    ) -> bool | None:
        """After a miss (or an exploration) the model answered ``prompt``: the judge compares the answer with
        the candidate neighbour's. The verdict is an observation for the error model (and the exploration
        sample), recorded before anything else is judged. Then the answer is linked to answer clusters: to the
        candidate's when equal, and to each other neighbouring cluster (up to ``link_tries``) whose answer the
        judge finds equal, so fragments of one answer merge; with ``merge=False`` only until the first link. A
        second cluster joins only if the judge also finds its answer equal to the first linked one (a judge
        that is not transitive must not chain two different answers into one cluster). The links go to the
        prompt's entry, now or when it is inserted (by an insert of this very answer ref: an insert of another
        answer to the prompt drops them); with ``link=False`` (the answer was not stored) nothing is linked.

        The lookup is the one ``decision`` came from (its ``token``), so concurrent lookups of the same prompt
        are each judged on their own candidate, once. A decision without a neighbour or token, one for another
        scope, or one whose lookup is no longer remembered (or was judged already) does nothing. In static
        mode nothing is learnt, so nothing is judged. A judge exception on the candidate propagates (nothing is
        recorded); one while judging for links ends the link search (logged, counted in ``link_errors``): the
        verdict stands.

        ``defer``: the judging for links (every judge call after the candidate's) is handed to it as one
        callable, to run later on another thread, so that the caller does not wait for it; it returns False
        when it cannot take more (the links are then not judged: counted in ``links_dropped``). The candidate's
        own link is made at once.

        Returns the verdict (True: the answers are the same), or None when nothing was judged.
        """
        if decision.neighbour is None or not self._policy.learns:
            return None
        with self._lock:
            pending = self._pending.pop(decision.token, None) if decision.token is not None else None
            if pending is None or pending.candidate is None or pending.scope != scope:
                return None
            neighbour_ref = self._ref_of(scope, decision.neighbour)
        if neighbour_ref is None:
            return None  # removed since the lookup: its answer is gone
        same = bool(self._judge(new_answer_ref, neighbour_ref))
        self._prepare()
        with self._lock:
            self._counts["judge_calls"] += 1
            if scope in self._judge_credit:  # made whatever the credit: the bound learns from it
                self._judge_credit[scope] -= 1.0
            self._counts["observations"] += 1
            if pending.explored:
                self._counts["explored_wrong"] += not same
            # What is kept of an entry is kept while it is held: one removed meanwhile gets no evidence or link.
            if self._held(scope, decision.neighbour):
                wrong, right = self._evidence.get(decision.neighbour, (0, 0))
                self._evidence[decision.neighbour] = (wrong + (not same), right + same)
            self._policy.observe(pending.candidate, not same, pending.est_error, explored=pending.explored)
        if not link:
            return same
        links = [(decision.neighbour, neighbour_ref)] if same else []
        if same and not self._merge:  # the candidate's link is the only one wanted: no more judging
            self._apply_links(scope, prompt, new_answer_ref, links)
            return same
        search = functools.partial(self._link, scope, prompt, new_answer_ref, decision, pending.neighbours, links)
        if defer is None:
            search()
            return same
        self._apply_links(scope, prompt, new_answer_ref, links)  # the candidate's now; the others later
        if not defer(search):
            with self._lock:
                self._counts["links_dropped"] += 1
        return same

    def _link(
        self, scope: Scope, prompt: str, answer: Any, decision: SemanticDecision, neighbours: Sequence[Neighbour],
        links: list[tuple[str, Any]],
    ) -> None:
        """Judge the neighbouring clusters for links (``_find_links``) and link the prompt's entry to them."""
        links = list(links)
        try:
            self._find_links(scope, neighbours, answer, decision, links)
        except Exception as exc:  # noqa: BLE001 - the user's judge: the verdict stands, links stop here
            log.warning("semantic link judging failed: %s: %s", type(exc).__name__, exc)
            with self._lock:
                self._counts["link_errors"] += 1
        self._apply_links(scope, prompt, answer, links)

    def _apply_links(self, scope: Scope, prompt: str, answer: Any, links: list[tuple[str, Any]]) -> None:
        """Union the prompt's entry with each linked entry still held in ``scope``; before its insert, keep
        the links for an insert of this ``answer``."""
        if not links:
            return
        with self._lock:
            held = [entry_id for entry_id, _ in links if self._held(scope, entry_id)]
            if held:
                new_id = self._exact.get((scope, prompt))
                if new_id is not None:
                    for entry_id in held:
                        self._clusters.union(new_id, entry_id)
                else:
                    _remember(self._links, (scope, prompt), (answer, tuple(held)))

    def _spend_judge_call(self, scope: Scope) -> bool:
        """Count one judge call for links and take it from ``scope``'s credit; False (nothing counted) when the
        ``judge_budget`` leaves the scope no whole call."""
        with self._lock:
            if self._judge_budget is not None:
                if self._judge_credit.get(scope, 0.0) < 1.0:
                    self._counts["links_unjudged"] += 1
                    return False
                self._judge_credit[scope] -= 1.0
            self._counts["judge_calls"] += 1
            return True

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def _prepare(self) -> None:
        """Let the policy load what learning needs before the lock is taken (the first fit's imports take
        about a second: under the lock they would stall every lookup)."""
        self._policy.prepare()

    def _ref_of(self, scope: Scope, entry_id: str) -> Any:
        entry = self._entries.get(entry_id)
        if entry is not None:
            return entry.answer_ref if entry.scope == scope else None
        return None if self._answer_ref_of is None else self._answer_ref_of(scope, entry_id)

    def _find_links(
        self, scope: Scope, neighbours: Sequence[Neighbour], answer: Any, decision: SemanticDecision,
        links: list[tuple[str, Any]],
    ) -> None:
        """Append to ``links`` (``(entry id, answer ref)``, the candidate's first when it is equal) one
        neighbour per other answer cluster whose answer the judge finds equal to ``answer``, and, for every
        cluster after the first linked one, equal to that one's answer too: the first only without ``merge``.
        An answer that has gone (``LookupError``) is no link. Other judge exceptions propagate."""
        tried = {self.cluster_of(decision.neighbour)} if decision.neighbour else set()
        for n in sorted(neighbours, key=lambda n: -n.similarity):  # the likeliest to share the answer first
            if self._link_tries is not None and len(tried) > self._link_tries:
                break
            if links and not self._merge:
                break
            root = self.cluster_of(n.entry_id)
            ref = self._ref_of(scope, n.entry_id)
            if root in tried or ref is None:
                continue
            tried.add(root)
            try:
                if not self._spend_judge_call(scope):
                    break
                if not self._judge(answer, ref):
                    continue
                if links:  # a second cluster: its answer must equal the first linked one's as well
                    if not self._spend_judge_call(scope):
                        break
                    if not self._judge(links[0][1], ref):
                        continue
            except LookupError:  # that answer has gone (a judge may say so): no link there, and no verdict lost
                continue
            links.append((n.entry_id, ref))

    def feedback(self, entry_id: str, correct: bool, *, decision: SemanticDecision | None = None) -> None:
        """A verdict on a served answer of ``entry_id`` (from a user or an evaluator). It counts in the realised
        error and in that entry's own evidence (a feature of its later lookups). When the lookup that served it
        is still remembered (the last few thousand served hits: ``decision``'s lookup when given, else the
        latest one served from ``entry_id`` that has no verdict yet), the verdict is also an observation for
        the error model, with the features that decided it. It never enters the calibration: served hits with
        feedback are not a uniform sample (users report what they choose to), the explorations are. Unknown
        entries are ignored (with ``answer_ref_of`` every id counts: it may be another replica's); evidence is
        kept only for an entry still held, so what is known of entries follows the live ones."""
        self._prepare()
        with self._lock:
            if entry_id not in self._entries and self._answer_ref_of is None:
                return
            self._counts["feedback"] += 1
            self._counts["feedback_wrong"] += not correct
            if decision is not None and decision.token is not None:
                token = decision.token if decision.token in self._served else None
            else:
                token = next((t for t in reversed(self._served) if self._served[t].entry_id == entry_id), None)
            served = None if token is None or self._served[token].entry_id != entry_id else self._served.pop(token)
            if entry_id in self._entries or (served is not None and self._holds(served.scope, entry_id)):
                wrong, right = self._evidence.get(entry_id, (0, 0))
                self._evidence[entry_id] = (wrong + (not correct), right + bool(correct))
            if served is not None:
                self._counts["observations"] += 1
                self._policy.observe(served.candidate, not correct, served.est_error, explored=False)

    def stats(self, scope: Scope | None = None) -> SemanticStats:
        """The counters (over all scopes); ``cutoff`` is ``scope``'s (each scope paces its own budget; by
        default the scope looked up last; 0.0 for a scope without a pacer), ``calibration`` the shared one."""
        with self._lock:
            cutoff, calibration, bounded = self._policy.readings(scope)
            return SemanticStats(**self._counts, cutoff=cutoff, calibration=calibration, calibration_bounded=bounded)

    def answer_ref(self, entry_id: str) -> Any:
        """The answer ref stored with ``entry_id``; ``KeyError`` if it is not held."""
        return self._entries[entry_id].answer_ref


def _weak_listener(cache: SemanticCache) -> Callable[[Any], None]:
    """``cache._changed`` without keeping the cache alive: an index may outlive the caches that use it."""
    ref = weakref.ref(cache)

    def changed(change: Any) -> None:
        target = ref()
        if target is not None:
            target._changed(change)

    return changed


def _same_ref(a: Any, b: Any) -> bool:
    """Whether two answer refs name the same answer; refs whose ``==`` is not a plain truth value (arrays) or
    raises count as different (a link judged for one is then dropped, never misapplied)."""
    if a is b:
        return True
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return False


def _check_prompt(prompt: object) -> None:
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")


def _remember(table: OrderedDict[Any, Any], key: Any, value: Any) -> None:
    table[key] = value
    table.move_to_end(key)
    if len(table) > _PENDING:
        table.popitem(last=False)
