"""Proposals, their state machine, the SQLite store (reviews, audit log, policy history) and the
`evocache proposals` commands."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from _helpers import SteppingClock
from evocache.agents._fingerprint import EvidenceContext, OutputFingerprint
from evocache.agents._proposal_commands import make_app
from evocache.agents._proposals import (
    MOVES,
    STATUSES,
    Evidence,
    Proposal,
    ProposalStore,
    ProposalStoreError,
)
from evocache.agents._types import Finding
from evocache.agents.errors import ProposalError
from evocache.dsl import diff_policies, load_policy, policy_to_yaml
from pydantic import ValidationError
from typer.testing import CliRunner

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "policies"
V7 = load_policy(EXAMPLES / "chat-prod.yaml")
V8 = load_policy(EXAMPLES / "chat-prod-v8.yaml")
T0 = 1_800_000_000.0  # 2027-01-15T08:00:00Z
T0_NS = int(T0) * 1_000_000_000

CONTEXT = EvidenceContext("chat-prod@7", V7.content_hash, "qwen", "rev-a", "t" * 64,
                          OutputFingerprint.of_lengths([40, 42, 39, 41]))
EVIDENCE = {
    "metrics": {"hit_ratio": {"base": 0.41, "new": 0.47, "ci": [0.03, 0.09]},
                "p99_ms": {"base": 812.0, "new": 640.0, "ci": [-210.0, -130.0], "unit": "ms"}},
    "evaluated_at": T0 + 30, "windows": [3, 4], "plots": ["plots/p-0000abcd-hit.png"],
    "context": CONTEXT.to_dict(),
}
FINDING = Finding(kind="key-drift", summary="the key distribution of rule faq moved (JS 0.31)", window=3,
                  windows=(2, 3), subject={"rule": "faq"}, statistic=0.31, p_value=0.0012, score=0.8)


def store_clock() -> SteppingClock:
    """The store's clock: the first reading is T0 + 100, each one after it 10 s later."""
    return SteppingClock(T0 + 90, step=10.0)


def proposal(id: str = "p-0000abcd", evidence: object = EVIDENCE, **kw: object) -> Proposal:
    return Proposal.create(V7, V8, at=T0, id=id, evidence=evidence, findings=[FINDING], predicted_gain=0.06,
                           window=3, thread_id="loop-1", edits=[{"op": "set", "path": "rules[sampled].ttl"}],
                           **kw)


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "agent" / "proposals.db"


@pytest.fixture
def store(path: Path) -> Iterator[ProposalStore]:
    with ProposalStore(path, clock=store_clock()) as s:
        yield s


# --- the proposal and its state machine ----------

def test_create_takes_refs_hash_yaml_and_diff_from_the_policies() -> None:
    p = proposal()
    assert (p.base_policy, p.base_hash, p.new_ref) == ("chat-prod@7", V7.content_hash, "chat-prod@8")
    assert p.new_policy == policy_to_yaml(V8)
    assert p.diff == diff_policies(V7, V8).text
    assert p.findings == (FINDING.to_dict(),)
    assert p.summary == "the key distribution of rule faq moved (JS 0.31)"
    assert (p.status, p.history, p.created_at, p.updated_at) == ("proposed", (), T0, T0)
    assert Proposal.from_dict(json.loads(json.dumps(p.to_dict()))) == p


def test_findings_must_be_findings() -> None:
    with pytest.raises(ValidationError) as info:
        Proposal.from_dict({**proposal().to_dict(), "findings": [{"summary": "x"}]})
    assert "findings[0]: missing 'kind'" in str(info.value)


def test_a_made_id_is_p_and_8_hex_digits() -> None:
    made = Proposal.create(V7, V8, at=T0).id
    assert re.fullmatch(r"p-[0-9a-f]{8}", made)
    assert Proposal.create(V7, V8, at=T0).id != made


LEGAL = [(a, b) for a in STATUSES for b in sorted(MOVES[a])]


@pytest.mark.parametrize(("start", "to"), LEGAL)
def test_every_allowed_move(start: str, to: str) -> None:
    p = proposal().model_copy(update={"status": start})
    moved = p.moved(to, at=T0 + 5, actor="bob", note="why", evidence=Evidence.model_validate(EVIDENCE))
    assert (moved.status, moved.updated_at) == (to, T0 + 5)
    assert moved.history[-1].model_dump(by_alias=True) == {"at": T0 + 5, "actor": "bob", "from": start, "to": to,
                                                           "note": "why"}


def test_the_moves_are_the_rollout_state_machine() -> None:
    assert {s: sorted(t) for s, t in MOVES.items()} == {
        "proposed": ["approved", "rejected", "stale", "waiting"],
        "waiting": ["approved", "rejected", "stale"],
        "stale": ["proposed", "rejected"],
        "approved": ["canary", "stale"],
        "rejected": [],
        "canary": ["promoted", "rolled_back", "waiting"],
        "promoted": [], "rolled_back": [],
    }


@pytest.mark.parametrize(("start", "to", "message"), [
    ("proposed", "canary", ("proposal p-0000abcd is proposed: it cannot move to canary "
                           "(from proposed: waiting, stale, approved, rejected)")),
    ("approved", "approved", ("proposal p-0000abcd is approved: it cannot move to approved "
                             "(from approved: stale, canary)")),
    ("rejected", "proposed", "proposal p-0000abcd is rejected: it cannot move to proposed (rejected is final)"),
    ("promoted", "rolled_back", ("proposal p-0000abcd is promoted: it cannot move to rolled_back "
                                "(promoted is final)")),
    ("canary", "approved", ("proposal p-0000abcd is canary: it cannot move to approved "
                           "(from canary: waiting, promoted, rolled_back)")),
])
def test_a_refused_move_names_the_proposal_its_status_and_the_move(start: str, to: str, message: str) -> None:
    with pytest.raises(ProposalError) as info:
        proposal().model_copy(update={"status": start}).moved(to, at=T0, actor="bob")
    assert str(info.value) == message


def test_an_unknown_status_is_a_caller_bug() -> None:
    with pytest.raises(ValueError, match=r"^unknown proposal status 'done' \(known: proposed, waiting, stale, "):
        proposal().moved("done", at=T0, actor="bob")


def test_no_approval_without_evidence() -> None:
    bare = proposal(evidence=None)
    with pytest.raises(ProposalError, match=r"^proposal p-0000abcd has no replay evidence: it cannot be approved$"):
        bare.moved("approved", at=T0, actor="alice")
    assert bare.moved("waiting", at=T0, actor="agent").moved(
        "approved", at=T0, actor="alice", evidence=Evidence.model_validate(EVIDENCE)).status == "approved"


def test_a_stale_proposal_comes_back_only_with_fresh_evidence() -> None:
    stale = proposal().moved("stale", at=T0, actor="agent", note="model revision changed from rev-a to rev-b")
    with pytest.raises(ProposalError, match=r"^proposal p-0000abcd is stale: moving it back to proposed needs "
                                            r"fresh evidence$"):
        stale.moved("proposed", at=T0 + 1, actor="agent")
    fresh = Evidence.model_validate({**EVIDENCE, "evaluated_at": T0 + 500})
    again = stale.moved("proposed", at=T0 + 600, actor="agent", evidence=fresh)
    assert (again.status, again.evidence) == ("proposed", fresh)


def test_evidence_from_a_replay_comparison() -> None:
    comparison = {"base": {"requests": 900, "hit_ratio": 0.41, "wrong_rate": 0.0},
                  "candidate": {"requests": 900, "hit_ratio": 0.47, "wrong_rate": 0.001},
                  "gain": 0.06, "ci": [0.03, 0.09], "wrong_change": 0.001, "requests": 900}
    evidence = Evidence.from_replay(comparison, evaluated_at=T0, windows=[3, 4], context=CONTEXT)
    assert evidence.model_dump(mode="json") == {
        "metrics": {"hit_ratio": {"base": 0.41, "new": 0.47, "ci": [0.03, 0.09], "level": 0.9, "unit": ""},
                    "wrong_rate": {"base": 0.0, "new": 0.001, "ci": None, "level": 0.9, "unit": ""}},
        "evaluated_at": T0, "windows": [3, 4], "plots": [], "context": CONTEXT.to_dict(),
        "detail": {"gain": 0.06, "wrong_change": 0.001, "requests": 900}}
    with pytest.raises(ValueError, match=r"^replay comparison: no 'ci'$"):
        Evidence.from_replay({"base": {}, "candidate": {}}, evaluated_at=T0)
    with pytest.raises(ValueError, match=r"^replay comparison: metrics wrong_rate missing from one arm$"):
        Evidence.from_replay({"base": {"hit_ratio": 0.4, "wrong_rate": 0.0}, "candidate": {"hit_ratio": 0.5},
                              "ci": [0.0, 0.1]}, evaluated_at=T0)


@pytest.mark.parametrize(("change", "fragment"), [
    ({"metrics": {}}, "metrics\n  Dictionary should have at least 1 item"),
    ({"metrics": {"hit_ratio": {"base": 0.4, "new": 0.5, "ci": [0.2, 0.1]}}},
     "ci low 0.2 is above ci high 0.1"),
    ({"metrics": {"hit_ratio": {"base": float("nan"), "new": 0.5, "ci": [0.0, 0.1]}}},
     "metrics.hit_ratio.base\n  Input should be a finite number"),
    ({"context": {"policy_ref": "chat-prod@7"}}, ("evidence context: policy_hash, model_id, model_revision, "
                                                 "template_hash missing or not text")),
    ({"evaluated": 3}, "evaluated\n  Extra inputs are not permitted"),
])
def test_malformed_evidence_is_refused_naming_the_field(change: dict, fragment: str) -> None:
    with pytest.raises(ValidationError) as info:
        Evidence.model_validate({**EVIDENCE, **change})
    assert fragment in str(info.value)


# --- the store ----------

def test_add_get_and_prefixes(store: ProposalStore, path: Path) -> None:
    stored = store.add(proposal())
    assert stored.history[0].model_dump(by_alias=True) == {"at": T0, "actor": "agent", "from": None,
                                                           "to": "proposed", "note": ""}
    assert store.get("p-0000abcd") == stored == store.get("p-00")
    store.add(proposal("p-0000ffff"))
    with pytest.raises(ProposalError, match=r"^proposal id 'p-0000' is ambiguous: p-0000abcd, p-0000ffff begin "
                                            r"with it$"):
        store.get("p-0000")
    with pytest.raises(ProposalError) as info:
        store.get("p-9")
    assert str(info.value) == f"no proposal 'p-9' in {path}"
    with pytest.raises(ProposalError, match=r"^proposal p-0000abcd is already in "):
        store.add(proposal())


def test_only_new_proposals_are_added(store: ProposalStore) -> None:
    with pytest.raises(ProposalError, match=r"^proposal p-0000abcd: only a new proposal can be added \(status "
                                            r"proposed, no history\), not one that is waiting$"):
        store.add(proposal().moved("waiting", at=T0, actor="agent"))


def test_list_newest_first_and_by_status(store: ProposalStore) -> None:
    for i, at in enumerate((T0, T0 + 2, T0 + 1)):
        store.add(Proposal.create(V7, V8, at=at, id=f"p-{i}"))
    store.transition("p-1", "waiting", actor="agent", note="inconclusive")
    assert [p.id for p in store.list()] == ["p-1", "p-2", "p-0"]
    assert [p.id for p in store.list("proposed")] == ["p-2", "p-0"]
    assert [p.id for p in store.list(limit=1)] == ["p-1"]
    with pytest.raises(ValueError, match=r"^limit 0 is below 1$"):
        store.list(limit=0)
    with pytest.raises(ValueError, match=r"^unknown proposal status 'open' \(known: proposed, waiting, stale, "
                                         r"approved, rejected, canary, promoted, rolled_back\)$"):
        store.list("open")


def test_transition_and_review_are_stored_with_their_audit(store: ProposalStore) -> None:
    store.add(proposal())
    store.transition("p-0000abcd", "waiting", actor="agent", note="CI spans zero")
    approved = store.review("p-0000", "approve", "alice", "looks right")
    assert approved.status == "approved"
    canary = store.transition("p-0000abcd", "canary", actor="agent")
    done = store.transition("p-0000abcd", "promoted", actor="agent", realised_gain=0.05)
    assert (done.status, done.realised_gain) == ("promoted", 0.05)
    assert [(h.from_, h.to, h.actor, h.at) for h in done.history] == [
        (None, "proposed", "agent", T0), ("proposed", "waiting", "agent", T0 + 110),
        ("waiting", "approved", "alice", T0 + 120), ("approved", "canary", "agent", T0 + 130),
        ("canary", "promoted", "agent", T0 + 140)]
    assert canary.updated_at == T0 + 130
    audit = store.audit("p-0000abcd")
    assert [(a.action, a.actor, a.from_state, a.to_state, dict(a.detail)) for a in audit] == [
        ("add", "agent", None, "proposed", {"base": "chat-prod@7", "new": "chat-prod@8"}),
        ("move", "agent", "proposed", "waiting", {"note": "CI spans zero"}),
        ("review", "alice", "waiting", "approved", {"verdict": "approve", "note": "looks right"}),
        ("move", "agent", "approved", "canary", {"note": ""}),
        ("move", "agent", "canary", "promoted", {"note": "", "realised_gain": 0.05}),
    ]
    assert [(r.reviewer, r.verdict, r.note, r.at) for r in store.reviews("p-0000abcd")] == [
        ("alice", "approve", "looks right", T0 + 120)]


def test_a_refused_review_is_not_recorded(store: ProposalStore) -> None:
    store.add(proposal())
    store.review("p-0000abcd", "reject", "alice", "too risky")
    with pytest.raises(ProposalError, match=r"^proposal p-0000abcd is rejected: it cannot move to approved "
                                            r"\(rejected is final\)$"):
        store.review("p-0000abcd", "approve", "bob", "")
    assert [r.reviewer for r in store.reviews()] == ["alice"]
    assert [a.action for a in store.audit()] == ["add", "review"]
    with pytest.raises(ValueError, match=r"^unknown verdict 'maybe' \(known: approve, reject\)$"):
        store.review("p-0000abcd", "maybe", "bob", "")


def test_stale_with_fresh_evidence_replaces_it(store: ProposalStore) -> None:
    store.add(proposal())
    store.transition("p-0000abcd", "stale", actor="agent", note="prompt template changed")
    fresh = {**EVIDENCE, "evaluated_at": T0 + 900}
    again = store.transition("p-0000abcd", "proposed", actor="agent", evidence=fresh)
    assert again.evidence == Evidence.model_validate(fresh)
    assert dict(store.audit("p-0000abcd")[-1].detail) == {"note": "", "evidence": "replaced"}


def test_invalidate_moves_a_proposal_whose_evidence_no_longer_holds(store: ProposalStore) -> None:
    store.add(proposal())
    assert store.invalidate("p-0000abcd", CONTEXT, actor="agent") is None
    now = EvidenceContext(**{**CONTEXT.to_dict(), "model_revision": "rev-b",
                             "output_fingerprint": CONTEXT.output_fingerprint})
    reason = store.invalidate("p-0000abcd", now, actor="agent")
    assert reason == "model revision changed from rev-a to rev-b"
    stale = store.get("p-0000abcd")
    assert (stale.status, stale.history[-1].note) == ("stale", reason)
    assert store.invalidate("p-0000abcd", now, actor="agent") is None  # stale already: nothing to move
    store.add(proposal("p-0000beef", evidence=None))
    assert store.invalidate("p-0000beef", now, actor="agent") is None  # no evidence, nothing it could invalidate
    store.add(proposal("p-0000cafe"))
    store.review("p-0000cafe", "approve", "alice", "")
    assert store.invalidate("p-0000cafe", now, actor="agent") == reason  # approved, not yet on the canary
    store.transition("p-0000cafe", "proposed", actor="agent", evidence={**EVIDENCE, "context": now.to_dict()})
    store.review("p-0000cafe", "approve", "alice", "again")
    store.transition("p-0000cafe", "canary", actor="agent")
    assert store.invalidate("p-0000cafe", CONTEXT, actor="agent") is None  # on the canary: the canary judges it


def test_policy_history(store: ProposalStore) -> None:
    store.add(proposal())
    first = store.record_policy("chat-prod@7", policy_to_yaml(V7), kind="applied", actor="ops")
    second = store.record_policy("chat-prod@8", policy_to_yaml(V8), kind="canary", actor="agent",
                                 proposal_id="p-0000")
    assert store.policy_history() == [first, second]
    assert (second.ref, second.content_hash, second.proposal_id, second.kind, second.applied_at) == (
        "chat-prod@8", V8.content_hash, "p-0000abcd", "canary", T0 + 120)
    assert [(a.action, a.proposal_id, dict(a.detail)) for a in store.audit() if a.action == "policy"] == [
        ("policy", None, {"ref": "chat-prod@7", "hash": V7.content_hash, "kind": "applied"}),
        ("policy", "p-0000abcd", {"ref": "chat-prod@8", "hash": V8.content_hash, "kind": "canary"}),
    ]


def test_policy_records_are_checked(store: ProposalStore) -> None:
    with pytest.raises(ValueError, match=r"^the document is chat-prod@8, not chat-prod@9$"):
        store.record_policy("chat-prod@9", policy_to_yaml(V8), kind="applied", actor="ops")
    with pytest.raises(ValueError, match=r"^unknown policy record kind 'shadow' \(known: applied, canary, "
                                         r"promoted, rolled_back\)$"):
        store.record_policy("chat-prod@8", policy_to_yaml(V8), kind="shadow", actor="ops")
    with pytest.raises(ProposalError, match=r"^policy x@1: not a valid policy document: "):
        store.record_policy("x@1", "policy: x\nversion: one\n", kind="applied", actor="ops")
    with pytest.raises(ProposalError, match=r"^no proposal 'p-1' in "):
        store.record_policy("chat-prod@8", policy_to_yaml(V8), kind="canary", actor="ops", proposal_id="p-1")
    assert store.policy_history() == []


def test_everything_survives_reopening(path: Path) -> None:
    with ProposalStore(path, clock=store_clock()) as first:
        first.add(proposal())
        first.review("p-0000abcd", "approve", "alice", "ok")
        first.record_policy("chat-prod@8", policy_to_yaml(V8), kind="canary", actor="agent",
                            proposal_id="p-0000abcd")
        seen = (first.list(), first.reviews(), first.audit(), first.policy_history())
    with ProposalStore(path, clock=store_clock()) as second:
        assert (second.list(), second.reviews(), second.audit(), second.policy_history()) == seen
        assert second.get("p-0000abcd").evidence == Evidence.model_validate(EVIDENCE)
        assert second.transition("p-0000abcd", "canary", actor="agent").status == "canary"
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone() == ("wal",)


def test_another_schema_version_is_refused(path: Path) -> None:
    ProposalStore(path).close()
    with sqlite3.connect(path) as db:
        db.execute("UPDATE meta SET value = '2' WHERE key = 'schema_version'")
    with pytest.raises(ProposalStoreError) as info:
        ProposalStore(path)
    assert str(info.value) == f"{path}: a proposal store of schema version 2; this evocache reads version 1"


def test_a_file_that_is_not_a_store_is_named(tmp_path: Path) -> None:
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not SQLite at all, but long enough to have a header" * 20)
    with pytest.raises(ProposalStoreError) as info:
        ProposalStore(junk)
    assert str(info.value) == f"{junk}: not a proposal store (file is not a database)"
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as db:
        db.execute("CREATE TABLE things (x)")
    with pytest.raises(ProposalStoreError) as info:
        ProposalStore(other)
    assert str(info.value) == f"{other}: not a proposal store (an SQLite file with tables things)"
    with pytest.raises(ProposalStoreError) as info:
        ProposalStore(tmp_path / "none.db", create=False)
    assert str(info.value) == f"{tmp_path / 'none.db'}: no proposal store there"
    assert not (tmp_path / "none.db").exists()


def not_stores(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Paths that exist and are not proposal stores, each with what the refusal says it is."""
    empty = tmp_path / "empty.db"
    empty.touch()
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not SQLite at all, but long enough to have a header" * 20)
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as db:
        db.execute("CREATE TABLE things (x)")
    db.close()
    bare = tmp_path / "bare.db"
    sqlite3.connect(bare).execute("PRAGMA user_version = 3").connection.close()  # SQLite, no tables
    folder = tmp_path / "folder.db"
    folder.mkdir()
    return {
        "empty": (empty, "an empty file"),
        "junk": (junk, "file is not a database"),
        "other": (other, "an SQLite file with tables things"),
        "bare": (bare, "an SQLite file with no tables"),
        "folder": (folder, "a directory"),
    }


def snapshot(directory: Path) -> dict[str, tuple[bytes | None, int]]:
    """Every entry of ``directory``: a file's bytes (None for a directory) and its modification time."""
    return {e.name: (e.read_bytes() if e.is_file() else None, e.stat().st_mtime_ns)
            for e in directory.iterdir()}


@pytest.mark.parametrize("kind", ["empty", "junk", "other", "bare", "folder"])
@pytest.mark.parametrize("create", [True, False])
def test_a_path_that_is_not_a_store_is_refused_and_left_as_it_was(tmp_path: Path, kind: str,
                                                                   create: bool) -> None:
    path, what = not_stores(tmp_path)[kind]
    os.utime(path, ns=(T0_NS, T0_NS))  # a time of its own: one any write would move
    before = snapshot(tmp_path)
    with pytest.raises(ProposalStoreError) as info:
        ProposalStore(path, create=create)
    assert str(info.value) == f"{path}: not a proposal store ({what})"
    assert snapshot(tmp_path) == before


def test_only_a_missing_path_is_made_into_a_store(tmp_path: Path) -> None:
    path = tmp_path / "made" / "proposals.db"
    with ProposalStore(path) as made:
        made.add(proposal())
    assert [e.name for e in path.parent.iterdir()] == ["proposals.db"]  # nothing half-made left beside it
    with ProposalStore(path, create=False) as opened:
        assert [p.id for p in opened.list()] == ["p-0000abcd"]


def test_stores_made_at_once_are_one_store(path: Path) -> None:
    start = threading.Barrier(6)

    def make(i: int) -> str:
        start.wait()
        with ProposalStore(path) as s:
            s.add(proposal(id=f"p-0000000{i}"))
            return s.path.name

    with ThreadPoolExecutor(6) as pool:
        assert list(pool.map(make, range(6))) == ["proposals.db"] * 6
    with ProposalStore(path, create=False) as s:
        assert sorted(p.id for p in s.list()) == [f"p-0000000{i}" for i in range(6)]
    assert sorted(e.name for e in path.parent.iterdir()) == ["proposals.db"]


def test_a_corrupt_document_names_the_proposal(store: ProposalStore, path: Path) -> None:
    store.add(proposal())
    with sqlite3.connect(path) as db:
        db.execute("UPDATE proposals SET doc = '{\"id\": ' WHERE id = 'p-0000abcd'")
    with pytest.raises(ProposalStoreError, match=r"proposals\.db: proposal p-0000abcd cannot be read: "):
        store.get("p-0000abcd")


def test_a_proposal_too_large_is_refused(store: ProposalStore) -> None:
    huge = proposal().model_copy(update={"diff": "x" * (4 * 1024 * 1024)})
    with pytest.raises(ProposalError, match=r"^proposal p-0000abcd: 4\d{6} bytes of JSON, more than the 4194304 "
                                            r"a proposal may take$"):
        store.add(huge)
    assert store.list() == []


APPROVER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from evocache.agents._proposals import ProposalStore
    from evocache.agents.errors import ProposalError

    path, go, who = sys.argv[1:]
    store = ProposalStore(path)
    print("ready", flush=True)
    while not Path(go).exists():
        time.sleep(0.005)
    try:
        store.review("p-0000abcd", "approve", who, "")
        print("won")
    except ProposalError as exc:
        print(f"lost: {exc}")
""")


def test_of_two_processes_approving_one_wins(path: Path, tmp_path: Path) -> None:
    with ProposalStore(path) as s:
        s.add(proposal())
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", APPROVER, str(path), str(go), who],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for who in ("alice", "bob")]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
    go.touch()
    outs = sorted(p.communicate(timeout=60)[0].strip() for p in procs)
    assert [p.returncode for p in procs] == [0, 0]
    assert outs[1] == "won"
    assert outs[0] == ("lost: proposal p-0000abcd is approved: it cannot move to approved "
                       "(from approved: stale, canary)")
    with ProposalStore(path) as s:
        assert len(s.reviews()) == 1 and s.get("p-0000abcd").status == "approved"


# --- `evocache proposals` ----------

runner = CliRunner()
WIDE = {"COLUMNS": "200"}


@pytest.fixture
def filled(path: Path) -> Path:
    with ProposalStore(path, clock=store_clock()) as s:
        s.add(proposal())
        s.add(Proposal.create(V7, V8, at=T0 + 60, id="p-0000beef", predicted_gain=None))
        s.transition("p-0000abcd", "waiting", actor="agent", note="the CI of p99_ms is wide")
    return path


def test_list_prints_a_table(filled: Path) -> None:
    result = runner.invoke(make_app(), ["list", "--store", str(filled)], env=WIDE)
    assert result.exit_code == 0, result.output
    rows = [line for line in result.stdout.splitlines() if "p-0000" in line]
    assert rows == [
        ("│ p-0000beef │ proposed │ chat-prod@7 -> chat-prod@8 │ -         │ -        │ 2027-01-15T08:01:00Z │ -      "
        "                                          │"),
        ("│ p-0000abcd │ waiting  │ chat-prod@7 -> chat-prod@8 │ +0.06     │ -        │ 2027-01-15T08:00:00Z │ the key "
        "distribution of rule faq moved (JS 0.31) │"),
    ]
    assert "┃ id         ┃ status   ┃ change" in result.stdout


def test_list_by_status_and_as_json(filled: Path) -> None:
    result = runner.invoke(make_app(), ["list", "--store", str(filled), "--status", "waiting", "--json"])
    assert result.exit_code == 0
    with ProposalStore(filled) as s:
        assert json.loads(result.stdout) == [s.get("p-0000abcd").to_dict()]
    empty = runner.invoke(make_app(), ["list", "--store", str(filled), "--status", "canary"])
    assert (empty.exit_code, empty.stdout) == (0, "no proposals are canary\n")
    bad = runner.invoke(make_app(), ["list", "--store", str(filled), "--status", "open"])
    assert (bad.exit_code, bad.stderr) == (2, ("error: --status: unknown proposal status 'open' (known: proposed, "
                                              "waiting, stale, approved, rejected, canary, promoted, rolled_back)\n"))


def test_the_store_comes_from_the_environment(filled: Path) -> None:
    result = runner.invoke(make_app(), ["list", "--json"], env={"EVOCACHE_AGENT_STORE": str(filled)})
    assert [p["id"] for p in json.loads(result.stdout)] == ["p-0000beef", "p-0000abcd"]


def test_show_prints_the_diff_findings_evidence_and_history(filled: Path) -> None:
    result = runner.invoke(make_app(), ["show", "p-0000a", "--store", str(filled)], env=WIDE)
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert out.startswith(
        "proposal p-0000abcd: waiting\n"
        f"change: chat-prod@7 ({V7.content_hash[:12]}) -> chat-prod@8\n"
        "made: 2027-01-15T08:00:00Z from window 3, thread loop-1\n"
        "gain: predicted +0.06, realised -\n"
        "\n"
        "--- a/chat-prod@7\n+++ b/chat-prod@8\n")
    assert diff_policies(V7, V8).text in out
    assert ("findings:\n"
            "  key-drift: the key distribution of rule faq moved (JS 0.31) (p=0.0012, score 0.80)\n"
            "evidence: evaluated 2027-01-15T08:00:30Z, windows 3-4\n") in out
    assert "│ hit_ratio │ 0.41   │ 0.47   │ +0.06 │ [+0.03, +0.09] at 95% │" in out
    assert "│ p99_ms    │ 812 ms │ 640 ms │ -172  │ [-210, -130] at 95%   │" in out
    assert out.endswith(
        "context: chat-prod@7, model qwen rev-a, template tttttttttttt\n"
        "plot: plots/p-0000abcd-hit.png\n"
        "reviews: none\n"
        "history:\n"
        "  2027-01-15T08:01:40Z agent add proposed\n"
        "  2027-01-15T08:02:00Z agent move proposed -> waiting: the CI of p99_ms is wide\n")


def test_show_without_evidence(filled: Path) -> None:
    result = runner.invoke(make_app(), ["show", "p-0000beef", "--store", str(filled)])
    assert "findings: none\nevidence: none (it cannot be approved before a replay)\nreviews: none\n" in result.stdout


def test_approve_records_the_review_and_calls_the_hook(filled: Path) -> None:
    calls: list[tuple[str, str, str, Path]] = []
    app = make_app(on_review=lambda p, verdict, store: calls.append((p.id, p.status, verdict, store)))
    result = runner.invoke(app, ["approve", "p-0000abcd", "--store", str(filled), "--reviewer", "alice",
                                 "--note", "ship it"])
    assert (result.exit_code, result.stdout) == (0, "approved p-0000abcd: chat-prod@7 -> chat-prod@8 (by alice)\n")
    assert calls == [("p-0000abcd", "approved", "approve", filled)]
    with ProposalStore(filled) as s:
        assert [(r.reviewer, r.verdict, r.note) for r in s.reviews()] == [("alice", "approve", "ship it")]
    shown = runner.invoke(make_app(), ["show", "p-0000abcd", "--store", str(filled)])
    assert "reviews:\n" in shown.stdout and " alice approve: ship it\n" in shown.stdout
    assert " alice review waiting -> approved: ship it\n" in shown.stdout


def test_reject(filled: Path) -> None:
    result = runner.invoke(make_app(), ["reject", "p-0000beef", "--store", str(filled), "--reviewer", "bob"])
    assert (result.exit_code, result.stdout) == (0, "rejected p-0000beef: chat-prod@7 -> chat-prod@8 (by bob)\n")


@pytest.mark.parametrize(("args", "code", "message"), [
    (["approve", "p-nope", "--reviewer", "alice"], 1, "error: no proposal 'p-nope' in {store}\n"),
    (["show", "p-0000"], 1, "error: proposal id 'p-0000' is ambiguous: p-0000abcd, p-0000beef begin with it\n"),
    (["approve", "p-0000beef", "--reviewer", "alice"], 1,
     "error: proposal p-0000beef has no replay evidence: it cannot be approved\n"),
])
def test_refusals_exit_1_with_the_message(filled: Path, args: list[str], code: int, message: str) -> None:
    result = runner.invoke(make_app(), [*args, "--store", str(filled)])
    assert (result.exit_code, result.stderr, result.stdout) == (code, message.format(store=filled), "")


def test_approving_twice_exits_1(filled: Path) -> None:
    args = ["approve", "p-0000abcd", "--store", str(filled), "--reviewer", "alice"]
    assert runner.invoke(make_app(), args).exit_code == 0
    again = runner.invoke(make_app(), args)
    assert (again.exit_code, again.stderr) == (
        1, "error: proposal p-0000abcd is approved: it cannot move to approved (from approved: stale, canary)\n")


@pytest.mark.parametrize("kind", ["empty", "other", "folder"])
@pytest.mark.parametrize("args", [["list"], ["show", "p-1"], ["approve", "p-1", "--reviewer", "alice"],
                                  ["reject", "p-1", "--reviewer", "alice"]])
def test_every_command_refuses_what_is_not_a_store_and_leaves_it(tmp_path: Path, kind: str,
                                                                  args: list[str]) -> None:
    path, what = not_stores(tmp_path)[kind]
    os.utime(path, ns=(T0_NS, T0_NS))
    before = snapshot(tmp_path)
    result = runner.invoke(make_app(), [*args, "--store", str(path)])
    assert (result.exit_code, result.stderr, result.stdout) == (
        2, f"error: {path}: not a proposal store ({what})\n", "")
    assert snapshot(tmp_path) == before


@pytest.mark.slow  # the evocache command in a subprocess
def test_the_command_refuses_an_empty_file_and_leaves_it(tmp_path: Path) -> None:
    path, _ = not_stores(tmp_path)["empty"]
    os.utime(path, ns=(T0_NS, T0_NS))
    before = snapshot(tmp_path)
    done = subprocess.run([sys.executable, "-m", "evocache.cli", "proposals", "list", "--store", str(path)],
                          capture_output=True, text=True, timeout=600)
    assert (done.returncode, done.stderr, done.stdout) == (
        2, f"error: {path}: not a proposal store (an empty file)\n", "")
    assert snapshot(tmp_path) == before


def test_a_missing_or_foreign_store_exits_2(tmp_path: Path) -> None:
    missing = tmp_path / "none.db"
    result = runner.invoke(make_app(), ["list", "--store", str(missing)])
    assert (result.exit_code, result.stderr) == (2, f"error: {missing}: no proposal store there\n")
    assert not missing.exists()
    junk = tmp_path / "junk.db"
    junk.write_text("x" * 2000)
    result = runner.invoke(make_app(), ["show", "p-1", "--store", str(junk)])
    assert (result.exit_code, result.stderr) == (
        2, f"error: {junk}: not a proposal store (file is not a database)\n")
