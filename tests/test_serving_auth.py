"""Tenants from verified API keys (serving/_auth.py) and the per-tenant rate limiter."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import redis

from evocache.controller import Tenant
from evocache.serving import (
    AdminKeys,
    FileKeyStore,
    Forbidden,
    MetricsConfig,
    Rate,
    RateLimited,
    RateLimiter,
    RedisKeyStore,
    ServingConfigError,
    Unauthenticated,
    authenticate,
    bearer_key,
)


def _key_file(tmp_path, text, mode=0o600, name="keys.yaml"):
    path = tmp_path / name
    path.write_text(text)
    path.chmod(mode)
    return path


KEYS = f"""
keys:
  - sha256: {hashlib.sha256(b"sk-acme").hexdigest()}
    tenant: acme
    tier: pro
  - key: sk-globex
    tenant: globex
"""


def test_a_key_file_maps_bearer_keys_to_tenants(tmp_path):
    store = FileKeyStore.load(_key_file(tmp_path, KEYS))
    assert authenticate(store, "Bearer sk-acme") == Tenant("acme", "pro")
    assert authenticate(store, "bearer  sk-globex ") == Tenant("globex", "default")
    assert set(store.table) == {hashlib.sha256(b"sk-acme").digest(), hashlib.sha256(b"sk-globex").digest()}


def test_a_json_key_file_is_read_the_same(tmp_path):
    document = {"keys": [{"key": "sk-1", "tenant": "t1", "tier": "free"}]}
    store = FileKeyStore.load(_key_file(tmp_path, json.dumps(document), name="keys.json"))
    assert store.tenant_for("sk-1") == Tenant("t1", "free")


@pytest.mark.parametrize(
    ("header", "match"),
    [
        (None, "missing Authorization header"),
        ("", "malformed Authorization header"),
        ("Basic c2stYWNtZQ==", "malformed Authorization header"),
        ("Bearer", "malformed Authorization header"),
        ("Bearer sk acme", "malformed API key"),
        ("Bearer " + "k" * 257, "malformed API key"),
        ("Bearer sk-\x00acme", "malformed API key"),
        ("Bearer sk-unknown", "unknown API key"),
        ("Bearer SK-ACME", "unknown API key"),
    ],
)
def test_missing_malformed_or_unknown_keys_are_unauthenticated(tmp_path, header, match):
    store = FileKeyStore.load(_key_file(tmp_path, KEYS))
    with pytest.raises(Unauthenticated, match=match) as caught:
        authenticate(store, header)
    assert (caught.value.status, caught.value.code) == (401, "invalid_api_key")


def test_bearer_key_reads_the_key():
    assert bearer_key("Bearer sk-123") == "sk-123"


@pytest.mark.parametrize("mode", [0o620, 0o602, 0o666])
def test_a_group_or_world_writable_key_file_is_refused(tmp_path, mode):
    with pytest.raises(ServingConfigError, match="group- or world-writable"):
        FileKeyStore.load(_key_file(tmp_path, KEYS, mode=mode))


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("keys: [{tenant: a}]", "keys.0: Value error, give exactly one of 'sha256' and 'key'"),
        ("keys: [{key: k, sha256: '" + "0" * 64 + "', tenant: a}]", "give exactly one"),
        ("keys: [{sha256: abc, tenant: a}]", "keys.0.sha256: String should match pattern"),
        ("keys: [{key: k, tenant: a, teir: pro}]", "keys.0.teir: Extra inputs are not permitted"),
        ("keys: [{key: k, tenant: ''}]", "keys.0.tenant"),
        ("keys: [{key: k, tenant: a}, {key: k, tenant: b}]", "keys.1: the same key is listed twice"),
        ("keys: [{key: k, tenant: 7}]", "keys.0.tenant: Input should be a valid string"),
        ("- just a list", r"\(document\): Input should be a valid dictionary"),
        ("keys: [{key: k, tenant: !!python/object:os.system a}]", "not valid YAML or JSON"),
        ("keys: [unclosed", "not valid YAML or JSON"),
    ],
)
def test_an_invalid_key_file_names_the_place(tmp_path, text, match):
    with pytest.raises(ServingConfigError, match=match):
        FileKeyStore.load(_key_file(tmp_path, text))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("keys:\n  - key: sk-one\n    tenant: acme\n  - key: sk-two\n    tenant: globex\n    teir: pro\n",
         ":6: keys.1.teir: Extra inputs are not permitted"),
        ("keys:\n  - key: sk-one\n    tenant: acme\n  - key: sk-two\n", ":4: keys.1.tenant: Field required"),
        ("keys:\n  - key: sk-one\n    tenant: acme\n  - key: sk-one\n    tenant: globex\n",
         ":4: keys.1: the same key is listed twice"),
        ("keys:\n  - key: sk-one\n    tenant: {acme\n", ":4:1: not valid YAML or JSON: while parsing a flow "
         "mapping; expected ',' or '}', but got '<stream end>'"),
        ("keys:\n  - key: sk-one\n tenant: acme\n", ":3:2: not valid YAML or JSON: while parsing a block "
         "mapping; expected <block end>, but found '<block mapping start>'"),
    ],
)
def test_a_key_file_error_names_the_file_and_the_line(tmp_path, text, message):
    path = _key_file(tmp_path, text)
    with pytest.raises(ServingConfigError) as caught:
        FileKeyStore.load(path)
    assert str(caught.value) == f"{path}{message}"


def test_a_key_file_that_is_not_utf8_names_the_line(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_bytes(b"keys:\n  - key: sk-\xff\n")
    path.chmod(0o600)
    with pytest.raises(ServingConfigError) as caught:
        FileKeyStore.load(path)
    assert str(caught.value) == f"{path}:2: not UTF-8 text"


def test_a_key_file_over_the_size_bound_is_refused(tmp_path):
    with pytest.raises(ServingConfigError, match="larger than 64 bytes"):
        FileKeyStore.load(_key_file(tmp_path, KEYS), max_bytes=64)


def test_a_key_file_that_is_a_fifo_or_a_directory_is_refused_without_waiting(tmp_path):
    fifo = tmp_path / "keys.fifo"
    os.mkfifo(fifo)  # no writer: opening it for reading the usual way would wait for one
    for path in (fifo, tmp_path):
        with pytest.raises(ServingConfigError, match="not a regular file"):
            FileKeyStore.load(path)


def test_a_missing_key_file_is_a_config_error(tmp_path):
    with pytest.raises(ServingConfigError, match="cannot read the API-key file"):
        FileKeyStore.load(tmp_path / "absent.yaml")


ADMIN = AdminKeys.from_hex([hashlib.sha256(b"sk-operator").hexdigest()])


def test_an_admin_key_is_authorized_and_a_tenants_key_is_forbidden(tmp_path):
    store = FileKeyStore.load(_key_file(tmp_path, KEYS))
    ADMIN.authorize("Bearer sk-operator", store)
    with pytest.raises(Forbidden) as caught:
        ADMIN.authorize("Bearer sk-acme", store)
    assert (caught.value.status, caught.value.code) == (403, "insufficient_permissions")
    assert "acme" not in caught.value.message


@pytest.mark.parametrize(("header", "match"), [(None, "missing Authorization header"),
                                                ("Basic c2stYWNtZQ==", "malformed Authorization header"),
                                                ("Bearer sk-unknown", "unknown API key")])
def test_no_key_a_malformed_or_an_unknown_one_is_unauthenticated_for_admin_endpoints(tmp_path, header, match):
    store = FileKeyStore.load(_key_file(tmp_path, KEYS))
    with pytest.raises(Unauthenticated, match=match):
        ADMIN.authorize(header, store)


def test_with_no_admin_key_configured_no_key_is_authorized(tmp_path):
    store = FileKeyStore.load(_key_file(tmp_path, KEYS))
    with pytest.raises(Unauthenticated):
        AdminKeys().authorize("Bearer sk-operator", store)
    with pytest.raises(Forbidden):
        AdminKeys().authorize("Bearer sk-acme", store)


def test_a_metrics_config_takes_sha256_digests_and_a_port_apart_from_the_apis():
    from evocache.serving import ApiKeysConfig, ServerSpec, ServingConfig

    digest = hashlib.sha256(b"sk-operator").hexdigest()
    assert MetricsConfig(admin_keys=[digest]).admin_keys == (digest,)
    assert (MetricsConfig().port, MetricsConfig().host) == (None, "127.0.0.1")
    with pytest.raises(ValueError, match="String should match pattern"):
        MetricsConfig(admin_keys=["sk-operator"])  # the key itself, not its digest
    with pytest.raises(ValueError, match="metrics.port: 8000 is the API's port"):
        ServingConfig(server=ServerSpec(model={"kind": "callable", "id": "m", "callable": "m:f"}),
                      api_keys=ApiKeysConfig(file="keys.yaml"), port=8000, metrics=MetricsConfig(port=8000))


def test_a_key_file_holds_one_key_its_owner_alone_reads(tmp_path):
    from evocache.serving._auth import read_key_file

    assert read_key_file(_key_file(tmp_path, "sk-operator\n", name="metrics-key")) == "sk-operator"
    with pytest.raises(ServingConfigError, match="readable or writable by others"):
        read_key_file(_key_file(tmp_path, "sk-operator\n", mode=0o640, name="shared-key"))
    with pytest.raises(ServingConfigError, match="no valid key"):
        read_key_file(_key_file(tmp_path, "sk operator\n", name="bad-key"))


@pytest.mark.redis
def test_a_redis_hash_maps_keys_to_tenants(redis_url):
    client = redis.Redis.from_url(redis_url)
    store = RedisKeyStore(client)
    store.add("sk-acme", Tenant("acme", "pro"))
    assert authenticate(store, "Bearer sk-acme") == Tenant("acme", "pro")
    assert client.hkeys(store.hash_key) == [hashlib.sha256(b"sk-acme").hexdigest().encode()]
    with pytest.raises(Unauthenticated, match="unknown API key"):
        authenticate(store, "Bearer sk-other")
    store.revoke("sk-acme")
    with pytest.raises(Unauthenticated, match="unknown API key"):
        authenticate(store, "Bearer sk-acme")


@pytest.mark.redis
def test_an_invalid_redis_record_is_a_config_error(redis_url):
    client = redis.Redis.from_url(redis_url)
    store = RedisKeyStore(client)
    client.hset(store.hash_key, hashlib.sha256(b"sk-bad").hexdigest(), b'{"tenant": 3}')
    with pytest.raises(ServingConfigError, match="invalid record"):
        store.tenant_for("sk-bad")


def test_the_rate_limiter_allows_the_burst_then_refills_at_the_rate(fake_clock):
    limiter = RateLimiter(Rate(per_second=2.0, burst=3.0), clock=fake_clock)
    for _ in range(3):
        limiter.acquire("acme")
    with pytest.raises(RateLimited) as caught:
        limiter.acquire("acme")
    error = caught.value
    assert (error.status, error.code, error.retry_after) == (429, "rate_limit_exceeded", 0.5)
    limiter.acquire("globex")  # another tenant has its own bucket
    fake_clock.advance(0.5)
    limiter.acquire("acme")
    with pytest.raises(RateLimited):
        limiter.acquire("acme")
    fake_clock.advance(100.0)  # refill stops at the burst
    for _ in range(3):
        limiter.acquire("acme")
    with pytest.raises(RateLimited):
        limiter.acquire("acme")


def test_a_tenant_can_have_its_own_rate(fake_clock):
    limiter = RateLimiter(Rate(1.0, 1.0), clock=fake_clock, per_tenant={"acme": Rate(1.0, 2.0)})
    limiter.acquire("acme")
    limiter.acquire("acme")
    limiter.acquire("globex")
    with pytest.raises(RateLimited, match="tenant 'globex' is over its rate of 1 requests/s"):
        limiter.acquire("globex")


@pytest.mark.parametrize(("per_second", "burst"), [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.5)])
def test_a_bad_rate_is_refused(per_second, burst):
    with pytest.raises(ValueError, match="a rate needs per_second > 0 and burst >= 1"):
        Rate(per_second, burst)
