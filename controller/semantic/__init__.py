"""Semantic caching: serve a cached answer for a prompt that means the same, within a per-rule error bound.

    from evocache.controller.semantic import Scope, SemanticIndex, default_embedder

Embedders turn prompts into unit vectors; ``SemanticIndex`` keeps one faiss index per ``Scope`` (tenant
namespace and contract boundary), so no neighbour crosses tenants or models. Heavy libraries (torch,
sentence-transformers, faiss) load only when an embedder or index is built, never at import.
``SemanticCache`` decides each lookup within the rule's error bound (``SemanticDecision`` explains it);
``SharedIndex`` shares the index between replicas through Redis. The replay helpers behind
``evocache bench semantic`` stay in ``_bench`` (they import numpy, and this package must import light).
"""

from ..errors import EmbeddingError, SemanticError
from ._cache import Judge, SemanticCache, SemanticStats
from ._decide import (
    AnswerClusters,
    BoundedPolicy,
    Candidate,
    ErrorModel,
    Pacer,
    SemanticDecision,
    StaticPolicy,
    neighbourhood,
)
from ._config import EMBEDDERS, EmbedderConfig, SemanticConfig
from ._embed import BatchingEmbedder, Embedder, OpenAIEmbedder, SentenceTransformerEmbedder, default_embedder
from ._index import IndexOptions, Neighbour, Scope, SemanticIndex, VectorIndex
from ._shared import Change, SharedEntry, SharedIndex, SharedStats

__all__ = [
    "EMBEDDERS",
    "AnswerClusters",
    "BatchingEmbedder",
    "BoundedPolicy",
    "Candidate",
    "Change",
    "Embedder",
    "EmbedderConfig",
    "EmbeddingError",
    "ErrorModel",
    "IndexOptions",
    "Judge",
    "Neighbour",
    "OpenAIEmbedder",
    "Pacer",
    "Scope",
    "SemanticCache",
    "SemanticConfig",
    "SemanticDecision",
    "SemanticError",
    "SemanticIndex",
    "SemanticStats",
    "SentenceTransformerEmbedder",
    "SharedEntry",
    "SharedIndex",
    "SharedStats",
    "StaticPolicy",
    "VectorIndex",
    "default_embedder",
    "neighbourhood",
]
