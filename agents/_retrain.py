"""The loop's retrain step: a new learned eviction model, kept only if replay on held-back traffic says so.

    result = retrain(requests, policy, capacity=64 * 512, model_dir=Path("models"))
    if result.kept: propose result.policy (its edit: result.edit), with result.evidence

The recent ``requests`` are split in time order: the first ``1 - holdout`` share trains, the rest is held
back. Two arms replay them in ``PolicySimulator``s of the same capacity and seed, each from a cold cache:

- the *base* arm replays the training part, then the held-back part, under ``policy`` as it is;
- the *candidate* arm replays the same training part under the candidate policy (``policy`` with
  ``eviction.l1: learned``), whose learned eviction policy collects its samples and labels them the way it
  does in production (``controller.eviction``: an access is positive when its object returns within
  ``horizon x objects held`` accesses). It trains no model on the way, so its fallback (LRU, as the simulator
  builds it) decides the training part; at its end the controller's own trainer fits one model on the latest
  window of labelled samples. The model is written under ``model_dir`` as JSON (``LearnedModel.to_json``,
  never pickle), read back from that file into the policy, and the held-back part is replayed with it,
  unchanged: what is judged is that model on traffic it was not trained on, not the online retraining a
  serving learned policy adds.

Both arms are thus warmed on the same requests, each by its own policy (to the same cache contents when the
policy in force is LRU), and neither is counted before the held-back part. The model is kept when the
candidate's hit ratio over the held-back requests beats the base's by the paired bootstrap of
``_evidence.bootstrap_gain`` (requests resampled with both arms' hits): the gain's lower bound at 90 % must be
above 0, so a gain that a few requests make is not enough. A model that is not kept is deleted.

A kept model is deployed by name: the candidate policy says ``eviction: {l1: learned, model: <file>}``, the
file's name under ``model_dir``, and a store whose ``l1.models`` is that directory starts its learned policy
from it (the replay simulator too, given ``models=model_dir``); the serving policy keeps retraining online
from there. When the policy in force already uses ``learned`` (with a model or without), the candidate is
the newer model, judged against it on the same held-back traffic.

Nothing here raises for the data: too few requests, a trainer that fails (xgboost refuses), no labelled
samples of both classes, or a model file that cannot be written give ``kept=False`` and a ``reason``
(failures are logged). Bad arguments (a holdout outside (0, 1), a capacity < 1) raise ``ValueError``.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from evocache.controller.eviction import LearnedBase, LearnedModel, LearnedModelError, LearnedTraining
from evocache.controller.replay import PolicySimulator, eviction_name
from evocache.dsl import Policy, policy_to_dict

from ._candidates import Edit, apply_edits
from ._evidence import Comparison, arm_metrics, bootstrap_gain
from ._types import Outcome, Request

log = logging.getLogger("evocache.agents")

LEARNED = "learned"
"""The eviction class the candidate names: the learned policy a policy document can name (``learned-rank``
is no identifier of the language)."""
MIN_TRAIN_REQUESTS = 100
"""Fewer requests do not fill a cache of any use and label few samples: a Mooncake request is tens of blocks,
so 100 requests are thousands of labelled accesses, the least a model of a few shallow trees learns from."""
MIN_HOLDOUT_REQUESTS = 30
"""The bootstrap resamples requests: below about 30, its interval says little."""
_NEVER = 1 << 62  # accesses: a retraining period and a staleness no replay reaches
LEVEL = 0.9
"""The bootstrap interval's level; its lower end must be above 0 to keep a model."""


@dataclass(frozen=True, slots=True)
class RetrainResult:
    """What one retraining did. ``kept``: the model beat the policy in force on the held-back requests
    (then ``model_path`` is its JSON file, else None and no file is left). ``policy``: the candidate policy
    whose eviction is the learned policy, validated as ``apply_edits`` validates (None when it could not be
    made); ``edit`` the one edit that makes it from the base. ``base_hit_ratio`` and ``new_hit_ratio``: each
    arm's hit ratio over the held-back requests (NaN when they were not replayed). ``train_requests`` /
    ``holdout_requests``: the split. ``evidence``: the held-back replay's ``Comparison`` (None when not
    replayed).
    ``reason``: one sentence for a person."""

    kept: bool
    model_path: Path | None
    policy: Policy | None
    base_hit_ratio: float
    new_hit_ratio: float
    train_requests: int
    holdout_requests: int
    reason: str
    edit: Edit | None = None
    evidence: Comparison | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values (NaN becomes None; the policy as its document)."""
        return {
            "kept": self.kept,
            "model_path": None if self.model_path is None else str(self.model_path),
            "policy": None if self.policy is None else policy_to_dict(self.policy),
            "edit": None if self.edit is None else self.edit.to_dict(),
            "base_hit_ratio": _finite(self.base_hit_ratio),
            "new_hit_ratio": _finite(self.new_hit_ratio),
            "train_requests": self.train_requests,
            "holdout_requests": self.holdout_requests,
            "reason": self.reason,
            "evidence": {} if self.evidence is None else self.evidence.to_dict(),
        }


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def retrain(requests: Sequence[Request], policy: Policy, *, capacity: int, model_dir: Path,
            holdout: float = 0.3, seed: int = 0, vectors: Any = None,
            training: LearnedTraining = LearnedTraining(), version: int | None = None) -> RetrainResult:
    """Train a learned eviction model on the first ``1 - holdout`` share of ``requests`` (time order) and keep
    it only if it beats ``policy`` on the rest (see the module docstring). ``capacity`` and ``vectors`` as
    ``PolicySimulator`` takes them; ``seed`` seeds both replays and the bootstrap (same inputs, same result
    and the same model file). ``training``: how the candidate arm labels and fits (``horizon``, ``window``,
    ``rounds``, ``depth``, ``threads``, ``monotone``, ``features``; its ``retrain_every`` and ``stale_after``
    are not used: one model is fitted, at the end of the training part); the production defaults unless
    given. ``version``: the candidate policy's (default one above ``policy``'s). The model is written to
    ``model_dir`` (created) as ``<policy>-eviction-v<N>.json``, N one above the highest there.

    Raises ``ValueError`` for a holdout outside (0, 1) or a capacity < 1; every other failure is a result with
    ``kept=False`` and its reason."""
    if isinstance(holdout, bool) or not isinstance(holdout, int | float) or not 0.0 < holdout < 1.0:
        raise ValueError(f"holdout must be a share in (0, 1), got {holdout!r}")
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
    n_train = round(len(requests) * (1.0 - holdout))
    train, held = requests[:n_train], requests[n_train:]

    def refused(reason: str, candidate: Policy | None = None, edit: Edit | None = None,
                evidence: Comparison | None = None) -> RetrainResult:
        base = new = math.nan
        if evidence is not None:
            base, new = evidence.base.hit_ratio, evidence.candidate.hit_ratio
        return RetrainResult(False, None, candidate, base, new, len(train), len(held), reason, edit,
                             evidence)

    if len(train) < MIN_TRAIN_REQUESTS or len(held) < MIN_HOLDOUT_REQUESTS:
        return refused(f"too few requests to retrain: {len(requests)} split into {len(train)} to train on "
                       f"and {len(held)} held back; need at least {MIN_TRAIN_REQUESTS} and "
                       f"{MIN_HOLDOUT_REQUESTS}")
    before = {"l1": eviction_name(policy), "model": policy.eviction.model}
    why = "a learned eviction model retrained on the recent traffic"
    edit = Edit("eviction", "eviction", before, {"l1": LEARNED, "model": None}, why)
    try:
        candidate = apply_edits(policy, [edit], version)  # the arm that trains: learned, from nothing
    except ValueError as exc:  # PolicyError / StoreConfigError: never propose what policy check rejects
        return refused(f"the candidate policy is refused: {exc}", edit=edit)

    arm = _candidate_arm(candidate, capacity, training=training, seed=seed, vectors=vectors)
    fitted = _train(arm, train)
    if isinstance(fitted, str):
        return refused(fitted, candidate, edit)
    try:
        path = _write(fitted, Path(model_dir), policy.name)
    except OSError as exc:
        log.warning("retrain: the model could not be written under %s: %s", model_dir, exc)
        return refused(f"the model could not be written under {model_dir}: {exc}", candidate, edit)
    try:
        _learned(arm).load_model(path)  # what is judged is what the file holds
    except (OSError, LearnedModelError) as exc:
        log.warning("retrain: the model written to %s cannot be read back: %s", path, exc)
        path.unlink(missing_ok=True)
        return refused(f"the model written to {path} cannot be read back: {exc}", candidate, edit)
    untrained = edit, candidate
    edit = replace(edit, new={"l1": LEARNED, "model": path.name})
    candidate = apply_edits(policy, [edit], version)  # as above, naming the file: passes as it did

    base = PolicySimulator(policy, capacity, seed=seed, vectors=vectors, models=Path(model_dir))
    base.run(train)
    evidence = _evidence(held, base.run(held), arm.run(held), seed)
    gain, (low, high) = evidence.gain, evidence.ci
    base_ratio, new_ratio = evidence.base.hit_ratio, evidence.candidate.hit_ratio
    summary = (f"hit ratio {new_ratio:.4f} against {base_ratio:.4f} under {eviction_name(policy)} over "
               f"{len(held)} held-back requests (gain {gain:+.4f}, {LEVEL:.0%} interval "
               f"[{low:+.4f}, {high:+.4f}])")
    if gain > 0 and low > 0:
        log.info("retrain: kept %s: %s", path, summary)
        return RetrainResult(True, path, candidate, base_ratio, new_ratio, len(train), len(held),
                             f"the new model beats the policy in force: {summary}", edit, evidence)
    path.unlink(missing_ok=True)
    log.info("retrain: dropped the new model: %s", summary)
    edit, candidate = untrained  # the file is gone: nothing names it
    return refused(f"the new model does not beat the policy in force: {summary}", candidate, edit, evidence)


def _candidate_arm(policy: Policy, capacity: int, *, training: LearnedTraining, seed: int,
                   vectors: Any) -> PolicySimulator:
    """The candidate arm: its learned eviction policy built with ``training``, so the model can be fitted and
    loaded at the end of the training part. No retraining on the way: the one model is fitted at the end of
    the training part, and the held-back part judges that model, unchanged."""
    once = replace(training, retrain_every=_NEVER, stale_after=_NEVER)
    return PolicySimulator(policy, capacity, seed=seed, vectors=vectors, training=once)


def _learned(arm: PolicySimulator) -> LearnedBase:
    eviction = arm.eviction
    assert isinstance(eviction, LearnedBase), f"the candidate arm runs {type(eviction).__name__}"
    return eviction


def _train(arm: PolicySimulator, train: Sequence[Request]) -> LearnedModel | str:
    """Replay ``train`` in ``arm`` (its learned policy collecting and labelling samples), then fit one model
    on the latest labelled window with the policy's own trainer. The model, or why there is none."""
    from xgboost.core import XGBoostError

    try:
        arm.run(train)
        learned = _learned(arm)
        before = learned.stats.trained
        learned._retrain()  # the controller's trainer: the latest window of samples whose horizon has passed
    except XGBoostError as exc:
        log.warning("retrain: the trainer failed: %s", exc)
        return f"the trainer failed: {_first_line(exc)}"
    model = learned.model
    if learned.stats.trained == before or model is None:
        stats = learned.stats
        return (f"the training part labelled no samples of both classes to train on ({stats.accesses} "
                f"accesses, {stats.samples} samples)")
    return model


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _write(model: LearnedModel, model_dir: Path, name: str) -> Path:
    """Write ``model`` to ``model_dir/<name>-eviction-v<N>.json``, N one above the highest there; never over a
    file that exists (a concurrent writer takes the next N). Raises ``OSError``."""
    model_dir.mkdir(parents=True, exist_ok=True)
    text = model.to_json()
    versioned = re.compile(rf"{re.escape(name)}-eviction-v(\d+)\.json")
    taken = [int(m.group(1)) for p in model_dir.iterdir() if (m := versioned.fullmatch(p.name))]
    n = max(taken, default=0) + 1
    while True:
        path = model_dir / f"{name}-eviction-v{n}.json"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            n += 1
            continue
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(text)
        except OSError:
            path.unlink(missing_ok=True)
            raise
        return path


def _evidence(held: Sequence[Request], base: Sequence[Outcome], cand: Sequence[Outcome],
              seed: int) -> Comparison:
    """The held-back replay, as ``_evidence.compare`` gives one."""
    gain, low, high = bootstrap_gain(held, base, cand, seed=seed, level=LEVEL)
    base_m, cand_m = arm_metrics(held, base), arm_metrics(held, cand)
    return Comparison(base_m, cand_m, gain, (low, high), cand_m.wrong_rate - base_m.wrong_rate, len(held))
