"""`evocache bench semantic`: the report's schema and definitions, the static baseline, pairs, errors."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from _bench_scripts import load_bench_script
from evocache.cli.app import app as evocache
from evocache.controller.semantic._bench import (
    StreamRow,
    VectorTable,
    PairRow,
    best_static,
    oracle_hit_rate,
    pair_answers,
    prior_neighbours,
    read_rows,
    replay_prefixes,
    replay_stream,
    static_replay,
)
from evocache.controller.semantic._cache import SemanticCache
from evocache.controller.semantic._decide import StaticPolicy
from evocache.controller.semantic._index import Scope
from evocache.controller.errors import TraceError
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parent.parent
BANKING = ROOT / "examples" / "data" / "banking77_train.jsonl"
PAIRS = ROOT / "bench" / "data" / "fow_traps.jsonl"


def _head(path: Path, n: int, out: Path) -> Path:
    with open(path, encoding="utf-8") as f:
        out.write_text("".join(line for _, line in zip(range(n), f, strict=False)), encoding="utf-8")
    return out


def _rows(seed: int, n: int = 600, groups: int = 12) -> tuple[list[StreamRow], np.ndarray]:
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(groups, 16))
    labels = rng.integers(0, groups, size=n)
    vecs = centres[labels] + rng.normal(scale=0.6, size=(n, 16))
    vecs = (vecs / np.linalg.norm(vecs, axis=1, keepdims=True)).astype(np.float32)
    rows = [StreamRow(f"p{i}", f"g{g}") for i, g in enumerate(labels)]
    rows += [StreamRow("p3", rows[3].group), StreamRow("p5", rows[5].group)]  # exact duplicates
    return rows, np.concatenate([vecs, vecs[[3, 5]]])


@pytest.mark.parametrize("threshold", [0.6, 0.75, 0.85, 0.95])
def test_static_baseline_replays_exactly_like_the_static_cache(threshold: float) -> None:
    rows, vecs = _rows(1)
    texts = [r.prompt for r in rows]
    unique = list(dict.fromkeys(texts))
    table = VectorTable(unique, vecs[: len(unique)], "test")
    cache = SemanticCache(table, policy=StaticPolicy(threshold=threshold))
    scope = Scope("bench", "x")
    hits = wrong = 0
    for i, row in enumerate(rows):
        _, entry = cache.lookup(scope, row.prompt, max_error=0.5)
        if entry is not None:
            hits += 1
            wrong += cache.answer_ref(entry) != row.group
        else:
            cache.insert(scope, f"e{i}", row.prompt, row.group)
    idx, sims = prior_neighbours(vecs, k=4)  # a small k forces the exact fallback too
    assert static_replay(rows, vecs, threshold, (idx.tolist(), sims.tolist())) == (hits, wrong)


def test_best_static_is_the_highest_hit_rate_within_delta() -> None:
    rows, vecs = _rows(2)
    n = len(rows)
    idx, sims = prior_neighbours(vecs)
    prior = (idx.tolist(), sims.tolist())
    grid = (0.5, 0.6, 0.7, 0.8, 0.9)
    curve = {t: static_replay(rows, vecs, t, prior) for t in grid}
    best = best_static(rows, vecs, [0.02, 0.1], grid)
    for delta in (0.02, 0.1):
        allowed = [t for t in grid if curve[t][1] / n <= delta]
        t = max(allowed, key=lambda t: (curve[t][0], t))
        assert best[delta] == {"threshold": t, "hit_rate": curve[t][0] / n, "error_rate": curve[t][1] / n}


def test_oracle_hit_rate_counts_groups_seen_before() -> None:
    rows = [StreamRow("a", "x"), StreamRow("b", "y"), StreamRow("c", "x"), StreamRow("d", "x"), StreamRow("e", "z")]
    assert oracle_hit_rate(rows) == 2 / 5


def test_malformed_lines_are_named_by_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "group": "g"}\n\n{"prompt": 3, "group": "g"}\n')
    with pytest.raises(TraceError) as caught:
        read_rows(bad)
    assert str(caught.value) == f"{bad}:3: field 'prompt' must be a string, got 3"
    bad.write_text("not json\n")
    with pytest.raises(TraceError, match=r":1: not JSON"):
        read_rows(bad)


def test_stream_report_schema_and_definitions_with_the_real_model(tmp_path: Path) -> None:
    data = _head(BANKING, 300, tmp_path / "stream.jsonl")
    out = tmp_path / "out.json"
    cache_dir = tmp_path / "emb"
    result = CliRunner().invoke(
        evocache,
        ["bench", "semantic", "--data", str(data), "--delta", "0.05", "--seed", "3", "--json", str(out),
         "--embed-cache", str(cache_dir)],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    rows = read_rows(data)
    assert report["n"] == 300
    assert report["oracle_hit_rate"] == oracle_hit_rate(rows)  # type: ignore[arg-type]
    assert set(report["evocache"]) >= {"hit_rate", "error_rate", "exploration_calls"}
    assert set(report["best_static"]) == {"threshold", "hit_rate", "error_rate"}
    evo = report["evocache"]
    assert evo["hit_rate"] == evo["hits"] / 300 and evo["error_rate"] == evo["wrong"] / 300
    assert evo["error_rate"] <= 0.05 and report["best_static"]["error_rate"] <= 0.05
    assert isinstance(evo["exploration_calls"], int) and evo["judge_calls"] > 0
    assert (report["delta"], report["seed"], report["embedder"]) == (0.05, 3, "st:all-MiniLM-L6-v2")
    assert "best static" in result.output
    assert len(list(cache_dir.glob("*.npy"))) == 1
    # the same run again reads the cached embeddings and gives the same report (the seed fixes the draws)
    again = CliRunner().invoke(
        evocache,
        ["bench", "semantic", "--data", str(data), "--delta", "0.05", "--seed", "3", "--json", str(out),
         "--embed-cache", str(cache_dir)],
    )
    assert again.exit_code == 0 and json.loads(out.read_text()) == report


def test_pairs_report_per_category(tmp_path: Path) -> None:
    pairs = [json.loads(line) for line in PAIRS.read_text().splitlines()]
    rng = random.Random(0)
    rng.shuffle(pairs)
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in pairs[:120]))
    out = tmp_path / "pairs.json"
    result = CliRunner().invoke(evocache, ["bench", "semantic", "--data", str(data), "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    chosen = pairs[:120]
    expected = {}
    for p in chosen:
        expected[p["category"]] = expected.get(p["category"], 0) + 1
    cats = report["evocache"]["categories"]
    assert {name: c["pairs"] for name, c in cats.items()} == expected
    for name, c in cats.items():
        trap = not any(p["same_answer"] for p in chosen if p["category"] == name)
        # A trap served is a wrong answer for a trap's b; an exact hit (its text stored for another pair) is not.
        assert c["traps_served"] == (c["wrong"] if trap else 0)
        assert c["traps_served"] <= c["hits"] - c["exact_hits"]
        assert (c["trap_rate"] is None) == (not trap)
    assert set(report["static"]) == {"0.8", "0.85", "0.9", "0.95"}
    assert report["n"] == 120


def test_pair_answers_follow_same_answer_links_and_identical_texts() -> None:
    pairs = [
        PairRow("cancel my plan", "end my plan", True, "paraphrase"),
        PairRow("end my plan", "stop my plan", True, "paraphrase"),  # transitively the same answer
        PairRow("cancel my plan", "don't cancel my plan", False, "negation"),
        PairRow("don't cancel my plan", "keep my plan", True, "paraphrase"),  # a trap's b written again
        PairRow("open on sundays?", "closed on sundays?", False, "negation"),
    ]
    answers = pair_answers(pairs)
    assert answers["cancel my plan"] == answers["end my plan"] == answers["stop my plan"]
    assert answers["don't cancel my plan"] == answers["keep my plan"] != answers["cancel my plan"]
    assert answers["open on sundays?"] != answers["closed on sundays?"]
    assert len(set(answers.values())) == 4
    with pytest.raises(ValueError, match="pairs contradict: 'stop my plan' and 'cancel my plan'"):
        pair_answers([*pairs, PairRow("stop my plan", "cancel my plan", False, "negation")])


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["--delta", "0.7"], 2, "error: --delta: expected a number in (0, 0.5], got 0.7"),
        (["--mode", "static"], 2, "error: --threshold: --mode static needs a threshold in (0, 1]"),
        (["--threshold", "0.9"], 2,
         "error: --threshold: applies only to --mode static (bounded learns its own cut-off)"),
        (["--explore", "1.5"], 2, "error: --explore: expected a fraction in [0, 1), got 1.5"),
        (["--embedder", "word2vec"], 2, "error: --embedder: expected minilm or openai:MODEL@BASE_URL, got 'word2vec'"),
    ],
)
def test_bad_options_exit_2_with_one_line(tmp_path: Path, args: list[str], code: int, message: str) -> None:
    data = _head(BANKING, 5, tmp_path / "s.jsonl")
    result = CliRunner().invoke(evocache, ["bench", "semantic", "--data", str(data), *args])
    assert (result.exit_code, result.output.strip()) == (code, message)


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    result = CliRunner().invoke(evocache, ["bench", "semantic", "--data", str(missing)])
    assert (result.exit_code, result.output.strip()) == (2, f"error: {missing}: No such file or directory")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n')
    result = CliRunner().invoke(evocache, ["bench", "semantic", "--data", str(bad)])
    assert (result.exit_code, result.output.strip()) == (1, f"{bad}:1: missing field 'group'")


PAIR = {"a": "x", "b": "y", "same_answer": True, "category": "c"}


@pytest.mark.parametrize(("line", "message"), [
    ({k: v for k, v in PAIR.items() if k != "category"}, "missing field 'category'"),
    ({**PAIR, "same_answer": "yes"}, 'field \'same_answer\' must be a boolean, got "yes"'),
    ({**PAIR, "same_answer": 1}, "field 'same_answer' must be a boolean, got 1"),
    ({**PAIR, "b": None}, "field 'b' must be a string, got null"),
    ({**PAIR, "category": ["x" * 50]}, 'field \'category\' must be a string, got ["' + "x" * 35 + "..."),
    ({"prompt": "hi"}, "missing field 'group'"),
    ({"prompt": "hi", "group": True}, "field 'group' must be a string or an int, got true"),
    ({"group": "g"}, "missing field 'prompt'"),
])
def test_a_malformed_line_names_its_field(tmp_path: Path, line: dict, message: str) -> None:
    first = PAIR if "a" in line or "b" in line or "category" in line else {"prompt": "ok", "group": "g"}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(first) + "\n\n" + json.dumps(line) + "\n")
    with pytest.raises(TraceError) as caught:
        read_rows(bad)
    assert str(caught.value) == f"{bad}:3: {message}"


def test_outputs_are_checked_before_anything_is_read(tmp_path: Path) -> None:
    never = str(tmp_path / "never-read.jsonl")
    out = tmp_path / "nonexistent" / "o.json"
    result = CliRunner().invoke(evocache, ["bench", "semantic", "--data", never, "--json", str(out)])
    assert (result.exit_code, result.output) == (
        2, f"error: --json: {out}: the directory {out.parent} does not exist\n")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cache = blocker / "embeddings"
    result = CliRunner().invoke(evocache, ["bench", "semantic", "--data", never, "--embed-cache", str(cache)])
    assert (result.exit_code, result.output) == (
        2, f"error: --embed-cache: {cache}: cannot make the directory: Not a directory\n")


def test_a_missing_warmup_is_named_as_such(tmp_path: Path) -> None:
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps(PAIR) + "\n")
    missing = tmp_path / "nonexist.jsonl"
    result = CliRunner().invoke(evocache, ["bench", "semantic", "--data", str(pairs), "--warmup", str(missing)])
    assert (result.exit_code, result.output) == (2, f"error: --warmup: {missing}: No such file or directory\n")


class _HashEmbedder:
    """Unit vectors drawn from each text's digest: no model, the same vector for the same text."""

    name = "hash"

    def fits(self, text: str) -> bool:
        return True

    def embed(self, texts: list[str]) -> np.ndarray:
        import hashlib

        vecs = np.stack([np.random.default_rng(int(hashlib.sha256(t.encode()).hexdigest()[:8], 16)).normal(size=8)
                         for t in texts]).astype(np.float32)
        return vecs / np.linalg.norm(vecs, axis=1, keepdims=True)


@pytest.mark.parametrize(("args", "cell"), [([], "learnt"), (["--mode", "static", "--threshold", "0.875"], "0.875")])
def test_the_threshold_column_says_what_evocache_served_at(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           args: list[str], cell: str) -> None:
    from evocache.controller.semantic import commands

    monkeypatch.setattr(commands, "_make_embedder", lambda spec: _HashEmbedder())
    data = tmp_path / "s.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i % 7}", "group": f"g{i % 3}"}) + "\n" for i in range(30)))
    result = CliRunner().invoke(evocache, ["bench", "semantic", "--data", str(data), *args])
    assert result.exit_code == 0, result.output
    row = next(line for line in result.output.splitlines() if line.startswith("evocache"))
    assert row.split()[3] == cell


def _bench_module(name: str = "semantic_ceiling"):  # bench/*.py are scripts, not package modules
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_ceiling_serves_the_most_confident_first_until_delta_is_spent() -> None:
    ceiling = _bench_module()
    confidence = np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0])
    correct = np.array([True, True, False, True, True, False, True, True, True, True])
    assert ceiling.frontier(confidence, correct, 0.0) == 0.2  # stops before the first wrong one
    assert ceiling.frontier(confidence, correct, 0.1) == 0.5  # one wrong allowed: up to the second wrong one
    assert ceiling.frontier(confidence, correct, 0.2) == 1.0
    assert ceiling.frontier(confidence, np.zeros(10, dtype=bool), 0.05) == 0.0
    first_unservable = np.array([-np.inf, 0.9, 0.8, 0.7])
    assert ceiling.frontier(first_unservable, np.array([False, True, True, True]), 0.25) == 0.75


def test_the_label_oracle_votes_by_the_stored_prompts_true_groups() -> None:
    ceiling = _bench_module()
    e = np.eye(3, dtype=np.float32)
    near_a = (e[0] + 0.1 * e[1]) / np.linalg.norm(e[0] + 0.1 * e[1])
    vecs = np.stack([e[0], e[1], near_a, e[2]])
    confidence, correct = ceiling.label_oracle(["a", "b", "a", "c"], vecs)
    assert not np.isfinite(confidence[0])  # nothing stored yet: never served
    assert correct.tolist() == [False, False, True, False]  # "c" has no stored prompt of its group
    assert confidence[2] > confidence[3]


def test_the_bench_table_has_a_line_of_traps_per_pair_seed() -> None:
    def run(entity: int, negation: int, error: float) -> dict:
        cats = {"entity_swap": (75, entity), "negation": (75, negation), "paraphrase": (200, None)}
        return {"error_rate": error, "lookups": 1200, "categories": {
            name: {"pairs": n, "hits": 9, "traps_served": t or 0, "trap_rate": None if t is None else t / n}
            for name, (n, t) in cats.items()}}

    seeds = {"0": {"cold": run(3, 2, 0.0075), "warm": run(1, 0, 0.0008)},
             "1": {"cold": run(4, 6, 0.0133), "warm": run(3, 0, 0.0058)}}
    pairs = {"delta": 0.02, "seed": 0, "warm": seeds["0"]["warm"], "cold": seeds["0"]["cold"], "seeds": seeds,
             "static": {}}
    text = _bench_module("semantic")._markdown([], pairs)
    assert "fow traps at δ = 0.02, pair seed 0" in text
    assert "Traps served per pair seed (entity_swap / negation):" in text
    assert "- seed 1: cold 4 / 6 (error per lookup 0.0133); warm 3 / 0 (error per lookup 0.0058)" in text


# -- bench/semantic.py: every option checked before any work ---------------------------------------------------


@pytest.mark.parametrize(("args", "message"), [
    (["--streams", "banking77,foo"], "--streams: 'foo' is not a known stream (banking77, clinc150)"),
    (["--deltas", "abc"], "--deltas: 'abc' is not a number in (0, 0.5]"),
    (["--deltas", "0.02,0.9"], "--deltas: '0.9' is not a number in (0, 0.5]"),
    (["--deltas", "0.02,nan"], "--deltas: 'nan' is not a number in (0, 0.5]"),
    (["--pairs-delta", "0"], "--pairs-delta: '0' is not a number in (0, 0.5]"),
    (["--seeds", "0,1.5"], "--seeds: '1.5' is not an integer"),
    (["--pairs-seeds", "x"], "--pairs-seeds: 'x' is not an integer"),
    (["--shuffled", "-1"], "--shuffled: '-1' is not an integer >= 0"),
])
def test_the_bench_script_refuses_a_bad_option_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exited:
        _bench_module("semantic").options([*args, "--out", str(tmp_path / "out")])
    assert exited.value.code == 2
    assert capsys.readouterr().err == f"semantic.py: error: {message}\n"


@pytest.mark.parametrize("option", ["--out", "--embed-cache"])
def test_the_bench_script_refuses_an_unwritable_directory(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    paths = {"--out": str(tmp_path / "out"), "--embed-cache": str(tmp_path / "emb"), option: str(blocker / "d")}
    with pytest.raises(SystemExit) as exited:
        _bench_module("semantic").options([f"{k}={v}" for k, v in paths.items()])
    assert exited.value.code == 2
    assert capsys.readouterr().err == (f"semantic.py: error: {option}: {blocker / 'd'}: cannot make the directory: "
                                       "Not a directory\n")


def test_the_bench_script_reads_its_options_into_values(tmp_path: Path) -> None:
    got = _bench_module("semantic").options(["--streams", "clinc150,clinc150", "--deltas", "0.01, 0.5",
                                             "--seeds", "3", "--shuffled", "0", "--pairs-seeds", "0,4",
                                             "--no-pairs", "--out", str(tmp_path / "o"),
                                             "--embed-cache", str(tmp_path / "e")])
    assert (got.streams, got.deltas, got.seeds, got.shuffled, got.pairs_delta, got.pairs_seeds, got.pairs) == (
        ("clinc150",), (0.01, 0.5), (3,), 0, 0.02, (0, 4), False)


@pytest.mark.slow
def test_the_bench_script_fails_without_a_traceback_and_gives_defaults_in_help() -> None:
    import subprocess
    import sys

    script = str(ROOT / "bench" / "semantic.py")
    done = subprocess.run([sys.executable, script, "--streams", "foo", "--no-pairs"], capture_output=True,
                          text=True, timeout=120)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == "semantic.py: error: --streams: 'foo' is not a known stream (banking77, clinc150)\n"
    usage = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=120)
    text = " ".join(usage.stdout.split())
    for option in ("--streams", "--deltas", "--seeds", "--shuffled", "--pairs-delta", "--pairs-seeds", "--no-pairs",
                   "--out", "--embed-cache", "--generalisation", "--gen-deltas", "--gen-prefixes", "--gen-shuffles",
                   "--gen-pairs-seeds", "--gen-warmup"):
        assert option in text
    assert text.count("(default: ") == 15


def test_classify_reaches_the_cache_and_the_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from evocache.controller.semantic import _bench

    seen: list[bool] = []
    real = _bench.SemanticCache

    def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(kwargs["classify"])
        return real(*args, **kwargs)

    monkeypatch.setattr(_bench, "SemanticCache", recording)
    data = _head(BANKING, 60, tmp_path / "stream.jsonl")
    for flag, on in (([], True), (["--no-classify"], False)):
        out = tmp_path / "out.json"
        result = CliRunner().invoke(
            evocache, ["bench", "semantic", "--data", str(data), "--delta", "0.05", *flag, "--json", str(out)]
        )
        assert result.exit_code == 0, result.output
        assert seen[-1] is on and json.loads(out.read_text())["classify"] is on


# -- bench/semantic.py --generalisation ----------------------------------------------------------------------


@pytest.mark.parametrize(("args", "message"), [
    (["--gen-prefixes", "0"], "--gen-prefixes: '0' is not an integer >= 1 or all"),
    (["--gen-prefixes", "100,most"], "--gen-prefixes: 'most' is not an integer >= 1 or all"),
    (["--gen-shuffles", "0"], "--gen-shuffles: '0' is not an integer >= 1"),
    (["--gen-deltas", "0.02,0.6"], "--gen-deltas: '0.6' is not a number in (0, 0.5]"),
    (["--gen-pairs-seeds", "0,a"], "--gen-pairs-seeds: 'a' is not an integer"),
    (["--gen-warmup", "-5"], "--gen-warmup: '-5' is not an integer >= 1 or all"),
])
def test_the_generalisation_options_are_checked_before_any_work(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exited:
        _bench_module("semantic").options(["--generalisation", *args, "--out", str(tmp_path / "out")])
    assert exited.value.code == 2
    assert capsys.readouterr().err == f"semantic.py: error: {message}\n"


def test_the_generalisation_options_read_into_values(tmp_path: Path) -> None:
    semantic = _bench_module("semantic")
    got = semantic.options(["--generalisation", "--gen-prefixes", "300, all,300", "--gen-shuffles", "2",
                            "--gen-deltas", "0.01,0.05", "--gen-pairs-seeds", "4", "--gen-warmup", "500",
                            "--out", str(tmp_path / "o"), "--embed-cache", str(tmp_path / "e")])
    assert (got.generalisation, got.gen_prefixes, got.gen_shuffles, got.gen_deltas, got.gen_pairs_seeds,
            got.gen_warmup) == (True, (300, None), 2, (0.01, 0.05), (4,), 500)
    default = semantic.options(["--out", str(tmp_path / "o"), "--embed-cache", str(tmp_path / "e")])
    assert (default.generalisation, default.gen_prefixes, default.gen_shuffles, default.gen_deltas,
            default.gen_pairs_seeds, default.gen_warmup) == (False, (1000, 3000, None), 3, (0.02,), (0, 1, 2),
                                                   None)


def _two_streams() -> tuple[dict[str, list[StreamRow]], list[PairRow], VectorTable]:
    """Two small labelled streams (their own groups and texts) and a few pairs, with their vectors."""
    streams, texts, vecs = {}, [], []
    for name, seed, n in (("banking77", 3, 180), ("clinc150", 4, 140)):
        rows, v = _rows(seed, n=n, groups=6)
        rows = [StreamRow(f"{name}:{r.prompt}", f"{name}:{r.group}") for r in rows]
        streams[name] = rows
        unique = list(dict.fromkeys(r.prompt for r in rows))
        texts += unique
        vecs.append(v[: len(unique)])
    rng = np.random.default_rng(5)
    pairs = []
    for i in range(24):
        a = rng.normal(size=16)
        b = a + rng.normal(scale=0.3, size=16)
        pairs.append(PairRow(f"a{i}", f"b{i}", i % 2 == 0, "paraphrase" if i % 2 == 0 else "negation"))
        texts += [f"a{i}", f"b{i}"]
        vecs.append(np.stack([a, b]) / np.linalg.norm(np.stack([a, b]), axis=1, keepdims=True))
    return streams, pairs, VectorTable(texts, np.concatenate(vecs).astype(np.float32), "test")


def test_a_prefix_of_one_replay_is_the_replay_of_that_prefix() -> None:
    streams, _, table = _two_streams()
    rows, warm = streams["banking77"], streams["clinc150"][:80]
    for warmup in ((), warm):
        at = replay_prefixes(rows, table, 0.05, [150, 40], seed=7, warmup=warmup)
        assert at == [replay_stream(rows[:n], table, 0.05, seed=7, warmup=warmup) for n in (150, 40)]
    with pytest.raises(ValueError, match="prefix lengths must be in 1 .. 182"):
        replay_prefixes(rows, table, 0.05, [0, 10])


def test_a_replay_given_a_policy_decides_with_it() -> None:
    from evocache.controller.semantic._policies import PolicyOptions

    streams, _, table = _two_streams()
    rows = streams["banking77"]
    built = PolicyOptions(explore=0.2).build()
    given = replay_prefixes(rows, table, 0.05, [len(rows)], seed=3, policy=built)[0]
    # the same figures as the replay that builds that policy itself, and the verdicts reached the policy given
    assert given == replay_prefixes(rows, table, 0.05, [len(rows)], seed=3, explore=0.2)[0]
    assert built.calibration.n == given["exploration_calls"] > 0
    assert given["calibration_bounded"] is built.calibration.bounded


def test_the_generalisation_runs_prefixes_cross_domain_and_pairs(tmp_path: Path, monkeypatch) -> None:
    semantic = _bench_module("semantic")
    args = semantic.options(["--generalisation", "--gen-prefixes", "60,all", "--gen-shuffles", "2",
                             "--gen-deltas", "0.05", "--gen-pairs-seeds", "0,1", "--gen-warmup", "100",
                             "--out", str(tmp_path / "o"), "--embed-cache", str(tmp_path / "e")])
    streams, pairs, table = _two_streams()
    rows = semantic.generalisation(args, streams, pairs, table)

    # per stream: 2 orders x 2 lengths, cold and after the other stream; per pair order: cold and after each stream
    assert [(r["run"], r["stream"], r["order"], r["n"], r["learnt_on"]) for r in rows[:4]] == [
        ("prefix", "banking77", "shuffled-100", 60, None), ("prefix", "banking77", "shuffled-100", 182, None),
        ("cross", "banking77", "shuffled-100", 60, "clinc150"), ("cross", "banking77", "shuffled-100", 182, "clinc150")]
    assert len(rows) == 2 * 2 * 2 * 2 + 2 * 3
    assert [(r["run"], r["order"], r["learnt_on"]) for r in rows[-3:]] == [
        ("pairs", "pairs-1", None), ("pairs", "pairs-1", "banking77"), ("pairs", "pairs-1", "clinc150")]
    assert {r["stream"] for r in rows if r["run"] == "pairs"} == {"fow-pairs"}
    assert all(r["n"] == 48 and r["stream_n"] == 48 for r in rows if r["run"] == "pairs")

    tuned = {name: best_static(stream[:100], table.embed([x.prompt for x in stream[:100]]), [0.05])[0.05]
             for name, stream in streams.items()}
    for r in rows:
        evo, static = r["evocache"], r["best_static"]
        assert r["delta"] == 0.05 and r["seed"] == int(r["order"].rsplit("-", 1)[1])
        assert 0 <= evo["error_rate"] <= evo["hit_rate"] <= 1 and evo["hits"] == round(evo["hit_rate"] * r["n"])
        # the warm-up's lookups are not the run's: its explorations are among the run's own misses
        assert evo["exploration_calls"] + evo["hits"] <= r["n"] and evo["exact_hits"] <= evo["hits"]
        assert static["error_rate"] <= 0.05
        assert r["ratio"] == (evo["hit_rate"] / static["hit_rate"] if static["hit_rate"] else None)
        assert r["judge_per_query"] == evo["judge_calls"] / r["n"] and r["judge_per_query"] > 0
        assert r["delta_spent"] == evo["error_rate"] / 0.05
        assert r["meets"] == (evo["error_rate"] <= 0.05 and r["ratio"] is not None and r["ratio"] >= 1.25
                              and r["judge_per_query"] <= 2)
        if r["learnt_on"] is None:
            assert r["transferred_static"] is None and r["warmup_n"] == 0
        else:
            moved = r["transferred_static"]
            assert r["warmup_n"] == 100 and moved["from"] == r["learnt_on"]
            assert moved["threshold"] == tuned[r["learnt_on"]]["threshold"]
            assert 0 <= moved["error_rate"] <= moved["hit_rate"] <= 1
    # a prefix is the start of its shuffled order; the whole stream is its own best static's stream
    shuffled = list(streams["clinc150"])
    random.Random(101).shuffle(shuffled)
    full = next(r for r in rows if r["stream"] == "clinc150" and r["order"] == "shuffled-101" and r["n"] == 142)
    own = best_static(shuffled, table.embed([x.prompt for x in shuffled]), [0.05])[0.05]
    assert full["best_static"] == own and full["stream_n"] == 142

    text = semantic.generalisation_markdown(rows)
    assert text.count("\n") == len(rows) + 2 and "| cross | banking77 | shuffled-100 | 60 | clinc150 | 0.05 |" in text

    results = load_bench_script("_results", monkeypatch)
    path = results.write(tmp_path / "results", "semantic-generalisation", rows, command="x",
                         context=semantic.generalisation_context(args))
    loaded = results.load(path)
    assert loaded.rows == json.loads(json.dumps(rows))
    assert loaded.context == {"deltas": [0.05], "prefixes": [60, None], "shuffles": 2, "pairs_seeds": [0, 1],
                              "warmup": 100, "classify": True, "target_ratio": 1.25, "judge_budget": 2.0,
                              "prior": "fitted without the measured stream "
                                       "(bench/data/semantic_priors/without_<stream>.json)"}
