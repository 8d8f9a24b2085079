"""The seam between a model runner and the KV cache: the cache reaches the engine only through ``KvEngine`` (a
made-up engine with nothing else drives ``prefill`` and ``store`` over real tensors), the runner reaches the
cache only through ``prefill`` and ``store`` (``HFGenerator`` on the example tiny Llama behind a cache that has
nothing else), and one writer thread writes prefix and chunk blocks alike: ``flush_writes`` waits for both, a
failing tier is counted and the request completes, and both are readable by another replica after a flush."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from evocache.controller import DiskConfig, StoreConfig, TierError, build_runtime, namespace_for  # noqa: E402
from evocache.serving import GenerationParams, ModelConfig, load_tokenizer  # noqa: E402
from evocache.serving._model import HFGenerator  # noqa: E402
from evocache.serving.kv import (  # noqa: E402
    BlockGeometry,
    KvConfig,
    KvEngine,
    KvPlan,
    KvPrefixCache,
    KvUsage,
    RopeShiftUnsupported,
)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny-llama"
GREEDY = GenerationParams(max_tokens=8, temperature=0.0, top_p=1.0, seed=None, stop=())
SALT = str(namespace_for("acme"))
BS = 8
WRITER = "evocache-kv-write"  # the name of the lower tiers' writer thread
ENGINE_MEMBERS = {"model_config", "lock", "forward", "rope_shift"}


def ids(n: int, seed: int) -> list[int]:
    return [1000 + (seed * 7919 + i * 104729) % 20000 for i in range(n)]


# -- the engine side: a made-up engine with the protocol's members and nothing else ---------------------------


class FakeEngine:
    """A 2-layer "model" whose keys and values at a position depend on its token and position only (as a
    model's layer 0 does), so a cache built from cached blocks must equal one computed whole. Its logits are
    its keys' sums. Records what it was asked to compute."""

    model_config = None

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.computed: list[list[int]] = []

    def forward(self, ids, cache, positions=None, mask=None):
        start = cache.get_seq_length()
        if positions is None:
            positions = start + torch.arange(len(ids))
        tokens = torch.tensor(list(ids), dtype=torch.float32)
        self.computed.append(list(ids))
        for layer in range(2):
            keys = (tokens * 1e-3 + positions + layer)[None, None, :, None].expand(1, 1, len(ids), 4).clone()
            values = (tokens * 1e-2 - layer)[None, None, :, None].expand(1, 1, len(ids), 4).clone()
            cache.update(keys, values, layer)
        return SimpleNamespace(logits=cache.layers[-1].keys.sum(dim=-1)[:, :, -len(ids):].transpose(1, 2))

    def rope_shift(self):
        raise RopeShiftUnsupported("this engine moves no keys")


def fake_cache(lower=None) -> KvPrefixCache:
    geometry = BlockGeometry(layers=2, kv_heads=1, head_dim=4, block_size=4, dtype="float32")
    return KvPrefixCache(KvConfig(), geometry, extras=("fake",), device="cpu", lower=lower)


def run(kv: KvPrefixCache, engine: FakeEngine, prompt: list[int], plan: KvPlan, usage: KvUsage):
    filled = kv.prefill(plan, prompt, usage, engine)
    assert engine.lock.locked()  # the model stays this request's until its blocks are kept
    kv.store(filled)
    assert not engine.lock.locked()
    return filled


def test_the_fake_engine_has_the_protocols_members_and_nothing_else():
    protocol = {n for n in vars(KvEngine) if not n.startswith("_")} | set(KvEngine.__annotations__)
    assert protocol == ENGINE_MEMBERS
    engine = FakeEngine()
    assert {n for n in dir(engine) if not n.startswith("_")} == ENGINE_MEMBERS | {"computed"}


def test_a_made_up_engine_drives_prefill_and_store_over_real_tensors(tmp_path):
    runtime = build_runtime(StoreConfig(disk=DiskConfig(path=str(tmp_path / "l3"))))
    lower = {"l3": runtime.store.tiers["l3"]}
    engine, prompt, plan = FakeEngine(), ids(21, 1), KvPlan(salt=SALT, tiers=("l1", "l3"))
    kv = fake_cache(lower)
    first = KvUsage()
    whole = run(kv, engine, prompt, plan, first)
    assert engine.computed == [prompt]
    assert (first.cached_tokens, first.recomputed, first.stored_blocks, first.miss) == (0, 21, 5, "never-seen")
    again = KvUsage()
    engine.computed.clear()
    reused = run(kv, engine, prompt, plan, again)
    assert engine.computed == [prompt[20:]]  # five blocks of four from L1: the rest computed
    assert (again.reused, again.recomputed, again.stored_blocks, again.miss) == ({"l1": 20}, 1, 0, "")
    for a, b in zip(whole.cache.layers, reused.cache.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert torch.equal(whole.logits[0, -1], reused.logits[0, -1])
    kv.flush_writes()
    cold, usage = fake_cache(lower), KvUsage()  # another replica: the blocks are on disk only
    engine.computed.clear()
    run(cold, engine, prompt, plan, usage)
    assert usage.reused == {"l1": 0, "l3": 20} and engine.computed == [prompt[20:]]
    kv.close()
    cold.close()
    runtime.close()


def test_the_ingress_hashes_are_used_when_the_plan_carries_them():
    engine, prompt, kv = FakeEngine(), ids(17, 2), fake_cache()
    given = kv.hasher.prefix(prompt, "the ingress's salt")  # not what the cache would hash under SALT
    run(kv, engine, prompt, KvPlan(salt=SALT, hashes=given), KvUsage())
    assert all(h in kv.l1 for h in given)
    assert not any(h in kv.l1 for h in kv.hasher.prefix(prompt, SALT))


def test_an_engine_that_fails_leaves_its_lock_free():
    class Failing(FakeEngine):
        def forward(self, ids, cache, positions=None, mask=None):
            raise RuntimeError("out of memory")

    engine, kv = Failing(), fake_cache()
    with pytest.raises(RuntimeError, match="out of memory"):
        kv.prefill(KvPlan(salt=SALT), ids(9, 3), KvUsage(), engine)
    assert not engine.lock.locked()


# -- the runner side: HFGenerator reaches the cache through prefill and store only ----------------------------


@pytest.fixture(scope="module")
def generator():
    return HFGenerator(ModelConfig(kind="hf", id="tiny-llama", path=str(EXAMPLE)), load_tokenizer("minilm"))


def attach(generator, lower=None) -> KvPrefixCache:
    kv = KvPrefixCache(KvConfig(), BlockGeometry.of_model(generator.model, BS),
                       extras=("tiny-llama", "", "float32", ""), device="cpu", lower=lower)
    generator.attach_kv(kv)
    return kv


class _OnlyTheEngine:
    """The runner's engine with the protocol's members only: the cache can reach nothing else of it."""

    __slots__ = ("_engine",)

    def __init__(self, engine):
        self._engine = engine

    @property
    def model_config(self):
        return self._engine.model_config

    @property
    def lock(self):
        return self._engine.lock

    def forward(self, ids, cache, positions=None, mask=None):
        return self._engine.forward(ids, cache, positions, mask)

    def rope_shift(self):
        return self._engine.rope_shift()


class _OnlyTheSeam:
    """A KV cache with ``prefill`` and ``store`` only, recording the calls."""

    __slots__ = ("_kv", "calls")

    def __init__(self, kv):
        self._kv, self.calls = kv, []

    def prefill(self, plan, ids, usage, engine):
        self.calls.append("prefill")
        return self._kv.prefill(plan, ids, usage, _OnlyTheEngine(engine))

    def store(self, filled):
        self.calls.append("store")
        self._kv.store(filled)


# Preamble A or B, the same 40-token chunk C, then a question Q.
A, B, C, Q = ids(13, 1), ids(29, 2), ids(40, 3), ids(5, 4)
FIRST, SECOND = A + C + Q, B + C + Q
FIRST_CHUNKS, SECOND_CHUNKS = (0, len(A), len(A) + len(C)), (0, len(B), len(B) + len(C))


def chunk_plan(chunks, tiers=("l1", "l2", "l3")) -> KvPlan:
    return KvPlan(salt=SALT, tiers=tiers, mode="chunks", recompute_tokens=0, chunks=chunks)


def tokens(generator, prompt, plan=None, usage=None) -> list[str]:
    return list(generator.stream("", prompt, GREEDY, plan, usage if plan else None))


def prefill(generator, prompt, plan, usage):
    with torch.no_grad():
        return generator._prefill(list(prompt), plan, usage)


def test_the_runner_reaches_the_cache_through_prefill_and_store_only(generator):
    generator.attach_kv(None)
    expected = tokens(generator, FIRST)
    kv = KvPrefixCache(KvConfig(), BlockGeometry.of_model(generator.model, BS),
                       extras=("tiny-llama", "", "float32", ""), device="cpu")
    seam = _OnlyTheSeam(kv)
    generator.attach_kv(seam)
    first, again, usage = KvUsage(), KvUsage(), KvUsage()
    assert tokens(generator, FIRST, chunk_plan(FIRST_CHUNKS), first) == expected  # nothing cached: exact
    assert tokens(generator, FIRST, KvPlan(salt=SALT), again) == expected
    assert again.reused == {"l1": (len(FIRST) - 1) // BS * BS}
    # Chunk reuse needs the engine's RoPE shift and its forward at other positions.
    tokens(generator, SECOND, chunk_plan(SECOND_CHUNKS), usage)
    assert usage.reused["chunk"] == len(C)
    assert seam.calls == ["prefill", "store"] * 3
    generator.attach_kv(None)
    kv.close()


# -- one writer thread for prefix and chunk blocks ------------------------------------------------------------


class _Recording:
    """A lower tier (a real one underneath) that records which thread wrote which keys, and can hold writes
    until ``gate`` is set or fail them."""

    def __init__(self, tier, fail: bool = False):
        self.tier, self.fail = tier, fail
        self.gate = threading.Event()
        self.gate.set()
        self.writes: list[tuple[str, list[str]]] = []

    def get_many(self, ns, keys):
        return self.tier.get_many(ns, keys)

    def set_many(self, ns, items):
        self.gate.wait(timeout=60)  # a write made on the request's path fails the test instead of hanging it
        self.writes.append((threading.current_thread().name, [k for k, _ in items]))
        if self.fail:
            raise TierError("l3", "the disk is full")
        self.tier.set_many(ns, items)

    def delete(self, ns, keys):
        return self.tier.delete(ns, keys)


def keys_of(kv: KvPrefixCache, hashes) -> set[str]:
    return {kv.hasher.tier_key(h, g) for h in hashes for g in kv.lower.groups}


def test_chunk_blocks_are_written_by_the_writer_thread_and_flush_waits_for_them(generator, tmp_path):
    runtime = build_runtime(StoreConfig(disk=DiskConfig(path=str(tmp_path / "l3"))))
    disk = _Recording(runtime.store.tiers["l3"])
    kv = attach(generator, {"l3": disk})
    disk.gate.clear()  # the tier holds every write: a write on the request's path would hold the request
    prefill(generator, FIRST, chunk_plan(FIRST_CHUNKS, ("l1", "l3")), KvUsage())
    assert disk.writes == []
    with pytest.raises(TimeoutError):
        kv.flush_writes(timeout=0.05)  # a write is pending: flush does not return before it is done
    disk.gate.set()
    kv.flush_writes()
    chunk = keys_of(kv, kv.hasher.chunk(C, SALT))
    written = {k for _, keys in disk.writes for k in keys}
    assert chunk <= written and keys_of(kv, kv.hasher.prefix(FIRST, SALT)) <= written
    assert {thread for thread, _ in disk.writes} == {f"{WRITER}_0"}
    kv.close()
    runtime.close()


def test_a_tier_failing_chunk_writes_is_counted_and_the_request_completes(generator, tmp_path):
    generator.attach_kv(None)
    expected = tokens(generator, FIRST)
    runtime = build_runtime(StoreConfig(disk=DiskConfig(path=str(tmp_path / "l3"))))
    disk = _Recording(runtime.store.tiers["l3"], fail=True)
    kv = attach(generator, {"l3": disk})
    usage = KvUsage()
    assert tokens(generator, FIRST, chunk_plan(FIRST_CHUNKS, ("l1", "l3")), usage) == expected
    kv.flush_writes()
    chunk_blocks = len(A) // BS + len(C) // BS + len(Q) // BS  # every chunk was computed whole
    assert kv.lower.errors == len(disk.writes) == usage.stored_blocks + chunk_blocks
    assert all(kv.l1.get(h) is not None for h in kv.hasher.chunk(C, SALT))  # L1 kept them all the same
    kv.close()
    runtime.close()


def test_a_requests_prefix_and_chunk_blocks_are_both_readable_after_a_flush(generator, tmp_path):
    runtime = build_runtime(StoreConfig(disk=DiskConfig(path=str(tmp_path / "l3"))))
    lower = {"l3": runtime.store.tiers["l3"]}
    warm = attach(generator, lower)
    usage = KvUsage()
    prefill(generator, FIRST, chunk_plan(FIRST_CHUNKS, ("l1", "l3")), usage)
    warm.flush_writes()
    prefix, chunk = warm.hasher.prefix(FIRST, SALT), warm.hasher.chunk(C, SALT)
    assert usage.stored_blocks == len(prefix)
    cold = attach(generator, lower)  # another replica: empty L1, the same disk
    blocks = cold.lower.read(SALT, ("l3",), prefix)
    chunks = cold.lower.read(SALT, ("l3",), chunk, chunk=True)
    assert blocks.tiers == ("l3",) * len(prefix) and chunks.tiers == ("l3",) * len(chunk)
    assert [b.position for b in chunks.blocks] == [len(A) + j * BS for j in range(len(chunk))]
    for h, block in zip(prefix, blocks.blocks, strict=True):
        assert all(torch.equal(x, y) for pair, held in zip(block, warm.l1.get(h), strict=True)
                   for x, y in zip(pair, held, strict=True))
    again = KvUsage()  # and through the seam: the chunk is reused after another preamble
    prefill(generator, SECOND, chunk_plan(SECOND_CHUNKS, ("l1", "l3")), again)
    assert again.reused["chunk"] == len(C)
    generator.attach_kv(None)
    warm.close()
    cold.close()
    runtime.close()
