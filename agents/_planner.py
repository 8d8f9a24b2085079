"""The loop's optional LLM planner: a chat model reads the findings, tries edits through the loop's own tools
and suggests edits, which the loop then judges by replay like any other candidate.

    planner = planner_from_env()          # None unless EVOCACHE_PLANNER is set
    if planner is not None:
        result = planner.plan(tools, findings, candidates)
        # result.edits join the candidates; each is still applied, checked and replayed by the loop

How it works. ``Planner.plan`` runs a two-node LangGraph graph, ``model ⇄ tools``: the chat model, bound to
the tools, either calls tools (a ``ToolNode`` runs them and hands the results back) or answers. The tools are
the loop's own functions, given as ``PlannerTools``: ``diagnose`` (the findings), ``replay`` (evidence for a
candidate built from edits: the loop builds and judges it, the planner applies nothing), ``diff`` (the policy
diff that ``evocache policy diff`` prints) and, when the loop has one, ``retrain``. Each result goes back to
the model as JSON cut to ``MAX_TOOL_CHARS``. The answer is a JSON object ``{"rationale": ..., "edits":
[{"path", "new", "why"}]}`` in the model's last message, fenced or not, with or without prose around it.

Why a model cannot do harm through it. Every edit the model names, for ``replay``, ``diff`` or in its answer,
is checked against the base policy before anything else sees it (``edits_from_model``): only the settings the
loop's own candidate edits change are editable (``EDITABLE``); the rule must exist; ``cache`` may only become
``bypass`` (turning caching on could serve sampled answers, which replay's hit ratio would reward); the value
must lie in the guardrails' ttl range and under the semantic error ceiling and pass ``apply_edits`` (the dsl's
validation and ``policy check``). The kind, which decides auto-approval, comes from the path, never from the
model, and ``old`` from the base. An edit that fails is dropped with a note. The model gets ``max_steps``
calls: one that keeps calling tools is stopped there (and the graph's recursion limit backs that up); a
timeout bounds each call of a configured endpoint; any failure of the model, the endpoint or a tool ends the
plan with no edits and the error in the rationale and the log. The planner is off unless configured, and the
loop never needs it.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import operator
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, TypedDict

from pydantic import BaseModel, Field

from evocache.dsl import Policy, parse_duration

from ._candidates import Edit, apply_edits
from ._types import Finding
from .errors import AgentError, PlannerError

if TYPE_CHECKING:
    from ._evidence import ArmMetrics, Comparison

log = logging.getLogger("evocache.agents.planner")

MAX_TOOL_CHARS = 4000
"""A tool's result is cut to this many characters before the model sees it."""
MAX_RATIONALE_CHARS = 4000
MAX_FINDINGS = 20
MAX_CANDIDATES = 24
MAX_EDITS = 4
"""At most this many edits per ``replay``/``diff`` call and in the answer; the rest are dropped, noted."""
DEFAULT_TIMEOUT_S = 60.0
EXTRA = "pip install 'evocache[planner]'"
ENV_PROVIDER = "EVOCACHE_PLANNER"
ENV_BASE_URL = "EVOCACHE_PLANNER_BASE_URL"
ENV_MODEL = "EVOCACHE_PLANNER_MODEL"
ENV_API_KEY = "EVOCACHE_PLANNER_API_KEY"
ENV_TIMEOUT = "EVOCACHE_PLANNER_TIMEOUT"


# -- what the loop gives and gets ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PlannerTools:
    """The loop's functions the model may call. ``base``: the policy every edit applies to. ``diagnose()``:
    a summary of the findings; ``replay(edits)``: the evidence for ``base`` with ``edits`` applied, judged by
    the loop; ``diff(edits)``: the policy diff text of that candidate; ``retrain()``: what retraining found
    (None: the loop has no retraining step, and the model is not offered the tool). Results must be JSON-able
    (other values are sent as their ``str``); a ``ValueError`` or ``AgentError`` they raise is shown to the
    model as the tool's result, anything else ends the plan."""

    base: Policy
    diagnose: Callable[[], Any]
    replay: Callable[[list[Edit]], Any]
    diff: Callable[[list[Edit]], str]
    retrain: Callable[[], Any] | None = None


@dataclass(frozen=True, slots=True)
class PlannerResult:
    """What the planner suggests: the model's ``rationale`` (or why there is no suggestion), the ``edits``
    that passed the checks, the ``tool_calls`` that ran, by name, in order, and ``notes`` on the edits
    dropped."""

    rationale: str
    edits: list[Edit]
    tool_calls: list[str]
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"rationale": self.rationale, "edits": [e.to_dict() for e in self.edits],
                "tool_calls": list(self.tool_calls), "notes": list(self.notes)}


def summarise_findings(findings: Sequence[Finding], limit: int = MAX_FINDINGS) -> list[dict[str, Any]]:
    """The ``limit`` strongest findings as short plain records (what ``diagnose`` may return)."""
    ranked = sorted(findings, key=lambda f: f.score, reverse=True)[:limit]
    return [{"kind": f.kind, "summary": f.summary, "subject": dict(f.subject), "window": f.window,
             "score": _finite(f.score), "p_value": _finite(f.p_value)} for f in ranked]


def summarise_evidence(evidence: Comparison) -> dict[str, Any]:
    """The parts of the loop's replay evidence a model can weigh (what ``replay`` may return): the gain and
    its interval, the requests counted, each arm's hit and wrong-answer rates."""
    def arm(metrics: ArmMetrics) -> dict[str, Any]:
        return {"hit_ratio": _finite(metrics.hit_ratio), "wrong_rate": _finite(metrics.wrong_rate)}

    return {"gain": _finite(evidence.gain), "ci": [_finite(x) for x in evidence.ci],
            "requests": evidence.requests, "base": arm(evidence.base), "candidate": arm(evidence.candidate),
            "wrong_change": _finite(evidence.wrong_change)}


def _finite(x: Any) -> Any:
    return None if isinstance(x, float) and not math.isfinite(x) else x


# -- edits as a model writes them --------------------------------------------------------------------------


class _Refused(ValueError):
    """An edit the model named that cannot be suggested; the message says why."""


@dataclass(frozen=True, slots=True)
class _Setting:
    """One editable setting of a rule (or the defaults): its edit kind, the value in force under a decision,
    and the reading of a model's value (raising ``_Refused``)."""

    kind: str
    current: Callable[[Any], Any]
    read: Callable[[Policy, Any, Any], Any]  # (base, value in force, the model's value) -> the new value


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _Refused(f"{what} must be a finite number, got {value!r}")
    return float(value)


def _ttl(base: Policy, old: Any, value: Any) -> float:
    try:
        seconds = parse_duration(value)
    except ValueError as exc:
        raise _Refused(str(exc)) from None
    g = base.guardrails
    low, high = g.ttl_min or 1.0, g.ttl_max or 30 * 86400.0  # the range candidate ttls keep to
    if not low <= seconds <= high:
        raise _Refused(f"a ttl of {seconds:g} s is outside the guardrails' range [{low:g}, {high:g}] s")
    return seconds


def _bypass(base: Policy, old: Any, value: Any) -> str:
    if value != "bypass":
        raise _Refused(f"cache may only become 'bypass', got {value!r}")
    return "bypass"


def _min_tokens(base: Policy, old: Any, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value) or value < 0:
        raise _Refused(f"min_tokens must be a whole number >= 0, got {value!r}")
    return int(value)


def _max_error(base: Policy, old: Any, value: Any) -> float:
    new = _number(value, "max_error")
    ceiling = float(base.guardrails.max_semantic_error or old)  # as candidate edits: no guardrail, no raise
    if not 0 < new <= ceiling:
        raise _Refused(f"max_error {new:g} is outside (0, {ceiling:g}]")
    return new


def _threshold(base: Policy, old: Any, value: Any) -> float:
    new = _number(value, "threshold")
    if not 0 < new <= 1:
        raise _Refused(f"threshold {new:g} is outside (0, 1]")
    return new


def _kv(decision: Any) -> Any:
    if decision.kv is None:
        raise _Refused("it does not reuse KV blocks")
    return int(decision.kv.min_tokens or 0)


def _semantic(name: str) -> Callable[[Any], Any]:
    def current(decision: Any) -> Any:
        if decision.semantic is None:
            raise _Refused("it has no semantic matching")
        value = getattr(decision.semantic, name)
        if value is None:
            raise _Refused(f"its semantic matching has no {name}")
        return float(value)
    return current


RULE_SETTINGS: dict[str, _Setting] = {
    "ttl": _Setting("ttl", lambda d: float(d.ttl), _ttl),
    "cache": _Setting("bypass", lambda d: "response" if d.cache else "bypass", _bypass),
    "kv.min_tokens": _Setting("min-tokens", _kv, _min_tokens),
    "semantic.max_error": _Setting("semantic", _semantic("max_error"), _max_error),
    "semantic.threshold": _Setting("semantic", _semantic("threshold"), _threshold),
}
EDITABLE = (
    *(f"rules.<rule>.{name}" for name in RULE_SETTINGS),
    *(f"defaults.{name}" for name in RULE_SETTINGS),
    "tenants.<tenant>.l1_share",
    "eviction.l1",
)
"""The paths a planner may edit: the settings the loop's candidate edits change."""


def _edit(base: Policy, path: str, value: Any, why: str) -> Edit:
    """One checked edit of ``base`` at ``path`` (raises ``_Refused`` saying why not)."""
    head, _, rest = path.partition(".")
    if head in ("rules", "defaults"):
        rule, _, name = rest.partition(".") if head == "rules" else ("default", "", rest)
        setting = RULE_SETTINGS.get(name)
        if setting is None:
            raise _Refused(f"{name!r} is not an editable setting; editable: {', '.join(RULE_SETTINGS)}")
        if head == "rules" and rule not in {r.name for r in base.rules}:
            names = ", ".join(r.name for r in base.rules) or "none"
            raise _Refused(f"no rule named {rule!r}; rules: {names}")
        try:
            old = setting.current(base.decision_for(rule))
        except _Refused as exc:
            raise _Refused(f"{rule if head == 'rules' else 'the defaults'}: {exc}") from None
        return _checked(base, Edit(setting.kind, path, old, setting.read(base, old, value), why))
    if head == "tenants" and rest.count(".") == 1 and rest.endswith(".l1_share"):
        tenant = rest.removesuffix(".l1_share")
        spec = base.tenant(tenant)
        old = 1.0 if spec is None else float(spec.l1_share)  # the share the tenant has now
        new = _number(value, "l1_share")
        if not 0 <= new <= 1:
            raise _Refused(f"l1_share {new:g} is outside [0, 1]")
        return _checked(base, Edit("tenant-share", path, old, new, why))
    if path == "eviction.l1":
        if not isinstance(value, str):
            raise _Refused(f"eviction.l1 names an eviction policy, got {value!r}")
        return _checked(base, Edit("eviction", path, base.eviction.l1 or "lru", value, why))
    raise _Refused(f"not an editable path; editable: {', '.join(EDITABLE)}")


def _checked(base: Policy, edit: Edit) -> Edit:
    if edit.new == edit.old:
        raise _Refused(f"no change: it is {edit.old!r} already")
    try:
        apply_edits(base, [edit])
    except ValueError as exc:  # PolicyError, StoreConfigError: what `policy check` would reject
        raise _Refused(str(exc).splitlines()[0][:300]) from None
    return edit


def edits_from_model(base: Policy, raw: Any) -> tuple[list[Edit], list[str]]:
    """The edits of ``base`` that ``raw`` (a model's list of ``{"path", "new", "why"}`` objects) names and
    that pass the checks of the module docstring, with a note for each one dropped. Never raises on what a
    model writes; at most ``MAX_EDITS`` edits, one per path."""
    if not isinstance(raw, list):
        return [], [f"edits must be a list of {{path, new, why}} objects, got {type(raw).__name__}"]
    edits: list[Edit] = []
    notes: list[str] = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict) or not isinstance(item.get("path"), str) or "new" not in item:
            notes.append(f"edit {i} dropped: not a {{path, new, why}} object: {_brief(item)}")
            continue
        path = item["path"].strip()
        if len(edits) >= MAX_EDITS:
            notes.append(f"edit {i} ({path}) dropped: at most {MAX_EDITS} edits at a time")
            continue
        if any(e.path == path for e in edits):
            notes.append(f"edit {i} ({path}) dropped: that path is edited already")
            continue
        why = item.get("why")
        why = f"planner: {why.strip()[:300]}" if isinstance(why, str) and why.strip() else "planner"
        try:
            edits.append(_edit(base, path, item["new"], why))
        except _Refused as exc:
            notes.append(f"edit {i} ({path}) dropped: {exc}")
    return edits, notes


def _brief(value: Any, limit: int = 120) -> str:
    text = json.dumps(value, default=str, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit] + "..."


# -- the answer --------------------------------------------------------------------------------------------


def _text(content: Any) -> str:
    """A message's text: a string, or the text parts of a list of content blocks."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part if isinstance(part, str) else str(part.get("text", ""))
                       for part in content if isinstance(part, str | dict))
    return ""


def parse_answer(text: str) -> tuple[str, Any]:
    """The rationale and the raw edits of a model's final answer: the last top-level JSON object in
    ``text`` with ``edits`` (else one with ``rationale``), fenced or not. Without one, the text is the
    rationale and the edits are None."""
    decoder = json.JSONDecoder()
    found: list[dict[str, Any]] = []
    i = text.find("{")
    while i != -1:
        try:
            obj, end = decoder.raw_decode(text, i)
        except ValueError:
            i = text.find("{", i + 1)
            continue
        if isinstance(obj, dict):
            found.append(obj)
        i = text.find("{", end)
    answer = next((o for o in reversed(found) if "edits" in o), None) or next(
        (o for o in reversed(found) if "rationale" in o), None)
    if answer is None:
        return text.strip()[:MAX_RATIONALE_CHARS], None
    rationale = answer.get("rationale")
    rationale = rationale if isinstance(rationale, str) else _brief(rationale, MAX_RATIONALE_CHARS)
    return rationale.strip()[:MAX_RATIONALE_CHARS], answer.get("edits", [])


# -- the agent ---------------------------------------------------------------------------------------------


class _AgentState(TypedDict):
    messages: Annotated[list[Any], operator.add]
    steps: int


class _NoArgs(BaseModel):
    pass


class _EditsArgs(BaseModel):
    edits: list[dict[str, Any]] = Field(
        description='Edits of the base policy, each {"path": ..., "new": ..., "why": ...}; paths: '
                    + ", ".join(EDITABLE))


_SYSTEM = """You plan changes to an evocache cache policy (policy {ref}).
You get the loop's findings about recent traffic and the candidate edits it already has. Tools:
- diagnose(): the findings, strongest first.
- replay(edits): replayed evidence for the base policy with these edits: the hit-ratio gain, its interval,
  wrong answers. Only replayed gains count.
- diff(edits): the policy diff those edits make.{retrain}
An edit is {{"path": ..., "new": ..., "why": ...}}. Editable paths: {paths}. Durations are seconds or strings
such as "10m"; cache may only become "bypass".
Every edit you suggest is replayed again by the loop and kept only when replay shows a gain; your word alone
changes nothing. Suggest at most {max_edits} edits, or none. End with one JSON object and nothing after it:
{{"rationale": "<why, in two or three sentences>", "edits": [<edits>]}}"""


def _bounded(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str, ensure_ascii=False)
    if len(text) <= MAX_TOOL_CHARS:
        return text
    return f"{text[:MAX_TOOL_CHARS]}... [cut: {len(text)} characters in all]"


class Planner:
    """A tool-using agent over ``chat_model`` (a LangChain chat model that supports ``bind_tools``), allowed
    ``max_steps`` model calls per plan. Raises ``ValueError`` for ``max_steps`` < 1."""

    def __init__(self, chat_model: Any, *, max_steps: int = 8) -> None:
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(f"max_steps must be an int >= 1, got {max_steps!r}")
        self.chat_model = chat_model
        self.max_steps = max_steps

    def plan(self, tools: PlannerTools, findings: Sequence[Finding],
             candidates: Sequence[Edit]) -> PlannerResult:
        """Run the agent over ``findings`` and the loop's ``candidates`` with ``tools``; the edits it
        suggests, checked (see the module docstring). Never raises: a failure gives no edits and the error as
        the rationale."""
        from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

        called: list[str] = []
        try:
            graph = self._graph(self._tools(tools, called))
            prompt = {"policy": tools.base.ref, "findings": summarise_findings(findings),
                      "candidates": [e.to_dict() for e in candidates[:MAX_CANDIDATES]]}
            retrain = "\n- retrain(): retrain the learned eviction model and say what replay made of it." \
                if tools.retrain is not None else ""
            system = _SYSTEM.format(ref=tools.base.ref, retrain=retrain, paths=", ".join(EDITABLE),
                                    max_edits=MAX_EDITS)
            messages = [SystemMessage(system), HumanMessage(_bounded(prompt))]
            state = graph.invoke({"messages": messages, "steps": 0},
                                 {"recursion_limit": 2 * self.max_steps + 2})
        except Exception as exc:  # a model, endpoint or tool failure must not stop the loop: no edits, why
            log.warning("planner failed after %s: %s: %s", called or "no tool calls", type(exc).__name__, exc,
                        exc_info=True)
            why = f"planner failed: {type(exc).__name__}: {exc}"
            return PlannerResult(why[:MAX_RATIONALE_CHARS], [], called)
        last = state["messages"][-1]
        if isinstance(last, AIMessage) and last.tool_calls:
            log.info("planner stopped after %d model calls without an answer", state["steps"])
            return PlannerResult(f"stopped after {state['steps']} model calls without an answer", [], called)
        rationale, raw = parse_answer(_text(last.content))
        if raw is None:
            return PlannerResult(rationale, [], called, ["the answer held no JSON object with edits"])
        edits, notes = edits_from_model(tools.base, raw)
        for note in notes:
            log.info("planner: %s", note)
        return PlannerResult(rationale, edits, called, notes)

    def _tools(self, tools: PlannerTools, called: list[str]) -> list[Any]:
        from langchain_core.tools import StructuredTool

        def run(name: str, fn: Callable[[], Any]) -> str:
            called.append(name)
            try:
                return _bounded(fn())
            except (ValueError, AgentError) as exc:  # the model may fix what it asked for
                return _bounded({"error": f"{type(exc).__name__}: {exc}"})

        def with_edits(name: str, fn: Callable[[list[Edit]], Any]) -> Callable[..., str]:
            def call(edits: list[dict[str, Any]]) -> str:
                checked, notes = edits_from_model(tools.base, edits)
                if not checked:
                    called.append(name)
                    return _bounded({"error": "no edit passed the checks", "notes": notes})
                return run(name, lambda: {"edits": [e.to_dict() for e in checked], "result": fn(checked),
                                          "notes": notes})
            return call

        def tool(fn: Callable[..., str], name: str, description: str, args: type[BaseModel]) -> Any:
            return StructuredTool.from_function(fn, name=name, description=description, args_schema=args)

        made = [
            tool(lambda: run("diagnose", tools.diagnose), "diagnose",
                 "The loop's findings about recent traffic, strongest first.", _NoArgs),
            tool(with_edits("replay", tools.replay), "replay",
                 "Replay the base policy with these edits against the base over recent traffic: the gain in "
                 "hit ratio, its interval, wrong answers.", _EditsArgs),
            tool(with_edits("diff", tools.diff), "diff",
                 "The policy diff these edits make to the base policy.", _EditsArgs),
        ]
        if tools.retrain is not None:
            retrain = tools.retrain
            made.append(tool(lambda: run("retrain", retrain), "retrain",
                             "Retrain the learned eviction model; what replay made of it.", _NoArgs))
        return made

    def _graph(self, tools: list[Any]) -> Any:
        from langchain_core.messages import AIMessage
        from langgraph.graph import END, START, StateGraph
        from langgraph.prebuilt import ToolNode

        bound = self.chat_model.bind_tools(tools)
        max_steps = self.max_steps

        def model(state: _AgentState) -> dict[str, Any]:
            return {"messages": [bound.invoke(state["messages"])], "steps": state["steps"] + 1}

        def route(state: _AgentState) -> str:
            last = state["messages"][-1]
            wants_tools = isinstance(last, AIMessage) and bool(last.tool_calls)
            return "tools" if wants_tools and state["steps"] < max_steps else END

        graph = StateGraph(_AgentState)
        graph.add_node("model", model)
        graph.add_node("tools", ToolNode(tools))
        graph.add_edge(START, "model")
        graph.add_conditional_edges("model", route, {"tools": "tools", END: END})
        graph.add_edge("tools", "model")
        return graph.compile()


# -- configuration ------------------------------------------------------------------------------------------


def _setting(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name, "").strip()
    return value or None


def _required(env: Mapping[str, str], name: str, provider: str) -> str:
    value = _setting(env, name)
    if value is None:
        raise PlannerError(f"{ENV_PROVIDER}={provider} needs {name} (the model to ask)")
    return value


def _import(module: str, provider: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise PlannerError(f"{ENV_PROVIDER}={provider} needs the {module.replace('_', '-')} package: "
                           f"{EXTRA}") from exc


def _openai(env: Mapping[str, str], timeout: float) -> Any:
    module = _import("langchain_openai", "openai")
    model = _required(env, ENV_MODEL, "openai")
    key = _setting(env, ENV_API_KEY) or _setting(env, "OPENAI_API_KEY")
    if key is None:
        raise PlannerError(f"{ENV_PROVIDER}=openai needs an API key in {ENV_API_KEY} or OPENAI_API_KEY "
                           "(any value for an endpoint that asks for none)")
    return module.ChatOpenAI(model=model, base_url=_setting(env, ENV_BASE_URL), api_key=key, timeout=timeout,
                             max_retries=1, temperature=0)


def _ollama(env: Mapping[str, str], timeout: float) -> Any:
    module = _import("langchain_ollama", "ollama")
    model = _required(env, ENV_MODEL, "ollama")
    return module.ChatOllama(model=model, base_url=_setting(env, ENV_BASE_URL), temperature=0,
                             client_kwargs={"timeout": timeout})


PROVIDERS: dict[str, Callable[[Mapping[str, str], float], Any]] = {"openai": _openai, "ollama": _ollama}
"""``EVOCACHE_PLANNER`` value -> the chat model it makes from the environment and a timeout in seconds."""


def planner_from_env(env: Mapping[str, str] = os.environ) -> Planner | None:
    """The planner ``env`` configures, or None when ``EVOCACHE_PLANNER`` is unset or empty.

    ``EVOCACHE_PLANNER``: ``openai`` (an OpenAI-compatible endpoint: ``EVOCACHE_PLANNER_BASE_URL``, default
    OpenAI's; the key in ``EVOCACHE_PLANNER_API_KEY`` or ``OPENAI_API_KEY``) or ``ollama``
    (``EVOCACHE_PLANNER_BASE_URL``, default Ollama's local one); both need ``EVOCACHE_PLANNER_MODEL``.
    ``EVOCACHE_PLANNER_TIMEOUT``: seconds per model call (default 60). Raises ``PlannerError`` naming the
    variable for an unknown value or a missing setting, and the extra to install when the provider's package
    is missing."""
    name = _setting(env, ENV_PROVIDER)
    if name is None:
        return None
    make = PROVIDERS.get(name.lower())
    if make is None:
        known = ", ".join(sorted(PROVIDERS))
        raise PlannerError(f"{ENV_PROVIDER}={name!r} is not a planner; use one of {known}, or leave it unset")
    raw = _setting(env, ENV_TIMEOUT)
    try:
        timeout = DEFAULT_TIMEOUT_S if raw is None else float(raw)
    except ValueError:
        timeout = math.nan
    if not (timeout > 0 and math.isfinite(timeout)):
        raise PlannerError(f"{ENV_TIMEOUT}={raw!r}: expected seconds, a number > 0")
    try:
        chat = make(env, timeout)
    except PlannerError:
        raise
    except Exception as exc:  # the provider's own validation (a malformed url, say), converted here
        raise PlannerError(f"{ENV_PROVIDER}={name}: cannot make the chat model: {exc}") from exc
    return Planner(chat)
