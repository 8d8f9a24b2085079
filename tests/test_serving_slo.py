"""A tenant's SLO breaker of a rule on a serving replica: users' verdicts that semantic answers were wrong
trip that tenant's calls of the rule to its safe mode (semantic off: exact caching goes on, and every response
says why), and after the cool-down, probes that hold close it again. Another tenant, asking over HTTP with the
official ``openai`` client, is served and labelled exactly as before: one tenant cannot switch off another's
semantic cache. The replica's runtime runs on a clock the test moves."""

from __future__ import annotations

from pathlib import Path

import openai
from _helpers import FakeClock
from _serving_fixtures import KEYS, UvicornThread, echo_model, write_keys

from evocache.controller import EventsConfig, PolicyStoreConfig, StoreConfig, build_runtime, open_policy_store
from evocache.serving import (
    Api,
    FileKeyStore,
    LocalBackend,
    ModelConfig,
    ModelServer,
    ServerSpec,
    build_fastapi,
    parse_request,
)
from evocache.serving._model import ByteTokenizer, CallableGenerator

POLICY = """
policy: slo-test
version: 1
fields: {endpoint: str}
rules:
  - name: faq
    when: endpoint == "chat"
    semantic: {max_error: 0.05, mode: static, threshold: 0.8}
    slo: {max_error_rate: 0.5, min_samples: 3, window: 1m, cool_down: 30s, probe: 1}
"""
QUESTIONS = ["How do I reset my password?", "How can I reset my password?", "How do I reset the password?",
             "How can I reset the password?", "How would I reset my password?"]


def test_wrong_answers_trip_the_rule_and_probes_that_hold_close_it(tmp_path: Path):
    clock = FakeClock()
    store_config = PolicyStoreConfig(directory=str(tmp_path / "policies"), poll_interval_s=0.1)
    store = open_policy_store(store_config)
    store.apply(POLICY)
    spec = ServerSpec(model=ModelConfig(kind="callable", id="echo", callable="_serving_fixtures:echo_model"),
                      store=StoreConfig(events=EventsConfig(sink="ring")), policy_store=store_config)
    server = ModelServer(spec, "replica-slo", generator=CallableGenerator(echo_model, "echo_model"),
                         tokenizer=ByteTokenizer(), runtime=build_runtime(spec.store, clock=clock))
    api = Api(model_id="echo", model_revision="", tokenizer=ByteTokenizer(), backend=LocalBackend([server]),
              keys=FileKeyStore.load(write_keys(tmp_path / "keys.yaml")))
    tenant, tier = KEYS[next(iter(KEYS))]

    def request(question):  # what the ingress hands the replica for this chat request
        body = ('{"model": "echo", "temperature": 0, "messages": [{"role": "user", "content": "%s"}]}'
                % question).encode()
        return api.to_generate(parse_request(body, "chat"), tenant, tier, "chat")

    try:
        server.complete(request(QUESTIONS[0]))
        served = [server.complete(request(q)) for q in QUESTIONS[1:4]]
        assert all(s.decision.outcome == "hit" and s.decision.reason == "semantic" for s in served)
        for q in QUESTIONS[1:4]:  # the users say those answers were wrong
            assert server.feedback(request(q), correct=False) is True
        assert server.rollouts.active.slo.states(tenant) == {"faq": "open"}

        tripped = server.complete(request(QUESTIONS[4]))
        assert (tripped.decision.outcome, tripped.decision.reason) == ("miss", "slo-breaker")
        again = server.complete(request(QUESTIONS[4]))
        assert again.decision.outcome == "hit" and again.decision.reason == "slo-breaker"  # exact caching goes on

        clock.now += 31  # the cool-down is over: the rule is half-open and probes run normally
        probes = ["How do I reset a password?", "How can I reset a password?", "How could I reset my password?"]
        for q in probes:
            probe = server.complete(request(q))
            assert probe.decision.reason == "semantic"
            assert server.feedback(request(q), correct=True) is True
        assert server.rollouts.active.slo.states(tenant) == {"faq": "closed"}
        events = [(e.outcome, e.ns, e.reason) for e in server.runtime.events.events()
                  if e.outcome.startswith("slo-")]
        assert events == [("slo-open", tenant, "error-rate"), ("slo-half-open", tenant, "cool-down"),
                          ("slo-closed", tenant, "probes-held")]
        text = server.metrics().decode()
        labels = 'policy="slo-test@1",rule="faq",scope="tenant",state="open"'
        assert f"evocache_slo_transitions_total{{{labels}}} 1.0" in text
        assert f'evocache_slo_state{{ns="{tenant}",policy="slo-test@1",rule="faq"}} 0.0' in text
    finally:
        server.close()
        store.close()


LOOK_ALIKES = ["How do I reset a password?", "How can I reset a password?", "How could I reset my password?",
               "How would I reset the password?", "How should I reset my password?"]


def test_a_tenant_cannot_lower_another_tenants_semantic_hits_over_http(tmp_path: Path):
    """Tenant B asks look-alike questions over HTTP and says every semantic answer was wrong, until its
    breaker opens. Tenant A, asking the same look-alikes over HTTP, is served and labelled the same whether B
    did that or not."""
    tenant_a, tenant_b = KEYS
    (a_id, _), (b_id, b_tier) = KEYS[tenant_a], KEYS[tenant_b]

    def run(b_trips: bool) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
        """A's headers for the look-alikes, and B's for one look-alike after its verdicts."""
        root = tmp_path / ("tripped" if b_trips else "quiet")
        store_config = PolicyStoreConfig(directory=str(root / "policies"), poll_interval_s=0.1)
        store = open_policy_store(store_config)
        store.apply(POLICY)
        model = ModelConfig(kind="callable", id="echo", callable="_serving_fixtures:echo_model")
        spec = ServerSpec(model=model, store=StoreConfig(events=EventsConfig(sink="ring")),
                          policy_store=store_config)
        server = ModelServer(spec, "replica-tenants", generator=CallableGenerator(echo_model, "echo_model"),
                             tokenizer=ByteTokenizer(), runtime=build_runtime(spec.store, clock=FakeClock()))
        api = Api(model_id="echo", model_revision="", tokenizer=ByteTokenizer(),
                  backend=LocalBackend([server]), keys=FileKeyStore.load(write_keys(root / "keys.yaml")))
        try:
            with UvicornThread(build_fastapi(api)) as running:
                def ask(key: str, question: str) -> dict[str, str]:
                    client = openai.OpenAI(base_url=f"{running.url}/v1", api_key=key, max_retries=0)
                    raw = client.chat.completions.with_raw_response.create(
                        model="echo", temperature=0, messages=[{"role": "user", "content": question}])
                    raw.parse()
                    return {k: v for k, v in raw.headers.items() if k.startswith("x-evocache-")}

                def verdict(question: str) -> bool:  # B's user says the answer was wrong
                    message = '{"role": "user", "content": "%s"}' % question
                    body = ('{"model": "echo", "temperature": 0, "messages": [%s]}' % message).encode()
                    request = api.to_generate(parse_request(body, "chat"), b_id, b_tier, "chat")
                    return server.feedback(request, correct=False)

                ask(tenant_a, QUESTIONS[0])
                ask(tenant_b, QUESTIONS[0])
                if b_trips:
                    for question in QUESTIONS[1:4]:
                        assert ask(tenant_b, question)["x-evocache-reason"] == "semantic"
                        assert verdict(question) is True
                    assert server.rollouts.active.slo.states(b_id) == {"faq": "open"}
                a_seen = [ask(tenant_a, q) for q in LOOK_ALIKES]
                b_seen = [ask(tenant_b, LOOK_ALIKES[0])]
                assert server.rollouts.active.slo.states(a_id) == {"faq": "closed"}
                assert server.rollouts.active.slo.states() == {"faq": "closed"}  # not rule-wide
                if b_trips:
                    slo = [(e.outcome, e.ns, e.reason) for e in server.runtime.events.events()
                           if e.outcome.startswith("slo-")]
                    assert slo == [("slo-open", b_id, "error-rate")]
                return a_seen, b_seen
        finally:
            server.close()
            store.close()

    a_quiet, b_quiet = run(b_trips=False)
    a_tripped, b_tripped = run(b_trips=True)
    assert a_tripped == a_quiet  # every header A sees, whether B tripped its breaker or not
    assert [h["x-evocache-outcome"] for h in a_tripped] == ["hit"] * len(LOOK_ALIKES)
    assert {h.get("x-evocache-reason") for h in a_tripped} == {"semantic"}
    assert b_quiet[0]["x-evocache-reason"] == "semantic"
    assert (b_tripped[0]["x-evocache-outcome"], b_tripped[0]["x-evocache-reason"]) == ("miss", "slo-breaker")
