"""The error model's prior: the shipped artefact, its format, how a rule's model starts from it and pools it."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import numpy as np
import pytest
from evocache.controller.errors import SemanticError
from evocache.controller.semantic import SemanticCache
from evocache.controller.semantic._bench import StreamRow, VectorTable
from evocache.controller.semantic._error_model import _RAISING_FEATURES, ErrorModel
from evocache.controller.semantic._index import Scope
from evocache.controller.semantic._neighbourhood import FEATURES
from evocache.controller.semantic._policies import BoundedPolicy, PolicyOptions
from evocache.controller.semantic._prior import (
    FORMAT,
    FORMAT_VERSION,
    SHIPPED_PRIOR,
    ErrorPrior,
    load_prior,
    shipped_prior,
)

ROOT = Path(__file__).resolve().parents[1]
DELTA = 0.02


def test_the_shipped_prior_is_json_of_the_declared_format_with_its_provenance() -> None:
    doc = json.loads(SHIPPED_PRIOR.read_text(encoding="utf-8"))
    assert (doc["format"], doc["version"], doc["features"]) == (FORMAT, FORMAT_VERSION, list(FEATURES))
    assert {d["name"]: d["licence"] for d in doc["fitted_on"]} == {
        "banking77": "CC BY 4.0", "clinc150": "CC BY 3.0", "fow_traps": "CC BY 4.0"
    }
    assert all(d["source"] and (ROOT / d["file"]).is_file() for d in doc["fitted_on"])
    prior = shipped_prior()
    assert prior.features == FEATURES and prior.strength > 0
    assert all(prior.coef[FEATURES.index(name)] >= 0 for name in _RAISING_FEATURES)
    assert np.allclose(prior.information, prior.information.T)
    assert np.all(np.linalg.eigvalsh(prior.information) > -1e-9)  # an information matrix: never negative
    assert ErrorPrior.from_json(prior.to_json()).to_json() == prior.to_json()  # written as read


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(version=FORMAT_VERSION + 1), "format version 2; this evocache reads version 1"),
        (lambda d: d.update(format="other"), "not an evocache semantic error prior"),
        (lambda d: d.update(features=d["features"][:-1]), "fitted on features"),
        (lambda d: d.update(coef=d["coef"][:-1]), "coef must be a list of 23 finite numbers"),
        (lambda d: d.update(scale=[0.0] * len(d["scale"])), "scale must be positive"),
        (lambda d: d.update(information=[[1.0]]), "information must be a symmetric positive semi-definite 24 x 24 matrix"),
        (lambda d: d["coef"].__setitem__(FEATURES.index("negation_differs"), -1.0), "can only raise the error"),
        (lambda d: d.update(strength=-1), "strength must be a finite number >= 0"),
        (lambda d: d["information"][0].__setitem__(0, -1e3), "positive semi-definite"),
    ],
)
def test_a_prior_of_another_version_or_with_broken_numbers_is_a_clear_error(tmp_path, change, message) -> None:
    doc = json.loads(SHIPPED_PRIOR.read_text(encoding="utf-8"))
    change(doc)
    path = tmp_path / "prior.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(SemanticError, match=message) as err:
        ErrorPrior.load(path)
    assert str(path) in str(err.value)


def test_a_corrupt_prior_file_is_a_clear_error(tmp_path) -> None:
    path = tmp_path / "prior.json"
    path.write_text(SHIPPED_PRIOR.read_text(encoding="utf-8")[:200])
    with pytest.raises(SemanticError, match=f"{path}: not JSON"):
        BoundedPolicy(prior=path)


def _stream(n: int, seed: int, groups: int = 24, dim: int = 48) -> tuple[list[StreamRow], np.ndarray]:
    """A labelled stream: groups in pairs of nearby topics (a neighbour of the other group of its pair is a
    plausible wrong answer), each prompt near its group's centre, with words of its own."""
    words = ["card", "account", "transfer", "refund", "balance", "pin", "limit", "fee", "payment", "loan", "statement", "branch"]
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(groups // 2, dim)).repeat(2, axis=0) + 0.8 * rng.normal(size=(groups, dim))
    rows, vecs = [], []
    for i in range(n):
        g = int(rng.integers(groups))
        v = centres[g] + 0.35 * np.linalg.norm(centres[g]) / np.sqrt(dim) * rng.normal(size=dim)
        tag = "".join("abcdefghijklmnopqrstuvwxyz"[int(d)] for d in f"{i:04d}")  # no two prompts alike
        text = " ".join([words[g % len(words)], *rng.choice(words, 3), tag])
        rows.append(StreamRow(text, f"g{g}"))
        vecs.append(v / np.linalg.norm(v))
    return rows, np.asarray(vecs, dtype=np.float32)


def _replay(rows: list[StreamRow], vecs: np.ndarray, policy: BoundedPolicy, scope: Scope,
            cache: SemanticCache | None = None) -> tuple[int, int, int | None, SemanticCache]:
    """(hits, wrong hits, index of the first hit, the cache), replaying ``rows`` in ``scope``."""
    if cache is None:
        cache = SemanticCache(VectorTable([r.prompt for r in rows], vecs, "synthetic"), policy=policy,
                              rng=random.Random(0))
    hits = wrong = 0
    first = None
    for i, row in enumerate(rows):
        decision, entry = cache.lookup(scope, row.prompt, max_error=DELTA)
        if entry is not None:
            hits += 1
            wrong += cache.answer_ref(entry) != row.group
            first = i if first is None and decision.est_error > 0 else first  # a semantic hit, not an exact one
        else:
            cache.insert(scope, f"{scope.namespace}-{i}", row.prompt, row.group)
            cache.judge_miss(scope, row.prompt, row.group, decision)
    return hits, wrong, first, cache


@pytest.mark.parametrize("seed", [0, 2])
def test_a_new_scope_with_the_prior_serves_earlier_within_the_bound(seed) -> None:
    rows, vecs = _stream(400, seed)
    scope = Scope("tenant", "fresh")
    bare = _replay(rows, vecs, BoundedPolicy(prior=None), scope)
    primed = _replay(rows, vecs, PolicyOptions().build(), scope)  # a rule's policy: the shipped prior
    assert primed[2] is not None and (bare[2] is None or primed[2] < bare[2])
    for hits, wrong, _, _ in (bare, primed):
        assert wrong <= DELTA * len(rows)
    assert primed[0] > 0


def test_the_prior_is_shared_knowledge_never_shared_entries() -> None:
    rows, vecs = _stream(300, 1)
    table = VectorTable([r.prompt for r in rows], vecs, "synthetic")
    one, two = PolicyOptions().build(), PolicyOptions().build()
    assert one.model.prior is two.model.prior  # the same prior, read once
    before = one.model.prior.to_json()
    cache = SemanticCache(table, policy=one, rng=random.Random(0))
    a, b = Scope("tenant-a", "x"), Scope("tenant-b", "x")
    _replay(rows, vecs, one, a, cache)
    assert one.model.fits > 0 and one.model.prior.to_json() == before  # learning moved the model, not the prior
    x = np.asarray(one.model.prior.mean)[None, :]
    assert one.model.predict(x) != two.model.predict(x)  # the other rule's model did not learn it
    # Tenant b asks what tenant a stored: nothing of a's is ever a neighbour, served or linked.
    served_from_a = 0
    for i, row in enumerate(rows[:100]):
        decision, entry = cache.lookup(b, row.prompt, max_error=DELTA)
        assert decision.neighbour is None or decision.neighbour.startswith("tenant-b")
        served_from_a += entry is not None and not entry.startswith("tenant-b")
        if entry is None:
            cache.insert(b, f"tenant-b-{i}", row.prompt, row.group)
            cache.judge_miss(b, row.prompt, row.group, decision)
    assert served_from_a == 0


def test_a_model_with_much_evidence_moves_away_from_the_prior() -> None:
    prior = shipped_prior()
    rng = np.random.default_rng(0)
    x = prior.mean + prior.scale * rng.normal(size=(3000, len(FEATURES))) * 0.3
    for name in _RAISING_FEATURES:  # flags stay flags
        x[:, FEATURES.index(name)] = 0.0
    truth = np.full(len(x), 0.3)  # errors at 30 %, whatever the features say
    weak, strong = ErrorModel(prior=prior.with_strength(10.0)), ErrorModel(prior=prior.with_strength(1e6))
    for model in (weak, strong):
        for row, wrong in zip(x, rng.random(len(x)) < truth, strict=True):
            model.observe(row, bool(wrong))
    assert abs(weak.predict(x).mean() - 0.3) < 0.05  # its own evidence
    assert abs(strong.predict(x).mean() - prior.predict(x).mean()) < 0.02  # a prior worth a million: held
    assert all(weak._coef[FEATURES.index(name)] >= 0 for name in _RAISING_FEATURES)


def test_with_the_prior_a_model_is_ready_before_any_verdict_and_without_it_is_not() -> None:
    assert ErrorModel(prior=shipped_prior()).ready
    assert not ErrorModel().ready and not BoundedPolicy(prior=None).model.ready
    assert PolicyOptions(prior=None).build().model.prior is None
    assert BoundedPolicy(prior=SHIPPED_PRIOR).model.prior is load_prior(SHIPPED_PRIOR)


def _fit_script():
    spec = importlib.util.spec_from_file_location("semantic_prior", ROOT / "bench" / "semantic_prior.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_refit_is_deterministic_on_a_small_slice() -> None:
    script = _fit_script()

    def once() -> str:
        sets = {}
        for name, seed in (("banking77", 3), ("clinc150", 4)):
            rows, vecs = _stream(250, seed)
            table = VectorTable([r.prompt for r in rows], vecs, "synthetic")
            x, y, n = script.collect(rows, table, 0)
            sets[name] = script.Observations(np.asarray(x), np.asarray(y), n, len(rows))
        return script.fit(sets, 100.0, "synthetic", 250).to_json()

    first = once()
    assert first == once()
    prior = ErrorPrior.from_json(first)
    assert [d["name"] for d in prior.fitted_on] == ["banking77", "clinc150"] and prior.strength == 100.0


def test_the_prior_is_package_data_so_an_installed_wheel_has_it() -> None:
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    data = config["tool"]["setuptools"]["package-data"]["evocache.controller.semantic"]
    assert SHIPPED_PRIOR.name in data
    assert SHIPPED_PRIOR.resolve().parent == (ROOT / "controller" / "semantic").resolve()
