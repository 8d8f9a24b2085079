"""The context a proposal's evidence was gathered under, and when that evidence stops holding.

A replay says what a policy change would have done to traffic served by one policy, one model revision, one
prompt template, with outputs of one shape. Evidence gathered under ``EvidenceContext`` A no longer holds in
context B when any of the four moved (``invalidated_by``), checked in this order:

1. the policy: the proposal was judged against ``chat@3`` and ``chat@4`` runs now (or ``chat@3`` with other
   contents);
2. the model: its id, then its revision;
3. the prompt template (its hash);
4. the outputs: the same model revision can serve outputs of another shape (a tokenizer or sampling change,
   a serving bug), which moves output lengths and so what a cached response is worth. ``OutputFingerprint``
   is a small sketch of a bounded sample of outputs: a histogram of their lengths in half-doublings and a
   feature-hashed histogram of their character (or token) n-grams. Two fingerprints are compared by the larger
   of the two histograms' Jensen-Shannon distances (base 2, so 0..1).

Equal samples are at distance 0. Resamples of one distribution come closer as samples grow: with 256 outputs
of about 20 words, two samples of the same distribution were about 0.1 apart, outputs twice as long about 0.5,
and another vocabulary about 0.55; with 512, the two samples were about 0.05 apart. With 64 outputs they were
0.15 apart: the default threshold, 0.2, assumes a few hundred outputs.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import numpy as np

OutputUnit = Literal["chars", "tokens"]

DEFAULT_THRESHOLD = 0.2
LENGTH_BUCKETS = 32  # half-doublings: bucket floor(2*log2(1 + length)), the last one open-ended (>= ~46k)
GRAM_BUCKETS = 256
MAX_SAMPLE = 4096  # outputs a fingerprint reads at most (a seeded sample of the outputs given)
MAX_OUTPUT = 4096  # characters or tokens of one output read for n-grams (its length counts in full)

_MIX = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: spreads the polynomial hash over the buckets
_BASE = 0x100000001B3  # the FNV-64 prime as the polynomial base


@dataclass(frozen=True, slots=True)
class OutputFingerprint:
    """A sketch of a sample of one model revision's outputs.

    ``unit``: what lengths count and n-grams are made of (characters of texts, or token ids). ``samples``: the
    outputs read. ``lengths``: outputs per length bucket (``LENGTH_BUCKETS``). ``grams``: n-grams per
    hashed bucket (``GRAM_BUCKETS``), empty when made from lengths alone (``of_lengths``). ``ngram`` and
    ``seed``: how it was made; only fingerprints made alike compare (``distance`` raises ``ValueError``
    otherwise).
    """

    unit: OutputUnit
    samples: int
    lengths: tuple[int, ...]
    grams: tuple[int, ...] = ()
    ngram: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        if self.unit not in ("chars", "tokens"):
            raise ValueError(f"output fingerprint: unit {self.unit!r} is not 'chars' or 'tokens'")
        if len(self.lengths) != LENGTH_BUCKETS:
            raise ValueError(f"output fingerprint: lengths has {len(self.lengths)} buckets, not "
                             f"{LENGTH_BUCKETS}")
        if self.grams and len(self.grams) != GRAM_BUCKETS:
            raise ValueError(f"output fingerprint: grams has {len(self.grams)} buckets, not {GRAM_BUCKETS}")
        if sum(self.lengths) != self.samples:
            raise ValueError(f"output fingerprint: lengths count {sum(self.lengths)} outputs, samples says "
                             f"{self.samples}")
        if not 1 <= self.ngram <= 16:
            raise ValueError(f"output fingerprint: ngram {self.ngram} is not within 1..16")

    @classmethod
    def of(cls, outputs: Sequence[str] | Sequence[Sequence[int]], *, sample: int = 512, seed: int = 0,
           ngram: int = 3) -> OutputFingerprint:
        """The fingerprint of ``outputs``: texts (``unit="chars"``) or token id sequences (``"tokens"``), all
        of one kind. At most ``sample`` of them are read (a sample drawn with ``seed`` when there are more;
        the seed also salts the n-gram hash). Raises ``ValueError`` for no outputs, a mix of kinds, or a
        ``sample`` outside 1..``MAX_SAMPLE``."""
        import numpy as np

        chosen = _sample(outputs, sample, seed)
        texts = [isinstance(o, str) for o in chosen]
        if any(texts) and not all(texts):
            raise ValueError("output fingerprint: outputs mix texts and token sequences")
        unit: OutputUnit = "chars" if all(texts) else "tokens"
        lengths = [0] * LENGTH_BUCKETS
        grams = np.zeros(GRAM_BUCKETS, dtype=np.int64)
        for output in chosen:
            lengths[_length_bucket(len(output))] += 1
            codes = _codes(output, unit)
            if len(codes) >= ngram:
                grams += np.bincount(_gram_buckets(codes, ngram, seed), minlength=GRAM_BUCKETS)
        return cls(unit, len(chosen), tuple(lengths), tuple(int(g) for g in grams), ngram, seed)

    @classmethod
    def of_lengths(cls, lengths: Sequence[int], *, unit: OutputUnit = "tokens", sample: int = 512,
                   seed: int = 0) -> OutputFingerprint:
        """A fingerprint of output lengths alone (what an access event or a trace records), compared on
        lengths only. Raises ``ValueError`` for no lengths or a negative one."""
        chosen = _sample(lengths, sample, seed)
        buckets = [0] * LENGTH_BUCKETS
        for length in chosen:
            if length < 0:
                raise ValueError(f"output fingerprint: a negative output length ({length})")
            buckets[_length_bucket(int(length))] += 1
        return cls(unit, len(chosen), tuple(buckets), (), 3, seed)

    def distance(self, other: OutputFingerprint) -> float:
        """0 for equal samples, up to 1 for outputs that share no length bucket or no n-gram bucket: the
        larger of the length and n-gram histograms' Jensen-Shannon distances (the n-grams only when both
        have them). Raises ``ValueError`` for fingerprints made differently (unit, ngram or seed)."""
        made = (self.unit, self.ngram, self.seed)
        theirs = (other.unit, other.ngram, other.seed)
        if made != theirs:
            raise ValueError(f"output fingerprints made differently cannot be compared: unit, ngram, seed "
                             f"{made} vs {theirs}")
        d = _js_distance(self.lengths, other.lengths)
        if self.grams and other.grams:
            d = max(d, _js_distance(self.grams, other.grams))
        return d

    def changed(self, other: OutputFingerprint, threshold: float = DEFAULT_THRESHOLD) -> bool:
        """Whether ``other`` is farther than ``threshold`` from this one."""
        return self.distance(other) > threshold

    def to_dict(self) -> dict[str, Any]:
        return {"unit": self.unit, "samples": self.samples, "ngram": self.ngram, "seed": self.seed,
                "lengths": list(self.lengths), "grams": list(self.grams)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OutputFingerprint:
        """Raises ``ValueError`` naming the field that is missing or malformed."""
        try:
            return cls(unit=data["unit"], samples=int(data["samples"]), ngram=int(data.get("ngram", 3)),
                       seed=int(data.get("seed", 0)), lengths=tuple(int(x) for x in data["lengths"]),
                       grams=tuple(int(x) for x in data.get("grams") or ()))
        except KeyError as exc:
            raise ValueError(f"output fingerprint: missing field {exc.args[0]!r}") from None
        except TypeError as exc:
            raise ValueError(f"output fingerprint: {exc}") from None


def _sample(items: Sequence[Any], sample: int, seed: int) -> list[Any]:
    if not 1 <= sample <= MAX_SAMPLE:
        raise ValueError(f"output fingerprint: sample {sample} is not within 1..{MAX_SAMPLE}")
    if not items:
        raise ValueError("output fingerprint: no outputs to fingerprint")
    if len(items) <= sample:
        return list(items)
    # Sorted indices: the sample keeps the outputs' order, so the same seed picks the same outputs.
    return [items[i] for i in sorted(random.Random(seed).sample(range(len(items)), sample))]


def _length_bucket(length: int) -> int:
    return min(LENGTH_BUCKETS - 1, int(2 * math.log2(1 + length)))


def _codes(output: str | Sequence[int], unit: OutputUnit) -> np.ndarray:
    import numpy as np

    if unit == "chars":
        assert isinstance(output, str)
        return np.frombuffer(output[:MAX_OUTPUT].encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)
    return np.asarray(list(output[:MAX_OUTPUT]), dtype=np.int64).astype(np.uint64)


def _gram_buckets(codes: np.ndarray, n: int, seed: int) -> np.ndarray:
    """The bucket of each n-gram of ``codes``: a polynomial hash mod 2^64, salted with ``seed`` and mixed, so
    the buckets are the same in every process (Python's ``hash`` of a str is not)."""
    import numpy as np

    m = len(codes) - n + 1
    h = np.zeros(m, dtype=np.uint64)
    base = np.uint64(_BASE)
    with np.errstate(over="ignore"):  # the hash wraps mod 2^64 on purpose
        for j in range(n):
            h = h * base + codes[j:j + m]
        h ^= np.uint64(seed & 0xFFFFFFFFFFFFFFFF)
        h *= np.uint64(_MIX)
        h ^= h >> np.uint64(29)
        h *= np.uint64(_MIX)
    return (h >> np.uint64(32)) % np.uint64(GRAM_BUCKETS)


def _js_distance(p: Sequence[int], q: Sequence[int]) -> float:
    """Jensen-Shannon distance (base 2) of two count histograms; 0 when either is empty of counts."""
    sp, sq = sum(p), sum(q)
    if not sp or not sq:
        return 0.0
    divergence = 0.0
    for a, b in zip(p, q, strict=True):
        pa, qb = a / sp, b / sq
        mid = (pa + qb) / 2
        if pa:
            divergence += pa * math.log2(pa / mid) / 2
        if qb:
            divergence += qb * math.log2(qb / mid) / 2
    return math.sqrt(max(0.0, divergence))


@dataclass(frozen=True, slots=True)
class EvidenceContext:
    """What traffic was served by when evidence was gathered: the policy (``policy_ref`` ``name@version`` and
    its content hash), the model (id and revision), the prompt template's hash, and the outputs' fingerprint
    (None when no outputs were sampled)."""

    policy_ref: str
    policy_hash: str
    model_id: str
    model_revision: str
    template_hash: str
    output_fingerprint: OutputFingerprint | None = None

    def to_dict(self) -> dict[str, Any]:
        fp = self.output_fingerprint
        return {"policy_ref": self.policy_ref, "policy_hash": self.policy_hash, "model_id": self.model_id,
                "model_revision": self.model_revision, "template_hash": self.template_hash,
                "output_fingerprint": None if fp is None else fp.to_dict()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EvidenceContext:
        """Raises ``ValueError`` naming the field that is missing or malformed."""
        fields = ("policy_ref", "policy_hash", "model_id", "model_revision", "template_hash")
        missing = [name for name in fields if not isinstance(data.get(name), str)]
        if missing:
            raise ValueError(f"evidence context: {', '.join(missing)} missing or not text")
        fp = data.get("output_fingerprint")
        return cls(policy_ref=data["policy_ref"], policy_hash=data["policy_hash"], model_id=data["model_id"],
                   model_revision=data["model_revision"], template_hash=data["template_hash"],
                   output_fingerprint=None if fp is None else OutputFingerprint.from_dict(fp))


def invalidated_by(evidence: EvidenceContext, now: EvidenceContext, *,
                   threshold: float = DEFAULT_THRESHOLD) -> str | None:
    """Why evidence gathered under ``evidence`` no longer holds under ``now``, or None while it does. The
    first reason found, in the order policy, model id, model revision, prompt template, outputs. The outputs
    are compared only when both contexts have a fingerprint; fingerprints made differently count as
    changed."""
    if (evidence.policy_ref, evidence.policy_hash) != (now.policy_ref, now.policy_hash):
        if evidence.policy_ref == now.policy_ref:
            return (f"the policy changed: evidence for {evidence.policy_ref} ({evidence.policy_hash[:12]}), "
                    f"running {now.policy_ref} ({now.policy_hash[:12]})")
        return f"the policy changed: evidence for {evidence.policy_ref}, running {now.policy_ref}"
    if evidence.model_id != now.model_id:
        return f"model changed from {evidence.model_id} to {now.model_id}"
    if evidence.model_revision != now.model_revision:
        return f"model revision changed from {evidence.model_revision} to {now.model_revision}"
    if evidence.template_hash != now.template_hash:
        return f"prompt template changed from {evidence.template_hash[:12]} to {now.template_hash[:12]}"
    before, after = evidence.output_fingerprint, now.output_fingerprint
    if before is None or after is None:
        return None
    try:
        d = before.distance(after)
    except ValueError as exc:
        return f"output distribution changed ({exc})"
    if d > threshold:
        return f"output distribution changed (distance {d:.2f} > {threshold:g})"
    return None
