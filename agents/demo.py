"""``evocache demo``: the whole loop on a local Ray Serve deployment, from the shipped data, to
``report.html``.

What runs, all under ``--workdir`` (default ``.evocache/demo``, emptied first):

1. The serving application of ``evocache serve`` on a local Ray: the example tiny Llama (random weights from
   ``examples/tiny-llama``, the packaged WordPiece tokenizer) with its KV prefix cache, L1 only (sized with
   ``--l1-kib`` so that what one tenant stores can push out another's), access events to ``events.jsonl``, and
   a policy store that the replica follows. Three API keys, one per tenant: ``acme`` and ``globex`` (tier
   ``pro``) and ``batchco`` (tier ``batch``); the tenant comes from the key, never from the body. The agents
   room never imports serving: the `evocache` command hands ``run_demo`` the deployment (``DemoDeployment``,
   ``evocache.cli``), and this module says where its parts go (``DemoSite``).
2. A workload with a drift in the middle, sent through the official ``openai`` client over HTTP:

   - phase A: tenant ``acme``. Completions whose prompts follow the Mooncake trace's prefix structure (each of
     a request's first hash ids becomes a block of words, so requests that share leading hash ids share
     leading tokens and their KV blocks), and chat questions from Banking77 drawn with Zipf popularity, so
     questions and their paraphrases come back (the ``faq`` rule serves them semantically);
   - phase B: the prompts and tenants shift. ``globex`` sends the rest of the trace re-hashed (another system
     prompt: nothing of phase A is reused) and CLINC150 questions; ``batchco`` sends one-off long documents
     that are never asked for again, and whose answers push the others' entries out of L1.
3. The loop (``LiveLoop``) reads the events after each window, diagnoses it (the drift shows in the traffic
   mix and the keys), proposes a diff judged by replay of the windows it saw, approves it within the policy's
   guardrails (or, with ``--interactive``, waits until a person runs ``evocache proposals approve``), puts it
   on the canary and promotes it. Later a proposal meant to hurt (every ttl cut to one second) is injected,
   approved against its evidence; the canary catches it and rolls it back.
4. ``report.html`` (``agents._report``): hit ratio per window with the policy versions, the drift and
   Granger findings with their plots, the latency histogram, the KV hits by token position, the diff that was
   promoted.

The demo policy is ``DEMO_POLICY``; the data are the repository's ``bench/data`` and ``examples/data`` files
(their provenance in the READMEs there).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ._live import LiveLoop, default_signals

if TYPE_CHECKING:
    from evocache.controller import PolicyStore

DEMO_POLICY = """\
# The policy evocache demo starts with. Rules are tried in order; the first whose `when` holds decides.
policy: evocache-demo
version: 1
fields: {endpoint: str}
defaults:
  ttl: 1h
  tiers: [l1]
  kv: {reuse: prefix, min_tokens: 16}
rules:
  - name: sampled
    when: temperature > 0
    cache: bypass
  - name: batch
    when: tenant.tier == "batch"
  - name: faq
    when: endpoint == "chat"
    semantic: {max_error: 0.02}
  - name: prompts
    when: 'true'
slo: {max_error_rate: 0.02}
guardrails:
  auto_approve: {ttl_change: 0.2, bypass: true, eviction: true, tenant_share_change: 0.9}
  canary: {fraction: 0.25, windows: 1, max_windows: 3, min_requests: 30}
"""

MARKER = ".evocache-demo"
TENANTS = (("acme", "pro"), ("globex", "pro"), ("batchco", "batch"))
MODEL_ID = "tiny-llama"
BLOCK_WORDS = 16  # words per trace block: one WordPiece token each, so a block of words is one KV block
PREFIX_BLOCKS = 6  # a request's leading trace blocks that become its prompt


@dataclass(frozen=True, slots=True)
class DemoOptions:
    """``windows`` of ``per_window`` requests each, the drift after ``drift_at`` windows; ``harmful_at`` the
    window from which the harmful proposal is injected, once no other change is on its way out (None: four
    windows after the drift, or four before the end, whichever is later); ``l1_kib`` the replica's L1;
    ``clients`` concurrent HTTP clients."""

    workdir: Path = Path(".evocache/demo")
    root: Path = Path(".")
    windows: int = 14
    per_window: int = 200
    drift_at: int = 5
    harmful_at: int | None = None
    l1_kib: int = 12
    clients: int = 6
    interactive: bool = False
    seed: int = 0
    port: int | None = None


@dataclass(frozen=True, slots=True)
class DemoSite:
    """What the demo's deployment serves and where its parts go, all chosen by the demo: the model folder, the
    API-key file (``tenants``: (tenant, tier) pairs, one key each), the access-event file the loop reads, the
    policy store the replica follows (polled every ``poll_interval_s``), the folder of the loop's retrained
    models, L1's size and the HTTP port on 127.0.0.1."""

    model: Path
    model_id: str
    max_tokens: int
    keys_file: Path
    tenants: tuple[tuple[str, str], ...]
    events: Path
    policies: Path
    poll_interval_s: float
    models: Path
    l1_bytes: int
    port: int


class DemoDeployment(Protocol):
    """The serving side of the demo, which the `evocache` command hands in."""

    def token_count(self, text: str) -> int:
        """How many tokens the replica's tokenizer makes of ``text``."""
        ...

    def serve(self, site: DemoSite) -> AbstractContextManager[dict[str, str]]:
        """Write one fresh API key per tenant of ``site`` (the file holds their digests only), start the
        replica on ``site.port`` following ``site.policies``; the context yields tenant -> key and stops
        serving on exit."""
        ...


@dataclass(frozen=True, slots=True)
class DemoRequest:
    tenant: str
    endpoint: str  # "completions" or "chat"
    text: str
    phase: str


@dataclass
class Served:
    """What the client saw of one window: latencies, KV usage, the cache's headers."""

    latencies_ms: list[float] = field(default_factory=list)
    kv: list[tuple[int, int]] = field(default_factory=list)  # (prompt tokens, cached tokens) per completion
    outcomes: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


# -- the workload -------------------------------------------------------------------------------------------


def _vocabulary(root: Path, token_count: Callable[[str], int]) -> list[str]:
    """Single-token words for the trace's blocks: Banking77's words that the replica's WordPiece tokenizer
    keeps whole."""
    words: set[str] = set()
    for line in _jsonl(root / "examples/data/banking77_train.jsonl"):
        words.update(re.findall(r"[a-z]{3,}", line["prompt"].lower()))
    single = sorted(w for w in words if token_count(w) == 1)
    if len(single) < 100:
        raise ValueError(f"only {len(single)} single-token words found for the demo's blocks")
    return single


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: the demo reads the repository's shipped data; run it from the "
            f"repository root or give --root"
        )
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _block(vocab: Sequence[str], salt: str, hash_id: int) -> str:
    rng = random.Random(hashlib.blake2b(f"{salt}:{hash_id}".encode(), digest_size=8).digest())
    return " ".join(rng.choice(vocab) for _ in range(BLOCK_WORDS))


def build_workload(
    root: Path, options: DemoOptions, token_count: Callable[[str], int]
) -> list[list[DemoRequest]]:
    """The demo's windows of requests (see the module docstring), the same for the same seed;
    ``token_count`` is the replica's tokenizer's (``DemoDeployment.token_count``)."""
    rng = random.Random(options.seed)
    vocab = _vocabulary(root, token_count)
    trace = _jsonl(root / "bench/data/mooncake_synthetic_trace.jsonl")
    banking = _jsonl(root / "examples/data/banking77_train.jsonl")
    clinc = _jsonl(root / "bench/data/clinc150_train.jsonl")

    def zipf(rows: list[dict[str, Any]], popular: int = 150) -> Callable[[], str]:
        pool = [r["prompt"] for r in rows[:popular]]
        weights = [1.0 / (rank + 1) ** 1.1 for rank in range(len(pool))]
        return lambda: rng.choices(pool, weights=weights)[0]

    def prompts(rows: list[dict[str, Any]], salt: str) -> Callable[[], str]:
        it = iter(rows)
        return lambda: " ".join(_block(vocab, salt, h) for h in next(it)["hash_ids"][:PREFIX_BLOCKS])

    half = len(trace) // 2
    a_prompt, b_prompt = prompts(trace[:half], "phase-a"), prompts(trace[half:], "phase-b")
    a_faq, b_faq = zipf(banking), zipf(clinc)
    out = []
    for w in range(options.windows):
        window = []
        for i in range(options.per_window):
            if w < options.drift_at:
                if rng.random() < 0.55:
                    window.append(DemoRequest("acme", "completions", a_prompt(), "A"))
                else:
                    window.append(DemoRequest("acme", "chat", a_faq(), "A"))
            else:
                u = rng.random()
                if u < 0.35:
                    window.append(DemoRequest("globex", "completions", b_prompt(), "B"))
                elif u < 0.65:
                    window.append(DemoRequest("globex", "chat", b_faq(), "B"))
                else:
                    doc = " ".join(_block(vocab, f"doc-{w}-{i}", j) for j in range(8))
                    window.append(DemoRequest("batchco", "completions", doc, "B"))
        out.append(window)
    return out


# -- the deployment ------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def demo_site(options: DemoOptions, workdir: Path, port: int) -> DemoSite:
    """Where the demo's deployment keeps its parts, under ``workdir``."""
    return DemoSite(
        model=(options.root / "examples/tiny-llama").resolve(),
        model_id=MODEL_ID,
        max_tokens=4,
        keys_file=workdir / "api-keys.yaml",
        tenants=TENANTS,
        events=workdir / "events.jsonl",
        policies=workdir / "policies",
        poll_interval_s=0.25,
        models=workdir / "models",  # the loop's retrained models
        l1_bytes=options.l1_kib * 1024,
        port=port,
    )


def wait_followed(policies: PolicyStore, timeout_s: float = 20.0) -> bool:
    """Wait until every replica reports the store's active version and canary."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = policies.state()
        reports = policies.status().replicas
        if reports and all(r.ok and r.ref == state.active and r.canary == state.canary for r in reports):
            return True
        time.sleep(0.1)
    return False


# -- sending ---------------------------------------------------------------------------------------------


def send_window(clients: dict[str, Any], window: Sequence[DemoRequest], workers: int) -> Served:
    """Send one window's requests with ``workers`` concurrent clients; what they saw."""
    served = Served()
    lock = threading.Lock()

    def one(req: DemoRequest) -> None:
        client = clients[req.tenant]
        t0 = time.perf_counter()
        try:
            if req.endpoint == "chat":
                raw = client.chat.completions.with_raw_response.create(
                    model=MODEL_ID,
                    messages=[{"role": "user", "content": req.text}],
                    max_tokens=4,
                    temperature=0,
                )
            else:
                raw = client.completions.with_raw_response.create(
                    model=MODEL_ID, prompt=req.text, max_tokens=4, temperature=0
                )
            body = raw.http_response.json()
        except Exception as exc:  # noqa: BLE001 - a failed request is reported, the demo goes on
            with lock:
                served.errors.append(f"{type(exc).__name__}: {exc}")
            return
        ms = (time.perf_counter() - t0) * 1000
        usage = body.get("usage") or {}
        cached = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
        with lock:
            served.latencies_ms.append(ms)
            outcome = raw.headers.get("x-evocache-outcome", "none")
            served.outcomes[outcome] = served.outcomes.get(outcome, 0) + 1
            if req.endpoint == "completions" and outcome != "hit":
                served.kv.append((int(usage.get("prompt_tokens") or 0), cached))

    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(one, window))
    return served


# -- the run -------------------------------------------------------------------------------------------------


def run_demo(
    options: DemoOptions,
    deployment: DemoDeployment,
    *,
    progress: Callable[[str, int, int], None] | None = None,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the demo (module docstring) on ``deployment``; the report document, with ``report_html`` its page's
    path."""
    import openai

    from evocache.controller import FilePolicyStore
    from evocache.dsl import parse_policy

    from ._loop import LoopConfig
    from ._report import render_report
    from .signals import EventsCollector

    workdir = options.workdir.resolve()
    if workdir.exists() and any(workdir.iterdir()):
        if not (workdir / MARKER).is_file():  # never empty a folder the demo did not make
            raise ValueError(
                f"--workdir {workdir}: not empty and not a demo's folder (no {MARKER}); give a new "
                f"or empty one"
            )
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / MARKER).write_text("made by evocache demo; emptied by the next run\n")
    root = options.root.resolve()
    workload = build_workload(root, options, deployment.token_count)
    policy = parse_policy(DEMO_POLICY, "<demo policy>")
    (workdir / "policy.yaml").write_text(DEMO_POLICY)
    site = demo_site(options, workdir, options.port or _free_port())
    policies = FilePolicyStore(site.policies)
    policies.apply(policy)
    site.events.touch()

    say(f"starting a local Ray and the model replica on 127.0.0.1:{site.port} ...")
    with deployment.serve(site) as keys:
        if not wait_followed(policies, 60.0):
            raise RuntimeError("the model replica did not report the demo policy within 60 s")
        base_url = f"http://127.0.0.1:{site.port}/v1"
        clients = {
            t: openai.OpenAI(base_url=base_url, api_key=k, max_retries=0, timeout=30.0)
            for t, k in keys.items()
        }
        harmful_at = (
            options.harmful_at
            if options.harmful_at is not None
            else max(options.drift_at + 4, options.windows - 4)
        )
        loop = LiveLoop(
            EventsCollector.from_files([site.events], miss_wait_s=5.0),
            policies,
            workdir,
            window=options.per_window,
            capacity=site.l1_bytes,
            policy=policy,
            config=LoopConfig(interactive=options.interactive, seed=options.seed),
            harmful_at=harmful_at,
            model=(site.model_id, "", ""),
            signals=default_signals(),
        )
        latencies: list[float] = []
        kv_positions: list[tuple[int, int, int]] = []
        errors: list[str] = []
        try:
            for i, window in enumerate(workload):
                if progress is not None:
                    progress(f"window {i}: sending", i, len(workload))
                served = send_window(clients, window, options.clients)
                latencies += served.latencies_ms
                kv_positions += [(i, p, c) for p, c in served.kv]
                errors += served.errors
                rows = _await_window(loop)
                for row in rows:
                    say(_window_line(row))
                if options.interactive:
                    _await_reviews(loop, workdir, say)
                if not wait_followed(policies):
                    say("note: the replica had not followed the policy store within 20 s")
            report = loop.report()
        finally:
            loop.close()  # its signals too
    report["errors"] = errors[:20]
    report["requests_failed"] = len(errors)
    finding_plots = _plots_worth_showing(loop.runner.windows)
    page = render_report(
        report,
        workdir / "report",
        proposals=loop.ctx.proposals.list(),
        latencies_ms=latencies,
        kv_positions=kv_positions,
        finding_plots=finding_plots,
        title="evocache demo",
    )
    report["report_html"] = str(page)
    (workdir / "report.json").write_text(json.dumps(report, indent=1, default=str))
    return report


def _plots_worth_showing(windows: Sequence[Any], most: int = 12) -> list[str]:
    """The findings' plots for the page: one per kind and window, not-testable ones left out, drift and
    Granger
    first (the report orders them), at most ``most``."""
    seen: set[tuple[str, int]] = set()
    out = []
    for w in windows:
        for f in w.findings:
            if f.plot and f.kind != "not-testable" and (f.kind, f.window) not in seen:
                seen.add((f.kind, f.window))
                out.append(f.plot)
    order = {"mix-drift": 0, "key-drift": 1, "granger": 2, "change-point": 3}
    return sorted(out, key=lambda p: order.get(Path(p).name.rsplit("-w", 1)[0], 9))[:most]


def _await_window(loop: LiveLoop, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """Pump the loop until the window just sent is in (its events written out by the replica)."""
    deadline = time.monotonic() + timeout_s
    rows: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        rows += loop.pump()
        if rows:
            return rows
        time.sleep(0.2)
    # requests whose events never came (failed requests, a lost write): the window closes on what came
    return [row for row in [loop.flush()] if row is not None]


def _await_reviews(loop: LiveLoop, workdir: Path, say: Callable[[str], None]) -> None:
    """With ``--interactive``: while a proposal waits for a person, traffic pauses until it is decided."""
    waiting = [p for p in loop.ctx.proposals.list() if p.status == "proposed"]
    for p in waiting:
        store = workdir / "proposals.db"
        say(
            f"\nproposal {p.id} waits for a review (window {p.window}, "
            f"predicted gain {p.predicted_gain:+.4f}):\n"
            f"{p.diff}\n  evocache proposals show {p.id} --store {store}\n"
            f"  evocache proposals approve {p.id} --store {store}   (or reject)\nwaiting ..."
        )
        while loop.ctx.proposals.get(p.id).status == "proposed":
            time.sleep(0.5)
        say(f"proposal {p.id}: {loop.ctx.proposals.get(p.id).status}")


def _window_line(row: dict[str, Any]) -> str:
    kinds = sorted({f["kind"] for f in row["findings"] if f["kind"] != "not-testable"})
    canary = f", canary {row['canary']}" if row.get("canary") else ""
    return (
        f"window {row['index']:>2} {'/'.join(row.get('phases') or []):<3} {row['policy']}{canary}: "
        f"hit ratio {row['hit_ratio']:.3f}  {', '.join(kinds) or '-'}"
    )
