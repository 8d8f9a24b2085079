"""evocache as LangChain's LLM cache (``evocache.controller.langchain``).

LangChain's own standard suites (``langchain_tests.integration_tests.cache``) run unmodified against it, sync
and async, on process memory and on a real Redis; the tests after them pin what those suites do not: tenants,
sampling, a Redis that is down, ``clear()``'s reach, access events, safe reading of stored answers, LangChain
models calling it, policies and semantic mode.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _helpers import free_port
from langchain_core.globals import set_llm_cache
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.language_models.fake import FakeListLLM
from langchain_core.load import dumps
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.outputs import ChatGeneration, ChatResult, Generation
from langchain_tests.integration_tests.cache import AsyncCacheTestSuite, SyncCacheTestSuite

from evocache.controller import (
    EventsConfig,
    RedisConfig,
    StoreConfig,
    TierUnavailable,
    build_runtime,
    read_events,
    tenant_scope,
)
from evocache.controller.langchain import EvocacheLLMCache, llm_params, load_generations, same_text
from evocache.dsl import load_policy

ANSWER = [Generation(text="Paris.", generation_info={"finish_reason": "stop"})]
GREEDY = "[('_type', 'fake'), ('model_name', 'm1'), ('stop', None), ('temperature', 0.0)]"


# --- LangChain's standard suites ------------------------------------------------------------------------------


@pytest.fixture
def memory_cache():
    cache = EvocacheLLMCache(StoreConfig(), namespace="standard")
    yield cache
    cache.runtime.close()


@pytest.fixture
def redis_cache(redis_url):
    cache = EvocacheLLMCache(StoreConfig(redis=RedisConfig(url=redis_url)), namespace="standard")
    yield cache
    cache.runtime.close()


class TestMemorySync(SyncCacheTestSuite):
    @pytest.fixture
    def cache(self, memory_cache):
        return memory_cache


@pytest.mark.anyio
class TestMemoryAsync(AsyncCacheTestSuite):
    @pytest.fixture
    def cache(self, memory_cache):
        return memory_cache


@pytest.mark.redis
class TestRedisSync(SyncCacheTestSuite):
    @pytest.fixture
    def cache(self, redis_cache):
        return redis_cache


@pytest.mark.redis
@pytest.mark.anyio
class TestRedisAsync(AsyncCacheTestSuite):
    @pytest.fixture
    def cache(self, redis_cache):
        return redis_cache


# --- what the suites do not cover -----------------------------------------------------------------------------


def test_importing_evocache_imports_no_langchain():
    code = (
        "import sys, evocache, evocache.dsl, evocache.controller, evocache.serving, evocache.agents, "
        "evocache.cli.app\n"
        "assert not [m for m in sys.modules if m.startswith('langchain')], sorted(sys.modules)\n"
        "import evocache.controller.langchain\n"
        "assert 'langchain_core.caches' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_generations_round_trip_exactly(memory_cache):
    message = AIMessage(
        content="It is sunny.", id="run-1", response_metadata={"model_name": "m1", "finish_reason": "stop"},
        tool_calls=[{"name": "weather", "args": {"city": "Paris"}, "id": "call-1"}],
        usage_metadata={"input_tokens": 3, "output_tokens": 4, "total_tokens": 7},
    )
    answer = [ChatGeneration(message=message, generation_info={"logprobs": None, "n": [1, 2.5]}),
              Generation(text="plain")]
    memory_cache.update("p", GREEDY, answer)
    found = memory_cache.lookup("p", GREEDY)
    assert found == answer
    assert [type(g) for g in found] == [ChatGeneration, Generation]
    assert found[0].message.tool_calls == message.tool_calls


def test_tenants_never_share(memory_cache):
    with tenant_scope("acme"):
        memory_cache.update("p", GREEDY, ANSWER)
        assert memory_cache.lookup("p", GREEDY) == ANSWER
    with tenant_scope("globex"):
        assert memory_cache.lookup("p", GREEDY) is None
        memory_cache.update("p", GREEDY, [Generation(text="Lyon.")])
    assert memory_cache.lookup("p", GREEDY) is None  # no tenant: a namespace of its own
    with tenant_scope("acme"):
        assert memory_cache.lookup("p", GREEDY) == ANSWER


async def _in_tenant(cache, tenant, prompt):
    with tenant_scope(tenant):
        return await cache.alookup(prompt, GREEDY)


@pytest.mark.anyio
async def test_async_calls_keep_the_callers_tenant(memory_cache):
    with tenant_scope("acme"):
        await memory_cache.aupdate("p", GREEDY, ANSWER)
    assert await _in_tenant(memory_cache, "acme", "p") == ANSWER
    assert await _in_tenant(memory_cache, "globex", "p") is None


SERIALISED_CHAT = json.dumps({"id": ["x", "Chat"], "kwargs": {"model_name": "m1", "temperature": 0.0},
                              "lc": 1, "type": "constructor"}, sort_keys=True)


@pytest.mark.parametrize(
    ("llm_string", "cached"),
    [
        ("[('_type', 'fake'), ('stop', None), ('temperature', 0.7)]", False),
        ("[('_type', 'fake'), ('seed', 7), ('stop', None), ('temperature', 0.7)]", True),
        ("[('_type', 'fake'), ('model_kwargs', {'temperature': 1.0}), ('stop', None)]", False),
        ("[('_type', 'fake'), ('stop', None)]", True),  # no temperature stated: greedy, as evocache reads it
        (SERIALISED_CHAT + "---[('stop', None)]", True),
        (SERIALISED_CHAT + "---[('stop', None), ('temperature', 0.9)]", False),  # run-time params win
        (SERIALISED_CHAT + "---[('callbacks', <object at 0x1>)]", False),  # unreadable: may sample
        ("[('_type', 'fake'), ('x', <object at 0x1>)]", False),
        ("Sample LLM string configuration.", True),  # neither form: no parameter stated
    ],
)
def test_a_sampled_llm_string_is_not_cached(memory_cache, llm_string, cached):
    memory_cache.update("p", llm_string, ANSWER)
    assert (memory_cache.lookup("p", llm_string) == ANSWER) is cached
    if not cached:
        (event,) = memory_cache.runtime.events.events()
        assert (event.outcome, event.reason) == ("bypass", "sampling")


def test_llm_params_reads_both_of_langchains_forms():
    assert llm_params(GREEDY) == {"_type": "fake", "model_name": "m1", "stop": None, "temperature": 0.0}
    assert llm_params(SERIALISED_CHAT + "---[('stop', ['---']), ('temperature', 0.5)]") == {
        "model_name": "m1", "temperature": 0.5, "stop": ["---"]}
    assert llm_params("free text") == {}
    assert llm_params("[('a', __import__('os'))]") is None
    assert llm_params("[(" + "1," * 100_000 + ")]") is None  # past the bound: not read


def test_a_redis_that_is_down_is_a_miss_not_an_error():
    cache = EvocacheLLMCache(StoreConfig(redis=RedisConfig(url=f"redis://127.0.0.1:{free_port()}/0")))
    try:
        assert cache.lookup("p", GREEDY) is None
        cache.update("p", GREEDY, ANSWER)  # nothing to store it under: no error either
        assert cache.lookup("p", GREEDY) is None
        with pytest.raises(TierUnavailable):
            cache.clear()  # a clear that could not be made is said, never assumed
    finally:
        cache.runtime.close()


@pytest.mark.redis
def test_a_redis_that_goes_down_is_a_miss_and_serves_again_once_back(restartable_redis):
    cache = EvocacheLLMCache(StoreConfig(redis=RedisConfig(url=restartable_redis.url, retry_after_s=0.0)))
    try:
        cache.update("p", GREEDY, ANSWER)
        restartable_redis.stop()
        assert cache.lookup("p", GREEDY) is None
        restartable_redis.start()  # empty: whether the namespace was cleared meanwhile is unknown, so a miss
        assert cache.lookup("p", GREEDY) is None
        cache.update("p", GREEDY, ANSWER)
        assert cache.lookup("p", GREEDY) == ANSWER
    finally:
        cache.runtime.close()


def test_clear_leaves_other_namespaces():
    rt = build_runtime(StoreConfig())
    try:
        chat, other = EvocacheLLMCache(rt, namespace="chat"), EvocacheLLMCache(rt, namespace="other")
        chat.update("p", GREEDY, ANSWER)
        other.update("p", GREEDY, ANSWER)
        with tenant_scope("acme"):
            chat.update("p", GREEDY, ANSWER)
        chat.clear()
        assert chat.lookup("p", GREEDY) is None
        with tenant_scope("acme"):
            assert chat.lookup("p", GREEDY) is None  # every tenant's entries of the namespace
        assert other.lookup("p", GREEDY) == ANSWER
        chat.update("p", GREEDY, ANSWER)
        assert chat.lookup("p", GREEDY) == ANSWER
    finally:
        rt.close()


@pytest.mark.redis
def test_a_clear_in_one_process_is_seen_by_another(redis_url):
    config = StoreConfig(redis=RedisConfig(url=redis_url))
    first, second = EvocacheLLMCache(config, namespace="chat"), EvocacheLLMCache(config, namespace="chat")
    try:
        first.update("p", GREEDY, ANSWER)
        assert second.lookup("p", GREEDY) == ANSWER  # one namespace on one Redis: shared
        second.clear()
        assert first.lookup("p", GREEDY) is None  # its L1 copy is of the old epoch
    finally:
        first.runtime.close()
        second.runtime.close()


def test_access_events_are_written(tmp_path):
    path = tmp_path / "events.jsonl"
    cache = EvocacheLLMCache(StoreConfig(events=EventsConfig(sink="jsonl", path=str(path))), namespace="chat")
    try:
        with tenant_scope("acme"):
            assert cache.lookup("p", GREEDY) is None  # a miss is recorded where it is computed: the update
            cache.update("p", GREEDY, ANSWER)
            assert cache.lookup("p", GREEDY) == ANSWER
        cache.runtime.flush()
    finally:
        cache.runtime.close()
    events = list(read_events(path))
    assert [(e.fn, e.ns, e.outcome, e.tier, e.stored) for e in events] == [
        ("langchain:chat", "acme", "miss", None, "l1"),
        ("langchain:chat", "acme", "hit", "l1", ""),
    ]
    assert events[0].key == events[1].key and events[1].size > 0


def test_stored_answers_build_generations_and_messages_only():
    assert load_generations(json.dumps([{"lc": 1, "type": "constructor", "id": ["langchain", "schema", "output",
                                         "Generation"], "kwargs": {"text": "x"}}])) == [Generation(text="x")]
    model = {"lc": 1, "type": "constructor", "id": ["langchain", "chat_models", "openai", "ChatOpenAI"],
             "kwargs": {"openai_api_base": "http://attacker.invalid",
                        "openai_api_key": {"lc": 1, "type": "secret", "id": ["OPENAI_API_KEY"]}}}
    template = {"lc": 1, "type": "constructor", "id": ["langchain", "prompts", "prompt", "PromptTemplate"],
                "kwargs": {"template": "{x}", "input_variables": ["x"]}}
    for payload in ([model], [template], {"lc": 1, "type": "secret", "id": ["HOME"]}, ["text"]):
        with pytest.raises(ValueError):
            load_generations(json.dumps(payload))


class _Chat(BaseChatModel):
    """A serialisable chat model (its llm_string is LangChain's first form) that counts its calls."""

    temperature: float = 0.0
    calls: int = 0

    @classmethod
    def is_lc_serializable(cls) -> bool:
        return True

    @property
    def _llm_type(self) -> str:
        return "counting-chat"

    def _generate(self, messages, stop=None, run_manager=None, **kwargs):
        self.calls += 1
        return ChatResult(generations=[ChatGeneration(message=AIMessage(content=f"answer {self.calls}"))])


def test_langchain_models_use_it(memory_cache):
    chat = _Chat(cache=memory_cache)
    first = chat.invoke([HumanMessage("hello")])
    assert chat.invoke([HumanMessage("hello")]).content == first.content == "answer 1"
    sampled = _Chat(temperature=0.8, cache=memory_cache)
    assert [sampled.invoke("hello").content for _ in range(2)] == ["answer 1", "answer 2"]

    set_llm_cache(memory_cache)
    try:
        llm = FakeListLLM(responses=["one", "two"])
        assert [llm.invoke("q"), llm.invoke("q")] == ["one", "one"]
    finally:
        set_llm_cache(None)


def test_a_policy_decides_ttl_and_bypass(clock):
    policy = load_policy(Path(__file__).resolve().parent.parent / "examples" / "policies" / "langchain.yaml")
    cache = EvocacheLLMCache(build_runtime(StoreConfig(), clock=clock), namespace="chat", policy=policy)
    draft = GREEDY.replace("'m1'", "'draft-1'")
    cache.update("p", draft, ANSWER)
    assert cache.lookup("p", draft) is None
    with tenant_scope("acme", tier="free"):
        cache.update("p", GREEDY, ANSWER)
    cache.update("p", GREEDY, ANSWER)
    clock.advance(61)
    with tenant_scope("acme", tier="free"):
        assert cache.lookup("p", GREEDY) is None
    assert cache.lookup("p", GREEDY) == ANSWER
    assert [(e.rule, e.outcome) for e in cache.runtime.events.events()] == [
        ("drafts", "bypass"), ("free-tier", "miss"), ("default", "miss"), ("default", "hit"),
    ]


def test_same_text_compares_the_generations_texts():
    stored = dumps  # the stored form: LangChain's JSON of the generations
    assert same_text(stored([Generation(text="a", generation_info={"x": 1})]), stored([Generation(text="a")]))
    assert not same_text(stored([Generation(text="a")]), stored([Generation(text="b")]))


@pytest.mark.slow
def test_semantic_mode_serves_a_paraphrase_within_the_tenant():
    semantic = {"max_error": 0.05, "mode": "static", "threshold": 0.8}
    cache = EvocacheLLMCache(StoreConfig(), namespace="faq", semantic=semantic)
    ask, paraphrase = "How do I reset my password?", "How can I reset my password?"
    try:
        with tenant_scope("acme"):
            assert cache.lookup(ask, GREEDY) is None
            cache.update(ask, GREEDY, ANSWER)
            assert cache.lookup(paraphrase, GREEDY) == ANSWER
            assert cache.lookup("What will the weather be like in Paris tomorrow?", GREEDY) is None
        with tenant_scope("globex"):
            assert cache.lookup(paraphrase, GREEDY) is None
        hits = [e for e in cache.runtime.events.events() if e.outcome == "hit"]
        assert [(e.ns, e.reason) for e in hits] == [("acme", "semantic")]
    finally:
        cache.runtime.close()
