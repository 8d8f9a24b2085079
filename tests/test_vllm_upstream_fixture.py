"""The facts evocache relies on when vLLM is its upstream, checked against the real server of the
``vllm_upstream`` fixture with the official OpenAI client: greedy answers and their usage, a stream that joins
to the same answer, prefix caching that reports ``cached_tokens`` and keeps tenants apart by ``cache_salt``,
the model list, and the fixture's own kill and restart."""

from __future__ import annotations

import httpx
import pytest
from _vllm import VllmEndpoint, VllmServer, group_members
from openai import OpenAI

from evocache.serving import load_tokenizer

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is a cache"}]
ANSWER_TOKENS = 12


@pytest.fixture
def client(vllm_upstream: VllmEndpoint) -> OpenAI:
    return OpenAI(base_url=vllm_upstream.base_url, api_key="unused", max_retries=0, timeout=60)


def chat(client: OpenAI, upstream: VllmEndpoint, messages: list[dict[str, str]], **kwargs: object):
    return client.chat.completions.create(
        model=upstream.model, messages=messages, max_tokens=ANSWER_TOKENS, temperature=0, **kwargs
    )


def long_prompt(topic: str, words: int) -> str:
    """A prompt of at least ``words`` tokens, distinct per ``topic``: each test caches prefixes of its own."""
    return " ".join(f"{topic} {i}" for i in range(words // 2))


def test_evocache_loads_the_model_folders_tokenizer(tiny_llama_dir) -> None:
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    assert tokenizer.vocab_size == 30522
    assert tokenizer.eos_id == 102  # [SEP]
    rendered = tokenizer.render_chat([("system", "be brief"), ("user", "hi")])
    assert rendered == "system: be brief\nuser: hi\nassistant:"
    # no 128-token cut left over from the embedder the vocabulary comes from
    assert len(tokenizer.encode(long_prompt("uncut", 600))) >= 600


def test_greedy_chat_completion_answers_with_usage(client: OpenAI, vllm_upstream: VllmEndpoint) -> None:
    first = chat(client, vllm_upstream, MESSAGES)
    again = chat(client, vllm_upstream, MESSAGES)

    tokenizer = load_tokenizer(str(vllm_upstream.model_dir))
    prompt = tokenizer.render_chat([(m["role"], m["content"]) for m in MESSAGES])
    answer = first.choices[0].message.content
    assert first.model == vllm_upstream.model
    assert isinstance(answer, str) and answer.strip()
    assert again.choices[0].message.content == answer  # greedy: the same answer every time
    # vLLM renders the same template and counts the same tokens as evocache (no special tokens added to chats)
    assert first.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert first.usage.completion_tokens == ANSWER_TOKENS
    assert first.choices[0].finish_reason == "length"
    assert first.usage.total_tokens == first.usage.prompt_tokens + ANSWER_TOKENS


def test_completions_answer_with_usage(client: OpenAI, vllm_upstream: VllmEndpoint) -> None:
    prompt = "the cache holds the answer"
    result = client.completions.create(model=vllm_upstream.model, prompt=prompt, max_tokens=ANSWER_TOKENS,
                                       temperature=0)

    tokenizer = load_tokenizer(str(vllm_upstream.model_dir))
    assert result.choices[0].text.strip()
    # a completion prompt gets the tokenizer's special tokens: [CLS] before, [SEP] after
    assert result.usage.prompt_tokens == len(tokenizer.encode(prompt)) + 2
    assert result.usage.completion_tokens == ANSWER_TOKENS
    assert result.choices[0].finish_reason == "length"


def test_a_stream_joins_to_the_greedy_answer(client: OpenAI, vllm_upstream: VllmEndpoint) -> None:
    whole = chat(client, vllm_upstream, MESSAGES)
    chunks = list(chat(client, vllm_upstream, MESSAGES, stream=True, stream_options={"include_usage": True}))

    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert sum(1 for p in pieces if p) > 1  # streamed in pieces, not in one
    assert "".join(pieces) == whole.choices[0].message.content
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def cached_tokens(client: OpenAI, upstream: VllmEndpoint, prompt: str, salt: str | None) -> tuple[int, int]:
    """(prompt tokens, cached prompt tokens) of a one-token greedy chat with ``cache_salt=salt`` (none when
    None)."""
    result = client.chat.completions.create(
        model=upstream.model, messages=[{"role": "user", "content": prompt}], max_tokens=1, temperature=0,
        extra_body={} if salt is None else {"cache_salt": salt},
    )
    details = result.usage.prompt_tokens_details
    assert details is not None  # --enable-prompt-tokens-details
    return result.usage.prompt_tokens, details.cached_tokens


def test_prefix_cache_hits_whole_blocks_within_a_salt_only(client: OpenAI,
                                                            vllm_upstream: VllmEndpoint) -> None:
    prompt = long_prompt("salted", 3 * vllm_upstream.block_tokens)
    tokens, cold = cached_tokens(client, vllm_upstream, prompt, "a")
    assert tokens > 2 * vllm_upstream.block_tokens
    assert cold == 0

    # whole blocks only, and never the block that holds the prompt's last token (its logits must be computed)
    expected = (tokens - 1) // vllm_upstream.block_tokens * vllm_upstream.block_tokens
    assert cached_tokens(client, vllm_upstream, prompt, "a") == (tokens, expected)
    # another salt hashes every block differently: nothing of salt a's is reused
    assert cached_tokens(client, vllm_upstream, prompt, "b") == (tokens, 0)
    assert cached_tokens(client, vllm_upstream, prompt, "b") == (tokens, expected)
    assert cached_tokens(client, vllm_upstream, prompt, None) == (tokens, 0)  # no salt is a salt of its own


def test_models_lists_the_served_name(vllm_upstream: VllmEndpoint) -> None:
    listing = httpx.get(f"{vllm_upstream.base_url}/models", timeout=10).json()

    assert [(m["id"], m["root"], m["max_model_len"]) for m in listing["data"]] == [
        (vllm_upstream.model, str(vllm_upstream.model_dir), vllm_upstream.max_model_len)
    ]


def test_a_killed_server_leaves_nothing_and_starts_again(vllm_server: VllmServer,
                                                         vllm_upstream: VllmEndpoint) -> None:
    assert vllm_server.process is not None
    group = vllm_server.process.pid
    vllm_server.kill()
    assert not vllm_server.running and group_members(group) == []
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{vllm_upstream.base_url}/models", timeout=5)

    vllm_server.start()
    assert vllm_server.endpoint == vllm_upstream  # the same port: clients reconnect unchanged
    assert httpx.get(f"{vllm_upstream.base_url}/models", timeout=10).status_code == 200
