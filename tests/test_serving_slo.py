"""A rule's SLO breaker on a serving replica: users' verdicts that semantic answers were wrong trip the rule to
its safe mode (semantic off: exact caching goes on, and every response says why), and after the cool-down,
probes that hold close it again. The replica's runtime runs on a clock the test moves."""

from __future__ import annotations

from pathlib import Path

from _helpers import FakeClock
from _serving_fixtures import KEYS, echo_model, write_keys

from evocache.controller import EventsConfig, PolicyStoreConfig, StoreConfig, build_runtime, open_policy_store
from evocache.serving import Api, FileKeyStore, LocalBackend, ModelConfig, ModelServer, ServerSpec, parse_request
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
        assert server.rollouts.active.slo.states() == {"faq": "open"}

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
        assert server.rollouts.active.slo.states() == {"faq": "closed"}
        events = [(e.outcome, e.reason) for e in server.runtime.events.events() if e.outcome.startswith("slo-")]
        assert events == [("slo-open", "error-rate"), ("slo-half-open", "cool-down"), ("slo-closed", "probes-held")]
        text = server.metrics().decode()
        assert 'evocache_slo_transitions_total{policy="slo-test@1",rule="faq",state="open"} 1.0' in text
    finally:
        server.close()
        store.close()
