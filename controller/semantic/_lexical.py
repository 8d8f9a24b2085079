"""Text features: how a prompt differs from a stored entry's prompt, word by word (``lexical``).

An embedding puts "cancel my subscription" next to "don't cancel my subscription": a trap is a minimal pair
(the prompts share almost every word and differ by one or a few whole, correctly spelt words), a near-repeat
differs by typos (words within a small character edit of the original), a paraphrase changes many words. The
classic paraphrase-identification features here tell them apart; their weights are learnt by the error model
from judge verdicts like every other feature's (see docs/semantic.md, 'Error model').
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Sequence

__all__ = ["LEXICAL", "lexical"]

LEXICAL = (
    "prompt_known", "token_jaccard", "word_edits", "content_edits", "typo_edits", "minimal_pair", "numbers_differ",
    "negation_differs", "reordered", "names_differ",
)
# What the scope's answer classifier (``_classify.AnswerClassifier``) says of the candidate's cluster: whether
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
