"""What every ``serving.Backend`` (the ingress's way to its model replicas) does, checked the same way for each:
``LocalBackend`` in tests/test_backends.py, ``RayBackend`` over a real deployment in tests/test_serving_ray.py.

The replicas behind it serve the echo model of ``_serving_fixtures`` (the prompt's words, reversed, one piece
per word) with an exact cache on its rule."""

from __future__ import annotations

import uuid

from prometheus_client.parser import text_string_to_metric_families

from evocache.controller import block_hashes, namespace_for
from evocache.serving import ByteTokenizer, Completion, Decision, Finish, GenerateRequest


def request(prompt: str, *, tenant: str = "acme", max_tokens: int = 64, block_size: int = 4,
            extras: tuple[str, ...] = ("echo", "")) -> GenerateRequest:
    ids = tuple(ByteTokenizer().encode(prompt))
    return GenerateRequest(
        request_id=f"cmpl-{uuid.uuid4().hex}", endpoint="completions", model="echo", prompt=prompt,
        input_ids=ids, blocks=block_hashes(ids, block_size, extras, str(namespace_for(tenant))), tenant=tenant,
        tenant_tier="pro", max_tokens=max_tokens, temperature=0.0, top_p=1.0, seed=None, stop=())


def echoed(prompt: str, max_tokens: int = 64) -> str:
    return " ".join(prompt.split()[::-1][:max_tokens])


async def check_backend(backend, **request_options) -> None:
    """Runs the contract against ``backend``; an assertion names the first part it breaks."""
    assert await backend.ready() is True

    # complete(): the answer, its decision and its usage; a repeat is the cache's.
    prompt = f"{uuid.uuid4().hex} one two three four"
    first = await backend.complete(request(prompt, **request_options))
    assert isinstance(first, Completion) and first.text == echoed(prompt)
    assert (first.decision.outcome, first.finish.finish_reason) == ("miss", "stop")
    assert first.finish.prompt_tokens == len(prompt.encode())
    again = await backend.complete(request(prompt, **request_options))
    assert (again.text, again.decision.outcome) == (first.text, "hit")

    # stream(): the decision first, then the pieces, then one Finish; the same answer as complete().
    prompt = f"{uuid.uuid4().hex} alpha beta gamma"
    items = [item async for item in backend.stream(request(prompt, **request_options))]
    assert isinstance(items[0], Decision) and items[0].outcome == "miss"
    assert all(isinstance(piece, str) for piece in items[1:-1])
    assert "".join(items[1:-1]) == echoed(prompt)
    assert isinstance(items[-1], Finish)  # a callable's pieces are counted in the tokenizer's tokens
    assert items[-1].completion_tokens == len(ByteTokenizer().encode(echoed(prompt)))
    replayed = [item async for item in backend.stream(request(prompt, **request_options))]
    assert replayed[0].outcome == "hit" and replayed[1:-1] == items[1:-1]

    # A stream closed after its first piece never leaves a partial answer to be served, and the backend serves
    # on. (Whether the replica had finished the answer by then, and stored it whole, is a race the contract
    # leaves open: a fast model over Ray may have.)
    prompt = f"{uuid.uuid4().hex} closed early here"
    stream = backend.stream(request(prompt, **request_options))
    assert isinstance(await stream.__anext__(), Decision)
    assert isinstance(await stream.__anext__(), str)
    await stream.aclose()
    after = await backend.complete(request(prompt, **request_options))
    assert after.text == echoed(prompt) and after.decision.outcome in ("miss", "hit")

    # Tenants: the same prompt of another tenant is that tenant's miss.
    other = await backend.complete(request(prompt, **{**request_options, "tenant": "globex"}))
    assert other.decision.outcome == "miss"

    # metrics(): one Prometheus exposition that parses, counting what was asked.
    exposition = (await backend.metrics()).decode()
    names = {family.name for family in text_string_to_metric_families(exposition)}
    assert "evocache_requests" in names
