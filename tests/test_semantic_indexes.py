"""One suite for every scoped semantic index (``ScopedIndex``): the local ``SemanticIndex``, the embedded
``SharedIndex`` (no Redis) and the ``SharedIndex`` on a real Redis, with the same behavioural assertions."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from evocache.controller.semantic import Scope, SemanticCache, SemanticIndex, SharedIndex

DIM = 16
A, B = Scope("tenant-a", "fn@m"), Scope("tenant-b", "fn@m")


def unit(rows) -> np.ndarray:
    rows = np.asarray(rows, dtype=np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def random_unit(n: int, seed: int = 0) -> np.ndarray:
    return unit(np.random.default_rng(seed).standard_normal((n, DIM)))


def ids(rows) -> list[list[str]]:
    return [[n.entry_id for n in row] for row in rows]


INDEXES = [pytest.param("local"), pytest.param("embedded"), pytest.param("redis", marks=pytest.mark.redis)]


@pytest.fixture(params=INDEXES)
def index(request, fake_clock) -> Iterator[SemanticIndex | SharedIndex]:
    if request.param == "local":
        made = SemanticIndex()
    elif request.param == "embedded":
        made = SharedIndex(None, clock=fake_clock)
    else:
        made = SharedIndex(
            request.getfixturevalue("redis_url"), secret=b"the deployment secret of this test", follow=False,
            clock=fake_clock,
        )
    yield made
    made.close()


def test_search_is_best_first_with_cosine_similarities(index) -> None:
    e = np.eye(DIM, dtype=np.float32)
    index.add(A, ["e0", "e1", "e2"], unit([e[0], e[1], e[1] + e[2]]))
    (row,) = index.search(A, e[1:2], 3)
    assert [(n.entry_id, round(n.similarity, 4)) for n in row] == [("e1", 1.0), ("e2", 0.7071), ("e0", 0.0)]
    assert ids(index.search(A, e[1:2], 2)) == [["e1", "e2"]]  # k bounds the row
    assert len(index) == 3 and index.scopes() == [A]


def test_identical_vectors_never_cross_scopes(index) -> None:
    vecs = random_unit(4)
    index.add(A, ["a0", "a1"], vecs[:2])
    index.add(B, ["b0", "b1"], vecs[:2])
    assert ids(index.search(A, vecs[:2], 4)) == [["a0", "a1"], ["a1", "a0"]]
    assert ids(index.search(B, vecs[:2], 4)) == [["b0", "b1"], ["b1", "b0"]]
    assert ids(index.search(Scope("tenant-c", "fn@m"), vecs[:1], 4)) == [[]]  # a scope holding nothing
    assert sorted(index.scopes()) == sorted([A, B]) and len(index) == 4


def test_removal_takes_entries_out_of_one_scope_only(index) -> None:
    e = np.eye(DIM, dtype=np.float32)
    vecs = unit([e[0], e[0] + e[1], e[0] + 2 * e[1]])  # nearest to e0: x, then y, then z
    index.add(A, ["x", "y", "z"], vecs)
    index.add(B, ["x"], vecs[:1])
    index.remove(A, ["x", "unknown"])  # unknown ids are ignored
    assert ids(index.search(A, vecs[:1], 3)) == [["y", "z"]]
    assert ids(index.search(B, vecs[:1], 3)) == [["x"]]
    with pytest.raises(KeyError):
        index.vector(A, "x")
    assert index.get(A, "x") is None and index.get(B, "x") is not None
    index.remove(A, ["y", "z"])
    assert index.scopes() == [B] and len(index) == 1


def test_adding_an_existing_id_replaces_its_vector_and_metadata(index) -> None:
    old, new = random_unit(2, seed=3)
    index.add(A, ["e"], old[None, :], metas=[{"prompt": "old"}])
    index.add(A, ["e"], new[None, :], metas=[{"prompt": "new"}])
    assert len(index) == 1
    assert np.allclose(index.vector(A, "e"), new)
    (row,) = index.search(A, new[None, :], 5)
    assert [n.entry_id for n in row] == ["e"] and row[0].similarity == pytest.approx(1.0, abs=1e-5)
    assert index.get(A, "e").meta == {"prompt": "new"}


def test_metadata_is_kept_with_each_entry_in_its_scope(index) -> None:
    index.add(A, ["p", "q"], random_unit(2), metas=[{"prompt": "Cancel my plan"}, {}])
    held = index.get(A, "p")
    assert (dict(held.meta), held.expires_at) == ({"prompt": "Cancel my plan"}, None)
    assert dict(index.get(A, "q").meta) == {}
    assert index.get(B, "p") is None and index.get(A, "nope") is None


def test_vector_is_the_stored_row_and_unknown_ids_are_a_key_error(index) -> None:
    vecs = random_unit(2, seed=5)
    index.add(A, ["a", "b"], vecs)
    assert np.allclose(index.vector(A, "b"), vecs[1])
    for scope, entry_id in ((A, "c"), (B, "a")):
        with pytest.raises(KeyError):
            index.vector(scope, entry_id)


def test_bad_input_is_rejected_and_changes_nothing(index) -> None:
    index.add(A, ["a"], random_unit(1))
    with pytest.raises(ValueError, match="rows must be L2-normalised"):
        index.add(A, ["b"], np.ones((1, DIM), dtype=np.float32))
    with pytest.raises(ValueError, match="dimension"):
        index.add(A, ["b"], unit(np.ones((1, DIM + 1))))
    with pytest.raises(TypeError, match="scope must be a Scope"):
        index.add(("tenant-a", "fn@m"), ["b"], random_unit(1))  # type: ignore[arg-type]
    assert len(index) == 1 and index.get(A, "b") is None


def test_a_cache_reads_another_caches_prompt_through_the_index(index) -> None:
    class Table:
        name, dim = "test:table", DIM

        def embed(self, texts):
            return random_unit(1, seed=sum(map(ord, texts[0])))

        def fits(self, text: str) -> bool:
            return True

    mine, theirs = SemanticCache(Table(), index=index), SemanticCache(Table(), index=index)
    mine.insert(A, "a0", "Cancel my subscription", "r0")
    assert theirs.prompt_of("a0", A) == "Cancel my subscription"
    assert theirs.prompt_of("a0", B) is None
    mine.remove(A, ["a0"])
    assert theirs.prompt_of("a0", A) is None
