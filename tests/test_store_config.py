"""The store configuration: nested by part, validated once, every error naming its place."""

from __future__ import annotations

import logging
import os
import stat

import pytest

from evocache.controller import (
    DiskConfig,
    EmbedderConfig,
    EventsConfig,
    L1Config,
    RedisConfig,
    SemanticConfig,
    StoreConfig,
    StoreConfigError,
    build_runtime,
)
from evocache.controller._secret import entry_secret

MiB = 1 << 20


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"events": {"sink": "jsonl"}}, "events: sink jsonl needs a path"),
        ({"events": {"sink": "redis"}}, "events.sink redis needs a redis part (RedisConfig)"),
        ({"l1": {"bytes": 0}}, "l1.bytes: Input should be greater than 0"),
        ({"events": {"sink": "kafka"}}, "events.sink: Input should be 'ring', 'jsonl', 'redis' or 'none'"),
        ({"l1_size": 1}, "l1_size: Extra inputs are not permitted"),
        ({"redis": {"prefix": "p"}}, "redis.url: Field required"),
        ({"redis": {"url": "localhost:6379"}}, "redis.url: 'localhost:6379' is not a Redis URL: Redis URL must"),
        ({"redis": {"url": "redis://h:99999/0"}}, "redis.url: 'redis://h:99999/0' is not a Redis URL: Port out"),
        ({"redis": {"url": "redis://h:port/0"}}, "redis.url: 'redis://h:port/0' is not a Redis URL: Port could"),
        ({"redis": {"url": "redis://h/zero"}}, "redis.url: 'redis://h/zero' is not a Redis URL: the database"),
        ({"redis": {"url": "redis://h", "timeout_s": 0}}, "redis.timeout_s: Input should be greater than 0"),
        ({"redis": {"url": "redis://h", "secret": "short"}}, "redis.secret: a secret needs at least 16 bytes"),
        ({"disk": {"path": "/d", "bytes": -1}}, "disk.bytes: Input should be greater than 0"),
        ({"semantic": {"embedder": {"kind": "word2vec"}}}, "semantic.embedder: unknown embedder 'word2vec'"),
        ({"redis_url": "redis://h"}, "redis_url: is now redis.url"),
        ({"events": "ring"}, "events: is now events.sink"),
    ],
)
def test_invalid_configs_name_the_field(data, message):
    with pytest.raises(StoreConfigError) as err:
        StoreConfig.parse(data)
    assert message in str(err.value)


def test_every_invalid_field_is_named_at_once():
    with pytest.raises(StoreConfigError) as err:
        StoreConfig.parse({"l1": {"bytes": 0}, "redis": {"url": "nope"}, "disk": {"path": ""}})
    assert [issue.split(":")[0] for issue in err.value.issues] == ["l1.bytes", "redis.url", "disk.path"]


def test_a_malformed_redis_url_is_a_config_error_before_anything_is_built():
    with pytest.raises(StoreConfigError, match=r"^invalid store configuration: redis\.url: 'redis//h:6379' is not"):
        RedisConfig(url="redis//h:6379")
    with pytest.raises(StoreConfigError, match=r"redis\.url: 'http://h' is not a Redis URL"):
        StoreConfig(redis={"url": "http://h"})


def test_a_malformed_url_in_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv("EVOCACHE_REDIS_URL", "127.0.0.1:6379")
    with pytest.raises(StoreConfigError, match=r"redis\.url: '127\.0\.0\.1:6379' is not .* \(from \$EVOCACHE_REDIS_URL\)"):
        StoreConfig()


@pytest.mark.parametrize(
    ("keyword", "new"),
    [
        ("l1_bytes", "l1=L1Config(bytes=...)"),
        ("l1_eviction", "l1=L1Config(eviction=...)"),
        ("redis_url", "redis=RedisConfig(url=...)"),
        ("l2_bytes", "redis=RedisConfig(l2_bytes=...)"),
        ("l2_prefix", "redis=RedisConfig(prefix=...)"),
        ("l2_timeout_s", "redis=RedisConfig(timeout_s=...)"),
        ("l2_retry_after_s", "redis=RedisConfig(retry_after_s=...)"),
        ("disk_path", "disk=DiskConfig(path=...)"),
        ("l3_bytes", "disk=DiskConfig(bytes=...)"),
        ("events_path", "events=EventsConfig(path=...)"),
        ("ring_capacity", "events=EventsConfig(ring_capacity=...)"),
        ("embedder", "semantic=SemanticConfig(embedder=EmbedderConfig(kind=...))"),
        ("embedder_url", "semantic=SemanticConfig(embedder=EmbedderConfig(url=...))"),
        ("embedder_model", "semantic=SemanticConfig(embedder=EmbedderConfig(model=...))"),
        ("embedder_api_key_env", "semantic=SemanticConfig(embedder=EmbedderConfig(api_key_env=...))"),
        ("embedder_threads", "semantic=SemanticConfig(embedder=EmbedderConfig(threads=...))"),
        ("semantic_shared", "semantic=SemanticConfig(shared=...)"),
    ],
)
def test_an_old_flat_keyword_names_its_new_place(keyword, new):
    with pytest.raises(TypeError) as err:
        StoreConfig(**{keyword: 1})
    assert str(err.value) == f"StoreConfig({keyword}=...) is now StoreConfig({new})"


def test_events_as_a_string_names_its_new_place():
    with pytest.raises(TypeError) as err:
        StoreConfig(events="jsonl")
    assert str(err.value) == "StoreConfig(events='jsonl') is now StoreConfig(events=EventsConfig(sink='jsonl'))"


def test_defaults_are_unchanged(monkeypatch):
    monkeypatch.delenv("EVOCACHE_REDIS_URL", raising=False)
    config = StoreConfig()
    assert config.l1 == L1Config(bytes=64 * MiB, eviction="lru")
    assert config.redis is None and config.disk is None
    assert config.events == EventsConfig(sink="ring", path=None, ring_capacity=100_000)
    assert config.semantic == SemanticConfig(shared=True, embedder=EmbedderConfig(kind="minilm"))
    redis = RedisConfig(url="redis://h:6379/0")
    assert (redis.prefix, redis.l2_bytes, redis.timeout_s, redis.retry_after_s) == ("evc", None, 0.05, 1.0)
    assert (redis.secret, redis.secret_file) == (None, None)
    assert DiskConfig(path="/d").bytes == 1024 * MiB
    monkeypatch.setenv("EVOCACHE_REDIS_URL", "redis://10.0.0.5:6379/1")
    assert StoreConfig().redis == RedisConfig(url="redis://10.0.0.5:6379/1")


def test_the_nested_mapping_parses():
    data = {
        "l1": {"bytes": 1000, "eviction": "s3fifo"},
        "redis": {"url": "redis://h:6379/0", "prefix": "p", "l2_bytes": 10_000},
        "disk": {"path": "/var/cache/evc"},
        "events": {"sink": "jsonl", "path": "e.jsonl"},
        "semantic": {"shared": False, "embedder": {"threads": 1}},
    }
    assert StoreConfig.parse(data) == StoreConfig(
        l1=L1Config(bytes=1000, eviction="s3fifo"),
        redis=RedisConfig(url="redis://h:6379/0", prefix="p", l2_bytes=10_000),
        disk=DiskConfig(path="/var/cache/evc"),
        events=EventsConfig(sink="jsonl", path="e.jsonl"),
        semantic=SemanticConfig(shared=False, embedder=EmbedderConfig(threads=1)),
    )


def test_parts_are_frozen_and_the_secret_is_not_shown():
    redis = RedisConfig(url="redis://h", secret="a deployment secret, not for logs")
    with pytest.raises(ValueError, match="frozen"):
        redis.url = "redis://other"  # type: ignore[misc]
    assert "deployment" not in repr(redis) and "deployment" not in repr(StoreConfig(redis=redis))


def test_unknown_eviction_policy_lists_the_known_ones():
    from evocache.controller import EVICTION_POLICIES

    assert {"lfu", "lru", "lruk", "s3fifo", "weighted"} <= set(EVICTION_POLICIES)
    with pytest.raises(StoreConfigError) as err:
        build_runtime(StoreConfig(l1=L1Config(eviction="clock")))
    assert str(err.value).endswith(f"unknown eviction policy 'clock'; known: {', '.join(sorted(EVICTION_POLICIES))}")


def test_tiers_follow_the_config(tmp_path):
    runtime = build_runtime(StoreConfig(disk=DiskConfig(path=str(tmp_path / "l3")), events=EventsConfig(sink="none")))
    assert list(runtime.store.tiers) == ["l1", "l3"]
    runtime.close()


# -- the secret that signs L2 and L3 entries -------------------------------------------------------------------


def test_the_secret_comes_from_the_config_first(tmp_path, monkeypatch):
    monkeypatch.setenv("EVOCACHE_SECRET", "the environment's secret")
    given = RedisConfig(url="redis://h", secret="the configuration's secret")
    assert entry_secret(StoreConfig(redis=given)) == b"the configuration's secret"
    key_file = tmp_path / "key"
    key_file.write_text("a secret kept in a file\n")
    in_file = RedisConfig(url="redis://h", secret_file=str(key_file))
    assert entry_secret(StoreConfig(redis=in_file)) == b"a secret kept in a file"
    assert entry_secret(StoreConfig(redis=RedisConfig(url="redis://h"))) == b"the environment's secret"
    assert entry_secret(StoreConfig(disk=DiskConfig(path=str(tmp_path / "l3")))) == b"the environment's secret"


def test_without_one_a_key_file_is_made_beside_the_store(tmp_path, monkeypatch):
    monkeypatch.setenv("EVOCACHE_STATE_DIR", str(tmp_path / "state"))
    on_disk = StoreConfig(disk=DiskConfig(path=str(tmp_path / "l3")))
    secret = entry_secret(on_disk)
    key_file = tmp_path / "l3" / "evocache.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert len(secret) == 64 and key_file.read_bytes() == secret + b"\n"
    assert entry_secret(on_disk) == secret  # read again, not made again
    redis_only = StoreConfig(redis=RedisConfig(url="redis://h"))
    state_secret = entry_secret(redis_only)
    assert (tmp_path / "state" / "evocache.key").read_bytes() == state_secret + b"\n"
    assert state_secret != secret


def test_a_redis_store_without_a_secret_warns(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="evocache.controller.secret"):
        entry_secret(StoreConfig(redis=RedisConfig(url="redis://h")))
    assert "set EVOCACHE_SECRET (or RedisConfig.secret) for replicas on other hosts" in caplog.text


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"short\n", r"redis\.secret_file \(.*key\): the secret is 5 bytes; at least 16 needed"),
        (b"x" * 5000, r"redis\.secret_file: .*key is over 4096 bytes, not a key file"),
    ],
)
def test_a_bad_key_file_is_a_config_error(tmp_path, content, message):
    (tmp_path / "key").write_bytes(content)
    config = StoreConfig(redis=RedisConfig(url="redis://h", secret_file=str(tmp_path / "key")))
    with pytest.raises(StoreConfigError, match=message):
        entry_secret(config)


def test_a_key_file_that_is_not_a_regular_file_is_refused(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    config = StoreConfig(redis=RedisConfig(url="redis://h", secret_file=str(fifo)))
    with pytest.raises(StoreConfigError, match=r"redis\.secret_file: .*fifo is not a regular file"):
        entry_secret(config)
    missing = StoreConfig(redis=RedisConfig(url="redis://h", secret_file=str(tmp_path / "none")))
    with pytest.raises(StoreConfigError, match=r"redis\.secret_file: cannot read the key file .*none: No such file"):
        entry_secret(missing)


def test_a_short_secret_in_the_environment_is_a_config_error(monkeypatch, tmp_path):
    monkeypatch.setenv("EVOCACHE_SECRET", "too short")
    with pytest.raises(StoreConfigError, match=r"\$EVOCACHE_SECRET: the secret is 9 bytes; at least 16 needed"):
        build_runtime(StoreConfig(disk=DiskConfig(path=str(tmp_path / "l3"))))


def test_a_secret_in_the_environment_that_is_not_utf8_is_its_bytes(monkeypatch, tmp_path):
    monkeypatch.setitem(os.environb, b"EVOCACHE_SECRET", b"\xff\xfe" * 10)
    assert entry_secret(StoreConfig(disk=DiskConfig(path=str(tmp_path / "l3")))) == b"\xff\xfe" * 10


def test_an_empty_secret_in_the_environment_is_a_config_error(monkeypatch, tmp_path):
    # Set but empty (EVOCACHE_SECRET=$UNSET): each host would sign with a key file of its own instead.
    monkeypatch.setenv("EVOCACHE_SECRET", "")
    with pytest.raises(StoreConfigError, match=r"\$EVOCACHE_SECRET: the secret is 0 bytes; at least 16 needed"):
        entry_secret(StoreConfig(disk=DiskConfig(path=str(tmp_path / "l3"))))
    assert not (tmp_path / "l3" / "evocache.key").exists()


@pytest.mark.parametrize("mode", [0o620, 0o602, 0o666])
def test_a_key_file_others_can_write_is_refused(tmp_path, mode):
    # Whoever can write the key can sign entries that every replica serves.
    key_file = tmp_path / "key"
    key_file.write_bytes(b"a secret kept in a file\n")
    key_file.chmod(mode)
    config = StoreConfig(redis=RedisConfig(url="redis://h", secret_file=str(key_file)))
    with pytest.raises(StoreConfigError, match=r"redis\.secret_file: .*key is writable by others .*chmod go-w"):
        entry_secret(config)
    auto = tmp_path / "l3" / "evocache.key"
    entry_secret(StoreConfig(disk=DiskConfig(path=str(tmp_path / "l3"))))
    auto.chmod(mode)
    with pytest.raises(StoreConfigError, match=r"key file: .*evocache\.key is writable by others"):
        entry_secret(StoreConfig(disk=DiskConfig(path=str(tmp_path / "l3"))))


def test_a_key_file_others_can_read_warns(tmp_path, caplog):
    key_file = tmp_path / "key"
    key_file.write_bytes(b"a secret kept in a file\n")
    key_file.chmod(0o644)
    config = StoreConfig(redis=RedisConfig(url="redis://h", secret_file=str(key_file)))
    with caplog.at_level(logging.WARNING, logger="evocache.controller.secret"):
        assert entry_secret(config) == b"a secret kept in a file"
    assert f"{key_file} is readable by others" in caplog.text
    key_file.chmod(0o600)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="evocache.controller.secret"):
        entry_secret(config)
    assert "readable by others" not in caplog.text
