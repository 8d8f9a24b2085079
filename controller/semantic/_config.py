"""The semantic part of the store configuration: which embedder, and whether entries are shared by replicas.

    SemanticConfig(shared=True, embedder=EmbedderConfig(kind="minilm", threads=1))

The embedder kind is a name in ``EMBEDDERS`` (a plain dict, name -> builder); an unknown name fails listing the
known ones. Validated once, when the configuration is built; nothing heavy (torch, sentence-transformers) loads
until ``EmbedderConfig.build`` is called, on the first semantic lookup.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    from ._embed import Embedder

__all__ = ["DEFAULT_JUDGE_BUDGET", "EMBEDDERS", "EmbedderConfig", "SemanticConfig"]

DEFAULT_JUDGE_BUDGET = 2.0
"""Judge calls per semantic lookup, on average, by default (``SemanticCache(judge_budget=)``, the decorator's
``SemanticOptions(judge_budget=)``)."""


def _minilm(config: EmbedderConfig) -> Embedder:
    from ._embed import default_embedder

    return default_embedder() if config.threads is None else _minilm_with_threads(config.threads)


@functools.cache
def _minilm_with_threads(threads: int) -> Embedder:
    from ._embed import BatchingEmbedder, SentenceTransformerEmbedder

    return BatchingEmbedder(SentenceTransformerEmbedder(threads=threads))


def _openai(config: EmbedderConfig) -> Embedder:
    from ._embed import BatchingEmbedder, OpenAIEmbedder

    assert config.url and config.model  # the validator's condition
    return BatchingEmbedder(
        OpenAIEmbedder(config.url, config.model, api_key=os.environ.get(config.api_key_env) or None)
    )


EMBEDDERS: dict[str, Callable[[EmbedderConfig], Embedder]] = {"minilm": _minilm, "openai": _openai}
"""Embedder kinds by name: each builds an ``Embedder`` from its ``EmbedderConfig``."""


class EmbedderConfig(BaseModel):
    """The embedder that turns prompts into vectors, built on the first semantic lookup.

    ``kind`` names a builder in ``EMBEDDERS``: ``minilm`` is the packaged all-MiniLM-L6-v2 (offline);
    ``openai`` is an OpenAI-compatible embeddings endpoint at ``url`` serving ``model``, with the API key read
    from the environment variable ``api_key_env``. ``threads`` sets torch's intra-op threads for the packaged
    embedder (process-wide, so unset by default: the application's own model may run in this process too); 1
    is the better choice on a CPU host busy with other work, where threads that wait on each other's core make
    one embedding many times slower (``bench/semantic_search.py --e2e --torch-threads 1``, against
    ``--torch-threads 2``, measures it on the host at hand).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: str = "minilm"
    url: str | None = None
    model: str | None = None
    api_key_env: str = "OPENAI_API_KEY"
    threads: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _known_and_complete(self) -> EmbedderConfig:
        if self.kind not in EMBEDDERS:
            raise ValueError(f"unknown embedder {self.kind!r}; known: {sorted(EMBEDDERS)}")
        if self.kind == "openai" and not (self.url and self.model):
            raise ValueError("embedder openai needs url and model")
        return self

    def build(self) -> Embedder:
        """The embedder this configuration names (the packaged one is shared by the process)."""
        return EMBEDDERS[self.kind](self)


class SemanticConfig(BaseModel):
    """Semantic matching (rules with ``semantic:``). With a Redis store and ``shared``, semantic entries and
    vectors live in Redis too, and every replica follows them; otherwise each process keeps its own."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    shared: bool = True
    embedder: EmbedderConfig = Field(default_factory=EmbedderConfig)
