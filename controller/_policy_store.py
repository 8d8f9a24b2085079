"""The policy store: one source of truth for the active policy, an optional canary and an optional shadow,
shared by replicas.

    store = open_policy_store(PolicyStoreConfig(directory=".evocache/policies"))  # or redis_url="redis://..."
    store.apply(text, canary=0.1)        # validated whole (dsl + check_policy) before anything is written
    store.apply(text, shadow=True)       # planned beside every call, never acted on (controller._rollout)
    store.promote(); store.rollback(); store.status()

``promote`` makes the canary the active; a shadow is put in force by applying its document again (as the
canary or the active). ``rollback`` drops the canary and the shadow, or with neither returns to the version
active before.

Two implementations of ``PolicyStore``: ``FilePolicyStore`` (embedded: one file per version and a JSON state
file, each written to a temporary file, fsynced and renamed over, so a crash mid-write leaves the old file)
and ``RedisPolicyStore`` (cluster: a key per version, a state key changed under WATCH, a hash of replica
reports and a pub/sub channel for changes; every key carries the prefix as its hash tag, so one store lives in
one slot of a Redis Cluster). A replica follows the store with ``PolicyFollower``: it keeps the last rollout
it could load and reports why a newer one could not be. A replica that registers (``PolicyFollower.register``)
says in its reports which run it belongs to and what its store can enforce (``StoreSummary``); ``apply``
checks a policy against every current replica's before anything is written, and ``status`` marks the replicas
gone (no report within ``stale_after_s``) and those of earlier runs. Stored documents are YAML text, parsed
safely; nothing is unpickled.
"""

from __future__ import annotations

import abc
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, Protocol

from pydantic import Field, model_validator

from ..dsl import Policy, parse_policy, policy_to_yaml
from ._runtime import check_policy
from ._store_config import DiskConfig, L1Config, RedisConfig, StoreConfig, _Part
from .errors import ControllerError, StoreConfigError

__all__ = [
    "POLICY_STORE_ENV",
    "FilePolicyStore",
    "PolicyFollower",
    "PolicyState",
    "PolicyStatus",
    "PolicyStore",
    "PolicyStoreConfig",
    "PolicyStoreError",
    "RedisPolicyStore",
    "Registration",
    "ReplicaReport",
    "Rollout",
    "StoreSummary",
    "UnenforceablePolicy",
    "canary_for",
    "default_policy_store",
    "open_policy_store",
]

log = logging.getLogger("evocache.controller")

POLICY_STORE_ENV = "EVOCACHE_POLICY_STORE"
DEFAULT_DIRECTORY = ".evocache/policies"
_REPLICA_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
_REF = re.compile(r"^[A-Za-z0-9_.-]+@[0-9]+$")
_RUN = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_CREDENTIALS = re.compile(r"^([A-Za-z+]+://)[^@/]*@")


class PolicyStoreError(ControllerError, ValueError):
    """A policy store operation refused (a version not above the active one, nothing to promote) or a store
    whose contents cannot be read (named with the key or file)."""


class UnenforceablePolicy(PolicyStoreError):
    """``apply`` refused a policy that a current replica cannot enforce with the store it runs with (the
    message names the replica and why); nothing changed."""

    def __init__(self, message: str, replica_id: str) -> None:
        super().__init__(message)
        self.replica_id = replica_id


class PolicyStoreConfig(_Part):
    """Where the policy store lives: ``directory`` (embedded) or ``redis_url`` (cluster), exactly one.
    ``redis_url`` may name a single Redis (``redis://host:6379/0``) or a Redis Cluster
    (``redis+cluster://host:6379[,host2:6379...]``; ``controller._redis_client``).

    ``prefix`` is the Redis key prefix, used as the hash tag of every key. A replica report older than
    ``stale_after_s`` is shown as stale; ``poll_interval_s`` is how often a follower re-reads the state (with
    Redis, also the bound on how late a lost change message makes it).
    """

    _part: ClassVar[str] = "policy_store"

    directory: str | None = Field(None, min_length=1)
    redis_url: str | None = None
    prefix: str = Field("evc:policy", pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    stale_after_s: float = Field(30.0, gt=0)
    poll_interval_s: float = Field(1.0, gt=0)

    @model_validator(mode="after")
    def _one_place(self) -> PolicyStoreConfig:
        if (self.directory is None) == (self.redis_url is None):
            raise ValueError("give directory or redis_url, exactly one")
        return self


def canary_for(request_key: bytes | str, fraction: float) -> bool:
    """Whether the request with ``request_key`` runs the canary: the first 8 bytes of sha256(key), as a number
    in [0, 1), below ``fraction``. Stable by key, so one conversation stays on one version."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"canary fraction {fraction!r} is not between 0 and 1")
    data = request_key.encode() if isinstance(request_key, str) else request_key
    point = int.from_bytes(hashlib.sha256(data).digest()[:8], "big") / 2.0**64
    return point < fraction


@dataclass(frozen=True)
class PolicyState:
    """What the store holds in force: ``active`` and ``canary`` refs (``name@version``), the canary's
    ``fraction``, ``previous`` (the refs that were active before, oldest first, which rollback returns to),
    ``history`` (one ``{"action", "ref", "at"}`` per operation), ``serial``, raised by every change, and
    ``shadow``: a version every replica plans beside each call, to count where it would decide otherwise,
    without acting on it. A shadow's version is above the active's and the canary's."""

    active: str | None = None
    canary: str | None = None
    fraction: float = 0.0
    previous: tuple[str, ...] = ()
    history: tuple[dict[str, Any], ...] = ()
    serial: int = 0
    shadow: str | None = None

    def to_json(self) -> str:
        return json.dumps({"active": self.active, "canary": self.canary, "fraction": self.fraction,
                           "previous": list(self.previous), "history": list(self.history),
                           "serial": self.serial, "shadow": self.shadow}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> PolicyState:
        try:
            data = json.loads(text)
            state = cls(active=data["active"], canary=data["canary"], fraction=float(data["fraction"]),
                        previous=tuple(data["previous"]), history=tuple(data["history"]),
                        serial=int(data["serial"]),
                        shadow=data.get("shadow"))  # absent from a state written before shadows
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise PolicyStoreError(f"{where}: not a policy store state: {exc}") from None
        for ref in (state.active, state.canary, state.shadow, *state.previous):
            if ref is not None and not (isinstance(ref, str) and _REF.match(ref)):
                raise PolicyStoreError(f"{where}: {ref!r} is not a policy ref (name@version)")
        return state


Step = Callable[[PolicyState], PolicyState]
"""One operation of the store: the state before -> the state after (``PolicyStoreError`` refuses it)."""


def _field(data: dict[str, Any], name: str, kind: type | tuple[type, ...], optional: bool = False) -> Any:
    value = data[name]
    if (value is None and optional) or (isinstance(value, kind) and not isinstance(value, bool)):
        return value
    raise TypeError(f"{name}: {value!r} is not a {getattr(kind, '__name__', kind)}")


@dataclass(frozen=True)
class StoreSummary:
    """The part of a replica's ``StoreConfig`` that decides which policies it can enforce (what
    ``check_policy`` reads): L1's size, eviction and trained-model directory, L2 (the Redis URL without its
    user and password; None: no L2) and its ``l2_bytes``, which a tenant's ``l2_share`` is a share of, and L3
    (the disk tier's directory; None: no L3). It holds no secret, so a store others read can keep it."""

    l1_bytes: int
    l1_eviction: str
    l1_models: str | None = None
    l2: str | None = None
    l2_bytes: int | None = None
    l3: str | None = None

    @classmethod
    def of(cls, config: StoreConfig) -> StoreSummary:
        redis, disk = config.redis, config.disk
        return cls(l1_bytes=config.l1.bytes, l1_eviction=config.l1.eviction, l1_models=config.l1.models,
                   l2=None if redis is None else _CREDENTIALS.sub(r"\1", redis.url),
                   l2_bytes=None if redis is None else redis.l2_bytes,
                   l3=None if disk is None else disk.path)

    def config(self) -> StoreConfig:
        """A store configuration with these settings, for ``check_policy`` (nothing is connected or
        opened)."""
        return StoreConfig(
            l1=L1Config(bytes=self.l1_bytes, eviction=self.l1_eviction, models=self.l1_models),
            redis=None if self.l2 is None else RedisConfig(url=self.l2, l2_bytes=self.l2_bytes),
            disk=None if self.l3 is None else DiskConfig(path=self.l3),
        )

    def describe(self) -> str:
        """``tiers l1, l2, l3; l2_bytes 1073741824`` (``l2_bytes none``: L2 without tenant quotas)."""
        tiers = ["l1"] + (["l2"] if self.l2 is not None else []) + (["l3"] if self.l3 is not None else [])
        text = "tiers " + ", ".join(tiers)
        if self.l2 is not None:
            text += f"; l2_bytes {self.l2_bytes if self.l2_bytes is not None else 'none'}"
        return text

    def as_dict(self) -> dict[str, Any]:
        return {"l1_bytes": self.l1_bytes, "l1_eviction": self.l1_eviction, "l1_models": self.l1_models,
                "l2": self.l2, "l2_bytes": self.l2_bytes, "l3": self.l3}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StoreSummary:
        """Raises ``TypeError`` or ``KeyError`` for a record of another shape (the caller names the place)."""
        return cls(l1_bytes=_field(data, "l1_bytes", int), l1_eviction=_field(data, "l1_eviction", str),
                   l1_models=_field(data, "l1_models", str, True), l2=_field(data, "l2", str, True),
                   l2_bytes=_field(data, "l2_bytes", int, True), l3=_field(data, "l3", str, True))


@dataclass(frozen=True)
class Registration:
    """What a replica said it runs with when it started following the store: ``run``, the start of the
    serving application it belongs to (one ``evocache serve``, one ``serve deploy``); ``started``, the store's
    clock then; ``store``, its store configuration's summary (None for a follower that enforces no cache
    policy, such as an ingress, which follows the store for the tenants' rates)."""

    run: str
    started: float
    store: StoreSummary | None = None

    def __post_init__(self) -> None:
        if not _RUN.match(self.run):
            raise ValueError(f"run {self.run!r} must match {_RUN.pattern}")

    def as_dict(self) -> dict[str, Any]:
        return {"run": self.run, "started": self.started,
                "store": None if self.store is None else self.store.as_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Registration:
        store = data["store"]
        return cls(run=_field(data, "run", str), started=float(_field(data, "started", (int, float))),
                   store=None if store is None else StoreSummary.from_dict(store))


@dataclass(frozen=True)
class ReplicaReport:
    """What one replica last said it runs: ``ref`` (its active version), ``canary`` and ``shadow``, whether it
    loaded the latest state (``ok``) and, if not, ``error``; ``at`` is the store's clock when it reported (a
    follower reports every poll: its heartbeat); ``registration``, what it runs with (None: it never said).

    ``status()`` marks a report ``stale`` (gone: no report within the store's ``stale_after_s``) and
    ``earlier_run`` (its run is not the latest to register); a report with neither mark is ``current``."""

    replica_id: str
    ref: str | None
    canary: str | None
    ok: bool
    error: str | None
    at: float
    stale: bool = False
    shadow: str | None = None
    registration: Registration | None = None
    earlier_run: bool = False

    @property
    def current(self) -> bool:
        return not (self.stale or self.earlier_run)

    def to_json(self) -> str:
        registration = None if self.registration is None else self.registration.as_dict()
        return json.dumps({"replica_id": self.replica_id, "ref": self.ref, "canary": self.canary,
                           "ok": self.ok, "error": self.error, "at": self.at, "shadow": self.shadow,
                           "registration": registration}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> ReplicaReport:
        try:
            data = json.loads(text)
            registration = data.get("registration")  # absent: a report written before registrations
            return cls(replica_id=str(data["replica_id"]), ref=data["ref"], canary=data["canary"],
                       ok=bool(data["ok"]), error=data["error"], at=float(data["at"]),
                       shadow=data.get("shadow"),  # absent: a report written before shadows
                       registration=None if registration is None else Registration.from_dict(registration))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise PolicyStoreError(f"{where}: not a replica report: {exc}") from None


@dataclass(frozen=True)
class PolicyStatus:
    """``status()``: the state, every replica's latest report (sorted by id; those gone and those of earlier
    runs marked) and ``run``, the latest run a replica registered (None: none registered)."""

    state: PolicyState
    replicas: tuple[ReplicaReport, ...] = field(default_factory=tuple)
    run: str | None = None


@dataclass(frozen=True)
class Rollout:
    """The policies a replica enforces: ``active``, and ``canary`` on ``fraction`` of request keys; ``shadow``
    is planned beside each call and never acts (``controller._rollout``)."""

    active: Policy
    canary: Policy | None = None
    fraction: float = 0.0
    shadow: Policy | None = None

    def policy_for(self, request_key: bytes | str) -> Policy:
        if self.canary is not None and canary_for(request_key, self.fraction):
            return self.canary
        return self.active


def _validated(document: str | Policy) -> Policy:
    """The document parsed by the dsl room (if text) and checked by the controller; raises ``PolicyError`` or
    ``StoreConfigError`` for one that cannot be enforced."""
    policy = parse_policy(document) if isinstance(document, str) else document
    if not isinstance(policy, Policy):
        raise TypeError(f"apply takes policy text or a Policy, not {type(document).__name__}")
    check_policy(policy)
    return policy


def _check_fraction(canary: float | None) -> None:
    if canary is not None and not 0.0 < canary < 1.0:
        raise PolicyStoreError(f"canary fraction {canary!r} must be above 0 and below 1")


def _version(ref: str) -> int:
    return int(ref.rpartition("@")[2])


def _after_apply(state: PolicyState, policy: Policy, canary: float | None, shadow: bool,
                 now: float) -> PolicyState:
    """The state once ``policy`` is applied: as the shadow, as the canary on ``canary`` of requests, or as
    the active. Its version must be above every version held, but the shadow's own: applying the shadow's
    document again (as the canary or the active) is how a shadow is put in force. Either way the shadow is
    dropped, since nothing held then is newer than it."""
    ref = str(policy.ref)
    for role, held in (("active", state.active), ("canary", state.canary), ("shadow", state.shadow)):
        if held is None:
            continue
        name = held.rpartition("@")[0]
        if name != policy.name:
            raise PolicyStoreError(f"policy {ref}: this store holds policy {name!r} (the {role} {held})")
        if role == "shadow" and ref == held and not shadow:
            continue  # the content is compared with the stored version's by _new_version
        if policy.version <= _version(held):
            raise PolicyStoreError(f"policy {ref}: version {policy.version} is not above the {role} {held}")
    role = "shadow" if shadow else "canary" if canary is not None else None
    if role is not None and state.active is None:
        raise PolicyStoreError(f"policy {ref}: no active policy for a {role} to run beside; apply it "
                               f"first without a {role}")
    serial = state.serial + 1
    if shadow:
        return replace(state, shadow=ref, serial=serial,
                       history=(*state.history, {"action": "shadow", "ref": ref, "at": now}))
    if canary is not None:
        return replace(state, canary=ref, fraction=canary, shadow=None, serial=serial,
                       history=(*state.history,
                                {"action": "canary", "ref": ref, "fraction": canary, "at": now}))
    previous = (*state.previous, state.active) if state.active is not None else state.previous
    return replace(state, active=ref, canary=None, fraction=0.0, shadow=None, previous=previous,
                   serial=serial, history=(*state.history, {"action": "apply", "ref": ref, "at": now}))


def _after_promote(state: PolicyState, now: float) -> PolicyState:
    """The canary becomes the active; a shadow (newer than both) stays."""
    if state.canary is None:
        hint = (f" (the shadow {state.shadow} is put in force by applying its document again, as the canary "
                "or the active)") if state.shadow is not None else ""
        raise PolicyStoreError(f"nothing to promote: there is no canary{hint}")
    previous = (*state.previous, state.active) if state.active is not None else state.previous
    return replace(state, active=state.canary, canary=None, fraction=0.0, previous=previous,
                   serial=state.serial + 1,
                   history=(*state.history, {"action": "promote", "ref": state.canary, "at": now}))


def _after_rollback(state: PolicyState, now: float) -> PolicyState:
    """The canary and the shadow dropped (one history entry each); with neither, the previous active back."""
    dropped = tuple(ref for ref in (state.canary, state.shadow) if ref is not None)
    if dropped:
        return replace(state, canary=None, fraction=0.0, shadow=None, serial=state.serial + 1,
                       history=(*state.history,
                                *({"action": "rollback", "ref": ref, "at": now} for ref in dropped)))
    if not state.previous:
        raise PolicyStoreError(f"nothing to roll back to: no canary or shadow, and no version was active "
                               f"before {state.active or 'none'}")
    return replace(state, active=state.previous[-1], previous=state.previous[:-1], serial=state.serial + 1,
                   history=(*state.history, {"action": "rollback", "ref": state.active, "at": now}))


class PolicyStore(Protocol):
    """One source of truth for the active policy, a canary and a shadow (see the module docstring)."""

    def apply(self, document: str | Policy, canary: float | None = None, *,
              shadow: bool = False) -> PolicyState: ...
    def promote(self) -> PolicyState: ...
    def rollback(self) -> PolicyState: ...
    def state(self) -> PolicyState: ...
    def status(self) -> PolicyStatus: ...
    def load(self, ref: str) -> Policy: ...
    def report(self, replica_id: str, ref: str | None, ok: bool, error: str | None = None,
               canary: str | None = None, shadow: str | None = None,
               registration: Registration | None = None) -> None: ...
    def wait(self, timeout: float) -> bool: ...
    def close(self) -> None: ...

    clock: Callable[[], float]
    stale_after_s: float


class _StoreBase(abc.ABC):
    """What both stores share: the operations as state transitions over ``_change``, and the report list."""

    def __init__(self, clock: Callable[[], float], stale_after_s: float) -> None:
        self.clock = clock
        self.stale_after_s = stale_after_s

    def apply(self, document: str | Policy, canary: float | None = None, *,
              shadow: bool = False) -> PolicyState:
        """Validate ``document`` whole, then store it: as the active policy, as the canary on ``canary`` of
        requests, or (``shadow=True``) as the shadow, which replicas plan beside each call and never act on.
        Raises ``PolicyError``/``StoreConfigError`` (invalid), ``UnenforceablePolicy`` (a current replica
        cannot enforce it with the store it registered) or ``PolicyStoreError`` (refused: both ``canary`` and
        ``shadow``, a version not above those held); in each case nothing changed."""
        if not isinstance(shadow, bool):
            raise TypeError(f"apply(shadow=) takes a bool, not {type(shadow).__name__}")
        if shadow and canary is not None:
            raise PolicyStoreError("a policy is applied as the canary or as the shadow, not both")
        _check_fraction(canary)
        policy = _validated(document)
        self._check_replicas(policy)
        text = policy_to_yaml(policy)
        return self._change(lambda state: _after_apply(state, policy, canary, shadow, self.clock()),
                            (str(policy.ref), text))

    def promote(self) -> PolicyState:
        return self._change(lambda state: _after_promote(state, self.clock()), None)

    def rollback(self) -> PolicyState:
        return self._change(lambda state: _after_rollback(state, self.clock()), None)

    def report(self, replica_id: str, ref: str | None, ok: bool, error: str | None = None,
               canary: str | None = None, shadow: str | None = None,
               registration: Registration | None = None) -> None:
        if not _REPLICA_ID.match(replica_id):
            raise PolicyStoreError(f"replica id {replica_id!r} must match {_REPLICA_ID.pattern}")
        self._put_report(ReplicaReport(replica_id, ref, canary, ok, error, self.clock(), shadow=shadow,
                                       registration=registration))

    def status(self) -> PolicyStatus:
        """Every report, marked ``stale`` when the replica has not reported within ``stale_after_s`` and
        ``earlier_run`` when its run is not the latest to register (the run whose registration started
        last)."""
        now = self.clock()
        reports = sorted(self._reports(), key=lambda r: r.replica_id)
        registered = [r.registration for r in reports if r.registration is not None]
        run = max(registered, key=lambda g: g.started).run if registered else None
        marked = tuple(replace(r, stale=now - r.at > self.stale_after_s,
                               earlier_run=r.registration is not None and r.registration.run != run)
                       for r in reports)
        return PolicyStatus(self.state(), marked, run)

    def _check_replicas(self, policy: Policy) -> None:
        """``UnenforceablePolicy`` unless every current replica that registered its store can enforce
        ``policy`` with it, as the replica itself checks a version before loading it (``check_policy``)."""
        for report in self.status().replicas:
            summary = report.registration.store if report.registration is not None else None
            if not report.current or summary is None:
                continue
            try:
                check_policy(policy, summary.config())
            except StoreConfigError as exc:
                reason = str(exc).removeprefix(f"policy {policy.ref}: ")
                raise UnenforceablePolicy(
                    f"policy {policy.ref}: replica {report.replica_id} ({summary.describe()}) cannot enforce "
                    f"it: {reason}", report.replica_id) from None

    def _stored(self, ref: str, text: str, where: str) -> Policy:
        policy = parse_policy(text, source=where)
        if str(policy.ref) != ref:
            raise PolicyStoreError(f"{where}: holds {policy.ref}, not {ref}")
        return policy

    def _new_version(self, ref: str, text: str, existing: str | None) -> None:
        if existing is not None and existing != text:
            raise PolicyStoreError(f"policy {ref} was stored before with other content; give it a new "
                                   "version")

    # What each store implements: where the state, the versions and the reports live.
    @abc.abstractmethod
    def _change(self, step: Step, version: tuple[str, str] | None) -> PolicyState: ...

    @abc.abstractmethod
    def state(self) -> PolicyState: ...

    @abc.abstractmethod
    def _put_report(self, report: ReplicaReport) -> None: ...

    @abc.abstractmethod
    def _reports(self) -> list[ReplicaReport]: ...


def _write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, fsync it, rename it over ``path``, fsync the
    directory: a reader sees the old file or the new one, never a part."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class FilePolicyStore(_StoreBase):
    """The embedded store in ``directory``: ``versions/<name>@<version>.yaml``, ``state.json``,
    ``replicas/<id>.json``; changes are serialised by an exclusive lock on ``.lock``. ``wait`` polls the state
    file every ``interval`` seconds through ``sleep`` (both injectable)."""

    def __init__(self, directory: str | os.PathLike[str], *, clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep, stale_after_s: float = 30.0,
                 interval: float = 1.0) -> None:
        super().__init__(clock, stale_after_s)
        self.directory = Path(directory)
        self.sleep = sleep
        self.interval = interval
        for sub in ("versions", "replicas"):
            (self.directory / sub).mkdir(parents=True, exist_ok=True)
        self._state_path = self.directory / "state.json"
        self._seen = self._stamp()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.directory / ".lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _version_path(self, ref: str) -> Path:
        return self.directory / "versions" / f"{ref}.yaml"

    def state(self) -> PolicyState:
        try:
            text = self._state_path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return PolicyState()
        return PolicyState.from_json(text, str(self._state_path))

    def _change(self, step: Step, version: tuple[str, str] | None) -> PolicyState:
        with self._locked():
            new = step(self.state())
            if version is not None:
                ref, text = version
                path = self._version_path(ref)
                existing = path.read_text(encoding="utf-8") if path.exists() else None
                self._new_version(ref, text, existing)
                if existing is None:
                    _write_atomically(path, text)
            _write_atomically(self._state_path, new.to_json())
            return new

    def load(self, ref: str) -> Policy:
        if not _REF.match(ref):
            raise PolicyStoreError(f"{ref!r} is not a policy ref (name@version)")
        path = self._version_path(ref)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise PolicyStoreError(f"{path}: no stored version {ref}") from None
        return self._stored(ref, text, str(path))

    def _put_report(self, report: ReplicaReport) -> None:
        _write_atomically(self.directory / "replicas" / f"{report.replica_id}.json", report.to_json())

    def _reports(self) -> list[ReplicaReport]:
        return [ReplicaReport.from_json(path.read_text(encoding="utf-8"), str(path))
                for path in sorted((self.directory / "replicas").glob("*.json"))]

    def _stamp(self) -> tuple[int, int] | None:
        try:
            info = self._state_path.stat()
        except FileNotFoundError:
            return None
        return info.st_mtime_ns, info.st_size

    def wait(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` seconds in steps of ``interval``; True as soon as the state file changed
        since the last call (compared by mtime and size; the follower re-reads the state either way)."""
        waited = 0.0
        while True:
            stamp = self._stamp()
            if stamp != self._seen:
                self._seen = stamp
                return True
            if waited >= timeout:
                return False
            step = min(self.interval, timeout - waited)
            self.sleep(step)
            waited += step

    def close(self) -> None:
        """Nothing to release: every file is closed after each operation."""


class RedisPolicyStore(_StoreBase):
    """The cluster store: ``{prefix}:v:<ref>`` per version, ``{prefix}:state``, the ``{prefix}:replicas`` hash
    and the ``{prefix}:changes`` channel (the braces make the prefix the hash tag: one slot). The state
    changes under WATCH in a MULTI with the version's key, so two applies never both win."""

    def __init__(self, url: str, prefix: str = "evc:policy", *, clock: Callable[[], float] = time.time,
                 stale_after_s: float = 30.0, client: Any = None) -> None:
        import redis

        from ._redis_client import connect

        super().__init__(clock, stale_after_s)
        self._redis = redis
        self.url = url
        self.client = client or connect(url)  # redis+cluster://...: a RedisCluster client
        self.prefix = prefix
        tag = "{" + prefix + "}"
        self._state_key, self._replicas_key = f"{tag}:state", f"{tag}:replicas"
        self.channel = f"{tag}:changes"
        self._version_prefix = f"{tag}:v:"
        self._pubsub: Any = None

    def state(self) -> PolicyState:
        raw = self.client.get(self._state_key)
        return PolicyState() if raw is None else PolicyState.from_json(raw, self._state_key)

    def _change(self, step: Step, version: tuple[str, str] | None) -> PolicyState:
        while True:
            with self.client.pipeline(transaction=True) as pipe:  # a cluster's pipelines default to none
                try:
                    keys = [self._state_key] + ([self._version_prefix + version[0]] if version else [])
                    pipe.watch(*keys)
                    raw = pipe.get(self._state_key)
                    new = step(PolicyState() if raw is None else PolicyState.from_json(raw, self._state_key))
                    existing = None if version is None else pipe.get(self._version_prefix + version[0])
                    if version is not None:
                        old = None if existing is None else existing.decode()
                        self._new_version(version[0], version[1], old)
                    pipe.multi()
                    if version is not None and existing is None:
                        pipe.set(self._version_prefix + version[0], version[1].encode())
                    pipe.set(self._state_key, new.to_json())
                    # PUBLISH as a raw command: redis-py's cluster pipeline refuses its publish() though a
                    # cluster broadcasts a message published on any node (and the channel is in the slot).
                    pipe.execute_command("PUBLISH", self.channel, str(new.serial))
                    pipe.execute()
                    return new
                except self._redis.WatchError:
                    continue

    def load(self, ref: str) -> Policy:
        if not _REF.match(ref):
            raise PolicyStoreError(f"{ref!r} is not a policy ref (name@version)")
        key = self._version_prefix + ref
        raw = self.client.get(key)
        if raw is None:
            raise PolicyStoreError(f"{key}: no stored version {ref}")
        try:
            text = raw.decode()
        except UnicodeDecodeError:
            raise PolicyStoreError(f"{key}: not UTF-8 text") from None
        return self._stored(ref, text, key)

    def _put_report(self, report: ReplicaReport) -> None:
        self.client.hset(self._replicas_key, report.replica_id, report.to_json())

    def _reports(self) -> list[ReplicaReport]:
        return [ReplicaReport.from_json(raw, f"{self._replicas_key}[{name.decode(errors='replace')}]")
                for name, raw in self.client.hgetall(self._replicas_key).items()]

    def wait(self, timeout: float) -> bool:
        """Up to ``timeout`` seconds for a change message; True when one came. The first call subscribes (and
        returns once Redis confirmed it, so every later change is published to this store). A follower
        re-reads the state after every wait, so a lost message costs at most one interval."""
        if self._pubsub is None:
            pubsub = self.client.pubsub()
            pubsub.subscribe(self.channel)
            while True:  # the confirmation is the first message on the connection
                confirmation = pubsub.get_message(timeout=max(timeout, 1.0))
                if confirmation is not None and confirmation["type"] == "subscribe":
                    break
                if confirmation is None:
                    pubsub.close()
                    raise self._redis.TimeoutError(f"{self.channel}: no subscribe confirmation from Redis")
            self._pubsub = pubsub
            return False
        message = self._pubsub.get_message(timeout=timeout)
        return message is not None and message["type"] == "message"

    def close(self) -> None:
        if self._pubsub is not None:
            self._pubsub.close()
        self.client.close()


def default_policy_store() -> str:
    """The policy store a command uses when none is named: ``$EVOCACHE_POLICY_STORE``, else
    ``.evocache/policies``. A directory, or (for the `evocache policy` commands) a Redis URL."""
    return os.environ.get(POLICY_STORE_ENV) or DEFAULT_DIRECTORY


def open_policy_store(config: PolicyStoreConfig, *, clock: Callable[[], float] = time.time) -> PolicyStore:
    """The store ``config`` names."""
    if config.redis_url is not None:
        return RedisPolicyStore(config.redis_url, config.prefix, clock=clock,
                                stale_after_s=config.stale_after_s)
    assert config.directory is not None  # the config's validator: exactly one of the two
    return FilePolicyStore(config.directory, clock=clock, stale_after_s=config.stale_after_s,
                           interval=config.poll_interval_s)


class PolicyFollower:
    """Keeps a replica on the store's rollout: ``poll()`` reads the state and, when it changed, loads the
    versions and calls ``on_policy(rollout)``. If loading or ``on_policy`` raises, the replica keeps its last
    good rollout and reports the error (once per state; it tries again when the state changes). Every poll
    reports what the replica runs, so status shows it as fresh; after ``register``, every report also says
    what the replica runs with, so ``apply`` can refuse what it could not enforce."""

    def __init__(self, store: PolicyStore, replica_id: str, on_policy: Callable[[Rollout], None],
                 interval: float = 1.0) -> None:
        self.store = store
        self.replica_id = replica_id
        self.on_policy = on_policy
        self.interval = interval
        self.rollout: Rollout | None = None
        self.error: str | None = None
        self.registration: Registration | None = None
        self._serial: int | None = None
        self._report_lock = threading.Lock()  # poll's thread and register() each write a whole report
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll(self) -> Rollout | None:
        state = self.store.state()
        if state.serial != self._serial:
            self._serial = state.serial
            self.error = None
            if state.active is not None and (self.rollout is None or self._refs(self.rollout) !=
                                             (state.active, state.canary, state.fraction, state.shadow)):
                blame = state.active  # the version named in the error: the one that failed to load
                try:
                    active = self.store.load(state.active)
                    blame = state.canary
                    canary = None if state.canary is None else self.store.load(state.canary)
                    blame = state.shadow
                    shadow = None if state.shadow is None else self.store.load(state.shadow)
                    rollout = Rollout(active, canary, state.fraction, shadow)
                    blame = state.shadow or state.canary or state.active  # on_policy: the newest change
                    self.on_policy(rollout)
                except Exception as exc:  # reported to the store; the replica keeps its last good rollout
                    self.error = f"{blame}: {exc}"
                else:
                    self.rollout = rollout
        self._report()
        return self.rollout

    def register(self, run: str, config: StoreConfig | None) -> None:
        """Say in the store what this replica runs with, at once and in every report after: ``run`` (the
        start of the serving application it belongs to) and ``config``'s summary (``StoreSummary``; None for a
        follower that enforces no cache policy). While the replica is current, ``apply`` refuses a policy
        this configuration cannot enforce."""
        summary = None if config is None else StoreSummary.of(config)
        self.registration = Registration(run, self.store.clock(), summary)
        self._report()

    def _report(self) -> None:
        with self._report_lock:
            running = (None, None, 0.0, None) if self.rollout is None else self._refs(self.rollout)
            self.store.report(self.replica_id, running[0], self.error is None, self.error, canary=running[1],
                              shadow=running[3], registration=self.registration)

    @staticmethod
    def _refs(rollout: Rollout) -> tuple[str, str | None, float, str | None]:
        return (str(rollout.active.ref), None if rollout.canary is None else str(rollout.canary.ref),
                rollout.fraction, None if rollout.shadow is None else str(rollout.shadow.ref))

    def run(self) -> None:
        """Poll, then wait for a change (or ``interval``), until ``stop()``. A store that cannot be reached (Redis
        down, a file being replaced) is tried again every ``interval``: the replica keeps its rollout and the
        error is kept in ``error`` (and reported once the store answers)."""
        while not self._stop.is_set():
            try:
                self.poll()
                self.store.wait(self.interval)
            except Exception as exc:  # noqa: BLE001 - the follower outlives any store failure
                message = f"policy store unreachable: {type(exc).__name__}: {exc}"
                if message != self.error:
                    log.warning("replica %s: %s", self.replica_id, message)
                self.error = message
                self._serial = None  # read the whole state again once the store answers
                self._stop.wait(self.interval)

    def start(self) -> PolicyFollower:
        name = f"policy-follower-{self.replica_id}"
        self._thread = threading.Thread(target=self.run, name=name, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
