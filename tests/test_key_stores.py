"""The shared KeyStore suite: every place API keys can live (a key file, a Redis hash) answers the same way.

A store maps an API key to its tenant and tier, raises ``Unauthenticated`` for any key it does not hold (one
that differs by a character, a prefix, its case), and keeps keys only as their SHA-256 digests."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
import yaml

from evocache.controller import Tenant
from evocache.serving import FileKeyStore, KeyStore, RedisKeyStore, Unauthenticated

HELD = {
    "sk-acme-0001-alpha": Tenant("acme", "pro"),
    "sk-acme-0002-beta": Tenant("acme", "pro"),
    "sk-globex-0003-gamma": Tenant("globex", "free"),
}

Make = Callable[[dict[str, Tenant]], tuple[KeyStore, Callable[[], bytes]]]
"""A store holding ``keys``, and what it keeps (the hex digests and records of its table or its Redis hash)."""


def file_store(tmp_path: Path) -> Make:
    def make(keys: dict[str, Tenant]) -> tuple[KeyStore, Callable[[], bytes]]:
        path = tmp_path / "keys.yaml"
        records = []
        for i, (key, tenant) in enumerate(keys.items()):
            # Both spellings a key file allows: the key's digest, or (for a file only its owner reads) the key.
            held = {"sha256": hashlib.sha256(key.encode()).hexdigest()} if i % 2 == 0 else {"key": key}
            records.append({**held, "tenant": tenant.id, "tier": tenant.tier})
        path.write_text(yaml.safe_dump({"keys": records}))
        os.chmod(path, 0o600)
        store = FileKeyStore.load(path)
        return store, lambda: repr(sorted((d.hex(), t) for d, t in store.table.items())).encode()

    return make


def redis_store(url: str) -> Make:
    def make(keys: dict[str, Tenant]) -> tuple[KeyStore, Callable[[], bytes]]:
        store = RedisKeyStore.from_url(url, hash_key="evc:test-keys")
        for key, tenant in keys.items():
            store.add(key, tenant)
        raw = redis.Redis.from_url(url)
        return store, lambda: repr(sorted(raw.hgetall("evc:test-keys").items())).encode()

    return make


@pytest.fixture(params=["file", pytest.param("redis", marks=pytest.mark.redis)])
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Make]:
    if request.param == "file":
        yield file_store(tmp_path)
    else:
        yield redis_store(request.getfixturevalue("redis_url"))


def test_each_key_maps_to_its_tenant_and_tier(make: Make) -> None:
    store, _ = make(HELD)
    assert {key: store.tenant_for(key) for key in HELD} == HELD


@pytest.mark.parametrize("key", ["sk-acme-0001-alphA", "sk-acme-0001-alph", "sk-acme-0001-alpha2",
                                 "SK-ACME-0001-ALPHA", "sk-unknown", "x" * 512])
def test_any_key_it_does_not_hold_is_unauthenticated(make: Make, key: str) -> None:
    store, _ = make(HELD)
    with pytest.raises(Unauthenticated, match="unknown API key"):
        store.tenant_for(key)


def test_keys_are_kept_as_digests_only(make: Make) -> None:
    store, at_rest = make(HELD)
    held = at_rest()
    for key in HELD:
        assert hashlib.sha256(key.encode()).hexdigest().encode() in held
        assert key.encode() not in held


def test_an_empty_store_knows_no_key(make: Make) -> None:
    store, _ = make({})
    with pytest.raises(Unauthenticated):
        store.tenant_for("sk-acme-0001-alpha")
