"""Chunk reuse (``kv: {reuse: chunks}``): a cached chunk (a chat message, a document) reused at another position
by re-rotating its keys. Approximate: the reused tokens' keys and values never attended to what now precedes
them.

A prompt is a sequence of chunks: the ingress gives the token offsets where a chat's rendered messages start
(``GenerateRequest.chunks``); a plain prompt is one chunk. After the prompt's longest exact prefix, the chunks
are the spans between those offsets, the first cut where the prefix ends (``chunk_spans``).

A chunk's KV is kept as full blocks of ``block_size`` tokens under hashes that chain only within the chunk:
``controller.block_hashes`` over the chunk's own tokens, with the plan's salt behind a marker byte that no UTF-8
salt starts with (``_hashing.BlockHasher.chunk``), so a chunk hash never equals a prefix block's hash and no chunk crosses tenants. Blocks, not
whole chunks, so a chunk's KV lives in the same tiers, under the same byte bound and eviction, as prefix
blocks, and a chunk whose later blocks were evicted is still reused up to them. Each block records the
position of its first token when it was computed (``ChunkBlock.position``; in L2/L3 after a magic in front of
the block payload), so the shift is one move per block and keys are rotated once, never to position 0 and back.

Reusing a chunk found at ``a`` (its blocks covering ``a .. a + m·block_size``): the model first computes the
chunk's first ``recompute_tokens`` tokens over the real context (EPIC's LegoLink: the first tokens of a chunk
carry the attention sink of a chunk computed alone); the rest of the found blocks are appended with keys shifted
by Δ = new position − stored position (``RopeShift``; values are not rotated); then a share
``recompute_fraction`` of those appended tokens is recomputed in one forward (CacheBlend's idea), evenly spaced
(``refresh_positions``): picking by KV deviation, as CacheBlend does, needs a partial forward of every layer
over the whole chunk that a transformers forward does not expose, and even spacing leaves no long run of
stale tokens. The refreshed tokens attend to the cache before them with their own fresh keys in place of the
stale ones, and overwrite their entries. Uncached chunks and the suffix then run normally.

What is kept: prefix blocks only up to the first reused chunk (everything after it attended to approximate
keys, and prefix reuse is exact), and the blocks of every chunk the model computed whole (a chunk's KV is reused
after other context anyway). A model whose RoPE does not shift exactly (``RopeShiftUnsupported``) gets
prefix-only reuse, logged and counted (``KvPrefixCache.chunk_fallbacks``).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ._store import BlockGeometry, CorruptBlock, decode_group, encode_group

_MAGIC = b"EVKC1"
_POSITION = struct.Struct("<Q")
MAX_CHUNKS = 256  # chunk offsets beyond this many are ignored: the prompt's tail is one chunk


@dataclass(frozen=True, slots=True)
class ChunkBlock:
    """One block of a chunk: a (keys, values) pair per layer, ``[kv_heads, block_size, head_dim]`` each, whose
    first token sat at ``position`` when the model computed it."""

    layers: tuple[Any, ...]
    position: int


def chunk_spans(n_tokens: int, starts: Sequence[int], prefix: int) -> list[tuple[int, int]]:
    """The ``[start, stop)`` chunks of a prompt of ``n_tokens`` after its exact ``prefix``: cut at ``starts``
    (offsets where chunks start; those out of order or out of range are ignored) and where the prefix ends."""
    cuts = sorted({s for s in list(starts)[:MAX_CHUNKS] if prefix < s < n_tokens})
    edges = [prefix, *cuts, n_tokens]
    return [(a, b) for a, b in zip(edges, edges[1:], strict=False) if a < b]


def refresh_positions(start: int, stop: int, fraction: float) -> list[int]:
    """``round(fraction · (stop − start))`` positions of ``[start, stop)``, evenly spaced (each in the middle of
    its share of the span)."""
    span = stop - start
    count = min(span, round(fraction * span))
    if count <= 0:
        return []
    return sorted({start + int((i + 0.5) * span / count) for i in range(count)})


def encode_chunk_group(block: ChunkBlock, geometry: BlockGeometry, a: int, b: int) -> bytes:
    """The L2/L3 payload of layers ``a .. b`` of a chunk block: magic, its position, the block payload."""
    return _MAGIC + _POSITION.pack(block.position) + encode_group(block.layers[a:b], geometry, a)


def decode_chunk_group(data: bytes, geometry: BlockGeometry, a: int, b: int,
                       device: Any) -> tuple[int, list[Any]]:
    """(position, layers) of a payload written by ``encode_chunk_group``; ``CorruptBlock`` otherwise."""
    head = len(_MAGIC) + _POSITION.size
    if data[: len(_MAGIC)] != _MAGIC or len(data) < head:
        raise CorruptBlock("not a KV chunk block payload")
    (position,) = _POSITION.unpack_from(data, len(_MAGIC))
    return position, decode_group(data[head:], geometry, a, b, device)


@dataclass(slots=True)
class ChunkPrefill:
    """The prefill of one prompt with chunk reuse, on a cache that holds its exact prefix. ``forward(ids,
    cache, positions=None, mask=None)`` runs the model (its logits are what the last call returns);
    ``lookup(tokens, usable_blocks)`` finds a chunk's leading cached blocks (``ChunkBlock``s)."""

    forward: Callable[..., Any]
    lookup: Callable[[Sequence[int], int], list[ChunkBlock]]
    shift: Any  # RopeShift
    block_size: int
    recompute_tokens: int
    recompute_fraction: float
    reused_tokens: int = 0  # appended from chunks and not recomputed
    first_reused: int = -1  # where the first reused chunk starts (-1: none)
    computed: list[tuple[int, int]] | None = None  # the chunks the model computed whole

    def run(self, ids: Sequence[int], cache: Any, starts: Sequence[int]) -> Any:
        """Fill ``cache`` (holding ``ids[:cache length]``) with the rest of ``ids``; returns the last forward's
        output."""
        import torch  # noqa: PLC0415

        n, bs = len(ids), self.block_size
        pos = cache.get_seq_length()
        self.computed = []
        out = None
        for a, b in chunk_spans(n, starts, pos):
            found = self.lookup(ids[a:b], (min(b, n - 1) - a) // bs)  # the last prompt token is computed
            if not found:
                self.computed.append((a, b))
                continue
            if pos < a:
                out = self.forward(ids[pos:a], cache)
            stop = a + len(found) * bs
            head = min(self.recompute_tokens, stop - a)
            if head:
                out = self.forward(ids[a : a + head], cache)
            pos = stop
            if a + head == stop:  # all of it recomputed over the real context: exact
                self.computed.append((a, b))
                continue
            self._append(cache, found, a, a + head)
            picked = refresh_positions(a + head, stop, self.recompute_fraction)
            if picked:
                self._refresh(ids, cache, picked, torch)
            self.reused_tokens += stop - a - head - len(picked)
            if self.first_reused < 0:
                self.first_reused = a
        return self.forward(ids[pos:], cache) if pos < n else out

    def _append(self, cache: Any, found: list[ChunkBlock], a: int, start: int) -> None:
        """Append tokens ``start ..`` of the found blocks (the chunk begins at ``a``), keys moved to here."""
        import torch  # noqa: PLC0415

        bs = self.block_size
        for layer in range(len(found[0].layers)):
            keys, values = [], []
            for j, block in enumerate(found):
                skip = max(start - (a + j * bs), 0)
                if skip >= bs:
                    continue
                k, v = block.layers[layer]
                keys.append(self.shift.shift(k[:, skip:], a + j * bs - block.position))
                values.append(v[:, skip:])
            cache.update(torch.cat(keys, dim=1).unsqueeze(0), torch.cat(values, dim=1).unsqueeze(0), layer)

    def _refresh(self, ids: Sequence[int], cache: Any, picked: list[int], torch: Any) -> None:
        """Recompute the tokens at ``picked`` (all below the cache length) in one forward and overwrite their
        entries: each attends to the cache before it, the refreshed tokens' fresh entries in place of their
        stale ones."""
        length = cache.get_seq_length()
        device = cache.layers[0].keys.device
        dtype = cache.layers[0].keys.dtype
        where = torch.tensor(picked, device=device)
        cols = torch.arange(length, device=device)
        old = (cols[None, :] < where[:, None]) & ~torch.isin(cols, where)[None, :]
        new = torch.ones(len(picked), len(picked), dtype=torch.bool, device=device).tril()
        allowed = torch.cat((old, new), dim=1)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        self.forward([ids[p] for p in picked], cache, positions=where, mask=mask[None, None])
        for layer in cache.layers:
            layer.keys[:, :, where] = layer.keys[:, :, length:]
            layer.values[:, :, where] = layer.values[:, :, length:]
            layer.keys = layer.keys[:, :, :length]
            layer.values = layer.values[:, :, :length]
