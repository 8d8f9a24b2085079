"""`evocache bench semantic`: replay a labelled prompt stream (or a pair set) through the semantic cache.

Exit codes: 0 success; 1 a malformed data file (``file:line: message``) or an embedder that fails; 2 a bad
option or a file that cannot be read or written (outputs are checked before the work). Errors go to stderr;
stdout holds the table.
Nothing heavy is imported at module level: `evocache` starts fast whatever command it runs.
"""

from __future__ import annotations

import enum
import json
import math
import random
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..cli_errors import EXIT_FAILED, EXIT_USAGE
from ..cli_errors import error as _error
from ..cli_errors import usage as _usage
from ..cli_errors import writable as _writable
from ._config import DEFAULT_JUDGE_BUDGET

if TYPE_CHECKING:
    from ._bench import VectorTable
    from ._embed import Embedder


PAIR_THRESHOLDS = (0.8, 0.85, 0.9, 0.95)  # static thresholds the pair report compares against


class Mode(enum.StrEnum):
    """``--mode``: how the semantic cache decides a hit."""

    bounded = "bounded"
    static = "static"


def _make_embedder(spec: str) -> Embedder:
    """``minilm`` (the packaged all-MiniLM-L6-v2) or ``openai:MODEL@BASE_URL`` (key from OPENAI_API_KEY), as an
    ``EmbedderConfig`` builds it for the store."""
    from pydantic import ValidationError

    from ..errors import EmbeddingError
    from ._config import EmbedderConfig

    model, at, url = spec.removeprefix("openai:").partition("@")
    if spec == "minilm":
        config = EmbedderConfig(kind="minilm")
    elif spec.startswith("openai:") and at:
        try:
            config = EmbedderConfig(kind="openai", model=model, url=url)
        except ValidationError as exc:
            raise _usage("--embedder", exc.errors()[0]["msg"].removeprefix("Value error, ")) from None
    else:
        raise _usage("--embedder", f"expected minilm or openai:MODEL@BASE_URL, got {spec!r}")
    try:
        return config.build()
    except ValueError as exc:
        raise _usage("--embedder", str(exc)) from None
    except EmbeddingError as exc:
        raise _error(f"error: --embedder: {exc}", EXIT_FAILED) from None


def semantic(
    data: Annotated[
        Path, typer.Option("--data", metavar="FILE.jsonl", help='A stream {"prompt", "group"} or pairs {"a", "b", '
                           '"same_answer", "category"}.')
    ],
    delta: Annotated[float, typer.Option("--delta", help="The error bound (a rule's semantic max_error), in "
                                         "(0, 0.5].")] = 0.02,
    json_out: Annotated[
        Path | None, typer.Option("--json", metavar="OUT", help="Write the report here, as JSON.")
    ] = None,
    embedder_spec: Annotated[
        str, typer.Option("--embedder", help="minilm, or openai:MODEL@BASE_URL (key from OPENAI_API_KEY).")
    ] = "minilm",
    seed: Annotated[int, typer.Option("--seed", help="Seeds the exploration draws (and --shuffle).")] = 0,
    shuffle: Annotated[bool, typer.Option("--shuffle", help="Replay the stream in an order shuffled by --seed.")] = False,
    explore: Annotated[float, typer.Option("--explore", help="Fraction of would-be hits that call the model "
                                           "anyway, to check the answer.")] = 0.05,
    mode: Annotated[Mode, typer.Option("--mode", help="bounded: serve a neighbour while the estimated error stays "
                                       "within --delta; static: serve any neighbour at least --threshold "
                                       "similar.")] = Mode.bounded,
    threshold: Annotated[
        float | None, typer.Option("--threshold", help="The cosine threshold of --mode static.")
    ] = None,
    warmup: Annotated[
        Path | None, typer.Option("--warmup", metavar="FILE.jsonl", help="Pairs: a stream replayed first (in its "
                                  "own scope) so the error model starts warm.")
    ] = None,
    embed_cache: Annotated[
        Path | None, typer.Option("--embed-cache", metavar="DIR", help="Keep embeddings here between runs "
                                  "(keyed by embedder and texts), e.g. .evocache/embeddings.")
    ] = None,
    classify: Annotated[
        bool, typer.Option("--classify/--no-classify", help="Learn, per scope, which answer cluster a prompt "
                           "belongs to from the answers the judge linked, and use it in the error estimate.")
    ] = True,
    judge_budget: Annotated[
        str, typer.Option("--judge-budget", metavar="CALLS", help="Judge calls per lookup on average (>= 1), or "
                          "none for no bound.")
    ] = f"{DEFAULT_JUDGE_BUDGET:g}",
) -> None:
    """Replay a labelled stream through the semantic cache and report hit and error rates against the best
    static threshold chosen in hindsight.

    Stream: every prompt is looked up in order; a miss (or an exploration) inserts it, and its group (the
    stand-in for the model's answer) reaches the cache only through the judge. Exact duplicates are exact
    hits, counted as hits by evocache and by the static baselines alike. Error rate = wrong served hits /
    queries. Pairs: store a, look up b (pairs shuffled by --seed, in one scope); hits and traps served per
    category, for evocache and for static thresholds.
    """
    _bench(data, delta, json_out, embedder_spec, seed, shuffle, explore, mode, threshold, warmup, embed_cache,
           classify, _judge_budget(judge_budget))


def _judge_budget(text: str) -> float | None:
    """``--judge-budget``: a number >= 1, or ``none``."""
    if text.strip().lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 1):
        raise _usage("--judge-budget", f"expected judge calls per lookup >= 1, or none; got {text!r}")
    return value


def _bench(data: Path, delta: float, json_out: Path | None, embedder_spec: str, seed: int, shuffle: bool,
           explore: float, mode: Mode, threshold: float | None, warmup: Path | None, embed_cache: Path | None,
           classify: bool = True, judge_budget: float | None = DEFAULT_JUDGE_BUDGET) -> None:
    if not (math.isfinite(delta) and 0 < delta <= 0.5):
        raise _usage("--delta", f"expected a number in (0, 0.5], got {delta}")
    if not 0 <= explore < 1:
        raise _usage("--explore", f"expected a fraction in [0, 1), got {explore}")
    if mode is Mode.static and (threshold is None or not 0 < threshold <= 1):
        raise _usage("--threshold", "--mode static needs a threshold in (0, 1]")
    if mode is not Mode.static and threshold is not None:
        raise _usage("--threshold", "applies only to --mode static (bounded learns its own cut-off)")
    # Before the replay: a run of minutes must not end on an output it cannot write.
    _writable("--json", json_out)
    _writable("--embed-cache", embed_cache, directory=True)
    from ._bench import PairRow, StreamRow

    rows = _read(data)
    warm: list[StreamRow] = []
    if warmup is not None:
        warm_rows = _read(warmup, "--warmup")
        if not isinstance(warm_rows[0], StreamRow):
            raise _usage("--warmup", f"{warmup} is a pair set; --warmup takes a stream")
        warm = warm_rows  # type: ignore[assignment]
    embedder = _make_embedder(embedder_spec)
    if isinstance(rows[0], PairRow):
        report = _pairs(rows, warm, embedder, embed_cache, delta, seed, explore, mode.value, threshold,  # type: ignore[arg-type]
                        classify, judge_budget)
    else:
        if shuffle:
            rows = list(rows)
            random.Random(seed).shuffle(rows)
        report = _stream(rows, embedder, embed_cache, delta, seed, explore, mode.value, threshold,  # type: ignore[arg-type]
                         classify, judge_budget)
    report = {"data": str(data), "delta": delta, "seed": seed, "shuffled": shuffle, "embedder": embedder.name,
              "mode": mode.value, "classify": classify, "judge_budget": judge_budget, **report}
    if json_out is not None:
        try:
            json_out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        except OSError as exc:
            raise _error(f"error: --json: {json_out}: {exc.strerror or exc}", EXIT_USAGE) from None


def _read(path: Path, option: str | None = None) -> list[Any]:
    """The rows of ``path``; a file that cannot be read is named with ``option`` when given (``--warmup``:
    beside ``--data``, a bare path would leave the reader guessing which file it was)."""
    from ..errors import TraceError
    from ._bench import read_rows

    named = f"{option}: {path}" if option else str(path)
    try:
        return read_rows(path)
    except TraceError as exc:
        raise _error(str(exc), EXIT_FAILED) from None
    except UnicodeDecodeError:
        raise _error(f"error: {named}: not UTF-8 text", EXIT_FAILED) from None
    except OSError as exc:
        raise _error(f"error: {named}: {exc.strerror or exc}", EXIT_USAGE) from None


def _table(texts: list[str], embedder: Embedder, embed_cache: Path | None) -> VectorTable:
    from ..errors import EmbeddingError
    from ._bench import VectorTable, embed_cached

    unique = list(dict.fromkeys(texts))
    try:
        vecs = embed_cached(unique, embedder, embed_cache)
    except EmbeddingError as exc:
        raise _error(f"error: --embedder: {exc}", EXIT_FAILED) from None
    except OSError as exc:
        raise _error(f"error: --embed-cache: {embed_cache}: {exc.strerror or exc}", EXIT_USAGE) from None
    return VectorTable(unique, vecs, embedder.name)


def _stream(rows: list[Any], embedder: Embedder, embed_cache: Path | None, delta: float, seed: int,
            explore: float, mode: str, threshold: float | None, classify: bool = True,
            judge_budget: float | None = DEFAULT_JUDGE_BUDGET) -> dict[str, Any]:
    from ._bench import best_static, oracle_hit_rate, replay_stream

    table = _table([r.prompt for r in rows], embedder, embed_cache)
    evocache = replay_stream(rows, table, delta, seed=seed, mode=mode, explore=explore, threshold=threshold,
                             classify=classify, judge_budget=judge_budget)
    static = best_static(rows, table.embed([r.prompt for r in rows]), [delta])[delta]
    n = len(rows)
    report = {
        "n": n,
        "oracle_hit_rate": oracle_hit_rate(rows),
        "evocache": evocache,
        "best_static": static,
        "ratio": evocache["hit_rate"] / static["hit_rate"] if static["hit_rate"] else None,
    }
    ratio = f"{report['ratio']:.2f}x" if report["ratio"] is not None else "n/a"
    typer.echo(f"{n} queries, delta {delta:g}, oracle hit rate {report['oracle_hit_rate']:.4f}")
    typer.echo(f"{'':<12} {'hit rate':>9} {'error rate':>11} {'threshold':>10} {'explore':>8} {'judge':>7}")
    # bounded mode learns its cut-off as it goes; static mode serves at the threshold it was given
    cutoff = f"{threshold:.3f}" if mode == "static" and threshold is not None else "learnt"
    typer.echo(f"{'evocache':<12} {evocache['hit_rate']:>9.4f} {evocache['error_rate']:>11.4f} {cutoff:>10} "
               f"{evocache['exploration_calls']:>8} {evocache['judge_calls']:>7}")
    static_t = "none" if static["threshold"] is None else f"{static['threshold']:.3f}"
    typer.echo(f"{'best static':<12} {static['hit_rate']:>9.4f} {static['error_rate']:>11.4f} {static_t:>10}")
    typer.echo(f"hit rate ratio {ratio}; exact hits {evocache['exact_hits']} (counted as hits by both)")
    return report


def _pairs(pairs: list[Any], warm: list[Any], embedder: Embedder, embed_cache: Path | None, delta: float,
           seed: int, explore: float, mode: str, threshold: float | None, classify: bool = True,
           judge_budget: float | None = DEFAULT_JUDGE_BUDGET) -> dict[str, Any]:
    from ._bench import replay_pairs

    texts = [t for p in pairs for t in (p.a, p.b)] + [r.prompt for r in warm]
    table = _table(texts, embedder, embed_cache)
    evocache = replay_pairs(pairs, table, delta, seed=seed, warmup=warm, mode=mode, explore=explore,
                            threshold=threshold, classify=classify, judge_budget=judge_budget)
    static = {
        f"{t:g}": replay_pairs(pairs, table, delta, seed=seed, mode="static", threshold=t)["categories"]
        for t in PAIR_THRESHOLDS
    }
    typer.echo(f"{len(pairs)} pairs, delta {delta:g}: b served (hits) and traps served, per category")
    header = f"{'category':<14} {'pairs':>5} {'evocache':>9} {'traps':>6}"
    header += "".join(f" {'static ' + t:>12}" for t in static)
    typer.echo(header)
    for name, c in evocache["categories"].items():
        line = f"{name:<14} {c['pairs']:>5} {c['hits']:>9} {c['traps_served']:>6}"
        line += "".join(f" {cats[name]['hits']:>12}" for cats in static.values())
        typer.echo(line)
    typer.echo(f"error per lookup in the pairs' scope (a and b): {evocache['error_rate']:.4f} "
               f"of {evocache['lookups']} lookups")
    return {"n": len(pairs), "warmup": len(warm), "evocache": evocache, "static": static}


def _reflow(doc: str) -> str:
    # rich's --help keeps every line break of a docstring; one line per paragraph lets it wrap to the terminal.
    import inspect

    return "\n\n".join(" ".join(paragraph.split()) for paragraph in inspect.cleandoc(doc).split("\n\n"))


semantic.__doc__ = _reflow(semantic.__doc__ or "")
