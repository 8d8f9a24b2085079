"""A policy names the trained eviction model L1 starts from (``eviction.model``, a file in the store's
``l1.models`` directory): the language checks the name, the runtime loads it when it builds or activates the
policy, and a file it cannot use refuses the policy whole, the one in force staying as it was."""

from __future__ import annotations

import dataclasses
import functools
import json
import random
from pathlib import Path

import pytest

from evocache.controller import L1Config, StoreConfig, StoreConfigError, build_runtime, check_policy
from evocache.controller.eviction import LearnedModel, LearnedPolicy, LearnedTraining
from evocache.controller.eviction import _model as model_module
from evocache.controller.replay import replay
from evocache.controller.replay._access import Access
from evocache.dsl import PolicyError, parse_policy


def policy_text(eviction: str, version: int = 1) -> str:
    return (
        f"policy: chat\nversion: {version}\n"
        "rules:\n  - name: all\n    when: 'true'\n    cache: response\n    ttl: 60s\n"
        f"eviction:\n{eviction}"
    )


def learned(model: str | None, version: int = 1):
    line = f"  model: {model}\n" if model is not None else ""
    return parse_policy(policy_text(f"  l1: learned\n{line}", version), "chat.yaml")


@functools.cache
def trained() -> LearnedModel:
    """A model fitted on prefix-chain accesses: a few chains return, most come once."""
    rng = random.Random(1)
    trace, t = [], 0.0
    for req in range(400):
        head = rng.randrange(12) if rng.random() < 0.6 else 1000 + req
        for pos in range(1 + rng.randrange(10)):
            trace.append(Access(t, f"{head}:{pos}", 1, "", "", req, pos))
        t += 1.0
    built: list[LearnedPolicy] = []

    def make(**kw):
        built.append(LearnedPolicy(capacity=20, training=LearnedTraining(retrain_every=300), **kw))
        return built[0]

    replay(trace, make, capacity_objects=20)
    assert built[0].model is not None
    return built[0].model


@pytest.fixture
def models(tmp_path: Path) -> Path:
    directory = tmp_path / "models"
    directory.mkdir()
    trained().save(directory / "chat-eviction-v1.json")
    return directory


def store(models: Path | None) -> StoreConfig:
    return StoreConfig(l1=L1Config(bytes=1 << 20, models=None if models is None else str(models)), redis=None)


def l1_policy(runtime) -> LearnedPolicy:
    policy = runtime.l1.policy
    assert isinstance(policy, LearnedPolicy)
    return policy


def test_a_built_runtime_starts_its_learned_policy_from_the_named_file(models: Path) -> None:
    runtime = build_runtime(store(models), policy=learned("chat-eviction-v1.json"))
    try:
        started = l1_policy(runtime).model
        assert started is not None
        # the file's model, rebased to this policy's access count (``tick``): fresh when it arrives
        assert dataclasses.replace(started.window, tick=0) == dataclasses.replace(trained().window, tick=0)
    finally:
        runtime.close()


def test_activation_switches_the_model_and_a_policy_without_one_starts_from_nothing(models: Path) -> None:
    trained().save(models / "chat-eviction-v2.json")
    runtime = build_runtime(store(models), policy=learned(None))
    try:
        assert l1_policy(runtime).model is None
        first = l1_policy(runtime)
        runtime = runtime.activate(learned("chat-eviction-v2.json", version=2))
        assert l1_policy(runtime) is not first and l1_policy(runtime).model is not None
        second = l1_policy(runtime)
        runtime = runtime.activate(learned("chat-eviction-v2.json", version=3))  # same class, same file
        assert l1_policy(runtime) is second
    finally:
        runtime.close()


def bad(models: Path, how: str) -> str:
    path = models / "chat-eviction-v9.json"
    if how == "missing":
        return path.name
    if how == "not json":
        path.write_text("{not json")
    elif how == "not a model":
        path.write_text(json.dumps({"format": "something-else"}))
    elif how == "other features":
        doc = json.loads((models / "chat-eviction-v1.json").read_text())
        doc["features"] = ["age"]
        path.write_text(json.dumps(doc))
    elif how == "broken booster":
        doc = json.loads((models / "chat-eviction-v1.json").read_text())
        doc["booster"] = {"learner": "nonsense"}
        path.write_text(json.dumps(doc))
    elif how == "binary":
        path.write_bytes(b"\xff\xfe\x00model")
    return path.name


@pytest.mark.parametrize(
    ("how", "says"),
    [
        ("missing", "No such file"),
        ("not json", "not JSON"),
        ("not a model", "not an evocache learned eviction model"),
        ("other features", "trained on features"),
        ("broken booster", "the booster cannot be read"),
        ("binary", "not UTF-8"),
    ],
)
def test_a_file_it_cannot_use_refuses_the_policy_and_the_one_in_force_stays(
    models: Path, how: str, says: str
) -> None:
    name = bad(models, how)
    runtime = build_runtime(store(models), policy=learned("chat-eviction-v1.json"))
    try:
        before = l1_policy(runtime)
        with pytest.raises(StoreConfigError, match=rf"chat@2: eviction\.model: .*{says}"):
            runtime.activate(learned(name, version=2))
        assert l1_policy(runtime) is before and runtime.policy.version == 1
        with pytest.raises(StoreConfigError, match=says):
            build_runtime(store(models), policy=learned(name, version=2))
    finally:
        runtime.close()


def test_a_file_over_the_size_bound_is_refused_before_it_is_read(
    models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(model_module, "MAX_MODEL_BYTES", 100)
    with pytest.raises(StoreConfigError, match="larger than 100 bytes"):
        check_policy(learned("chat-eviction-v1.json"), store(models))


def test_a_store_without_a_models_directory_refuses_a_policy_that_names_one() -> None:
    with pytest.raises(StoreConfigError, match=r"chat@1: eviction\.model: .*no l1\.models directory"):
        check_policy(learned("chat-eviction-v1.json"), store(None))
    check_policy(learned("chat-eviction-v1.json"))  # without a store: the document alone is valid


@pytest.mark.parametrize(
    ("eviction", "where", "says"),
    [
        ("  l1: lru\n  model: m.json\n", "chat.yaml:10:10: eviction.model", "needs l1: learned, not l1: lru"),
        ("  l1: learned\n  model: ../m.json\n", "chat.yaml:10:10: eviction.model", "not a model file name"),
        ("  l1: learned\n  model: /etc/m.json\n", "chat.yaml:10:10: eviction.model", "not a model file name"),
        ("  l1: learned\n  model: m.pkl\n", "chat.yaml:10:10: eviction.model", "ending in '.json'"),
        ("  l1: learned\n  model: 3\n", "chat.yaml:10:10: eviction.model", "string"),
    ],
)
def test_the_language_checks_the_model_name_where_it_is_written(eviction: str, where: str, says: str) -> None:
    with pytest.raises(PolicyError) as caught:
        parse_policy(policy_text(eviction), "chat.yaml")
    text = str(caught.value)
    assert where in text and says in text


def test_a_fifo_at_the_model_path_is_refused_not_waited_on(models: Path) -> None:
    import os

    os.mkfifo(models / "chat-eviction-v9.json")
    with pytest.raises(StoreConfigError, match=r"eviction\.model: .*not a regular file"):
        check_policy(learned("chat-eviction-v9.json"), store(models))
