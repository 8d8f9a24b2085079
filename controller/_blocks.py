"""Chained hashes of a tokenised prompt's full blocks: the key the prefix router and the KV cache share.

Block ``i`` covers tokens ``[i * block_size, (i + 1) * block_size)``; a trailing partial block has no hash.
Each hash is BLAKE2b-256 over a canonical byte encoding of

* its parent: the previous block's hash, or for block 0 the salt (the tenant namespace), so no two tenants
  ever share a block hash;
* the extra keys (model id and revision, dtype, adapter id: whatever changes what a block's KV holds);
* the block's token ids.

so a hash names the whole prefix up to and including its block: changing block ``i`` changes the hashes of
blocks ``i`` onward and leaves those before it alone. The encoding is fixed (little-endian, length-prefixed
fields), so the same prompt gives the same hashes in every process; Python's ``hash()`` is never used.

Encoding of one block (``u32``/``u64``: unsigned little-endian)::

    parent  = b"\\x00" u32(len(salt)) salt          (block 0)
            | b"\\x01" previous hash (32 bytes)     (block i > 0)
    extras  = u32(count) { u32(len(utf8)) utf8 }...
    tokens  = u32(block_size) { u64(token) }...
    hash    = blake2b(parent extras tokens, digest_size=32, person=b"evocache.block1")
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NewType

BlockHash = NewType("BlockHash", bytes)

BLOCK_HASH_BYTES = 32
MAX_BLOCK_TOKENS = 1 << 20  # the most tokens hashed per call: work stays bounded whatever the caller sends
_PERSON = b"evocache.block1"
_MAX_TOKEN_ID = (1 << 64) - 1


def _u32(n: int) -> bytes:
    return struct.pack("<I", n)


def _encode_extras(extra_keys: Sequence[str]) -> bytes:
    if isinstance(extra_keys, str | bytes):
        raise TypeError("extra_keys must be a sequence of strings, not a single string")
    parts = [_u32(len(extra_keys))]
    for i, key in enumerate(extra_keys):
        if not isinstance(key, str):
            raise TypeError(f"extra_keys[{i}] must be a string, got {type(key).__qualname__}")
        data = key.encode("utf-8")
        parts += (_u32(len(data)), data)
    return b"".join(parts)


def _encode_tokens(tokens: Sequence[int], start: int) -> bytes:
    for offset, token in enumerate(tokens):
        if type(token) is not int or not 0 <= token <= _MAX_TOKEN_ID:
            raise ValueError(f"token_ids[{start + offset}] must be an int in [0, 2**64), got {token!r}")
    return _u32(len(tokens)) + struct.pack(f"<{len(tokens)}Q", *tokens)


def block_hashes(
    token_ids: Sequence[int], block_size: int, extra_keys: Sequence[str], first_salt: str | bytes
) -> tuple[BlockHash, ...]:
    """The chained hash of each full block of ``token_ids`` (a partial final block is left out).

    ``first_salt`` is the tenant namespace (a str is hashed as its UTF-8 bytes). Raises ``ValueError`` for a
    block size below 1, more than ``MAX_BLOCK_TOKENS`` tokens, or a token that is not a non-negative int.
    """
    if type(block_size) is not int or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    if len(token_ids) > MAX_BLOCK_TOKENS:
        raise ValueError(
            f"token_ids has {len(token_ids)} tokens, more than the {MAX_BLOCK_TOKENS} hashed per call"
        )
    salt = first_salt.encode("utf-8") if isinstance(first_salt, str) else bytes(first_salt)
    extras = _encode_extras(extra_keys)
    parent = b"\x00" + _u32(len(salt)) + salt
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        tokens = _encode_tokens(token_ids[start : start + block_size], start)
        data = parent + extras + tokens
        digest = hashlib.blake2b(data, digest_size=BLOCK_HASH_BYTES, person=_PERSON).digest()
        hashes.append(BlockHash(digest))
        parent = b"\x01" + digest
    return tuple(hashes)
