"""Proposals, their reviews, the audit log and the policy history: the loop's durable record.

A ``Proposal`` is one policy change the loop suggests: the base policy it changes, the new version's document,
the diff a person reads, the findings that motivated it and the replay evidence that judged it. Its ``status``
is a small state machine, the way a rollout controller keeps one (an inconclusive analysis is a state of its
own, never a pass)::

    proposed ─┬─> approved ─┬─> canary ─┬─> promoted
              │             └─> stale   ├─> rolled_back
              ├─> rejected              └─> waiting (inconclusive: the canary withdrawn)
              ├─> waiting (inconclusive: a person decides) ──> approved | rejected | stale
              └─> stale   (the evidence no longer holds)   ──> proposed (with fresh evidence) | rejected

    rejected, promoted and rolled_back are final. An approved proposal whose evidence stops holding before its
    canary starts (its base is no longer the policy in force) is stale: it is approved again after a replay.

No proposal is approved without replay evidence, and a stale one goes back to ``proposed`` only with fresh
evidence, which replaces the old.

``ProposalStore`` keeps proposals, reviews, an audit log (every state change and every policy write) and the
policy history in one SQLite file (WAL, a busy timeout, each change one ``BEGIN IMMEDIATE`` transaction), so
processes can share it: of two processes approving the same proposal, exactly one succeeds and the other gets
a ``ProposalError`` saying it is approved already.
"""

from __future__ import annotations

import builtins
import json
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ._fingerprint import DEFAULT_THRESHOLD, EvidenceContext, invalidated_by
from ._types import Finding
from .errors import ProposalError

if TYPE_CHECKING:
    from evocache.dsl import Policy

ProposalStatus = Literal[
    "proposed", "waiting", "stale", "approved", "rejected", "canary", "promoted", "rolled_back"
]
PolicyKind = Literal["applied", "canary", "promoted", "rolled_back"]
Verdict = Literal["approve", "reject"]

MOVES: Mapping[str, frozenset[str]] = MappingProxyType(
    {
        "proposed": frozenset({"approved", "rejected", "waiting", "stale"}),
        "waiting": frozenset({"approved", "rejected", "stale"}),
        "stale": frozenset({"proposed", "rejected"}),
        "approved": frozenset({"canary", "stale"}),
        "rejected": frozenset(),
        "canary": frozenset(
            {"promoted", "rolled_back", "waiting"}
        ),  # waiting: inconclusive, the canary withdrawn
        "promoted": frozenset(),
        "rolled_back": frozenset(),
    }
)
"""Each status -> the statuses it may move to; an empty set marks a final status."""
STATUSES: tuple[str, ...] = tuple(MOVES)
POLICY_KINDS: tuple[str, ...] = ("applied", "canary", "promoted", "rolled_back")
_VERDICTS: Mapping[str, str] = MappingProxyType({"approve": "approved", "reject": "rejected"})
_ORDER = {s: i for i, s in enumerate(STATUSES)}  # the order moves are listed in messages

SCHEMA_VERSION = 1
STORE_KIND = "evocache-proposals"
DEFAULT_STORE = ".evocache/agent/proposals.db"
STORE_ENV = "EVOCACHE_AGENT_STORE"
MAX_DOCUMENT = 4 * 1024 * 1024  # bytes of one proposal's JSON: bounded before it is written or parsed


class ProposalStoreError(ProposalError):
    """The store's file cannot be opened, read or written: not a proposal store (empty, not SQLite, other
    tables, a directory), another schema version, missing (when not to be created), or locked past the busy
    timeout. The message names the file."""


class _Plain(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, populate_by_name=True)


class MetricEstimate(_Plain):
    """One replayed metric: its value under the base policy and the new one, and the confidence interval
    ``ci`` (low, high) of the difference ``new - base`` at ``level`` (None where the replay estimated none).
    ``unit``: what it counts."""

    base: float
    new: float
    ci: tuple[float, float] | None = None
    level: float = Field(default=0.95, gt=0, lt=1)
    unit: str = ""

    @property
    def delta(self) -> float:
        return self.new - self.base

    @model_validator(mode="after")
    def _ordered(self) -> MetricEstimate:
        if self.ci is not None and self.ci[0] > self.ci[1]:
            raise ValueError(f"ci low {self.ci[0]} is above ci high {self.ci[1]}")
        return self


class Evidence(_Plain):
    """What the replay said of a proposal: ``metrics`` by name (at least one), the ``windows`` replayed, the
    ``plots`` drawn (PNG paths), when it was evaluated, the ``context`` it was evaluated under
    (``EvidenceContext.to_dict()``; None when unknown) and ``detail`` (plain values: seeds, request
    counts)."""

    metrics: dict[str, MetricEstimate] = Field(min_length=1)
    evaluated_at: float
    windows: tuple[int, ...] = ()
    plots: tuple[str, ...] = ()
    context: dict[str, Any] | None = None
    detail: dict[str, Any] = Field(default_factory=dict)

    @field_validator("context")
    @classmethod
    def _context(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            EvidenceContext.from_dict(value)  # a ValueError names the field
        return value

    def evidence_context(self) -> EvidenceContext | None:
        return None if self.context is None else EvidenceContext.from_dict(self.context)

    @classmethod
    def from_replay(
        cls,
        comparison: Mapping[str, Any],
        *,
        evaluated_at: float,
        windows: Sequence[int] = (),
        plots: Sequence[str] = (),
        context: EvidenceContext | None = None,
        level: float = 0.9,
    ) -> Evidence:
        """Evidence from a replay comparison of two arms: ``comparison["base"]`` and ``["candidate"]`` map
        metric names to numbers (``requests`` among them is a count, not a metric), ``["ci"]`` is the
        interval of the hit-ratio gain at ``level``; its other plain values (``gain``, ``requests``,
        ``wrong_change``) go to ``detail``. Raises ``ValueError`` naming a missing key or a metric one arm
        lacks."""
        try:
            base, new, ci = comparison["base"], comparison["candidate"], comparison["ci"]
        except KeyError as exc:
            raise ValueError(f"replay comparison: no {exc.args[0]!r}") from None
        missing = sorted(set(base) ^ set(new))
        if missing:
            raise ValueError(f"replay comparison: metrics {', '.join(missing)} missing from one arm")
        metrics = {
            name: MetricEstimate(
                base=base[name],
                new=new[name],
                level=level,
                ci=(ci[0], ci[1]) if name == "hit_ratio" else None,
            )
            for name in base
            if name != "requests"
        }
        detail = {
            k: v
            for k, v in comparison.items()
            if k not in ("base", "candidate", "ci") and isinstance(v, str | int | float | bool)
        }
        return cls(
            metrics=metrics,
            evaluated_at=evaluated_at,
            windows=tuple(windows),
            plots=tuple(plots),
            context=None if context is None else context.to_dict(),
            detail=detail,
        )


class StateChange(_Plain):
    """One move of a proposal: ``from`` (None when it was made), ``to``, who moved it, when and why."""

    at: float
    actor: str
    from_: ProposalStatus | None = Field(default=None, alias="from")
    to: ProposalStatus
    note: str = ""


def new_proposal_id() -> str:
    """``p-`` and 8 random hex digits."""
    return "p-" + secrets.token_hex(4)


class Proposal(_Plain):
    """One proposed policy change; plain JSON (``to_dict`` / ``from_dict``). ``base_policy`` and ``new_ref``
    are ``name@version`` refs, ``base_hash`` the base's content hash, ``new_policy`` the new version's
    normalised YAML and ``diff`` the text ``evocache policy diff`` prints. ``edits``: the planner's edits as
    plain dicts; ``findings``: ``Finding.to_dict()`` dicts. ``window``: the index of the window it was made
    from. Times are seconds since the epoch. Moves are made with ``moved`` (or a store's ``transition``)."""

    id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    base_policy: str
    base_hash: str
    new_policy: str
    new_ref: str
    diff: str
    created_at: float
    updated_at: float
    thread_id: str | None = None
    edits: tuple[dict[str, Any], ...] = ()
    findings: tuple[dict[str, Any], ...] = ()
    evidence: Evidence | None = None
    predicted_gain: float | None = None
    realised_gain: float | None = None
    status: ProposalStatus = "proposed"
    history: tuple[StateChange, ...] = ()
    window: int = Field(default=0, ge=0)
    rationale: str = Field(default="", max_length=8000)

    @field_validator("findings")
    @classmethod
    def _findings(cls, value: tuple[dict[str, Any], ...]) -> tuple[dict[str, Any], ...]:
        for i, data in enumerate(value):
            try:
                Finding.from_dict(data)
            except KeyError as exc:
                raise ValueError(f"findings[{i}]: missing {exc.args[0]!r}") from None
            except (TypeError, ValueError, IndexError) as exc:
                raise ValueError(f"findings[{i}]: {exc}") from None
        return value

    @classmethod
    def create(
        cls,
        base: Policy,
        new: Policy,
        *,
        at: float,
        edits: Sequence[Mapping[str, Any]] = (),
        findings: Sequence[Finding] = (),
        evidence: Evidence | Mapping[str, Any] | None = None,
        predicted_gain: float | None = None,
        window: int = 0,
        thread_id: str | None = None,
        id: str | None = None,
        rationale: str = "",
    ) -> Proposal:
        """A new ``proposed`` proposal to change ``base`` into ``new``, made at ``at``; the diff, refs, hash
        and YAML come from the two policies, the id from ``new_proposal_id`` unless given. Raises
        ``pydantic.ValidationError`` for malformed evidence or edits."""
        from evocache.dsl import diff_policies, policy_to_yaml

        return cls(
            id=id or new_proposal_id(),
            thread_id=thread_id,
            base_policy=base.ref,
            base_hash=base.content_hash,
            new_policy=policy_to_yaml(new),
            new_ref=new.ref,
            diff=diff_policies(base, new).text,
            edits=tuple(dict(e) for e in edits),
            findings=tuple(f.to_dict() for f in findings),
            evidence=_evidence(evidence),
            predicted_gain=predicted_gain,
            created_at=at,
            updated_at=at,
            window=window,
            rationale=rationale[:8000],
        )

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Proposal:
        """Raises ``pydantic.ValidationError`` naming each malformed field."""
        return cls.model_validate(data)

    @property
    def final(self) -> bool:
        return not MOVES[self.status]

    @property
    def summary(self) -> str:
        """The first finding's summary ("" without findings)."""
        return str(self.findings[0].get("summary", "")) if self.findings else ""

    def moved(
        self,
        to: str,
        *,
        at: float,
        actor: str,
        note: str = "",
        evidence: Evidence | None = None,
        realised_gain: float | None = None,
    ) -> Proposal:
        """This proposal moved to ``to``: status, history and ``updated_at`` changed, the evidence replaced
        when ``evidence`` is given, ``realised_gain`` set when given. Raises ``ProposalError`` for a move the
        state machine does not allow (naming the proposal, its status and the move), for an approval without
        evidence, and for a stale proposal moved back to ``proposed`` without fresh evidence; ``ValueError``
        for a status that does not exist."""
        if to not in MOVES:
            raise ValueError(f"unknown proposal status {to!r} (known: {', '.join(STATUSES)})")
        allowed = MOVES[self.status]
        if to not in allowed:
            why = (
                f"{self.status} is final"
                if not allowed
                else f"from {self.status}: {', '.join(sorted(allowed, key=_ORDER.__getitem__))}"
            )
            raise ProposalError(f"proposal {self.id} is {self.status}: it cannot move to {to} ({why})")
        if to == "approved" and evidence is None and self.evidence is None:
            raise ProposalError(f"proposal {self.id} has no replay evidence: it cannot be approved")
        if self.status == "stale" and to == "proposed" and evidence is None:
            raise ProposalError(
                f"proposal {self.id} is stale: moving it back to proposed needs fresh evidence"
            )
        change = StateChange.model_validate(
            {"at": at, "actor": actor, "from": self.status, "to": to, "note": note}
        )
        update: dict[str, Any] = {"status": to, "history": (*self.history, change), "updated_at": at}
        if evidence is not None:
            update["evidence"] = evidence
        if realised_gain is not None:
            update["realised_gain"] = realised_gain
        return self.model_copy(update=update)


@dataclass(frozen=True, slots=True)
class Review:
    """A person's (or a guardrail's) verdict on a proposal."""

    proposal_id: str
    reviewer: str
    verdict: Verdict
    note: str
    at: float


@dataclass(frozen=True, slots=True)
class AuditEntry:
    """One line of the audit log. ``action``: ``add`` (a proposal stored), ``move`` or ``review`` (a state
    change; ``from_state``/``to_state`` set), ``policy`` (a policy written; ``detail`` has ref, hash,
    kind)."""

    seq: int
    at: float
    actor: str
    action: str
    proposal_id: str | None
    from_state: str | None
    to_state: str | None
    detail: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class PolicyRecord:
    """One policy write: ``kind`` applied (made active), canary, promoted or rolled_back (the version gone
    back to)."""

    seq: int
    ref: str
    content_hash: str
    yaml: str
    applied_at: float
    actor: str
    proposal_id: str | None
    kind: PolicyKind


_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE proposals (
    id TEXT PRIMARY KEY, status TEXT NOT NULL, created_at REAL NOT NULL, updated_at REAL NOT NULL,
    doc TEXT NOT NULL);
CREATE INDEX proposals_status ON proposals (status, created_at);
CREATE INDEX proposals_created ON proposals (created_at);
CREATE TABLE reviews (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, proposal_id TEXT NOT NULL REFERENCES proposals (id),
    reviewer TEXT NOT NULL, verdict TEXT NOT NULL, note TEXT NOT NULL, at REAL NOT NULL);
CREATE INDEX reviews_proposal ON reviews (proposal_id, seq);
CREATE TABLE audit (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, actor TEXT NOT NULL, action TEXT NOT NULL,
    proposal_id TEXT, from_state TEXT, to_state TEXT, detail TEXT NOT NULL);
CREATE INDEX audit_proposal ON audit (proposal_id, seq);
CREATE TABLE policy_history (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, ref TEXT NOT NULL, content_hash TEXT NOT NULL, yaml TEXT NOT NULL,
    applied_at REAL NOT NULL, actor TEXT NOT NULL, proposal_id TEXT, kind TEXT NOT NULL);
"""


@contextmanager
def _transaction(db: sqlite3.Connection) -> Iterator[None]:
    """``BEGIN IMMEDIATE`` ... ``COMMIT``, rolled back when the body raises (anything: the write is not half
    kept after an interrupt either), the error then re-raised."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        if db.in_transaction:  # SQLite rolls some failures (a full disk) back by itself
            db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


class ProposalStore:
    """Proposals, reviews, the audit log and the policy history in the SQLite file ``path``.

    The file (and its directory) is made when ``path`` does not exist, unless ``create`` is False; anything
    that exists there is only opened, never made into a store. ``clock`` stamps every change. Raises
    ``ProposalStoreError`` (naming ``path``) for a path that is not a proposal store (an empty file, a file
    that is not SQLite, an SQLite file of other tables, a directory), leaving it as it was; for a store of
    another schema version; for a missing file with ``create=False``; and for a database error later (locked
    longer than ``busy_timeout_s``, disk full). One store object may be shared by threads.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        clock: Callable[[], float] = time.time,
        create: bool = True,
        busy_timeout_s: float = 10.0,
    ) -> None:
        self.path = Path(path)
        self._clock = clock
        self._lock = threading.RLock()
        self._db = self._connect(create, busy_timeout_s)

    def _connect(self, create: bool, busy_timeout_s: float) -> sqlite3.Connection:
        if not self.path.exists():
            if not create:
                raise ProposalStoreError(f"{self.path}: no proposal store there")
            self._make(busy_timeout_s)
        if not self.path.is_file():
            what = "a directory" if self.path.is_dir() else "not a regular file"
            raise ProposalStoreError(f"{self.path}: not a proposal store ({what})")
        elif self.path.stat().st_size == 0:
            # SQLite reads an empty file as an empty database; taking it as a new store would hide a path
            # that names something else, so only a missing path is made
            raise ProposalStoreError(f"{self.path}: not a proposal store (an empty file)")
        db = self._sqlite(self.path, busy_timeout_s)
        try:
            # checked before anything is written: switching to WAL rewrites the header of a foreign file
            self._check_meta(db)
            db.execute("PRAGMA journal_mode = WAL")
            db.execute("PRAGMA foreign_keys = ON")
        except sqlite3.OperationalError as exc:
            db.close()
            raise ProposalStoreError(f"{self.path}: cannot open the proposal store: {exc}") from None
        except sqlite3.DatabaseError as exc:
            db.close()
            raise ProposalStoreError(f"{self.path}: not a proposal store ({exc})") from None
        except ProposalStoreError:
            db.close()
            raise
        return db

    def _sqlite(self, path: Path, busy_timeout_s: float) -> sqlite3.Connection:
        try:
            db = sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
            db.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
        except sqlite3.Error as exc:
            raise ProposalStoreError(f"{self.path}: cannot open the proposal store: {exc}") from None
        return db

    def _make(self, busy_timeout_s: float) -> None:
        """Make the store whole under a temporary name, then link it to ``path``: another process never sees
        a half-made store (nor an empty file it would have to refuse), and of two making it at once, one
        links and the other opens what it linked."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            why = exc.strerror or exc
            raise ProposalStoreError(f"{self.path}: cannot make its directory: {why}") from None
        draft = self.path.with_name(f".{self.path.name}.{secrets.token_hex(4)}.new")
        try:
            db = self._sqlite(draft, busy_timeout_s)
            try:
                with _transaction(db):
                    # one statement at a time: executescript would commit the transaction first
                    for statement in filter(str.strip, _SCHEMA.split(";")):
                        db.execute(statement)
                    db.executemany(
                        "INSERT INTO meta (key, value) VALUES (?, ?)",
                        [("kind", STORE_KIND), ("schema_version", str(SCHEMA_VERSION))],
                    )
                db.execute("PRAGMA journal_mode = WAL")  # kept in the file's header
            except sqlite3.Error as exc:
                raise ProposalStoreError(f"{self.path}: cannot make the proposal store: {exc}") from None
            finally:
                db.close()
            try:
                self.path.hardlink_to(draft)
            except FileExistsError:
                pass  # made by another process meanwhile: opened and checked as any existing store
            except OSError as exc:
                why = exc.strerror or exc
                raise ProposalStoreError(f"{self.path}: cannot make the proposal store: {why}") from None
        finally:
            draft.unlink(missing_ok=True)

    def _check_meta(self, db: sqlite3.Connection) -> None:
        """Check, only reading, that ``db`` is a proposal store of this schema version."""
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        tables.discard("sqlite_sequence")
        meta = dict(db.execute("SELECT key, value FROM meta").fetchall()) if "meta" in tables else {}
        if meta.get("kind") != STORE_KIND:
            what = f"tables {', '.join(sorted(tables))}" if tables else "no tables"
            raise ProposalStoreError(f"{self.path}: not a proposal store (an SQLite file with {what})")
        if meta.get("schema_version") != str(SCHEMA_VERSION):
            raise ProposalStoreError(
                f"{self.path}: a proposal store of schema version "
                f"{meta.get('schema_version')}; this evocache reads version "
                f"{SCHEMA_VERSION}"
            )

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- transactions --------------------------------------------------------------------------------------

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One ``BEGIN IMMEDIATE`` transaction: the write lock is taken before anything is read, so a check
        and the write it allows cannot interleave with another process's."""
        with self._lock, self._errors(), _transaction(self._db):
            yield self._db

    @contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.Error as exc:
            raise ProposalStoreError(f"{self.path}: {exc}") from None

    def _read(self, sql: str, args: Sequence[Any] = ()) -> builtins.list[tuple[Any, ...]]:
        with self._lock, self._errors():
            return self._db.execute(sql, args).fetchall()

    def _audit(
        self,
        db: sqlite3.Connection,
        at: float,
        actor: str,
        action: str,
        proposal_id: str | None,
        moved: tuple[str | None, str | None],
        detail: Mapping[str, Any],
    ) -> None:
        db.execute(
            "INSERT INTO audit (at, actor, action, proposal_id, from_state, to_state, detail) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (at, actor, action, proposal_id, *moved, json.dumps(dict(detail), sort_keys=True)),
        )

    def _document(self, proposal: Proposal) -> str:
        doc = json.dumps(proposal.to_dict(), sort_keys=True, ensure_ascii=False)
        if len(doc.encode()) > MAX_DOCUMENT:
            raise ProposalError(
                f"proposal {proposal.id}: {len(doc.encode())} bytes of JSON, more than the "
                f"{MAX_DOCUMENT} a proposal may take"
            )
        return doc

    def _parse(self, pid: str, doc: str) -> Proposal:
        if len(doc) > MAX_DOCUMENT:
            raise ProposalStoreError(
                f"{self.path}: proposal {pid}: a document of {len(doc)} characters, more than {MAX_DOCUMENT}"
            )
        try:
            return Proposal.from_dict(json.loads(doc))
        except (json.JSONDecodeError, ValidationError) as exc:
            raise ProposalStoreError(f"{self.path}: proposal {pid} cannot be read: {exc}") from None

    def _find(self, db: sqlite3.Connection, key: str) -> Proposal:
        rows = db.execute("SELECT id, doc FROM proposals WHERE id = ?", (key,)).fetchall()
        if not rows and key:
            rows = db.execute(
                "SELECT id, doc FROM proposals WHERE substr(id, 1, ?) = ? ORDER BY id LIMIT 4",
                (len(key), key),
            ).fetchall()
        if not rows:
            raise ProposalError(f"no proposal {key!r} in {self.path}")
        if len(rows) > 1:
            raise ProposalError(
                f"proposal id {key!r} is ambiguous: {', '.join(r[0] for r in rows[:3])}"
                f"{', ...' if len(rows) > 3 else ''} begin with it"
            )
        return self._parse(*rows[0])

    def _save(self, db: sqlite3.Connection, proposal: Proposal) -> None:
        db.execute(
            "UPDATE proposals SET status = ?, updated_at = ?, doc = ? WHERE id = ?",
            (proposal.status, proposal.updated_at, self._document(proposal), proposal.id),
        )

    # --- proposals ----------------------------------------------------------------------------------------

    def add(self, proposal: Proposal, *, actor: str = "agent") -> Proposal:
        """Store a new proposal (status ``proposed``, no history yet); its history starts with the making of
        it at ``created_at``. Raises ``ProposalError`` when its id is taken or it is not new."""
        if proposal.status != "proposed" or proposal.history:
            raise ProposalError(
                f"proposal {proposal.id}: only a new proposal can be added (status proposed, "
                f"no history), not one that is {proposal.status}"
            )
        made = StateChange.model_validate({"at": proposal.created_at, "actor": actor, "to": "proposed"})
        proposal = proposal.model_copy(update={"history": (made,)})
        doc = self._document(proposal)
        with self._write() as db:
            if db.execute("SELECT 1 FROM proposals WHERE id = ?", (proposal.id,)).fetchone():
                raise ProposalError(f"proposal {proposal.id} is already in {self.path}")
            db.execute(
                "INSERT INTO proposals (id, status, created_at, updated_at, doc) VALUES (?, ?, ?, ?, ?)",
                (proposal.id, proposal.status, proposal.created_at, proposal.updated_at, doc),
            )
            self._audit(
                db,
                self._clock(),
                actor,
                "add",
                proposal.id,
                (None, "proposed"),
                {"base": proposal.base_policy, "new": proposal.new_ref},
            )
        return proposal

    def get(self, id: str) -> Proposal:
        """The proposal with id ``id``, or the one whose id begins with it. Raises ``ProposalError`` naming
        ``id`` when none does, or when more than one begins with it (naming them)."""
        with self._lock, self._errors():
            return self._find(self._db, id)

    def list(self, status: str | None = None, limit: int = 100) -> builtins.list[Proposal]:
        """Up to ``limit`` proposals, newest first, of ``status`` when given. Raises ``ValueError`` for a
        status that does not exist (listing those that do) and a ``limit`` below 1."""
        if limit < 1:
            raise ValueError(f"limit {limit} is below 1")
        if status is not None and status not in MOVES:
            raise ValueError(f"unknown proposal status {status!r} (known: {', '.join(STATUSES)})")
        where, args = ("WHERE status = ? ", [status]) if status is not None else ("", [])
        rows = self._read(
            f"SELECT id, doc FROM proposals {where}ORDER BY created_at DESC, id LIMIT ?", [*args, limit]
        )
        return [self._parse(pid, doc) for pid, doc in rows]

    def transition(
        self,
        id: str,
        to: str,
        *,
        actor: str,
        note: str = "",
        evidence: Evidence | Mapping[str, Any] | None = None,
        realised_gain: float | None = None,
    ) -> Proposal:
        """Move proposal ``id`` (or a unique prefix) to ``to`` (see ``Proposal.moved`` for the rules and the
        errors; ``pydantic.ValidationError`` for malformed ``evidence``), in one transaction with its audit
        line; returns it as stored."""
        fresh = _evidence(evidence)
        with self._write() as db:
            proposal = self._find(db, id)
            moved = proposal.moved(
                to, at=self._clock(), actor=actor, note=note, evidence=fresh, realised_gain=realised_gain
            )
            self._save(db, moved)
            detail: dict[str, Any] = {"note": note}
            if fresh is not None:
                detail["evidence"] = "replaced"
            if realised_gain is not None:
                detail["realised_gain"] = realised_gain
            self._audit(db, moved.updated_at, actor, "move", moved.id, (proposal.status, to), detail)
        return moved

    def set_realised_gain(self, id: str, gain: float, *, actor: str = "agent") -> Proposal:
        """Record what a promoted proposal gained once it ran (measured after the promotion; no status
        move)."""
        with self._write() as db:
            proposal = self._find(db, id)
            if proposal.status != "promoted":
                raise ProposalError(
                    f"proposal {proposal.id} is {proposal.status}: only a promoted one has a realised gain"
                )
            moved = proposal.model_copy(update={"realised_gain": float(gain), "updated_at": self._clock()})
            self._save(db, moved)
            self._audit(
                db,
                moved.updated_at,
                actor,
                "realised",
                moved.id,
                ("promoted", "promoted"),
                {"realised_gain": float(gain)},
            )
        return moved

    def review(self, id: str, verdict: str, reviewer: str, note: str = "") -> Proposal:
        """Record ``reviewer``'s ``verdict`` (``approve`` or ``reject``) on proposal ``id`` and move it to
        approved or rejected, in one transaction: a review whose move is refused (see ``Proposal.moved``)
        raises ``ProposalError`` and is not recorded. Raises ``ValueError`` for another verdict."""
        if verdict not in _VERDICTS:
            raise ValueError(f"unknown verdict {verdict!r} (known: {', '.join(_VERDICTS)})")
        with self._write() as db:
            proposal = self._find(db, id)
            at = self._clock()
            moved = proposal.moved(_VERDICTS[verdict], at=at, actor=reviewer, note=note)
            self._save(db, moved)
            db.execute(
                "INSERT INTO reviews (proposal_id, reviewer, verdict, note, at) VALUES (?, ?, ?, ?, ?)",
                (moved.id, reviewer, verdict, note, at),
            )
            self._audit(
                db,
                at,
                reviewer,
                "review",
                moved.id,
                (proposal.status, moved.status),
                {"verdict": verdict, "note": note},
            )
        return moved

    def reviews(self, proposal_id: str | None = None) -> builtins.list[Review]:
        """The reviews recorded, oldest first; of one proposal (its full id) when given."""
        where, args = ("WHERE proposal_id = ? ", [proposal_id]) if proposal_id is not None else ("", [])
        rows = self._read(
            f"SELECT proposal_id, reviewer, verdict, note, at FROM reviews {where}ORDER BY seq", args
        )
        return [Review(*row) for row in rows]

    def invalidate(
        self, id: str, now: EvidenceContext, *, actor: str, threshold: float = DEFAULT_THRESHOLD
    ) -> str | None:
        """The evidence check: when proposal ``id`` is proposed, waiting or approved (not yet on the canary)
        and its evidence was gathered under a context that ``now`` invalidates (``invalidated_by``), move it
        to stale with the reason as the note and return the reason; else change nothing and return None
        (also for evidence without a context)."""
        with self._write() as db:
            proposal = self._find(db, id)
            context = proposal.evidence.evidence_context() if proposal.evidence is not None else None
            if proposal.status not in ("proposed", "waiting", "approved") or context is None:
                return None
            reason = invalidated_by(context, now, threshold=threshold)
            if reason is None:
                return None
            moved = proposal.moved("stale", at=self._clock(), actor=actor, note=reason)
            self._save(db, moved)
            self._audit(
                db, moved.updated_at, actor, "move", moved.id, (proposal.status, "stale"), {"note": reason}
            )
        return reason

    # --- policies -----------------------------------------------------------------------------------------

    def record_policy(
        self, ref: str, yaml_text: str, *, kind: str, actor: str, proposal_id: str | None = None
    ) -> PolicyRecord:
        """Record that policy ``ref`` (its document ``yaml_text``) was written as ``kind``, with an audit
        line. Raises ``ProposalError`` for a document that is not a valid policy or a ``proposal_id`` not
        stored; ``ValueError`` for an unknown ``kind`` or a document of another ref."""
        from evocache.dsl import PolicyError, parse_policy

        if kind not in POLICY_KINDS:
            raise ValueError(f"unknown policy record kind {kind!r} (known: {', '.join(POLICY_KINDS)})")
        try:
            policy = parse_policy(yaml_text, source=ref)
        except PolicyError as exc:
            raise ProposalError(f"policy {ref}: not a valid policy document: {exc}") from None
        if policy.ref != ref:
            raise ValueError(f"the document is {policy.ref}, not {ref}")
        with self._write() as db:
            pid = None if proposal_id is None else self._find(db, proposal_id).id
            at = self._clock()
            cursor = db.execute(
                "INSERT INTO policy_history (ref, content_hash, yaml, applied_at, actor, "
                "proposal_id, kind) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (ref, policy.content_hash, yaml_text, at, actor, pid, kind),
            )
            self._audit(
                db,
                at,
                actor,
                "policy",
                pid,
                (None, None),
                {"ref": ref, "hash": policy.content_hash, "kind": kind},
            )
        assert cursor.lastrowid is not None
        return PolicyRecord(cursor.lastrowid, ref, policy.content_hash, yaml_text, at, actor, pid, kind)  # type: ignore[arg-type]  # checked against POLICY_KINDS above

    def policy_history(self) -> builtins.list[PolicyRecord]:
        """Every policy write, oldest first."""
        rows = self._read(
            "SELECT seq, ref, content_hash, yaml, applied_at, actor, proposal_id, kind "
            "FROM policy_history ORDER BY seq"
        )
        return [PolicyRecord(*row) for row in rows]

    def audit(self, proposal_id: str | None = None) -> builtins.list[AuditEntry]:
        """The audit log, oldest first; the lines of one proposal (its full id) when given."""
        where, args = ("WHERE proposal_id = ? ", [proposal_id]) if proposal_id is not None else ("", [])
        rows = self._read(
            "SELECT seq, at, actor, action, proposal_id, from_state, to_state, detail "
            f"FROM audit {where}ORDER BY seq",
            args,
        )
        return [
            AuditEntry(seq, at, actor, action, pid, before, after, MappingProxyType(json.loads(detail)))
            for seq, at, actor, action, pid, before, after, detail in rows
        ]


def _evidence(evidence: Evidence | Mapping[str, Any] | None) -> Evidence | None:
    if evidence is None or isinstance(evidence, Evidence):
        return evidence
    return Evidence.model_validate(evidence)
