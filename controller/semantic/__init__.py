"""Semantic caching: serve a cached answer for a prompt that means the same, within a per-rule error bound.

    from evocache.controller.semantic import Scope, SemanticIndex, default_embedder

Embedders turn prompts into unit vectors; ``SemanticIndex`` keeps one faiss index per ``Scope`` (tenant
namespace and contract boundary), so no neighbour crosses tenants or models. Heavy libraries (torch,
sentence-transformers, faiss) load only when an embedder or index is built, never at import.
``SemanticCache`` decides each lookup within the rule's error bound (``SemanticDecision`` explains it);
``SharedIndex`` shares the index between replicas through Redis. The replay helpers behind
``evocache bench semantic`` stay in ``_bench`` (they import numpy, and this package must import light).

The seams, each a Protocol: ``Embedder`` (texts to vectors), ``ScopedIndex`` (what ``SemanticCache`` reads
and writes; ``SemanticIndex`` and ``SharedIndex`` implement it), ``DecisionPolicy`` (decides and learns;
``BoundedPolicy``, ``StaticPolicy``, built by mode name from ``POLICIES``) and ``AnswerClusters`` (what a
policy reads of the cache). Their options are frozen: ``IndexOptions``, ``PolicyOptions``, ``PacerOptions``,
``SemanticConfig`` with its ``EmbedderConfig``.
"""

from ..errors import EmbeddingError, SemanticError
from ._cache import Judge, SemanticCache, SemanticStats
from ._decide import (
    POLICIES,
    AnswerClusters,
    BoundedPolicy,
    Candidate,
    DecisionPolicy,
    ErrorModel,
    Pacer,
    PacerOptions,
    PolicyOptions,
    Readings,
    SemanticDecision,
    StaticPolicy,
    neighbourhood,
)
from ._config import EMBEDDERS, EmbedderConfig, SemanticConfig
from ._embed import (
    BatchingEmbedder,
    Embedder,
    OpenAIEmbedder,
    SentenceTransformerEmbedder,
    default_embedder,
    precomputed_embedder,
)
from ._index import IndexOptions, Neighbour, Scope, ScopedIndex, SemanticIndex, VectorIndex
from ._shared import Change, SharedEntry, SharedIndex, SharedStats

__all__ = [
    "EMBEDDERS",
    "POLICIES",
    "AnswerClusters",
    "BatchingEmbedder",
    "BoundedPolicy",
    "Candidate",
    "Change",
    "DecisionPolicy",
    "Embedder",
    "EmbedderConfig",
    "EmbeddingError",
    "ErrorModel",
    "IndexOptions",
    "Judge",
    "Neighbour",
    "OpenAIEmbedder",
    "Pacer",
    "PacerOptions",
    "PolicyOptions",
    "Readings",
    "Scope",
    "ScopedIndex",
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
    "precomputed_embedder",
]
