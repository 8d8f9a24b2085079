"""What the KV cache calls its blocks: prefix hashes, chunk hashes, and the keys of their L2/L3 entries.

A prefix block's hash chains its parent's, its tokens and the extra keys that change what its keys and values
are (model id and revision, dtype, adapter: ``controller.block_hashes``); block 0's parent is the plan's salt
(the tenant's namespace, or the shared one). A chunk's blocks chain over the chunk's own tokens only, salted
with the same salt behind ``CHUNK_MARK``: no UTF-8 salt starts with it, so a chunk hash never equals a prefix
block's hash, and no chunk crosses tenants unless the rule shares prefixes.

An L2/L3 entry holds one layer group of one block; its key is a digest of the block hash and the group's layer
range under a personalisation of its own, so it never equals a response entry's key in the same tier.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from evocache.controller import BlockHash, block_hashes

CHUNK_MARK = b"\xffkv-chunk\x00"  # 0xFF never occurs in UTF-8: no str salt's bytes start with it


def chunk_salt(salt: str) -> bytes:
    """The first salt of a chunk's hash chain: the plan's salt behind ``CHUNK_MARK``."""
    return CHUNK_MARK + salt.encode("utf-8")


class BlockHasher:
    """The hashes of one model's blocks: ``block_size`` tokens each, bound to ``extras``."""

    def __init__(self, block_size: int, extras: Sequence[str]) -> None:
        self.block_size = block_size
        self.extras = tuple(extras)

    def prefix(self, ids: Sequence[int], salt: str) -> tuple[BlockHash, ...]:
        """The hashes of the prompt ``ids``' full blocks, chained from ``salt``."""
        return block_hashes(ids, self.block_size, self.extras, salt)

    def chunk(self, tokens: Sequence[int], salt: str) -> tuple[BlockHash, ...]:
        """The hashes of a chunk's full blocks: chained over the chunk's own tokens only, salted apart from
        prefix blocks (``chunk_salt``)."""
        return block_hashes(tokens, self.block_size, self.extras, chunk_salt(salt))

    @staticmethod
    def tier_key(block: BlockHash, group: tuple[int, int]) -> str:
        """The L2/L3 key of the layers ``group`` (``[start, stop)``) of ``block``: hex, as the tiers take."""
        data = bytes(block) + group[0].to_bytes(4, "little") + group[1].to_bytes(4, "little")
        return hashlib.blake2b(data, digest_size=32, person=b"evocache.kv1").hexdigest()
