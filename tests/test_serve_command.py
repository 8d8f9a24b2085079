"""`evocache serve` as a user runs it: the installed command, from the repository root, serving the example
tiny Llama; answered with the official openai client (streaming), driven with `evocache policy`, stopped with
SIGTERM. Then, serving a plain function (light on Ray): SIGTERM from a supervisor stops it as Ctrl-C does,
`evocache policy apply` refuses what its replicas cannot enforce, and a malformed API-key file is refused
before Ray starts."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from _helpers import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
EVOCACHE = Path(sys.executable).with_name("evocache")


def _read_until(proc: subprocess.Popen, pattern: str, timeout: float) -> str:
    """The process's output up to ``pattern``, read from its pipe directly (a buffered reader would hold lines
    that select() cannot see)."""
    seen = b""
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            data = os.read(fd, 65536)
            if not data:
                break
            seen += data
            if re.search(pattern, seen.decode(errors="replace")):
                return seen.decode(errors="replace")
        elif proc.poll() is not None:
            break
    raise AssertionError(f"no {pattern!r} within {timeout}s; output:\n{seen.decode(errors='replace')}")


def test_evocache_serve_answers_the_openai_client_and_follows_policy_commands(tmp_path):
    port = free_port()
    store = tmp_path / "policies"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [str(EVOCACHE), "serve", "--port", str(port), "--workdir", str(tmp_path / "serve"), "--store", str(store)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        banner = _read_until(proc, r"Ctrl-C stops", timeout=180)
        assert f"http://127.0.0.1:{port}/v1" in banner and "policy serve-example@1" in banner
        key = re.search(r"sk-evc-[A-Za-z0-9_-]+", banner).group(0)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=60)
        pieces = [chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
            model="tiny-llama", temperature=0, max_tokens=8, stream=True,
            messages=[{"role": "user", "content": "Hello there"}]) if chunk.choices]
        assert "".join(pieces)
        again = client.chat.completions.with_raw_response.create(
            model="tiny-llama", temperature=0, max_tokens=8, messages=[{"role": "user", "content": "Hello there"}])
        assert again.headers["x-evocache-outcome"] == "hit"
        assert again.parse().choices[0].message.content == "".join(pieces)

        # /metrics answers the admin key generated beside the API keys (owner-only), not an API key.
        admin_key = tmp_path / "serve" / "metrics-key"
        assert admin_key.stat().st_mode & 0o077 == 0
        metrics = f"http://127.0.0.1:{port}/metrics"
        admin = {"Authorization": f"Bearer {admin_key.read_text().strip()}"}
        assert "evocache_http_requests_total" in httpx.get(metrics, headers=admin).text
        assert httpx.get(metrics, headers={"Authorization": f"Bearer {key}"}).status_code == 403

        system = {"role": "system", "content": "You answer questions about caching, briefly and exactly. " * 5}
        usages = [client.chat.completions.create(
            model="tiny-llama", temperature=0, max_tokens=4,
            messages=[system, {"role": "user", "content": question}]).usage
            for question in ("what is an eviction?", "what is a tier?")]
        assert usages[0].prompt_tokens_details.cached_tokens == 0
        cached = usages[1].prompt_tokens_details.cached_tokens  # the shared system prompt's full blocks
        assert 32 <= cached < usages[1].prompt_tokens and cached % 16 == 0

        newer = tmp_path / "serve-v2.yaml"
        newer.write_text((ROOT / "examples/policies/serve.yaml").read_text().replace("version: 1", "version: 2"))
        applied = subprocess.run([str(EVOCACHE), "policy", "apply", str(newer), "--store", str(store)],
                                 env=env, capture_output=True, text=True, timeout=60)
        assert applied.returncode == 0, applied.stderr
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            status = subprocess.run([str(EVOCACHE), "policy", "status", "--store", str(store)], env=env,
                                    capture_output=True, text=True, timeout=60).stdout
            replicas = [ln for ln in status.splitlines() if " serve-example@2 ok at " in ln]
            if len(replicas) >= 2:  # the model replica and the ingress
                break
            time.sleep(0.3)
        assert len(replicas) >= 2, status
        r = client.completions.with_raw_response.create(model="tiny-llama", prompt="after", temperature=0,
                                                        max_tokens=4)
        assert r.headers["x-evocache-policy"] == "serve-example@2"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise


# -- a plain function behind `evocache serve` ----------------------------------------------------------------

PYTHON = [sys.executable, "-m", "evocache.cli"]
ECHO = ["--callable", "_serving_fixtures:echo_model", "--model-id", "echo", "--tokenizer", "bytes"]


def _env() -> dict[str, str]:
    """The CLI's environment: offline, and the tests' folder importable by Ray's workers (the echo model)."""
    path = os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": path}


def _serve_echo(tmp_path: Path, *options: str) -> subprocess.Popen:
    return subprocess.Popen(
        [*PYTHON, "serve", *ECHO, "--port", str(free_port()), "--workdir", str(tmp_path / "serve"), *options],
        cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    def running(p: psutil.Process) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
    return [p for p in processes if running(p)]


def _wait_until_gone(processes: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while _alive(processes) and time.monotonic() < deadline:
        time.sleep(0.2)
    return _alive(processes)


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[int | None, str]:
    """Wait up to ``timeout`` for ``proc`` to exit, reading its output meanwhile (so it never blocks on a full
    pipe); its exit status (None if it did not exit) and what it wrote."""
    seen = b""
    fd = proc.stdout.fileno()
    os.set_blocking(fd, False)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        exited = proc.poll() is not None
        ready, _, _ = select.select([fd], [], [], 0.2)
        data = os.read(fd, 65536) if ready else b""
        seen += data
        if exited and not data:
            break
    return proc.poll(), seen.decode(errors="replace")


def _stop(proc: subprocess.Popen, family: list[psutil.Process]) -> None:
    """Whatever a failed test left running: the command and what it started."""
    for p in _alive([psutil.Process(proc.pid)] if proc.poll() is None else []) + _alive(family):
        p.kill()
    proc.wait(timeout=30)


def test_sigterm_stops_serve_as_ctrl_c_does_and_leaves_no_process(tmp_path):
    proc = _serve_echo(tmp_path, "--store", str(tmp_path / "policies"))
    family: list[psutil.Process] = []
    try:
        _read_until(proc, r"Ctrl-C stops", timeout=180)
        family = psutil.Process(proc.pid).children(recursive=True)
        assert {"raylet", "gcs_server"} <= {p.name() for p in family}
        proc.send_signal(signal.SIGTERM)
        code, output = _finish(proc, timeout=120)
        assert code == 0, output
        assert "SIGTERM received" not in output  # Ray's fatal-signal dump
        assert [(p.pid, p.name()) for p in _wait_until_gone(family, timeout=60)] == []
    finally:
        _stop(proc, family)


def test_policy_apply_refuses_what_the_serving_replicas_cannot_enforce(tmp_path, redis_url):
    proc = _serve_echo(tmp_path, "--redis", redis_url)
    family: list[psutil.Process] = []
    try:
        _read_until(proc, r"Ctrl-C stops", timeout=180)
        family = psutil.Process(proc.pid).children(recursive=True)
        shared = tmp_path / "shared-l2.yaml"  # a share of L2 for the default tenant: needs l2_bytes
        shared.write_text((ROOT / "examples/policies/serve.yaml").read_text()
                          .replace("version: 1", "version: 2")
                          .replace("default: {l1_share: 1.0}", "default: {l1_share: 1.0, l2_share: 0.5}"))

        def policy(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([*PYTHON, "policy", *args, "--redis", redis_url], env=_env(),
                                  capture_output=True, text=True, timeout=60)

        applied = policy("apply", str(shared))
        assert applied.returncode == 2 and applied.stdout == "", applied
        refusal = re.fullmatch(
            r"error: policy serve-example@2: replica (\S+) \(tiers l1, l2, l3; l2_bytes none\) cannot "
            r"enforce it: tenants \['default'\] set l2_share, but the store has no l2_bytes to share "
            r"\(RedisConfig\.l2_bytes: evocache's part of Redis memory\)\n", applied.stderr)
        assert refusal, applied.stderr
        status = policy("status")
        assert status.returncode == 0, status.stderr
        lines = status.stdout.splitlines()
        assert lines[:3] == ["active: serve-example@1", "canary: none", "shadow: none"]
        replicas = lines[lines.index("replicas:") + 1:]  # the current ones, and nothing after them
        names = [line.split()[0] for line in replicas]
        ingress = [name for name in names if name.startswith("ingress:")]
        # One model replica and the ingress, which enforces the policy on the hits it serves: either may be
        # the replica the refusal names.
        assert names == sorted(names) and len(names) == 2 and len(ingress) == 1, replicas
        assert refusal.group(1) in names, (refusal.group(1), replicas)
        runs = {re.search(r" serve-example@1 ok at \S+Z \(run (\w+)", line).group(1) for line in replicas}
        assert len(runs) == 1, replicas
    finally:
        proc.send_signal(signal.SIGTERM)
        _finish(proc, timeout=120)
        _stop(proc, family)


@pytest.mark.parametrize(("text", "where"), [
    ("keys:\n  - key: sk-one\n    tenant: acme\n  - key: sk-two\n    tenant: [globex\n",
     r":6:1: not valid YAML or JSON: while parsing a flow sequence; "
     r"expected ',' or '\]', but got '<stream end>'"),
    ("keys:\n  - key: sk-one\n    tenant: acme\n  - key: sk-two\n    tier: pro\n",
     r":4: keys\.1\.tenant: Field required"),
    ("keys: []\n", r": lists no key; a server no key can use serves nobody"),
])
def test_a_malformed_key_file_is_refused_before_ray_starts(tmp_path, text, where):
    keys = tmp_path / "keys.yaml"
    keys.write_text(text)
    keys.chmod(0o600)
    store = tmp_path / "policies"
    result = subprocess.run(
        [*PYTHON, "serve", *ECHO, "--keys", str(keys), "--store", str(store),
         "--workdir", str(tmp_path / "serve")],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout) == (2, ""), result
    assert re.fullmatch(f"error: --keys: {re.escape(str(keys))}{where}\n", result.stderr), result.stderr
    assert not store.exists()  # refused before the policy was applied, and before Ray
