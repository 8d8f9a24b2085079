"""Tiers against someone who can write their storage: rows planted in L3's SQLite index, entries copied or
re-signed in Redis. Nothing planted is ever unpickled or served; each is a counted, deleted miss, and the next
call of the key works."""

from __future__ import annotations

import hashlib
import os
import pickle
import sqlite3
import threading
from pathlib import Path

import pytest
import redis

from evocache.controller._types import L2, L3, CacheKey, Entry, Namespace
from evocache.controller.errors import StoreConfigError, TierUnavailable
from evocache.controller.tiers._disk import DiskTier
from evocache.controller.tiers._tiered import MISS, TieredStore
from evocache.controller.tiers._redis import RedisTier

NS = Namespace("tenant-a")
KEY = CacheKey("a1" * 8)
T0 = 1_700_000_000.0


class _Marker:
    """Unpickling this creates ``path``: the proof that a stored pickle ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def _disk(tmp_path: Path, faults: list) -> DiskTier:
    return DiskTier(tmp_path / "l3", clock=lambda: T0, on_fault=lambda tier, kind: faults.append((tier, kind)))


def _rows(directory: Path) -> list[tuple]:
    with sqlite3.connect(directory / "cache.db") as db:
        return db.execute("SELECT key, raw, mode, filename FROM Cache ORDER BY key").fetchall()


def _plant(directory: Path, key: str, *, mode: int, value: object, filename: str | None = None) -> None:
    """Write a row straight into diskcache's index, as someone with write access to the file could."""
    with sqlite3.connect(directory / "cache.db") as db:
        db.execute(
            "INSERT OR REPLACE INTO Cache (key, raw, store_time, expire_time, access_time, access_count, tag,"
            " size, mode, filename, value) VALUES (?, 1, ?, NULL, ?, 0, ?, 0, ?, ?, ?)",
            (key, T0, T0, NS, mode, filename, value),
        )


def test_a_planted_pickle_row_is_never_unpickled(tmp_path: Path) -> None:
    faults: list = []
    tier = _disk(tmp_path, faults)
    marker = tmp_path / "pickle-ran"
    _plant(tier_dir := tmp_path / "l3", f"{NS}:{KEY}", mode=4, value=pickle.dumps(_Marker(str(marker))))

    assert tier.get_many(NS, [KEY]) == [None]
    assert not marker.exists()
    assert faults == [(L3, "corrupt")]
    assert _rows(tier_dir) == []  # deleted

    assert tier.get_one(NS, KEY) is None and faults == [(L3, "corrupt")]  # a plain miss now, not a fault
    tier.set_many(NS, [(KEY, Entry(b"fresh", None, T0))])
    assert tier.get_one(NS, KEY) == Entry(b"fresh", None, T0)
    assert not marker.exists()
    tier.close()


def test_a_flipped_mode_bit_is_one_counted_miss(tmp_path: Path) -> None:
    # A stored entry whose mode column changes from raw (1) to pickle (4)... or any mode but raw and file.
    for mode in (0, 3, 4, 5):
        faults: list = []
        tier = _disk(tmp_path, faults)
        tier.set_many(NS, [(KEY, Entry(b"value", None, T0))])
        with sqlite3.connect(tmp_path / "l3" / "cache.db") as db:
            db.execute("UPDATE Cache SET mode = ?", (mode,))
        assert tier.get_one(NS, KEY) is None, mode
        assert faults == [(L3, "corrupt")], mode
        assert tier.get_one(NS, KEY) is None and len(faults) == 1  # deleted: the next call is a plain miss
        tier.set_many(NS, [(KEY, Entry(b"again", None, T0))])
        assert tier.get_one(NS, KEY) == Entry(b"again", None, T0)
        tier.close()


def test_rows_of_the_wrong_type_are_counted_deleted_misses(tmp_path: Path) -> None:
    faults: list = []
    tier = _disk(tmp_path, faults)
    directory = tmp_path / "l3"
    keys = [CacheKey(f"{i:016x}") for i in range(4)]
    _plant(directory, f"{NS}:{keys[0]}", mode=1, value="text, not bytes")
    _plant(directory, f"{NS}:{keys[1]}", mode=1, value=12345)
    _plant(directory, f"{NS}:{keys[2]}", mode=1, value=b"bytes without a valid signature")
    _plant(directory, f"{NS}:{keys[3]}", mode=1, value=None)
    assert tier.get_many(NS, keys) == [None] * 4
    assert faults == [(L3, "corrupt")] * 4
    assert _rows(directory) == []
    tier.close()


def test_a_planted_file_name_outside_the_store_is_neither_read_nor_removed(tmp_path: Path) -> None:
    faults: list = []
    tier = _disk(tmp_path, faults)
    outside = tmp_path / "precious.txt"
    outside.write_bytes(b"not the cache's")
    _plant(tmp_path / "l3", f"{NS}:{KEY}", mode=2, value=None, filename="../precious.txt")
    assert tier.get_one(NS, KEY) is None
    assert faults == [(L3, "corrupt")]
    assert outside.read_bytes() == b"not the cache's"
    assert _rows(tmp_path / "l3") == []
    tier.close()


def test_the_disk_tier_stores_raw_bytes_only(tmp_path: Path) -> None:
    tier = _disk(tmp_path, [])
    small, large = CacheKey("b2" * 8), CacheKey("c3" * 8)
    tier.set_many(NS, [(small, Entry(b"s", None, T0)), (large, Entry(b"L" * 100_000, None, T0))])
    rows = _rows(tmp_path / "l3")
    assert [(key, raw, mode) for key, raw, mode, _ in rows] == [(f"{NS}:{small}", 1, 1), (f"{NS}:{large}", 1, 2)]
    assert hashlib.sha256(tier.get_one(NS, large).value).digest() == hashlib.sha256(b"L" * 100_000).digest()
    tier.close()


# -- L2: whoever can write to Redis cannot make one tenant's entry another's ------------------------------

TENANT_B = Namespace("tenant-b")
SECRET = b"a deployment secret of 32 bytes!"


def _resigned(blob: bytes, ns: str, key: str) -> list[bytes]:
    """``blob`` re-signed for ``(ns, key)`` every way one can without the secret: the unkeyed digests a format
    could use, and a keyed one under a guessed key."""
    body = blob[:-16]
    nsb, keyb = ns.encode(), key.encode()
    bound = len(nsb).to_bytes(2, "little") + nsb + len(keyb).to_bytes(2, "little") + keyb + body
    return [
        body + hashlib.sha256(bound).digest()[:16],
        body + hashlib.blake2b(bound, digest_size=16).digest(),
        body + hashlib.blake2b(bound, digest_size=16, key=b"guessed").digest(),
    ]


@pytest.mark.redis
def test_an_entry_copied_or_resigned_for_another_tenant_is_a_counted_miss(redis_url: str) -> None:
    faults: list = []
    tier = RedisTier(redis_url, secret=SECRET, clock=lambda: T0, on_fault=lambda t, k: faults.append((t, k)))
    tier.set_many(NS, [(KEY, Entry(b"tenant A's answer", None, T0))])
    with redis.Redis.from_url(redis_url) as raw:
        blob = raw.get(f"evc:{NS}:{KEY}")
        forgeries = [blob, *_resigned(blob, TENANT_B, KEY)]
        for n, forged in enumerate(forgeries, 1):
            raw.set(f"evc:{TENANT_B}:{KEY}", forged)
            assert tier.get_one(TENANT_B, KEY) is None
            assert tier.get_many(TENANT_B, [KEY]) == [None]
            assert faults == [(L2, "corrupt")] * n
            assert raw.exists(f"evc:{TENANT_B}:{KEY}") == 0  # deleted
    assert tier.get_one(NS, KEY) == Entry(b"tenant A's answer", None, T0)  # the original still serves A
    tier.close()


@pytest.mark.redis
def test_entries_signed_under_another_secret_are_misses(redis_url: str) -> None:
    faults: list = []
    ours = RedisTier(redis_url, secret=SECRET, on_fault=lambda t, k: faults.append((t, k)))
    theirs = RedisTier(redis_url, secret=b"another deployment's secret....")
    theirs.set_many(NS, [(KEY, Entry(b"theirs", None, T0))])
    assert ours.get_one(NS, KEY) is None
    assert faults == [(L2, "corrupt")]
    ours.close()
    theirs.close()


def test_disk_entries_are_signed_with_the_key_file_beside_the_store(tmp_path: Path) -> None:
    tier = _disk(tmp_path, [])
    key_file = tmp_path / "l3" / "evocache.key"
    assert key_file.stat().st_mode & 0o777 == 0o600
    tier.set_many(NS, [(KEY, Entry(b"value", None, T0))])
    tier.close()
    faults: list = []
    again = _disk(tmp_path, faults)  # the same key file: the entry reads back
    assert again.get_one(NS, KEY) == Entry(b"value", None, T0)
    again.close()
    key_file.unlink()  # a new key: entries signed under the old one are misses, never served
    third = _disk(tmp_path, faults)
    assert third.get_one(NS, KEY) is None
    assert faults == [(L3, "corrupt")]
    third.close()


# -- L3: links, special files and oversized files planted in the store directory -------------------------

_VALUE_NAME = "ab/cd/" + "0" * 28 + ".val"


def _value_file(directory: Path, name: str = _VALUE_NAME) -> Path:
    path = directory / name
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


@pytest.mark.parametrize("kind", ["symlink-to-dev-zero", "fifo", "directory"])
def test_a_value_file_that_is_no_regular_file_is_neither_read_nor_waited_on(tmp_path: Path, kind: str) -> None:
    # A link to /dev/zero read whole exhausts memory; a FIFO blocks the read forever; neither is opened.
    faults: list = []
    tier = _disk(tmp_path, faults)
    directory = tmp_path / "l3"
    path = _value_file(directory)
    if kind == "symlink-to-dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
    _plant(directory, f"{NS}:{KEY}", mode=2, value=None, filename=_VALUE_NAME)
    assert tier.get_one(NS, KEY) is None
    assert faults == [(L3, "corrupt")]
    assert _rows(directory) == []
    tier.close()


def test_a_value_file_larger_than_the_store_is_not_read(tmp_path: Path) -> None:
    faults: list = []
    tier = DiskTier(tmp_path / "l3", size_limit=1 << 20, on_fault=lambda tier, kind: faults.append((tier, kind)))
    with open(_value_file(tmp_path / "l3"), "wb") as fh:
        fh.truncate(1 << 40)  # sparse: a terabyte that costs the planter nothing
    _plant(tmp_path / "l3", f"{NS}:{KEY}", mode=2, value=None, filename=_VALUE_NAME)
    assert tier.get_one(NS, KEY) is None
    assert faults == [(L3, "corrupt")]
    tier.close()


def test_a_linked_directory_leads_no_read_and_no_removal_out_of_the_store(tmp_path: Path) -> None:
    faults: list = []
    tier = _disk(tmp_path, faults)
    elsewhere = tmp_path / "elsewhere"
    victim = _value_file(elsewhere, "cd/" + "0" * 28 + ".val")
    victim.write_bytes(b"not the cache's")
    (tmp_path / "l3" / "ab").symlink_to(elsewhere)
    _plant(tmp_path / "l3", f"{NS}:{KEY}", mode=2, value=None, filename=_VALUE_NAME)
    assert tier.get_one(NS, KEY) is None
    assert faults == [(L3, "corrupt")]
    assert victim.read_bytes() == b"not the cache's"
    assert _rows(tmp_path / "l3") == []
    tier.close()


def test_values_are_never_written_through_a_linked_directory(tmp_path: Path) -> None:
    tier = _disk(tmp_path, [])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for first in range(256):  # every first level diskcache may pick
        (tmp_path / "l3" / f"{first:02x}").symlink_to(elsewhere)
    with pytest.raises(TierUnavailable):
        tier.set_many(NS, [(KEY, Entry(b"L" * 100_000, None, T0))])
    assert list(elsewhere.iterdir()) == []
    tier.set_many(NS, [(KEY, Entry(b"small", None, T0))])  # inline values need no file
    assert tier.get_one(NS, KEY) == Entry(b"small", None, T0)
    tier.close()


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("disk_foo", 1),  # would be handed to the Disk as a keyword
        ("sqlite_temp_store_directory", "'/tmp'"),  # would run as PRAGMA temp_store_directory = '/tmp'
    ],
)
def test_a_planted_setting_is_refused_at_open(tmp_path: Path, setting: str, value: object) -> None:
    _disk(tmp_path, []).close()
    with sqlite3.connect(tmp_path / "l3" / "cache.db") as db:
        db.execute("INSERT OR REPLACE INTO Settings VALUES (?, ?)", (setting, value))
    with pytest.raises(StoreConfigError, match=f"never writes.*{setting}"):
        _disk(tmp_path, [])


def test_planted_values_of_known_settings_are_overridden(tmp_path: Path) -> None:
    _disk(tmp_path, []).close()
    with sqlite3.connect(tmp_path / "l3" / "cache.db") as db:
        db.executemany(
            "UPDATE Settings SET value = ? WHERE key = ?",
            [("x", "cull_limit"), (0, "disk_min_file_size"), ("1; DROP TABLE Cache", "sqlite_cache_size")],
        )
    tier = _disk(tmp_path, [])
    tier.set_many(NS, [(KEY, Entry(b"small", None, T0))])  # a 'x' cull limit failed every write
    assert tier.get_one(NS, KEY) == Entry(b"small", None, T0)
    assert [mode for _, _, mode, _ in _rows(tmp_path / "l3")] == [1]  # inline again, as by default
    tier.close()


def test_settings_planted_while_open_reach_no_new_connection(tmp_path: Path) -> None:
    # diskcache re-reads the sqlite_* settings for every new connection (a thread's first call).
    tier = _disk(tmp_path, [])
    tier.set_many(NS, [(KEY, Entry(b"value", None, T0))])
    with sqlite3.connect(tmp_path / "l3" / "cache.db") as db:
        db.execute("UPDATE Settings SET value = '1; DROP TABLE Cache' WHERE key = 'sqlite_cache_size'")
        db.execute("INSERT INTO Settings VALUES (?, ?)", ("sqlite_temp_store_directory", "'/nonexistent'"))
    found: list = []
    reader = threading.Thread(target=lambda: found.append(tier.get_one(NS, KEY)))
    reader.start()
    reader.join()
    assert found == [Entry(b"value", None, T0)]
    tier.close()


def test_duplicated_rows_are_a_counted_tier_failure_not_an_exception(tmp_path: Path) -> None:
    # With diskcache's unique index dropped, one key can have two rows; diskcache then fails to unpack them.
    tier = _disk(tmp_path, [])
    tier.set_many(NS, [(KEY, Entry(b"value", None, T0))])
    with sqlite3.connect(tmp_path / "l3" / "cache.db") as db:
        db.execute("DROP INDEX Cache_key_raw")
        db.execute("INSERT INTO Cache (key, raw, store_time, access_time, tag, size, mode, filename, value)"
                   " SELECT key, raw, store_time, access_time, tag, size, mode, filename, value FROM Cache")
    errors: list = []
    store = TieredStore([tier], on_error=lambda tier, op, exc: errors.append((tier, op)))
    assert store.get(NS, KEY) == MISS
    assert store.set(NS, KEY, Entry(b"again", None, T0)) == ()
    assert errors == [(L3, "get"), (L3, "set")]
    with pytest.raises(TierUnavailable, match="l3: delete: ValueError"):
        tier.delete(NS, [KEY])
    tier.close()


@pytest.mark.redis
def test_usage_reads_past_foreign_bookkeeping(redis_url: str) -> None:
    tier = RedisTier(redis_url, secret=SECRET, socket_timeout=1.0)
    tier.set_many(NS, [(KEY, Entry(b"value", None, T0))])
    used = tier.usage()
    with redis.Redis.from_url(redis_url) as raw:
        raw.sadd("evc:#namespaces", b"\xff\xfe", b"not:a namespace")  # no namespace this tier writes
        assert tier.usage() == used
        raw.set(f"evc:{NS}:#used", "another program's")
    with pytest.raises(TierUnavailable, match=f"usage: the byte count of namespace {NS} is not a number"):
        tier.usage(NS)
    with pytest.raises(TierUnavailable, match="is not a number"):
        tier.usage()
    tier.close()
