"""What the cache saved, in an engine's tokens and in money: an engine reports what an answer took
(``CallHandle.report_usage``), the entry keeps it through every tier, each hit's outcome and access event say
it; a miss says what the engine's own prefix cache reused. Over HTTP, a price per model turns tokens into money
in the events and in ``evocache_tokens_saved_total`` / ``evocache_saved_cost_total`` by rule and tenant."""

from __future__ import annotations

import httpx
import pytest
from _fake_upstream import FakeUpstream
from _serving_fixtures import KEYS, UvicornThread, write_keys

from evocache.controller import (
    CallHandle,
    DiskConfig,
    Entry,
    EventsConfig,
    StoreConfig,
    build_runtime,
    cache_if,
)
from evocache.controller._codec import EntryCodec
from evocache.serving import (
    Api,
    FileKeyStore,
    LocalBackend,
    ModelConfig,
    ModelServer,
    ServerSpec,
    UpstreamConfig,
    build_fastapi,
)
from evocache.serving._prices import Price

ACME = next(iter(KEYS))


def test_a_hit_says_what_its_answer_cost_in_every_tier(tmp_path):
    rt = build_runtime(StoreConfig(disk=DiskConfig(path=str(tmp_path / "l3")), events=EventsConfig(sink="ring")))

    @cache_if("true", store=rt, call_param="call")
    def answer(prompt: str, *, call: CallHandle) -> str:
        call.report_usage(tokens=120, cost=0.003, saved_tokens=32, saved_cost=0.0004)
        return prompt.upper()

    miss = answer.call("hello").outcome
    assert (miss.saved_tokens, miss.saved_cost) == (32, 0.0004)  # what the engine's own cache reused
    hit = answer.call("hello").outcome
    assert (hit.outcome, hit.saved_tokens, hit.saved_cost) == ("hit", 120, 0.003)
    answer("hello")  # the L1 hit path records the same
    rt.l1.delete(miss.ns, [miss.key])
    from_disk = answer.call("hello").outcome
    assert (from_disk.tier, from_disk.saved_tokens, from_disk.saved_cost) == ("l3", 120, 0.003)
    rt.flush()
    events = [(e.outcome, e.saved_tokens, e.saved_cost, e.cost) for e in rt.events.events()]
    assert events == [("miss", 32, 0.0004, 0.003), ("hit", 120, 0.003, 0.003), ("hit", 120, 0.003, 0.003),
                      ("hit", 120, 0.003, 0.003)]
    rt.close()
    with pytest.raises(ValueError, match="non-negative finite"):
        CallHandle().report_usage(tokens=-1, cost=0.0)


def test_the_codec_keeps_the_figures_and_signs_them():
    codec = EntryCodec(b"s" * 32)
    entry = Entry(b"payload", None, 1.0, "rule", 5.0, None, 77, 0.25)
    assert codec.decode("ns", "ab" * 8, codec.encode("ns", "ab" * 8, entry), tier="l2") == entry


@pytest.fixture
def gateway(tmp_path):
    fake = FakeUpstream("up-model")
    with UvicornThread(fake.app) as up:
        model = ModelConfig(kind="upstream", id="up-model", upstream=UpstreamConfig(url=f"{up.url}/v1"))
        spec = ServerSpec(model=model, store=StoreConfig(events=EventsConfig(sink="ring")), block_size=4,
                          prices={"up-model": Price(input=2.0, cached_input=0.5, output=8.0)})
        server = ModelServer(spec, "replica-a")
        api = Api(model_id="up-model", model_revision="", tokenizer=server.tokenizer, backend=LocalBackend([server]),
                  keys=FileKeyStore.load(write_keys(tmp_path / "keys.yaml")), block_size=4,
                  upstream_fields=frozenset())
        with UvicornThread(build_fastapi(api)) as http:
            yield http, server
        server.close()


def test_the_money_saved_over_http_by_rule_and_tenant(gateway):
    http, server = gateway
    for _ in range(3):
        r = httpx.post(f"{http.url}/v1/chat/completions", headers={"Authorization": f"Bearer {ACME}"}, timeout=30,
                       json={"model": "up-model", "messages": [{"role": "user", "content": "one two three"}],
                             "temperature": 0, "max_tokens": 8})
        assert r.status_code == 200
    server.runtime.flush()
    events = [(e.outcome, e.saved_tokens, round(e.saved_cost, 9)) for e in server.runtime.events.events()]
    # The stand-in upstream reports 7 prompt tokens (3 cached) and 3 completion tokens: a miss saves the 3
    # reused tokens at 2.0 - 0.5 per million; each hit the whole answer, 7 x 2.0 + 3 x 8.0 per million.
    assert events == [("miss", 3, 4.5e-06), ("hit", 10, 3.8e-05), ("hit", 10, 3.8e-05)]
    sample = server.runtime.metrics.registry.get_sample_value
    labels = {"rule": server.runtime.events.events()[0].rule, "tenant": "acme"}
    assert sample("evocache_tokens_saved_total", labels) == 23
    assert sample("evocache_saved_cost_total", labels) == pytest.approx(4.5e-06 + 2 * 3.8e-05)


def test_the_loop_weighs_a_policy_by_the_money_its_misses_cost():
    from evocache.agents._evidence import arm_metrics
    from evocache.agents._types import Outcome, Request
    from evocache.agents.signals._events import _pair
    from evocache.controller import AccessEvent

    event = AccessEvent.from_dict({"v": 2, "t": 1.0, "key": "k1", "outcome": "miss", "size": 10, "cost": 0.004})
    request = _pair(event, 0).request
    assert request.cost == 0.004  # the answer's cost travels from the event into the replay
    unpriced = Request(2.0, "response", ("k2",))
    base = arm_metrics([request, unpriced], [Outcome(1, 0), Outcome(1, 0)])
    cand = arm_metrics([request, unpriced], [Outcome(1, 1), Outcome(1, 0)])
    assert base.model_cost == pytest.approx(0.002) and cand.model_cost == 0.0  # per request, of two
