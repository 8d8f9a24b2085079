"""A request's lifetime at the ingress, over in-process replicas (``LocalBackend``) and a real uvicorn server:
its deadline (``Limits.request_timeout_s``, apart from the wait for a replica), the 504 past it, and the
cancellation of the generation on the replica when the deadline passes or the client goes away.

The model is gated: it produces a piece only for a permit the test gives, so every test orders the model
against the client with events, and checks how many pieces the model produced (bounded after a cancellation)
rather than how long anything took.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from _helpers import eventually
from _serving_fixtures import KEYS, UvicornThread, serve, write_keys

from evocache.serving import Api, FileKeyStore, Limits, build_fastapi
from evocache.serving._ingress import request_timeout
from evocache.serving._model import ByteTokenizer

ACME = next(iter(KEYS))
LONG = 1000  # max_tokens of a generation the tests never let finish


class Gated:
    """A model whose pieces ("x", one token each) come one per permit; ``open()`` lets it run freely. It counts
    its calls and the pieces it produced, and says when it started and when it ended (closed or not)."""

    def __init__(self) -> None:
        self.permits = threading.Semaphore(0)
        self.calls = 0
        self.produced = 0
        self.ends = 0
        self.started = threading.Event()
        self.ended = threading.Event()

    def __call__(self, prompt: str, max_tokens: int) -> Iterator[str]:
        self.calls += 1
        self.started.set()
        try:
            for _ in range(max_tokens):
                self.permits.acquire()
                self.produced += 1
                yield "x"
        finally:
            self.ends += 1
            self.ended.set()

    def give(self, n: int) -> None:
        self.permits.release(n)

    def open(self) -> None:
        self.permits.release(10 * LONG)


def slow_model(prompt: str, max_tokens: int) -> Iterator[str]:
    """A generation longer than the tests' ready timeout: a model that takes its time per token."""
    for _ in range(max_tokens):
        time.sleep(0.02)
        yield "y"


def cancelled(api: Api, why: str) -> float:
    return api.registry.get_sample_value("evocache_http_cancelled_total",
                                         {"endpoint": "completions", "why": why}) or 0.0


async def _never() -> None:
    await asyncio.Event().wait()  # never set: no replica ever takes the request


def post_and_leave(http: UvicornThread, body: dict) -> socket.socket:
    """A completion request sent on a raw connection, which the caller closes to go away."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", http.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + ACME.encode()
                 + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(payload)).encode()
                 + b"\r\n\r\n" + payload)
    return sock


def test_a_generation_longer_than_the_ready_timeout_is_answered_within_the_request_deadline(tmp_path):
    # The ready timeout bounds only the wait for a replica to take the request; the answer has until the
    # deadline the configuration gives.
    api, server = serve(tmp_path, slow_model, ready_timeout_s=0.05, limits=Limits(request_timeout_s=120))
    with UvicornThread(build_fastapi(api)) as http:
        client = openai.OpenAI(base_url=f"{http.url}/v1", api_key=ACME, max_retries=0)
        answer = client.completions.create(model="echo", prompt="long answer", temperature=0, max_tokens=10)
        streamed = client.completions.create(model="echo", prompt="long stream", temperature=0, max_tokens=10,
                                             stream=True)
        assert answer.choices[0].text == "y" * 10
        assert "".join(c.choices[0].text for c in streamed) == "y" * 10
    server.close()


def test_past_the_deadline_the_answer_is_a_504_not_retried_and_the_generation_stops(tmp_path):
    gated = Gated()
    api, server = serve(tmp_path, gated, limits=Limits(request_timeout_s=0.2))
    with UvicornThread(build_fastapi(api)) as http:
        client = openai.OpenAI(base_url=f"{http.url}/v1", api_key=ACME)  # the client's own retries on
        with pytest.raises(openai.APIStatusError) as err:
            client.completions.create(model="echo", prompt="never ends", temperature=0, max_tokens=LONG)
        assert err.value.status_code == 504 and err.value.body["code"] == "timeout"
        assert err.value.response.headers["x-should-retry"] == "false"
        assert gated.calls == 1  # the client did not start the same generation again
        r = httpx.post(f"{http.url}/v1/completions", headers={"Authorization": f"Bearer {ACME}"},
                       json={"model": "echo", "prompt": "stream never ends", "temperature": 0,
                             "max_tokens": LONG, "stream": True})
        assert r.status_code == 504  # a stream's deadline is for its first piece
        assert cancelled(api, "deadline") == 2
        gated.open()
        eventually(lambda: gated.ends == 2, message="both generations to end")
        # The piece under way when the deadline passed is each generation's last one.
        assert gated.produced <= 2
    server.close()


def test_a_client_shortens_its_deadline_with_a_header_and_never_lengthens_it(tmp_path):
    gated = Gated()
    api, server = serve(tmp_path, gated, limits=Limits(request_timeout_s=120))
    with UvicornThread(build_fastapi(api)) as http:
        headers = {"Authorization": f"Bearer {ACME}"}
        body = {"model": "echo", "prompt": "never ends", "temperature": 0, "max_tokens": LONG}
        r = httpx.post(f"{http.url}/v1/completions", headers={**headers, "x-evocache-timeout": "0.2"}, json=body,
                       timeout=30)
        assert r.status_code == 504 and r.headers["x-should-retry"] == "false"
        assert "x-evocache-timeout" in r.json()["error"]["message"]
        assert cancelled(api, "deadline") == 1
        for value in ("soon", "0", "-1", "nan", "inf"):
            r = httpx.post(f"{http.url}/v1/completions", headers={**headers, "x-evocache-timeout": value},
                           json=body, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == "x-evocache-timeout", value
        r = httpx.post(f"{http.url}/v1/completions",
                       headers=[*headers.items(), ("x-evocache-timeout", "1"), ("x-evocache-timeout", "2")],
                       json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "x-evocache-timeout"
        assert gated.calls == 1  # refused headers start no generation
        gated.open()
    server.close()
    # More than the limit is the limit: a header cannot buy a longer generation than the operator allows.
    assert request_timeout(["99999"], Limits(request_timeout_s=5)) == 5
    assert request_timeout([], Limits(request_timeout_s=5)) == 5
    assert request_timeout(["1.5"], Limits(request_timeout_s=5)) == 1.5


def test_no_replica_taking_the_request_is_a_503_with_retry_after(tmp_path):
    class NoReplica:
        async def complete(self, request, placed=None):
            await _never()

        async def stream(self, request, placed=None):
            await _never()
            yield None

        async def ready(self):
            return False

        async def metrics(self):
            return b""

    api = Api(model_id="echo", model_revision="", tokenizer=ByteTokenizer(), backend=NoReplica(),
              keys=FileKeyStore.load(write_keys(tmp_path / "keys.yaml")), ready_timeout_s=0.1)
    with UvicornThread(build_fastapi(api)) as http:
        for stream in (False, True):
            r = httpx.post(f"{http.url}/v1/completions", headers={"Authorization": f"Bearer {ACME}"},
                           json={"model": "echo", "prompt": "x", "temperature": 0, "stream": stream})
            assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
            assert r.headers["retry-after"] == "1" and "x-should-retry" not in r.headers
    # A deadline shorter than the wait for a replica is the request's own: a 504 the client does not retry.
    api.ready_timeout_s = 30.0
    with UvicornThread(build_fastapi(api)) as http:
        r = httpx.post(f"{http.url}/v1/completions", headers={"Authorization": f"Bearer {ACME}",
                                                              "x-evocache-timeout": "0.1"},
                       json={"model": "echo", "prompt": "x", "temperature": 0}, timeout=30)
        assert r.status_code == 504 and r.headers["x-should-retry"] == "false", r.text


def test_a_client_gone_before_its_answer_stops_the_generation(tmp_path):
    gated = Gated()
    api, server = serve(tmp_path, gated)
    with UvicornThread(build_fastapi(api)) as http:
        sock = post_and_leave(http, {"model": "echo", "prompt": "left", "temperature": 0, "max_tokens": LONG})
        assert gated.started.wait(30)
        sock.close()
        eventually(lambda: cancelled(api, "client-gone") == 1, message="the ingress to see the client gone")
        gated.open()
        assert gated.ended.wait(30)
        assert gated.produced <= 1
    server.close()


def test_a_client_gone_mid_stream_stops_the_generation(tmp_path):
    gated = Gated()
    api, server = serve(tmp_path, gated)
    with UvicornThread(build_fastapi(api)) as http:
        sock = post_and_leave(http, {"model": "echo", "prompt": "left mid-stream", "temperature": 0,
                                     "max_tokens": LONG, "stream": True})
        gated.give(2)
        seen = b""
        while seen.count(b"data: ") < 2:  # the headers, then the first two pieces
            seen += sock.recv(4096)
        sock.close()
        eventually(lambda: cancelled(api, "client-gone") == 1, message="the ingress to see the client gone")
        gated.open()
        assert gated.ended.wait(30)
        assert gated.produced <= 3  # the two read, and the one under way when the client went
    server.close()


def test_the_model_stops_when_its_answer_is_closed_in_process(tmp_path):
    """ModelServer.stream is lazy: closing it closes the model's generator, whatever ran the pieces."""
    gated = Gated()
    _, server = serve(tmp_path, gated)
    from _backend_contract import request

    items = server.stream(request("closed here", max_tokens=LONG))
    gated.give(2)  # the decision comes with the first piece
    assert [type(next(items)).__name__ for _ in range(3)] == ["Decision", "str", "str"]
    items.close()
    assert gated.ended.is_set() and gated.produced == 2
    server.close()


def test_identical_concurrent_streams_on_a_replica_run_the_model_once(tmp_path):
    gated = Gated()
    api, server = serve(tmp_path, gated)
    body = {"model": "echo", "prompt": "eight at once", "temperature": 0, "max_tokens": 3, "stream": True}

    def ask():
        with httpx.stream("POST", f"{http.url}/v1/completions", headers={"Authorization": f"Bearer {ACME}"},
                          json=body, timeout=30) as r:
            lines = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
            text = "".join(c["text"] for line in lines for c in json.loads(line)["choices"])
            return r.headers["x-evocache-outcome"], r.headers.get("x-evocache-reason", ""), text

    with UvicornThread(build_fastapi(api)) as http:
        results: list = []
        threads = [threading.Thread(target=lambda: results.append(ask())) for _ in range(8)]
        for t in threads:
            t.start()
        eventually(lambda: server.answer.cache_info().waiting == 7, message="seven streams to wait for the first")
        gated.open()
        for t in threads:
            t.join(30)
    assert gated.calls == 1
    assert sorted((outcome, reason) for outcome, reason, _ in results) == [("hit", "coalesced")] * 7 + [("miss", "")]
    assert [text for _, _, text in results] == ["xxx"] * 8
    server.close()
