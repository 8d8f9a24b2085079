"""evocache as LangChain's LLM cache: ``set_llm_cache(EvocacheLLMCache(StoreConfig(...)))``.

Only whoever uses it imports this module: ``evocache.controller`` does not, so importing evocache never imports
LangChain.

Every lookup and update is a call of one ``@cache_if`` function per cache, named ``langchain:<namespace>``,
whose request view is the call LangChain makes: ``prompt`` (the prompt, or a chat model's messages as
LangChain's JSON), ``llm_string`` (the model and its parameters, as LangChain writes them), the ``model``,
``temperature`` and ``seed`` read from that string, and the namespace's ``epoch``. So the store, its tiers,
the ttl, the tenant of the enclosing ``tenant_scope``, a policy's rules and the access events are evocache's,
as for any cached function:

- ``lookup`` is the function's ``lookup``: an exact hit, or None without computing anything.
- ``update`` is its ``refresh`` with the generations handed in: the function returns them (the ``value``
  parameter, left out of the key and the view), and the cache stores them by the rule in force.

What ``llm_string`` says (LangChain builds it in ``BaseChatModel._get_llm_string`` and ``BaseLLM``'s
``get_prompts``), in one of two forms:

- a serialisable chat model: ``json.dumps(its serialised constructor, sort_keys=True) + "---" +
  str(sorted(run-time params))``: the constructor's ``kwargs`` overridden by the run-time pairs;
- any other model: ``str(sorted(params.items()))``, a Python list of ``(name, value)`` pairs.

Both are read without evaluating code (``json`` and ``ast.literal_eval``, bounded in length). ``temperature`` and
``seed`` come from the top level or from ``model_kwargs``; ``model`` from ``model``, ``model_name`` or
``model_id``. A string in neither form (a test's free text) states no parameter and is keyed as it is. A string
in one of the forms that cannot be read gives the temperature NaN. evocache's rule for sampling then decides: a
call whose temperature may sample (not a number <= 0) and which has no seed is served uncached
(``reason: sampling``), unless a rule allows sampling.

Generations are stored as LangChain's own JSON (``langchain_core.load.dumps``) and read back with
``langchain_core.load.loads`` restricted to the generation and message classes (``allowed_objects``, no
secrets read from the environment): nothing read from a tier is unpickled, and no other class can be built from
it. An update whose generations do not read back equal to themselves is not stored.

``clear()`` drops this namespace only: it gives the namespace a new epoch, which every key of the namespace
binds, so the entries of the old epoch are never read again (they leave by their ttl or by eviction). The epoch
is kept in the store, in its most shared tier (Redis if there is one, else the disk, else memory), so a clear
in one process is seen by every process sharing that tier. While that tier cannot be read, calls are misses.
See docs/langchain.md, "clear() and the epoch".
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import hashlib
import json
import logging
import math
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.caches import RETURN_VAL_TYPE, BaseCache
from langchain_core.load import dumps, loads
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    ChatMessage,
    ChatMessageChunk,
    FunctionMessage,
    FunctionMessageChunk,
    HumanMessage,
    HumanMessageChunk,
    SystemMessage,
    SystemMessageChunk,
    ToolMessage,
    ToolMessageChunk,
)
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, Generation, GenerationChunk

from evocache.dsl import Policy

from . import (
    L1,
    L2,
    L3,
    Admission,
    CacheKey,
    CacheRuntime,
    Entry,
    Namespace,
    SemanticOptions,
    StoreConfig,
    TierName,
    TierUnavailable,
    build_runtime,
    cache_if,
    current_runtime,
)

log = logging.getLogger("evocache.controller.langchain")

__all__ = ["EvocacheLLMCache", "llm_params", "load_generations", "same_text"]

ALLOWED_OBJECTS = (
    Generation, GenerationChunk, ChatGeneration, ChatGenerationChunk,
    AIMessage, AIMessageChunk, HumanMessage, HumanMessageChunk, SystemMessage, SystemMessageChunk,
    ToolMessage, ToolMessageChunk, FunctionMessage, FunctionMessageChunk, ChatMessage, ChatMessageChunk,
)
"""What a stored answer may build: generations and the messages a chat generation carries. None of them takes
an endpoint or reads a secret when built."""

MAX_LLM_STRING = 64 * 1024
"""The longest ``llm_string`` read for parameters; a longer one is keyed but its temperature counts as unknown."""

EPOCH_NS = Namespace(".langchain")
"""The namespace of the epoch records. It starts with a dot, which no tenant's namespace does."""

_TEMPERATURE = ("temperature",)
_SEED = ("seed",)
_MODEL = ("model", "model_name", "model_id")


# --- what llm_string says -------------------------------------------------------------------------------------


def llm_params(llm_string: str) -> dict[str, Any] | None:
    """The model's parameters as LangChain wrote them into ``llm_string`` (module docstring): ``{}`` for a string
    in neither of LangChain's forms, None for one in a form that cannot be read."""
    if len(llm_string) > MAX_LLM_STRING:
        return None
    if llm_string.startswith("{"):
        try:
            head, end = json.JSONDecoder().raw_decode(llm_string)
        except ValueError:
            return {}
        if not (isinstance(head, dict) and isinstance(head.get("kwargs"), dict) and
                llm_string.startswith("---", end)):
            return {}
        runtime = _pairs(llm_string[end + 3:])
        return None if runtime is None else {**head["kwargs"], **runtime}
    if llm_string.startswith("[("):
        return _pairs(llm_string)
    return {}


def _pairs(text: str) -> dict[str, Any] | None:
    """``str(sorted(params.items()))`` read back, or None when it holds anything but literals."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    if not isinstance(value, list) or not all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)
                                              for p in value):
        return None
    return dict(value)


def _param(params: Mapping[str, Any], names: Sequence[str]) -> Any:
    """The first of ``names`` at the top level, else in ``model_kwargs`` (where LangChain's chat models put the
    parameters they do not declare)."""
    nested = params.get("model_kwargs")
    for scope in (params, nested if isinstance(nested, Mapping) else {}):
        for name in names:
            if scope.get(name) is not None:
                return scope[name]
    return None


def _readable(prompt: str) -> str:
    """The text a chat prompt's messages say, one message a line (what semantic matching embeds); the prompt
    itself when it is no list of messages with text content."""
    if not prompt.startswith("[{"):
        return prompt
    try:
        messages = json.loads(prompt)
    except ValueError:
        return prompt
    lines = []
    for message in messages:
        kwargs = message.get("kwargs") if isinstance(message, dict) else None
        content = kwargs.get("content") if isinstance(kwargs, dict) else None
        if not isinstance(content, str):
            return prompt
        lines.append(content)
    return "\n".join(lines)


# --- the stored answer ----------------------------------------------------------------------------------------


def load_generations(payload: str) -> list[Generation]:
    """Generations from their stored JSON (``dumps`` of a list of them), building none but ``ALLOWED_OBJECTS``;
    ``ValueError`` for anything else (another class, a secret, a payload that is no list of generations)."""
    value = loads(payload, allowed_objects=ALLOWED_OBJECTS, secrets_from_env=False)
    if not isinstance(value, list) or not all(isinstance(g, Generation) for g in value):
        raise ValueError("not a list of generations")
    return value


def same_text(new: str, cached: str) -> bool:
    """The default judge of semantic mode: two stored answers are the same when their generations' texts are."""
    try:
        return [g.text for g in load_generations(new)] == [g.text for g in load_generations(cached)]
    except (ValueError, NotImplementedError):
        return False


class _Uncomputed(Exception):
    """Raised by the cached function when a semantic-mode lookup reaches the model: LangChain computes it."""


# --- the cache ------------------------------------------------------------------------------------------------


class EvocacheLLMCache(BaseCache):
    """LangChain's ``BaseCache`` over an evocache store (module docstring).

    ``store``: a ``StoreConfig`` (a runtime is built for this cache), a ``CacheRuntime`` (shared), or None (the
    process runtime at each call, see ``configure``). ``namespace``: what this cache's entries belong to; caches
    with one namespace on one store share entries, and ``clear()`` drops that namespace alone. ``policy``: rules
    that decide this cache's calls (ttl, tiers, sampling, semantic matching) over the view above; without one,
    ``ttl`` (a duration or seconds; ``cache_if``'s default when None) and ``admission``. ``semantic``: semantic
    mode (a ``SemanticOptions``, a mapping of its fields, or a ``max_error``); its judge defaults to
    ``same_text``; ``SemanticOptions()`` without ``max_error`` leaves the policy's ``semantic:`` rules to decide.

    Semantic mode looks a miss up as a whole call (exact, then similar prompts), and stores an update through a
    whole call too, so the semantic layer judges the new answer against the neighbour it did not serve. A miss
    is then looked up twice, and its first call's access event is ``rejected: incomplete``.

    Lookups never raise for the store: a tier that is down is a miss. The async methods run the sync ones in a
    thread, in the caller's context (its ``tenant_scope``).
    """

    def __init__(
        self,
        store: StoreConfig | CacheRuntime | None = None,
        *,
        namespace: str = "default",
        policy: Policy | None = None,
        ttl: str | float | None = None,
        admission: Admission | Mapping[str, Any] | None = None,
        semantic: SemanticOptions | Mapping[str, Any] | float | None = None,
    ) -> None:
        if not isinstance(namespace, str) or not namespace:
            raise ValueError(f"namespace must be a non-empty string, got {namespace!r}")
        self.namespace = namespace
        self.runtime = _runtime(store, policy)
        self.semantic = _semantic_options(semantic)
        self._epoch_key = CacheKey(hashlib.sha256(f"langchain-epoch|{namespace}".encode()).hexdigest())

        def answer(prompt: str, text: str, llm_string: str, model: str, temperature: float | None,
                   seed: int | None, epoch: str, value: str | None = None) -> str:
            if value is None:
                raise _Uncomputed
            return value

        decorate = cache_if(
            name=f"langchain:{namespace}",
            ignore=("value",),
            store=self.runtime,
            admission=admission,
            semantic=self.semantic,
            **({} if ttl is None else {"ttl": ttl}),
        )
        self._answer = decorate(answer)

    # -- BaseCache -----------------------------------------------------------------------------------------

    def lookup(self, prompt: str, llm_string: str) -> RETURN_VAL_TYPE | None:
        call = self._call(prompt, llm_string)
        if call is None:
            return None
        if self.semantic is None:
            found = self._answer.lookup(**call)
            payload = None if found is None else found.value
        else:
            try:
                payload = self._answer(**call)
            except _Uncomputed:
                return None
        if payload is None:
            return None
        try:
            return load_generations(payload)
        except (ValueError, NotImplementedError) as exc:  # signed by the store, so only another version's
            log.warning("langchain:%s: stored generations not read back (%s): a miss", self.namespace, exc)
            return None

    def update(self, prompt: str, llm_string: str, return_val: RETURN_VAL_TYPE) -> None:
        generations = list(return_val)
        payload = dumps(generations)
        try:
            exact = load_generations(payload) == generations
        except (ValueError, NotImplementedError):
            exact = False
        if not exact:
            log.warning("langchain:%s: generations that do not read back equal are not cached", self.namespace)
            return
        call = self._call(prompt, llm_string, payload)
        if call is None:
            return
        if self.semantic is None:
            self._answer.refresh(**call)
        else:
            self._answer(**call)

    def clear(self, **kwargs: Any) -> None:
        """Drop this namespace's entries, in every process sharing the store (module docstring).
        ``TierUnavailable`` when the new epoch could not be written: nothing was cleared."""
        rt = self._rt()
        tier = _epoch_tier(rt)
        if self._write_epoch(rt, tier) is None:
            raise TierUnavailable(tier, f"langchain:{self.namespace}: the new epoch was not stored; nothing cleared")

    async def alookup(self, prompt: str, llm_string: str) -> RETURN_VAL_TYPE | None:
        return await asyncio.to_thread(self.lookup, prompt, llm_string)

    async def aupdate(self, prompt: str, llm_string: str, return_val: RETURN_VAL_TYPE) -> None:
        await asyncio.to_thread(self.update, prompt, llm_string, return_val)

    async def aclear(self, **kwargs: Any) -> None:
        await asyncio.to_thread(self.clear, **kwargs)

    # -- one call ------------------------------------------------------------------------------------------

    def _call(self, prompt: str, llm_string: str, value: str | None = None) -> dict[str, Any] | None:
        """The cached function's arguments for this call, or None when the namespace's epoch cannot be read."""
        epoch = self._epoch()
        if epoch is None:
            return None
        params = llm_params(llm_string)
        if params is None:
            model, temperature, seed = "", math.nan, None  # a temperature unknown: not provably greedy
        else:
            model, temperature, seed = _param(params, _MODEL), _param(params, _TEMPERATURE), _param(params, _SEED)
        return {
            "prompt": prompt,
            "text": _readable(prompt) if self.semantic is not None else "",
            "llm_string": llm_string,
            "model": model if isinstance(model, str) else "",
            "temperature": temperature,
            "seed": seed if isinstance(seed, int) and not isinstance(seed, bool) else None,
            "epoch": epoch,
            "value": value,
        }

    def _rt(self) -> CacheRuntime:
        return self.runtime or current_runtime()

    def _epoch(self) -> str | None:
        """The namespace's epoch: read from the store, or made and stored on first use (or after the record
        left the store: that clears the namespace). None when it can be neither read nor stored."""
        rt = self._rt()
        tier = _epoch_tier(rt)
        found = rt.store.get(EPOCH_NS, self._epoch_key, (tier,)).entry
        if found is not None:
            return found.value.decode("ascii", "replace")
        return self._write_epoch(rt, tier)

    def _write_epoch(self, rt: CacheRuntime, tier: TierName) -> str | None:
        epoch = secrets.token_hex(16)
        entry = Entry(value=epoch.encode("ascii"), expires_at=None, created_at=rt.clock())
        return epoch if rt.store.set(EPOCH_NS, self._epoch_key, entry, (tier,)) else None


def _epoch_tier(rt: CacheRuntime) -> TierName:
    """The store's most shared tier: the one every process sharing the store reads."""
    names = rt.tier_names
    return next((t for t in (L2, L3) if t in names), L1)


def _runtime(store: StoreConfig | CacheRuntime | None, policy: Policy | None) -> CacheRuntime | None:
    if policy is not None and not isinstance(policy, Policy):
        raise TypeError(f"policy must be an evocache.dsl.Policy, got {type(policy).__name__}")
    if isinstance(store, StoreConfig):
        return build_runtime(store, policy=policy)
    if isinstance(store, CacheRuntime):
        return store if policy is None else store.with_rules(policy)
    if store is None:
        return None if policy is None else current_runtime().with_rules(policy)
    raise TypeError(f"store must be a StoreConfig, a CacheRuntime or None, got {type(store).__name__}")


def _semantic_options(semantic: SemanticOptions | Mapping[str, Any] | float | None) -> SemanticOptions | None:
    """Semantic mode's options, with this cache's defaults: the prompt's text is the ``text`` parameter (its
    ``prompt`` is the same prompt in LangChain's form), and the judge compares the generations' texts."""
    if semantic is None:
        return None
    if isinstance(semantic, (int, float)) and not isinstance(semantic, bool):
        semantic = {"max_error": semantic}
    options = SemanticOptions.of(semantic)
    return dataclasses.replace(options, text="text", text_forms=("prompt",), judge=options.judge or same_text)
