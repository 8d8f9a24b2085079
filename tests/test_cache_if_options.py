"""cache_if's options: the everyday keywords, the Admission and SemanticOptions groups, and what is refused."""

from __future__ import annotations

import pytest

from evocache.controller import Admission, ContractError, SemanticOptions, cache_if
from evocache.controller._contract import Options
from evocache.controller._semantic import JudgeLimits


def test_the_everyday_call_needs_no_group(rt):
    @cache_if("len(prompt) < 100", ttl="10m", model="m", model_revision="r", prompt_template="Q: {prompt}",
              name="echo", store=rt)
    def echo(prompt: str) -> str:
        return prompt

    assert echo("a") == "a" and echo("a") == "a"
    assert echo.cache_info().hits == 1
    options = echo.cached_function.contract.options
    assert options == Options(ttl=600.0, sliding=False, tiers=None, max_entry_bytes=None, allow_sampling=False,
                              stream=True, semantic=None)


def test_an_admission_and_its_mapping_decide_alike(rt):
    as_object = Admission(sliding=True, tiers=["l1"], max_entry_bytes=64, allow_sampling=True, stream=False)
    as_mapping = {"sliding": True, "tiers": ("l1",), "max_entry_bytes": 64, "allow_sampling": True,
                  "stream": False}
    assert Admission.of(as_mapping) == as_object
    assert as_object.tiers == ("l1",)
    options = Options.validated(10, as_object)
    assert options == Options(ttl=10.0, sliding=True, tiers=("l1",), max_entry_bytes=64, allow_sampling=True,
                              stream=False, semantic=None)


@pytest.mark.parametrize(
    ("keyword", "place"),
    [
        ("sliding", "admission=Admission(sliding=...)"),
        ("tiers", "admission=Admission(tiers=...)"),
        ("max_entry_bytes", "admission=Admission(max_entry_bytes=...)"),
        ("allow_sampling", "admission=Admission(allow_sampling=...)"),
        ("stream", "admission=Admission(stream=...)"),
        ("semantic_text", "semantic=SemanticOptions(text=...)"),
        ("judge", "semantic=SemanticOptions(judge=...)"),
        ("judge_links", "semantic=SemanticOptions(judge_links=...)"),
    ],
)
def test_a_keyword_that_moved_into_a_group_names_its_new_place(keyword, place):
    with pytest.raises(TypeError) as err:
        cache_if("true", **{keyword: None})
    assert str(err.value) == f"cache_if({keyword}=...) is now cache_if({place})"


def test_a_misspelt_option_is_a_type_error_listing_the_options():
    with pytest.raises(TypeError) as err:
        cache_if("true", tll="5m")
    assert str(err.value) == (
        "cache_if() got an unexpected keyword argument 'tll'; its options: ['ttl', 'model', 'model_revision', "
        "'prompt_template', 'name', 'ignore', 'store', 'serializer', 'admission', 'semantic', 'call_param']"
    )
    with pytest.raises(TypeError, match="unexpected keyword argument 'slidng'"):
        Admission(slidng=True)
    with pytest.raises(TypeError) as err:
        cache_if("true", admission={"slidng": True})
    assert str(err.value) == (
        "admission: unknown option(s) ['slidng']; known: ['sliding', 'tiers', 'max_entry_bytes', "
        "'allow_sampling', 'stream']"
    )
    with pytest.raises(TypeError) as err:
        cache_if("true", semantic={"max_eror": 0.02})
    assert str(err.value) == (
        "semantic: unknown option(s) ['max_eror']; known: ['max_error', 'mode', 'explore', 'threshold', 'text', "
        "'text_forms', 'judge', 'judge_links', 'judge_budget']"
    )


def test_a_group_of_the_wrong_type_is_a_type_error():
    with pytest.raises(TypeError, match=r"admission= takes Admission\(\.\.\.\) or a mapping of its .*, got list"):
        cache_if("true", admission=["l1"])
    with pytest.raises(TypeError, match=r"semantic= takes SemanticOptions\(\.\.\.\) or a mapping .*, got float"):
        cache_if("true", semantic=0.02)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"sliding": "yes"}, "admission: sliding must be a bool, got 'yes'"),
        ({"stream": 1}, "admission: stream must be a bool, got 1"),
        ({"tiers": "l1"}, "admission: tiers must be a list of tier names, got 'l1'"),
        ({"tiers": ["l1", "l4"]}, "admission: tiers: unknown ['l4']; known: ['l1', 'l2', 'l3']"),
        ({"tiers": []}, "admission: tiers: unknown []; known: ['l1', 'l2', 'l3']"),
        ({"max_entry_bytes": 0}, "admission: max_entry_bytes must be a positive int or None, got 0"),
        ({"max_entry_bytes": 1.5}, "admission: max_entry_bytes must be a positive int or None, got 1.5"),
        ({"max_entry_bytes": True}, "admission: max_entry_bytes must be a positive int or None, got True"),
    ],
)
def test_a_bad_admission_value_is_a_contract_error_naming_it(fields, message):
    with pytest.raises(ContractError) as err:
        Admission(**fields)
    assert str(err.value) == message


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"mode": "static"}, "semantic: ['mode'] need a max_error"),
        ({"max_error": 0.9}, "semantic: "),
        ({"judge": "=="}, "semantic: judge must be callable, got '=='"),
        ({"judge_links": -1}, "semantic: judge_links must be an int >= 0 or None, got -1"),
        ({"judge_links": True}, "semantic: judge_links must be an int >= 0 or None, got True"),
        ({"judge_budget": 0.5}, "semantic: judge_budget must be a number of judge calls per lookup >= 1, or None"),
        ({"judge_budget": float("inf")}, "semantic: judge_budget must be a number of judge calls per lookup >= 1"),
        ({"judge_budget": "2"}, "semantic: judge_budget must be a number of judge calls per lookup >= 1"),
        ({"text": 3}, "semantic: text must be a parameter name, got 3"),
    ],
)
def test_a_bad_semantic_value_is_a_contract_error_naming_it(fields, message):
    with pytest.raises(ContractError) as err:
        SemanticOptions(**fields)
    assert str(err.value).startswith(message)


def test_semantic_options_resolve_the_spec_once():
    options = SemanticOptions(max_error=0.02, judge=min, judge_links=2, text="question")
    assert options.spec is not None and options.spec.mode == "bounded" and options.spec.max_error == 0.02
    assert SemanticOptions.of({"max_error": 0.02, "judge": min, "judge_links": 2, "text": "question"}) == options
    assert SemanticOptions(max_error=0).spec is None  # 0 switches matching off
    assert SemanticOptions(judge=min).spec is None  # a judge for the rules of a policy, matching off without one


def test_semantic_text_and_judge_reach_the_function_without_a_spec(rt):
    @cache_if("true", semantic={"text": "question", "judge": min, "judge_links": 0, "judge_budget": 3}, store=rt)
    def ask(question: str) -> str:
        return question

    cached = ask.cached_function
    assert cached.contract.semantic_text == "question" and cached.contract.options.semantic is None
    assert cached.judge is min and cached.judge_limits == JudgeLimits(links=0, budget=3.0)
    assert SemanticOptions().judge_budget == 2.0 and SemanticOptions(judge_budget=None).judge_budget is None
