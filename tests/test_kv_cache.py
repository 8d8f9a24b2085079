"""The KV prefix cache on the example tiny Llama (real transformers code, random weights, fp32, CPU): greedy
decoding with cached prefixes gives exactly the tokens it gives without, from L1, L2 (the suite's redis-server)
and L3 (disk); a corrupt or forged block is never used; Redis killed mid-stream is a recompute; tenants never
share blocks; the rule's choices are honoured; prefetch loads a waiting request's blocks in order."""

from __future__ import annotations

from pathlib import Path

import pytest

from evocache.controller import DiskConfig, RedisConfig, StoreConfig, build_runtime, namespace_for
from evocache.serving import GenerationParams, ModelConfig, load_tokenizer
from evocache.serving._model import HFGenerator
from evocache.serving.kv import KvConfig, KvPlan, KvPrefixCache, KvUsage
from evocache.serving.kv._store import BlockGeometry

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny-llama"
GREEDY = GenerationParams(max_tokens=12, temperature=0.0, top_p=1.0, seed=None, stop=())
SECRET = "kv-test-secret-0123456789abcdef"


@pytest.fixture(scope="module")
def generator():
    tokenizer = load_tokenizer("minilm")
    return HFGenerator(ModelConfig(kind="hf", id="tiny-llama", path=str(EXAMPLE)), tokenizer)


def attach(generator, lower=None, **config):
    kv = KvPrefixCache(KvConfig(**config), BlockGeometry.of_model(generator.model, 8),
                       extras=("tiny-llama", "", "float32", ""), device="cpu", lower=lower)
    generator.attach_kv(kv)
    return kv


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    return [1000 + (seed * 7919 + i * 104729) % 20000 for i in range(n)]


def run(generator, ids, plan=None, usage=None):
    return list(generator.stream("", ids, GREEDY, plan, usage))


def plan_for(tenant="acme", tiers=("l1", "l2", "l3")):
    return KvPlan(salt=str(namespace_for(tenant)), tiers=tiers)


def test_greedy_tokens_with_a_cached_prefix_equal_those_without(generator):
    ids = prompt_ids(61)
    generator.attach_kv(None)
    expected = run(generator, ids)
    kv = attach(generator)
    first = KvUsage()
    assert run(generator, ids, plan_for(), first) == expected
    assert first.cached_tokens == 0 and first.miss == "never-seen" and first.stored_blocks == 7
    again = KvUsage()
    assert run(generator, ids, plan_for(), again) == expected
    assert again.reused == {"l1": 56} and again.recomputed == 5
    longer = ids + prompt_ids(20, seed=3)  # the next turn shares the whole previous prompt
    generator.attach_kv(None)
    expected_longer = run(generator, longer)
    generator.attach_kv(kv)
    usage = KvUsage()
    assert run(generator, longer, plan_for(), usage) == expected_longer
    assert usage.reused["l1"] == 56  # the previous prompt's full blocks
    assert kv.reuse_rate() > 0


@pytest.mark.redis
def test_blocks_come_back_from_l2_and_l3_into_a_cold_replica_exactly(generator, redis_url, tmp_path):
    ids = prompt_ids(45, seed=1)
    generator.attach_kv(None)
    expected = run(generator, ids)
    for tiers, tier in ((("l2",), "l2"), (("l3",), "l3")):
        runtime = build_runtime(StoreConfig(redis=RedisConfig(url=redis_url, secret=SECRET),
                                            disk=DiskConfig(path=str(tmp_path / f"l3-{tier}"))))
        lower = {k: v for k, v in runtime.store.tiers.items() if k in ("l2", "l3")}
        warm = attach(generator, lower)
        run(generator, ids, plan_for(tiers=("l1", *tiers)), KvUsage())
        warm.flush_writes()  # L2/L3 writes run off the request's path
        cold = attach(generator, lower)  # another replica: empty L1, the same L2/L3
        usage = KvUsage()
        assert run(generator, ids, plan_for(tiers=("l1", *tiers)), usage) == expected
        assert usage.reused == {"l1": 0, tier: 40} and usage.load_ms + usage.prefetch_ms > 0
        assert len(cold.l1) == 5  # promoted into the cold replica's L1
        warm.close()
        cold.close()
        runtime.close()


def comparable(usage: KvUsage) -> dict:
    """A request's usage without its timings: what the cache did, which a tenant's guess must not change."""
    return {k: v for k, v in usage.as_dict().items() if k not in ("load_ms", "prefetch_ms", "hidden_ms")}


def test_no_block_crosses_tenants_and_the_miss_is_that_of_a_prompt_nobody_sent(generator):
    ids = prompt_ids(40, seed=2)
    attach(generator)
    run(generator, ids, plan_for("acme"), KvUsage())
    guess, fresh = KvUsage(), KvUsage()
    run(generator, ids, plan_for("globex"), guess)  # acme's prompt, guessed by globex
    run(generator, prompt_ids(40, seed=12), plan_for("globex"), fresh)  # a prompt nobody sent
    assert guess.cached_tokens == 0 and guess.miss == "never-seen"
    assert comparable(guess) == comparable(fresh)
    shared = KvPlan(salt=".kv-shared")
    run(generator, ids, shared, KvUsage())
    again = KvUsage()
    run(generator, ids, KvPlan(salt=".kv-shared"), again)
    assert again.cached_tokens == 32  # a shared prefix is shared only when the rule says so


def test_an_evicted_prefix_is_evicted_only_for_the_tenant_that_stored_it(generator):
    ids = prompt_ids(40, seed=13)
    four_blocks = 4 * BlockGeometry.of_model(generator.model, 8).block_bytes()
    kv = attach(generator, l1_bytes=four_blocks, eviction="lru")
    run(generator, ids, plan_for("acme"), KvUsage())
    run(generator, prompt_ids(40, seed=14), plan_for("acme"), KvUsage())  # pushes the first prompt out of L1
    assert not any(h in kv.l1 for h in kv.hasher.prefix(ids, plan_for("acme").salt))
    mine, guess, fresh = KvUsage(), KvUsage(), KvUsage()
    run(generator, ids, plan_for("globex"), guess)
    run(generator, prompt_ids(40, seed=15), plan_for("globex"), fresh)
    run(generator, ids, plan_for("acme"), mine)
    assert mine.miss == "evicted"  # the tenant that stored it learns its own block went
    assert guess.miss == fresh.miss == "never-seen" and comparable(guess) == comparable(fresh)


def test_a_prompt_shorter_than_a_block_and_an_off_plan_compute_everything(generator):
    kv = attach(generator)
    short = KvUsage()
    run(generator, prompt_ids(6), plan_for(), short)
    assert short.cached_tokens == 0 and short.stored_blocks == 0
    off = KvUsage()
    run(generator, prompt_ids(30), KvPlan(salt="acme", enabled=False, reason="off"), off)
    assert off.stored_blocks == 0 and len(kv.l1) == 0


@pytest.mark.redis
def test_a_tampered_block_in_l2_is_never_used(generator, redis_url):
    import redis

    ids = prompt_ids(33, seed=4)
    generator.attach_kv(None)
    expected = run(generator, ids)
    runtime = build_runtime(StoreConfig(redis=RedisConfig(url=redis_url, secret=SECRET)))
    lower = {"l2": runtime.store.tiers["l2"]}
    attach(generator, lower)
    run(generator, ids, plan_for(tiers=("l1", "l2")), KvUsage())
    generator.kv.flush_writes()
    client = redis.Redis.from_url(redis_url)
    keys = [k for k in client.keys("*") if client.type(k) == b"string"]  # the entries, not bookkeeping
    assert keys
    for k in keys:  # flip one byte of every stored block
        value = bytearray(client.get(k))
        value[len(value) // 2] ^= 0xFF
        client.set(k, bytes(value))
    cold = attach(generator, lower)
    usage = KvUsage()
    assert run(generator, ids, plan_for(tiers=("l1", "l2")), usage) == expected
    assert usage.cached_tokens == 0
    assert cold.l1.used == 4 * cold.geometry.block_bytes()  # recomputed and stored afresh
    runtime.close()


def test_a_block_that_fails_the_caches_checks_is_dropped_and_its_miss_is_named_corrupt(generator, tmp_path):
    """A block whose entry is sound (signed, in the right place) but is not a block of this model: dropped,
    counted, the prompt recomputed, and the request's miss reason is ``corrupt``; stored afresh, it hits."""
    from evocache.controller import Entry

    ids = prompt_ids(33, seed=6)
    generator.attach_kv(None)
    expected = run(generator, ids)
    runtime = build_runtime(StoreConfig(disk=DiskConfig(path=str(tmp_path / "l3"))))
    lower = {"l3": runtime.store.tiers["l3"]}
    warm = attach(generator, lower)
    plan = plan_for(tiers=("l1", "l3"))
    run(generator, ids, plan, KvUsage())
    warm.flush_writes()
    first = warm.hasher.prefix(ids, plan.salt)[0]
    forged = Entry(b"not a block of this model", None, 0.0, "kv")
    lower["l3"].set_many(plan.salt, [(warm.hasher.tier_key(first, g), forged) for g in warm.lower.groups])
    cold = attach(generator, lower)
    usage = KvUsage()
    assert run(generator, ids, plan, usage) == expected
    assert (usage.cached_tokens, usage.miss, cold.lower.corrupt) == (0, "corrupt", 1)
    cold.flush_writes()
    again = KvUsage()
    assert run(generator, ids, plan, again) == expected
    assert again.cached_tokens == 32 and again.miss == ""
    runtime.close()


@pytest.mark.redis
def test_redis_killed_mid_request_is_a_recompute(generator, restartable_redis):
    ids = prompt_ids(50, seed=5)
    generator.attach_kv(None)
    expected = run(generator, ids)
    runtime = build_runtime(StoreConfig(redis=RedisConfig(url=restartable_redis.url, secret=SECRET,
                                                          timeout_s=0.2)))
    attach(generator, {"l2": runtime.store.tiers["l2"]})
    run(generator, ids, plan_for(tiers=("l1", "l2")), KvUsage())
    generator.kv.flush_writes()
    attach(generator, {"l2": runtime.store.tiers["l2"]})  # a cold L1: the blocks are in Redis only
    pieces = generator.stream("", ids, GREEDY, plan_for(tiers=("l1", "l2")), KvUsage())
    restartable_redis.stop()
    assert list(pieces) == expected
    runtime.close()


def test_queue_aware_eviction_keeps_the_blocks_a_waiting_request_needs(generator):
    block = BlockGeometry.of_model(generator.model, 8).block_bytes()
    kv = attach(generator, l1_bytes=6 * block, eviction="lookahead")
    waiting_ids = prompt_ids(33, seed=6)  # 4 full blocks
    run(generator, waiting_ids, plan_for(), KvUsage())
    ticket = kv.l1.enqueue(kv.hasher.prefix(waiting_ids, plan_for().salt))
    for seed in range(7, 10):  # other prompts push 12 blocks through a 6-block L1
        run(generator, prompt_ids(33, seed=seed), plan_for(), KvUsage())
    kv.l1.dequeue(ticket)
    usage = KvUsage()
    run(generator, waiting_ids, plan_for(), usage)
    assert usage.reused["l1"] == 32


class _Recording:
    """A lower tier that records the keys it is asked for, in order (a real tier underneath)."""

    def __init__(self, tier):
        self.tier, self.asked = tier, []

    def get_many(self, ns, keys):
        self.asked += list(keys)
        return self.tier.get_many(ns, keys)

    def set_many(self, ns, items):
        return self.tier.set_many(ns, items)

    def delete(self, ns, keys):
        return self.tier.delete(ns, keys)


def test_prefetch_loads_a_waiting_requests_blocks_in_position_order(generator, tmp_path):
    ids = prompt_ids(57, seed=11)  # 7 full blocks
    runtime = build_runtime(StoreConfig(disk=DiskConfig(path=str(tmp_path / "l3"))))
    disk = _Recording(runtime.store.tiers["l3"])
    warm = attach(generator, {"l3": disk})
    run(generator, ids, plan_for(tiers=("l1", "l3")), KvUsage())
    warm.flush_writes()
    cold = attach(generator, {"l3": disk}, prefetch=True)
    hashes = cold.hasher.prefix(ids, plan_for().salt)
    disk.asked.clear()
    cold.prefetch(plan_for(tiers=("l1", "l3")), hashes)
    # The chain, in order.
    assert disk.asked == [cold.hasher.tier_key(h, g) for h in hashes for g in cold.lower.groups]
    assert [h in cold.l1 for h in hashes] == [True] * 7
    usage = KvUsage()
    run(generator, ids, plan_for(tiers=("l1", "l3")), usage)
    assert usage.reused == {"l1": 0, "l3": 56}  # counted for the tier the prefetch read them from
    warm.close()
    cold.close()
    runtime.close()


def test_the_l1_policy_is_told_each_blocks_place_in_its_request_and_may_be_the_lookahead_over_learned(generator):
    told = []
    kv = attach(generator, eviction="lookahead:learned")
    assert type(kv.l1.policy).__name__ == "LookaheadPolicy"
    assert type(kv.l1.policy.base).__name__.startswith("Learned")
    put = kv.l1.put
    kv.l1.put = lambda key, block, info: told.append(info) or put(key, block, info)
    ids = prompt_ids(41, seed=12)  # 5 full blocks
    run(generator, ids, plan_for(), KvUsage())
    hashes = kv.hasher.prefix(ids, plan_for().salt)
    assert [(i.pos, i.req_len, i.parent) for i in told] == [(j, 5, hashes[j - 1] if j else None) for j in range(5)]
    assert len({i.req for i in told}) == 1
