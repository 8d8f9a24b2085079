"""The block store and the scheduler's index behind the vLLM connector, without vLLM: blocks round-trip
through L1 and L3, a fresh store (a restarted server) finds L3's blocks, a payload that fails its checks is
refused, deleted and counted, L1 evictions with no lower tier are reported, the index answers leading runs
from what it was told and what a probe of L3 finds, and the configuration names its bad fields."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from evocache.controller import BlockHash, DiskTier, Entry, StoreConfigError
from evocache.serving.kv._hashing import BlockHasher
from evocache.serving.kv._store import BlockGeometry, encode_group
from evocache.serving.kv._vllm_store import (
    BlockStore,
    ConnectorConfig,
    Counters,
    HeldIndex,
    TierProbe,
    build_tiers,
    model_namespace,
)

# The tiny Llama's: a block (128 KiB) is larger than diskcache keeps inline, so each is a file of its own.
GEOMETRY = BlockGeometry(layers=2, kv_heads=2, head_dim=64, block_size=128, dtype="bfloat16")
NAMESPACE = model_namespace({"model": "tiny", "dtype": "bfloat16"})
SECRET = "connector-test-secret-0123456789"


def chain(n: int, salt: str = "") -> list[BlockHash]:
    """n chained 32-byte hashes, as vLLM's are."""
    out, parent = [], salt.encode()
    for i in range(n):
        parent = hashlib.sha256(parent + i.to_bytes(4, "little")).digest()
        out.append(BlockHash(parent))
    return out


def block(seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    shape = (GEOMETRY.kv_heads, GEOMETRY.block_size, GEOMETRY.head_dim)
    return tuple((torch.randn(shape, generator=g).to(torch.bfloat16), torch.randn(shape, generator=g)
                  .to(torch.bfloat16)) for _ in range(GEOMETRY.layers))


def same(a: tuple, b: tuple) -> bool:
    return all(torch.equal(x, y) for pa, pb in zip(a, b, strict=True) for x, y in zip(pa, pb, strict=True))


def config(tmp_path: Path | None = None, **extra) -> ConnectorConfig:
    data = {"l1_bytes": 4 * GEOMETRY.block_bytes(), **extra}
    if tmp_path is not None:
        data["disk"] = {"path": str(tmp_path / "l3")}
    return ConnectorConfig.parse(data)


def store_for(cfg: ConnectorConfig, namespace: str = NAMESPACE) -> tuple[BlockStore, Counters]:
    counters = Counters()
    return BlockStore(cfg, GEOMETRY, namespace, build_tiers(cfg, counters), counters), counters


@pytest.fixture(autouse=True)
def _secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EVOCACHE_SECRET", SECRET)


def test_blocks_round_trip_through_l1_and_a_fresh_store_finds_them_in_l3(tmp_path: Path) -> None:
    hashes, blocks = chain(3), [block(i) for i in range(3)]
    store, counters = store_for(config(tmp_path))
    store.put(list(zip(hashes, blocks, strict=True)))
    loaded = store.load(hashes)
    assert loaded.tiers == ("l1", "l1", "l1") and all(map(same, loaded.blocks, blocks))
    store.flush()
    assert store.take_report() == (tuple(hashes), ())
    store.close()

    fresh, counters = store_for(config(tmp_path))  # a restarted server: L1 empty
    loaded = fresh.load(hashes + chain(1, salt="other"))
    assert loaded.tiers == ("l3", "l3", "l3") and all(map(same, loaded.blocks, blocks))
    assert fresh.load(hashes).tiers == ("l1", "l1", "l1")  # promoted
    assert counters.take() == {"loaded_l3": 3, "loaded_l1": 3}


def test_a_load_stops_at_the_first_block_nobody_holds(tmp_path: Path) -> None:
    hashes = chain(4)
    store, _ = store_for(config(tmp_path))
    store.put([(hashes[0], block(0)), (hashes[1], block(1)), (hashes[3], block(3))])
    assert len(store.load(hashes).blocks) == 2


def test_another_models_namespace_sees_none_of_the_blocks(tmp_path: Path) -> None:
    hashes = chain(2)
    store, _ = store_for(config(tmp_path))
    store.put([(h, block(i)) for i, h in enumerate(hashes)])
    store.close()
    other, _ = store_for(config(tmp_path), model_namespace({"model": "another", "dtype": "bfloat16"}))
    assert other.load(hashes).blocks == ()


def test_l1_evictions_are_reported_dropped_only_without_a_lower_tier(tmp_path: Path) -> None:
    hashes = chain(6)
    alone, counters = store_for(config())  # L1 holds four blocks
    alone.put([(h, block(i)) for i, h in enumerate(hashes)])
    stored, dropped = alone.take_report()
    assert dropped == tuple(hashes[:2]) and counters.take()["evicted"] == 2
    assert set(stored) >= set(hashes[2:])
    backed, _ = store_for(config(tmp_path))
    backed.put([(h, block(i)) for i, h in enumerate(hashes)])
    backed.flush()
    assert backed.take_report() == (tuple(hashes), ())
    assert len(backed.load(hashes).blocks) == 6  # the first two from L3


def test_a_signed_payload_of_another_geometry_is_refused_deleted_and_counted(tmp_path: Path) -> None:
    hashes = chain(2)
    store, counters = store_for(config(tmp_path))
    store.put([(h, block(i)) for i, h in enumerate(hashes)])
    store.close()
    # Signed with the deployment's secret, so the tier accepts it; its header names another geometry.
    wrong = BlockGeometry(layers=2, kv_heads=1, head_dim=128, block_size=128, dtype="bfloat16")
    payload = encode_group(block(9)[:2], wrong, 0)
    disk = DiskTier(tmp_path / "l3", secret=SECRET.encode())
    key = BlockHasher.tier_key(hashes[1], (0, 2))
    disk.set_many(NAMESPACE, [(key, Entry(payload, None, 0.0, "kv"))])

    fresh, counters = store_for(config(tmp_path))
    assert fresh.load(hashes).tiers == ("l3",)
    assert counters.take()["corrupt"] == 1
    assert disk.get_many(NAMESPACE, [key]) == [None]  # deleted: the next probe does not find it


def test_flipped_bytes_on_disk_are_a_counted_tier_fault_and_a_miss(tmp_path: Path) -> None:
    hashes = chain(2)
    store, _ = store_for(config(tmp_path))
    store.put([(h, block(i)) for i, h in enumerate(hashes)])
    store.close()
    files = sorted((tmp_path / "l3").rglob("*.val"), key=lambda p: p.stat().st_mtime)
    assert len(files) == 2
    data = bytearray(files[-1].read_bytes())
    data[len(data) // 2] ^= 0xFF
    files[-1].write_bytes(bytes(data))

    fresh, counters = store_for(config(tmp_path))
    assert fresh.load(hashes).tiers == ("l3",)
    assert counters.take()["tier_faults"] == 1


def test_the_index_answers_leading_runs_and_probes_l3_for_the_rest(tmp_path: Path) -> None:
    hashes = chain(5)
    store, _ = store_for(config(tmp_path))
    store.put([(h, block(i)) for i, h in enumerate(hashes[:3])])
    store.close()
    counters = Counters()
    tiers = build_tiers(config(tmp_path), counters)
    index = HeldIndex(100, TierProbe(tiers, [(0, 2)], NAMESPACE, counters))
    index.add(hashes[:1])
    assert index.run(hashes) == 3
    assert counters.take() == {"probed_l3": 2}
    assert index.run(hashes) == 3 and counters.take() == {}  # remembered: no second probe
    index.discard(hashes[1:2])
    assert index.run(hashes[:1]) == 1


def test_the_index_is_bounded_and_forgets_the_least_recently_matched_first() -> None:
    hashes = chain(4)
    index = HeldIndex(3)
    index.add(hashes[:3])
    assert index.run(hashes[:1]) == 1  # block 0 matched: block 1 is now the oldest
    index.add(hashes[3:])
    assert [h in index for h in hashes] == [True, False, True, True]


def test_the_configuration_names_its_bad_fields() -> None:
    with pytest.raises(StoreConfigError) as caught:
        ConnectorConfig.parse({"l1_bytes": 0, "disk": {"bytes": 5}, "colour": "red"})
    assert sorted(caught.value.issues) == [
        "kv_connector_extra_config.colour: Extra inputs are not permitted",
        "kv_connector_extra_config.disk.path: Field required",
        "kv_connector_extra_config.l1_bytes: Input should be greater than 0",
    ]


def test_blocks_round_trip_through_redis_for_a_fresh_store(redis_url: str) -> None:
    hashes, blocks = chain(2), [block(i) for i in range(2)]
    cfg = config(redis={"url": redis_url})
    store, _ = store_for(cfg)
    store.put(list(zip(hashes, blocks, strict=True)))
    store.flush()
    store.close()
    fresh, counters = store_for(cfg)
    loaded = fresh.load(hashes)
    assert loaded.tiers == ("l2", "l2") and all(map(same, loaded.blocks, blocks))
    assert counters.take() == {"loaded_l2": 2}
