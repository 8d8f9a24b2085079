"""KV chunk reuse (``kv: {reuse: chunks}``) on the example tiny Llama (real transformers code, random weights,
fp32, CPU): a chunk computed after one preamble is reused after another of a different length with its keys
moved by RoPE; layer 0 (which sees no other token) is exact, the whole agrees with a full recompute better as
more of the chunk is recomputed and exactly when all of it is; a RoPE that cannot be shifted falls back to
prefix reuse; tenants never share chunks; ``reuse: prefix`` never uses them; the ingress finds message offsets.

``pytest -s tests/test_kv_chunks.py -k agreement`` prints the agreement table (KL of the next-token
distribution and greedy tokens against a full recompute, per recompute setting)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from transformers import DynamicCache  # noqa: E402

from evocache.controller import (  # noqa: E402
    CallId,
    CallOutcome,
    DiskConfig,
    EventsConfig,
    RedisConfig,
    StoreConfig,
    build_runtime,
    namespace_for,
    tenant_scope,
)
from evocache.dsl import parse_policy  # noqa: E402
from evocache.serving import GenerationParams, ModelConfig, ModelServer, ServerSpec, load_tokenizer  # noqa: E402
from evocache.serving._ingress import chat_chunks  # noqa: E402
from evocache.serving._model import HFGenerator  # noqa: E402
from evocache.serving._request import GenerateRequest  # noqa: E402
from evocache.serving.kv import KvConfig, KvPlan, KvPrefixCache, KvUsage  # noqa: E402
from evocache.serving.kv._chunks import chunk_spans, refresh_positions  # noqa: E402
from evocache.serving.kv._store import BlockGeometry  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny-llama"
GREEDY = GenerationParams(max_tokens=12, temperature=0.0, top_p=1.0, seed=None, stop=())
TOLERANCE = 1e-5
BS = 8
SECRET = "kv-chunk-test-secret-0123456789abcdef"


def ids(n: int, seed: int) -> list[int]:
    return [1000 + (seed * 7919 + i * 104729) % 20000 for i in range(n)]


# Preamble A (13 tokens) or B (29), the same 40-token chunk C (5 blocks), then a question Q.
A, B, C, Q = ids(13, 1), ids(29, 2), ids(40, 3), ids(5, 4)
FIRST, SECOND = A + C + Q, B + C + Q
FIRST_CHUNKS, SECOND_CHUNKS = (0, len(A), len(A) + len(C)), (0, len(B), len(B) + len(C))


@pytest.fixture(scope="module")
def generator():
    return HFGenerator(ModelConfig(kind="hf", id="tiny-llama", path=str(EXAMPLE)), load_tokenizer("minilm"))


def attach(generator, lower=None):
    kv = KvPrefixCache(KvConfig(), BlockGeometry.of_model(generator.model, BS),
                       extras=("tiny-llama", "", "float32", ""), device="cpu", lower=lower)
    generator.attach_kv(kv)
    return kv


def plan(chunks, k=0, fraction=0.0, tenant="acme", mode="chunks", tiers=("l1", "l2", "l3")):
    return KvPlan(salt=str(namespace_for(tenant)), tiers=tiers, mode=mode, recompute_tokens=k,
                  recompute_fraction=fraction, chunks=chunks)


def prefill(generator, prompt, kv_plan=None, usage=None):
    with torch.no_grad():
        return generator._prefill(list(prompt), kv_plan, usage)


def full(generator, prompt):
    """The prompt computed whole, with no KV cache: (cache, last logits)."""
    kv, generator.kv = generator.kv, None
    try:
        cache, logits = prefill(generator, prompt)
    finally:
        generator.kv = kv
    return cache, logits[0, -1]


def tokens(generator, prompt, kv_plan=None):
    return list(generator.stream("", prompt, GREEDY, kv_plan, KvUsage() if kv_plan else None))


def kl(p_logits, q_logits) -> float:
    """KL(p || q) of the next-token distributions."""
    p, q = p_logits.double().log_softmax(-1), q_logits.double().log_softmax(-1)
    return float((p.exp() * (p - q)).sum())


def reuse(generator, k=0, fraction=0.0):
    """C computed after A, then reused after B: (cache, last logits, usage) of the second prompt."""
    attach(generator)
    prefill(generator, FIRST, plan(FIRST_CHUNKS, k, fraction), KvUsage())
    usage = KvUsage()
    cache, logits = prefill(generator, SECOND, plan(SECOND_CHUNKS, k, fraction), usage)
    return cache, logits[0, -1], usage


@pytest.mark.parametrize("k", [0, 16])
def test_a_chunk_moved_after_another_preamble_has_the_layer_0_keys_computed_there(generator, k):
    cache, _, usage = reuse(generator, k)
    assert usage.reused == {"l1": 0, "chunk": len(C) - k}  # B is new: no exact prefix
    assert usage.recomputed == len(SECOND) - (len(C) - k) and usage.chunk_fallback == ""
    # The chunk computed alone at its new position: layer 0 keys and values depend on token and position only.
    fresh = DynamicCache(config=generator.model.config)
    with torch.no_grad():
        generator.engine.forward(C, fresh, positions=len(B) + torch.arange(len(C)))
    where = slice(len(B), len(B) + len(C))
    moved, there = cache.layers[0], fresh.layers[0]
    assert (moved.keys[:, :, where] - there.keys).abs().max() <= TOLERANCE
    assert (moved.values[:, :, where] - there.values).abs().max() <= TOLERANCE
    # Unmoved, the stored keys differ: the shift is doing the work.
    stored = generator.kv.lookup_chunk(plan(SECOND_CHUNKS), C, 5)
    assert stored[0].position == len(A)
    assert (stored[0].layers[0][0] - there.keys[0, :, :BS]).abs().max() > 1e-3


def test_agreement_with_a_full_recompute_holds_or_improves_with_k_and_is_exact_for_the_whole_chunk(generator):
    _, expected = full(generator, SECOND)
    generator.attach_kv(None)
    expected_tokens = tokens(generator, SECOND)
    rows = []
    for k, fraction in [(0, 0.0), (4, 0.0), (8, 0.0), (16, 0.0), (len(C), 0.0), (0, 0.5), (0, 1.0)]:
        _, logits, usage = reuse(generator, k, fraction)
        attach(generator)
        prefill(generator, FIRST, plan(FIRST_CHUNKS, k, fraction), KvUsage())
        got = tokens(generator, SECOND, plan(SECOND_CHUNKS, k, fraction))
        agree = next((i for i, (a, b) in enumerate(zip(got, expected_tokens, strict=False)) if a != b), len(got))
        rows.append((k, fraction, usage.reused["chunk"], kl(expected, logits),
                     float((logits - expected).abs().max()), agree))
    print("\nk  fraction  chunk-tokens  KL(full||reuse)  max|dlogit|  greedy tokens agreeing (of 12)")
    for k, fraction, reused, divergence, dlogit, agree in rows:
        print(f"{k:<3}{fraction:<10}{reused:<14}{divergence:<17.3e}{dlogit:<13.3e}{agree}")
    by_k = [r for r in rows if r[1] == 0.0]
    assert by_k[0][2] == len(C) and by_k[0][3] > 1e-7  # k = 0 reuses all of C and is approximate
    for (_, _, _, before, _, agree_before), (_, _, _, after, _, agree_after) in zip(by_k, by_k[1:]):
        assert after <= before * 1.05 + 1e-9 and agree_after >= agree_before
    whole, half, every = by_k[-1], rows[-2], rows[-1]
    assert whole[2] == 0 and whole[4] <= 1e-4 and whole[5] == 12  # k >= the chunk: a full recompute
    assert every[2] == 0 and every[4] <= 1e-4 and every[5] == 12  # every token refreshed: exact as well
    assert half[2] == len(C) // 2 and half[3] <= by_k[0][3]


def test_a_rope_that_cannot_be_shifted_falls_back_to_prefix_reuse_without_error(tmp_path, caplog):
    config = json.loads((EXAMPLE / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    ntk = HFGenerator(ModelConfig(kind="hf", id="tiny-ntk", path=str(tmp_path)), load_tokenizer("minilm"))
    expected = tokens(ntk, SECOND)
    kv = attach(ntk)
    with caplog.at_level(logging.INFO, logger="evocache.serving.kv"):
        assert tokens(ntk, FIRST, plan(FIRST_CHUNKS)) == tokens(ntk, FIRST)
        usage = KvUsage()
        assert list(ntk.stream("", SECOND, GREEDY, plan(SECOND_CHUNKS), usage)) == expected
    assert usage.chunk_fallback == "rope-unsupported" and "chunk" not in usage.reused
    assert kv.chunk_fallbacks == 2
    assert any("dynamic" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    again = KvUsage()  # prefix reuse still works: the whole of SECOND was kept
    assert list(ntk.stream("", SECOND, GREEDY, plan(SECOND_CHUNKS), again)) == expected
    assert again.reused["l1"] == (len(SECOND) - 1) // BS * BS


def test_a_sliding_window_model_falls_back_to_prefix_reuse(tmp_path):
    config = {key: value for key, value in json.loads((EXAMPLE / "config.json").read_text()).items()
              if key not in ("architectures", "model_type")}
    config |= {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 4096}
    (tmp_path / "config.json").write_text(json.dumps(config))
    windowed = HFGenerator(ModelConfig(kind="hf", id="tiny-mistral", path=str(tmp_path)),
                           load_tokenizer("minilm"))
    expected = tokens(windowed, SECOND)
    kv = attach(windowed)
    tokens(windowed, FIRST, plan(FIRST_CHUNKS))
    usage = KvUsage()
    assert list(windowed.stream("", SECOND, GREEDY, plan(SECOND_CHUNKS), usage)) == expected
    assert usage.chunk_fallback == "sliding-window" and "chunk" not in usage.reused and kv.chunk_fallbacks == 2


def test_tenants_never_share_chunks_and_chunk_hashes_are_not_prefix_hashes(generator):
    kv = attach(generator)
    salt = str(namespace_for("acme"))
    assert set(kv.hasher.chunk(C, salt)).isdisjoint(kv.hasher.prefix(C, salt))
    assert set(kv.hasher.chunk(C, salt)).isdisjoint(kv.hasher.chunk(C, str(namespace_for("globex"))))
    prefill(generator, FIRST, plan(FIRST_CHUNKS, tenant="acme"), KvUsage())
    other = KvUsage()
    prefill(generator, SECOND, plan(SECOND_CHUNKS, tenant="globex"), other)
    assert other.reused.get("chunk") == 0
    same = KvUsage()
    prefill(generator, SECOND, plan(SECOND_CHUNKS, tenant="acme"), same)
    assert same.reused["chunk"] == len(C)


def test_reuse_prefix_never_uses_or_stores_chunks_and_stays_exact(generator):
    kv = attach(generator)
    for prompt, chunks in ((FIRST, FIRST_CHUNKS), (SECOND, SECOND_CHUNKS)):
        prefill(generator, prompt, plan(chunks, mode="prefix"), KvUsage())
    assert not any(kv.l1.get(h) for h in kv.hasher.chunk(C, str(namespace_for("acme"))))
    usage = KvUsage()
    assert tokens(generator, SECOND, plan(SECOND_CHUNKS, mode="prefix")) == tokens(generator, SECOND)
    prefill(generator, SECOND, plan(SECOND_CHUNKS, mode="prefix"), usage)
    assert "chunk" not in usage.reused and usage.reused["l1"] == (len(SECOND) - 1) // BS * BS


def test_no_prefix_block_is_stored_after_a_reused_chunk(generator):
    kv = attach(generator)
    prefill(generator, FIRST, plan(FIRST_CHUNKS), KvUsage())
    usage = KvUsage()
    prefill(generator, SECOND, plan(SECOND_CHUNKS), usage)
    assert usage.reused["chunk"] == len(C)
    held = [h for h in kv.hasher.prefix(SECOND, str(namespace_for("acme"))) if h in kv.l1]
    assert len(held) == len(B) // BS  # the blocks before C only: the rest attended to moved keys
    exact = KvUsage()
    got = list(generator.stream("", SECOND, GREEDY, plan(SECOND_CHUNKS, mode="prefix"), exact))
    assert exact.reused["l1"] == len(B) // BS * BS
    assert got == tokens(generator, SECOND)  # prefix reuse after a chunk-mode request is still exact
    whole = attach(generator)  # a chunk recomputed whole is exact: every prefix block is kept
    prefill(generator, FIRST, plan(FIRST_CHUNKS), KvUsage())
    prefill(generator, SECOND, plan(SECOND_CHUNKS, k=len(C)), KvUsage())
    assert all(h in whole.l1 for h in whole.hasher.prefix(SECOND, str(namespace_for("acme"))))


def test_a_chunk_comes_back_from_l3_with_its_position(generator, tmp_path):
    runtime = build_runtime(StoreConfig(disk=DiskConfig(path=str(tmp_path / "l3"))))
    lower = {"l3": runtime.store.tiers["l3"]}
    warm = attach(generator, lower)
    prefill(generator, FIRST, plan(FIRST_CHUNKS, tiers=("l3",)), KvUsage())
    warm.flush_writes()  # chunk blocks are written on the writer thread, as prefix blocks are
    _, warm_logits, _ = reuse(generator)  # the same request from L1
    attach(generator, lower)  # a cold replica: the chunk is on disk only
    usage = KvUsage()
    _, logits = prefill(generator, SECOND, plan(SECOND_CHUNKS, tiers=("l3",)), usage)
    assert usage.reused["chunk"] == len(C)
    assert (logits[0, -1] - warm_logits).abs().max() <= TOLERANCE
    runtime.close()


@pytest.mark.redis
def test_a_chunk_comes_back_from_l2_in_layer_groups_and_a_forged_position_is_refused(generator, redis_url):
    runtime = build_runtime(StoreConfig(redis=RedisConfig(url=redis_url, secret=SECRET)))
    lower = {"l2": runtime.store.tiers["l2"]}
    _, warm_logits, _ = reuse(generator)
    kv = KvPrefixCache(KvConfig(layer_group=1), BlockGeometry.of_model(generator.model, BS),
                       extras=("tiny-llama", "", "float32", ""), device="cpu", lower=lower)
    generator.attach_kv(kv)
    prefill(generator, FIRST, plan(FIRST_CHUNKS, tiers=("l2",)), KvUsage())
    kv.flush_writes()
    for _ in range(2):  # a cold replica each time: the chunk is in Redis only, one payload per layer
        cold = KvPrefixCache(KvConfig(layer_group=1), kv.geometry, extras=kv.hasher.extras, device="cpu",
                             lower=lower)
        generator.attach_kv(cold)
        usage = KvUsage()
        _, logits = prefill(generator, SECOND, plan(SECOND_CHUNKS, tiers=("l1", "l2")), usage)
        assert usage.reused["chunk"] == len(C) and len(cold.l1) >= 5
        assert (logits[0, -1] - warm_logits).abs().max() <= TOLERANCE
    # Layer groups of one block that disagree on its position are a corrupt block: dropped, never used.
    salt = str(namespace_for("acme"))
    first = kv.hasher.chunk(C, salt)[0]
    tier = lower["l2"]
    (entry,) = tier.get_many(salt, [kv.hasher.tier_key(first, (1, 2))])
    forged = bytearray(entry.value)
    forged[5:13] = (len(A) + 1).to_bytes(8, "little")
    tier.set_many(salt, [(kv.hasher.tier_key(first, (1, 2)), entry._replace(value=bytes(forged)))])
    cold = KvPrefixCache(KvConfig(layer_group=1), kv.geometry, extras=kv.hasher.extras, device="cpu",
                         lower=lower)
    generator.attach_kv(cold)
    usage = KvUsage()
    prefill(generator, SECOND, plan(SECOND_CHUNKS, tiers=("l1", "l2")), usage)
    assert usage.reused["chunk"] == 0 and cold.lower.corrupt == 1
    runtime.close()


def test_chunk_spans_and_refresh_positions():
    assert chunk_spans(74, (0, 29, 69), 0) == [(0, 29), (29, 69), (69, 74)]
    assert chunk_spans(74, (0, 29, 69), 24) == [(24, 29), (29, 69), (69, 74)]
    assert chunk_spans(74, (), 32) == [(32, 74)]  # a plain prompt: the rest after its prefix
    assert chunk_spans(74, (50, 10, 900, -3), 0) == [(0, 10), (10, 50), (50, 74)]
    assert refresh_positions(10, 20, 0.0) == [] and refresh_positions(10, 20, 1.0) == list(range(10, 20))
    assert refresh_positions(10, 20, 0.2) == [12, 17]


def test_the_server_plans_chunks_only_for_a_chunks_rule(generator):
    spec = ServerSpec(model=ModelConfig(kind="hf", id="tiny-llama", path=str(EXAMPLE), tokenizer="minilm"),
                      store=StoreConfig(events=EventsConfig(sink="ring")))
    server = ModelServer(spec, "kv-chunks")
    head = "policy: p\nversion: 1\n"
    request = GenerateRequest("r", "chat", "tiny-llama", "", tuple(SECOND), (), "acme", "free", 4, 0.0, 1.0,
                              None, (), chunks=SECOND_CHUNKS)
    chunks = parse_policy(head + "defaults: {kv: {reuse: chunks, recompute_fraction: 0.25}}\n")
    got = server._kv_plan(_decided(server, request, chunks), len(request.input_ids), request.chunks)
    assert (got.mode, got.recompute_tokens, got.recompute_fraction, got.chunks) == ("chunks", 16, 0.25,
                                                                                     SECOND_CHUNKS)
    prefix = parse_policy(head + "defaults: {kv: {reuse: prefix}}\n")
    assert server._kv_plan(_decided(server, request, prefix), len(request.input_ids), request.chunks).mode \
        == "prefix"
    server.close()


def _decided(server: ModelServer, request: GenerateRequest, policy) -> CallOutcome:
    """The outcome the cache decides for ``request`` under ``policy`` (its plan, as a call would make it)."""
    rt = server.runtime.with_rules(policy)
    with tenant_scope(request.tenant, request.tenant_tier):
        plan = server.answer.cached_function.contract.plan(rt, (), server._kwargs(request))
    return CallOutcome(CallId("c-1"), "miss", plan.rule, rt.policy_ref, "", plan.key, plan.ns, plan.decision)


class _Glued:
    """The WordPiece tokenizer under a template that glues messages together (no separator): a message
    boundary then falls inside a word, so no exact token offset exists."""

    def __init__(self):
        self._tok = load_tokenizer("minilm")
        self.eos_id = self._tok.eos_id

    def encode(self, text):
        return self._tok.encode(text)

    def decode(self, token_ids):
        return self._tok.decode(token_ids)

    def render_chat(self, messages):
        return "".join(content for _, content in messages)


@pytest.mark.parametrize("name", ["bytes", "minilm"])
def test_the_ingress_finds_where_each_message_starts(name):
    tokenizer = load_tokenizer(name)
    messages = [("system", "You are terse."), ("user", "Tell me about caches."), ("assistant", "A cache keeps."),
                ("user", "More?")]
    prompt = tokenizer.render_chat(messages)
    input_ids = tokenizer.encode(prompt)
    offsets = chat_chunks(tokenizer, messages, prompt, input_ids)
    assert len(offsets) == 4 and offsets[0] == 0
    spans = [tokenizer.decode(input_ids[a:b]) for a, b in zip(offsets, [*offsets[1:], len(input_ids)],
                                                               strict=True)]
    for (_, content), span in zip(messages, spans, strict=True):
        assert content.lower() in span.lower()
    assert chat_chunks(tokenizer, messages[:1], tokenizer.render_chat(messages[:1]), input_ids) == ()
    glued = _Glued()
    parts = [("user", "cach"), ("user", "ing")]
    text = glued.render_chat(parts)
    assert chat_chunks(glued, parts, text, glued.encode(text)) == ()


def test_a_chat_request_carries_its_message_offsets_and_a_completion_none():
    from evocache.serving._ingress import Api
    from evocache.serving._protocol import parse_request

    tokenizer = load_tokenizer("bytes")
    api = Api(model_id="m", model_revision="", tokenizer=tokenizer, backend=None, keys=None)
    body = json.dumps({"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": "Hi"}]}).encode()
    chat = api.to_generate(parse_request(body, "chat"), "acme", "free", "chat")
    assert chat.chunks == (0, len("system: Be brief.\n"))
    plain = api.to_generate(parse_request(b'{"model": "m", "prompt": "Be brief. Hi"}', "completion"), "acme",
                            "free", "completions")
    assert plain.chunks == ()
