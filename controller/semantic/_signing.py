"""The tags that sign the shared semantic index in Redis (``SharedIndex``): keyed BLAKE2b under the
deployment secret, the one that signs the L2 and L3 entries (``controller._secret``), with a key of its own
derived from it.

A record (``encode_record``: expiry, metadata, vector) is stored and streamed sealed: the record, then a
16-byte tag over its scope (namespace and boundary), its entry id and the record itself. A removal message
carries a tag over its scope and its JSON list of ids. A record copied to another scope or id, a changed bit
of its vector, metadata or expiry, a planted record or message: each fails its tag, and without the secret
nobody who can write to Redis can make one that passes. So a lookup only ever finds neighbours that a replica
holding the secret wrote, in the scope they were written for.

What a tag does not bind is when it was made: a sealed record or message copied back into the same scope
replays what a replica once wrote there (the entry's answer is still read through the signed tiers, under
the scope's namespace, and an entry past its signed expiry is never returned).
"""

from __future__ import annotations

import hashlib
import hmac

from .._codec import MIN_SECRET_BYTES
from ._index import Scope

__all__ = ["TAG_SIZE", "IndexSigner", "check_secret"]

TAG_SIZE = 16
_RECORD = b"rec"
_REMOVAL = b"del"


def check_secret(secret: object, where: str) -> bytes:
    """``secret`` if it is bytes of at least ``MIN_SECRET_BYTES``; else a ``TypeError`` or ``ValueError``
    naming ``where``."""
    if not isinstance(secret, bytes):
        raise TypeError(f"{where} must be bytes, not {type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{where} is {len(secret)} bytes; at least {MIN_SECRET_BYTES} are needed")
    return secret


def _framed(*parts: bytes) -> bytes:
    # Length prefixes keep the fields apart: ("ab", "c") and ("a", "bc") sign differently.
    return b"".join(len(part).to_bytes(4, "little") + part for part in parts)


class IndexSigner:
    """Seals and opens the shared index's records, signs and checks its removal messages, under one secret."""

    __slots__ = ("_key",)

    def __init__(self, secret: bytes) -> None:
        check_secret(secret, "secret")
        # A fixed-size key of its own: a tag made for the index can never pass as an entry's, nor the reverse.
        self._key = hashlib.blake2b(secret, digest_size=32, person=b"evocache-semidx").digest()

    def __repr__(self) -> str:
        return "IndexSigner(<secret>)"

    def _tag(self, kind: bytes, scope: Scope, name: bytes, body: bytes) -> bytes:
        head = _framed(kind, scope.namespace.encode(), scope.boundary.encode(), name)
        return hashlib.blake2b(head + body, digest_size=TAG_SIZE, key=self._key).digest()

    def seal(self, scope: Scope, entry_id: str, record: bytes) -> bytes:
        """``record`` followed by its tag, as stored under ``entry_id`` in ``scope``."""
        return record + self._tag(_RECORD, scope, entry_id.encode(), record)

    def open(self, scope: Scope, entry_id: bytes, sealed: bytes) -> bytes | None:
        """The record in ``sealed`` if its tag is the one ``seal(scope, entry_id, record)`` made (``entry_id``
        as stored: UTF-8 bytes); ``None`` otherwise. Nothing of the record is read before the tag is
        checked."""
        if len(sealed) <= TAG_SIZE:
            return None
        record = sealed[:-TAG_SIZE]
        expected = self._tag(_RECORD, scope, entry_id, record)
        return record if hmac.compare_digest(expected, sealed[-TAG_SIZE:]) else None

    def removal(self, scope: Scope, ids_json: bytes) -> bytes:
        """The tag of a removal message that takes the ids in ``ids_json`` (a JSON list) out of ``scope``."""
        return self._tag(_REMOVAL, scope, b"", ids_json)

    def removal_ok(self, scope: Scope, ids_json: bytes, tag: bytes) -> bool:
        return hmac.compare_digest(self.removal(scope, ids_json), tag)
