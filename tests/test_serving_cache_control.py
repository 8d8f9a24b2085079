"""Per-request cache control over HTTP, as users of gateways send it: ``Cache-Control`` (no-store, no-cache,
max-age) and the body's ``cache`` object (LiteLLM's shape, with a namespace within the tenant), and the
``x-evocache-status`` header that says what happened."""

from __future__ import annotations

import httpx
import pytest
from _serving_fixtures import CALLS, KEYS, UvicornThread, echo_model, serve

from evocache.serving import build_fastapi

ACME, GLOBEX = list(KEYS)


@pytest.fixture
def http(tmp_path):
    api, server = serve(tmp_path, echo_model)
    with UvicornThread(build_fastapi(api)) as running:
        yield running
    server.close()


def ask(http, prompt, *, key=ACME, headers=None, **body):
    r = httpx.post(f"{http.url}/v1/completions", headers={"Authorization": f"Bearer {key}", **(headers or {})},
                   json={"model": "echo", "prompt": prompt, "temperature": 0, "max_tokens": 8, **body}, timeout=30)
    return r


def status(r) -> str:
    assert r.status_code == 200, r.text
    return r.headers["x-evocache-status"]


def test_no_store_serves_without_storing_and_no_cache_refreshes(http):
    CALLS.clear()
    assert status(ask(http, "one two", headers={"Cache-Control": "no-store"})) == "STORE-SKIPPED"
    assert status(ask(http, "one two")) == "MISS"  # nothing was stored
    assert status(ask(http, "one two")) == "HIT"
    assert status(ask(http, "one two", headers={"Cache-Control": "no-store"})) == "HIT"  # served all the same
    assert status(ask(http, "one two", headers={"Cache-Control": "no-cache"})) == "REFRESH"
    assert CALLS.count("one two") == 3
    assert status(ask(http, "one two", cache={"no-cache": True})) == "REFRESH"  # the body's object alike
    assert status(ask(http, "one two", headers={"Cache-Control": "max-age=3600"})) == "HIT"
    assert status(ask(http, "one two", headers={"Cache-Control": "max-age=0"})) == "MISS"  # older than 0 s


def test_a_namespace_partitions_within_the_tenant_and_never_across(http):
    assert status(ask(http, "red green", cache={"namespace": "team-a"})) == "MISS"
    assert status(ask(http, "red green", cache={"namespace": "team-a"})) == "HIT"
    assert status(ask(http, "red green")) == "MISS"  # the tenant's own entries are another partition
    assert status(ask(http, "red green", key=GLOBEX, cache={"namespace": "team-a"})) == "MISS"


def test_malformed_directives_are_400s_naming_them(http):
    r = ask(http, "x", headers={"Cache-Control": "max-age=soon"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "Cache-Control"
    r = ask(http, "x", headers={"Cache-Control": "private, must-revalidate"})
    assert r.status_code == 200  # directives that do not concern a request's cache are ignored, as HTTP asks
    for bad, param in (({"no-store": "yes"}, "cache.no-store"), ({"namespace": "a b"}, "cache.namespace"),
                       ({"ttl": -1}, "cache.ttl"), ({"shared": True}, "cache.shared")):
        r = ask(http, "x", cache=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)
