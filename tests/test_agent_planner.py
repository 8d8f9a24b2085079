"""The optional LLM planner: a real LangGraph agent over the loop's tools, driven by a scripted chat model
(the one part that cannot run here: a hosted or local LLM), with a real policy, real edits and a real
replay."""

from __future__ import annotations

import gzip
import json
import logging
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.utils.function_calling import convert_to_openai_tool

from evocache.agents._candidates import Edit, apply_edits, candidate_edits
from evocache.agents._evidence import compare
from evocache.agents._planner import (
    EXTRA,
    Planner,
    PlannerResult,
    PlannerTools,
    parse_answer,
    planner_from_env,
    summarise_evidence,
)
from evocache.agents._types import Finding
from evocache.agents._workload import read_requests, windows
from evocache.agents.errors import PlannerError
from evocache.dsl import Policy, diff_policies, load_policy

ROOT = Path(__file__).resolve().parents[1]
POLICY = ROOT / "examples" / "policies" / "chat-prod.yaml"
MOONCAKE = ROOT / "tests" / "data" / "agents_diag" / "mooncake_head2400.jsonl.gz"
CAPACITY = 4_000_000  # tokens: about 7,800 blocks of 512, enough for the slice's prefixes to hit


class ScriptedChat(BaseChatModel):
    """A chat model whose n-th reply is ``reply(n)`` (an exception is raised); it records what it was sent and
    the tools each call offered, as a real provider would receive them (``bind_tools`` -> OpenAI schemas)."""

    reply: Callable[[int], AIMessage | Exception]
    calls: list[list[BaseMessage]] = []
    offered: list[list[str]] = []

    @property
    def _llm_type(self) -> str:
        return "scripted"

    def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
        return self.bind(tools=[convert_to_openai_tool(t) for t in tools], **kwargs)

    def _generate(self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None,
                  **kwargs: Any) -> ChatResult:
        self.calls.append(list(messages))
        self.offered.append([t["function"]["name"] for t in kwargs.get("tools", [])])
        out = self.reply(len(self.calls) - 1)
        if isinstance(out, Exception):
            raise out
        return ChatResult(generations=[ChatGeneration(message=out)])


def scripted(*replies: AIMessage | Exception) -> ScriptedChat:
    return ScriptedChat(reply=lambda n: replies[n], calls=[], offered=[])


def call(name: str, args: dict[str, Any], n: int) -> AIMessage:
    return AIMessage("", tool_calls=[{"name": name, "args": args, "id": f"call-{n}", "type": "tool_call"}])


@pytest.fixture(scope="module")
def base() -> Policy:
    return load_policy(POLICY)


@pytest.fixture(scope="module")
def traffic(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    trace = tmp_path_factory.mktemp("planner") / "mooncake.jsonl"
    with gzip.open(MOONCAKE, "rt") as src:
        trace.write_text(src.read())
    return list(windows(read_requests(trace)[:800], 200))


FINDINGS = [
    Finding(kind="key-drift", summary="the key distribution moved", window=3, windows=(0, 3), score=0.9),
    Finding(kind="never-hits", summary="rule sampled never hits", window=3, windows=(3, 3),
            subject={"rule": "sampled"}, score=0.4),
]


class LoopTools:
    """The loop's side: a real replay (``compare`` over the Mooncake slice, as ``Loop.judge`` runs it)
    and the real policy diff, recording every call."""

    def __init__(self, base: Policy, traffic: list[Any]) -> None:
        self.base = base
        self.traffic = traffic
        self.log: list[tuple[str, Any]] = []
        self.evidence: list[dict[str, Any]] = []

    def diagnose(self) -> list[dict[str, Any]]:
        self.log.append(("diagnose", None))
        return [f.to_dict() for f in FINDINGS]

    def replay(self, edits: list[Edit]) -> dict[str, Any]:
        self.log.append(("replay", list(edits)))
        cand = apply_edits(self.base, edits)
        n = len(self.traffic)
        evidence = summarise_evidence(compare(self.traffic, [(self.base, None, 0.0)] * n,
                                              [(cand, None, 0.0)] * n, measure=1, capacity=CAPACITY))
        self.evidence.append(evidence)
        return evidence

    def diff(self, edits: list[Edit]) -> str:
        self.log.append(("diff", list(edits)))
        return diff_policies(self.base, apply_edits(self.base, edits)).text

    def retrain(self) -> dict[str, Any]:
        self.log.append(("retrain", None))
        return {"accepted": False, "reason": "no learned policy in force"}

    def tools(self, *, retrain: bool = False) -> PlannerTools:
        return PlannerTools(self.base, self.diagnose, self.replay, self.diff,
                            self.retrain if retrain else None)


def tool_results(chat: ScriptedChat, call_index: int) -> list[ToolMessage]:
    return [m for m in chat.calls[call_index] if isinstance(m, ToolMessage)]


LRU = {"path": "eviction.l1", "new": "lru", "why": "the keys drifted"}


def test_the_agent_calls_the_loops_tools_and_returns_its_checked_answer(base: Policy,
                                                                        traffic: list[Any]) -> None:
    loop = LoopTools(base, traffic)
    told = {"kind": "ttl", "path": "eviction.l1", "new": "lru", "why": "replayed"}
    answer = ("Replay says LRU keeps the drifted prefixes.\n```json\n"
              + json.dumps({"rationale": "LRU follows the drift.", "edits": [told]}) + "\n```")
    chat = scripted(call("diagnose", {}, 0), call("replay", {"edits": [LRU]}, 1),
                    call("diff", {"edits": [LRU]}, 2), AIMessage(answer))

    candidates = candidate_edits(base, FINDINGS, [])

    result = Planner(chat).plan(loop.tools(retrain=True), FINDINGS, candidates)

    lru = Edit("eviction", "eviction.l1", "s3fifo", "lru", "planner: the keys drifted")
    assert loop.log == [("diagnose", None), ("replay", [lru]), ("diff", [lru])]
    assert result.tool_calls == ["diagnose", "replay", "diff"]
    # the kind comes from the path, not from the model's word "ttl" (which auto-approval would honour)
    assert result.edits == [Edit("eviction", "eviction.l1", "s3fifo", "lru", "planner: replayed")]
    assert result.rationale == "LRU follows the drift."
    assert result.notes == []
    assert len(chat.calls) == 4
    assert chat.offered == [["diagnose", "replay", "diff", "retrain"]] * 4
    # what the model saw of each tool is the loop's own answer
    diagnosed, replayed, diffed = tool_results(chat, 3)
    assert json.loads(diagnosed.content) == [f.to_dict() for f in FINDINGS]
    assert json.loads(replayed.content) == {"edits": [lru.to_dict()], "result": loop.evidence[0], "notes": []}
    assert json.loads(diffed.content)["result"] == diff_policies(base, apply_edits(base, [lru])).text
    assert "-  l1: s3fifo\n+  l1: lru\n" in json.loads(diffed.content)["result"]
    # the first message names the findings and the loop's candidates
    prompt = json.loads(chat.calls[0][1].content)
    assert prompt["policy"] == "chat-prod@7"
    assert [f["kind"] for f in prompt["findings"]] == ["key-drift", "never-hits"]
    assert prompt["candidates"] == [e.to_dict() for e in candidates]
    assert [e["new"] for e in prompt["candidates"]] == ["lru", "arc"]


def test_the_replay_the_model_sees_is_the_real_replay(base: Policy, traffic: list[Any]) -> None:
    loop = LoopTools(base, traffic)
    share = {"path": "tenants.default.l1_share", "new": 1.0}
    chat = scripted(call("replay", {"edits": [share]}, 0), AIMessage('{"rationale": "no gain", "edits": []}'))

    result = Planner(chat).plan(loop.tools(), FINDINGS, [])

    edit = Edit("tenant-share", "tenants.default.l1_share", 0.5, 1.0, "planner")
    cand = apply_edits(base, [edit])
    expected = summarise_evidence(compare(traffic, [(base, None, 0.0)] * 4, [(cand, None, 0.0)] * 4,
                                          measure=1, capacity=CAPACITY))
    (seen,) = tool_results(chat, 1)
    assert json.loads(seen.content)["result"] == expected
    assert expected["requests"] == 200
    assert result == PlannerResult("no gain", [], ["replay"], [])
    assert chat.offered[0] == ["diagnose", "replay", "diff"]  # no retrain step in the loop: not offered


def test_edits_the_base_cannot_take_are_dropped_with_a_note(base: Policy) -> None:
    edits = [
        {"path": "defaults.ttl", "new": "10m", "why": "longer"},
        {"path": "rules.nope.ttl", "new": 60},
        {"path": "guardrails.ttl_max", "new": 10},
        {"path": "rules.sampled.cache", "new": "response"},
        {"path": "rules.free-tier.ttl", "new": 60},
        {"path": "tenants.acme.l1_share", "new": 1.5},
        {"path": "eviction.l1", "new": "belady"},
        {"path": "defaults.ttl", "new": 900},
        {"path": "rules.long-context-greedy.semantic.max_error", "new": 0.01},
        "lower the ttl",
    ]
    chat = scripted(AIMessage(json.dumps({"rationale": "several", "edits": edits})))

    result = Planner(chat).plan(PlannerTools(base, list, list, str), [], [])

    assert result.edits == [
        Edit("ttl", "defaults.ttl", 300.0, 600.0, "planner: longer"),
        Edit("semantic", "rules.long-context-greedy.semantic.max_error", 0.02, 0.01, "planner"),
    ]
    notes = result.notes
    assert notes[:5] == [
        "edit 1 (rules.nope.ttl) dropped: no rule named 'nope'; rules: long-context-greedy, free-tier, "
        "sampled",
        "edit 2 (guardrails.ttl_max) dropped: not an editable path; editable: rules.<rule>.ttl, "
        "rules.<rule>.cache, rules.<rule>.kv.min_tokens, rules.<rule>.semantic.max_error, "
        "rules.<rule>.semantic.threshold, "
        "defaults.ttl, defaults.cache, defaults.kv.min_tokens, defaults.semantic.max_error, "
        "defaults.semantic.threshold, tenants.<tenant>.l1_share, eviction.l1",
        "edit 3 (rules.sampled.cache) dropped: cache may only become 'bypass', got 'response'",
        "edit 4 (rules.free-tier.ttl) dropped: no change: it is 60.0 already",
        "edit 5 (tenants.acme.l1_share) dropped: l1_share 1.5 is outside [0, 1]",
    ]
    assert notes[5].startswith("edit 6 (eviction.l1) dropped: policy chat-prod@8: eviction.l1: unknown "
                               "eviction policy 'belady'; known: ")
    assert notes[6:] == [
        "edit 7 (defaults.ttl) dropped: that path is edited already",
        'edit 9 dropped: not a {path, new, why} object: "lower the ttl"',
    ]
    assert result.rationale == "several"


def test_at_most_four_edits_and_the_guardrails_ttl_range(tmp_path: Path) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text("policy: p\nversion: 3\nrules:\n" + "".join(
        f"  - {{name: r{i}, when: 'true', ttl: 2m}}\n" for i in range(6))
        + "guardrails: {ttl_min: 1m, ttl_max: 10m}\n")
    base = load_policy(policy)
    edits = [{"path": "rules.r0.ttl", "new": "20m"}]
    edits += [{"path": f"rules.r{i}.ttl", "new": 300} for i in range(1, 6)]
    chat = scripted(AIMessage(json.dumps({"rationale": "r", "edits": edits})))

    result = Planner(chat).plan(PlannerTools(base, list, list, str), [], [])

    assert [e.path for e in result.edits] == ["rules.r1.ttl", "rules.r2.ttl", "rules.r3.ttl", "rules.r4.ttl"]
    assert {(e.kind, e.old, e.new) for e in result.edits} == {("ttl", 120.0, 300.0)}
    assert result.notes == [
        "edit 0 (rules.r0.ttl) dropped: a ttl of 1200 s is outside the guardrails' range [60, 600] s",
        "edit 5 (rules.r5.ttl) dropped: at most 4 edits at a time",
    ]


def test_a_replay_of_edits_that_all_fail_never_reaches_the_loop(base: Policy, traffic: list[Any]) -> None:
    loop = LoopTools(base, traffic)
    chat = scripted(call("replay", {"edits": [{"path": "rules.nope.ttl", "new": 5}]}, 0),
                    AIMessage("I found nothing to change."))

    result = Planner(chat).plan(loop.tools(), [], [])

    assert loop.log == []
    (seen,) = tool_results(chat, 1)
    assert json.loads(seen.content) == {
        "error": "no edit passed the checks",
        "notes": ["edit 0 (rules.nope.ttl) dropped: no rule named 'nope'; rules: long-context-greedy, "
                  "free-tier, sampled"]}
    assert result == PlannerResult("I found nothing to change.", [], ["replay"],
                                   ["the answer held no JSON object with edits"])


def test_a_domain_error_of_a_tool_goes_back_to_the_model(base: Policy) -> None:
    def replay(edits: list[Edit]) -> Any:
        raise PlannerError("the windows were rolled over")

    chat = scripted(call("replay", {"edits": [LRU]}, 0),
                    AIMessage(json.dumps({"rationale": "r", "edits": [LRU]})))

    result = Planner(chat).plan(PlannerTools(base, list, replay, str), [], [])

    (seen,) = tool_results(chat, 1)
    assert json.loads(seen.content) == {"error": "PlannerError: the windows were rolled over"}
    assert [e.path for e in result.edits] == ["eviction.l1"]


def test_a_model_that_keeps_calling_tools_is_stopped_at_max_steps(base: Policy, traffic: list[Any]) -> None:
    loop = LoopTools(base, traffic)
    chat = ScriptedChat(reply=lambda n: call("diagnose", {}, n), calls=[], offered=[])

    result = Planner(chat, max_steps=3).plan(loop.tools(), FINDINGS, [])

    assert len(chat.calls) == 3
    assert loop.log == [("diagnose", None)] * 2
    assert result == PlannerResult("stopped after 3 model calls without an answer", [],
                                   ["diagnose", "diagnose"])


def test_a_model_that_fails_gives_no_edits_and_says_why(base: Policy,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    chat = scripted(call("diagnose", {}, 0), ConnectionError("endpoint refused the connection"))

    with caplog.at_level(logging.WARNING, logger="evocache.agents.planner"):
        result = Planner(chat).plan(PlannerTools(base, list, list, str), FINDINGS, [])

    assert result == PlannerResult("planner failed: ConnectionError: endpoint refused the connection", [],
                                   ["diagnose"])
    assert [r.getMessage() for r in caplog.records] == [
        "planner failed after ['diagnose']: ConnectionError: endpoint refused the connection"]


def test_a_tool_bug_ends_the_plan_without_edits(base: Policy) -> None:
    def diagnose() -> Any:
        return {}["findings"]

    chat = scripted(call("diagnose", {}, 0), AIMessage(json.dumps({"rationale": "r", "edits": [LRU]})))

    result = Planner(chat).plan(PlannerTools(base, diagnose, list, str), [], [])

    assert result == PlannerResult("planner failed: KeyError: 'findings'", [], ["diagnose"])
    assert len(chat.calls) == 1


def test_a_model_without_tool_support_gives_no_edits(base: Policy) -> None:
    class NoTools(BaseChatModel):
        @property
        def _llm_type(self) -> str:
            return "no-tools"

        def _generate(self, messages: Any, stop: Any = None, run_manager: Any = None,
                      **kw: Any) -> ChatResult:
            raise AssertionError("never called")

    result = Planner(NoTools()).plan(PlannerTools(base, list, list, str), [], [])

    assert result.edits == [] and result.rationale.startswith("planner failed: NotImplementedError")


def test_max_steps_must_be_a_positive_int() -> None:
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="max_steps must be an int >= 1"):
            Planner(scripted(), max_steps=bad)  # type: ignore[arg-type]


def test_the_answer_is_the_last_top_level_object_with_edits() -> None:
    text = ('First I tried {"path": "x"} by hand.\n```json\n{"rationale": "early", "edits": []}\n```\n'
            'Final:\n{"rationale": "late",\n "edits": [{"path": "eviction.l1", "new": "lru", '
            '"why": {"nested": 1}}]}')
    assert parse_answer(text) == ("late", [{"path": "eviction.l1", "new": "lru", "why": {"nested": 1}}])
    assert parse_answer('{"rationale": "only words"} and {"other": 1}') == ("only words", [])
    assert parse_answer("  no json at all {broken  ") == ("no json at all {broken", None)


# -- configuration -------------------------------------------------------------------------------------------


def stand_in(monkeypatch: pytest.MonkeyPatch, module: str, cls: str) -> list[dict[str, Any]]:
    """A stand-in for a provider package (not installed here): its chat class records its arguments."""
    made: list[dict[str, Any]] = []

    def make(**kwargs: Any) -> ScriptedChat:
        made.append(kwargs)
        return scripted()

    monkeypatch.setitem(sys.modules, module, types.SimpleNamespace(**{cls: make}))
    return made


def test_unset_means_no_planner() -> None:
    assert planner_from_env({}) is None
    assert planner_from_env({"EVOCACHE_PLANNER": "  "}) is None


def test_an_unknown_planner_names_the_variable_and_the_choices() -> None:
    with pytest.raises(PlannerError) as err:
        planner_from_env({"EVOCACHE_PLANNER": "claude"})
    assert str(err.value) == ("EVOCACHE_PLANNER='claude' is not a planner; use one of ollama, openai, "
                              "or leave it unset")


@pytest.mark.parametrize(("provider", "module"),
                         [("openai", "langchain_openai"), ("ollama", "langchain_ollama")])
def test_a_missing_package_names_the_extra(monkeypatch: pytest.MonkeyPatch, provider: str,
                                           module: str) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # import fails, installed or not
    env = {"EVOCACHE_PLANNER": provider, "EVOCACHE_PLANNER_MODEL": "m", "EVOCACHE_PLANNER_API_KEY": "k"}
    with pytest.raises(PlannerError) as err:
        planner_from_env(env)
    assert str(err.value) == (f"EVOCACHE_PLANNER={provider} needs the {module.replace('_', '-')} package: "
                              "pip install 'evocache[planner]'")
    assert EXTRA == "pip install 'evocache[planner]'"


def test_openai_is_made_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    made = stand_in(monkeypatch, "langchain_openai", "ChatOpenAI")
    env = {"EVOCACHE_PLANNER": "OpenAI", "EVOCACHE_PLANNER_BASE_URL": "http://127.0.0.1:8000/v1",
           "EVOCACHE_PLANNER_MODEL": "qwen", "OPENAI_API_KEY": "sk-test", "EVOCACHE_PLANNER_TIMEOUT": "12.5"}

    planner = planner_from_env(env)

    assert isinstance(planner, Planner) and planner.max_steps == 8
    assert made == [{"model": "qwen", "base_url": "http://127.0.0.1:8000/v1", "api_key": "sk-test",
                     "timeout": 12.5, "max_retries": 1, "temperature": 0}]
    planner_from_env({**env, "EVOCACHE_PLANNER_API_KEY": "own", "EVOCACHE_PLANNER_TIMEOUT": ""})
    assert (made[1]["api_key"], made[1]["timeout"]) == ("own", 60.0)


def test_ollama_is_made_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    made = stand_in(monkeypatch, "langchain_ollama", "ChatOllama")

    planner_from_env({"EVOCACHE_PLANNER": "ollama", "EVOCACHE_PLANNER_MODEL": "llama3.1"})

    assert made == [{"model": "llama3.1", "base_url": None, "temperature": 0,
                     "client_kwargs": {"timeout": 60.0}}]


def test_missing_settings_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in(monkeypatch, "langchain_openai", "ChatOpenAI")
    cases = [
        ({"EVOCACHE_PLANNER": "openai", "OPENAI_API_KEY": "k"},
         "EVOCACHE_PLANNER=openai needs EVOCACHE_PLANNER_MODEL (the model to ask)"),
        ({"EVOCACHE_PLANNER": "openai", "EVOCACHE_PLANNER_MODEL": "m"},
         "EVOCACHE_PLANNER=openai needs an API key in EVOCACHE_PLANNER_API_KEY or OPENAI_API_KEY (any value "
         "for an endpoint that asks for none)"),
        ({"EVOCACHE_PLANNER": "openai", "EVOCACHE_PLANNER_MODEL": "m", "OPENAI_API_KEY": "k",
          "EVOCACHE_PLANNER_TIMEOUT": "soon"},
         "EVOCACHE_PLANNER_TIMEOUT='soon': expected seconds, a number > 0"),
        ({"EVOCACHE_PLANNER": "openai", "EVOCACHE_PLANNER_MODEL": "m", "OPENAI_API_KEY": "k",
          "EVOCACHE_PLANNER_TIMEOUT": "0"}, "EVOCACHE_PLANNER_TIMEOUT='0': expected seconds, a number > 0"),
    ]
    for env, message in cases:
        with pytest.raises(PlannerError) as err:
            planner_from_env(env)
        assert str(err.value) == message


def test_a_provider_that_rejects_its_settings_becomes_a_planner_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def reject(**kwargs: Any) -> Any:
        raise ValueError("base_url is not a URL")

    monkeypatch.setitem(sys.modules, "langchain_ollama", types.SimpleNamespace(ChatOllama=reject))
    with pytest.raises(PlannerError) as err:
        planner_from_env({"EVOCACHE_PLANNER": "ollama", "EVOCACHE_PLANNER_MODEL": "m"})
    assert str(err.value) == "EVOCACHE_PLANNER=ollama: cannot make the chat model: base_url is not a URL"


@pytest.mark.slow
@pytest.mark.parametrize(
    "command",
    [
        ["agent", "run", "--trace", "missing.jsonl", "--policy", "missing.yaml"],
        ["agent", "watch", "--events", "missing.jsonl"],
        ["demo", "--workdir", "demo"],
    ],
)
def test_a_misconfigured_planner_stops_each_loop_command_before_it_reads_or_starts_anything(
    command: list[str], tmp_path: Path
) -> None:
    import os
    import subprocess

    env = {**os.environ, "EVOCACHE_PLANNER": "openai", "EVOCACHE_PLANNER_MODEL": ""}
    done = subprocess.run([sys.executable, "-m", "evocache.cli", *command], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "EVOCACHE_PLANNER" in done.stderr and "evocache[planner]" in done.stderr.replace("\n", "")
    assert list(tmp_path.iterdir()) == []  # no workdir made, no demo started


def test_a_tenant_without_its_own_entry_is_offered_shares_below_the_default_one_it_runs_with():
    doc = """
policy: shares
version: 1
rules:
  - name: all
    when: true
tenants:
  default: {l1_share: 0.5}
  acme: {l1_share: 0.2}
"""
    from evocache.dsl import parse_policy

    base = parse_policy(doc)
    pushed = [Finding(kind="push-out", summary="pushes others out", window=3, windows=(1, 3),
                      subject={"tenant": tenant}) for tenant in ("batch", "acme")]
    shares = [(e.path, e.old, e.new) for e in candidate_edits(base, pushed, []) if e.kind == "tenant-share"]
    assert shares == [("tenants.batch.l1_share", 0.5, 0.1), ("tenants.batch.l1_share", 0.5, 0.25),
                      ("tenants.acme.l1_share", 0.2, 0.1)]
