"""The scoped vector index: exact and HNSW agree, migration keeps entries, removal, and scope isolation."""

from __future__ import annotations

import importlib
import subprocess
import sys
import threading

import numpy as np
import pytest
from evocache.controller.semantic import IndexOptions, Neighbour, Scope, SemanticIndex, SharedIndex, VectorIndex

DIM = 384


def unit(rows: np.ndarray) -> np.ndarray:
    rows = np.asarray(rows, dtype=np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def random_unit(n: int, seed: int = 0, dim: int = DIM) -> np.ndarray:
    return unit(np.random.default_rng(seed).standard_normal((n, dim)))


def nudge(vecs: np.ndarray, scale: float, seed: int = 1) -> np.ndarray:
    """Near-identical vectors: each row moved by noise of norm about ``scale``, then renormalised."""
    noise = np.random.default_rng(seed).standard_normal(vecs.shape) * scale / np.sqrt(vecs.shape[1])
    return unit(vecs + noise)


def ids_for(n: int, prefix: str = "e") -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


# -- VectorIndex ----------------------------------------------------------------------------------------------


def test_exact_and_hnsw_agree_on_top1_for_well_separated_vectors():
    vecs = random_unit(2000)
    exact = VectorIndex(DIM, IndexOptions(exact_limit=10**6))
    hnsw = VectorIndex(DIM, IndexOptions(exact_limit=0))
    exact.add(ids_for(2000), vecs)
    hnsw.add(ids_for(2000), vecs)
    assert hnsw.wait_rebuilt(60)
    assert (exact.kind, hnsw.kind) == ("exact", "hnsw")
    queries = nudge(vecs[::10], 0.3)
    top_exact = [row[0].entry_id for row in exact.search(queries, 1)]
    top_hnsw = [row[0].entry_id for row in hnsw.search(queries, 1)]
    assert top_exact == ids_for(2000)[::10]
    assert top_hnsw == top_exact


def test_search_is_best_first_with_cosine_similarities():
    vecs = unit(np.array([[1, 0, 0], [0.8, 0.6, 0], [0, 1, 0], [0, 0, 1]]))
    index = VectorIndex(3)
    index.add(["x", "xy", "y", "z"], vecs)
    [row] = index.search(unit(np.array([[1, 0.1, 0]])), 3)
    assert [n.entry_id for n in row] == ["x", "xy", "y"]
    q = unit(np.array([[1, 0.1, 0]]))[0]
    assert [n.similarity for n in row] == pytest.approx([float(q @ v) for v in vecs[:3]], abs=1e-6)
    assert index.search(q[None, :], 10)[0][-1] == Neighbour("z", pytest.approx(0.0, abs=1e-6))


def test_crossing_exact_limit_keeps_every_entry():
    vecs = random_unit(250, seed=3)
    index = VectorIndex(DIM, IndexOptions(exact_limit=100))
    index.add(ids_for(60), vecs[:60])
    assert index.kind == "exact"
    index.add(ids_for(250)[60:], vecs[60:])
    assert index.wait_rebuilt(60)
    assert index.kind == "hnsw"
    assert len(index) == 250
    assert sorted(index.ids()) == sorted(ids_for(250))
    assert [row[0].entry_id for row in index.search(vecs, 1)] == ids_for(250)
    for i in (0, 59, 60, 249):
        np.testing.assert_array_equal(index.vector(f"e{i}"), vecs[i])


@pytest.mark.parametrize("exact_limit", [10**6, 0], ids=["exact", "hnsw"])
def test_remove_takes_entries_out_of_search(exact_limit):
    vecs = random_unit(100, seed=4)
    index = VectorIndex(DIM, IndexOptions(exact_limit=exact_limit, background=False))
    index.add(ids_for(100), vecs)
    assert index.kind == ("exact" if exact_limit else "hnsw")
    index.remove(["e3", "e7", "not-there"])
    assert len(index) == 98 and "e3" not in index
    found = {n.entry_id for row in index.search(vecs, 100) for n in row}
    assert found == set(ids_for(100)) - {"e3", "e7"}
    assert index.search(vecs[3:4], 1)[0][0].entry_id != "e3"
    with pytest.raises(KeyError):
        index.vector("e3")


@pytest.mark.parametrize("exact_limit", [10**6, 50], ids=["exact", "hnsw"])
def test_mass_removal_compacts_and_keeps_the_rest(exact_limit):
    vecs = random_unit(300, seed=5)
    index = VectorIndex(DIM, IndexOptions(exact_limit=exact_limit, background=False))
    index.add(ids_for(300), vecs)
    index.remove(ids_for(300)[:200])
    assert len(index) == 100
    assert index._dead == set()  # tombstones outnumbered live entries: the index was rebuilt without them
    assert [row[0].entry_id for row in index.search(vecs[200:], 1)] == ids_for(300)[200:]
    assert index.kind == ("exact" if exact_limit > 100 else "hnsw")
    index.add(["again"], vecs[:1])
    assert index.search(vecs[:1], 1)[0][0].entry_id == "again"


class PausedBuild:
    """Wraps ``VectorIndex._build`` (the real one) so a background rebuild waits until the test lets it go."""

    def __init__(self, monkeypatch) -> None:
        self.started = threading.Event()
        self.go = threading.Event()
        real = VectorIndex._build

        def build(index, kind, vecs):
            self.started.set()
            assert self.go.wait(60), "the test never released the build"
            return real(index, kind, vecs)

        monkeypatch.setattr(VectorIndex, "_build", build)


def test_writes_during_a_background_migration_are_kept(monkeypatch):
    paused = PausedBuild(monkeypatch)
    vecs = random_unit(200, seed=11)
    index = VectorIndex(DIM, IndexOptions(exact_limit=100))
    index.add(ids_for(120), vecs[:120])  # crosses the limit: the HNSW build starts in the background
    assert paused.started.wait(60)
    assert index.kind == "exact"
    # While it builds, the exact index serves and takes writes: adds, a replacement and removals.
    assert index.search(vecs[5:6], 1)[0][0].entry_id == "e5"
    index.add(ids_for(200)[120:], vecs[120:])
    index.add(["e0"], vecs[199:200])
    index.remove(["e1", "e150"])
    paused.go.set()
    assert index.wait_rebuilt(60)
    assert index.kind == "hnsw"
    assert sorted(index.ids()) == sorted(set(ids_for(200)) - {"e1", "e150"})
    np.testing.assert_array_equal(index.vector("e0"), vecs[199])
    live = [i for i in range(2, 200) if i != 150]
    assert [row[0].entry_id for row in index.search(vecs[live], 1)] == [f"e{i}" for i in live]
    assert index.search(vecs[1:2], 198)[0][-1].entry_id not in {"e1", "e150"}
    assert {n.entry_id for n in index.search(vecs[1:2], 198)[0]} == set(index.ids())


def test_a_failed_background_build_keeps_the_current_index(monkeypatch, caplog):
    def fail(index, kind, vecs):
        raise MemoryError("no room for the new index")

    monkeypatch.setattr(VectorIndex, "_build", fail)
    vecs = random_unit(30, seed=12)
    index = VectorIndex(DIM, IndexOptions(exact_limit=10))
    index.add(ids_for(20), vecs[:20])
    assert index.wait_rebuilt(60)
    assert index.kind == "exact" and len(index) == 20
    assert "rebuilding a 20-entry index as hnsw failed" in caplog.text
    monkeypatch.undo()
    index.add(ids_for(30)[20:], vecs[20:])  # the next write tries again
    assert index.wait_rebuilt(60)
    assert index.kind == "hnsw" and len(index) == 30


def test_a_failed_background_build_is_counted_by_every_index_above_it(monkeypatch):
    def fail(index, kind, vecs):
        raise MemoryError("no room for the new index")

    vecs = random_unit(40, seed=13)
    told: list[str] = []
    index = SemanticIndex(IndexOptions(exact_limit=10), on_rebuild_error=lambda: told.append("failed"))
    shared = SharedIndex(None, index_options=IndexOptions(exact_limit=10))
    healthy = VectorIndex(DIM, IndexOptions(exact_limit=10))
    healthy.add(ids_for(20), vecs[:20])
    assert healthy.wait_rebuilt(60) and healthy.kind == "hnsw" and healthy.rebuild_errors == 0
    monkeypatch.setattr(VectorIndex, "_build", fail)
    index.add(A, ids_for(20), vecs[:20])
    assert index.index(A).wait_rebuilt(60)
    assert index.index(A).rebuild_errors == 1 and index.rebuild_errors == 1 and told == ["failed"]
    index.remove(A, ids_for(20))  # the scope goes; its failure stays counted
    assert index.index(A) is None and index.rebuild_errors == 1
    shared.add(B, ids_for(20), vecs[20:])
    assert shared._index.index(B).wait_rebuilt(60)
    assert shared.stats().rebuild_errors == 1 and shared.stats().errors == 0
    shared.close()


def test_concurrent_writers_and_readers_across_rebuilds_end_consistent():
    """Four threads add, replace, remove and search disjoint ids while migrations and compactions run.

    The exact limit is low enough that one thread alone crosses it: on a loaded machine the threads may run one
    after another (with 150, a run where they never overlapped never migrated). Whether a compaction follows
    depends on timing (removals made while the migration runs never reach the new index as tombstones), so only
    the migration is certain; compactions are pinned by the tests that rebuild inline."""
    index = VectorIndex(DIM, IndexOptions(exact_limit=20))
    pool = random_unit(1600, seed=13)
    expected: list[dict[str, int]] = [{} for _ in range(4)]  # id -> row of ``pool`` it holds, per thread
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        rng = np.random.default_rng(t)
        mine = expected[t]
        try:
            for step in range(300):
                entry_id = f"t{t}-{rng.integers(0, 120)}"
                op = rng.random()
                if op < 0.6:
                    row = int(rng.integers(0, len(pool)))
                    index.add([entry_id], pool[row : row + 1])
                    mine[entry_id] = row
                elif op < 0.85:
                    index.remove([entry_id])
                    mine.pop(entry_id, None)
                else:
                    index.search(pool[step : step + 1], 5)
            for entry_id in sorted(mine)[10:]:  # then keep 10: tombstones outnumber live entries
                index.remove([entry_id])
                del mine[entry_id]
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    assert index.wait_rebuilt(60)
    assert index.rebuilds >= 1  # the migration (and a compaction, when the timing makes one due)
    live = {entry_id: row for mine in expected for entry_id, row in mine.items()}
    assert sorted(index.ids()) == sorted(live)
    for entry_id, row in live.items():
        np.testing.assert_array_equal(index.vector(entry_id), pool[row])
    found = {n.entry_id for n in index.search(pool[:1], len(live))[0]}
    assert found <= set(live)


def test_adding_an_existing_id_replaces_its_vector():
    vecs = random_unit(3, seed=6)
    index = VectorIndex(DIM)
    index.add(["a", "b"], vecs[:2])
    index.add(["a"], vecs[2:3])
    assert len(index) == 2
    np.testing.assert_array_equal(index.vector("a"), vecs[2])
    assert index.search(vecs[2:3], 1)[0][0] == Neighbour("a", pytest.approx(1.0, abs=1e-6))
    # the old vector is gone: a query equal to it finds "a" only through the new vector, once
    row = index.search(vecs[0:1], 5)[0]
    assert [n.entry_id for n in row].count("a") == 1
    assert row[[n.entry_id for n in row].index("a")].similarity == pytest.approx(
        float(vecs[0] @ vecs[2]), abs=1e-6
    )


def test_empty_index_and_k_larger_than_size():
    index = VectorIndex(DIM)
    q = random_unit(2, seed=7)
    assert index.search(q, 3) == [[], []]
    index.add(["only"], q[:1])
    assert [[n.entry_id for n in row] for row in index.search(q, 3)] == [["only"], ["only"]]


def test_bad_input_is_rejected_and_changes_nothing():
    index = VectorIndex(4)
    index.add(["a"], unit(np.array([[1, 0, 0, 0]])))
    good = unit(np.array([[0, 1, 0, 0]]))
    with pytest.raises(ValueError, match="dimension 3, the index holds dimension 4"):
        index.add(["b"], unit(np.array([[1, 0, 0]])))
    with pytest.raises(ValueError, match=r"vecs\[0\] has norm 2.000000"):
        index.add(["b"], np.array([[2, 0, 0, 0]]))
    with pytest.raises(ValueError, match="NaN"):
        index.add(["b"], np.array([[np.nan, 0, 0, 0]]))
    with pytest.raises(ValueError, match="2-D"):
        index.add(["b"], good[0])
    with pytest.raises(ValueError, match="2 ids for 1 vectors"):
        index.add(["b", "c"], good)
    with pytest.raises(ValueError, match="distinct"):
        index.add(["b", "b"], np.vstack([good, good]))
    with pytest.raises(ValueError, match=r"ids\[0\]"):
        index.add([""], good)
    with pytest.raises(TypeError, match="single str"):
        index.remove("a")
    with pytest.raises(ValueError, match="k must be a positive int"):
        index.search(good, 0)
    assert index.ids() == ["a"]


# -- SemanticIndex: scopes ------------------------------------------------------------------------------------

A = Scope("tenant-a", "fn=chat|model=m1|rev=1|params=0f|emb=st:all-MiniLM-L6-v2")
B = Scope("tenant-b", A.boundary)  # another tenant, same contract
A2 = Scope("tenant-a", "fn=chat|model=m2|rev=1|params=0f|emb=st:all-MiniLM-L6-v2")  # same tenant, other model


@pytest.mark.parametrize("exact_limit", [10**6, 0], ids=["exact", "hnsw"])
def test_identical_and_near_identical_vectors_never_cross_scopes(exact_limit):
    index = SemanticIndex(IndexOptions(exact_limit=exact_limit, background=False))
    vecs = random_unit(50, seed=8)
    index.add(A, ids_for(50, "a"), vecs)
    index.add(B, ids_for(50, "b"), vecs)  # identical vectors in another tenant
    index.add(A2, ids_for(50, "m"), nudge(vecs, 0.01))  # near-identical under another model
    for scope, prefix in ((A, "a"), (B, "b"), (A2, "m")):
        rows = index.search(scope, vecs, 50)
        assert all(len(row) == 50 for row in rows)
        assert {n.entry_id[0] for row in rows for n in row} == {prefix}
    other = Scope("tenant-c", A.boundary)
    assert index.search(other, vecs[:2], 5) == [[], []]
    assert sorted(index.scopes()) == sorted([A, B, A2])


def test_removal_in_one_scope_leaves_the_others():
    index = SemanticIndex()
    vecs = random_unit(2, seed=9)
    index.add(A, ["same-id", "x"], vecs)
    index.add(B, ["same-id", "y"], vecs)
    index.remove(A, ["same-id"])
    assert [n.entry_id for n in index.search(A, vecs[:1], 2)[0]] == ["x"]
    assert [n.entry_id for n in index.search(B, vecs[:1], 2)[0]] == ["same-id", "y"]
    np.testing.assert_array_equal(index.vector(B, "same-id"), vecs[0])
    with pytest.raises(KeyError):
        index.vector(A, "same-id")
    index.remove(Scope("tenant-z", "nothing"), ["same-id"])  # an unknown scope: nothing to do
    assert len(index) == 3


def test_real_embeddings_of_one_prompt_stay_in_their_tenant():
    from evocache.controller.semantic import default_embedder

    emb = default_embedder()
    index = SemanticIndex()
    stored = emb.embed(["cancel my subscription"])
    index.add(A, ["a-cancel"], stored)
    index.add(B, ["b-cancel"], stored)
    index.add(A2, ["m-cancel"], emb.embed(["please cancel my subscription"]))
    query = emb.embed(["cancel my subscription"])
    assert [[n.entry_id for n in row] for row in index.search(A, query, 5)] == [["a-cancel"]]
    assert [[n.entry_id for n in row] for row in index.search(B, query, 5)] == [["b-cancel"]]
    assert [[n.entry_id for n in row] for row in index.search(A2, query, 5)] == [["m-cancel"]]
    assert index.search(A, query, 1)[0][0].similarity == pytest.approx(1.0, abs=1e-5)


def test_scope_of_a_contract_binds_every_part():
    base = Scope.of("tenant-a", "st:all-MiniLM-L6-v2", fn="chat", model="m1", revision="1", params="0f")
    assert base == Scope.of(
        "tenant-a", "st:all-MiniLM-L6-v2", params="0f", revision="1", model="m1", fn="chat"
    )
    others = {
        Scope.of("tenant-b", "st:all-MiniLM-L6-v2", fn="chat", model="m1", revision="1", params="0f"),
        Scope.of("tenant-a", "openai:x", fn="chat", model="m1", revision="1", params="0f"),
        Scope.of("tenant-a", "st:all-MiniLM-L6-v2", fn="chat", model="m2", revision="1", params="0f"),
        Scope.of("tenant-a", "st:all-MiniLM-L6-v2", fn="chat", model="m1", revision="2", params="0f"),
        Scope.of("tenant-a", "st:all-MiniLM-L6-v2", fn="chat", model="m1", revision="1", params="10"),
        Scope.of("tenant-a", "st:all-MiniLM-L6-v2", fn="chat|model=m1", revision="1", params="0f"),
    }
    assert base not in others and len(others) == 6
    assert (
        base.boundary
        == '{"embedder":"st:all-MiniLM-L6-v2","fn":"chat","model":"m1","params":"0f","revision":"1"}'
    )
    with pytest.raises(TypeError, match="revision=7"):
        Scope.of("tenant-a", "e", revision=7)  # type: ignore[arg-type]


def test_invalid_scopes_are_rejected():
    index = SemanticIndex()
    v = random_unit(1)
    with pytest.raises(ValueError, match="invalid namespace"):
        index.add(Scope("tenant:a", "b"), ["x"], v)
    with pytest.raises(ValueError, match="boundary"):
        index.add(Scope("tenant-a", ""), ["x"], v)
    with pytest.raises(TypeError, match="Scope"):
        index.add(("tenant-a", "b"), ["x"], v)  # type: ignore[arg-type]
    assert index.scopes() == []


def test_scopes_have_their_own_dimension():
    index = SemanticIndex()
    index.add(A, ["small"], unit(np.array([[1.0, 0.0]])))
    index.add(B, ["big"], random_unit(1))
    assert index.index(A).dim == 2 and index.index(B).dim == DIM
    with pytest.raises(ValueError, match="dimension 384, the index holds dimension 2"):
        index.search(A, random_unit(1), 1)


# -- the package --------------------------------------------------------------------------------------------


def test_semantic_all_is_exact():
    module = importlib.import_module("evocache.controller.semantic")
    assert len(set(module.__all__)) == len(module.__all__)
    for name in module.__all__:
        origin = getattr(getattr(module, name), "__module__", "") or ""
        if origin.startswith("evocache."):  # a typing alias (Judge) reports typing as its module
            assert origin.startswith("evocache.controller"), f"{name} comes from {origin}"
    public = {n for n in dir(module) if not n.startswith("_")}
    modules = {n for n in public if type(getattr(module, n)) is type(module)}
    assert public - modules == set(module.__all__)


def test_importing_semantic_loads_no_heavy_library():
    """Only what ``evocache.controller`` itself loads: numpy, faiss and torch wait until vectors are made."""
    code = (
        "import sys\n"
        "heavy = ('numpy', 'faiss', 'torch', 'sentence_transformers', 'transformers')\n"
        "import evocache.controller\n"
        "before = {m for m in heavy if m in sys.modules}\n"
        "import evocache.controller.semantic\n"
        "print(sorted(m for m in heavy if m in sys.modules and m not in before))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_semantic_index_refuses_an_expiry():
    """What every index does is tested in test_semantic_indexes.py; a local one keeps no expiry."""
    index, scope = SemanticIndex(), Scope("t", "fn")
    index.add(scope, ["a"], random_unit(1), metas=[{"prompt": "first"}])
    with pytest.raises(ValueError, match="SemanticIndex keeps no expiry: use SharedIndex"):
        index.add(scope, ["c"], random_unit(1, seed=3), expires_at=[5.0])
    assert index.get(scope, "c") is None and len(index) == 1
    with pytest.raises(ValueError, match="1 metas for 2 vectors"):
        index.add(scope, ["x", "y"], random_unit(2, seed=4), metas=[{}])
    assert len(index) == 1


def test_index_options_refuse_a_misspelt_or_out_of_range_option():
    with pytest.raises(TypeError, match="exact_limt"):
        IndexOptions(exact_limt=5)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="exact_limit"):
        SemanticIndex(exact_limit=5)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="hnsw_m"):
        SharedIndex(None, hnsw_m=8)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match=r"IndexOptions.hnsw_m must be >= 2, got 1"):
        IndexOptions(hnsw_m=1)
    with pytest.raises(ValueError, match=r"IndexOptions.exact_limit must be >= 0, got -1"):
        IndexOptions(exact_limit=-1)
    with pytest.raises(TypeError, match=r"IndexOptions.ef_search must be an int, got True"):
        IndexOptions(ef_search=True)
    with pytest.raises(TypeError, match=r"IndexOptions.background must be a bool, got 'no'"):
        IndexOptions(background="no")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="options must be an IndexOptions, got dict"):
        SemanticIndex({"exact_limit": 5})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dim must be a positive int, got 0"):
        VectorIndex(0)


@pytest.mark.parametrize("make", [SemanticIndex, lambda o: SharedIndex(None, index_options=o)],
                         ids=["SemanticIndex", "SharedIndex"])
def test_index_options_build_every_scopes_index(make):
    index = make(IndexOptions(exact_limit=3, background=False))
    scope = Scope("t", "fn")
    index.add(scope, ids_for(4), random_unit(4))  # crosses exact_limit=3: the scope's index migrates at once
    local = index._index if isinstance(index, SharedIndex) else index
    assert local.index(scope).kind == "hnsw" and local.index(scope).exact_limit == 3
