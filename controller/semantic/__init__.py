"""Semantic caching: serve a cached answer for a prompt that means the same, within a per-rule error bound.

    from evocache.controller.semantic import Scope, SemanticIndex, default_embedder

Embedders turn prompts into unit vectors; ``SemanticIndex`` keeps one faiss index per ``Scope`` (tenant
namespace and contract boundary), so no neighbour crosses tenants or models. Heavy libraries (torch,
sentence-transformers, faiss) load only when an embedder or index is built, never at import.
"""

from ..errors import EmbeddingError, SemanticError
from ._embed import BatchingEmbedder, Embedder, OpenAIEmbedder, SentenceTransformerEmbedder, default_embedder
from ._index import Neighbour, Scope, SemanticIndex, VectorIndex
from ._shared import Change, SharedEntry, SharedIndex, SharedStats

__all__ = [
    "BatchingEmbedder",
    "Change",
    "Embedder",
    "EmbeddingError",
    "Neighbour",
    "OpenAIEmbedder",
    "Scope",
    "SemanticError",
    "SemanticIndex",
    "SentenceTransformerEmbedder",
    "SharedEntry",
    "SharedIndex",
    "SharedStats",
    "VectorIndex",
    "default_embedder",
]
