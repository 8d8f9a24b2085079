"""What a replica's KV prefix cache says about itself, on the example tiny Llama (real transformers code, random
weights, fp32, CPU) behind an in-process ``ModelServer`` with a policy: the ``kv`` access event after each model
call (its usage, joined to the call's decision; skipped by replay), the ``evocache_kv_*`` metrics on the
replica's registry, the miss reasons, the reuse-rate window, the routing report limited to the blocks L1 still
holds, and the L2/L3 payload transfers on the CPU and (where there is one) a CUDA device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evocache.controller import (
    AccessEvent,
    EventsConfig,
    PolicyStoreConfig,
    StoreConfig,
    block_hashes,
    namespace_for,
    open_policy_store,
)
from evocache.controller.replay import read_trace
from evocache.serving import ModelConfig, ModelServer, ServerSpec
from evocache.serving._affinity import AffinityIndex, parse_report
from evocache.serving._request import GenerateRequest
from evocache.serving.kv import KvConfig
from evocache.serving.kv._store import BlockGeometry, decode_group, encode_group

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny-llama"
BLOCK = 16  # ServerSpec's default block size
BLOCK_BYTES = 2 * 2 * 2 * BLOCK * 16 * 4  # layers x (keys, values) x kv heads x tokens x head dim x fp32
POLICY = """
policy: kv-obs
version: 1
defaults: {ttl: 10m, tiers: [l1], kv: {reuse: prefix}}
rules:
  - name: kv-off
    when: max_tokens == 3
    kv: {reuse: "off"}
  - name: long-prompts-only
    when: max_tokens == 5
    kv: {min_tokens: 1000}
  - name: chat
    when: true
"""


def make_server(tmp_path: Path, **kv: int) -> ModelServer:
    store = PolicyStoreConfig(directory=str(tmp_path / "policies"), poll_interval_s=0.1)
    policies = open_policy_store(store)
    policies.apply(POLICY)
    policies.close()
    spec = ServerSpec(model=ModelConfig(kind="hf", id="tiny-llama", path=str(EXAMPLE), tokenizer="minilm"),
                      store=StoreConfig(events=EventsConfig(sink="ring")), policy_store=store,
                      kv=KvConfig(**kv))
    return ModelServer(spec, "kv-replica")


@pytest.fixture
def server(tmp_path):
    served = make_server(tmp_path)
    yield served
    served.close()


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    return [1000 + (seed * 7919 + i * 104729) % 20000 for i in range(n)]


def request(server: ModelServer, ids: list[int], tenant: str = "acme", max_tokens: int = 4) -> GenerateRequest:
    blocks = block_hashes(ids, server.spec.block_size, server.spec.block_extras(), str(namespace_for(tenant)))
    return GenerateRequest(request_id="cmpl-1", endpoint="completions", model="tiny-llama",
                           prompt=" ".join(map(str, ids)), input_ids=tuple(ids), blocks=blocks, tenant=tenant,
                           tenant_tier="standard", max_tokens=max_tokens, temperature=0.0, top_p=1.0, seed=None,
                           stop=())


def events(server: ModelServer, outcome: str) -> list[AccessEvent]:
    return [e for e in server.runtime.events.events() if e.outcome == outcome]


def kv_events(server: ModelServer) -> list[AccessEvent]:
    """The calls whose model ran with the KV cache: their event carries its usage."""
    return [e for e in server.runtime.events.events() if e.kv is not None]


FIRST = prompt_ids(61)  # 3 full blocks
SECOND = FIRST[:48] + prompt_ids(20, seed=3)  # the same 3 blocks, then a block of its own


def test_a_model_call_carries_its_kv_usage_in_its_one_event(server, tmp_path):
    server.complete(request(server, FIRST))
    finish = server.complete(request(server, SECOND)).finish
    first, second = server.runtime.events.events()
    assert (first.outcome, second.outcome) == ("miss", "miss")
    assert (first.ns, first.rule, first.policy) == (str(namespace_for("acme")), "chat", "kv-obs@1")
    assert first.key and first.call and first.stored == "l1"
    usage = {k: first.kv[k] for k in ("prompt_tokens", "cached_tokens", "reused", "recomputed", "load_ms",
                                      "miss", "stored_blocks")}
    assert usage == {"prompt_tokens": 61, "cached_tokens": 0, "reused": {"l1": 0}, "recomputed": 61,
                     "load_ms": 0.0, "miss": "never-seen", "stored_blocks": 3}
    assert 0 <= first.kv["hidden_ms"] <= first.kv["prefetch_ms"]
    assert (second.kv["cached_tokens"], second.kv["miss"]) == (48, "never-seen")
    assert second.kv["reused"] == {"l1": 48} and second.kv["recomputed"] == 68 - 48
    assert second.kv["stored_blocks"] == 1 and finish.cached_tokens == 48
    # The usage survives the JSON line, and replay reads the two calls as two accesses.
    lines = [e.to_json() for e in server.runtime.events.events()]
    assert [AccessEvent.from_dict(json.loads(line)) for line in lines] == server.runtime.events.events()
    path = tmp_path / "events.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert [(a.key, a.size) for a in read_trace(path, "events")] == [(first.key, first.size),
                                                                    (second.key, second.size)]


def test_a_hit_runs_no_model_and_carries_no_kv_usage(server):
    server.complete(request(server, FIRST))
    again = server.complete(request(server, FIRST))
    assert again.decision.outcome == "hit" and len(kv_events(server)) == 1
    assert events(server, "hit")[0].kv is None


def test_the_metrics_count_tokens_per_tier_after_two_requests_sharing_a_prefix(server):
    metrics = server.runtime.metrics
    server.complete(request(server, FIRST))
    server.complete(request(server, SECOND))
    assert metrics.value("evocache_kv_reused_tokens_total", tier="l1") == 48
    assert metrics.value("evocache_kv_reused_tokens_total", tier="l2") == 0
    assert metrics.value("evocache_kv_recomputed_tokens_total") == 61 + 20
    assert metrics.value("evocache_kv_misses_total", reason="never-seen") == 2
    assert metrics.value("evocache_kv_l1_bytes") == 4 * BLOCK_BYTES == server.kv.l1.used
    assert metrics.value("evocache_kv_l1_evictions_total") == 0
    assert metrics.value("evocache_kv_block_errors_total", kind="tier-error") == 0
    assert metrics.value("evocache_kv_load_seconds_count") == 0  # no lower tier was read
    exposition = server.metrics().decode()
    for name in ("evocache_kv_reused_tokens_total", "evocache_kv_recomputed_tokens_total",
                 "evocache_kv_load_seconds_bucket", "evocache_kv_prefetch_seconds_total",
                 "evocache_kv_prefetch_hidden_seconds_total", "evocache_kv_misses_total", "evocache_kv_l1_bytes",
                 "evocache_kv_l1_evictions_total", "evocache_kv_block_errors_total", "evocache_kv_reuse_rate",
                 "evocache_requests_total"):
        assert f"\n{name}" in exposition, name


def test_each_miss_reason_is_counted(server):
    metrics = server.runtime.metrics
    server.complete(request(server, FIRST))  # never-seen
    server.complete(request(server, FIRST, tenant="globex"))  # the same tokens, another tenant: never-seen too
    server.complete(request(server, prompt_ids(40, seed=5), max_tokens=5))  # the rule's min_tokens: 1000
    held = server.kv.l1.used
    server.complete(request(server, prompt_ids(40, seed=6), max_tokens=3))  # the rule's kv: off
    reasons = {r: metrics.value("evocache_kv_misses_total", reason=r)
               for r in ("never-seen", "below-min-tokens", "off")}
    assert reasons == {"never-seen": 2, "below-min-tokens": 1, "off": 1}
    assert [(e.rule, e.kv["miss"]) for e in kv_events(server)] == [
        ("chat", "never-seen"), ("chat", "never-seen"), ("long-prompts-only", "below-min-tokens"),
        ("kv-off", "off")]
    off = kv_events(server)[-1]
    assert off.kv["recomputed"] == off.kv["prompt_tokens"] == 40 and off.kv["stored_blocks"] == 0
    assert server.kv.l1.used == held  # a request the rule keeps off the cache stores nothing


KV_COUNTERS = ("evocache_kv_recomputed_tokens_total", "evocache_kv_l1_evictions_total",
               "evocache_kv_load_seconds_count")


def kv_counts(server: ModelServer) -> dict[str, float]:
    """Every KV counter the replica exposes (misses by each reason, reused tokens by each tier), by name."""
    value = server.runtime.metrics.value
    counts = {name: value(name) for name in KV_COUNTERS}
    for reason in ("never-seen", "evicted", "partial-block", "below-min-tokens", "off", "corrupt"):
        counts[f"miss:{reason}"] = value("evocache_kv_misses_total", reason=reason)
    for tier in ("l1", "l2", "l3", "chunk"):
        counts[f"reused:{tier}"] = value("evocache_kv_reused_tokens_total", tier=tier)
    return counts


def observed(server: ModelServer, ids: list[int], tenant: str) -> tuple[dict, dict[str, float], tuple]:
    """What one request changes where it can be seen: the counters (as deltas), its event's KV usage (timings
    aside), and what it answers (the decision and the cached tokens)."""
    before = kv_counts(server)
    done = server.complete(request(server, ids, tenant=tenant))
    after = kv_counts(server)
    event = kv_events(server)[-1]
    usage = {k: v for k, v in event.kv.items() if k not in ("load_ms", "prefetch_ms", "hidden_ms")}
    answer = (done.decision.outcome, done.decision.tier, done.decision.reason, done.finish.cached_tokens,
              done.finish.prompt_tokens)
    return ({"reason": event.kv["miss"], "usage": usage},
            {k: after[k] - before[k] for k in after}, answer)


def test_a_prompt_another_tenant_sent_misses_exactly_like_one_nobody_sent(server):
    server.complete(request(server, FIRST))  # acme's prompt
    guess = observed(server, FIRST, "globex")  # globex guesses acme's prompt
    fresh = observed(server, prompt_ids(61, seed=9), "globex")  # a prompt nobody sent, of the same length
    assert guess == fresh
    assert guess[0]["reason"] == "never-seen" and guess[1]["miss:never-seen"] == 1


def test_the_reuse_rate_is_the_share_of_blocks_accessed_more_than_once_in_the_window(server):
    assert server.kv_window() == 0.0  # nothing accessed yet
    server.complete(request(server, FIRST))
    server.complete(request(server, SECOND))
    # FIRST's 3 blocks were accessed twice, SECOND's own block once.
    assert server.kv_window() == 0.75
    assert server.runtime.metrics.value("evocache_kv_reuse_rate") == 0.75
    assert server.kv_window() == 0.0  # a new window
    assert server.runtime.metrics.value("evocache_kv_reuse_rate") == 0.0


def test_the_routing_report_lists_only_the_blocks_l1_still_holds(tmp_path):
    server = make_server(tmp_path, l1_bytes=4 * BLOCK_BYTES, eviction="lru")
    try:
        a = request(server, prompt_ids(49, seed=7))  # 3 full blocks each
        b = request(server, prompt_ids(49, seed=8))
        server.complete(a)
        assert set(server.routing_stats()["blocks"]) == {h.hex() for h in a.blocks}
        server.complete(b)  # 6 blocks through a 4-block L1: the 2 oldest of a's go
        evicted = [h for h in a.blocks if h not in server.kv.l1]
        assert evicted == list(a.blocks[:2]) and a.blocks[2] in server.kv.l1
        report = server.routing_stats()
        # a's last block is still held, but names a prefix whose leading blocks are gone: not listed either.
        assert set(report["blocks"]) == {h.hex() for h in b.blocks}
        assert {h.hex() for h in a.blocks} <= set(server.ledger.stats(0)["blocks"])  # served, but gone
        # A router reading the report sends a's prefix elsewhere, b's here.
        index = AffinityIndex()
        index.reported("kv-replica", parse_report(report).blocks)
        assert index.holders(a.blocks, ["kv-replica"]) == (0, [])
        assert index.holders(b.blocks, ["kv-replica"]) == (3, ["kv-replica"])
    finally:
        server.close()


# -- L2/L3 payload transfers -------------------------------------------------------------------------------


def _round_trip(dtype: str, device: str) -> bytes:
    import torch

    geometry = BlockGeometry(layers=3, kv_heads=2, head_dim=8, block_size=4, dtype=dtype)
    torch.manual_seed(0)
    full = torch.randn(2, 6, 8, dtype=getattr(torch, dtype), device=device)
    # Keys and values as the cache stores them: slices of a longer sequence, cloned.
    layers = [(full[:, i : i + 4, :].clone(), (full[:, i : i + 4, :] * 2).clone()) for i in range(3)]
    data = encode_group(layers, geometry, 0)
    back = decode_group(data, geometry, 0, 3, device)
    assert len(back) == 3
    for (k, v), (k2, v2) in zip(layers, back, strict=True):
        assert k2.device.type == torch.device(device).type and k2.dtype == k.dtype and k2.shape == k.shape
        assert torch.equal(k.cpu(), k2.cpu()) and torch.equal(v.cpu(), v2.cpu())
    return data


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_a_payload_round_trips_on_the_cpu(dtype):
    _round_trip(dtype, "cpu")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_payload_round_trips_through_pinned_buffers_on_cuda_and_matches_the_cpu_bytes(dtype):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    # The same tensors give the same payload on either device, so replicas on CPU and GPU share L2/L3.
    assert _round_trip(dtype, "cuda") == _round_trip(dtype, "cpu")


def test_access_event_records_without_the_kv_field_still_read():
    record = (1.0, "k", "ns", "r", "p@1", "miss", None, 0, 0.1, 0.0, "fn", "", None)  # the request path's
    event = AccessEvent._make(record)
    assert event.kv is None and tuple(event)[:13] == record
    assert AccessEvent._make((*record, "c-1", "", 0, 0.0, 0.0, {"recomputed": 3})).kv == {"recomputed": 3}
    with pytest.raises(TypeError, match=rf"{len(AccessEvent._fields)} fields, got 5"):
        AccessEvent._make(record[:5])
