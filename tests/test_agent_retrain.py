"""The loop's retrain step on the first 2,400 requests of the Mooncake trace: a model trained on the head
and kept only when it beats the policy in force on the held-back tail, with real xgboost and the real
simulator."""

from __future__ import annotations

import dataclasses
import gzip
import json
import logging
import math
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from evocache.agents._candidates import apply_edits
from evocache.agents._evidence import arm_metrics
from evocache.agents._retrain import MIN_HOLDOUT_REQUESTS, MIN_TRAIN_REQUESTS, RetrainResult, retrain
from evocache.agents._types import Request
from evocache.controller.replay import PolicySimulator as Simulator
from evocache.agents._workload import read_requests
from evocache.controller import StoreConfigError
from evocache.controller.eviction import LearnedModel, LearnedTraining
from evocache.dsl import Policy, parse_policy, policy_to_yaml

DATA = Path(__file__).parent / "data" / "agents_diag" / "mooncake_head2400.jsonl.gz"
BLOCK = 512  # tokens per Mooncake block: the size of every key


def policy(eviction: str) -> Policy:
    text = f"policy: kv-chat\nversion: 3\neviction: {{l1: {eviction}, fallback: lru}}\n"
    return parse_policy(text, "<test>")


def capacity(requests: Sequence[Request], share: float) -> int:
    """``share`` of the distinct blocks ``requests`` ask for, in tokens."""
    return int(share * len({k for r in requests for k in r.keys})) * BLOCK


@pytest.fixture(scope="module")
def mooncake(tmp_path_factory: pytest.TempPathFactory) -> list[Request]:
    path = tmp_path_factory.mktemp("retrain") / "mooncake.jsonl"
    with gzip.open(DATA, "rt", encoding="utf-8") as src:
        path.write_text(src.read())
    requests = read_requests(path)
    assert len(requests) == 2400
    return requests


@pytest.fixture(scope="module")
def kept(mooncake: list[Request], tmp_path_factory: pytest.TempPathFactory) -> tuple[RetrainResult, Path]:
    """Retrained against LRU with 3 % of the slice's blocks: the case where the model wins."""
    model_dir = tmp_path_factory.mktemp("models")
    return retrain(mooncake, policy("lru"), capacity=capacity(mooncake, 0.03), model_dir=model_dir), model_dir


@pytest.mark.slow  # ends with `evocache policy check` in a subprocess
def test_a_model_that_beats_lru_is_kept_as_json_with_a_policy_that_passes_check(
        kept: tuple[RetrainResult, Path], mooncake: list[Request], tmp_path: Path) -> None:
    result, model_dir = kept
    assert result.kept, result.reason
    assert (result.train_requests, result.holdout_requests) == (1680, 720)
    assert result.evidence is not None
    low, high = result.evidence.ci
    assert 0 < low <= result.evidence.gain <= high
    assert result.new_hit_ratio > result.base_hit_ratio
    assert result.evidence.gain == pytest.approx(result.new_hit_ratio - result.base_hit_ratio)
    assert result.reason.startswith("the new model beats the policy in force")

    # the base arm is the policy in force replayed from a cold cache over the head, counted over the tail
    base = Simulator(policy("lru"), capacity(mooncake, 0.03))
    base.run(mooncake[:1680])
    tail = mooncake[1680:]
    assert result.base_hit_ratio == arm_metrics(tail, base.run(tail)).hit_ratio

    assert result.model_path == model_dir / "kv-chat-eviction-v1.json"
    assert sorted(p.name for p in model_dir.iterdir()) == ["kv-chat-eviction-v1.json"]
    doc = json.loads(result.model_path.read_text())
    assert doc["format"] == "evocache-learned-eviction"
    assert doc["window"]["samples"] > doc["window"]["positives"] > 0
    loaded = LearnedModel.load(result.model_path, features=LearnedTraining().features)
    assert loaded.features == tuple(doc["features"])

    # the candidate names the file: a store (or replay) with that models directory starts from it
    assert result.edit is not None and result.edit.to_dict()["path"] == "eviction"
    assert result.edit.old == {"l1": "lru", "model": None}
    assert result.edit.new == {"l1": "learned", "model": "kv-chat-eviction-v1.json"}
    assert result.policy is not None and result.policy == apply_edits(policy("lru"), [result.edit])
    assert (result.policy.eviction.l1, result.policy.eviction.model, result.policy.version) == (
        "learned", "kv-chat-eviction-v1.json", 4)
    started = Simulator(result.policy, capacity(mooncake, 0.03), models=model_dir)
    assert started._eviction.model is not None
    assert started._eviction.model.window.samples == loaded.window.samples
    with pytest.raises(StoreConfigError, match=r"kv-chat@4: eviction\.model: no models directory"):
        Simulator(result.policy, capacity(mooncake, 0.03))
    file = tmp_path / "candidate.yaml"
    file.write_text(policy_to_yaml(result.policy))
    done = subprocess.run([sys.executable, "-m", "evocache.cli", "policy", "check", str(file)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr

    plain = json.loads(json.dumps(result.to_dict()))
    assert plain["kept"] is True and plain["model_path"] == str(result.model_path)
    assert plain["policy"]["eviction"] == {"l1": "learned", "fallback": "lru", "model": "kv-chat-eviction-v1.json"}
    assert plain["evidence"]["requests"] == 720


def test_the_same_seed_trains_the_same_model_and_the_next_one_takes_the_next_version(
        kept: tuple[RetrainResult, Path], mooncake: list[Request]) -> None:
    first, model_dir = kept
    again = retrain(mooncake, policy("lru"), capacity=capacity(mooncake, 0.03), model_dir=model_dir, seed=0)
    assert again.model_path == model_dir / "kv-chat-eviction-v2.json"
    assert again.model_path.read_bytes() == first.model_path.read_bytes()
    again.model_path.unlink()
    assert again.edit is not None and again.edit.new == {"l1": "learned", "model": "kv-chat-eviction-v2.json"}
    assert dataclasses.replace(again, model_path=first.model_path, edit=first.edit, policy=first.policy) == first


def test_a_model_is_not_kept_against_the_online_learned_policy(mooncake: list[Request],
                                                                tmp_path: Path) -> None:
    # The policy in force already learns, and retrains on the tail as it goes: one model fitted on the head
    # does worse over the tail, and its file goes.
    head = mooncake[:800]
    result = retrain(head, policy("learned"), capacity=capacity(head, 0.1), model_dir=tmp_path)
    assert not result.kept
    assert result.model_path is None and list(tmp_path.iterdir()) == []
    assert result.new_hit_ratio < result.base_hit_ratio
    assert result.evidence is not None and result.evidence.ci[0] <= 0
    assert result.reason.startswith("the new model does not beat the policy in force")
    assert result.policy is not None and result.policy.eviction.l1 == "learned"
    assert result.policy.eviction.model is None  # the file went, so the candidate names none


def test_over_a_policy_already_on_a_trained_model_the_newer_model_is_judged_against_it(
        kept: tuple[RetrainResult, Path], mooncake: list[Request], tmp_path: Path) -> None:
    first, model_dir = kept
    assert first.policy is not None
    # the base arm starts from the kept model, read from the same directory the newer one is written to
    again = retrain(mooncake, first.policy, capacity=capacity(mooncake, 0.03), model_dir=model_dir)
    assert again.edit is not None
    assert again.edit.old == {"l1": "learned", "model": "kv-chat-eviction-v1.json"}
    base = Simulator(first.policy, capacity(mooncake, 0.03), models=model_dir)
    base.run(mooncake[:1680])
    tail = mooncake[1680:]
    assert again.base_hit_ratio == arm_metrics(tail, base.run(tail)).hit_ratio
    if again.kept:
        assert again.policy is not None and again.policy.eviction.model == again.model_path.name
        again.model_path.unlink()
    else:
        assert again.model_path is None
    assert sorted(p.name for p in model_dir.iterdir()) == ["kv-chat-eviction-v1.json"]


def test_a_held_back_tail_that_never_returns_cannot_be_helped(mooncake: list[Request],
                                                              tmp_path: Path) -> None:
    # Every block of the tail is asked for once and never before: no eviction order can turn one into a hit.
    head = mooncake[:600]
    cut = round(len(head) * 0.7)
    once = [dataclasses.replace(r, keys=tuple(f"once-{i}-{j}" for j in range(len(r.keys))))
            for i, r in enumerate(head[cut:])]
    result = retrain(head[:cut] + once, policy("lru"), capacity=capacity(head, 0.05), model_dir=tmp_path)
    assert not result.kept
    assert (result.base_hit_ratio, result.new_hit_ratio) == (0.0, 0.0)
    assert result.evidence is not None
    assert result.evidence.gain == 0.0 and result.evidence.ci == (0.0, 0.0)
    assert result.model_path is None and list(tmp_path.iterdir()) == []


def test_too_few_requests_are_not_retrained_on(mooncake: list[Request], tmp_path: Path) -> None:
    model_dir = tmp_path / "models"
    few = retrain(mooncake[:120], policy("lru"), capacity=BLOCK * 64, model_dir=model_dir)
    assert not few.kept and few.model_path is None and few.policy is None
    assert (few.train_requests, few.holdout_requests) == (84, 36)
    assert few.reason == ("too few requests to retrain: 120 split into 84 to train on and 36 held back; "
                          f"need at least {MIN_TRAIN_REQUESTS} and {MIN_HOLDOUT_REQUESTS}")
    assert math.isnan(few.base_hit_ratio) and few.to_dict()["base_hit_ratio"] is None
    short_tail = retrain(mooncake[:200], policy("lru"), capacity=BLOCK * 64, model_dir=model_dir, holdout=0.1)
    assert not short_tail.kept and (short_tail.train_requests, short_tail.holdout_requests) == (180, 20)
    assert not model_dir.exists()


def test_traffic_that_never_returns_labels_nothing_to_train_on(tmp_path: Path) -> None:
    fresh = [Request(t=float(i), kind="kv", keys=(f"b{i}-0", f"b{i}-1"), size=BLOCK) for i in range(200)]
    result = retrain(fresh, policy("lru"), capacity=BLOCK * 16, model_dir=tmp_path)
    assert not result.kept and result.model_path is None and list(tmp_path.iterdir()) == []
    assert result.reason.startswith("the training part labelled no samples of both classes")


def test_a_failing_trainer_is_a_reason_and_a_log_line(mooncake: list[Request], tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    head = mooncake[:400]
    refused = LearnedTraining(depth=2**31)  # a valid int here, beyond what xgboost takes for max_depth
    with caplog.at_level(logging.WARNING, logger="evocache.agents"):
        result = retrain(head, policy("lru"), capacity=capacity(head, 0.05), model_dir=tmp_path,
                         training=refused)
    assert not result.kept and result.model_path is None and list(tmp_path.iterdir()) == []
    assert result.reason.startswith("the trainer failed: ") and "max_depth" in result.reason
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["retrain"]


@pytest.mark.parametrize("holdout", [0, 1, 1.5, -0.2, True])
def test_a_holdout_outside_the_unit_interval_is_refused(holdout: float, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="holdout must be a share in"):
        retrain([], policy("lru"), capacity=BLOCK, model_dir=tmp_path, holdout=holdout)
