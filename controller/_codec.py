"""The byte form of an ``Entry`` in the shared tiers (L2 Redis, L3 disk), and the namespace/key checks.

Layout (little endian)::

    magic  b"EVC"            3 bytes
    format version           1 byte   (FORMAT_VERSION)
    flags                    1 byte   bit 0: expires_at present, bit 1: sliding_ttl present
    expires_at               f64      (0.0 when absent)
    created_at               f64
    saved_ms                 f64
    sliding_ttl              f64      (0.0 when absent)
    saved_tokens             u64
    saved_cost               f64
    rule length              u16
    rule                     UTF-8
    payload                  the rest, up to the tag
    tag                      16 bytes: keyed BLAKE2b over (namespace, key, everything above)

The tag is a MAC under the deployment's secret (``EntryCodec(secret)``) and binds the blob to the namespace
and key it was written under and to its expiry (part of the header). A blob copied under another key or
namespace fails its check exactly like a flipped bit or a truncated write, and without the secret nobody who
can write to Redis or the disk can make a blob that passes: a tier never serves one tenant's value to another,
nor a value it did not write itself. (Keyed BLAKE2b rather than HMAC-SHA256: one hash call instead of two, on
every L2/L3 read and write.) Blobs of an older format read as an unsupported version: dropped and recomputed.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import re
import struct
from collections.abc import Sequence

from ._types import CacheKey, Entry, Namespace, TierName
from .errors import CorruptEntry

_blake2b = hashlib.blake2b
_new_tuple = tuple.__new__

MAGIC = b"EVC"
FORMAT_VERSION = 4
DIGEST_SIZE = 16
MIN_SECRET_BYTES = 16
"""The shortest deployment secret accepted: 128 bits."""

# Fixed part of the header; the rule and the payload follow it, the digest closes the blob.
_HEAD = struct.Struct("<3sBBddddQdH")
_HAS_EXPIRY = 0x01
_HAS_SLIDING = 0x02
_KNOWN_FLAGS = _HAS_EXPIRY | _HAS_SLIDING
_MAX_RULE = 0xFFFF

OVERHEAD = _HEAD.size + DIGEST_SIZE
"""Bytes an encoded entry adds to its value, not counting the rule name."""

_NS_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")
_KEY_RE = re.compile(r"[0-9a-f]{16,128}")


_checked_ns: set[str] = set()  # namespaces seen valid: a set lookup instead of a regex on every call


def check_ns(ns: Namespace) -> None:
    """Raise ``ValueError`` unless ``ns`` is a valid namespace (``^[A-Za-z0-9._-]{1,128}$``).

    The controller validates namespaces already; tiers check again because a namespace is part of a storage
    key, and a separator smuggled into one would let it address another tenant's entries.
    """
    if type(ns) is str and ns in _checked_ns:
        return
    if not (isinstance(ns, str) and _NS_RE.fullmatch(ns)):
        raise ValueError(f"invalid namespace {ns!r}: expected 1-128 characters of [A-Za-z0-9._-]")
    if len(_checked_ns) < 65_536:  # bounded: tenants are many but not unbounded in one process
        _checked_ns.add(ns)


def is_ns(ns: object) -> bool:
    """Whether ``ns`` is a valid namespace (``check_ns`` without the exception)."""
    return isinstance(ns, str) and _NS_RE.fullmatch(ns) is not None


def check_keys(keys: Sequence[CacheKey]) -> None:
    """Raise ``ValueError`` unless every key is a lower-case hex digest of 16 to 128 characters."""
    for key in keys:
        if not (isinstance(key, str) and _KEY_RE.fullmatch(key)):
            raise ValueError(f"invalid cache key {key!r}: expected 16-128 lower-case hex digits")


def check_key(key: CacheKey) -> None:
    """``check_keys((key,))`` for the request path's single-key reads."""
    if not (type(key) is str and _KEY_RE.fullmatch(key)):
        raise ValueError(f"invalid cache key {key!r}: expected 16-128 lower-case hex digits")


def check_slot(ns: Namespace, key: CacheKey) -> None:
    """``check_ns(ns)`` and ``check_key(key)`` in one call, for the request path's single-key reads."""
    if not (type(ns) is str and ns in _checked_ns):
        check_ns(ns)
    if not (type(key) is str and _KEY_RE.fullmatch(key)):
        raise ValueError(f"invalid cache key {key!r}: expected 16-128 lower-case hex digits")


def encoded_size(entry: Entry) -> int:
    """Length of ``EntryCodec.encode(..., entry)`` without encoding it."""
    return OVERHEAD + len(entry.rule.encode()) + len(entry.value)


@functools.lru_cache(maxsize=4096)
def _digest_prefix(ns: str, key: str) -> bytes:
    # Length prefixes keep (ns, key) unambiguous: ("ab", "c…") and ("a", "bc…") hash differently.
    nsb, keyb = ns.encode(), key.encode()
    return b"".join((len(nsb).to_bytes(2, "little"), nsb, len(keyb).to_bytes(2, "little"), keyb))


class EntryCodec:
    """Encodes entries into signed blobs and verifies them, under one secret (at least 16 bytes).

    Every process that shares a tier's storage must use the same secret (``controller._secret`` finds it);
    a blob signed under another one is a ``CorruptEntry``, never an entry.
    """

    __slots__ = ("_key",)

    def __init__(self, secret: bytes) -> None:
        if not isinstance(secret, bytes):
            raise TypeError(f"secret must be bytes, not {type(secret).__name__}")
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"secret is {len(secret)} bytes; at least {MIN_SECRET_BYTES} are needed")
        # A fixed-size key whatever the secret's length (BLAKE2b takes at most 64), separate from other uses.
        self._key = _blake2b(secret, digest_size=32, person=b"evocache-entry").digest()

    def __repr__(self) -> str:
        return "EntryCodec(<secret>)"

    def _tag(self, ns: str, key: str, body: bytes) -> bytes:
        # One concatenated buffer and one hash call: on the read path the calls cost more than copying a
        # payload. The (ns, key) prefix is memoised: a read path asks for the same few hot keys again and again.
        return _blake2b(_digest_prefix(ns, key) + body, digest_size=DIGEST_SIZE, key=self._key).digest()

    def encode(self, ns: Namespace, key: CacheKey, entry: Entry) -> bytes:
        """The signed blob of ``entry`` as stored under ``(ns, key)``.

        Raises ``ValueError`` for a rule name over 65535 UTF-8 bytes or ``saved_tokens`` outside 0 to 2**64 - 1,
        ``TypeError`` for a value that is not bytes.
        """
        if not isinstance(entry.value, bytes | bytearray):
            raise TypeError(f"Entry.value must be bytes, not {type(entry.value).__name__}")
        rule = entry.rule.encode()
        if len(rule) > _MAX_RULE:
            raise ValueError(f"rule name is {len(rule)} bytes; at most {_MAX_RULE} fit the header")
        if not 0 <= entry.saved_tokens < 1 << 64:
            raise ValueError(f"saved_tokens {entry.saved_tokens} is outside 0 to 2**64 - 1")
        flags = (_HAS_EXPIRY if entry.expires_at is not None else 0) | (
            _HAS_SLIDING if entry.sliding_ttl is not None else 0
        )
        head = _HEAD.pack(
            MAGIC,
            FORMAT_VERSION,
            flags,
            0.0 if entry.expires_at is None else entry.expires_at,
            entry.created_at,
            entry.saved_ms,
            0.0 if entry.sliding_ttl is None else entry.sliding_ttl,
            entry.saved_tokens,
            entry.saved_cost,
            len(rule),
        )
        body = b"".join((head, rule, entry.value))
        return body + self._tag(ns, key, body)

    def decode(self, ns: Namespace, key: CacheKey, blob: bytes, *, tier: TierName) -> Entry:
        """The entry in ``blob``, which must have been encoded under exactly ``(ns, key)`` and this secret.

        Raises ``CorruptEntry(tier, ...)`` when the blob is too short, has another magic or format version,
        fails its tag (a flipped bit, a truncation, a blob written under another key, namespace or secret) or
        has an inconsistent header. The tag is checked before any field is decoded; never returns a partially
        checked entry.
        """
        # Plain bytes slicing throughout: on every L2/L3 read, and memoryview comparisons cost more than copies.
        blob = bytes(blob)
        if len(blob) < OVERHEAD:
            raise CorruptEntry(tier, f"entry {ns}/{key}: {len(blob)} bytes, shorter than any entry")
        if blob[:3] != MAGIC:
            raise CorruptEntry(tier, f"entry {ns}/{key}: bad magic {blob[:3]!r}")
        if blob[3] != FORMAT_VERSION:
            raise CorruptEntry(tier, f"entry {ns}/{key}: unsupported format version {blob[3]}")
        body = blob[:-DIGEST_SIZE]
        expected = _blake2b(_digest_prefix(ns, key) + body, digest_size=DIGEST_SIZE, key=self._key).digest()
        if not hmac.compare_digest(expected, blob[-DIGEST_SIZE:]):  # _tag, inlined (request path)
            raise CorruptEntry(tier, f"entry {ns}/{key}: checksum mismatch")
        _, _, flags, expires_at, created_at, saved_ms, sliding_ttl, saved_tokens, saved_cost, rule_len = (
            _HEAD.unpack_from(body))
        # The tag matched, so these can only fail for a blob made by a buggy writer holding the secret.
        if flags & ~_KNOWN_FLAGS or _HEAD.size + rule_len > len(body):
            raise CorruptEntry(tier, f"entry {ns}/{key}: inconsistent header")
        rule_end = _HEAD.size + rule_len
        try:
            rule = body[_HEAD.size : rule_end].decode()
        except UnicodeDecodeError as exc:
            raise CorruptEntry(tier, f"entry {ns}/{key}: rule name is not UTF-8") from exc
        # tuple.__new__ straight away: a NamedTuple's own __new__ is a Python-level call, and this is every read.
        return _new_tuple(Entry, (
            body[rule_end:],
            expires_at if flags & _HAS_EXPIRY else None,
            created_at,
            rule,
            saved_ms,
            sliding_ttl if flags & _HAS_SLIDING else None,
            saved_tokens,
            saved_cost,
        ))
