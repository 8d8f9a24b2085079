"""The semantic decision: serve a neighbour's answer only while the error it costs stays within the rule's bound.

The bound ``max_error`` is on the error rate per lookup (wrong served answers / lookups), the rate the rule's
user sees. A would-be hit is served when its estimated probability of being wrong is at most the current
cut-off ``threshold``; the cut-off is paced so that the estimated error of everything served stays within the
bound, inflated by a conservative calibration factor measured on the exploration sample.

Three pieces, each one small class:

- ``neighbourhood``: turns a neighbour list and the answer clusters (built from judge links only) into a
  candidate entry and its features: similarity, margin to the nearest other cluster, vote of the top-k, the
  entry's own verdicts, and the ``lexical`` difference of the prompt and the entry's stored prompt (a trap is
  a minimal pair, a near-repeat differs by typos, a paraphrase by many words).
- ``ErrorModel``: one global logistic model of P(wrong | features), refitted online from observations (judge
  verdicts on misses and explorations, feedback), each weighed by the inverse of its chance of being observed.
- ``Pacer``: one per scope (tenant namespace + boundary), so each scope's own error per lookup is held within
  the bound; it picks the cut-off from the scope's recent lookups' estimated errors so that their expected
  error per lookup is within the bound; an upper confidence bound on the exploration sample's observed/expected
  error ratio (``Calibration``, shared like the model) scales the estimates up when the model is optimistic,
  and a scope whose own explored verdicts refute that shared bound uses its own.

``StaticPolicy`` is the comparison baseline: serve the nearest entry at cosine similarity >= threshold.
"""

from __future__ import annotations

import difflib
import math
import re
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

from ._index import Neighbour

if TYPE_CHECKING:
    import numpy as np

__all__ = [
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
    "lexical",
    "neighbourhood",
]


class SemanticDecision(NamedTuple):
    """One semantic lookup's decision; also the explanation recorded in its access event.

    ``serve``: the neighbour's answer is served. ``explore``: it would have been served, but the model is
    called instead to measure the error (the lookup counts as a miss). ``neighbour``: the candidate entry (None
    when the scope held nothing). ``similarity``: its cosine similarity to the prompt. ``threshold``: what the
    decision compared against: the cut-off on ``est_error`` in bounded mode, the similarity threshold in static
    mode. ``est_error``: the estimated probability that the candidate's answer is wrong for this prompt (1.0
    before the model has learnt anything; 0.0 for an exact match; NaN in static mode, which estimates nothing).
    ``token``: which lookup this was, for ``SemanticCache.judge_miss``/``feedback`` to find what it remembers
    of it (None for an exact match and for decisions a policy makes before the cache numbers them).
    """

    serve: bool
    explore: bool
    neighbour: str | None
    similarity: float
    threshold: float
    est_error: float
    token: int | None = None


# --- the neighbourhood ------------------------------------------------------------------------------------

LEXICAL = (
    "prompt_known", "token_jaccard", "word_edits", "content_edits", "typo_edits", "minimal_pair", "numbers_differ",
    "negation_differs", "reordered", "names_differ",
)
# What the scope's answer classifier (``_classify.AnswerClassifier``) says of the candidate's cluster: whether
# the scope has a model, the share it gives the candidate's cluster (and its log), the largest share of another.
CLASSIFIED = ("classified", "answer_share", "answer_log_share", "rival_share")
FEATURES = (
    "similarity", "gap_to_top", "margin", "vote", "share_of_k", "cluster_size", "similarity_sq", "entry_wrong",
    "entry_right", *LEXICAL, *CLASSIFIED,
)
_SHARE_FLOOR = 1e-4  # the log of a share is read from this up
_VOTE_TEMPERATURE = 0.02  # softmax temperature over similarities: 0.02 apart weighs e times less
_NO_RIVAL = 0.0  # the similarity assumed for "another answer" when none is among the neighbours


# --- lexical difference of two prompts ---------------------------------------------------------------------------
# An embedding puts "cancel my subscription" next to "don't cancel my subscription": a trap is a minimal pair
# (the prompts share almost every word and differ by one or a few whole, correctly spelt words), a near-repeat
# differs by typos (words within a small character edit of the original), a paraphrase changes many words. The
# classic paraphrase-identification features below tell them apart; their weights are learnt by the error
# model from judge verdicts like every other feature's.

_WORD = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")
_NEGATIONS = frozenset(("not", "no", "never", "none", "nothing", "nobody", "nor", "neither", "without", "nowhere"))
_CONTRACTIONS = {"can't": ("can", "not"), "cannot": ("can", "not"), "won't": ("will", "not"), "shan't": ("shall", "not")}
# Words that frame a request rather than say what it is about (articles, pronouns, auxiliaries, politeness):
# "how do I top up my card" and "how can I top up the card" ask the same. Question words, prepositions,
# negations and quantifiers are not among them: each can change the answer.
_FUNCTION_WORDS = frozenset(
    "a an the my your our their his her its this that these those i me we us you it he she they i'm i've i'd "
    "i'll you're it's there here is are am was were be been being do does did done can could would should will "
    "shall may might must have has had please kindly just also really so to and then some any get got want "
    "need like wish able help tell know think believe try trying".split()
)
_NUMBER_WORDS = frozenset(
    "zero one two three four five six seven eight nine ten eleven twelve twenty thirty forty fifty hundred "
    "thousand million billion first second third fourth fifth half quarter dozen once twice".split()
)
_MINIMAL_EDITS = 3  # at most this many whole-word edits ...
_MINIMAL_SHARED = 0.5  # ... between prompts sharing at least this share of their words (Jaccard)


def _words(text: str) -> list[str]:
    """Lower-case word tokens; a negation contracted into its verb is split off ("didn't" -> "did", "not")."""
    words = []
    for word in _WORD.findall(text.lower().replace("\u2019", "'")):
        if word in _CONTRACTIONS:
            words.extend(_CONTRACTIONS[word])
        elif word.endswith("n't"):
            words.extend((word[:-3], "not"))
        else:
            words.append(word)
    return words


def _is_number(word: str) -> bool:
    return word in _NUMBER_WORDS or any(c.isdigit() for c in word)


def _is_typo(u: str, v: str) -> bool:
    """``v`` is a misspelling of ``u``: one edit apart (two for words of 8 letters or more), counting a swap of
    neighbouring letters as one; same first letter (a misspelling rarely changes it, a prefix such as un-,
    in-, dis- does); never a number (a changed number is another question)."""
    if u[0] != v[0] or _is_number(u) or _is_number(v):
        return False
    return _edit_distance(u, v) <= (1 if min(len(u), len(v)) < 8 else 2)


def _edit_distance(u: str, v: str) -> int:
    """Optimal-string-alignment distance: insertions, deletions, substitutions and swaps of adjacent
    characters, each 1 (Levenshtein plus the transposition typists make most)."""
    prev2: list[int] = []
    prev = list(range(len(v) + 1))
    for i in range(1, len(u) + 1):
        row = [i] + [0] * len(v)
        for j in range(1, len(v) + 1):
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (u[i - 1] != v[j - 1]))
            if i > 1 and j > 1 and u[i - 1] == v[j - 2] and u[i - 2] == v[j - 1]:
                row[j] = min(row[j], prev2[j - 2] + 1)
        prev2, prev = prev, row
    return prev[-1]


_NAME = re.compile(r"(?<![.?!]\s)(?<!^)\b[A-Z][A-Za-z0-9]*")


def _names(text: str) -> list[str]:
    """Capitalised words past the start of a sentence, in order: the names a prompt mentions ("from London to
    Manchester"), the cheapest stand-in for named entities. "I" and its contractions are not names."""
    return [w.lower() for w in _NAME.findall(text.strip()) if w != "I"]


def _negated(words: Sequence[str]) -> frozenset[str]:
    return frozenset(w for w in words if w in _NEGATIONS)


def lexical(query: str | None, stored: str | None) -> tuple[float, ...]:
    """The ``LEXICAL`` features of a prompt against a stored entry's prompt (lower-case word tokens):
    ``prompt_known`` 1 (0 and all else 0 when either text is unknown, e.g. an entry written without it);
    ``token_jaccard`` of the word sets; ``word_edits``, ``content_edits`` and ``typo_edits`` (log1p of the
    word-level edits of a ``difflib`` alignment: words substituted, inserted or deleted, those of them that
    touch a content word (not a function word such as "the", "my", "can"), and substitutions that are
    misspellings); ``minimal_pair`` 1 when 1 to 3 content-word edits separate prompts sharing at least half
    their words, or the same words are in another order; ``numbers_differ`` (the numbers in them, digits or words, differ),
    ``negation_differs`` (a negation word in one only, or different ones), ``reordered`` (same words,
    another order) and ``names_differ`` (the capitalised words past a sentence's start, in order, differ:
    another place, product or person), each 1 or 0."""
    if query is None or stored is None:
        return (0.0,) * len(LEXICAL)
    a, b = _words(query), _words(stored)
    sa, sb = set(a), set(b)
    jaccard = len(sa & sb) / len(sa | sb) if sa or sb else 1.0
    words = content = typos = 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        x, y = a[i1:i2], b[j1:j2]
        for u, v in zip(x, y, strict=False):
            if _is_typo(u, v):
                typos += 1
            else:
                words += 1
                content += u not in _FUNCTION_WORDS or v not in _FUNCTION_WORDS
        rest = x[len(y):] + y[len(x):]
        words += len(rest)
        content += sum(w not in _FUNCTION_WORDS for w in rest)
    numbers_a = sorted(w for w in a if _is_number(w))
    numbers_b = sorted(w for w in b if _is_number(w))
    reordered = a != b and sorted(a) == sorted(b)
    return (
        1.0,
        jaccard,
        math.log1p(words),
        math.log1p(content),
        math.log1p(typos),
        float(reordered or 1 <= content <= _MINIMAL_EDITS and jaccard >= _MINIMAL_SHARED),
        float(numbers_a != numbers_b),
        float(_negated(a) != _negated(b)),
        float(reordered),
        float(_names(query) != _names(stored)),
    )


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
        return (0.0, 0.0, math.log(_SHARE_FLOOR), 0.0)
    share = shares[chosen]
    rival = max((v for cluster, v in shares.items() if cluster != chosen), default=0.0)
    return (1.0, share, math.log(max(share, _SHARE_FLOOR)), rival)


def _with_classifier_blanked(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each observation the answer classifier spoke for, twice at half its weight: as observed, and with the
    ``CLASSIFIED`` features at their no-model values. The fit's other weights then also stand on their own
    for lookups the classifier cannot speak for (a scope without a model, a cluster it never saw), instead of
    being learnt only next to a share such lookups do not have: fitted on Banking77's classified lookups, then
    asked about fow's minimal pairs (no share), a model without this served up to 7 of 75 traps of a category
    (docs/notes/semantic-session5-*.md)."""
    import numpy as np

    if x.shape[1] != len(FEATURES):
        return x, y, w
    spoke = x[:, FEATURES.index("classified")] != 0.0
    if not spoke.any():
        return x, y, w
    blank = x[spoke].copy()
    blank[:, [FEATURES.index(name) for name in CLASSIFIED]] = _classified(None, "")
    half = np.where(spoke, w / 2.0, w)
    return np.vstack([x, blank]), np.concatenate([y, y[spoke]]), np.concatenate([half, w[spoke] / 2.0])


# Differences between the prompt and the stored one that can only make the stored answer *less* likely to be
# right: a negation, a number, a name, word order, a minimal edit. Their weights are rarely observed (Banking77
# has few such pairs), and a fit left free gave them the wrong sign by chance: "reordered" at -0.22 after a
# run with the answer classifier, and the warm fow replay served 4 of 75 entity swaps ("from London to
# Manchester" for "from Manchester to London"; docs/notes/semantic-session5-*.md). Their weights are held >= 0.
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


# --- the error model ----------------------------------------------------------------------------------------


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


# --- pacing the cut-off --------------------------------------------------------------------------------------


# The upper quantile the calibration reads. 0.85 let 16 of 48 synthetic runs (4 stream seeds x 4 exploration rng
# seeds x 3 bounds) end above the bound: a dozen explored verdicts often show no wrong answer from a model several
# times too optimistic. With 0.975 and the first 100 explorations at 25 %, 1 of 108 did
# (docs/notes/semantic-session3-*.md).
CONFIDENCE = 0.975


def calibration_upper(wrong: int, expected: float, *, prior: float, confidence: float) -> float:
    """Upper ``confidence`` quantile of the ratio observed / expected wrong answers: a Gamma posterior (Poisson
    counts) whose prior, worth ``prior`` expected errors, says the model is calibrated (ratio 1)."""
    from scipy.stats import gamma

    return float(gamma.ppf(confidence, prior + wrong, scale=1.0 / (prior + expected)))


class Calibration:
    """The exploration sample: observed and expected wrong answers among explored would-be hits, and ``value``,
    the upper ``confidence`` bound on their ratio (``calibration_upper``). It checks one error model, so the
    pacers that read that model share one."""

    def __init__(self, *, prior: float = 2.0, confidence: float = CONFIDENCE) -> None:
        self.prior = prior
        self.confidence = confidence
        self.expected = 0.0
        self.wrong = 0
        self.n = 0
        self.value = 1.0

    def explored(self, est_error: float, wrong: bool) -> None:
        self.expected += est_error
        self.wrong += int(wrong)
        self.n += 1
        self.value = calibration_upper(self.wrong, self.expected, prior=self.prior, confidence=self.confidence)


_OWN_PRIOR = 0.1
# The tail probability below which a scope's explored verdicts refute the shared calibration. Reading the own
# value only ever tightens (the larger of the two is used), so a false refutation costs a scope hits, never the
# bound; 0.025 waited for a second wrong answer while a new tenant's budget went on answers the model was
# wrong about (fow pairs after Banking77, 5 seeds: the pairs' scope above the bound in 3, in 1 with 0.1).
_REFUTED = 0.1
# The floor waits for stronger evidence: 2 wrong of 11 explored where 0.47 were expected (tail 0.08) set a floor
# of 0.47 a hit and closed a newcomer whose served hits were right 226 times in 226 (synthetic stream).
_FLOORED = 0.01


@dataclass(frozen=True, slots=True)
class PacerOptions:
    """The settings every ``Pacer`` of a ``BoundedPolicy`` is built with (``Pacer`` says what each does)."""

    window: int = 1000
    safety: float = 0.9
    every: int = 25
    prior: float = 2.0
    confidence: float = CONFIDENCE


class Pacer:
    """The cut-off on estimated error that keeps the expected error per lookup within ``max_error``.

    It remembers the estimates of the last ``window`` lookups (``inf`` for lookups with no candidate, 0 for
    exact hits) and picks the largest cut-off whose served estimates, summed and scaled by ``calibration``,
    average at most ``safety * max_error`` per lookup: serving the lowest estimates first gives the most hits
    for a given expected error. Errors already spent above budget are paid back over the next window.
    ``calibration`` is an upper confidence bound (``confidence``) on observed / expected wrong answers among
    explored would-be hits (``calibration_upper``): when the model underestimates the error, the cut-off
    tightens; when it overestimates, it loosens as the evidence grows.
    """

    def __init__(
        self,
        *,
        window: int = 1000,
        safety: float = 0.9,
        confidence: float = CONFIDENCE,
        prior: float = 2.0,
        every: int = 25,
        calibration: Calibration | None = None,
        newcomer: bool = False,
        trust: int = 10,
    ) -> None:
        self.window = window
        self.prior = prior
        self.safety = safety
        self.confidence = confidence
        self.every = every
        import numpy as np

        # The estimates of the last ``window`` lookups, a ring (order does not matter: they are sorted).
        self._recent = np.empty(window)
        self._n = self._pos = 0
        self._since = 0
        self._cutoff = 0.0
        self.lookups = 0
        self.spent = 0.0  # expected wrong answers served so far, by the model (uncalibrated)
        # The exploration sample may be shared between pacers (one per scope) that read the same error model.
        self._calibration = calibration if calibration is not None else Calibration(prior=prior, confidence=confidence)
        # This scope's own share of it: read only once it shows the shared value to be too low here.
        # Its prior is weak (worth a tenth of an expected error): it is read only once the shared value is refuted
        # here, and then it must be free to say how wrong the model is (a prior worth 2 expected errors kept a
        # model 90 times too optimistic at 6 times).
        self._own = Calibration(prior=_OWN_PRIOR, confidence=confidence) if calibration is not None else None
        # A newcomer: a scope first seen when the shared model had already been checked on other scopes' traffic
        # (BoundedPolicy). It must earn trust: its own calibration always counts (from its prior alone until its
        # first verdict: 2.8 times the model's estimates), its cut-off never splits a run of equal
        # estimates, and once its verdicts refute the shared calibration its hits cost at least its own wrong rate
        # (``floor``). A founding scope (the model learnt on its traffic) reads its own only when refuted.
        self.newcomer = newcomer and self._own is not None
        self.trust = trust  # the verdicts of its own a newcomer's floor waits for
        if self.newcomer:
            assert self._own is not None
            # Its own calibration has the shared one's prior (worth ``prior`` expected errors at ratio 1), not
            # the weak one a founder's refutation check reads: with 0.1, one wrong answer where 0.46 were expected
            # read 6.9 and closed a tenant like the founders for 500 lookups (synthetic, docs/notes).
            self._own.prior = prior
            self._own.value = calibration_upper(0, 0.0, prior=prior, confidence=confidence)
        self.explored_here = 0  # this scope's would-be hits explored so far (drawn at decision time)

    @property
    def calibration(self) -> float:
        """The shared calibration, or this scope's own when its explored verdicts refute the shared one: a
        model learnt on other tenants' prompts may be wrong on this one's (a new tenant asking minimal pairs
        the others never asked). The own value is read only on evidence, so a new scope is not held back
        for being new; in a scope that is the whole sample the two agree and the own one never applies."""
        shared = self._calibration.value
        own = self._own
        if own is not None and (self.newcomer or self.refuted):
            return max(shared, own.value)
        return shared

    @property
    def refuted(self) -> bool:
        """Whether this scope's explored verdicts refute the shared calibration: as many wrong answers as seen
        here, or more, would be unlikely (< _REFUTED) under the shared value."""
        return self._tail() < _REFUTED

    def _tail(self) -> float:
        """The chance of as many wrong answers as this scope's explorations saw, or more, under the shared value."""
        own = self._own
        if own is None or not own.wrong:
            return 1.0
        from scipy.stats import poisson

        return float(poisson.sf(own.wrong - 1, self._calibration.value * own.expected))

    @property
    def floor(self) -> float:
        """The least error a served hit is counted at here: 0 while the shared model holds in this scope; once
        refuted, the upper ``confidence`` bound on the wrong rate among the scope's explored would-be hits
        (Jeffreys prior). A model that put this scope's wrong answers at its floor ranks them among the right
        ones, so scaling its estimates cannot price them (fow pairs after Banking77: estimates of 1e-4 for
        answers wrong one time in two at its floor estimate 0.002, a calibration of 100 still served them); the rate seen here can."""
        own = self._own
        # Before ``trust`` verdicts the rate says little: one wrong answer in one read an upper bound of 1.0, and
        # a newcomer whose every hit cost 1 served nothing, explored nothing, and never learnt otherwise (5 of 36
        # synthetic runs at 0.05 served under 25 %, one nothing at all).
        if not self.newcomer or own is None or own.n < self.trust or self._tail() >= _FLOORED:
            return 0.0
        from scipy.stats import beta

        return float(beta.ppf(self.confidence, own.wrong + 0.5, own.n - own.wrong + 0.5))

    def scope_explored(self, est_error: float, wrong: bool) -> None:
        """A verdict on one of this scope's explored would-be hits (the shared sample is told by its owner)."""
        if self._own is not None:
            self._own.explored(est_error, wrong)

    @property
    def explored_expected(self) -> float:
        return self._calibration.expected

    @property
    def explored_wrong(self) -> int:
        return self._calibration.wrong

    @property
    def current(self) -> float:
        """The cut-off as last computed."""
        return self._cutoff

    def cutoff(self, max_error: float) -> float:
        if self._since >= self.every:
            self._since = 0
            self._recompute(max_error)
        elif self.lookups < self.every:
            # A young pacer (a scope's first lookups) follows each one: a scope with little traffic would
            # otherwise serve nothing until its first scheduled cut-off. The schedule itself is unchanged.
            self._recompute(max_error)
        return self._cutoff

    def record(self, est_error: float, served: bool) -> None:
        """One lookup: its candidate's estimated error (``inf`` if none) and whether it was served."""
        self._recent[self._pos] = est_error
        self._pos = (self._pos + 1) % self.window
        self._n = min(self._n + 1, self.window)
        self.lookups += 1
        self._since += 1
        if served:
            self.spent += est_error

    def explored(self, est_error: float, wrong: bool) -> None:
        """The verdict on an explored would-be hit: the sample that checks the model where it serves."""
        self._calibration.explored(est_error, wrong)

    def replace_recent(self, estimates: Sequence[float]) -> None:
        """Re-estimate the remembered lookups (after the model was refitted)."""
        import numpy as np

        kept = np.asarray(estimates, dtype=float)[-self.window :]
        self._recent[: len(kept)] = kept
        self._n, self._pos = len(kept), len(kept) % self.window
        self._since = self.every

    def _recompute(self, max_error: float) -> None:
        import numpy as np

        n = self._n
        if n == 0:
            return
        budget = self.safety * max_error
        # Over budget so far: pay the debt back over the next window. Under budget (the cold start serves
        # nothing): spend the saving over the next window, at most 1.5 times the rate, so the cumulative
        # expected error still stays within the budget.
        # Past spending is re-read with today's calibration: the cold start spent on an unchecked model.
        calibration = self.calibration
        floor = self.floor
        # The floor prices the hits to come, not those served: re-reading them all at an upper bound on the
        # wrong rate ran up a debt that closed a newcomer for a thousand lookups (synthetic stream, 3 wrong of 56).
        balance = (budget * self.lookups - self.spent * calibration) / self.window
        target = budget + min(balance, budget / 2)
        p = np.sort(self._recent[:n])
        p = p[np.isfinite(p)]
        if target <= 0 or p.size == 0:
            self._cutoff = 0.0
            return
        # Exact hits (estimate 0) cost nothing at any floor.
        spend = np.cumsum(np.where(p > 0, np.maximum(p * calibration, floor), 0.0)) / n
        k = int(np.searchsorted(spend, target, side="right"))
        if self.newcomer and 0 < k < p.size and p[k] == p[k - 1]:
            # The budget affords only part of a run of equal estimates (the model's floor): a cut-off serves all
            # of them or none, so none (serving all overspent a new tenant's budget ten times over).
            k = int(np.searchsorted(p, p[k], side="left"))
        self._cutoff = float(p[k - 1]) if k > 0 else 0.0


# --- the policies ----------------------------------------------------------------------------------------------


class StaticPolicy:
    """Serve the nearest entry when its cosine similarity is at least ``threshold``: the comparison baseline
    (GPTCache, RedisVL and LiteLLM decide this way). It learns nothing and explores nothing."""

    mode = "static"
    reads_shares = False
    learns = False

    def __init__(self, *, threshold: float) -> None:
        if not 0 < threshold <= 1:
            raise ValueError(f"threshold must be in (0, 1], got {threshold!r}")
        self.threshold = threshold

    def decide(
        self,
        neighbours: Sequence[Neighbour],
        max_error: float,
        explore_draw: float,
        clusters: AnswerClusters,
        scope: Hashable = None,
        prompt: str | None = None,
        shares: Mapping[str, float] | None = None,
    ) -> tuple[SemanticDecision, Candidate | None]:
        if not neighbours:
            return SemanticDecision(False, False, None, 0.0, self.threshold, math.nan), None
        top = neighbours[0]
        serve = top.similarity >= self.threshold
        return SemanticDecision(serve, False, top.entry_id, top.similarity, self.threshold, math.nan), None

    def exact(self, scope: Hashable, entry_id: str) -> SemanticDecision:
        return SemanticDecision(True, False, entry_id, 1.0, self.threshold, 0.0)

    def prepare(self) -> None:
        """Static mode fits nothing."""

    def observe(self, candidate: Candidate, wrong: bool, est_error: float, *, explored: bool) -> None:
        """Static mode learns nothing."""

    def readings(self, scope: Hashable | None = None) -> Readings:
        return Readings(self.threshold, 1.0)


class Readings(NamedTuple):
    """What ``SemanticStats`` reports of a policy: the cut-off a scope decides against, and the calibration."""

    cutoff: float
    calibration: float


class DecisionPolicy(Protocol):
    """Decides each semantic lookup of one rule and learns from the verdicts on them.

    ``mode`` names it (``bounded``, ``static``); ``reads_shares`` says whether ``decide`` reads the answer
    classifier's ``shares`` (the cache keeps a classifier only then); ``learns`` whether verdicts teach it
    anything (the cache judges no miss for a policy that does not learn). ``decide`` picks the candidate among
    ``neighbours`` and says whether to serve or explore it; ``exact`` is told of an exact hit (which costs no
    error) and returns its decision; ``prepare`` is called outside the cache's lock before ``observe``, which
    records one verdict on a candidate; ``readings`` is what ``SemanticStats`` reports of ``scope``.
    """

    mode: str
    reads_shares: bool
    learns: bool

    def decide(
        self,
        neighbours: Sequence[Neighbour],
        max_error: float,
        explore_draw: float,
        clusters: AnswerClusters,
        scope: Hashable = None,
        prompt: str | None = None,
        shares: Mapping[str, float] | None = None,
    ) -> tuple[SemanticDecision, Candidate | None]: ...

    def exact(self, scope: Hashable, entry_id: str) -> SemanticDecision: ...

    def prepare(self) -> None: ...

    def observe(self, candidate: Candidate, wrong: bool, est_error: float, *, explored: bool) -> None: ...

    def readings(self, scope: Hashable | None = None) -> Readings: ...


class AnswerClusters(Protocol):
    """What a policy reads of the cache: the answer clusters (judge links) and each entry's own verdicts."""

    @property
    def evidence(self) -> Mapping[str, tuple[int, int]]: ...  # entry -> (wrong, right) as a candidate

    def cluster_of(self, entry_id: str) -> str: ...

    def cluster_size(self, root: str) -> int: ...

    def prompt_of(self, entry_id: str, scope: Hashable = None) -> str | None: ...  # its stored prompt, if known


_NONE, _EXACT, _CANDIDATE = 0, 1, 2  # what a remembered lookup had: no candidate, an exact hit, a candidate
_SCOPES = 1024  # pacers kept (LRU): about 112 KB each with a full window, so about 115 MB at most


class _Pace:
    """One scope's pacer and the features of its last lookups, re-estimated when the shared error model has
    been refitted since (``fit``: the model's fit count then). The features are kept in a ring of rows
    (``kinds``: 0 no candidate, 1 an exact hit, 2 a candidate whose features are the row), about 80 KB per
    scope at the default window, so many scopes stay affordable."""

    __slots__ = ("fit", "kinds", "n", "pacer", "pos", "rows")

    def __init__(self, pacer: Pacer, fit: int) -> None:
        import numpy as np

        self.pacer = pacer
        self.fit = fit
        self.kinds = np.zeros(pacer.window, dtype=np.int8)
        self.rows: np.ndarray | None = None  # (window, features), made at the first candidate
        self.n = self.pos = 0

    def append(self, features: np.ndarray | None, *, exact: bool = False) -> None:
        import numpy as np

        if features is not None:
            if self.rows is None:
                self.rows = np.empty((len(self.kinds), len(features)))
            self.rows[self.pos] = features
        self.kinds[self.pos] = _CANDIDATE if features is not None else _EXACT if exact else _NONE
        self.pos = (self.pos + 1) % len(self.kinds)
        self.n = min(self.n + 1, len(self.kinds))

    def order(self) -> np.ndarray:
        """Positions of the remembered lookups, oldest first."""
        import numpy as np

        return (self.pos - self.n + np.arange(self.n)) % len(self.kinds)


class BoundedPolicy:
    """Serve a would-be hit when its estimated error is within the paced cut-off; explore a fraction
    ``explore`` of would-be hits (the caller draws uniformly in [0, 1) for each lookup), a fraction
    ``explore_first[1]`` of the first would-be hits until ``explore_first[0]`` of them were explored
    (``explore_chance``); each explored verdict weighs the inverse of the chance it had.

    One policy per rule (the bound is the rule's). The error model and its calibration (the exploration
    sample) are shared by all the scopes the rule serves: what makes a neighbour wrong is learnt from all of
    them. The budget is not: each scope (tenant namespace + boundary) has its own ``Pacer``, so one tenant's
    lookups without a candidate never buy another tenant's risky hits, and each scope's own error per lookup is
    held within the bound. The ``max_scopes`` most recently used pacers are kept; a scope whose pacer was
    dropped starts again cold (it serves nothing until its first cut-off), which errs on the safe side.
    ``pacer`` (a ``PacerOptions``) configures every ``Pacer``.

    ``item_cap``: a would-be hit whose own estimate (the model's, before calibration) exceeds ``item_cap`` x
    the bound is never served, whatever the budget left (None: the pacer alone decides). The calibration is an
    upper confidence bound over the whole exploration sample, right for pacing a budget and pessimistic for
    judging one answer: at the calibrations seen on Banking77 and CLINC150 (1.1-2.5) a cap on the calibrated
    estimate would act like a cap of 2-4.5 on the model's, and a cap of 2 cost 0.1-0.2 of the hit-rate ratio
    at δ = 0.02 (docs/notes/semantic-session4-*.md). The pacer holds the *average* error per lookup within the
    bound, so a scope whose lookups are mostly safe could otherwise spend its budget on a few answers that are
    individually likely wrong: 15-20 % estimates at a 2 % bound served negation traps ("without a
    prescription" for "do I need a prescription") in fow pair replays. With 5, at most 3 of 75 traps per
    category were served on every pair seed (docs/notes/semantic-session4-*.md).

    A scope first seen after the early exploration schedule is done is a newcomer (``Pacer(newcomer=)``): the
    model was checked on other scopes' traffic, not its. Its first ``trust`` would-be hits are all explored
    (verdicts for its own calibration; only those the draw picked join the shared sample), and its pacer reads
    its own pessimistic calibration until its verdicts earn it the shared one. A founding scope is unaffected.
    """

    mode = "bounded"
    reads_shares = True
    learns = True

    def __init__(
        self,
        *,
        explore: float = 0.05,
        explore_first: tuple[int, float] = (100, 0.25),
        k: int = 10,
        model: ErrorModel | None = None,
        pacer: PacerOptions = PacerOptions(),
        max_scopes: int = _SCOPES,
        trust: int = 10,
        item_cap: float | None = 5.0,
    ) -> None:
        if not 0 <= explore < 1:
            raise ValueError(f"explore must be in [0, 1), got {explore!r}")
        if k < 1:
            raise ValueError(f"k must be positive, got {k!r}")
        if max_scopes < 1:
            raise ValueError(f"max_scopes must be positive, got {max_scopes!r}")
        if explore_first[0] < 0 or not 0 <= explore_first[1] < 1:
            raise ValueError(f"explore_first must be (count >= 0, fraction in [0, 1)), got {explore_first!r}")
        if trust < 0:
            raise ValueError(f"trust must be >= 0, got {trust!r}")
        if item_cap is not None and (isinstance(item_cap, bool) or not isinstance(item_cap, int | float)
                                     or not item_cap > 0):
            raise ValueError(f"item_cap must be a number > 0 or None, got {item_cap!r}")
        self.explore = explore
        self.explore_first = explore_first
        self.trust = trust
        self.item_cap = item_cap
        self.explorations = 0  # would-be hits explored so far, all scopes (they check one model)
        self.k = k
        self.model = model if model is not None else ErrorModel()  # an empty one is falsy (len 0)
        if not isinstance(pacer, PacerOptions):
            raise TypeError(f"pacer must be a PacerOptions, got {type(pacer).__name__}")
        self._pacer_options = pacer
        self.calibration = Calibration(prior=pacer.prior, confidence=pacer.confidence)
        self.max_scopes = max_scopes
        self._paces: OrderedDict[Hashable, _Pace] = OrderedDict()
        self._last: Pacer | None = None

    @property
    def pacer(self) -> Pacer:
        """The pacer used last (a fresh one before any lookup): what ``SemanticStats`` reports by default."""
        if self._last is None:
            self._last = self._new_pacer()
        return self._last

    def pacer_of(self, scope: Hashable) -> Pacer | None:
        """``scope``'s pacer, or None when it has none (never looked up, or dropped as least recently used)."""
        pace = self._paces.get(scope)
        return None if pace is None else pace.pacer

    def __len__(self) -> int:
        """The number of pacers held."""
        return len(self._paces)

    def _new_pacer(self) -> Pacer:
        # A scope first seen once the model was checked elsewhere (its early exploration schedule done) is a
        # newcomer: that check says nothing of its prompts.
        newcomer = self.explore > 0 and self.explorations >= self.explore_first[0]
        o = self._pacer_options
        return Pacer(
            window=o.window, safety=o.safety, confidence=o.confidence, prior=o.prior, every=o.every,
            calibration=self.calibration, newcomer=newcomer, trust=self.trust,
        )

    def _pace(self, scope: Hashable) -> _Pace:
        pace = self._paces.get(scope)
        if pace is None:
            pace = self._paces[scope] = _Pace(self._new_pacer(), self.model.fits)
            if len(self._paces) > self.max_scopes:
                self._paces.popitem(last=False)
        else:
            self._paces.move_to_end(scope)
            if pace.fit != self.model.fits:
                self._reestimate(pace)
        self._last = pace.pacer
        return pace

    def decide(
        self,
        neighbours: Sequence[Neighbour],
        max_error: float,
        explore_draw: float,
        clusters: AnswerClusters,
        scope: Hashable = None,
        prompt: str | None = None,
        shares: Mapping[str, float] | None = None,
    ) -> tuple[SemanticDecision, Candidate | None]:
        if not 0 < max_error <= 0.5:
            raise ValueError(f"max_error must be in (0, 0.5], got {max_error!r}")
        pace = self._pace(scope)
        pacer = pace.pacer
        cutoff = pacer.cutoff(max_error)
        if self.item_cap is not None:
            cutoff = min(cutoff, self.item_cap * max_error)
        candidate = neighbourhood(
            neighbours, clusters.cluster_of, clusters.cluster_size, clusters.evidence,
            query=prompt, prompt_of=lambda entry_id: clusters.prompt_of(entry_id, scope), shares=shares,
        )
        pace.append(None if candidate is None else candidate.features)
        if candidate is None:
            pacer.record(math.inf, False)
            return SemanticDecision(False, False, None, 0.0, cutoff, 1.0), None
        est = float(self.model.predict(candidate.features)[0])
        would = self.model.ready and est <= cutoff
        # Uniform exploration: its sample of would-be hits is unbiased, so observed / expected wrong answers in
        # it measures the model where it serves (exploring more where estimates are high was tried: the sample
        # then checks the model where it is pessimistic, and the calibration loosened the bound; see
        # docs/notes/semantic-*.md).
        chance = self.explore_chance(self.explorations) if would else 0.0
        sampled = would and explore_draw < chance
        self.explorations += sampled
        # A scope earns trust: its first ``trust`` would-be hits are all explored, whatever the draw. The shared
        # model and calibration were learnt on other scopes' prompts; a tenant asking what they never asked
        # (minimal pairs after Banking77) was served on estimates 90 times too optimistic before a 5 % sample
        # of its hits could refute them (docs/notes/semantic-session3-*.md). Only the drawn ones enter the
        # shared calibration, which stays a uniform sample of would-be hits.
        untrusted = would and chance > 0 and pacer.newcomer and pacer.explored_here < self.trust
        explore = sampled or untrusted
        pacer.explored_here += explore
        candidate = candidate._replace(explore_chance=1.0 if untrusted else chance, scope=scope, sampled=sampled)
        pacer.record(est, would and not explore)
        decision = SemanticDecision(
            would and not explore, explore, candidate.entry_id, candidate.similarity, cutoff, est
        )
        return decision, candidate

    def explore_chance(self, explored: int) -> float:
        """The chance that the next would-be hit is explored, when ``explored`` would-be hits have been:
        ``explore``, raised to ``explore_first[1]`` for the first ``explore_first[0]``. The model is checked
        where it serves before its estimates are trusted: with 5 % explored, the first few hundred served
        lookups would rest on a dozen verdicts, too few to see a model several times too optimistic."""
        count, chance = self.explore_first
        return max(self.explore, chance) if explored < count and self.explore > 0 else self.explore

    def exact(self, scope: Hashable, entry_id: str) -> SemanticDecision:
        """An exact hit in ``scope``: a lookup that costs no error (it still counts in the per-lookup rate)."""
        pace = self._pace(scope)
        pace.append(None, exact=True)
        pace.pacer.record(0.0, True)
        return SemanticDecision(True, False, entry_id, 1.0, 0.0, 0.0)

    def readings(self, scope: Hashable | None = None) -> Readings:
        """``scope``'s cut-off (by default the scope looked up last; 0.0 for a scope without a pacer) and the
        shared calibration."""
        pacer = self.pacer if scope is None else self.pacer_of(scope)
        return Readings(0.0 if pacer is None else pacer.current, self.calibration.value)

    def prepare(self) -> None:
        """Called before ``observe``, outside the caller's lock: loads what the model's fit needs."""
        self.model.prepare()

    def observe(self, candidate: Candidate, wrong: bool, est_error: float, *, explored: bool) -> None:
        """A verdict on a candidate: the judge on a miss or an exploration, or feedback on a served hit.

        Only explorations enter the calibration: they are the uniform sample of would-be hits. Served hits with
        feedback are not (users report what they choose to, mostly what was wrong); they still inform the
        model, whose features include everything that decided they were served.
        """
        if explored:
            if candidate.sampled:
                self.calibration.explored(est_error, wrong)
            pace = self._paces.get(candidate.scope)
            if pace is not None:
                pace.pacer.scope_explored(est_error, wrong)
        # Inverse propensity: an explored verdict stands for the 1/chance would-be hits like it that were served.
        weight = 1.0 / candidate.explore_chance if explored and candidate.explore_chance > 0 else 1.0
        self.model.observe(candidate.features, wrong, weight)  # the pacers re-estimate on their next lookup

    def _reestimate(self, pace: _Pace) -> None:
        """Re-estimate a scope's remembered lookups with the refitted model."""
        import numpy as np

        at = pace.order()
        kinds = pace.kinds[at]
        estimates = np.where(kinds == _NONE, math.inf, 0.0)
        candidates = kinds == _CANDIDATE
        if candidates.any():
            assert pace.rows is not None
            estimates[candidates] = self.model.predict(pace.rows[at[candidates]])
        pace.pacer.replace_recent(estimates)
        pace.fit = self.model.fits


@dataclass(frozen=True, slots=True)
class PolicyOptions:
    """What ``SemanticCache(mode=...)`` builds its policy from: ``explore`` and ``k`` for ``bounded``,
    ``threshold`` for ``static`` (and only there)."""

    mode: str = "bounded"
    explore: float = 0.05
    threshold: float | None = None
    k: int = 10

    def __post_init__(self) -> None:
        if self.mode not in POLICIES:
            raise ValueError(f"unknown semantic mode {self.mode!r}; known: {', '.join(POLICIES)}")
        if self.mode == "static" and self.threshold is None:
            raise ValueError("mode 'static' needs a threshold")
        if self.mode != "static" and self.threshold is not None:
            raise ValueError(f"threshold applies only to mode 'static', not {self.mode!r}")

    def build(self) -> DecisionPolicy:
        return POLICIES[self.mode](self)


POLICIES: dict[str, Callable[[PolicyOptions], DecisionPolicy]] = {
    "bounded": lambda o: BoundedPolicy(explore=o.explore, k=o.k),
    "static": lambda o: StaticPolicy(threshold=o.threshold),  # type: ignore[arg-type]  # checked: not None
}
"""Semantic modes by name: each builds its ``DecisionPolicy`` from the ``PolicyOptions``."""
