"""Prompts embedded once, up front: the table of vectors a replay of recorded prompts looks its texts up in.

``embed_cached`` embeds a set of texts in batches and keeps the vectors as ``.npy`` under a cache directory
(keyed by the sha256 of the embedder's name and the exact texts, so a changed text or model never reads a
stale file); ``VectorTable`` is an ``Embedder`` over such vectors; ``embedded_table`` makes one over several
text sets, each cached as a set of its own. The policy loop replays its windows' prompts through one
(``precomputed_embedder``), and ``evocache bench semantic`` its streams and pair sets.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ._embed import Embedder  # which builds its precomputed embedder from this module


def embed_cached(texts: Sequence[str], embedder: Embedder, cache_dir: str | Path | None) -> np.ndarray:
    """``embedder.embed(texts)``, read from / written to ``cache_dir`` when given (keyed by the embedder's
    name and the exact texts, so a changed text or model never reads a stale file)."""
    texts = list(texts)
    if cache_dir is None:
        return embedder.embed(texts)
    digest = hashlib.sha256("\x1e".join([embedder.name, *texts]).encode()).hexdigest()[:32]
    path = Path(cache_dir) / f"{digest}.npy"
    if path.is_file():
        vecs = np.load(path)
        if vecs.shape[0] == len(texts):
            return vecs
    vecs = embedder.embed(texts)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, vecs)
    tmp.replace(path)
    return vecs


class VectorTable:
    """An ``Embedder`` over precomputed vectors: the replay embeds every prompt once, up front, in batches."""

    def __init__(self, texts: Sequence[str], vecs: np.ndarray, name: str) -> None:
        self._row = {text: i for i, text in enumerate(texts)}
        self._vecs = np.ascontiguousarray(vecs, dtype=np.float32)
        self.name = name
        self.dim = int(vecs.shape[1])

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        return self._vecs[[self._row[t] for t in texts]]

    def fits(self, text: str) -> bool:
        return True  # the vectors were made from the whole texts


def embedded_table(
    text_sets: Sequence[Sequence[str]], embedder: Embedder, cache_dir: str | Path | None
) -> VectorTable:
    """One ``VectorTable`` over several text sets (a stream's prompts, the pairs' texts), each embedded by
    ``embed_cached`` as a set of its own, so every replay that embeds the same set reads the same cached
    file."""
    vecs = np.concatenate([embed_cached(texts, embedder, cache_dir) for texts in text_sets])
    return VectorTable([t for texts in text_sets for t in texts], vecs, embedder.name)
