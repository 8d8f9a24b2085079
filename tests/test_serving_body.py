"""The request body over a real socket (uvicorn in front of an in-process replica): a body larger than the
server reads is refused without reading the rest, the connection closed; a body that trickles in slower than
``Limits.body_timeout_s`` is a 408, the connection closed too. Sent as raw HTTP, as a hostile client would."""

from __future__ import annotations

import json
import socket

import pytest
from _serving_fixtures import KEYS, UvicornThread, echo_model, write_keys

from evocache.controller import EventsConfig, StoreConfig
from evocache.serving import (
    Api,
    ByteTokenizer,
    CallableGenerator,
    FileKeyStore,
    Limits,
    LocalBackend,
    ModelConfig,
    ModelServer,
    ServerSpec,
    build_fastapi,
)

pytestmark = pytest.mark.slow  # a uvicorn server

ACME = next(iter(KEYS))
LIMITS = Limits(max_body_bytes=4096, body_timeout_s=0.5)


@pytest.fixture
def http(tmp_path):
    spec = ServerSpec(model=ModelConfig(kind="callable", id="echo", callable="_serving_fixtures:echo_model"),
                      store=StoreConfig(events=EventsConfig(sink="ring")), block_size=4)
    server = ModelServer(spec, "replica-a", generator=CallableGenerator(echo_model, "echo_model"),
                         tokenizer=ByteTokenizer())
    api = Api(model_id="echo", model_revision="", tokenizer=server.tokenizer, backend=LocalBackend([server]),
              keys=FileKeyStore.load(write_keys(tmp_path / "keys.yaml")), block_size=4, limits=LIMITS)
    with UvicornThread(build_fastapi(api)) as running:
        yield running
    server.close()


def _head(port: int, length: int | None) -> tuple[socket.socket, bytes]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {ACME}\r\n"
            "Content-Type: application/json\r\n")
    head += f"Content-Length: {length}\r\n" if length is not None else "Transfer-Encoding: chunked\r\n"
    return sock, (head + "\r\n").encode()


def _answer(sock: socket.socket) -> tuple[bytes, bool]:
    """Everything the server sends until it closes the connection (or 10 s pass: then not closed)."""
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except TimeoutError:
        return received, False
    return received, True


def test_a_declared_length_past_the_limit_is_refused_before_reading_and_the_connection_closed(http):
    sock, head = _head(http.port, 50 << 20)
    sock.sendall(head + b"x" * 8192)  # the server reads none of it
    received, closed = _answer(sock)
    assert received.startswith(b"HTTP/1.1 400 ") and b"connection: close" in received.lower()
    assert b"more than the 4096 allowed" in received and closed


def test_a_chunked_body_past_the_limit_stops_being_read_and_the_connection_is_closed(http):
    sock, head = _head(http.port, None)
    chunk = b"x" * 1024
    sock.sendall(head)
    for _ in range(6):  # 6 KiB in chunks, past the 4 KiB the server reads
        sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
    try:
        received, closed = _answer(sock)
    except ConnectionResetError:
        # The server closed with our unread chunks in its buffer, so its kernel reset the connection, which
        # can drop the 400 it sent before we read it: closed all the same, and the rest never read.
        return
    assert received.startswith(b"HTTP/1.1 400 ") and b"more than the 4096 bytes allowed" in received
    assert closed


def test_a_body_that_trickles_in_too_slowly_is_a_408_and_the_connection_closed(http):
    body = json.dumps({"model": "echo", "prompt": "hello there", "max_tokens": 4}).encode()
    sock, head = _head(http.port, len(body))
    sock.sendall(head + body[:5])  # and nothing more: the body never completes
    received, closed = _answer(sock)
    assert received.startswith(b"HTTP/1.1 408 ") and b"did not arrive within 0.5s" in received
    assert b"connection: close" in received.lower() and closed


def test_a_whole_body_within_the_limits_is_answered(http):
    body = json.dumps({"model": "echo", "prompt": "hello there", "max_tokens": 32, "temperature": 0}).encode()
    sock, head = _head(http.port, len(body))
    sock.sendall(head + body)
    received = b""
    while b"\r\n\r\n" not in received or not received.rstrip().endswith(b"}"):
        received += sock.recv(65536)
    assert received.startswith(b"HTTP/1.1 200 ") and b"there hello" in received
    sock.close()
