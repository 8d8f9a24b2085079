"""What the ingress hands a model replica, and what the replica sends back.

The ingress parses and authenticates the HTTP request, renders and tokenises the prompt and hashes its leading
blocks; a replica gets a ``GenerateRequest``, a plain frozen dataclass (cheap to pickle across Ray), as the first
argument of every call, where the prefix-affinity router reads ``blocks``. The tenant in it comes from the
verified API key, never from the body.

A replica answers with a ``Decision`` (what the cache did: the ``x-evocache-*`` headers) followed by text
pieces (``str``; from an upstream engine also ``bytes``, a JSON document of the choice's other fields, see
``serving._upstream``) and a ``Finish`` (streaming), or with one ``Completion`` (not streaming).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from evocache.controller import BlockHash, CacheControl


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    request_id: str
    endpoint: Literal["completions", "chat"]
    model: str
    prompt: str
    input_ids: tuple[int, ...]
    blocks: tuple[BlockHash, ...]
    tenant: str
    tenant_tier: str
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool = False
    include_usage: bool = False
    created: int = 0
    # Token offsets where the prompt's chunks start (a chat's rendered messages; 0 first), for KV chunk reuse;
    # () when unknown: the replica then treats the prompt after its cached prefix as one chunk.
    chunks: tuple[int, ...] = ()
    # With an upstream engine: the fields it gets as the client sent them (the prompt or messages, and those
    # passed through: tools, response_format, ...); None with the built-in engine.
    fields: Mapping[str, Any] | None = None
    # The client's cache directives (Cache-Control, the body's cache object) and its partition of the
    # tenant's entries ("" for none).
    control: CacheControl | None = None
    cache_namespace: str = ""

    @property
    def rollout_key(self) -> bytes:
        """What picks the canary arm: the first block's hash (a conversation keeps its leading block, so it
        stays on one version), or for prompts shorter than a block a digest of tenant and prompt."""
        if self.blocks:
            return bytes(self.blocks[0])
        data = f"{len(self.tenant)}:{self.tenant}:{self.prompt}".encode()
        return hashlib.blake2b(data, digest_size=16).digest()


CACHE_STATUS = ("HIT", "SEMANTIC HIT", "MISS", "BYPASS", "REFRESH", "STORE-SKIPPED")
"""``x-evocache-status``: an exact or a semantic hit; a miss; not looked up (``x-evocache-reason`` says why);
a miss whose lookup the client skipped (``no-cache``), and one whose answer it asked not to store
(``no-store``)."""


@dataclass(frozen=True, slots=True)
class Decision:
    """What the cache did for one request: outcome (``hit``, ``miss``, ``bypass``), the tier of a hit, the rule
    and the policy version that decided, the arm (``active`` or ``canary``), the replica, and why (a bypass's
    reason, ``semantic`` for a semantic hit)."""

    outcome: str
    tier: str
    rule: str
    policy: str
    arm: str
    replica: str
    reason: str = ""
    cached_tokens: int = 0
    status: str = ""  # CACHE_STATUS: what a gateway's users read (HIT, SEMANTIC HIT, MISS, ...)

    def headers(self) -> dict[str, str]:
        headers = {
            "x-evocache-status": self.status or self.outcome.upper(),
            "x-evocache-outcome": self.outcome,
            "x-evocache-tier": self.tier or "none",
            "x-evocache-rule": self.rule or "none",
            "x-evocache-policy": self.policy or "none",
            "x-evocache-arm": self.arm,
            "x-evocache-replica": self.replica,
        }
        if self.reason:
            headers["x-evocache-reason"] = self.reason
        return headers


@dataclass(frozen=True, slots=True)
class Finish:
    finish_reason: str  # "stop", "length"; from an upstream engine also "tool_calls", "content_filter", ...
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Completion:
    decision: Decision
    text: str
    finish: Finish
    # An upstream engine's structured pieces (JSON: a delta's tool calls, logprobs), in order.
    extras: tuple[bytes, ...] = ()


def completion_of(items: Iterable[Decision | str | Finish]) -> Completion:
    """A whole answer from the items of ``ModelServer.stream``: its decision, its text and its finish."""
    decision: Decision | None = None
    finish: Finish | None = None
    text: list[str] = []
    extras: list[bytes] = []
    for item in items:
        if isinstance(item, str):
            text.append(item)
        elif isinstance(item, bytes):
            extras.append(item)
        elif isinstance(item, Decision):
            decision = item
        else:
            finish = item
    assert decision is not None and finish is not None  # stream() always yields both
    return Completion(decision, "".join(text), finish, tuple(extras))
