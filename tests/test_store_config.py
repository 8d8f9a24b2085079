from __future__ import annotations

import pytest

from evocache.controller import StoreConfig, StoreConfigError, build_runtime


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"events": "jsonl"}, "events: jsonl needs events_path"),
        ({"events": "redis"}, "events: redis needs redis_url"),
        ({"l1_bytes": 0}, "l1_bytes: Input should be greater than 0"),
        ({"events": "kafka"}, "events: Input should be 'ring', 'jsonl', 'redis' or 'none'"),
        ({"l1_size": 1}, "l1_size: Extra inputs are not permitted"),
    ],
)
def test_invalid_configs_name_the_field(data, message):
    with pytest.raises(StoreConfigError) as err:
        StoreConfig.parse(data)
    assert message in str(err.value)


def test_unknown_eviction_policy_lists_the_known_ones():
    from evocache.controller import EVICTION_POLICIES

    assert {"lfu", "lru", "lruk", "s3fifo", "weighted"} <= set(EVICTION_POLICIES)
    with pytest.raises(StoreConfigError) as err:
        build_runtime(StoreConfig(l1_eviction="clock"))
    assert str(err.value).endswith(f"unknown eviction policy 'clock'; known: {', '.join(sorted(EVICTION_POLICIES))}")


def test_tiers_follow_the_config(tmp_path):
    runtime = build_runtime(StoreConfig(disk_path=str(tmp_path / "l3"), events="none"))
    assert list(runtime.store.tiers) == ["l1", "l3"]
    runtime.close()
