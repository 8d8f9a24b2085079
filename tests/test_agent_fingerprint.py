"""The evidence context and its invalidation: output fingerprints, and the reason evidence stops holding."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys

import pytest
from evocache.agents._fingerprint import (
    GRAM_BUCKETS,
    LENGTH_BUCKETS,
    MAX_SAMPLE,
    EvidenceContext,
    OutputFingerprint,
    invalidated_by,
)

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def vocabulary(seed: int, size: int = 2000) -> list[str]:
    r = random.Random(seed)
    return ["".join(r.choice(LETTERS) for _ in range(r.randint(2, 8))) for _ in range(size)]


def outputs(words: list[str], n: int, mean_words: float, seed: int) -> list[str]:
    """``n`` texts of Zipf-distributed words, lognormal lengths around ``mean_words`` words."""
    r = random.Random(seed)
    weights = [1 / (i + 1) ** 1.2 for i in range(len(words))]
    return [" ".join(r.choices(words, weights, k=max(1, int(r.lognormvariate(math.log(mean_words), 0.5)))))
            for _ in range(n)]


WORDS = vocabulary(1)
BASE = OutputFingerprint.of(outputs(WORDS, 256, 20, seed=10))


def lengths_only(buckets: dict[int, int]) -> OutputFingerprint:
    counts = [0] * LENGTH_BUCKETS
    for i, n in buckets.items():
        counts[i] = n
    return OutputFingerprint("tokens", sum(counts), tuple(counts))


def test_equal_samples_are_at_distance_zero() -> None:
    again = OutputFingerprint.of(outputs(WORDS, 256, 20, seed=10))
    assert again == BASE
    assert BASE.distance(again) == 0.0
    assert not BASE.changed(again)


def test_a_resample_of_the_same_distribution_is_close() -> None:
    resample = OutputFingerprint.of(outputs(WORDS, 256, 20, seed=11))
    assert 0 < BASE.distance(resample) < 0.15
    assert not BASE.changed(resample, 0.2)


def test_longer_outputs_are_far() -> None:
    longer = OutputFingerprint.of(outputs(WORDS, 256, 40, seed=12))
    assert BASE.distance(longer) > 0.4
    assert BASE.changed(longer, 0.2)


def test_another_vocabulary_of_the_same_lengths_is_far() -> None:
    r = random.Random(2)
    respelt = ["".join(r.choice(LETTERS) for _ in word) for word in WORDS]  # each word as long as before
    other = OutputFingerprint.of(outputs(respelt, 256, 20, seed=10))
    assert other.lengths == BASE.lengths  # the lengths alone would not tell
    assert BASE.distance(other) > 0.4


def test_lengths_are_counted_in_half_doublings() -> None:
    fp = OutputFingerprint.of(["", "a", "abc", "x" * 100_000])
    expected = [0] * LENGTH_BUCKETS
    expected[0] = expected[2] = expected[4] = expected[LENGTH_BUCKETS - 1] = 1
    assert fp.lengths == tuple(expected)
    assert (fp.unit, fp.samples, len(fp.grams)) == ("chars", 4, GRAM_BUCKETS)
    # "abc" gives one trigram, the long text MAX_OUTPUT - 2 of them, the shorter texts none
    assert sum(fp.grams) == 1 + 4096 - 2


def test_token_sequences_make_a_token_fingerprint() -> None:
    fp = OutputFingerprint.of([[1, 2, 3, 4], [5, 6]], ngram=2)
    assert (fp.unit, fp.samples, sum(fp.grams), fp.ngram) == ("tokens", 2, 4, 2)


def test_a_sample_is_bounded_and_seeded() -> None:
    texts = outputs(WORDS, 300, 10, seed=3)
    a = OutputFingerprint.of(texts, sample=100, seed=7)
    assert a == OutputFingerprint.of(texts, sample=100, seed=7)
    assert a.samples == 100
    assert OutputFingerprint.of(texts, sample=100, seed=8).grams != a.grams


def test_the_fingerprint_is_the_same_in_another_process() -> None:
    # Python salts str hashes per process: the n-gram buckets must not depend on them.
    code = ("import json; from evocache.agents._fingerprint import OutputFingerprint as F; "
            "print(json.dumps(F.of(['the cat sat on the mat', 'a dog']).to_dict()))")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert json.loads(out.stdout) == OutputFingerprint.of(["the cat sat on the mat", "a dog"]).to_dict()


@pytest.mark.parametrize(("outputs_", "kwargs", "message"), [
    ([], {}, "output fingerprint: no outputs to fingerprint"),
    (["a"], {"sample": MAX_SAMPLE + 1}, f"output fingerprint: sample {MAX_SAMPLE + 1} is not within 1..4096"),
    (["a", [1, 2]], {}, "output fingerprint: outputs mix texts and token sequences"),
])
def test_bad_outputs_are_refused(outputs_: list, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        OutputFingerprint.of(outputs_, **kwargs)
    assert str(info.value) == message


def test_lengths_alone_compare_on_lengths() -> None:
    a = OutputFingerprint.of_lengths([10, 12, 11, 9])
    b = OutputFingerprint.of_lengths([300, 280, 310, 290])
    assert (a.grams, a.unit) == ((), "tokens")
    assert a.distance(b) == 1.0  # no length bucket in common
    with pytest.raises(ValueError, match=r"^output fingerprint: a negative output length \(-1\)$"):
        OutputFingerprint.of_lengths([3, -1])


def test_a_half_overlap_has_the_jensen_shannon_distance() -> None:
    # p = (1, 0), q = (1/2, 1/2): JSD = 0.5 log2(4/3) + 0.25 log2(2/3) + 0.25 log2(2)
    jsd = 0.5 * math.log2(4 / 3) + 0.25 * math.log2(2 / 3) + 0.25
    assert lengths_only({3: 4}).distance(lengths_only({3: 2, 9: 2})) == pytest.approx(math.sqrt(jsd), abs=1e-12)


def test_fingerprints_made_differently_do_not_compare() -> None:
    chars = OutputFingerprint.of(["abcd"])
    with pytest.raises(ValueError) as info:
        chars.distance(OutputFingerprint.of([[1, 2, 3]]))
    assert str(info.value) == ("output fingerprints made differently cannot be compared: unit, ngram, seed "
                               "('chars', 3, 0) vs ('tokens', 3, 0)")


def test_round_trip_and_malformed_dicts() -> None:
    assert OutputFingerprint.from_dict(json.loads(json.dumps(BASE.to_dict()))) == BASE
    broken = BASE.to_dict()
    del broken["lengths"]
    with pytest.raises(ValueError, match=r"^output fingerprint: missing field 'lengths'$"):
        OutputFingerprint.from_dict(broken)
    with pytest.raises(ValueError, match=r"^output fingerprint: lengths count 257 outputs, samples says 256$"):
        OutputFingerprint.from_dict({**BASE.to_dict(), "lengths": [257] + [0] * (LENGTH_BUCKETS - 1)})
    with pytest.raises(ValueError, match=r"^output fingerprint: grams has 3 buckets, not 256$"):
        OutputFingerprint.from_dict({**BASE.to_dict(), "grams": [1, 2, 3]})


# --- the context and its invalidation ----------

H3, H4 = "a" * 64, "b" * 64
T1, T2 = "1" * 64, "2" * 64
CONTEXT = EvidenceContext("chat@3", H3, "qwen", "rev-a", T1, lengths_only({3: 4}))


def moved(**changes: object) -> EvidenceContext:
    fields = CONTEXT.to_dict()
    fields["output_fingerprint"] = CONTEXT.output_fingerprint
    fields.update(changes)
    return EvidenceContext(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(("now", "reason"), [
    (CONTEXT, None),
    (moved(policy_ref="chat@4", policy_hash=H4), "the policy changed: evidence for chat@3, running chat@4"),
    (moved(policy_hash=H4), "the policy changed: evidence for chat@3 (aaaaaaaaaaaa), running chat@3 (bbbbbbbbbbbb)"),
    (moved(model_id="llama"), "model changed from qwen to llama"),
    (moved(model_revision="rev-b"), "model revision changed from rev-a to rev-b"),
    (moved(template_hash=T2), "prompt template changed from 111111111111 to 222222222222"),
    (moved(output_fingerprint=lengths_only({9: 4})), "output distribution changed (distance 1.00 > 0.2)"),
    (moved(output_fingerprint=lengths_only({3: 2, 9: 2})), "output distribution changed (distance 0.56 > 0.2)"),
    (moved(output_fingerprint=lengths_only({3: 40, 9: 1})), None),
    (moved(output_fingerprint=None), None),
    (moved(output_fingerprint=OutputFingerprint.of(["abc"])),
     ("output distribution changed (output fingerprints made differently cannot be compared: unit, ngram, seed "
     "('tokens', 3, 0) vs ('chars', 3, 0))")),
])
def test_the_reason_evidence_no_longer_holds(now: EvidenceContext, reason: str | None) -> None:
    assert invalidated_by(CONTEXT, now) == reason


def test_the_first_reason_wins_and_the_threshold_is_the_callers() -> None:
    everything = moved(policy_ref="chat@4", policy_hash=H4, model_revision="rev-b", template_hash=T2)
    assert invalidated_by(CONTEXT, everything) == "the policy changed: evidence for chat@3, running chat@4"
    both = moved(model_revision="rev-b", template_hash=T2)
    assert invalidated_by(CONTEXT, both) == "model revision changed from rev-a to rev-b"
    half = moved(output_fingerprint=lengths_only({3: 2, 9: 2}))
    assert invalidated_by(CONTEXT, half, threshold=0.6) is None
    assert invalidated_by(CONTEXT, half, threshold=0.5) == "output distribution changed (distance 0.56 > 0.5)"


def test_a_context_survives_json() -> None:
    assert EvidenceContext.from_dict(json.loads(json.dumps(CONTEXT.to_dict()))) == CONTEXT
    bare = {k: v for k, v in CONTEXT.to_dict().items() if k != "model_revision"}
    with pytest.raises(ValueError, match=r"^evidence context: model_revision missing or not text$"):
        EvidenceContext.from_dict(bare)
