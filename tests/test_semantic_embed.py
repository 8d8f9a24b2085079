"""Embedders: the real packaged model, the batching wrapper, and the OpenAI-compatible adapter over loopback."""

from __future__ import annotations

import json
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from _helpers import eventually
from evocache.controller.semantic import (
    BatchingEmbedder,
    EmbeddingError,
    OpenAIEmbedder,
    SentenceTransformerEmbedder,
    default_embedder,
)

PROMPTS = [
    "cancel my subscription",
    "don't cancel my subscription",
    "how do I reset my password?",
    "what is the exchange rate for euros",
    "cancel my subscription",
]


@pytest.fixture(scope="module")
def model() -> SentenceTransformerEmbedder:
    embedder = default_embedder()
    assert isinstance(embedder, BatchingEmbedder)
    assert isinstance(embedder.inner, SentenceTransformerEmbedder)
    return embedder.inner


# -- the real model --------------------------------------------------------------------------------------


def test_model_gives_normalised_float32_rows(model):
    vecs = model.embed(PROMPTS)
    assert model.name == "st:all-MiniLM-L6-v2"
    assert model.dim == 384
    assert vecs.shape == (5, 384)
    assert vecs.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)


def test_identical_texts_give_identical_vectors(model):
    vecs = model.embed(PROMPTS)
    assert np.array_equal(vecs[0], vecs[4])
    assert not np.array_equal(vecs[0], vecs[1])
    again = model.embed([PROMPTS[0]])
    np.testing.assert_allclose(again[0], vecs[0], atol=1e-5)  # alone or in a batch: the same vector


def test_paraphrase_is_closer_than_unrelated(model):
    a, b, c = model.embed(
        ["how do I reset my password?", "I forgot my password, how can I reset it", "euro rate"]
    )
    assert float(a @ b) > float(a @ c) + 0.3


def test_empty_and_bad_input(model):
    assert model.embed([]).shape == (0, 384)
    with pytest.raises(TypeError, match=r"texts\[1\] is int"):
        model.embed(["fine", 3])
    with pytest.raises(TypeError, match="not a single string"):
        model.embed("a bare string")


def test_default_embedder_is_cached_per_process():
    assert default_embedder() is default_embedder()
    assert default_embedder().name == "st:all-MiniLM-L6-v2"
    assert default_embedder().dim == 384


def test_bad_thread_count_is_refused():
    with pytest.raises(ValueError, match="threads must be >= 1"):
        SentenceTransformerEmbedder(threads=0)


def test_model_path_without_a_model_is_a_clear_error(tmp_path):
    with pytest.raises(EmbeddingError, match="no sentence-transformers model"):
        SentenceTransformerEmbedder(tmp_path)


# -- batching ----------------------------------------------------------------------------------------------


class Counting:
    """A real embedder that records the size of each inner call; ``gate`` (if set) holds the first call."""

    def __init__(self, inner, gate: threading.Event | None = None) -> None:
        self.inner = inner
        self.name = inner.name
        self.dim = inner.dim
        self.calls: list[int] = []
        self.gate = gate

    def fits(self, text: str) -> bool:
        return True

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        self.calls.append(len(texts))
        if self.gate is not None and len(self.calls) == 1:
            assert self.gate.wait(30), "the test never released the first inner call"
        return self.inner.embed(texts)


def run_threads(batcher: BatchingEmbedder, texts: list[str]) -> list[np.ndarray]:
    """Each text embedded by its own thread, all released together by a barrier."""
    barrier = threading.Barrier(len(texts))
    results: list[np.ndarray | BaseException | None] = [None] * len(texts)

    def call(i: int) -> None:
        barrier.wait()
        try:
            results[i] = batcher.embed([texts[i]])
        except Exception as exc:  # noqa: BLE001 - collected for the test thread to check
            results[i] = exc

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results  # type: ignore[return-value]


def texts_for(n: int) -> list[str]:
    return [f"question number {i} about my account" for i in range(n)]


def test_concurrent_calls_share_one_inner_call(model):
    counting = Counting(model)
    batcher = BatchingEmbedder(counting, max_batch=8, max_wait_ms=60_000)
    texts = texts_for(8)
    results = run_threads(batcher, texts)
    batcher.close()
    assert counting.calls == [8]
    direct = model.embed(texts)
    for i, got in enumerate(results):
        assert isinstance(got, np.ndarray) and got.shape == (1, 384)
        np.testing.assert_allclose(got[0], direct[i], atol=1e-5)  # each caller gets its own row back


def test_batches_are_capped_at_max_batch(model):
    counting = Counting(model)
    batcher = BatchingEmbedder(counting, max_batch=4, max_wait_ms=60_000)
    results = run_threads(batcher, texts_for(8))
    batcher.close()
    assert counting.calls == [4, 4]
    assert all(isinstance(r, np.ndarray) for r in results)


def test_without_waiting_calls_queued_during_an_inner_call_form_the_next_batch(model):
    gate = threading.Event()
    counting = Counting(model, gate=gate)
    batcher = BatchingEmbedder(counting, max_batch=64)  # max_wait_ms=0: a lone request never waits
    texts = texts_for(6)
    done: list[np.ndarray] = []
    first = threading.Thread(target=lambda: done.append(batcher.embed([texts[0]])))
    first.start()
    # The first request is being embedded alone, held at the gate.
    eventually(lambda: counting.calls, timeout=30, interval=0.001, message="the first request to be embedded")
    others = [threading.Thread(target=lambda t=t: done.append(batcher.embed([t]))) for t in texts[1:]]
    for t in others:
        t.start()
    eventually(lambda: batcher.pending() >= 5, timeout=30, interval=0.001, message="five requests to queue")
    gate.set()
    for t in [first, *others]:
        t.join(60)
    batcher.close()
    assert counting.calls == [1, 5]
    assert len(done) == 6


def test_a_request_larger_than_max_batch_goes_alone(model):
    counting = Counting(model)
    batcher = BatchingEmbedder(counting, max_batch=2)
    out = batcher.embed(texts_for(5))
    batcher.close()
    assert out.shape == (5, 384)
    assert counting.calls == [5]


def test_inner_failure_reaches_every_caller_of_the_batch(model):
    class Failing:
        name, dim = "failing", 384

        def fits(self, text):
            return True

        def embed(self, texts):
            raise EmbeddingError("endpoint down")

    batcher = BatchingEmbedder(Failing(), max_batch=3, max_wait_ms=60_000)
    results = run_threads(batcher, texts_for(3))
    batcher.close()
    assert all(isinstance(r, EmbeddingError) and "endpoint down" in str(r) for r in results)


def test_one_callers_bad_text_fails_only_that_caller(model):
    """An embedder that refuses a text (an endpoint rejecting an empty or overlong input) fails the whole inner
    call; the batcher then embeds each request alone, so the other callers of the batch still get vectors."""

    class Picky:
        name, dim = model.name, 384

        def __init__(self) -> None:
            self.calls: list[int] = []

        def fits(self, text):
            return True

        def embed(self, texts):
            self.calls.append(len(texts))
            if "BAD" in texts:
                raise EmbeddingError("HTTP 400: input rejected")
            return model.embed(texts)

    picky = Picky()
    batcher = BatchingEmbedder(picky, max_batch=3, max_wait_ms=60_000)
    results = run_threads(batcher, ["first question", "BAD", "third question"])
    batcher.close()
    assert picky.calls == [3, 1, 1, 1]  # the batch, then each request alone
    assert [type(r).__name__ for r in results] == ["ndarray", "EmbeddingError", "ndarray"]


def test_closed_batcher_refuses_calls(model):
    batcher = BatchingEmbedder(model)
    assert batcher.embed(["x"]).shape == (1, 384)
    batcher.close()
    with pytest.raises(RuntimeError, match="closed"):
        batcher.embed(["x"])


def test_batcher_rejects_bad_options(model):
    with pytest.raises(ValueError, match="max_batch"):
        BatchingEmbedder(model, max_batch=0)
    with pytest.raises(ValueError, match="max_wait_ms"):
        BatchingEmbedder(model, max_wait_ms=-1)


# -- the OpenAI-compatible adapter against a real HTTP server on loopback ----------------------------------


def fake_vector(text: str, dim: int) -> list[float]:
    """A deterministic, deliberately unnormalised vector for ``text``."""
    rng = np.random.default_rng(zlib.crc32(text.encode()))
    return (rng.standard_normal(dim) * 3.0).tolist()


class EmbeddingsServer:
    """A stdlib HTTP server speaking ``POST /v1/embeddings`` the way OpenAI does, recording each request."""

    dim = 16

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep the test output clean
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body)
                server.headers.append(dict(self.headers))
                if self.path != "/v1/embeddings":
                    return self.reply(404, {"error": {"message": f"no route {self.path}"}})
                if body["model"] == "missing-model":
                    return self.reply(400, {"error": {"message": "model 'missing-model' does not exist"}})
                if body["model"] == "garbled":
                    return self.reply(200, {"object": "list", "items": []})
                data = [
                    {"object": "embedding", "index": i, "embedding": fake_vector(t, server.dim)}
                    for i, t in enumerate(body["input"])
                ]
                data.reverse()  # index order, not list order, says which text a vector belongs to
                self.reply(200, {"object": "list", "data": data, "model": body["model"]})

            def reply(self, status, payload):
                raw = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server() -> Iterator[EmbeddingsServer]:
    srv = EmbeddingsServer()
    yield srv
    srv.close()


@pytest.mark.slow
def test_openai_adapter_embeds_over_http(server):
    emb = OpenAIEmbedder(server.base_url, "text-embedding-3-small", api_key="sk-test", dim=16)
    vecs = emb.embed(["alpha", "beta", "alpha"])
    assert vecs.shape == (3, 16) and vecs.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-6)
    expected = np.array(fake_vector("beta", 16), dtype=np.float32)
    np.testing.assert_allclose(vecs[1], expected / np.linalg.norm(expected), atol=1e-6)
    assert np.array_equal(vecs[0], vecs[2])
    assert server.requests == [
        {"model": "text-embedding-3-small", "input": ["alpha", "beta", "alpha"], "encoding_format": "float"}
    ]
    assert server.headers[0]["Authorization"] == "Bearer sk-test"
    assert emb.name == f"openai:text-embedding-3-small@{server.base_url}"


@pytest.mark.slow
def test_openai_adapter_splits_into_batch_size_requests(server):
    emb = OpenAIEmbedder(server.base_url, "m", batch_size=2)
    vecs = emb.embed(["a", "b", "c"])
    assert [r["input"] for r in server.requests] == [["a", "b"], ["c"]]
    assert vecs.shape == (3, 16)
    assert "Authorization" not in server.headers[0]


@pytest.mark.slow
def test_openai_adapter_learns_dim_from_a_probe(server):
    emb = OpenAIEmbedder(server.base_url, "m")
    assert emb.dim == 16
    assert len(server.requests) == 1


@pytest.mark.slow
def test_openai_error_response_is_a_clear_error(server):
    emb = OpenAIEmbedder(server.base_url, "missing-model")
    with pytest.raises(EmbeddingError) as info:
        emb.embed(["x"])
    assert str(info.value) == f"{server.base_url}/embeddings: HTTP 400: model 'missing-model' does not exist"


@pytest.mark.slow
def test_openai_malformed_reply_is_a_clear_error(server):
    with pytest.raises(EmbeddingError, match="reply is not an embeddings response"):
        OpenAIEmbedder(server.base_url, "garbled").embed(["x"])


@pytest.mark.slow
def test_openai_wrong_dimension_is_a_clear_error(server):
    with pytest.raises(EmbeddingError, match="expected dimension 384, got 16"):
        OpenAIEmbedder(server.base_url, "m", dim=384).embed(["x"])


@pytest.mark.slow
def test_openai_unreachable_endpoint_is_a_clear_error(server):
    url = server.base_url
    server.close()  # nothing listens on the port any more
    with pytest.raises(EmbeddingError, match="cannot reach the endpoint"):
        OpenAIEmbedder(url, "m", timeout=2).embed(["x"])


def test_openai_bad_options():
    with pytest.raises(ValueError, match="base_url"):
        OpenAIEmbedder("localhost:8000", "m")
    with pytest.raises(ValueError, match="model"):
        OpenAIEmbedder("http://127.0.0.1:1/v1", "")
